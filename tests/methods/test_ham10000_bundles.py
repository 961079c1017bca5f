"""bundles/ham10000 and bundles/ham10000_fedsdc run through MONAI's bundle CLI on a HAM10000
fixture in the Dataverse layout: the natural split by source collection, and FedSDC's NIID-1
(k images per class held out in whole lesions, Dirichlet 5.0) with FedSDC, FedSDC+ and the six
baselines over two seeds, then predictions on the held-out images."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

BUNDLES = Path(__file__).resolve().parents[2] / "bundles"
METHODS = ["fedsdc", "fedsdc_plus", "fedavgm", "fedadam", "fedyogi", "fedadagrad", "fedprox", "feddisco"]


def test_ham10000_bundle_one_client_per_source_collection(tmp_path):
    """The three commands of the bundle README's "Try it on fixture data", as written."""
    from bundle_readme import run_readme

    _, exp = run_readme("ham10000", tmp_path)
    assert exp == tmp_path / "bundles" / "ham10000" / "runs" / "ham10000"
    manifest = pd.read_csv(tmp_path / "bundles" / "ham10000" / "data" / "try" / "manifest.csv")
    part = pd.read_csv(exp / "partition.csv", dtype={"client_id": str, "client_name": str}, keep_default_na=False)
    clients = part[part["role"] != "global_test"]
    assert set(clients["client_name"]) == set(manifest["site"])  # the `dataset` column's collections
    held = manifest.iloc[part.loc[part["role"] == "global_test", "row"]]
    assert held["label"].value_counts().min() >= 30 and set(held["label"]) == set(range(7))
    lesions = part.assign(lesion=manifest["subject_id"].to_numpy()[part["row"]])
    assert (lesions.groupby("lesion")["role"].apply(lambda r: (r == "global_test").nunique()) == 1).all()
    for label in ("fedavg", "local"):
        assert json.loads((exp / label / "summary.json").read_text())["rounds"] == 1


def test_ham10000_fedsdc_bundle_runs_every_method_over_seeds(tmp_path, run_bundle):
    """The three commands of the bundle README's "Try it on fixture data", as written (two
    seeds, one round), then its inference config."""
    from bundle_readme import run_readme

    procs, exp = run_readme("ham10000_fedsdc", tmp_path)
    assert exp == tmp_path / "bundles" / "ham10000_fedsdc" / "runs" / "ham10000_fedsdc"
    table = pd.read_csv(exp / "seeds_table.csv")
    assert list(table["method"]) == METHODS
    assert table["global_test: micro_f1"].str.fullmatch(r"\d\.\d{3} ± \d\.\d{3}").all()
    assert "2 seed(s) [0, 1]" in procs[-1].stdout
    results = pd.read_csv(exp / "seeds_results.csv")
    assert set(results["seed"]) == {0, 1} and set(results["split"]) == {"global_test"}
    for seed in (0, 1):
        report = json.loads((exp / f"seed_{seed}" / "fedsdc_plus" / "summary.json").read_text())["method_report"]
        assert len(report["ensemble_heads"]) == 2 and len(report["head_widths"]) == 5  # ceil(0.3 x 5) of 5
    # from where the README's commands ran: the run's config.json holds their relative paths
    run_bundle(BUNDLES / "ham10000_fedsdc" / "configs" / "inference.json", "--bundle_root", "bundles/ham10000_fedsdc",
               "--dataset_dir", "bundles/ham10000_fedsdc/data/try", "--image_size", "16", cwd=tmp_path)
    pred = pd.read_csv(exp / "seed_0" / "fedsdc_plus" / "predictions.csv", dtype={"sample_id": str})
    part = pd.read_csv(exp / "seed_0" / "partition.csv", dtype={"sample_id": str}, keep_default_na=False)
    assert set(pred["sample_id"]) == set(part.loc[part["role"] == "global_test", "sample_id"])
    assert [c for c in pred.columns if c.startswith("prob_")] == [f"prob_{c}" for c in
                                                                  ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc")]
