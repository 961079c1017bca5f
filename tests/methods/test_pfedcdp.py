"""PFedCDP (paper 000): Fisher masks that take effect (the authors' bug), eqs. 1-2 clusters from
the profile exchange, what leaves a client (the extractor's filtered update; four scores),
teacher weights (Shapley, uniform, the authors' fixed ones), the post-hoc student scored on the
public and the clients' test splits, resume, and config errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from medfl.capability import SCORES
from medfl.config import resolve_config
from medfl.engine.client import run_client_update
from medfl.engine.runner import Run
from medfl.experiment import resume, run_experiment
from medfl.engine.data import split_data
from medfl.engine.runner import build_source
from medfl.method import MethodConfigError
from medfl.models.registry import build_seeded
from medfl_plugins.pfedcdp import method as cdp
from medfl_plugins.pfedcdp import PFedCDP, fisher_information, fisher_masks, mix_extractor


def _fl(tmp: Path, **method: Any) -> dict[str, Any]:
    return {
        "name": "cdp", "output_dir": str(tmp / "runs"), "seed": 0, "rounds": 2, "num_clients": 4, "progress": False,
        "dataset": {"name": "synthetic2d", "root": str(tmp / "data"), "num_samples": 96, "num_classes": 2,
                    "image_size": 12, "noise": 0.5},
        "public_dataset": {"name": "synthetic2d", "root": str(tmp / "public"), "num_samples": 40, "num_classes": 2,
                           "image_size": 12, "noise": 0.5, "seed": 1},
        "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8},
        "model": {"name": "small_cnn", "width": 4},
        "train": {"batch_size": 8, "lr": 0.05},
        "methods": [{"name": "pfedcdp", "refine_epochs": 1, **method}],
    }


# the scores of the four clients: overall 0.75 (high), 0.5 (medium), 0.45 (medium), 0.2 (low)
SCORES_BY_CLIENT = {"0": {"cpu": 1.0, "memory": 0.5, "battery": 1.0, "network": 0.5},
                    "1": {"cpu": 0.5, "memory": 0.5, "battery": 0.5, "network": 0.5},
                    "2": {"cpu": 0.2, "memory": 0.6, "battery": 0.5, "network": 0.5},
                    "3": {"cpu": 0.2, "memory": 0.2, "battery": 0.2, "network": 0.2}}


def _run(tmp: Path, **method: Any) -> Run:
    """A prepared run of PFedCDP (its profile exchange done), nothing trained yet."""
    cfg = resolve_config(_fl(tmp, **method))
    data = split_data(build_source(cfg["dataset"]), cfg)
    run = Run(cfg, cfg["methods"][0], tmp / "run", data)
    run.prepare()
    run.profile()
    return run


# ------------------------------------------------------------------ eqs. 3-6


def test_fisher_masks_and_eq6_keep_own_values_above_the_threshold():
    own = {"w": torch.tensor([1.0, 2.0, 3.0, 4.0]), "b": torch.tensor([5.0])}
    glob = {"w": torch.tensor([10.0, 20.0, 30.0, 40.0]), "b": torch.tensor([50.0]),
            "bn.running_mean": torch.tensor([7.0])}
    fisher = {"w": torch.tensor([0.9, 0.1, 0.5, 0.0]), "b": torch.tensor([0.5])}
    masks = fisher_masks(fisher, threshold=0.5)       # F >= T is personal (ties too), zero never
    assert masks["w"].tolist() == [True, False, True, False] and masks["b"].tolist() == [True]
    mixed = mix_extractor(own, glob, masks)
    assert mixed["w"].tolist() == [1.0, 20.0, 3.0, 40.0]   # above: own value; below: global value
    assert mixed["b"].tolist() == [5.0]
    assert mixed["bn.running_mean"].tolist() == [7.0]      # buffers follow the global model
    # quantile form: the top 20 % of 10 entries = 2 entries; zero Fisher never personal
    f = {"a": torch.arange(10, dtype=torch.float32)}
    assert fisher_masks(f, keep=0.2)["a"].tolist() == [False] * 8 + [True, True]
    assert not fisher_masks({"a": torch.zeros(5)}, keep=0.5)["a"].any()
    with pytest.raises(ValueError, match="exactly one"):
        fisher_masks(f, keep=0.2, threshold=1.0)


def test_fisher_information_is_the_mean_squared_batch_gradient_of_the_log_likelihood():
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    batches = [(torch.randn(4, 3), torch.tensor([0, 1, 1, 0])), (torch.randn(4, 3), torch.tensor([1, 1, 0, 0]))]
    fisher, used = fisher_information(model, batches, ["weight", "bias"])
    assert used == 2
    want = torch.zeros(2, 3)
    for x, y in batches:
        model.zero_grad()
        (-torch.nn.functional.cross_entropy(model(x), y)).backward()
        want += model.weight.grad ** 2
    torch.testing.assert_close(fisher["weight"], want / 2)
    assert fisher_information(model, batches, ["weight"], max_batches=1)[1] == 1


def test_client_keeps_its_own_value_where_fisher_is_high_and_takes_the_global_one_elsewhere(tmp_path):
    """The authors' v1.7 clients apply the masks to their global weights (a no-op); here a client's reply (with
    extractor_epochs=0 nothing else changes its extractor) is exactly eq. 6."""
    run = _run(tmp_path, capabilities=SCORES_BY_CLIENT, extractor_epochs=0, epsilon=None, bits=None,
               fisher_keep=0.3)
    ins = run.coordinator.configure_round(1)
    cid = "1"
    spec = json.loads(ins[cid].config["spec"])
    g_ext, s_head = ins[cid].payload["extractor"], ins[cid].payload["server_head"]
    gen = torch.Generator().manual_seed(0)
    own = {k: v + torch.randn(v.shape, generator=gen) for k, v in g_ext.items()}
    head = {k: v.clone() for k, v in s_head.items()}
    ctx = run.context(cid, 1)
    ctx.state = {"extractor": own, "head": head}
    reply = run.client_method.client_update(ctx, ins[cid])
    got = reply.payload["extractor"]
    # the masks, computed independently on the client's own model
    model = build_seeded(spec, 0)
    model.load_state_dict({**own, **head})
    keys = [k for k, _ in model.named_parameters() if k in own]
    fisher, _ = fisher_information(model, run.context(cid, 1).loader("train", augment=False), keys)
    masks = fisher_masks(fisher, keep=0.3)
    kept = sum(int(m.sum()) for m in masks.values())
    total = sum(m.numel() for m in masks.values())
    assert 0 < kept < total
    assert reply.metrics["personal_fraction"] == pytest.approx(kept / total)
    for k in keys:
        assert torch.equal(got[k][masks[k]], own[k][masks[k]]), k          # above T: own value
        assert torch.equal(got[k][~masks[k]], g_ext[k][~masks[k]]), k      # below T: global value
    # the classifier trained (KD) and stayed at the client
    assert set(reply.payload) == {"extractor"}
    assert not any(torch.equal(ctx.state["head"][k], head[k]) for k in head)


# ------------------------------------------------------------------ eqs. 1-2 and what leaves a client


def test_profile_exchange_clusters_by_eq1_and_eq2(tmp_path):
    run = _run(tmp_path, capabilities=SCORES_BY_CLIENT, epsilon=None)
    m = run.coordinator
    assert m.client_groups() == {"0": "high", "1": "medium", "2": "medium", "3": "low"}
    assert m.scores["0"]["overall"] == pytest.approx(0.75) and m.scores["2"]["overall"] == pytest.approx(0.45)
    prof = pd.read_csv(tmp_path / "run" / "profile.csv", dtype={"client_id": str})
    assert list(prof.columns) == ["client_id", *SCORES]                      # only the four scores
    # weights and thresholds by hand, w = (0.3, 0.3, 0.1, 0.3): client 0 -> .3 + .15 + .1 + .15 = 0.70
    # >= T_H = 0.65 (high); client 1 -> 0.5 (medium); client 2 -> .06 + .18 + .05 + .15 = 0.44 < T_M = 0.45
    # (low); client 3 -> 0.2 (low)
    m2 = PFedCDP(capabilities=SCORES_BY_CLIENT, capability_weights=[0.3, 0.3, 0.1, 0.3], t_high=0.65,
                 t_medium=0.45, epsilon=None)
    m2.federation = m.federation
    m2.assign, m2.scores = {}, {}
    m2.server_profile({cid: dict(s) for cid, s in SCORES_BY_CLIENT.items()})
    assert m2.assign == {"0": "high", "1": "medium", "2": "low", "3": "low"}
    # a site that sends garbage or nothing lands in Low
    m2.server_profile({"0": {"cpu": 7.0, "memory": 1, "battery": 1, "network": 1}, "1": dict(SCORES_BY_CLIENT["1"])})
    assert m2.assign["0"] == "low" and m2.assign["1"] == "medium" and m2.assign["3"] == "low"


def test_a_deployed_client_measures_its_machine(tmp_path, monkeypatch):
    run = _run(tmp_path, epsilon=None)            # capabilities "auto": drawn in process
    ctx = run.context("0", 1)
    drawn = run.client_method.client_profile(ctx, run.coordinator.configure_profile()["0"])
    assert set(drawn) == set(SCORES) and all(0 <= v <= 1 for v in drawn.values())
    seen = {}

    def fake(coordinator, max_latency_ms):
        seen.update(coordinator=coordinator, max_latency_ms=max_latency_ms)
        return {k: 0.5 for k in SCORES}, {k: "test" for k in SCORES}

    monkeypatch.setattr(cdp, "measure_capabilities", fake)
    ctx.deployed, ctx.coordinator = True, "10.0.0.1:9092"
    assert run.client_method.client_profile(ctx, run.coordinator.configure_profile()["0"]) == {k: 0.5 for k in SCORES}
    assert seen == {"coordinator": "10.0.0.1:9092", "max_latency_ms": 200.0}


def test_only_the_extractor_update_leaves_a_client_noised_and_quantized(tmp_path):
    run = _run(tmp_path, capabilities=SCORES_BY_CLIENT)       # the paper's epsilon 5, C2 2.5, 8 bits
    assert [f["name"] for f in run.privacy.chain.specs()] == ["dp_gaussian", "quantize"]
    ins = run.coordinator.configure_round(1)
    cid = "0"
    ctx = run.context(cid, 1)
    reply = run_client_update(run.client_method, ctx, ins[cid], filters=run.privacy.chain)
    model = build_seeded(json.loads(ins[cid].config["spec"]), 0)
    assert set(reply.payload) == {"extractor"}
    sent = reply.payload["extractor"]
    assert set(sent) == set(model.body_keys())                # no classifier key
    for k, v in sent.items():                                 # 8-bit codes with their range, no float state
        assert isinstance(v, dict) and v["codes"].dtype == torch.uint8, k
    assert set(ctx.state) == {"extractor", "buffers", "head"} and set(ctx.state["head"]) == set(model.head_keys())
    # the coordinator undoes the chain: a full extractor state, off the reference by the noised update
    back = run.unfilter(1, ins, {cid: reply})[cid].payload["extractor"]
    assert set(back) == set(ins[cid].payload["extractor"])
    delta = torch.cat([(back[k] - ins[cid].payload["extractor"][k]).reshape(-1) for k in back])
    assert float(delta.std()) > 1.0        # sigma * C2 per coordinate: the paper's privacy drowns the update


# ------------------------------------------------------------------ a run, the post-hoc stage, resume


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("cdp")
    with pytest.MonkeyPatch.context() as mp:      # the run draws its plots (groups.png is checked)
        mp.delenv("MEDFL_NO_PLOTS", raising=False)
        out = run_experiment(resolve_config(_fl(tmp, capabilities=SCORES_BY_CLIENT, epsilon=None)))
    return Path(out["dir"]) / "pfedcdp", out["summaries"]["pfedcdp"]


def test_a_run_scores_the_student_on_public_and_client_test_splits(finished):
    run_dir, summary = finished
    rep = summary["method_report"]
    assert rep["cluster_sizes"] == {"high": 1, "medium": 2, "low": 1}
    sh = rep["shapley"]
    assert sum(sh["values"].values()) == pytest.approx(sh["v_all"] - sh["v_empty"])    # efficiency
    assert sum(rep["teacher_weights"].values()) == pytest.approx(1.0)
    final = pd.read_csv(run_dir / "final_metrics.csv", dtype={"client_id": str})
    assert set(final["model"]) == {"student", "teacher_ensemble", "teacher_high", "teacher_medium", "teacher_low"}
    student = final[final["model"] == "student"]
    assert set(student["split"]) == {"public_test", "local_test", "global_test"}
    # whose word each score is: the coordinator's on the public split, each site's own elsewhere
    assert dict(zip(student["split"], student["reported_by"])) == {
        "public_test": "coordinator", "local_test": "self", "global_test": "self"}
    assert set(student.loc[student["split"] == "local_test", "client_id"]) == {"0", "1", "2", "3"}
    assert {"accuracy", "precision", "recall", "specificity", "f1", "auc"} <= set(final.columns)
    assert set(summary["final_models"]["student"]) >= {"public_test", "local_test", "global_test"}
    groups = pd.read_csv(run_dir / "groups.csv", dtype={"client_id": str})
    assert dict(zip(groups["client_id"], groups["group"])) == {"0": "high", "1": "medium", "2": "medium", "3": "low"}
    assert set(summary["groups"]) == {"high", "medium", "low"}
    assert (run_dir / "plots" / "groups.png").is_file()
    comm = pd.read_csv(run_dir / "communication.csv")
    assert {"profile", "train", "evaluate", "final"} <= set(comm["phase"])
    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["public_dataset"]["sizes"]["test"] > 0


def test_without_dp_the_mechanisms_show_no_noise_and_no_blow_up(finished):
    """The no-DP run of the fixture: zero noise in every cluster's average, the update
    quantized (eq. 14) at a small fraction of its norm, no own weight above 1, no warning."""
    run_dir, summary = finished
    mech = pd.read_csv(run_dir / "mechanisms.csv", dtype={"id": str, "text": str}, keep_default_na=False,
                       na_values=[""])
    noise = mech[(mech["mechanism"] == "dp_noise") & (mech["name"] == "noise_to_update_min")]
    assert len(noise) == 2 * 3 and (noise["value"] == 0).all()
    quant = mech[mech["mechanism"] == "quantization"]
    assert set(quant[quant["name"] == "target"]["text"]) == {"update"}
    assert (quant[quant["name"] == "error_to_update"]["value"] < 0.05).all()
    above = mech[(mech["mechanism"] == "personalization") & (mech["name"] == "above_one")]
    assert len(above) == 2 * 4 and (above["value"] == 0).all()
    assert "warnings" not in summary
    assert summary["method_report"]["mechanisms"]["dp"]["private"] is False
    assert (run_dir / "student_metrics.csv").is_file() and (run_dir / "plots" / "student_metrics.png").is_file()


def test_teacher_weight_modes(tmp_path):
    fixed = _run(tmp_path / "f", capabilities=SCORES_BY_CLIENT, epsilon=None, teacher_weights="fixed").coordinator
    fixed.trained = {"0", "1", "3"}
    logits = [torch.zeros(4, 2)] * 3
    w, info = fixed._weights(["high", "medium", "low"], logits, torch.tensor([0, 1, 0, 1]).numpy())
    assert w == pytest.approx([0.4, 0.35, 0.25]) and info is None
    w, _ = fixed._weights(["high", "low"], logits[:2], torch.tensor([0, 1, 0, 1]).numpy())
    assert w == pytest.approx([0.4 / 0.65, 0.25 / 0.65])
    fixed.teacher_weights = "uniform"
    assert fixed._weights(["high", "low"], logits[:2], torch.tensor([0, 1]).numpy())[0] == [0.5, 0.5]


def test_resume_gives_identical_results(tmp_path, finished):
    run_dir, _ = finished
    fl = _fl(tmp_path, capabilities=SCORES_BY_CLIENT, epsilon=None)
    fl["stop_after_round"] = 1
    out = run_experiment(resolve_config(fl))
    resumed = resume(Path(out["dir"]))
    assert resumed["summaries"]["pfedcdp"]
    for f in ("metrics.csv", "final_metrics.csv", "profile.csv", "groups.csv"):
        a = pd.read_csv(run_dir / f)
        b = pd.read_csv(Path(out["dir"]) / "pfedcdp" / f)
        pd.testing.assert_frame_equal(a, b, check_exact=True, obj=f)


def test_config_errors(tmp_path):
    fl = _fl(tmp_path)
    fl["public_dataset"] = None
    with pytest.raises(MethodConfigError, match="fl.public_dataset"):
        run_experiment(resolve_config(fl))
    with pytest.raises(MethodConfigError, match="exactly one of fisher_keep"):
        PFedCDP(fisher_keep=0.2, fisher_threshold=1e-3)
    with pytest.raises(MethodConfigError, match="teacher_weights"):
        PFedCDP(teacher_weights="best")
    with pytest.raises(MethodConfigError, match="capabilities"):
        PFedCDP(capabilities=[{"cpu": 2.0, "memory": 1, "battery": 1, "network": 1}])
    with pytest.raises(MethodConfigError, match="lists 2 clients"):
        _run(tmp_path / "x", capabilities=[SCORES_BY_CLIENT["0"], SCORES_BY_CLIENT["1"]])
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_cbis_ddsm_images_are_the_dicom_pixels_not_zeros(tmp_path, monkeypatch):
    """The authors' code opens the DICOM mammograms with an image reader that returns zeros;
    here the private set PFedCDP trains on holds each DICOM's pixels (pydicom), resized."""
    import numpy as np
    import pydicom

    from medfl.fixtures import generate
    from medfl.prep.cbis_ddsm import main as prep, read_dicom
    from medfl.data.manifest import manifest_source

    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")
    raw = Path(generate("cbis_ddsm", tmp_path / "raw", cases=6, seed=0, reference=False)["root"])
    assert prep(["--raw", str(raw), "--out", str(tmp_path / "out"), "--size", "32", "32"]) == 0
    manifest = pd.read_csv(tmp_path / "out" / "manifest.csv")
    for _, row in manifest.iterrows():
        dcm = raw / row["image_path"]
        pixels, _ = read_dicom(dcm)
        stored = pydicom.dcmread(dcm).pixel_array.astype(np.float64)
        np.testing.assert_allclose(pixels, stored / 65535.0, rtol=0, atol=1e-6)   # the DICOM's own pixels
        assert stored.std() > 0
        arr = np.load(tmp_path / "out" / row["path"])
        assert arr.std() > 0.01 and np.abs(arr).max() > 0.05, row["path"]       # not a blank image
    source = manifest_source(path=str(tmp_path / "out" / "manifest.csv"), column="path", num_classes=2)
    x, _ = source.make_dataset(source.table, False)[0]
    assert float(x.abs().sum()) > 0 and float(x.std()) > 0


