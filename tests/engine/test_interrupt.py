"""Ctrl-C during a run (issue 19): the run says what was saved and how to resume,
status.json says "interrupted" (never "running"), the CLI exits 130 without a traceback, and
``medfl resume`` then ends with the uninterrupted run's numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from medfl.cli import main
from medfl.config import resolve_config
from medfl.engine.runner import Run
from medfl.experiment import resume, run_experiment


def _interrupt_at(monkeypatch: pytest.MonkeyPatch, at: int, signal: BaseException | None = None) -> None:
    real = Run.run_round

    def run_round(self, r, pm):  # type: ignore[no-untyped-def]
        if r == at:
            raise signal if signal is not None else KeyboardInterrupt
        return real(self, r, pm)

    monkeypatch.setattr(Run, "run_round", run_round)


def test_ctrl_c_leaves_an_interrupted_run_that_resumes_exactly(tiny_fl, tmp_path, monkeypatch, capsys):
    tiny_fl.update(rounds=3)
    full = run_experiment(resolve_config(dict(tiny_fl, name="full")))
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"fl": dict(tiny_fl, name="cut")}))
    _interrupt_at(monkeypatch, 3)
    assert main(["run", str(cfg)]) == 130
    err = capsys.readouterr().err
    exp = Path(tiny_fl["output_dir"]) / "cut"
    assert "Traceback" not in err and "interrupted; rounds 1-2 are saved" in err
    assert f"medfl resume {exp}" in err
    status = json.loads((exp / "fedavg" / "status.json").read_text())
    assert status["status"] == "interrupted" and status["last_round"] == 2
    monkeypatch.undo()
    resume(exp)
    for f in ("metrics.csv", "train_metrics.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(Path(full["dir"]) / "fedavg" / f), pd.read_csv(exp / "fedavg" / f),
                                      check_exact=True, obj=f)
    assert json.loads((exp / "fedavg" / "status.json").read_text())["status"] == "finished"


def test_sigterm_turned_into_system_exit_leaves_an_interrupted_run(tiny_fl, monkeypatch, capsys):
    """Flower's ServerApp turns SIGTERM (its SuperLink stopped or restarted) into SystemExit:
    the run is "interrupted" (it stayed "running" before) and resumes exactly."""
    tiny_fl.update(rounds=3)
    full = run_experiment(resolve_config(dict(tiny_fl, name="full")))
    _interrupt_at(monkeypatch, 2, SystemExit(0))
    with pytest.raises(SystemExit):
        run_experiment(resolve_config(dict(tiny_fl, name="term")))
    exp = Path(tiny_fl["output_dir"]) / "term"
    assert "interrupted; round 1 is saved" in capsys.readouterr().err
    status = json.loads((exp / "fedavg" / "status.json").read_text())
    assert status["status"] == "interrupted" and status["last_round"] == 1
    monkeypatch.undo()
    resume(exp)
    pd.testing.assert_frame_equal(pd.read_csv(Path(full["dir"]) / "fedavg" / "metrics.csv"),
                                  pd.read_csv(exp / "fedavg" / "metrics.csv"), check_exact=True)


def test_ctrl_c_under_the_bundle_runner_exits_130_without_a_traceback(tiny_fl, monkeypatch, capsys):
    from medfl.bundle import run as bundle_run

    _interrupt_at(monkeypatch, 1)
    with pytest.raises(SystemExit) as stop:
        bundle_run(dict(tiny_fl, name="b"))
    assert stop.value.code == 130 and stop.value.__cause__ is None
    assert "interrupted; no round was finished yet" in capsys.readouterr().err


@pytest.mark.plots
def test_a_run_stopped_after_its_summary_draws_its_plots_on_resume(tiny_fl, monkeypatch) -> None:
    """A kill between summary.json and the plots left a run that resume called finished
    without plots; now the run is "finished" only after its end-of-run hooks, and resume
    completes them."""
    import medfl_plugins.reporting as reporting

    def boom(run_dir):  # type: ignore[no-untyped-def]
        raise KeyboardInterrupt

    with monkeypatch.context() as mp, pytest.raises(KeyboardInterrupt):
        mp.setattr(reporting, "write_plots", boom)
        run_experiment(resolve_config(dict(tiny_fl, name="p")))
    run = Path(tiny_fl["output_dir"]) / "p" / "fedavg"
    assert (run / "summary.json").is_file() and not (run / "plots").exists()
    assert json.loads((run / "status.json").read_text())["status"] == "interrupted"
    resume(run)
    assert list((run / "plots").glob("*.png"))
    assert json.loads((run / "status.json").read_text())["status"] == "finished"
