"""A medfl site as an NVFlare executor: :class:`MedflExecutor`.

Each NVFlare client of a medfl job runs this executor for medfl's tasks
(:data:`medfl.nvflare.transport.TASKS`). A task's data holds one medfl message (its content's
bytes, :func:`medfl.wire.encode`); the executor answers it with
:func:`medfl.site_messages.answer_message` on the site's :class:`medfl.site.Site`, exactly
as a Flower SuperNode's site does (no Flower needed): the site's
approvals and privacy policy (``MEDFL_APPROVALS`` in the NVFlare client's environment,
:mod:`medfl.approval`), its release ledger and privacy budget, the content guard on what
leaves, and the run's client state under the site's own state directory. Nothing of the site's
state is sent to the server.

What the job carries (its bundle config, ``overrides``, ``client_ids`` and ``workdir``) is the
coordinator's text: it is read as plain JSON data (:func:`medfl.config_file.plain_fl`), never by
MONAI's parser, and MONAI syntax anywhere in it is refused naming the key before anything else
runs. What the site alone chooses comes from the NVFlare client's environment, which
``medfl nvflare site`` writes (:data:`SITE_ENV`):

* ``MEDFL_APPROVALS``: the approvals file whose methods and privacy policy the site enforces; the
  executor answers nothing without one, unless the site opts out by name (``MEDFL_APPROVALS=none``).
* ``MEDFL_SITE_CONFIG``: the site's own bundle config (its data set and root; MONAI's full syntax:
  the site's own text). A job may then choose run settings only (:data:`SITE_KEYS` are the site's):
  a job whose overrides set one, or that sets ``workdir``, or whose ``client_ids`` name another
  client for this site, is refused naming the key. Without it the job's config is the site's
  (its data paths included), read as plain data.
* ``MEDFL_CLIENT_ID`` (else the job's ``client_ids``), ``MEDFL_WORKDIR`` (else the job's
  ``workdir`` at a site without its own config), ``MEDFL_DEVICE``.
* ``MEDFL_STATE_DIR``, else ``medfl_state`` in the NVFlare client's workspace: never the job's. The
  state directory holds the site's release ledger (``budget.jsonl``, what its privacy budget
  counts) and its noise key; a coordinator that could point the site at a new folder could start
  its budget from zero.
"""

from __future__ import annotations

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

from medfl import wire
from medfl.approval import APPROVALS_ENV, OPT_OUT
from medfl.config_file import PlainDataError, plain_fl, refuse_syntax
from medfl.site import Site, SiteError, SiteSettings
from medfl.site_messages import answer_message
from medfl.nvflare.transport import CONTENT, ERROR

__all__ = ["MedflExecutor", "SITE_ENV", "SITE_KEYS"]

logger = logging.getLogger(__name__)

#: the environment variables a site's operator sets on its NVFlare client (they win over the job)
SITE_ENV = {"client-id": "MEDFL_CLIENT_ID", "state-dir": "MEDFL_STATE_DIR", "config": "MEDFL_SITE_CONFIG",
            "workdir": "MEDFL_WORKDIR", "device": "MEDFL_DEVICE"}

