"""medfl's coordinator as a Flower ``ServerApp``: :data:`app` (``flwr run``; the deployment
names ``medfl.flower.server:app``) and the functions that run an experiment over a grid.

This module is the top of the coordinator's process, like the command line: it parses the
run config, reads the bundle config, runs the experiment (:mod:`medfl.experiment`) on the
``flower`` backend and prints the result. The coordinator itself is
:class:`medfl.engine.remote.RemoteRun`, over :class:`medfl.flower.transport.FlowerTransport`.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from medfl.backend import resume_command
from medfl.report import print_result
from medfl.config import THREADS_ENV, check_threads, resolve_config
from medfl.config_file import load_bundle_config
from medfl.engine.remote_sites import RemoteSettings
from medfl.engine.runner import RunError
from medfl.experiment import resume, run_experiment
from medfl.flower.transport import RUN_CONFIG
from medfl.plugins import lookup

__all__ = ["run_flower_experiment", "resume_flower", "serve", "refusal", "app", "RUN_CONFIG"]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------------- experiments
def run_flower_experiment(cfg: dict[str, Any], grid: Any, settings: RemoteSettings | None = None
                          ) -> dict[str, Any]:
    """Run every method of a resolved config over Flower: :func:`medfl.experiment.run_experiment`
    on the ``flower`` backend (``grid``: the ServerApp's, or a :class:`medfl.transport.Transport`
    standing in for it), with :class:`~medfl.engine.remote.RemoteRun` as its runs (same directory layout,
    ``comparison.csv``, cross-validation folds in ``fold_<k>/``; the ``config.json`` files say
    ``"engine": "flower"``)."""
    return run_experiment(cfg, backend=lookup("backend", "flower")(grid, settings))


def resume_flower(path: str | Path, grid: Any, settings: RemoteSettings | None = None,
                  rounds: int | None = None) -> dict[str, Any]:
    """Continue a stopped Flower run, experiment or cross-validated experiment directory
    over Flower (:func:`medfl.experiment.resume` on the ``flower`` backend, with
    :class:`~medfl.engine.remote.RemoteRun`); its sites keep their state under the run id in each run's
    ``flower.json`` and roll back what they wrote after the last checkpoint."""
    return resume(path, rounds, backend=lookup("backend", "flower")(grid, settings))


# ---------------------------------------------------------------------- the ServerApp
def serve(grid: Grid, run_config: dict[str, Any]) -> dict[str, Any]:
    """The ServerApp's work: run (or resume) the configured experiment over ``grid``.

    Raises:
        RunError: the run config names no bundle config, or the run fails.
    """
    rc = {**RUN_CONFIG, **{k: v for k, v in run_config.items()}}
    if rc["workdir"]:
        os.chdir(str(rc["workdir"]))
    settings = RemoteSettings.from_run_config(rc)
    if rc["resume"]:
        with _threads(str(rc.get("threads") or "")):   # `medfl flower run --resume --threads N`
            result = resume_flower(str(rc["resume"]), grid, settings, int(rc["rounds"]) or None)
    else:
        if not rc["config"]:
            raise RunError("medfl flower: the run config names no bundle config; "
                           "use `medfl flower run CONFIG` or --run-config \"config='/abs/train.json'\"")
        overrides = json.loads(str(rc["overrides"]) or "{}")
        cfg = resolve_config(load_bundle_config(str(rc["config"]), overrides))
        result = run_flower_experiment(cfg, grid, settings)
    print_result(result)
    return result


@contextmanager
def _threads(value: str) -> Iterator[None]:
    """With ``value`` (the run config's ``threads``), the coordinator's ``--threads`` as
    ``medfl resume --threads`` gives it: ``MEDFL_THREADS`` for the ``with`` block, which wins
    over the run's saved ``fl.threads`` (:func:`medfl.config.threads_setting`)."""
    if not value:
        yield
        return
    before = os.environ.get(THREADS_ENV)
    os.environ[THREADS_ENV] = str(check_threads(value, "--threads"))
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(THREADS_ENV, None)
        else:
            os.environ[THREADS_ENV] = before


def refusal(exc: BaseException) -> str | None:
    """The ``medfl: error:`` line of ``exc`` when the coordinator refused the run's settings
    before any run started, as ``medfl run`` refuses them: the config
    (:class:`~medfl.config.ConfigError`, which a method's ``__init__`` refusal becomes, and
    plugin names, :class:`~medfl.plugins.PluginError`), a model's parameters
    (:class:`~medfl.models.registry.ModelConfigError`), or a method's refusal where it first
    sees the training settings (:class:`~medfl.method.MethodConfigError` from ``setup``: the
    run directory is removed, :meth:`medfl.engine.runner.Run.prepare`). ``None`` for anything
    else: a run that failed (kept, with its traceback in the ServerApp's log)."""
    from medfl.config import ConfigError
    from medfl.engine.checkpoints import REFUSALS

    # none of these is a KeyError, so the line is the exception's text (as medfl.bundle prints it)
    return str(exc) if isinstance(exc, (ConfigError, *REFUSALS)) else None


def _report_refusal(message: str, error: str, result_file: str) -> None:
    """Say that the run was refused (:func:`refusal`) once: in ``result_file`` (``"refused"``:
    the line ``medfl flower run`` prints as ``medfl: error: MESSAGE``, exiting 2 as ``medfl run``
    does), or, without one that can be written (a ``flwr run`` of the app by hand), on the
    ServerApp's stderr, which its log stream carries."""
    if result_file:
        try:
            Path(result_file).write_text(json.dumps({"ok": False, "error": error, "refused": message}))
            return
        except OSError:
            pass
    logger.error(f"medfl: error: {message}")


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """medfl's coordinator as a Flower ServerApp (``flwr run``): reads the run config
    (:data:`RUN_CONFIG`), runs the experiment and, with ``result-file``, writes
    ``{"ok": true, "dir": ...}`` or ``{"ok": false, "error": ...}`` there. A run refused before
    it started (:func:`refusal`: the config, a method's ``MethodConfigError``) ends the
    ServerApp without a traceback, its line in the result file's ``"refused"`` (or on stderr)."""
    from medfl.logs import ensure_console

    ensure_console()   # the coordinator's lines on the ServerApp's stderr, as the medfl command shows them
    rc = dict(context.run_config)
    result_file = str(rc.get("result-file", "") or "")
    try:
        result = serve(grid, rc)
    except BaseException as exc:
        refused = refusal(exc)
        if refused is not None:   # refused before anything ran: one line, no traceback (Flower's would follow a raise)
            _report_refusal(refused, f"{type(exc).__name__}: {exc}", result_file)
            return
        stopped = isinstance(exc, (SystemExit, KeyboardInterrupt))
        error = f"{type(exc).__name__}: {exc}"
        if stopped:
            # a new run's directory is named by the coordinator's own line ("interrupted; ... continue with: ...")
            error = ("the coordinator was stopped (a signal: the SuperLink was stopped or restarted, or Ctrl-C); "
                     "the finished rounds are saved and status.json says \"interrupted\": continue with "
                     f"`{resume_command(str(rc['resume'])) if rc.get('resume') else 'medfl flower run --resume RUN_DIR'}`"
                     " once the SuperLink is back")
        if result_file:
            Path(result_file).write_text(json.dumps({"ok": False, "error": error, "interrupted": stopped,
                                                     "traceback": traceback.format_exc()}))
        raise
    if result_file:
        Path(result_file).write_text(json.dumps({"ok": True, "dir": result["dir"]}, default=str))
