"""bundles/derm7pt_fedkper runs through MONAI's bundle CLI: 20 clients, Dirichlet 0.1, 10 %
sampling, FedKPer/FedAvg/FedProx on the same sampled clients, forgetting measures written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pandas as pd

from medfl.fixtures import generate
from medfl.prep.derm7pt import main as prep

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "derm7pt_fedkper"


def test_derm7pt_fedkper_bundle(tmp_path, run_bundle):
    generate("derm7pt", tmp_path / "raw", cases=600, seed=0, reference=False)
    os.environ["MEDFL_NO_PROGRESS"] = "1"
    assert prep(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "data"), "--size", "16",
                 "--crop-border", "2"]) == 0
    run_bundle(BUNDLE / "configs" / "train.json", "--bundle_root", tmp_path, "--dataset_dir", tmp_path / "data",
               "--image_size", "16", "--fl#rounds", "2", "--fl#model", "{'name': 'small_cnn', 'width': 4}",
               "--fl#progress", "False", "--fl#train#batch_size", "4")
    exp = tmp_path / "runs" / "derm7pt_fedkper"
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
