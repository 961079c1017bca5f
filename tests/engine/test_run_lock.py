"""One process per run directory, and experiment names taken atomically (issue 19): two
`medfl resume` of one directory both exited 0 and corrupted it; 16 of 80 synchronized starts
shared a directory."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from medfl.config import resolve_config
from medfl.engine.runner import Run, RunError
from medfl.experiment import _create_unique_dir, resume, run_experiment


def test_a_run_in_use_cannot_be_resumed_by_another_process(tiny_fl) -> None:
    exp = Path(run_experiment(resolve_config(dict(tiny_fl, stop_after_round=1)))["dir"])
    held = {}
    real = Run.run_round

    def run_round(self, r, pm):  # type: ignore[no-untyped-def]
        # while this run holds its directory, a second resume (its own open file) is refused
        if "err" not in held:
            with pytest.raises(RunError, match=r"fedavg is in use by another medfl process \(pid \d+\)") as e:
                resume(exp / "fedavg")
            held["err"] = str(e.value)
        return real(self, r, pm)

    Run.run_round = run_round
    try:
        resume(exp / "fedavg")
    finally:
        Run.run_round = real
    assert "err" in held
    # released at the end: a later resume of the finished run is fine
    assert resume(exp / "fedavg")["summaries"]["fedavg"]["rounds"] == 2


def test_synchronized_starts_never_share_a_directory(tmp_path) -> None:
    base = tmp_path / "runs" / "exp"
    got: list[Path] = []
    barrier = threading.Barrier(16)

    def start() -> None:
        barrier.wait()
        got.append(_create_unique_dir(base, overwrite=False))

    threads = [threading.Thread(target=start) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(got)) == 16 and base in got
