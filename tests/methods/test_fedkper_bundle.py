"""bundles/derm7pt_fedkper runs through MONAI's bundle CLI: 20 clients, Dirichlet 0.1, 10 %
sampling, FedKPer/FedAvg/FedProx on the same sampled clients, forgetting measures written."""

from __future__ import annotations

import json

import pandas as pd


def test_derm7pt_fedkper_bundle(tmp_path):
    """The three commands of the bundle README's "Try it on fixture data", as written (fixture
    of 600 cases, prepared at 16 x 16, configs/try.json over train.json)."""
    from bundle_readme import run_readme

    _, exp = run_readme("derm7pt_fedkper", tmp_path)
    assert exp == tmp_path / "bundles" / "derm7pt_fedkper" / "runs" / "derm7pt_fedkper"
    sampled = {}
    for label in ("fedkper", "fedavg", "fedprox"):
        summary = json.loads((exp / label / "summary.json").read_text())
        assert summary["num_clients"] == 20 and "forgetting" in summary
        tm = pd.read_csv(exp / label / "train_metrics.csv", dtype={"client_id": str})
        assert tm.groupby("round").size().tolist() == [2, 2]  # 10 % of 20 clients per round
        sampled[label] = tm[["round", "client_id"]].values.tolist()
    assert sampled["fedkper"] == sampled["fedavg"] == sampled["fedprox"]
    table = pd.read_csv(exp / "comparison_forgetting.csv")
    assert list(table["method"]) == ["fedkper", "fedavg", "fedprox"]
    assert table["global_consistency"].between(0, 1).all()
