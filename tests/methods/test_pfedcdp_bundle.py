"""bundles/cbis_ddsm_pfedcdp runs through MONAI's bundle CLI: CBIS-DDSM fixture clients
(official test split as the global test), a MIAS benign-vs-malignant fixture as the
coordinator's public set, PFedCDP with the paper's privacy next to FedAvg and Centralized."""

from __future__ import annotations

import json
import math

import pandas as pd
import pytest

# the README prepares at 16 px: there the paper's CNNs are exactly the paper's (their 4 x 4 pool is the identity)
METHODS = ["pfedcdp", "fedavg", "centralized"]
SPLITS = ("public_test", "local_test", "global_test")
CLIENTS = {str(c) for c in range(10)}   # the bundle's default num_clients


@pytest.mark.plots
def test_cbis_ddsm_pfedcdp_bundle(tmp_path):
    """The three commands of the bundle README's "Try it on fixture data", as written: 800
    CBIS-DDSM mammograms (the training share split over the default 10 clients by Dirichlet
    0.5, at least 20 each; the official test split as the global test) and 30 MIAS images
    of which 16 are benign or malignant, both prepared at 16 x 16, two rounds."""
    from bundle_readme import run_readme

    procs, exp = run_readme("cbis_ddsm_pfedcdp", tmp_path)
    proc = procs[-1]
    assert exp == tmp_path / "bundles" / "cbis_ddsm_pfedcdp" / "runs" / "cbis_ddsm_pfedcdp"
    private, public = (tmp_path / "bundles" / "cbis_ddsm_pfedcdp" / "data" / "try" / d for d in ("cbis_ddsm", "mias"))
    manifest = pd.read_csv(private / "manifest.csv")
    assert set(manifest["split"]) == {"train", "test"}  # the official split: the global test set
    assert set(pd.read_csv(public / "manifest.csv")["label"]) == {0, 1}

    # the console names the refined student's scores and the clusters' under PFedCDP's table
    assert "final models (final_metrics.csv" in proc.stdout and "  student: public_test accuracy" in proc.stdout
    assert "groups (groups.csv" in proc.stdout
    summaries = {m: json.loads((exp / m / "summary.json").read_text()) for m in METHODS}
    cdp = summaries["pfedcdp"]
    assert cdp["num_clients"] == 10 and cdp["rounds"] == 2

    # every client trained (Dirichlet 0.5 with min_size left none empty) and has a cluster
    train = pd.read_csv(exp / "pfedcdp" / "train_metrics.csv", dtype={"client_id": str})
    assert set(train["client_id"]) == CLIENTS and (train["steps"] > 0).all()
    report = cdp["method_report"]
    assert set(report["clusters"]) == CLIENTS
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
    assert set(profile["client_id"]) == CLIENTS
    groups = pd.read_csv(exp / "pfedcdp" / "groups.csv", dtype={"client_id": str})
    assert dict(zip(groups["client_id"], groups["group"])) == report["clusters"]
    finals = pd.read_csv(exp / "pfedcdp" / "final_metrics.csv")
    assert set(SPLITS) <= set(finals["split"])
    assert {"student", "teacher_ensemble"} <= set(finals["model"])
    assert (exp / "pfedcdp" / "privacy.csv").is_file() and (exp / "pfedcdp" / "plots" / "groups.png").is_file()

    table = pd.read_csv(exp / "comparison.csv")
    assert list(dict.fromkeys(table["method"])) == METHODS
