"""Differential privacy and reply filters over Flower (the loop-back transport of
test_coordinator.py: the coordinator's and the sites' real code): the same DP run gives the
in-process numbers exactly (seeded noise, the same filters applied at the site and undone at
the coordinator), the filter chain travels with every training instruction, and a site with
an approvals file refuses a filter its operator did not approve."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

pytest.importorskip("flwr", reason="Flower is a dependency of medfl")

from medfl.engine import protocol as P  # noqa: E402
from medfl.engine.remote import SiteFailure  # noqa: E402
from medfl.site import REPRODUCIBLE_NOISE_ENV  # noqa: E402

from flower_cases import numeric_equal  # noqa: E402
from test_coordinator import _run_both, _no_state_at_coordinator  # noqa: E402


BASE: dict[str, Any] = {"rounds": 2, "model": {"name": "small_cnn", "width": 4},
                        "train": {"batch_size": 8, "lr": 0.05}}


def test_a_dp_run_over_flower_gives_the_in_process_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setenv(REPRODUCIBLE_NOISE_ENV, "1")   # the sites draw noise from the run seed alone
    job = {**BASE, "filters": [{"name": "dp_gaussian", "epsilon": 3.0, "delta": 1e-3, "clip": 0.5},
                               {"name": "quantize", "bits": 6, "stochastic": True}],
           "methods": [{"name": "fedavg"}]}
    seen: list[dict[str, Any]] = []

    def rule(node: int, kind: str, ctl: dict[str, Any]) -> str:
        if kind == P.TRAIN:
            seen.append(ctl)
        return "ok"

    flower, local, _ = _run_both(tmp_path, "dp", job, {"rule": rule})
    for f in ("metrics.csv", "train_metrics.csv", "privacy.csv"):
        numeric_equal(pd.read_csv(local / f), pd.read_csv(flower / f), f, atol=0.0)
    s_local = json.loads((local / "summary.json").read_text())["privacy"]
    s_flower = json.loads((flower / "summary.json").read_text())["privacy"]
    assert s_local == s_flower and s_local["epsilon"] <= 3.0
    assert len(seen) == 6     # every training instruction carries the resolved chain
    for ctl in seen:
        assert [f["name"] for f in ctl["filters"]] == ["dp_gaussian", "quantize"]
        assert ctl["filters"][0]["noise_multiplier"] == pd.read_csv(local / "privacy.csv")["noise_multiplier"].iloc[0]
    _no_state_at_coordinator(flower)


def test_dp_sgd_over_flower_gives_the_in_process_numbers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPRODUCIBLE_NOISE_ENV, "1")
    job = {**BASE, "rounds": 1, "model": {"name": "resnet10", "width": 4},
           "train": {**BASE["train"], "dp": {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-3}},
           "methods": [{"name": "fedprox", "mu": 0.1}]}
    flower, local, _ = _run_both(tmp_path, "dpsgd", job)
    for f in ("metrics.csv", "train_metrics.csv", "privacy.csv"):
        numeric_equal(pd.read_csv(local / f), pd.read_csv(flower / f), f, atol=0.0)


def test_by_default_each_site_noises_with_its_own_secret(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The coordinator knows the run seed: noise drawn from it alone could be subtracted. A
    site mixes in a secret kept in its state directory: the noise (and so the model) differs
    from the in-process simulation, the accounting does not."""
    monkeypatch.delenv(REPRODUCIBLE_NOISE_ENV, raising=False)
    job = {**BASE, "rounds": 1, "eval_every": 0, "filters": [{"name": "dp_gaussian", "noise_multiplier": 1.0}],
           "methods": [{"name": "fedavg"}]}
    flower, local, _ = _run_both(tmp_path, "secret", job)
    numeric_equal(pd.read_csv(local / "privacy.csv"), pd.read_csv(flower / "privacy.csv"), "privacy.csv", atol=0.0)
    a, b = pd.read_csv(local / "metrics.csv"), pd.read_csv(flower / "metrics.csv")
    with pytest.raises(AssertionError):
        numeric_equal(a, b, "metrics.csv", atol=0.0)
    keys = sorted((tmp_path / "state").rglob("noise.key"))
    assert len(keys) == 3 and len({k.read_text() for k in keys}) == 3
    assert all(oct(k.stat().st_mode & 0o777) == "0o600" for k in keys)
    plan = json.loads((flower / "config.json").read_text())["privacy"]
    assert "secret" in plan["noise_seeds"]


def test_a_site_refuses_a_filter_its_operator_did_not_approve(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                               ) -> None:
    from medfl.approval import APPROVALS_ENV
    from medfl.cli import main
    from test_approval import _approve

    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")   # and what every site runs besides its method
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    job = {**BASE, "rounds": 1, "eval_every": 0, "filters": [{"name": "quantize", "bits": 8}],
           "methods": [{"name": "fedavg"}]}
    with pytest.raises(SiteFailure, match=r"refused filter 'quantize'.*medfl approve quantize --kind filter"):
        _run_both(tmp_path, "refused", job)
    assert main(["approve", "quantize", "--kind", "filter", "--file", str(approvals)]) == 0
    flower, _, _ = _run_both(tmp_path, "approved", job)
    assert (flower / "summary.json").is_file()