def test_feature_shapley_values_as_printed_scale_the_loss(tmp_path):
    """Eqs. 16 and 19 as printed: psi per teacher from shap, averaged; the loss times mean(psi)."""
    pytest.importorskip("shap", reason="the shap package computes eq. 16's feature importance")
    m = _run(tmp_path, capabilities=SCORES_BY_CLIENT, epsilon=None, feature_shap="printed", shap_samples=4,
             shap_nsamples=8).coordinator
    m.trained = {"0", "1", "3"}
    m.finalize()
    rep = m.report()
    fs = rep["feature_shap"]
    assert fs["mode"] == "printed" and fs["samples"] == 4
    assert set(fs["per_teacher_mean_psi"]) == {"high", "medium", "low"}
    assert fs["mean_psi"] == pytest.approx(sum(fs["per_teacher_mean_psi"].values()) / 3)
    assert fs["mean_psi"] > 0 and rep["refine"]["steps"] > 0
    assert set(m.final_models()) == {"student", "teacher_ensemble", "teacher_high", "teacher_medium", "teacher_low"}


def test_any_registered_model_per_cluster_and_batchnorm_statistics_stay_at_the_client(tmp_path):
    """ResNet-10 (BatchNorm) for High, small CNN for Medium: the reply holds the extractor's
    parameters only (BatchNorm statistics are data statistics the noise does not cover); the
    coordinator re-estimates its cluster model's statistics on the public set."""
    run = _run(tmp_path, capabilities=SCORES_BY_CLIENT,
               cluster_models={"high": {"name": "resnet10", "width": 2}, "medium": {"name": "small_cnn", "width": 4}})
    m = run.coordinator
    ins = m.configure_round(1)
    assert json.loads(ins["0"].config["spec"])["name"] == "resnet10"
    assert json.loads(ins["1"].config["spec"])["name"] == "small_cnn"
    assert json.loads(ins["3"].config["spec"])["name"] == "pfedcdp_c"
    before = {k: v.clone() for k, v in m.buffers["high"].items()}
    assert any(k.endswith("running_mean") for k in before)
    ctx = run.context("0", 1)
    reply = run_client_update(run.client_method, ctx, ins["0"], filters=run.privacy.chain)
    model = build_seeded(json.loads(ins["0"].config["spec"]), 0)
    params = {n for n, _ in model.named_parameters()}
    assert set(reply.payload["extractor"]) == set(model.body_keys()) & params      # no running statistics
    assert set(ctx.state["buffers"]) == set(model.body_keys()) - params              # kept at the client
    replies = run.unfilter(1, {"0": ins["0"]}, {"0": reply})
    m.server_update(1, replies)
    changed = [k for k in before if k.endswith("running_mean") and not torch.equal(before[k], m.buffers["high"][k])]
    assert changed                                                                   # re-estimated on public data
    teacher = m._teacher("high")
    x, _ = next(iter(m.federation.public.loader("test", batch_size=4, shuffle=False)))
    assert torch.isfinite(teacher(x)).all()


