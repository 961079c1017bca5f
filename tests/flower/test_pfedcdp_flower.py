"""PFedCDP over Flower (the loop-back transport of test_coordinator.py: the coordinator's and the
sites' real code): the profile exchange carries four scores per site, the public set is read
at the coordinator only, the extractor's noised 8-bit update is the only training reply, the
final models are scored at the sites, and every number equals the in-process run's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

pytest.importorskip("flwr", reason="Flower is a dependency of medfl")

from medfl import wire  # noqa: E402
from medfl import public as public_module  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl.site import REPRODUCIBLE_NOISE_ENV  # noqa: E402

from flower_cases import numeric_equal  # noqa: E402
from test_coordinator import _run_both, _no_state_at_coordinator  # noqa: E402


SCORES = [{"cpu": 1.0, "memory": 0.8, "battery": 1.0, "network": 0.6},
          {"cpu": 0.5, "memory": 0.5, "battery": 0.5, "network": 0.5},
          {"cpu": 0.1, "memory": 0.2, "battery": 0.3, "network": 0.2}]


def test_pfedcdp_over_flower_gives_the_in_process_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPRODUCIBLE_NOISE_ENV, "1")   # the sites draw noise from the run seed alone
    job = {"rounds": 2, "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8, "lr": 0.05},
           "public_dataset": {"name": "synthetic2d", "root": str(tmp_path / "public"), "num_samples": 40,
                              "num_classes": 2, "image_size": 16, "noise": 0.5, "seed": 1},
           "methods": [{"name": "pfedcdp", "capabilities": SCORES, "refine_epochs": 1}]}
    built: list[str] = []
    real = public_module.PublicData.from_config.__func__

    def spy(cls: Any, cfg: dict[str, Any]) -> Any:
        built.append("public")
        return real(cls, cfg)

    monkeypatch.setattr(public_module.PublicData, "from_config", classmethod(spy))
    seen: list[tuple[str, dict[str, Any]]] = []

    def rule(node: int, kind: str, ctl: dict[str, Any]) -> str:
        seen.append((kind, ctl))
        return "ok"

    replies: list[tuple[str, Any]] = []

    def watch(node: int, kind: str, ctl: dict[str, Any], out: Any) -> Any:
        replies.append((kind, out))
        return out

    flower, local, grid = _run_both(tmp_path, "cdp", job, {"rule": rule, "tamper": watch})
    for f in ("metrics.csv", "train_metrics.csv", "privacy.csv", "profile.csv", "groups.csv", "final_metrics.csv"):
        numeric_equal(pd.read_csv(local / f), pd.read_csv(flower / f), f, atol=0.0)
    s_flower = json.loads((flower / "summary.json").read_text())
    s_local = json.loads((local / "summary.json").read_text())
    assert s_flower["method_report"] == s_local["method_report"]
    assert s_flower["privacy"]["epsilon"] <= 5.0
    # the public set was built by the two coordinators (Flower and in-process), never by a site
    assert built == ["public", "public"]
    assert {kind for kind, _ in replies} == {P.HELLO, P.VALIDATE, P.TRAIN, P.EVALUATE}
    profiles = [ctl for kind, ctl in seen if kind == P.VALIDATE and ctl.get("exchange") == "profile"]
    assert len(profiles) == 3
    finals = [ctl for kind, ctl in seen if kind == P.EVALUATE and ctl.get("final")]
    assert len(finals) == 3
    # what came back: four scores per site in the profile, the extractor's codes in training
    for kind, content in replies:
        if kind == P.VALIDATE:
            assert set(wire.read_metrics(content.get("validate"), "profile")) == {"cpu", "memory", "battery",
                                                                                 "network"}
        if kind == P.TRAIN:
            payload = wire.take(content, "reply.payload", "train reply", allow_str=False)
            assert set(payload) == {"extractor"}
            assert all(isinstance(v, dict) and "codes" in v for v in payload["extractor"].values())
    _no_state_at_coordinator(flower)
