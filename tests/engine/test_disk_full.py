"""A full disk (issue 39, item 4) stopped a run with two or three chained tracebacks, no
``medfl: error:`` line, and a ``status.json`` left as it was (the failure handler's own write
failed too). Now the run stops with one line naming the file and "no space left on device",
its last good state intact, and ``medfl resume`` ends, once space is freed, with the
uninterrupted run's numbers.

Two disks fill up here: a real one, a small tmpfs mounted for the test (needs root: skipped
with the reason where mounting fails), and one that always runs, every file opened for
writing under the run's directory sharing a budget of bytes past which a write fails with
``ENOSPC`` after writing what fits, as a full device does (:class:`BudgetDisk`)."""

from __future__ import annotations

import builtins
import errno
import io
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import pytest

from medfl.cli import main
from medfl.config import resolve_config
from medfl.experiment import run_experiment

METHOD = "fedbn"   # FedBN keeps state at each client: client states to lose as well


class _Limited:
    """A file opened for writing whose writes draw on a :class:`BudgetDisk`."""

    def __init__(self, f: Any, disk: "BudgetDisk") -> None:
        self._f, self._disk = f, disk

    def write(self, data: Any) -> int:
        n = len(data)
        if n > self._disk.free:
            fits = max(0, self._disk.free)
            self._f.write(data[:fits])
            self._disk.free = 0
            raise OSError(errno.ENOSPC, "No space left on device")
        self._disk.free -= n
        return self._f.write(data)

    def __enter__(self) -> "_Limited":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._f.close()

    def __iter__(self) -> Iterator[Any]:
        return iter(self._f)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)


class BudgetDisk:
    """Files opened for writing under ``root`` share ``free`` bytes (characters for text):
    a write past them writes what fits and fails with ``ENOSPC``."""

    def __init__(self, root: Path, free: int) -> None:
        self.root, self.free = str(root.resolve()), int(free)

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = builtins.open

        def limited_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            f = real(file, mode, *args, **kwargs)
            under = isinstance(file, (str, Path)) and str(Path(file).resolve()).startswith(self.root)
            # "r+": overwriting a file's own bytes takes no new space on a device (medfl writes no more)
            return _Limited(f, self) if under and any(c in mode for c in "wax") else f

        monkeypatch.setattr(builtins, "open", limited_open)
        monkeypatch.setattr(io, "open", limited_open)


def _job(tiny_fl: dict[str, Any], output_dir: Path) -> dict[str, Any]:
    return dict(tiny_fl, rounds=4, methods=[{"name": METHOD}], output_dir=str(output_dir))


def _config(tmp_path: Path, fl: dict[str, Any]) -> Path:
    path = tmp_path / f"{fl['name']}.json"
    path.write_text(json.dumps({"fl": fl}))
    return path


def _stopped_by_a_full_disk(capsys: pytest.CaptureFixture[str], part: Path, fill: Any, status: tuple[str, ...] = (
        "failed", "stopped")) -> str:
    """Resume ``part`` (stopped after round 2) on a disk ``fill`` fills: exit code 2, one
    ``medfl: error:`` line naming a file of the run and the full disk, no traceback; the
    last good state whole. Returns the line."""
    capsys.readouterr()
    with fill():
        rc = main(["resume", str(part.parent)])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [x for x in err.splitlines() if x.startswith("medfl: error:")]
    assert len(lines) == 1 and "Traceback" not in err and "During handling" not in err, err
    assert "no space left on device" in lines[0] and f"{part}/" in lines[0], lines[0]
    assert "medfl resume" in lines[0]
    statuses = status
    status = json.loads((part / "status.json").read_text())                 # whole JSON, never torn
    assert status["status"] in statuses and status["last_round"] == 2, status
    assert sorted(p.name for p in (part / "checkpoints").glob("round_*.pt")) == ["round_0001.pt", "round_0002.pt"]
    assert not list(part.rglob("*.tmp")), "a partial temporary file was left behind"
    for name in ("metrics.csv", "train_metrics.csv", "communication.csv"):
        rows = pd.read_csv(part / name)
        assert rows["round"].max() <= 3, name
    return lines[0]


def _same(full: Path, part: Path) -> None:
    for name in ("metrics.csv", "train_metrics.csv", "communication.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(full / name), pd.read_csv(part / name), check_exact=True, obj=name)
    assert (part / "metrics.csv").read_bytes() == (full / "metrics.csv").read_bytes()


def test_a_full_disk_stops_with_one_line_and_resumes_exactly(tiny_fl, tmp_path, monkeypatch, capsys) -> None:
    """The disk that always runs: 3000 bytes left after round 2 run out in round 3."""
    out = tmp_path / "runs"
    full = Path(run_experiment(resolve_config(dict(_job(tiny_fl, out), name="full")))["dir"]) / METHOD
    assert main(["run", str(_config(tmp_path, dict(_job(tiny_fl, out), name="cut", stop_after_round=2)))]) == 0
    part = out / "cut" / METHOD

    class fill:
        def __enter__(self) -> None:
            self.mp = pytest.MonkeyPatch()
            # the resume writes config.json again first: room for it, and 3000 bytes more
            BudgetDisk(out / "cut", (part / "config.json").stat().st_size + 3000).install(self.mp)

        def __exit__(self, *exc: Any) -> None:
            self.mp.undo()

    # issue 49, item 6: the stop says failed (status.json rewritten in place), not its last status
    _stopped_by_a_full_disk(capsys, part, fill, status=("failed",))
    assert main(["resume", str(part.parent)]) == 0                     # space freed: the run goes on
    assert json.loads((part / "status.json").read_text())["status"] == "finished"
    _same(full, part)


def test_a_full_tmpfs_stops_with_one_line_and_resumes_exactly(tiny_fl, tmp_path, capsys) -> None:
    """A real device: a 4 MiB tmpfs, filled after round 2 up to 8 KiB, runs out in round 3;
    the filler deleted, the resume ends with the uninterrupted numbers."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip() or mounted.returncode}; "
                    "test_a_full_disk_stops_with_one_line_and_resumes_exactly covers the same without a mount")
    try:
        full = Path(run_experiment(resolve_config(dict(_job(tiny_fl, tmp_path / "runs"), name="full")))["dir"])
        job = dict(_job(tiny_fl, mnt), name="cut", stop_after_round=2)
        assert main(["run", str(_config(tmp_path, job))]) == 0
        part = mnt / "cut" / METHOD
        filler = mnt / "filler"

        class fill:
            def __enter__(self) -> None:
                with open(filler, "wb") as f:
                    while shutil.disk_usage(mnt).free > 8192:
                        try:
                            f.write(b"\0" * min(1 << 16, shutil.disk_usage(mnt).free - 8192))
                            f.flush()
                        except OSError:
                            break

            def __exit__(self, *exc: Any) -> None:
                pass

        # a real device frees status.json's own blocks when it is rewritten in place: it says failed
        _stopped_by_a_full_disk(capsys, part, fill, status=("failed",))
        filler.unlink()
        assert main(["resume", str(part.parent)]) == 0
        assert json.loads((part / "status.json").read_text())["status"] == "finished"
        _same(full / METHOD, part)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
