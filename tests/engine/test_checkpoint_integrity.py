"""Checkpoints and client states carry checksums and a resume continues only from a whole
one (issue 19): 64 flipped bytes in the latest checkpoint or a deleted client state used to
resume silently (that client restarting from scratch). Now the run falls back to the last
intact checkpoint *with its client states* (kept for every kept checkpoint) and ends with the
uninterrupted run's numbers, or stops with one message when none is intact."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from medfl.config import resolve_config
from medfl.engine.runner import RunError
from medfl.experiment import resume, run_experiment


@pytest.fixture
def job(tiny_fl) -> dict:
    # FedBN keeps its norm layers at each client: real client state to lose
    return dict(tiny_fl, rounds=4, methods=[{"name": "fedbn"}], keep_checkpoints=2)


def _runs(job: dict) -> tuple[Path, Path]:
    full = Path(run_experiment(resolve_config(dict(job, name="full")))["dir"]) / "fedbn"
    part = Path(run_experiment(resolve_config(dict(job, name="part", stop_after_round=3)))["dir"]) / "fedbn"
    assert sorted(p.name for p in (part / "checkpoints").glob("round_*.pt")) == ["round_0002.pt", "round_0003.pt"]
    # each kept checkpoint keeps its client states
    assert {p.name for p in (part / "clients" / "0").glob("state_r*.pt")} == {"state_r0002.pt", "state_r0003.pt"}
    return full, part


def _same(full: Path, part: Path) -> None:
    for f in ("metrics.csv", "train_metrics.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(full / f), pd.read_csv(part / f), check_exact=True, obj=f)


def _flip(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(n):
        data[(len(data) // 3 + 97 * i) % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(job, capsys) -> None:
    full, part = _runs(job)
    _flip(part / "checkpoints" / "round_0003.pt")
    resume(part)
    err = capsys.readouterr().err
    assert "round_0003.pt is damaged (its SHA-256 differs" in err and "last intact checkpoint, round 2" in err
    assert (part / "checkpoints" / "round_0003.pt.damaged").is_file()       # kept, not deleted
    _same(full, part)


def test_a_deleted_client_state_falls_back_to_a_checkpoint_whose_states_are_whole(job, capsys) -> None:
    full, part = _runs(job)
    (part / "clients" / "1" / "state_r0003.pt").unlink()
    resume(part)
    assert "client 1's state of round 3 is missing" in capsys.readouterr().err
    _same(full, part)


def test_a_checkpoint_without_its_checksum_is_refused(job, capsys) -> None:
    """Issue 49, item 6: a checkpoint edited (a readable checkpoint with other values) together
    with deleting its ``.sha256`` resumed silently from the edit (accuracy off by 0.167). A
    checkpoint is always written with its sum: without it, it is set aside as damaged and the
    run falls back to the one before, saying so."""
    import torch

    full, part = _runs(job)
    ckpt = part / "checkpoints" / "round_0003.pt"
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    state["method"] = {k: (v + 1 if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                       for k, v in state["method"].items()} if isinstance(state["method"], dict) else state["method"]
    torch.save(state, ckpt)
    (part / "checkpoints" / "round_0003.pt.sha256").unlink()
    resume(part)
    err = capsys.readouterr().err
    assert "round_0003.pt is damaged (it has no round_0003.pt.sha256" in err and "last intact checkpoint, round 2" in err
    _same(full, part)


def test_no_intact_checkpoint_stops_with_one_message(job) -> None:
    _, part = _runs(job)
    for k in (2, 3):
        _flip(part / "checkpoints" / f"round_{k:04d}.pt")
    with pytest.raises(RunError, match=r"no intact checkpoint to resume from \(round_0003.pt: its SHA-256 differs"):
        resume(part)


def test_metrics_rows_lost_or_changed_stop_the_resume(job) -> None:
    """metrics.csv with rows dropped resumed silently with rc 0; now it is checked against the
    checksum written with it. A kill between the checksum and the rename is finished instead."""
    _, part = _runs(job)
    metrics = part / "metrics.csv"
    good = metrics.read_text()
    lines = good.splitlines(keepends=True)
    (part / "metrics.csv.tmp").write_text(good)      # what a kill just before the rename leaves
    metrics.write_text("".join(lines[:-2]))           # and an older file in place
    resume(part)                                      # the interrupted write is finished, the run goes on
    assert metrics.read_text().startswith(good) and not (part / "metrics.csv.tmp").exists()
    metrics.write_text("".join(metrics.read_text().splitlines(keepends=True)[:-3]))
    with pytest.raises(RunError, match=r"metrics.csv: its SHA-256 differs.*rows lost or changed"):
        resume(part, rounds=5)


def test_a_per_round_file_written_with_no_row_resumes(tmp_path: Path) -> None:
    """Issue 39, item 2: a Flower run whose first evaluation round had no site wrote
    metrics.csv as a one-byte file with a valid checksum; every resume then died in
    ``_read_rounds`` with pandas' EmptyDataError. Such a file holds no round: it reads as
    none, and the run continues from its checkpoint."""
    from medfl.rundir import _read_rounds, write_sum

    path = tmp_path / "metrics.csv"
    pd.DataFrame().to_csv(path, index=False)
    write_sum(path, path)
    assert path.stat().st_size <= 1
    assert _read_rounds(path, 3) is None


def _snapshot(run: Path) -> dict[str, bytes]:
    """Every file of a run directory but its lock, by relative path."""
    return {str(p.relative_to(run)): p.read_bytes() for p in sorted(run.rglob("*")) if p.is_file()
            and p.name != ".lock"}


def _refused(part: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Resume ``part`` with the command line: exit code 2 and one ``medfl: error:`` line,
    nothing changed in the run directory; return that line."""
    from medfl.cli import main

    before = _snapshot(part)
    capsys.readouterr()
    assert main(["resume", str(part)]) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("medfl: error:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert _snapshot(part) == before, "the refused resume changed the run directory"
    return lines[0]


def test_a_deleted_per_round_file_stops_the_resume(job, capsys) -> None:
    """Issue 39, 6b: a deleted metrics.csv, train_metrics.csv or communication.csv resumed
    with rc 0, the file written again with the later rounds only. Round 3's checkpoint now
    holds a manifest of the run's files; each missing one stops the resume naming it, and
    the run, its file restored, resumes to the uninterrupted numbers."""
    full, part = _runs(job)
    for name in ("metrics.csv", "train_metrics.csv", "communication.csv"):
        kept = (part / name).read_bytes()
        (part / name).unlink()
        line = _refused(part, capsys)
        assert f"{part / name}: missing; round 3's checkpoint lists it (" in line, line
        (part / name).write_bytes(kept)
    resume(part)
    _same(full, part)
    assert (part / "communication.csv").read_bytes() == (full / "communication.csv").read_bytes()


def test_a_file_changed_with_its_checksum_deleted_stops_the_resume(job, capsys) -> None:
    """Issue 39, 6b: a per-round file changed together with its deleted ``.sha256`` resumed
    with rc 0 and the changed rows. The checkpoint's manifest has the file's digest: the
    resume stops with a digest mismatch naming the file; restored, the run resumes exactly."""
    full, part = _runs(job)
    for name in ("metrics.csv", "train_metrics.csv", "communication.csv"):
        path, side = part / name, part / f"{name}.sha256"
        kept, kept_side = path.read_bytes(), side.read_bytes()
        df = pd.read_csv(path)
        df.loc[1, df.columns[-1]] = 12345                    # one number of round 1 changed
        df.to_csv(path, index=False)
        side.unlink()
        line = _refused(part, capsys)
        assert f"{path}: digest mismatch: its first bytes are not those round 3's checkpoint recorded" in line, line
        path.write_bytes(kept)
        side.write_bytes(kept_side)
    resume(part)
    _same(full, part)


@pytest.mark.parametrize("text, why", [('{"fl": {"rounds": 4', "line 1 column"), ("[1, 2]", "expected a JSON object"),
                                       ("\xff\xfe", "not the JSON medfl wrote")])
def test_a_garbled_config_json_is_one_line(tiny_fl: dict, text: str, why: str,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    """Issue 49, item 6: a garbled ``config.json`` gave a traceback; now ``medfl resume`` says
    which file and where, in one line, and changes nothing."""
    from medfl.cli import main

    run = Path(run_experiment(resolve_config(dict(tiny_fl, name="g", rounds=2, stop_after_round=1)))["dir"]) / "fedavg"
    (run / "config.json").write_bytes(text.encode("latin-1"))
    capsys.readouterr()
    assert main(["resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(run / "config.json") in err[0] and why in err[0], err
    assert "Traceback" not in "\n".join(err)
