"""bundles/pathmnist_fedtpf and bundles/ham10000's FedTPF configuration through MONAI's bundle
CLI on fixtures in the real download layouts (a MedMNIST npz, the HAM10000 Dataverse folder):
every split and participation is selectable, FedTPF, FedFed and FedAvg run on the same split,
FedTPF's release is recorded with its epsilon, and predictions come out of the inference config."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from medfl.fixtures import generate
from medfl.prep.medmnist import main as prep_medmnist

BUNDLES = Path(__file__).resolve().parents[2] / "bundles"
TINY = ("--fl#rounds", "3", "--distill_rounds", "2", "--fl#progress", "False",
        "--fl#model", "{'name': 'small_cnn', 'width': 4}", "--fl#train#batch_size", "16",
        "--fl#methods#0#vae_width", "4", "--fl#methods#0#critic_width", "4", "--fl#methods#1#vae_width", "4",
        "--fl#methods#0#distill_steps", "4", "--fl#methods#1#distill_steps", "4")


@pytest.fixture(scope="module")
def pathmnist(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pathmnist")
    generate("medmnist", root / "raw", cases=300, seed=0, flag="pathmnist")
    assert prep_medmnist(["--raw", str(root / "raw"), "--out", str(root / "data"), "--flag", "pathmnist"]) == 0
    return root / "data"


@pytest.mark.parametrize("split, participation", [("subset", 0.4), ("label_skew_2", 0.8)])
def test_pathmnist_bundle_runs_the_three_methods_on_a_selected_split(pathmnist, tmp_path, run_bundle, monkeypatch,
                                                                     split, participation):
    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")
    run_bundle(BUNDLES / "pathmnist_fedtpf" / "configs" / "train.json", "--bundle_root", tmp_path,
               "--dataset_dir", pathmnist, "--split", split, "--participation", str(participation),
               "--fl#num_clients", "9", *TINY)
    exp = tmp_path / "runs" / f"pathmnist_fedtpf_{split}_c{participation}"
    config = json.loads((exp / "config.json").read_text())["fl"]
    assert config["partition"]["name"] == {"subset": "subset", "label_skew_2": "label_skew"}[split]
    assert config["fraction"] == participation
    part = pd.read_csv(exp / "partition.csv", dtype={"client_id": str}, keep_default_na=False)
    manifest = pd.read_csv(pathmnist / "manifest.csv", keep_default_na=False)
    held = manifest.iloc[part.loc[part["role"] == "global_test", "row"]]
    assert set(held["split"]) == {"test"}                                # the official test split
    labels = part[part["role"] != "global_test"].groupby("client_id")["label"]   # a client's whole share
    if split == "subset":
        assert (labels.apply(lambda s: s.value_counts(normalize=True).iloc[0]) >= 0.9).all()
    else:
        assert (labels.nunique() <= 2).all()
    for method in ("fedtpf", "fedfed", "fedavg"):
        summary = json.loads((exp / method / "summary.json").read_text())
        assert summary["rounds"] == 3
    for method in ("fedtpf", "fedfed"):
        privacy = pd.read_csv(exp / method / "privacy.csv")
        assert len(privacy) == 9 and (privacy["epsilon"] <= 8.0).all() and set(privacy["round"]) == {3}
    run_bundle(BUNDLES / "pathmnist_fedtpf" / "configs" / "inference.json", "--bundle_root", tmp_path,
               "--dataset_dir", pathmnist, "--split", split, "--participation", str(participation))
    pred = pd.read_csv(exp / "fedtpf" / "predictions.csv")
    assert len(pred) and [c for c in pred.columns if c.startswith("prob_")][:1] == ["prob_adipose"]


def test_an_unknown_split_stops_with_the_list(pathmnist, tmp_path, run_bundle, monkeypatch):
    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")
    proc = run_bundle(BUNDLES / "pathmnist_fedtpf" / "configs" / "train.json", "--bundle_root", tmp_path,
                      "--dataset_dir", pathmnist, "--split", "dirichlet_0.2", *TINY, check=False)
    assert proc.returncode != 0
    assert "split: 'dirichlet_0.2' is not one of 'dirichlet_0.1', 'dirichlet_0.3'" in proc.stderr


def test_ham10000_fedtpf_configuration(tmp_path, run_bundle, monkeypatch):
    from medfl.prep.ham10000 import main as prep_ham

    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")
    generate("ham10000", tmp_path / "raw", cases=200, seed=0, reference=False)
    assert prep_ham(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "data"), "--size", "16"]) == 0
    manifest = pd.read_csv(tmp_path / "data" / "manifest.csv")
    run_bundle(BUNDLES / "ham10000" / "configs" / "fedtpf.json", "--bundle_root", tmp_path, "--dataset_dir",
               tmp_path / "data", "--image_size", "16", "--fl#global_test_per_class", "3",
               "--fl#num_clients", str(manifest["site"].nunique()), *TINY)
    run = tmp_path / "runs" / "ham10000_fedtpf" / "fedtpf"
    report = json.loads((run / "summary.json").read_text())["method_report"]
    assert report["transition"]["release_round"] == 3 and report["release"]["x_norm_mean"] > 0
    assert json.loads((run / "summary.json").read_text())["privacy"]["epsilon"] <= 8.0
