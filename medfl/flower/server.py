"""medfl's coordinator as a Flower ``ServerApp``: :data:`app` (``flwr run``; the deployment
names ``medfl.flower.server:app``) and the functions that run an experiment over a grid.

This module is the top of the coordinator's process, like the command line: it parses the
run config, reads the bundle config, runs the experiment (:mod:`medfl.experiment`) on the
``flower`` backend and prints the result. The coordinator itself, :class:`FlowerRun`, is
:mod:`medfl.flower.coordinator` (its names are importable from here too).
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import Any

from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from medfl.report import print_result
from medfl.config import resolve_config
from medfl.config_file import load_bundle_config
from medfl.experiment import resume, run_experiment
from medfl.flower.coordinator import (RUN_CONFIG, FlowerRun, FlowerSettings, SiteDirectory, SiteFailure, SteadyGrid,
                                      SuperLinkError, transient_error)
from medfl.engine.runner import RunError
from medfl.plugins import lookup

__all__ = ["FlowerSettings", "FlowerRun", "SiteDirectory", "SiteFailure", "SteadyGrid", "SuperLinkError",
           "transient_error", "run_flower_experiment", "resume_flower", "serve", "app", "RUN_CONFIG"]


# ---------------------------------------------------------------------- experiments
def run_flower_experiment(cfg: dict[str, Any], grid: Grid, settings: FlowerSettings | None = None
                          ) -> dict[str, Any]:
    """Run every method of a resolved config over Flower: :func:`medfl.experiment.run_experiment`
    on the ``flower`` backend, with :class:`FlowerRun` as its runs (same directory layout,
    ``comparison.csv``, cross-validation folds in ``fold_<k>/``; the ``config.json`` files say
    ``"engine": "flower"``)."""
    return run_experiment(cfg, backend=lookup("backend", "flower")(grid, settings))


def resume_flower(path: str | Path, grid: Grid, settings: FlowerSettings | None = None,
                  rounds: int | None = None) -> dict[str, Any]:
    """Continue a stopped Flower run, experiment or cross-validated experiment directory
    over Flower (:func:`medfl.experiment.resume` on the ``flower`` backend, with
    :class:`FlowerRun`); its sites keep their state under the run id in each run's
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
    settings = FlowerSettings.from_run_config(rc)
    if rc["resume"]:
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


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """medfl's coordinator as a Flower ServerApp (``flwr run``): reads the run config
    (:data:`RUN_CONFIG`), runs the experiment and, with ``result-file``, writes
    ``{"ok": true, "dir": ...}`` or ``{"ok": false, "error": ...}`` there."""
    from medfl.flower.flwr_launcher import outlive_superexec
    from medfl.logs import ensure_console

    ensure_console()   # the coordinator's lines on the ServerApp's stderr, as the medfl command shows them
    outlive_superexec()   # under `medfl flower superlink`, a SuperExec restarted does not end this run
    rc = dict(context.run_config)
    result_file = str(rc.get("result-file", "") or "")
    try:
        result = serve(grid, rc)
    except BaseException as exc:
        stopped = isinstance(exc, (SystemExit, KeyboardInterrupt))
        error = f"{type(exc).__name__}: {exc}"
        if stopped:
            error = ("the coordinator was stopped (a signal: the SuperLink was stopped or restarted, or Ctrl-C); "
                     "the finished rounds are saved and status.json says \"interrupted\": continue with "
                     "`medfl flower run --resume RUN_DIR` once the SuperLink is back")
        if result_file:
            Path(result_file).write_text(json.dumps({"ok": False, "error": error, "interrupted": stopped,
                                                     "traceback": traceback.format_exc()}))
        raise
    if result_file:
        Path(result_file).write_text(json.dumps({"ok": True, "dir": result["dir"]}, default=str))
