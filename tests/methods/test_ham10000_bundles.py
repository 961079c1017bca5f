"""bundles/ham10000 and bundles/ham10000_fedsdc run through MONAI's bundle CLI on a HAM10000
fixture in the Dataverse layout: the natural split by source collection, and FedSDC's NIID-1
(k images per class held out in whole lesions, Dirichlet 5.0) with FedSDC, FedSDC+ and the six
baselines over two seeds, then predictions on the held-out images."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from medfl.fixtures import generate
from medfl.prep.ham10000 import main as prep

BUNDLES = Path(__file__).resolve().parents[2] / "bundles"
METHODS = ["fedsdc", "fedsdc_plus", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedprox", "feddisco"]
SMALL = ("--image_size", "16", "--fl#rounds", "1", "--fl#progress", "False",
         "--fl#model", "{'name': 'small_cnn', 'width': 4}", "--fl#train#batch_size", "8")


@pytest.fixture(scope="module")
def ham_data(tmp_path_factory) -> Path:
    """The fixture prepared at 16 x 16 (shared by both bundle tests)."""
    root = tmp_path_factory.mktemp("ham")
    generate("ham10000", root / "raw", cases=400, seed=0, reference=False)
    assert prep(["--raw", str(root / "raw"), "--out", str(root / "data"), "--size", "16"]) == 0
    return root / "data"


def test_ham10000_bundle_one_client_per_source_collection(ham_data, tmp_path, run_bundle, monkeypatch):
    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")
    manifest = pd.read_csv(ham_data / "manifest.csv")
    run_bundle(BUNDLES / "ham10000" / "configs" / "train.json", "--bundle_root", tmp_path, "--dataset_dir",
               ham_data, *SMALL, "--fl#global_test_per_class", "5",
               "--fl#num_clients", str(manifest["site"].nunique()))
    exp = tmp_path / "runs" / "ham10000"
    part = pd.read_csv(exp / "partition.csv", dtype={"client_id": str, "client_name": str}, keep_default_na=False)
    clients = part[part["role"] != "global_test"]
    assert set(clients["client_name"]) == set(manifest["site"])  # the `dataset` column's collections
    held = manifest.iloc[part.loc[part["role"] == "global_test", "row"]]
    assert held["label"].value_counts().min() >= 5 and set(held["label"]) == set(range(7))
    lesions = part.assign(lesion=manifest["subject_id"].to_numpy()[part["row"]])
    assert (lesions.groupby("lesion")["role"].apply(lambda r: (r == "global_test").nunique()) == 1).all()
    for label in ("fedavg", "local"):
        assert json.loads((exp / label / "summary.json").read_text())["rounds"] == 1


def test_ham10000_fedsdc_bundle_runs_every_method_over_seeds(ham_data, tmp_path, run_bundle, monkeypatch):
    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")
    proc = run_bundle(BUNDLES / "ham10000_fedsdc" / "configs" / "train.json", "--bundle_root", tmp_path,
                      "--dataset_dir", ham_data, *SMALL, "--fl#seeds", "[0, 1]", "--fl#global_test_per_class", "5",
                      "--fl#partition#min_size", "5")
    exp = tmp_path / "runs" / "ham10000_fedsdc"
    table = pd.read_csv(exp / "seeds_table.csv")
    assert list(table["method"]) == METHODS
    assert table["global_test: micro_f1"].str.fullmatch(r"\d\.\d{3} ± \d\.\d{3}").all()
    assert "2 seed(s) [0, 1]" in proc.stdout
    results = pd.read_csv(exp / "seeds_results.csv")
    assert set(results["seed"]) == {0, 1} and set(results["split"]) == {"global_test"}
    for seed in (0, 1):
        report = json.loads((exp / f"seed_{seed}" / "fedsdc_plus" / "summary.json").read_text())["method_report"]
        assert len(report["ensemble_heads"]) == 2 and len(report["head_widths"]) == 5  # ceil(0.3 x 5) of 5
    run_bundle(BUNDLES / "ham10000_fedsdc" / "configs" / "inference.json", "--bundle_root", tmp_path,
               "--dataset_dir", ham_data, "--image_size", "16")
    pred = pd.read_csv(exp / "seed_0" / "fedsdc_plus" / "predictions.csv", dtype={"sample_id": str})
    part = pd.read_csv(exp / "seed_0" / "partition.csv", dtype={"sample_id": str}, keep_default_na=False)
    assert set(pred["sample_id"]) == set(part.loc[part["role"] == "global_test", "sample_id"])
    assert [c for c in pred.columns if c.startswith("prob_")] == [f"prob_{c}" for c in
                                                                  ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc")]
