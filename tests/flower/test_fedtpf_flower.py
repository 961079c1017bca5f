"""FedTPF over Flower (the loop-back transport of test_coordinator.py: the coordinator's and the
sites' real code): stage 1, the stop-condition validation exchange, the release round and
stage 2 give the in-process numbers; only the release reply carries per-sample features, and
only in answer to the release instruction; a site whose release holds features of another
size is left out of the shared set (the other sites' release goes on)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

pytest.importorskip("flwr", reason="Flower is a dependency of medfl")

from medfl import wire  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl.site import REPRODUCIBLE_NOISE_ENV  # noqa: E402

from flower_cases import numeric_equal  # noqa: E402
from test_coordinator import _no_state_at_coordinator, _run_both, _tampered_run  # noqa: E402


JOB: dict[str, Any] = {"rounds": 4, "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8, "lr": 0.05},
                       "client_split": {"train": 0.6, "val": 0.2, "test": 0.2},
                       "methods": [{"name": "fedtpf", "distill_rounds": 2, "epsilon": 4.0, "vae_width": 4,
                                    "critic_width": 4, "distill_steps": 4}]}


def test_fedtpf_over_flower_gives_the_in_process_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPRODUCIBLE_NOISE_ENV, "1")   # the sites draw the release noise from the run seed alone
    seen: list[tuple[str, dict[str, Any]]] = []

    def rule(node: int, kind: str, ctl: dict[str, Any]) -> str:
        seen.append((kind, ctl))
        return "ok"

    flower, local, grid = _run_both(tmp_path, "tpf", JOB, {"rule": rule})
    for f in ("metrics.csv", "train_metrics.csv", "privacy.csv", "validation_metrics.csv"):
        numeric_equal(pd.read_csv(local / f), pd.read_csv(flower / f), f"fedtpf: {f}", atol=0.0)
    reports = [json.loads((d / "summary.json").read_text()) for d in (flower, local)]
    assert reports[0]["method_report"] == reports[1]["method_report"]
    assert reports[0]["privacy"]["epsilon"] == reports[1]["privacy"]["epsilon"] <= 4.0
    # round 3 is the transition: 3 release messages and 3 training messages
    trains = [r for (_, k, r) in grid.sent if k == P.TRAIN]
    assert [trains.count(r) for r in (1, 2, 3, 4)] == [3, 3, 6, 3]
    assert [r for (_, k, r) in grid.sent if k == P.VALIDATE] == [1, 1, 1]    # after round 1 only
    _no_state_at_coordinator(flower)


@pytest.mark.parametrize("mode", [
    {"noise": {"variance": 0.15}, "epsilon": None},      # the paper's noise on unclipped x_s, not private
    {"clip": "public_quantile", "clip_quantile": 0.5},   # the clip measured on fl.public_dataset
])
def test_the_release_modes_over_flower_give_the_in_process_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   mode: dict[str, Any]) -> None:
    """The paper's fixed-variance noise and the public-quantile clip: the sites release what
    the in-process clients release (the clip the coordinator measured travels in the release
    instruction), with the same privacy record and mechanism rows."""
    monkeypatch.setenv(REPRODUCIBLE_NOISE_ENV, "1")
    job = json.loads(json.dumps(JOB))
    job["methods"][0].update(mode)
    if mode.get("clip") == "public_quantile":
        job["public_dataset"] = {"name": "synthetic2d", "root": str(tmp_path / "public"), "num_samples": 40,
                                 "num_classes": 2, "image_size": 16, "noise": 0.5, "seed": 1}
    flower, local, _ = _run_both(tmp_path, "tpf_mode", job)
    for f in ("metrics.csv", "privacy.csv", "mechanisms.csv"):
        numeric_equal(pd.read_csv(local / f), pd.read_csv(flower / f), f"fedtpf {mode}: {f}", atol=0.0)
    reports = [json.loads((d / "summary.json").read_text()) for d in (flower, local)]
    assert reports[0]["method_report"] == reports[1]["method_report"]
    assert reports[0]["privacy"] == reports[1]["privacy"]
    if "noise" in mode:
        assert reports[0]["privacy"]["private"] is False
    else:
        release = pd.read_csv(flower / "mechanisms.csv", dtype={"id": str, "text": str}, keep_default_na=False)
        clip = release[(release["mechanism"] == "noise") & (release["name"] == "clip")]
        assert len(clip) and (pd.to_numeric(clip["value"]) > 0).all()
        measured = reports[0]["privacy"]["mechanisms"]["feature_gaussian"]["clip"]
        assert measured > 0 and measured != 5.0   # measured on the public set, not the constant default


def test_a_site_releasing_features_of_another_size_is_left_out_of_the_shared_set(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPRODUCIBLE_NOISE_ENV, "1")

    first: list[int] = []

    def tamper(node: int, kind: str, ctl: dict[str, Any], out: Any) -> Any:
        if kind == P.TRAIN and int(ctl.get("round", 0)) == 3 and first in ([], [node]):
            first[:] = [node]
            payload = wire.take(out, "reply.payload", "test", allow_str=False)
            if "shared_x" in payload:
                payload["shared_x"] = payload["shared_x"][:, :, :4]
                wire.put(out, "reply.payload", payload, "test", allow_str=False)
        return out

    from medfl.config import resolve_config
    from medfl.flower.server import run_flower_experiment
    from flower_cases import fl_config
    from test_coordinator import FAST, LoopTransport, _sites

    fl = fl_config(tmp_path, "tpf_bad", JOB)
    out = run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl), tamper=tamper), FAST)
    report = json.loads((Path(out["dir"]) / "fedtpf" / "summary.json").read_text())["method_report"]
    assert list(report["transition"]["left_out"]) == [str(first[0] - 101)]     # node 101 serves client 0
    assert report["transition"]["contributors"] == 2


def test_image_shaped_features_outside_the_release_round_are_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """``shared_x`` is excused from the coordinator's shape check only in a reply to the
    release instruction: the same key in a stage-2 training reply is refused (dropped from the
    round with an event naming the site; the run goes on, issue 19)."""
    import torch

    monkeypatch.setenv(REPRODUCIBLE_NOISE_ENV, "1")

    def tamper(node: int, kind: str, ctl: dict[str, Any], out: Any) -> Any:
        if kind == P.TRAIN and int(ctl.get("round", 0)) == 4 and node == 101:
            payload = wire.take(out, "reply.payload", "test", allow_str=False)
            payload["shared_x"] = torch.rand(20, 1, 16, 16)   # shaped like a batch of the images
            wire.put(out, "reply.payload", payload, "test", allow_str=False)
        return out

    run_dir, events = _tampered_run(tmp_path, "tpf_leak", JOB, tamper, method="fedtpf")
    assert events[["round", "client_id", "status"]].values.tolist() == [[4, "0", "dropped"]]
    assert "reply of site 0 in round 4['shared_x']" in events["reason"].iloc[0]
    trained = pd.read_csv(run_dir / "train_metrics.csv", dtype={"client_id": str})
    assert sorted(trained[trained["round"] == 4]["client_id"]) == ["1", "2"]
