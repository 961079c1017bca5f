"""PFedCDP's mechanisms made visible (issue 37): the observables of every run (mechanisms.csv,
the report's ``mechanisms`` block, the warnings) recomputed from the run's other outputs; the
presets resolved from config.json; the options the paper's readings need (noise_multiplier
with its recorded epsilon, quantizing the update or the weights, uniform cluster averages,
SupCon's reduction and two views) checked by hand; the student per epoch (student_metrics.csv)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from medfl.config import build_method, method_preset, method_train, preset_origin, resolve_config
from medfl.engine.client import run_client_update
from medfl.experiment import run_experiment
from medfl.messages import Reply
from medfl.method import MethodConfigError
from medfl.models.registry import build_model
from medfl_plugins.pfedcdp import (AUTHORS_NOISE_MULTIPLIER, DEFAULT_CLUSTER_MODELS, PFedCDP, personal_observables,
                                   quantization_error)

from test_pfedcdp import SCORES_BY_CLIENT, _fl, _run


def _opacus_epsilon(sigma: float, releases: int, delta: float) -> float:
    """The epsilon of ``releases`` Gaussian releases at sample rate 1, straight from Opacus."""
    from opacus.accountants import RDPAccountant

    acc = RDPAccountant()
    for _ in range(releases):
        acc.step(noise_multiplier=sigma, sample_rate=1.0)
    return float(acc.get_epsilon(delta))


# ------------------------------------------------------------------ pieces by hand
def test_personal_observables_by_hand() -> None:
    prev = {"w": torch.tensor([0.5, -0.5, 2.0, 0.0]), "b": torch.tensor([1.0])}
    new = {"w": torch.tensor([0.5, -1.5, 3.0, 0.25]), "b": torch.tensor([1.0])}
    masks = {"w": torch.tensor([True, True, False, False]), "b": torch.tensor([True])}
    got = personal_observables(new, prev, masks)
    assert got["own_norm"] == pytest.approx(math.sqrt(0.25 + 2.25 + 9 + 0.0625 + 1))
    assert got["above_one"] == pytest.approx(2 / 5)                      # -1.5 and 3.0 (1.0 is not above)
    assert got["personal_norm"] == pytest.approx(math.sqrt(0.25 + 2.25 + 1))       # 0.5, -1.5, 1.0
    assert got["personal_norm_prev"] == pytest.approx(math.sqrt(0.25 + 0.25 + 1))   # 0.5, -0.5, 1.0
    assert got["personal_drift"] == pytest.approx(1.0 / math.sqrt(1.5))             # only -0.5 -> -1.5 moved
    first = personal_observables(new, None, None)                        # a client's first round
    assert set(first) == {"own_norm", "above_one"}


def test_quantization_error_by_hand() -> None:
    """Ranges 3 and 0 over 4 + 2 entries at 2 bits: steps 1 and 0, error sqrt(4 / 12)."""
    state = {"a": torch.tensor([0.0, 1.0, 2.0, 3.0]), "b": torch.tensor([5.0, 5.0]), "n": torch.tensor([7])}
    assert quantization_error(state, 2) == pytest.approx(math.sqrt(4 / 12))
    assert quantization_error(state, 8) == pytest.approx(math.sqrt(4 * (3 / 255) ** 2 / 12))


@pytest.mark.parametrize("kwargs, match", [
    ({"noise_multiplier": 1.0}, "exactly one of epsilon"),
    ({"epsilon": None, "noise_multiplier": 0}, "noise_multiplier must be a number > 0"),
    ({"quantize": "codes"}, "quantize must be one of update, weights"),
    ({"quantize": "weights"}, "quantize 'weights' needs the update without DP"),
    ({"cluster_average": "median"}, "cluster_average must be one of weighted, uniform"),
    ({"supcon_reduction": "max"}, "supcon_reduction must be one of sum, mean"),
    ({"supcon_views": 3}, "supcon_views must be 1 or 2"),
    ({"supcon_views": True}, "supcon_views must be 1 or 2"),
])
def test_new_options_are_checked(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(MethodConfigError, match=match):
        PFedCDP(**kwargs)


def test_default_filters_follow_the_noise_and_quantize_options() -> None:
    assert PFedCDP().default_filters()[0]["epsilon"] == 5.0
    assert PFedCDP().default_filters()[1] == {"name": "quantize", "bits": 8, "update": True}
    nm = PFedCDP(epsilon=None, noise_multiplier=0.5).default_filters()[0]
    assert nm["noise_multiplier"] == 0.5 and "epsilon" not in nm and nm["clip"] == 2.5
    assert PFedCDP(epsilon=None).default_filters() == [{"name": "quantize", "bits": 8, "update": True}]
    assert PFedCDP(epsilon=None, quantize="weights").default_filters()[0]["update"] is False


# ------------------------------------------------------------------ presets
def test_presets_resolve_to_the_documented_values() -> None:
    paper = build_method({"name": "pfedcdp", "preset": "paper"})
    assert (paper.epsilon, paper.noise_multiplier, paper.clip, paper.bits, paper.quantize) == (5.0, None, 2.5, 8,
                                                                                               "update")
    assert paper.cluster_models == DEFAULT_CLUSTER_MODELS and paper.student_model == {"name": "pfedcdp_student"}
    assert (paper.supcon_reduction, paper.supcon_views, paper.cluster_average) == ("sum", 2, "weighted")
    assert (paper.teacher_weights, paper.feature_shap) == ("uniform", "printed")
    train = method_train({"train": {"epochs": 1, "lr": 0.05, "dp": None}}, {"name": "pfedcdp", "preset": "paper"})
    assert (train["epochs"], train["batch_size"], train["optimizer"], train["lr"]) == (20, 64, "adam", 1e-3)
    authors = build_method({"name": "pfedcdp", "preset": "authors"})
    assert authors.epsilon is None and authors.noise_multiplier == pytest.approx(
        math.sqrt(2 * math.log(1.25 / 1e-5)) / 5) == pytest.approx(0.969, abs=5e-4)
    assert authors.teacher_weights == "fixed" and (authors.kd_temperature, authors.kd_lambda) == (3.0, 0.3)
    train = method_train({"train": {"epochs": 1, "lr": 0.05, "dp": None}}, {"name": "pfedcdp", "preset": "authors"})
    assert (train["epochs"], train["optimizer"]) == (5, "adam")
    # the authors' sigma composed over the paper's 20 rounds: epsilon about 31
    assert _opacus_epsilon(AUTHORS_NOISE_MULTIPLIER, 20, 1e-5) == pytest.approx(31.43, abs=0.01)


# ------------------------------------------------------------------ a run with the authors' noise
@pytest.fixture(scope="module")
def authors_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], str]:
    """2 rounds, 4 clients, the 'authors' preset (sigma 0.969 every round), the paper's 2-view
    summed SupCon; the slow settings overridden (feature Shapley values off, 1 local epoch)."""
    tmp = tmp_path_factory.mktemp("cdp_mech")
    fl = _fl(tmp, capabilities=SCORES_BY_CLIENT, preset="authors", feature_shap="off", refine_epochs=2,
             train={"epochs": 1, "batch_size": 8})
    with pytest.MonkeyPatch.context() as mp:
        import io
        import sys

        err = io.StringIO()
        mp.setattr(sys, "stderr", err)
        out = run_experiment(resolve_config(fl))
    run = Path(out["dir"]) / "pfedcdp"
    return run, json.loads((run / "summary.json").read_text()), err.getvalue()


def test_the_authors_preset_is_recorded_and_spends_its_true_epsilon(authors_run: tuple[Path, dict, str]) -> None:
    run, summary, _ = authors_run
    preset = json.loads((run / "config.json").read_text())["preset"]
    assert preset["name"] == "authors" and "shadhin39/PFedCDP" in preset["source"]
    # the code's formula at the paper's epsilon, recorded as such: the code itself runs at epsilon 8
    assert preset["values"]["noise_multiplier"]["value"] == AUTHORS_NOISE_MULTIPLIER
    assert preset["values"]["noise_multiplier"]["source"].startswith("the authors' differential_privacy.py")
    assert "epsilon 8 (sigma 0.606)" in preset["values"]["noise_multiplier"]["source"]
    assert preset["values"]["feature_shap"] == {"value": "off", "from": "config"}
    assert preset["values"]["clip"]["source"].startswith("the authors' code clips each weight tensor")
    assert preset["train"]["epochs"] == {"value": 1, "from": "config"}
    authors = method_preset({"name": "pfedcdp", "preset": "authors"})
    assert preset["train"]["optimizer"] == {"value": "adam", **preset_origin(authors, "train.optimizer", False)}
    assert preset["experiment"]["rounds"] == 20
    privacy = pd.read_csv(run / "privacy.csv", dtype={"client_id": str})
    assert (privacy["noise_multiplier"] == AUTHORS_NOISE_MULTIPLIER).all()
    last = privacy[privacy["round"] == 2]
    assert len(last) == 4
    for eps in last["epsilon"]:                        # two releases each, composed: not the per-round 5
        assert eps == pytest.approx(_opacus_epsilon(AUTHORS_NOISE_MULTIPLIER, 2, 1e-5), rel=1e-6)
    assert summary["privacy"]["epsilon"] == pytest.approx(7.346, abs=1e-3)


def test_mechanisms_equal_a_recomputation_from_the_run(authors_run: tuple[Path, dict, str]) -> None:
    run, summary, _ = authors_run
    mech = pd.read_csv(run / "mechanisms.csv", dtype={"id": str, "text": str}, keep_default_na=False,
                       na_values=[""])
    train = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
    groups = dict(pd.read_csv(run / "groups.csv", dtype={"client_id": str})[["client_id", "group"]].values)
    privacy = pd.read_csv(run / "privacy.csv", dtype={"client_id": str})

    def value(r: int, mechanism: str, who: str, name: str) -> float:
        row = mech[(mech["round"] == r) & (mech["mechanism"] == mechanism) & (mech["id"] == who)
                   & (mech["name"] == name)]
        assert len(row) == 1, (r, mechanism, who, name)
        return float(row["value"].item())

    for r in (1, 2):
        part = train[train["round"] == r]
        for cluster in ("high", "medium", "low"):
            members = part[part["client_id"].map(groups) == cluster]
            n = members["num_examples"].astype(float)
            w2 = float(((n / n.sum()) ** 2).sum())
            spec = {"spatial_dims": 2, "in_channels": 1, "num_classes": 2, **DEFAULT_CLUSTER_MODELS[cluster]}
            model = build_model(spec)
            head = {id(p) for p in model.head.parameters()}
            d = sum(p.numel() for p in model.parameters() if id(p) not in head)
            sigma = float(privacy[privacy["round"] == r]["noise_multiplier"].iloc[0])
            clip = float(privacy["clip"].iloc[0])
            assert value(r, "dp_noise", cluster, "sigma") == pytest.approx(sigma)
            assert value(r, "dp_noise", cluster, "coordinates") == d
            assert value(r, "dp_noise", cluster, "weights_sq_sum") == pytest.approx(w2)
            assert value(r, "dp_noise", cluster, "noise_norm") == pytest.approx(sigma * clip * math.sqrt(d * w2))
            assert value(r, "dp_noise", cluster, "noise_to_update_min") == pytest.approx(sigma * math.sqrt(d * w2))
            # the received (noised) averaged update is about as large as the noise: the noise is all of it
            assert value(r, "dp_noise", cluster, "received_update_norm") == pytest.approx(
                sigma * clip * math.sqrt(d * w2), rel=0.05)
        for _, row in part.iterrows():
            cid = row["client_id"]
            for name in ("own_norm", "above_one", "personal_fraction"):
                assert value(r, "personalization", cid, name) == pytest.approx(row[name], rel=1e-12), (r, cid, name)
            if r == 2:
                for name in ("personal_norm", "personal_norm_prev", "personal_drift"):
                    assert value(r, "personalization", cid, name) == pytest.approx(row[name], rel=1e-12)
    # the symptom the issue measured: none of a client's weights above 1 after round 1, most after round 2
    assert (train[train["round"] == 1]["above_one"] == 0).all()
    assert (train[train["round"] == 2]["above_one"] > 0.3).all()
    report = summary["method_report"]["mechanisms"]
    assert report["dp"]["sigma_per_round"] == AUTHORS_NOISE_MULTIPLIER and report["dp"]["epsilon_target"] is None
    assert report["noise_drowns_update_from_round"] == {"high": 1, "medium": 1, "low": 1}
    assert report["own_weights_above_one_by_round"]["0"]["2"] == pytest.approx(
        float(train[(train["round"] == 2) & (train["client_id"] == "0")]["above_one"].item()))


def test_the_warnings_say_the_noise_drowns_the_update_and_the_weights_blew_up(
        authors_run: tuple[Path, dict, str]) -> None:
    run, summary, err = authors_run
    warned = [w["warning"] for w in summary["warnings"]]
    noise = [w for w in warned if "the DP noise in the averaged extractor update" in w]
    assert len(noise) == 3 and all("A ratio of 1 needs sigma <=" in w for w in noise)   # once per cluster
    assert [w["round"] for w in summary["warnings"] if w["warning"] in noise] == [1, 1, 1]
    assert any(w.startswith("the personal models blew up") for w in warned)
    assert err.count("the DP noise in the averaged extractor update") == 3


def test_the_student_per_epoch_ends_where_the_final_scores_are(authors_run: tuple[Path, dict, str]) -> None:
    run, summary, err = authors_run
    table = pd.read_csv(run / "student_metrics.csv")
    test = table[table["split"] == "public_test"]
    assert test["epoch"].tolist() == [0, 1, 2]
    trained = table[table["split"] == "public_train"]
    assert trained["epoch"].tolist() == [1, 2] and (trained["steps"] > 0).all()
    alpha = 0.5    # eq. 18 with the logged terms (feature Shapley values off: no extra factor)
    assert trained["loss"].tolist() == pytest.approx(((1 - alpha) * trained["supcon"] + alpha * trained["kd"]).tolist())
    final = pd.read_csv(run / "final_metrics.csv")
    student = final[(final["model"] == "student") & (final["split"] == "public_test")].iloc[0]
    for metric in ("accuracy", "f1", "micro_f1", "auc"):
        assert test[metric].iloc[-1] == pytest.approx(student[metric], rel=1e-12, nan_ok=True), metric
    refine = summary["method_report"]["refine"]
    assert (refine["supcon_reduction"], refine["supcon_views"]) == ("sum", 2)
    # the synthetic public set has no random transforms: the run says its two views are one image
    assert "same image" in refine["views_identical"] and "supcon_views 2" in err


# ------------------------------------------------------------------ options at the client and the coordinator
def test_quantizing_the_update_errs_far_less_than_quantizing_the_weights(tmp_path: Path) -> None:
    """Eq. 14 quantizes the update: without DP, 8 bits over the update's range against over the
    weights' range, on the same client's reply of round 1."""
    errors = {}
    for mode in ("update", "weights"):
        run = _run(tmp_path / mode, capabilities=SCORES_BY_CLIENT, epsilon=None, quantize=mode)
        ins = run.coordinator.configure_round(1)
        ctx = run.context("0", 1)
        reply = run_client_update(run.client_method, ctx, ins["0"], filters=run.privacy.chain)
        back = run.unfilter(1, ins, {"0": reply})["0"].payload["extractor"]
        sent = ctx.state["extractor"]                      # what the client returned before the filters
        sent_update = {k: sent[k] - ins["0"].payload["extractor"][k] for k in sent}
        errors[mode] = math.sqrt(sum(float(((back[k] - sent[k]).double() ** 2).sum()) for k in sent))
        errors[mode + "_predicted"] = quantization_error(sent_update if mode == "update" else sent, 8)
        errors["update_norm"] = math.sqrt(sum(float((v.double() ** 2).sum()) for v in sent_update.values()))
    assert errors["update"] < errors["weights"] / 5
    assert errors["weights"] > 0.3 * errors["update_norm"] > 10 * errors["update"]
    for mode in ("update", "weights"):                     # the coordinator's estimate is the right size
        assert 0.5 < errors[mode] / errors[mode + "_predicted"] < 2.0


@pytest.mark.parametrize("average", ["weighted", "uniform"])
def test_cluster_average_by_hand(tmp_path: Path, average: str) -> None:
    run = _run(tmp_path, capabilities=SCORES_BY_CLIENT, epsilon=None, server_classifier="init",
               cluster_average=average)
    m = run.coordinator
    old = {k: v.clone() for k, v in m.extractors["medium"].items()}
    replies = {cid: Reply(payload={"extractor": {k: v + shift for k, v in old.items()}}, num_examples=n,
                          metrics={"personal_fraction": 0.0, "own_norm": 1.0, "above_one": 0.0})
               for cid, shift, n in (("1", 1.0, 30), ("2", 3.0, 10))}       # clients 1 and 2: the medium cluster
    m.server_update(1, replies)
    want = 1.5 if average == "weighted" else 2.0            # (30 x 1 + 10 x 3) / 40, or (1 + 3) / 2
    for k, v in m.extractors["medium"].items():
        assert torch.allclose(v, old[k] + want), k
    w2 = (0.75 ** 2 + 0.25 ** 2) if average == "weighted" else 0.5
    rows = {r["mechanism"]: r for r in m.mechanisms(1) if r.get("id") == "medium"}
    assert rows["dp_noise"]["weights_sq_sum"] == pytest.approx(w2) and rows["dp_noise"]["noise_to_update_min"] == 0.0
    d = rows["dp_noise"]["coordinates"]
    assert rows["dp_noise"]["received_update_norm"] == pytest.approx(want * math.sqrt(d))
    assert rows["quantization"]["target"] == "update"
    assert not m.mechanism_warnings(1)                     # no noise, nothing blew up
