"""partition.csv is written atomically with a checksum and read back whole or not at all
(issue 19): a kill mid-write left 0 bytes or a short file that resumed on a fraction of the
rows; now each damaged form stops the resume with one message naming the file."""

from __future__ import annotations

from pathlib import Path

import pytest

from medfl.cli import main
from medfl.config import resolve_config
from medfl.data.source import DataError
from medfl.experiment import resume, run_experiment


@pytest.fixture
def stopped(tiny_fl) -> Path:
    out = run_experiment(resolve_config(dict(tiny_fl, stop_after_round=1)))
    exp = Path(out["dir"])
    for d in (exp, exp / "fedavg"):
        assert (d / "partition.csv.sha256").is_file() and not list(d.glob("*.tmp"))
    return exp


def _cut(path: Path) -> None:
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[: len(lines) // 2]))        # whole lines: a short but valid CSV


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (_cut, "its SHA-256 differs"),
    (lambda p: p.write_bytes(b""), "its SHA-256 differs"),
    (_flip, "its SHA-256 differs"),
])
def test_a_damaged_partition_stops_the_resume(stopped, damage, message) -> None:
    damage(stopped / "fedavg" / "partition.csv")     # the run's own copy, which a resume reads
    with pytest.raises(DataError, match=f"partition.csv: the saved partition is damaged: {message}"):
        resume(stopped)


def test_without_the_checksum_the_content_is_still_checked(stopped, capsys) -> None:
    """A run written before the checksum existed: an empty or column-less file is refused
    (one line from the CLI, no pandas traceback); an intact one resumes."""
    part = stopped / "fedavg" / "partition.csv"
    (stopped / "fedavg" / "partition.csv.sha256").unlink()
    good = part.read_text()
    part.write_bytes(b"")
    assert main(["resume", str(stopped)]) == 2
    err = capsys.readouterr().err
    assert "the saved partition is damaged: the file is empty" in err and "Traceback" not in err
    part.write_text("row,client\n1,0\n")
    with pytest.raises(DataError, match=r"no column\(s\) \['client_id', 'role'\]"):
        resume(stopped)
    part.write_text(good)
    assert resume(stopped)["summaries"]["fedavg"]["rounds"] == 2
