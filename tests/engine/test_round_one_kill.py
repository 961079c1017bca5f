"""A run killed or interrupted in round 1, before its first checkpoint, resumes exactly
(issue 39, item 3). ``Run.prepare(resume=True)`` returned early when there was no
checkpoint, without rolling back the client and evaluation states round 1 had already
written, so the redone round 1 trained FedBN's local layers (or ``local``'s own model) on
from the killed attempt's and the run ended with other numbers, rc 0. The kill points are
the ones that resumed exactly before: just before round 1's checkpoint ``.tmp`` and
``metrics.csv.tmp`` are renamed into place (everything of round 1 written but the rename),
as a ``SIGKILL`` there leaves them; and Ctrl-C in round 1."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from medfl.config import resolve_config
from medfl.engine.runner import Run
from medfl.experiment import resume, run_experiment


class Killed(BaseException):
    """A kill: nothing of the run's own handling runs (not an ``Exception``, not Ctrl-C)."""


def kill_before_rename(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """End the run (:class:`Killed`) just before the file ``name`` (a ``.tmp`` written whole)
    is renamed into place, the first time: what a ``SIGKILL`` at that moment leaves on disk."""
    real = Path.replace

    def replace(self: Path, target: Any) -> Path:
        if self.name == name:
            monkeypatch.setattr(Path, "replace", real)
            raise Killed(name)
        return real(self, target)

    monkeypatch.setattr(Path, "replace", replace)


def ctrl_c_in_round_one(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Ctrl-C after round 1 trained and evaluated, before its checkpoint (``name`` unused)."""
    real = Run._save_checkpoint

    def save(self: Run, r: int) -> None:
        if r == 1:
            raise KeyboardInterrupt
        real(self, r)

    monkeypatch.setattr(Run, "_save_checkpoint", save)


def _same_files(full: Path, part: Path, names: Iterator[str]) -> None:
    for f in names:
        assert (part / f).read_bytes() == (full / f).read_bytes(), f"{f} differs from the uninterrupted run's"


@pytest.mark.parametrize("method", ["fedbn", "local"])
@pytest.mark.parametrize("stop,point", [(kill_before_rename, "round_0001.tmp"),
                                         (kill_before_rename, "metrics.csv.tmp"),
                                         (ctrl_c_in_round_one, "")],
                         ids=["checkpoint-tmp", "metrics-tmp", "ctrl-c"])
def test_a_run_stopped_in_round_one_resumes_to_the_uninterrupted_numbers(tiny_fl, monkeypatch, method, stop,
                                                                          point) -> None:
    job = dict(tiny_fl, rounds=2, methods=[{"name": method}])
    full = Path(run_experiment(resolve_config(dict(job, name="full")))["dir"]) / method
    with monkeypatch.context() as m:
        stop(m, point)
        with pytest.raises((Killed, KeyboardInterrupt)):
            run_experiment(resolve_config(dict(job, name="cut")))
    part = Path(tiny_fl["output_dir"]) / "cut" / method
    assert not list((part / "checkpoints").glob("round_*.pt"))          # stopped before the first checkpoint
    assert list((part / "clients").rglob("state_r0001.pt"))             # but round 1 wrote client states
    resume(part.parent)
    _same_files(full, part, iter(["metrics.csv", "train_metrics.csv", "communication.csv"]))