#: the ``fl`` settings a job cannot set at a site with its own config: which data, where the site
#: reads and writes, its machine, and which plugin a dataset name resolves to
SITE_KEYS = ("dataset", "output_dir", "device", "threads", "plugin_names")


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
        self.bundle, self.overrides, self.client_ids, self.workdir = bundle, overrides or {}, client_ids or {}, workdir
        self._sites: dict[str, Site] = {}

    def settings(self, fl_ctx: FLContext) -> SiteSettings:
        """This NVFlare client's site settings (see the module docstring): the site's
        environment, and of the job only what the site lets it choose, read as plain data.

        Raises:
            SiteError: no approvals file (and no opt-out), MONAI syntax anywhere in the job, a
                site setting the job may not choose, or no client id.
        """
        name = fl_ctx.get_identity_name()
        where = f"medfl site {name!r}: the job"
        approvals = os.environ.get(APPROVALS_ENV, "").strip()
        if not approvals:
            raise SiteError(f"medfl site {name!r}: refused: no approvals file ({APPROVALS_ENV} is not set in this NVFlare "
                            f"client's environment); write the site with `medfl nvflare site --approvals FILE`, or set "
                            f"{APPROVALS_ENV}={OPT_OUT} to run any installed method the job names")
        try:
            refuse_syntax({"client_ids": self.client_ids, "workdir": self.workdir}, where)
            own = os.environ.get(SITE_ENV["config"], "")
            if own:
                refuse_syntax(self.overrides, f"{where}: overrides")
                self._site_only(name, where)
            else:
                fl = plain_fl(self.bundle or {}, self.overrides, where)
        except PlainDataError as exc:
            raise SiteError(str(exc)) from None
        cid = os.environ.get(SITE_ENV["client-id"]) or str(self.client_ids.get(name, ""))
        if not cid:
            raise SiteError(f"medfl site {name!r}: which client of the partition it serves is not known: the job's "
                            f"client_ids name {sorted(self.client_ids)}; set MEDFL_CLIENT_ID in this NVFlare client's "
                            "environment or write the job with `medfl nvflare job --sites N` for clients site-1..site-N")
        state = os.environ.get(SITE_ENV["state-dir"], "") or str(
            Path(fl_ctx.get_engine().get_workspace().get_root_dir()) / "medfl_state")
        workdir = os.environ.get(SITE_ENV["workdir"]) or self.workdir   # a job's: refused above with own config
        common = {"client_id": cid, "state_dir": Path(state).resolve(), "device": os.environ.get(SITE_ENV["device"]) or None,
                  "workdir": Path(workdir) if workdir else None}
        if own:
            return SiteSettings(config=Path(own), overrides=dict(self.overrides), **common)
        return SiteSettings(config=Path(f"<job of {name}>"), resolved=fl, **common)

    def _site_only(self, name: str, where: str) -> None:
        """Refuse what a job may not choose at a site with its own config: an override of a
        :data:`SITE_KEYS` setting (or of anything outside ``fl``), a ``workdir``, a client id
        for this site other than the site's ``MEDFL_CLIENT_ID`` (which it must then set).

        Raises:
            PlainDataError: naming the key.
        """
        for key in self.overrides:
            parts = str(key).replace("::", "#").split("#")
            if parts[0] != "fl" or len(parts) < 2 or parts[1] in SITE_KEYS:
                raise PlainDataError(f"{where}: overrides: key {key!r}: the site's own setting (this site reads its "
                                     f"own config, {SITE_ENV['config']}; a job chooses run settings only, not "
                                     f"fl.{'/'.join(SITE_KEYS)}) (refused)")
        if self.workdir:
            raise PlainDataError(f"{where}: key 'workdir' ({self.workdir!r}): where this site reads its files is its "
                                 f"own ({SITE_ENV['workdir']}) (refused)")
        cid = os.environ.get(SITE_ENV["client-id"], "")
        if not cid:
            raise PlainDataError(f"medfl site {name!r}: a site with its own config ({SITE_ENV['config']}) names the "
                                 f"client it serves itself: set {SITE_ENV['client-id']} (refused)")
        if name in self.client_ids and str(self.client_ids[name]) != cid:
            raise PlainDataError(f"{where}: key 'client_ids': names client {self.client_ids[name]!r} for this site, "
                                 f"which serves client {cid!r} ({SITE_ENV['client-id']}) (refused)")

    def site(self, fl_ctx: FLContext) -> Site:
        """This client's :class:`Site` (one per executor and NVFlare client)."""
        name = fl_ctx.get_identity_name()
        if name not in self._sites:
            self._sites[name] = Site(self.settings(fl_ctx))
        return self._sites[name]

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        """Answer one medfl message: the answer's bytes, or return code
        ``EXECUTION_EXCEPTION`` with the site's error text (a refusal by its approvals or
        policy, a method that failed, a message that cannot be read), which the coordinator
        names with the site."""
        if CONTENT not in shareable:
            return make_reply(ReturnCode.BAD_TASK_DATA)
        try:
            out = wire.encode(answer_message(self.site(fl_ctx), task_name, wire.decode(shareable[CONTENT])))
        except Exception as exc:  # noqa: BLE001 - every failure is the site's answer, with its reason
            logger.debug(traceback.format_exc())
            reply = make_reply(ReturnCode.EXECUTION_EXCEPTION)
            reply[ERROR] = f"{type(exc).__name__}: {exc}"
            return reply
        reply = Shareable()
        reply[CONTENT] = out
        return reply