def test_feature_shapley_values_weight_the_students_input(tmp_path):
    """The per-feature reading of eq. 19: psi becomes input weights of mean 1 that travel with
    the student (the input_weighted model), so a client scores the student as it was trained."""
    pytest.importorskip("shap", reason="the shap package computes eq. 16's feature importance")
    from medfl.models.registry import build_model

    m = _run(tmp_path, capabilities=SCORES_BY_CLIENT, epsilon=None, feature_shap="input", shap_samples=4,
             shap_nsamples=8).coordinator
    m.trained = {"0", "1", "3"}
    m.finalize()
    spec, state = m.final_models()["student"]
    assert spec["name"] == "input_weighted" and spec["inner"] == {"name": "pfedcdp_student"}
    w = state["feature_weights"]
    assert tuple(w.shape) == (1, 12, 12) and float(w.mean()) == pytest.approx(1.0, abs=1e-5)
    assert float(w.min()) >= 0.1 - 1e-6 and float(w.max()) > 1.0         # not all ones: psi varies
    rep = m.report()["feature_shap"]
    assert rep["mode"] == "input" and rep["weight_min"] == pytest.approx(float(w.min()))
    rebuilt = build_model({"spatial_dims": 2, "in_channels": 1, "num_classes": 2, **spec})
    rebuilt.load_state_dict(state, strict=True)
    x = torch.randn(3, 1, 12, 12)
    inner = build_model({"name": "pfedcdp_student", "spatial_dims": 2, "in_channels": 1, "num_classes": 2})
    inner.load_state_dict({k[len("inner."):]: v for k, v in state.items() if k.startswith("inner.")})
    torch.testing.assert_close(rebuilt.eval()(x), inner.eval()(x * w))
