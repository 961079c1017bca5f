"""medfl's coordinator as an NVFlare controller workflow: :class:`MedflController`.

The NVFlare server runs this workflow of a medfl job (``medfl nvflare job``). Its
:meth:`~MedflController.control_flow` reads the job's bundle config and runs the experiment
(:func:`medfl.experiment.run_experiment`, or :func:`medfl.experiment.resume` of a stopped run)
on the ``nvflare`` backend, whose runs send their messages to the NVFlare clients as tasks
(:class:`medfl.nvflare.transport.NVFlareTransport`). The run directory is written on the server's machine
(``fl.output_dir``) exactly as under ``medfl run``; with ``result_file`` the outcome is also
written there as JSON (``{"ok": true, "dir": ...}`` or ``{"ok": false, "error": ...}``). A
failed or refused run ends the NVFlare job with a system panic whose reason is the error line.

Relative paths of the config (``fl.output_dir``, a data root, ``result_file``) are read at the
server from ``MEDFL_WORKDIR`` in the server's environment, else from the directory NVFlare runs
the server's job in (its workspace: ``WORKSPACE/server`` in the simulator, the server's startup
kit when provisioned). A job written by ``medfl nvflare job`` names no folder of the machine
that wrote it.

This module is the top of the server's process for medfl (as :mod:`medfl.flower.server` is
under Flower).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import traceback
from pathlib import Path
from typing import Any

from nvflare.apis.client import Client
from nvflare.apis.fl_context import FLContext
from nvflare.apis.impl.controller import Controller
from nvflare.apis.signal import Signal

from medfl.config import resolve_config
from medfl.config_file import load_bundle_config
from medfl.engine.remote_sites import RemoteSettings
from medfl.experiment import resume, run_experiment
from medfl.nvflare.transport import NVFlareTransport
from medfl.plugins import lookup
from medfl.report import print_result

__all__ = ["MedflController", "WORKDIR_ENV"]

#: where relative paths of the config are read at the server, set in its environment (as at a
#: site: :data:`medfl.nvflare.executor.SITE_ENV`)
WORKDIR_ENV = "MEDFL_WORKDIR"

logger = logging.getLogger(__name__)


class _Aborted(threading.Event):
    """The stop event of :class:`~medfl.engine.remote_sites.RemoteSettings`, set when NVFlare aborts the job."""

    def __init__(self, signal: Signal) -> None:
        super().__init__()
        self.signal = signal

    def is_set(self) -> bool:
        return bool(self.signal.triggered) or super().is_set()

    def wait(self, timeout: float | None = None) -> bool:
        step = 0.2 if timeout is None else min(0.2, max(timeout, 0.0))
        left = timeout
        while not self.is_set():
            if left is not None and left <= 0:
                return False
            super().wait(step)
            left = None if left is None else left - step
        return True


class MedflController(Controller):
    """The workflow running a medfl experiment over the job's NVFlare clients.

    Args:
        bundle: the bundle config (``{"fl": ...}``) the job carries.
        overrides: ``#``-path overrides of it.
        workdir: where relative paths of the config are read when the server's environment sets
            no ``MEDFL_WORKDIR`` (default: the directory NVFlare runs the server's job in, its
            workspace). ``medfl nvflare job`` leaves it empty: a job carries no folder of the
            machine that wrote it.
        resume: a stopped run or experiment directory (on the server's machine) to continue
            instead of starting the config's.
        rounds: with ``resume``, a new total number of rounds (0: as configured).
        result_file: where to write the outcome as JSON (""): nowhere.
        round_timeout: seconds to wait for the sites' answers to one exchange.
        connect_timeout: seconds to wait at the start for a client serving each site.
        hello_timeout: seconds to wait for the hello of a client that joined mid-run.
    """

    def __init__(self, bundle: dict[str, Any] | None = None, overrides: dict[str, Any] | None = None,
                 workdir: str = "", resume: str = "", rounds: int = 0, result_file: str = "",
                 round_timeout: float = 600.0, connect_timeout: float = 300.0, hello_timeout: float = 60.0) -> None:
        super().__init__(task_check_period=0.05)
        self.bundle = dict(bundle or {})
        self.overrides = dict(overrides or {})
        self.workdir = workdir
        self.resume = resume
        self.rounds = int(rounds)
        self.result_file = result_file
        # attributes named as the arguments: NVFlare's job API writes a component's arguments
        # from them (a dict of them wrote none, and a job ran with the default timeouts)
        self.round_timeout, self.connect_timeout = float(round_timeout), float(connect_timeout)
        self.hello_timeout = float(hello_timeout)

    def start_controller(self, fl_ctx: FLContext) -> None:
        """Nothing to start: the experiment starts in :meth:`control_flow`."""

    def stop_controller(self, fl_ctx: FLContext) -> None:
        """Cancel the tasks still standing (a stopped run's sites need not answer them)."""
        self.cancel_all_tasks(fl_ctx=fl_ctx)

    def process_result_of_unknown_task(self, client: Client, task_name: str, client_task_id: str,
                                       result: Any, fl_ctx: FLContext) -> None:
        """A late result of a task already given up (a site that timed out): ignored, as
        Flower's coordinator ignores a reply it stopped waiting for."""
        logger.info(f"medfl nvflare: late {task_name} result of {client.name} ignored")

    def experiment(self, transport: NVFlareTransport, settings: RemoteSettings) -> dict[str, Any]:
        """Run (or resume) the job's experiment on the ``nvflare`` backend over ``transport``."""
        backend = lookup("backend", "nvflare")(transport, settings)
        workdir = os.environ.get(WORKDIR_ENV) or self.workdir
        if workdir:
            os.chdir(workdir)
        if self.resume:
            return resume(self.resume, self.rounds or None, backend=backend)
        return run_experiment(self._config(), backend=backend)

    def _config(self) -> dict[str, Any]:
        """The resolved ``fl`` config of the job's bundle (with its overrides)."""
        from medfl.engine.runner import RunError

        if not self.bundle:
            raise RunError("medfl nvflare: the job's controller carries no bundle config; write the job with "
                           "`medfl nvflare job --config CONFIG --out DIR`")
        # load_bundle_config reads a file: the job's copy of it, beside the server's workspace
        path = Path(os.getcwd()) / f"medfl_{os.getpid()}_config.json"
        path.write_text(json.dumps(self.bundle))
        try:
            return resolve_config(load_bundle_config(path, self.overrides))
        finally:
            path.unlink(missing_ok=True)

    def control_flow(self, abort_signal: Signal, fl_ctx: FLContext) -> None:
        """Run the experiment; write the result file; a failure panics the job with its reason."""
        from medfl.logs import ensure_console

        ensure_console()
        settings = RemoteSettings(poll_interval=0.05, stop=_Aborted(abort_signal), round_timeout=self.round_timeout,
                                  connect_timeout=self.connect_timeout, hello_timeout=self.hello_timeout)
        try:
            result = self.experiment(NVFlareTransport(self, fl_ctx), settings)
        except BaseException as exc:  # noqa: BLE001 - said in the result file and as the job's panic
            error = f"{type(exc).__name__}: {exc}"
            self._write({"ok": False, "error": error, "traceback": traceback.format_exc()})
            self.system_panic(f"medfl: {error}", fl_ctx)
            return
        print_result(result)
        # absolute: a relative fl.output_dir is in the server's working folder, not the reader's
        self._write({"ok": True, "dir": os.path.abspath(str(result["dir"]))})

    def _write(self, outcome: dict[str, Any]) -> None:
        if self.result_file:
            Path(self.result_file).write_text(json.dumps(outcome, default=str))
