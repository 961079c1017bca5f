"""bundles/abide_fedskd and bundles/derm7pt_fedskd run end to end through MONAI's bundle CLI
on fixture data: heterogeneous ResNet-10s, cross-validation, Local and Global Test, fairness."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from medfl.fixtures.bundles import BUNDLE_FIXTURES

BUNDLES = Path(__file__).resolve().parents[2] / "bundles"
METHODS = ["fedskd", "fedcross_het", "local"]


def _check_experiment(exp: Path, n_clients: int, region: bool) -> None:
    for fold in (0, 1):
        for label in METHODS:
            run = exp / f"fold_{fold}" / label
            summary = json.loads((run / "summary.json").read_text())
            assert summary["rounds"] == 2 and summary["num_clients"] == n_clients
            assert {"local_test", "cross_test"} <= set(summary["final"])
            pairs = pd.read_csv(run / "cross_test.csv")
            assert len(pairs) == 2 * n_clients * n_clients
        tm = pd.read_csv(exp / f"fold_{fold}" / "fedskd" / "train_metrics.csv")
        mutual = tm[tm["self_round"] == 0]
        assert len(mutual) and (mutual["skd_batch"] > 0).all() and (mutual["skd_pixel"] > 0).all()
        if region:
            assert (mutual["skd_region"] > 0).all()
        else:
            assert "skd_region" not in tm.columns
        widths = json.loads((exp / f"fold_{fold}" / "fedskd" / "config.json").read_text())["fl"]["client_models"]
        assert len({w["width"] for w in widths.values()}) > 1   # heterogeneous
    table = pd.read_csv(exp / "cv_table.csv")
    assert set(METHODS) <= set(table.iloc[:, 0].astype(str))
    assert (exp / "cv_table.md").is_file()
    cv = json.loads((exp / "cv_summary.json").read_text())
    assert cv["folds"] == 2 and set(cv["methods"]) == set(METHODS)
    for block in cv["methods"].values():   # both manifests carry sex: eq. 16 for every method
        assert {"local_test", "cross_test", "fairness"} <= set(block)
        assert set(block["fairness"]) == {"auc_M", "auc_F", "avg", "delta_auc"}


def test_abide_fedskd_bundle(tmp_path: Path, run_bundle) -> None:
    """The three commands of the bundle README's "Try it on fixture data", as written."""
    from bundle_readme import run_readme

    _, exp = run_readme("abide_fedskd", tmp_path)
    assert exp == tmp_path / "bundles" / "abide_fedskd" / "runs" / "abide_fedskd"
    _check_experiment(exp, 4, region=True)
    part = pd.read_csv(exp / "fold_1" / "fedskd" / "partition.csv", dtype=str)
    assert not (part["role"] == "global_test").any()   # no held-out set: CV uses every subject
    # from where the README's commands ran: the run's config.json holds their relative paths
    run_bundle(BUNDLES / "abide_fedskd" / "configs" / "inference.json", "--bundle_root", "bundles/abide_fedskd",
               "--dataset_dir", "bundles/abide_fedskd/data/try", "--spatial_size", "[16,16,16]", "--fold", "1",
               cwd=tmp_path)
    pred = pd.read_csv(exp / "fold_1" / "fedskd" / "predictions.csv")
    cases = BUNDLE_FIXTURES["abide_fedskd"].parts[0].cases
    assert len(pred) == 4 * cases and set(pred["prediction"]) <= {0, 1}


def test_derm7pt_fedskd_bundle(tmp_path: Path) -> None:
    """The three commands of the bundle README's "Try it on fixture data", as written."""
    from bundle_readme import run_readme

    _, exp = run_readme("derm7pt_fedskd", tmp_path)
    assert exp == tmp_path / "bundles" / "derm7pt_fedskd" / "runs" / "derm7pt_fedskd_alpha1.0"
    _check_experiment(exp, 3, region=False)


@pytest.mark.parametrize("bundle", ["abide_fedskd", "derm7pt_fedskd"])
def test_bundles_hold_the_paper_settings(bundle: str) -> None:
    from medfl.bundle import load_bundle_config
    from medfl.config import method_params

    fl = load_bundle_config(BUNDLES / bundle / "configs" / "train.json", {"dataset_dir": "/nonexistent"})
    entry = fl["methods"][0]
    assert entry["preset"] == {"abide_fedskd": "paper_asd", "derm7pt_fedskd": "paper_skin"}[bundle]
    skd = method_params(entry)   # the preset's values under the entry's own (atlas, iterations)
    assert entry["name"] == "fedskd" and [m["name"] for m in fl["methods"]] == METHODS
    assert skd["iterations"] == fl["methods"][1]["iterations"]   # FedCross-dagger steps as often
    assert fl["train"]["optimizer"] == "adam" and fl["train"]["lr"] == 1e-4 and fl["train"]["batch_size"] == 8
    assert fl["model"] == {"name": "resnet10", "width": 64} and fl["cv"]["folds"] == 5
    assert "cross_test" in fl["eval_splits"]
    n = fl["num_clients"]
    assert skd["iterations"] == 5 * n
    assert [w["width"] for w in fl["client_models"]] == [64, 62, 60, 58][:n]
    if bundle == "abide_fedskd":
        assert skd["gamma"] == 1.0 and skd["terms"] == ["batch", "pixel", "region"]
        assert skd["atlas"].endswith("manifest.csv") and fl["dataset"]["spatial_size"] == [48] * 3
    else:
        assert skd["gamma"] == 100.0 and skd["terms"] == ["batch", "pixel"] and fl["partition"]["alpha"] == 1.0
        assert fl["dataset"]["spatial_size"] == [224, 224]
