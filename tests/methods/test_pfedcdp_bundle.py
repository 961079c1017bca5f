"""bundles/cbis_ddsm_pfedcdp runs through MONAI's bundle CLI: CBIS-DDSM fixture clients
(official test split as the global test), a MIAS benign-vs-malignant fixture as the
coordinator's public set, PFedCDP with the paper's privacy next to FedAvg and Centralized."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest

from medfl.fixtures import generate
from medfl.prep import cbis_ddsm, mias

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "cbis_ddsm_pfedcdp"
SIZE = "16"  # on 16 px inputs the paper's CNNs are exactly the paper's (their 4 x 4 pool is the identity)
METHODS = ["pfedcdp", "fedavg", "centralized"]
SPLITS = ("public_test", "local_test", "global_test")


@pytest.mark.plots
def test_cbis_ddsm_pfedcdp_bundle(tmp_path, run_bundle, monkeypatch):
    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")
    # 40 CBIS-DDSM mammograms: 19 in the training CSVs (split over the clients, at least 4
    # each), 21 in the official test split; 30 MIAS images of which 16 are benign or malignant
    generate("cbis_ddsm", tmp_path / "raw_cbis", cases=40, seed=0, reference=False, size=(48, 32))
    generate("mias", tmp_path / "raw_mias", cases=30, seed=0, reference=False, size=32)
    private, public = tmp_path / "data" / "cbis_ddsm", tmp_path / "data" / "mias"
    assert cbis_ddsm.main(["--raw", str(tmp_path / "raw_cbis"), "--out", str(private),
                           "--size", SIZE, SIZE]) == 0
    assert mias.main(["--raw", str(tmp_path / "raw_mias"), "--out", str(public), "--size", SIZE,
                      "--classes", "benign-malignant"]) == 0
    manifest = pd.read_csv(private / "manifest.csv")
    assert set(manifest["split"]) == {"train", "test"}  # the official split: the global test set
    assert set(pd.read_csv(public / "manifest.csv")["label"]) == {0, 1}

    # default dataset_dir: bundle_root/data, with cbis_ddsm/ and mias/ below it
    proc = run_bundle(BUNDLE / "configs" / "train.json", "--bundle_root", tmp_path, "--image_size", SIZE,
                      "--fl#rounds", "2", "--fl#num_clients", "4", "--fl#progress", "False",
                      "--fl#partition#min_size", "4", "--fl#partition#max_retries", "1000",
                      "--fl#train#batch_size", "4", "--fl#train#epochs", "1", "--fl#methods#0#refine_epochs", "1")
    # the console names the refined student's scores and the clusters' under PFedCDP's table
    assert "final models (final_metrics.csv" in proc.stdout and "  student: public_test accuracy" in proc.stdout
    assert "groups (groups.csv" in proc.stdout
    exp = tmp_path / "runs" / "cbis_ddsm_pfedcdp"
    summaries = {m: json.loads((exp / m / "summary.json").read_text()) for m in METHODS}
    cdp = summaries["pfedcdp"]
    assert cdp["num_clients"] == 4 and cdp["rounds"] == 2

    # every client trained (Dirichlet 0.5 with min_size left none empty) and has a cluster
    train = pd.read_csv(exp / "pfedcdp" / "train_metrics.csv", dtype={"client_id": str})
    assert sorted(train["client_id"].unique()) == ["0", "1", "2", "3"] and (train["steps"] > 0).all()
    report = cdp["method_report"]
    assert set(report["clusters"]) == {"0", "1", "2", "3"}
    assert set(report["clusters"].values()) <= {"high", "medium", "low"}
    weights = report["teacher_weights"]
    assert set(weights) == set(report["teachers"]) == set(report["clusters"].values())
    assert math.isclose(sum(weights.values()), 1.0, abs_tol=1e-6) and min(weights.values()) >= 0

    student = cdp["final_models"]["student"]
    assert set(SPLITS) <= set(student)
    assert 0 <= student["public_test"]["accuracy"]["mean"] <= 1
    assert cdp["public_dataset"]["split"]["method"] == "drawn"  # test_fraction, not MIAS's own split
    assert cdp["privacy"]["private"] and cdp["privacy"]["epsilon"] <= 5.0
    assert not summaries["fedavg"]["privacy"]["private"]  # no filters: FedAvg sends plain models

    profile = pd.read_csv(exp / "pfedcdp" / "profile.csv", dtype={"client_id": str})
    assert list(profile.columns) == ["client_id", "cpu", "memory", "battery", "network"]
    assert sorted(profile["client_id"]) == ["0", "1", "2", "3"]
    groups = pd.read_csv(exp / "pfedcdp" / "groups.csv", dtype={"client_id": str})
    assert dict(zip(groups["client_id"], groups["group"])) == report["clusters"]
    finals = pd.read_csv(exp / "pfedcdp" / "final_metrics.csv")
    assert set(SPLITS) <= set(finals["split"])
    assert {"student", "teacher_ensemble"} <= set(finals["model"])
    assert (exp / "pfedcdp" / "privacy.csv").is_file() and (exp / "pfedcdp" / "plots" / "groups.png").is_file()

    table = pd.read_csv(exp / "comparison.csv")
    assert list(dict.fromkeys(table["method"])) == METHODS
