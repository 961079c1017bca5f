"""A medfl site as an NVFlare executor: :class:`MedflExecutor`.

Each NVFlare client of a medfl job runs this executor for medfl's tasks
(:data:`medfl.nvflare.grid.TASKS`). A task's data holds one medfl message (its records as
Flower's protobuf bytes); the executor answers it with :func:`medfl.flower.site.handle` on the
site's :class:`medfl.flower.site.Site`, exactly as a Flower SuperNode's site does: the site's
approvals and privacy policy (``MEDFL_APPROVALS`` in the NVFlare client's environment,
:mod:`medfl.approval`), its release ledger and privacy budget, the content guard on what
leaves, and the run's client state under the site's own state directory. Nothing of the site's
state is sent to the server.

Which client of the partition this NVFlare client serves is read from the environment of the
NVFlare client (``MEDFL_CLIENT_ID``), else the job's ``client_ids``; its config from
``MEDFL_SITE_CONFIG`` (a site's own bundle config, e.g. with its own data path), else the job's;
``MEDFL_WORKDIR`` and ``MEDFL_DEVICE`` likewise. Where the site keeps its state is the site's
alone: ``MEDFL_STATE_DIR``, else ``medfl_state`` in the NVFlare client's workspace. A job cannot
choose it: the state directory holds the site's release ledger (``budget.jsonl``, what its
privacy budget counts) and its noise key, and a coordinator that could point the site at a new
folder could start its budget from zero.
"""

from __future__ import annotations

import json
import hashlib
import logging
import os
import traceback
from pathlib import Path
from typing import Any

from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal

from medfl.flower.proxy import decode_records, encode_records
from medfl.flower.site import Site, SiteError, handle, site_for
from medfl.nvflare.grid import ERROR, RECORDS

__all__ = ["MedflExecutor", "SITE_ENV"]

logger = logging.getLogger(__name__)

#: the environment variables a site's operator sets on its NVFlare client (they win over the job)
SITE_ENV = {"client-id": "MEDFL_CLIENT_ID", "state-dir": "MEDFL_STATE_DIR", "config": "MEDFL_SITE_CONFIG",
            "workdir": "MEDFL_WORKDIR", "device": "MEDFL_DEVICE"}


class MedflExecutor(Executor):
    """medfl's site side for the tasks of a medfl job.

    Args:
        bundle: the job's bundle config (``{"fl": ...}``), used unless the site sets
            ``MEDFL_SITE_CONFIG``.
        overrides: ``#``-path overrides of the config (``{"fl#dataset#root": "/data"}``).
        client_ids: NVFlare client name -> the medfl client id it serves (``{"site-1": "0"}``).
        state_dir: refused when set: the state directory is the site's (``MEDFL_STATE_DIR``, or
            ``medfl_state`` in its workspace), never the job's.
        workdir: where relative paths of the config are read (default: the client's own).

    Raises:
        ValueError: the job sets ``state_dir``.
    """

    def __init__(self, bundle: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                 client_ids: dict[str, str] | None = None, state_dir: str = "", workdir: str = "") -> None:
        super().__init__()
        if state_dir:
            raise ValueError(f"medfl executor: the job sets state_dir={state_dir!r}; a site's state directory "
                             "holds its release ledger and is the site's to choose: set MEDFL_STATE_DIR in the "
                             "NVFlare client's environment (default: medfl_state in its workspace)")
        self.bundle = dict(bundle or {})
        self.overrides = dict(overrides or {})
        self.client_ids = {str(k): str(v) for k, v in (client_ids or {}).items()}
        self.workdir = workdir

    def node_config(self, fl_ctx: FLContext) -> dict[str, Any]:
        """The Flower-style node config of this client's site (see the module docstring).

        Raises:
            SiteError: no client id for this NVFlare client, or no bundle config.
        """
        name = fl_ctx.get_identity_name()
        cid = os.environ.get(SITE_ENV["client-id"]) or self.client_ids.get(name)
        if not cid:
            raise SiteError(f"medfl site {name!r}: which client of the partition it serves is not known: the job's "
                            f"client_ids name {sorted(self.client_ids)}; set MEDFL_CLIENT_ID in this NVFlare client's "
                            "environment or write the job with `medfl nvflare job --sites N` for clients site-1..site-N")
        state = os.environ.get(SITE_ENV["state-dir"], "")
        if not state:
            workspace = fl_ctx.get_engine().get_workspace()
            state = str(Path(workspace.get_root_dir()) / "medfl_state")
        config = os.environ.get(SITE_ENV["config"]) or self._job_config(Path(state))
        node = {"client-id": cid, "state-dir": str(Path(state).resolve()), "config": config,
                "overrides": json.dumps(self.overrides)}
        for key in ("workdir", "device"):
            value = os.environ.get(SITE_ENV[key]) or (self.workdir if key == "workdir" else "")
            if value:
                node[key] = value
        return node

    def _job_config(self, state: Path) -> str:
        """The job's bundle config as a file in the site's state directory (named by its digest)."""
        if not self.bundle:
            raise SiteError("medfl site: the job carries no bundle config and MEDFL_SITE_CONFIG is not set")
        # the keys keep their order: a config's order is part of it (``client_split``'s splits are
        # drawn in the order they are written)
        text = json.dumps(self.bundle, indent=1)
        path = state / "jobs" / f"config_{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(text)
            tmp.replace(path)
        return str(path)

    def site(self, fl_ctx: FLContext) -> Site:
        """This client's :class:`Site` (one per process and node config)."""
        return site_for(self.node_config(fl_ctx))

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        """Answer one medfl message: the reply's records, or return code
        ``EXECUTION_EXCEPTION`` with the site's error text (a refusal by its approvals or
        policy, a method that failed), which the coordinator names with the site."""
        if RECORDS not in shareable:
            return make_reply(ReturnCode.BAD_TASK_DATA)
        try:
            out = handle(self.site(fl_ctx), task_name, decode_records(shareable[RECORDS]))
        except Exception as exc:  # noqa: BLE001 - every failure is the site's answer, with its reason
            logger.debug(traceback.format_exc())
            reply = make_reply(ReturnCode.EXECUTION_EXCEPTION)
            reply[ERROR] = f"{type(exc).__name__}: {exc}"
            return reply
        reply = Shareable()
        reply[RECORDS] = encode_records(out)
        return reply
