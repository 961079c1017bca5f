"""The resume attack (issue 38, item 0): a run that stops after a round's DP replies reached
the coordinator, resumed with more rounds (which re-derives the noise multiplier for its
target epsilon), must not release that round again as the same noise at another scale, from
which the coordinator solves every client's clipped update. The round is re-run under the
parameters it was released under (the same bytes come back), the new noise applies from the
next round, and privacy.csv counts every release the coordinator saw."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from medfl.engine.runner import Run
from medfl.experiment import resume, run_experiment

CLIP = 0.5


def _watch_round(monkeypatch: pytest.MonkeyPatch, round: int, seen: list[dict[str, Any]], crash: bool) -> None:
    """Keep a copy of every reply of ``round`` as it reached the coordinator (before the
    filters are undone); with ``crash``, stop the run right after they arrived (before the
    method saw them and before the round's checkpoint), as a killed coordinator would."""
    unfilter, screen = Run.unfilter, Run.screen

    def watched(self, r, instructions, replies):  # type: ignore[no-untyped-def]
        if r == round:
            seen.append({cid: {k: v.clone() for k, v in rep.payload["model"].items()}
                         for cid, rep in replies.items()})
        return unfilter(self, r, instructions, replies)

    def crashing(self, r, instructions, replies):  # type: ignore[no-untyped-def]
        if crash and r == round:
            raise KeyboardInterrupt
        return screen(self, r, instructions, replies)

    monkeypatch.setattr(Run, "unfilter", watched)
    monkeypatch.setattr(Run, "screen", crashing)


def _stopped_after_release(tiny_fl: dict[str, Any], resolve: Any, monkeypatch: pytest.MonkeyPatch, round: int = 3
                           ) -> tuple[Path, list[dict[str, Any]]]:
    """A dp_gaussian run (target epsilon over 3 rounds) killed after round ``round``'s replies arrived."""
    fl = {**tiny_fl, "rounds": 3, "eval_every": 0,
          "filters": [{"name": "dp_gaussian", "epsilon": 2.0, "delta": 1e-3, "clip": CLIP}]}
    seen: list[dict[str, Any]] = []
    with monkeypatch.context() as m:
        _watch_round(m, round, seen, crash=True)
        with pytest.raises(KeyboardInterrupt):
            run_experiment(resolve(fl))
    return Path(fl["output_dir"]) / "t" / "fedavg", seen


def _flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([v.double().flatten() for v in state.values()])


def test_a_round_released_before_a_crash_is_released_again_as_the_same_bytes(
        tiny_fl: dict, resolve: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    run, first = _stopped_after_release(tiny_fl, resolve, monkeypatch)
    s_old = float(json.loads((run / "config.json").read_text())["privacy"]["dp_gaussian"]["noise_multiplier"])
    capfd.readouterr()
    again: list[dict[str, Any]] = []
    with monkeypatch.context() as m:
        _watch_round(m, 3, again, crash=False)
        resume(run, rounds=6)
    err = capfd.readouterr().err
    df = pd.read_csv(run / "privacy.csv", dtype={"client_id": str})
    s_new = float(df[df["round"] == 6]["noise_multiplier"].iloc[0])
    assert s_new > s_old * 1.2          # six planned rounds need more noise for the same target
    (r1,), (r2,) = first, again
    assert sorted(r1) == sorted(r2) and r1
    for cid in r1:
        a, b = _flat(r1[cid]), _flat(r2[cid])
        # the coordinator's algebra: a = u + s_old z and b = u + s_new z give u exactly
        u = (s_new * a - s_old * b) / (s_new - s_old)
        assert torch.equal(a, b) or float(u.norm()) > 10 * CLIP, (
            f"client {cid}: the two releases of round 3 are one draw at two scales; the coordinator solved the "
            f"clipped update (norm {float(u.norm()):.3g} <= clip {CLIP})")
        assert torch.equal(a, b), f"client {cid}: round 3 was released again as other bytes"
    assert "round 3 was released to the coordinator before the run stopped" in err
    # accounted as released: round 3 once per client at the noise it was released with,
    # the new noise from round 4 on
    r3 = df[df["round"] == 3]
    assert sorted(r3["client_id"]) == sorted(r1) and (r3["steps"] == 1).all()
    assert r3["noise_multiplier"].tolist() == pytest.approx([s_old] * len(r3), rel=1e-12)
    assert (df[df["round"] >= 4]["noise_multiplier"] == s_new).all()
    assert (df.groupby("client_id")["total_steps"].last() == 6).all()


def test_a_release_the_coordinator_saw_that_comes_back_different_is_counted(
        tiny_fl: dict, resolve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A release re-run after a crash that does not come back as the same bytes (here: the
    journal says client 0 sent other bytes before the crash, as on a machine whose training
    is not bit-reproducible) is two releases, and privacy.csv counts both."""
    run, _ = _stopped_after_release(tiny_fl, resolve, monkeypatch)
    journal = run / "releases.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    assert [(r["round"], r["client"]) for r in records if r["round"] == 3] == [(3, "0"), (3, "1"), (3, "2")]
    for r in records:
        if r["round"] == 3 and r["client"] == "0":
            r["digest"] = "0" * 64
    journal.write_text("".join(json.dumps(r) + "\n" for r in records))
    resume(run)
    df = pd.read_csv(run / "privacy.csv", dtype={"client_id": str})
    r3 = df[df["round"] == 3].set_index("client_id")
    assert r3.loc["0", "steps"] == 2 and r3.loc["1", "steps"] == 1 and r3.loc["2", "steps"] == 1
    assert df.groupby("client_id")["total_steps"].last().to_dict() == {"0": 4, "1": 3, "2": 3}


def test_a_resume_with_fewer_rounds_than_were_released_is_refused(
        tiny_fl: dict, resolve: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Round 3 reached the coordinator: a run resumed with 2 rounds would never account it."""
    from medfl.rundir import RunError

    run, _ = _stopped_after_release(tiny_fl, resolve, monkeypatch)
    before = {name: (run / name).read_bytes() for name in ("config.json", "status.json")}
    with pytest.raises(RunError, match=r"round 3 was released to the coordinator before the run stopped "
                                       r"\(releases.jsonl\), but the resumed run has only 2 rounds.*"
                                       r"resume with --rounds 3 or more"):
        resume(run, rounds=2)
    # issue 49, item 6: a refused resume changes nothing (config.json was planned at 2 rounds)
    assert {name: (run / name).read_bytes() for name in before} == before
    resume(run, rounds=4)      # the refusal changed nothing: the run resumes with enough rounds
    df = pd.read_csv(run / "privacy.csv", dtype={"client_id": str})
    assert sorted(set(df["round"])) == [1, 2, 3, 4]


def test_round_one_released_before_the_first_checkpoint_is_released_again_as_the_same_bytes(
        tiny_fl: dict, resolve: Any, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture) -> None:
    """Issue 39, item 3: a run killed in round 1 after its DP replies arrived, before any
    checkpoint, resumed without reading releases.jsonl (the resume returned early), so with
    ``--rounds 6`` round 1 was released again at the re-derived noise: one draw at two scales.
    Now round 1 runs again under the parameters it was released under: the same bytes."""
    run, first = _stopped_after_release(tiny_fl, resolve, monkeypatch, round=1)
    assert not list((run / "checkpoints").glob("round_*.pt"))
    capfd.readouterr()
    again: list[dict[str, Any]] = []
    with monkeypatch.context() as m:
        _watch_round(m, 1, again, crash=False)
        resume(run, rounds=6)
    assert "round 1 was released to the coordinator before the run stopped" in capfd.readouterr().err
    (r1,), (r2,) = first, again
    assert sorted(r1) == sorted(r2) and r1
    for cid in r1:
        assert torch.equal(_flat(r1[cid]), _flat(r2[cid])), f"client {cid}: round 1 was released again as other bytes"
