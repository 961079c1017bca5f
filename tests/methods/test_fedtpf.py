"""FedTPF and FedFed (paper 003): eqs. 8-9's weights by hand over a scripted accuracy sequence,
the stop condition and the stage switch, the release (one per sample, epsilon from the
accountant, Laplace and noise-off), what leaves a client in each stage, hostile replies
(check_reply), a run of each, and resume across the stage switch."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

from medfl.config import resolve_config
from medfl.experiment import resume, run_experiment
from medfl.messages import PayloadError, Reply
from medfl.method import Federation, MethodConfigError
from medfl.privacy.accounting import epsilon_spent, noise_for_epsilon
from medfl.privacy.ledger import UNNOISED_RELEASE_NOTE
from medfl_plugins.fedtpf import FedFed, FedTPF

SMALL = {"vae_width": 4, "critic_width": 4, "distill_steps": 4}


def _fed(rounds: int = 6, fraction: float = 1.0) -> Federation:
    return Federation(client_ids=["0", "1", "2"], eval_client_ids=["0", "1", "2"],
                      num_examples={"0": 30, "1": 10, "2": 20}, num_classes=2, rounds=rounds, seed=0,
                      fraction=fraction, model={"name": "small_cnn", "width": 2}, in_channels=1, spatial_dims=2)


def _replies(m: FedTPF, shift: dict[str, float]) -> dict[str, Reply]:
    """Each client returns the global models shifted by ``shift[cid]``."""
    return {cid: Reply(payload={"model": {k: v + d if v.is_floating_point() else v for k, v in m.global_state.items()},
                                "distill": {k: v + d if v.is_floating_point() else v
                                            for k, v in m.distill_state.items()}},
                       num_examples=_fed().num_examples[cid]) for cid, d in shift.items()}


def test_decay_weights_follow_eqs_8_and_9_over_a_scripted_accuracy_sequence() -> None:
    m = FedTPF(distill_rounds=4, decay_lambda=2.0, stop_on="x_s", **SMALL)
    m.setup(_fed())
    key = "vae.mu.bias"
    # round 1: everybody distils; accuracies p(1); client 0 meets the stop condition
    m.server_update(1, _replies(m, {"0": 0.0, "1": 0.0, "2": 0.0}))
    m.server_validate(1, {"0": {"residual_accuracy": 0.5, "converged": 1.0},
                          "1": {"residual_accuracy": 0.4, "converged": 0.0},
                          "2": {"residual_accuracy": 0.3, "converged": 0.0}})
    assert m.stopped_at == {"0": 2} and m.delta_perf == 0.0          # no p(0): no change measured
    # round 2: client 0 frozen from this round; Delta_perf(1) = 0 so alpha = exp(0) = 1
    before = m.distill_state[key].clone()
    m.server_update(2, _replies(m, {"0": 3.0, "1": 0.0, "2": 0.0}))
    torch.testing.assert_close(m.distill_state[key], before + 3.0 * 30 / 60)
    m.server_validate(2, {"0": {"residual_accuracy": 0.5, "converged": 1.0},
                          "1": {"residual_accuracy": 0.6, "converged": 0.0},
                          "2": {"residual_accuracy": 0.4, "converged": 0.0}})
    # eq. 9 over the clients still distilling (1 and 2): ((0.6 - 0.4) + (0.4 - 0.3)) / 2
    assert m.delta_perf == pytest.approx(0.15)
    # round 3: alpha_0 = exp(-2 * 0.15); weights 30 * alpha_0, 10, 20
    before = m.distill_state[key].clone()
    m.server_update(3, _replies(m, {"0": 3.0, "1": 0.0, "2": 0.0}))
    a0 = math.exp(-2 * 0.15)
    torch.testing.assert_close(m.distill_state[key], before + 3.0 * 30 * a0 / (30 * a0 + 30))
    assert m.log[-1]["alpha"] == pytest.approx({"0": a0, "1": 1.0, "2": 1.0})
    # a falling accuracy (Delta_perf < 0) gives alpha = exp(0) = 1 (max(0, .) of eq. 8)
    m.server_validate(3, {"0": {"residual_accuracy": 0.5}, "1": {"residual_accuracy": 0.5},
                          "2": {"residual_accuracy": 0.2}})
    assert m.delta_perf == pytest.approx(-0.15)
    assert m.alphas(4, ["0", "1"]) == {"0": 1.0, "1": 1.0}
    # the phi average is plain FedAvg whatever alpha is
    nodecay = FedTPF(distill_rounds=4, decay=False, **SMALL)
    nodecay.setup(_fed())
    nodecay.stopped_at, nodecay.delta_perf = {"0": 1}, 5.0
    assert nodecay.alphas(3, ["0", "1"]) == {"0": 1.0, "1": 1.0}


def test_hostile_validation_scalars_are_ignored() -> None:
    m = FedTPF(distill_rounds=4, stop_on="x_s", **SMALL)
    m.setup(_fed())
    m.server_validate(1, {"0": {"residual_accuracy": 7.0}, "1": {"residual_accuracy": math.nan},
                          "2": {"residual_accuracy": 0.5}})
    assert m.p_prev == {"2": 0.5}
    # by default p_k is the accuracy on x_p (stop_on="x_p")
    d = FedTPF(distill_rounds=4, **SMALL)
    d.setup(_fed())
    d.server_validate(1, {"0": {"residual_accuracy": 0.9, "residual_accuracy_p": 0.4}, "1": {"residual_accuracy": 0.5}})
    assert d.p_prev == {"0": 0.4}


def _release_replies(m: FedTPF, n: dict[str, int], shape=(1, 12, 12)) -> dict[str, Reply]:
    return {cid: Reply(payload={"shared_x": torch.randn(k, *shape), "shared_y": torch.arange(k) % 2},
                       metrics={"released": float(k), "x_norm": 2.0, "x_s_norm": 1.0, "x_s_norm_ratio": 0.5},
                       num_examples=k) for cid, k in n.items()}


def test_the_stage_switch_when_every_client_converged_then_release_then_stage_2() -> None:
    m = FedTPF(distill_rounds=4, **SMALL)
    m.setup(_fed())
    assert m.round_steps(1) == 1 and set(m.configure_validate(1)) == {"0", "1", "2"}
    ins = m.configure_round(1)
    assert all(i.config["stage"] == "distill" and set(i.payload) == {"model", "distill"} for i in ins.values())
    m.server_update(1, _replies(m, {c: 0.0 for c in ins}))
    m.server_validate(1, {c: {"residual_accuracy": 0.95, "converged": 1.0} for c in ("0", "1")})
    assert not m.pending_release                                        # client 2 has not converged
    m.server_update(2, _replies(m, {c: 0.0 for c in "012"}))
    m.server_validate(2, {c: {"residual_accuracy": 0.95, "converged": 1.0} for c in "012"})
    assert m.pending_release and m.transition["reason"] == "every client met the stop condition"
    # round 3: two steps; the first asks every client for the release, flagged as the DP release
    assert m.round_steps(3) == 2
    rel = m.configure_round(3)
    assert set(rel) == {"0", "1", "2"} and all(i.config["dp_release"] is True and i.config["stage"] == "release"
                                                for i in rel.values())
    assert "model" not in next(iter(rel.values())).payload
    assert m.round_releases(3) == ["0", "1", "2"] and m.round_releases(2) == []
    m.server_update(3, _release_replies(m, {"0": 30, "1": 10, "2": 20}))
    assert m.stage == "train" and m.shared_x.shape == (60, 1, 12, 12) and m.shared_y.tolist()[:3] == [0, 1, 0]
    train = m.configure_round(3)
    assert all(i.config["stage"] == "train" and i.payload["shared_x"].shape[0] == 60 for i in train.values())
    assert m.configure_validate(3) == {}
    assert m.report()["release"]["x_s_to_x_norm"] == pytest.approx(0.5)


def test_stage_1_ends_at_distill_rounds_at_the_latest_and_fedfed_never_validates() -> None:
    m = FedTPF(distill_rounds=2, **SMALL)
    m.setup(_fed())
    for r in (1, 2):
        m.server_update(r, _replies(m, {c: 0.0 for c in "012"}))
    assert m.pending_release and m.transition["reason"].startswith("round cap")
    assert m.configure_validate(2) == {}
    f = FedFed(distill_rounds=1, vae_width=4)
    f.setup(_fed())
    assert f.configure_validate(1) == {} and f.lambda_wgan == 0 and f.lambda_proto == 0 and not f.decay
    f.server_update(1, _replies(f, {c: 0.0 for c in "012"}))
    assert f.pending_release


@pytest.mark.parametrize("bad, message", [
    (lambda r: r.payload.update(shared_y=r.payload["shared_y"] + 5), r"labels outside \[0, 2\)"),
    (lambda r: setattr(r, "num_examples", 3), "10 features, 10 labels, num_examples 3"),
    (lambda r: r.payload.update(shared_y=r.payload["shared_y"].float()), "integer labels"),
    (lambda r: r.payload.pop("shared_x"), "must be tensors"),
    (lambda r: r.payload.update(shared_x=r.payload["shared_x"].repeat(1, 3, 1, 1)), "expected 1 channels in 2D"),
])
def test_a_hostile_release_reply_fails_check_reply(bad: Any, message: str) -> None:
    """What the engine drops from the round (it also drops NaN values and num_examples above
    the client's training size for every method: tests/engine/test_reply_screening.py)."""
    m = FedTPF(distill_rounds=1, **SMALL)
    m.setup(_fed())
    m.server_update(1, _replies(m, {c: 0.0 for c in "012"}))
    release = m.configure_round(2)["1"]
    replies = _release_replies(m, {"0": 30, "1": 10, "2": 20})
    assert m.check_reply("1", release, replies["1"]) == ""
    bad(replies["1"])
    assert re.search(message, m.check_reply("1", release, replies["1"]))


def test_a_release_of_another_feature_size_is_left_out_and_stage_1_replies_must_return_the_models() -> None:
    m = FedTPF(distill_rounds=1, **SMALL)
    m.setup(_fed())
    distill = m.configure_round(1)["0"]
    sent = _replies(m, {"0": 0.0})["0"]
    assert m.check_reply("0", distill, sent) == ""
    sent.payload["distill"]["extra"] = torch.zeros(3)
    assert "distill is not the state it was sent: extra ['extra']" in m.check_reply("0", distill, sent)
    m.server_update(1, _replies(m, {c: 0.0 for c in "012"}))
    replies = _release_replies(m, {"0": 30, "1": 10, "2": 20})
    replies["1"].payload["shared_x"] = replies["1"].payload["shared_x"][:, :, :5]
    m.server_update(2, replies)
    assert m.shared_x.shape == (50, 1, 12, 12) and "1" in m.transition["left_out"]


def test_bad_settings_are_refused_before_training() -> None:
    with pytest.raises(MethodConfigError, match="mechanism must be one of gaussian, laplace"):
        FedTPF(mechanism="exponential")
    with pytest.raises(MethodConfigError, match="epsilon must be a number > 0"):
        FedTPF(epsilon=0)
    with pytest.raises(MethodConfigError, match="target_accuracy"):
        FedTPF(target_accuracy=1.5)
    with pytest.raises(MethodConfigError, match=r"fl.rounds \(3\) must exceed distill_rounds \(3\)"):
        FedTPF(distill_rounds=3).setup(_fed(rounds=3))
    with pytest.raises(MethodConfigError, match=r"client 1\): delta=0.2 must be below 1/N = 0.1 \(N = 10"):
        FedTPF(distill_rounds=1, delta=0.2).setup(
            Federation(client_ids=["1"], eval_client_ids=["1"], num_examples={"1": 10}, num_classes=2, rounds=3,
                       seed=0, model={"name": "small_cnn", "width": 2}))


def test_release_plans() -> None:
    g = FedTPF(epsilon=4.0, delta=1e-5, clip=2.0).release_plan()
    assert (g.mechanism, g.unit, g.sample_rate, g.clip) == ("feature_gaussian", "sample", 1.0, 2.0)
    assert g.noise_multiplier == pytest.approx(noise_for_epsilon(4.0, 1e-5, 1.0, 1, "rdp"))
    lap = FedTPF(epsilon=2.0, mechanism="laplace").release_plan()
    assert (lap.mechanism, lap.noise_multiplier, lap.accountant) == ("feature_laplace", 0.5, "laplace")
    assert FedTPF(epsilon=None).release_plan().noise_multiplier == 0.0


# ---------------------------------------------------------------------------- runs
def _job(tmp: Path, entry: dict[str, Any], rounds: int = 4, **extra: Any) -> dict[str, Any]:
    return {"name": extra.pop("name", "t"), "output_dir": str(tmp / "runs"), "seed": 0, "rounds": rounds,
            "num_clients": 3, "progress": False,
            "dataset": {"name": "synthetic2d", "root": str(tmp / "data"), "num_samples": 96, "num_classes": 2,
                        "image_size": 12, "noise": 0.5},
            "client_split": {"train": 0.6, "val": 0.2, "test": 0.2},
            "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8},
            "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8, "lr": 0.05},
            "methods": [entry], **extra}


class _Spy(FedTPF):
    """FedTPF that keeps what reached the coordinator (the replies' keys and tensors)."""

    name = "test_fedtpf_spy"
    seen: list[tuple[int, str, dict[str, Any], dict[str, float]]] = []

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        for cid, r in replies.items():
            type(self).seen.append((round, cid, dict(r.payload), dict(r.metrics)))
        super().server_update(round, replies)


def test_a_run_releases_once_per_sample_with_the_accountants_epsilon(tmp_path: Path, monkeypatch) -> None:
    from medfl.plugins import get_plugin_manager

    class _P:
        from medfl import hookimpl

        @staticmethod
        @hookimpl
        def register_methods(register):  # type: ignore[no-untyped-def]
            register(_Spy)

    pm = get_plugin_manager()
    pm.register(_P, name="fedtpf_spy")
    _Spy.seen = []
    try:
        out = run_experiment(resolve_config(_job(tmp_path, {"name": "test_fedtpf_spy", "distill_rounds": 2,
                                                            "epsilon": 3.0, "clip": 2.0, **SMALL})))
    finally:
        pm.unregister(name="fedtpf_spy")
    run = Path(out["dir"]) / "test_fedtpf_spy"
    stage = {}
    for r, cid, payload, metrics in _Spy.seen:
        keys = set(payload)
        if r <= 2:
            assert keys == {"model", "distill"}                  # no prototype, no sample leaves in stage 1
        elif "shared_x" in keys:
            assert keys == {"shared_x", "shared_y"} and metrics["clipped_fraction"] >= 0
            norms = payload["shared_x"].flatten(1).norm(dim=1)
            assert bool((norms > 2.0).any())                      # noised: not the clipped x_s
            stage[cid] = int(payload["shared_x"].shape[0])
        else:
            assert keys == {"model"}
    partition = pd.read_csv(run / "partition.csv", dtype={"client_id": str})
    assert stage == partition[partition["role"] == "train"].groupby("client_id").size().to_dict()
    privacy = pd.read_csv(run / "privacy.csv", dtype={"client_id": str})
    assert privacy["round"].tolist() == [3, 3, 3] and set(privacy["mechanism"]) == {"feature_gaussian"}
    z = noise_for_epsilon(3.0, 1e-5, 1.0, 1, "rdp")
    want = epsilon_spent([(z, 1.0, 1)], 1e-5, "rdp")
    assert privacy["epsilon"].tolist() == pytest.approx([want] * 3) and want <= 3.0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["privacy"]["epsilon"] == pytest.approx(want)
    assert any("labels travel in the clear" in u for u in summary["privacy"]["not_covered"])
    rep = summary["method_report"]
    assert rep["transition"]["release_round"] == 3 and rep["transition"]["shared_samples"] == sum(stage.values())
    assert rep["release"]["x_s_norm_mean"] > 0 and len(rep["stage1"]) == 2
    train = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
    assert (train.loc[train["round"] == 4, "shared_samples"] == sum(stage.values())).all()
    assert (run / "validation_metrics.csv").is_file()
    # at epsilon 3 a 144-value feature gets noise of norm about z * clip * 12: the run says so
    released = train[train["noise_norm"].notna()]
    assert (released["noise_norm"] / released["signal_norm"] > 1).all()
    assert any("mostly noise" in w["warning"] or "more noise than signal" in w["warning"]
               for w in summary["warnings"])
    assert any("the distillation model: the per-sample epsilon" in u for u in summary["privacy"]["not_covered"])


def test_laplace_is_recorded_as_such(tmp_path: Path) -> None:
    out = run_experiment(resolve_config(_job(tmp_path, {"name": "fedfed", "distill_rounds": 1, "vae_width": 4,
                                                        "distill_steps": 4, "epsilon": 2.0, "mechanism": "laplace"},
                                             rounds=2)))
    run = Path(out["dir"]) / "fedfed"
    privacy = pd.read_csv(run / "privacy.csv")
    assert set(privacy["mechanism"]) == {"feature_laplace"}
    block = json.loads((run / "summary.json").read_text())["privacy"]
    assert block["epsilon"] == pytest.approx(2.0) and privacy["epsilon"].tolist() == pytest.approx([2.0] * 3)


def test_noise_off_is_recorded_as_such_and_a_release_that_copies_the_images_is_refused(tmp_path: Path) -> None:
    """``epsilon: null`` turns the noise off: the run's plan records the release as not private
    and unnoised. On this fixture (pixel noise of std 0.5, which no reconstruction removes)
    ``x_s = x - x_hat`` after 4 distillation steps correlates 0.9998 with the images: an
    offset copy of them, which the content guard stops at the client, naming the method, the
    key and the sample (issue 38, items 1 and 4); no release is counted."""
    with pytest.raises(PayloadError, match=r"reply of method 'fedfed' from client \d+\['shared_x'\]: holds image \d+ "
                                           r"of client \d+'s train split .*transformed: a plane of 12x12 values "
                                           r"correlates with its pixels at \d+ pixels \(0\.99"):
        run_experiment(resolve_config(_job(tmp_path, {"name": "fedfed", "distill_rounds": 1, "vae_width": 4,
                                                      "distill_steps": 4, "epsilon": None}, rounds=2)))
    run = next(tmp_path.glob("runs/*/fedfed"))
    privacy = json.loads((run / "config.json").read_text())["privacy"]
    plan = privacy["feature_gaussian"]
    assert plan["private"] is False and plan["noise_multiplier"] == 0.0 and plan["target_epsilon"] is None
    assert plan["content_guard"] == UNNOISED_RELEASE_NOTE
    assert privacy["private"] is False   # the plan as a whole: its one release adds no noise
    assert pd.read_csv(run / "privacy.csv").empty
    assert json.loads((run / "status.json").read_text())["status"] == "failed"


def test_noise_off_on_features_that_are_not_the_images_is_recorded_as_such(tmp_path: Path) -> None:
    """On the PathMNIST fixture (28 x 28 RGB tiles), after 2 rounds of 5 distillation steps,
    the unnoised x_s is not a copy of the images (it correlates at most 0.82 with a client's
    image; after 1 round, 0.976, and the guard refuses it), so it may leave, and the run
    records the release as not private: ``privacy.csv`` with an infinite epsilon,
    ``summary.json`` with ``private: false`` and the mechanism under ``non_private_releases``."""
    from medfl.fixtures import generate
    from medfl.prep.medmnist import main as prep_medmnist

    generate("medmnist", tmp_path / "raw", cases=300, seed=0, flag="pathmnist")
    assert prep_medmnist(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "data"), "--flag", "pathmnist"]) == 0
    data = {"name": "manifest", "path": str(tmp_path / "data" / "manifest.csv"), "column": "path", "num_classes": 9,
            "cache": "memory"}
    job = _job(tmp_path, {"name": "fedfed", "distill_rounds": 2, "distill_steps": 5, "epsilon": None},
               rounds=3, train={"batch_size": 32, "lr": 0.05}, dataset=data)
    run = Path(run_experiment(resolve_config(job))["dir"]) / "fedfed"
    privacy = pd.read_csv(run / "privacy.csv")
    assert set(privacy["mechanism"]) == {"feature_gaussian"} and len(privacy) == 3
    assert privacy["epsilon"].map(math.isinf).all()
    block = json.loads((run / "summary.json").read_text())["privacy"]
    assert block["private"] is False and block["epsilon"] is None
    assert block["non_private_releases"] == ["feature_gaussian"] and "unnoised_release" in block
    train = pd.read_csv(run / "train_metrics.csv")
    assert (train["noise_norm"].dropna() == 0.0).all() and train["noise_norm"].notna().sum() == 3


def test_without_a_val_split_the_stop_condition_reads_the_test_split(tmp_path: Path) -> None:
    out = run_experiment(resolve_config(_job(tmp_path, {"name": "fedtpf", "distill_rounds": 2, **SMALL}, rounds=3,
                                             client_split={"train": 0.8, "test": 0.2})))
    val = pd.read_csv(Path(out["dir"]) / "fedtpf" / "validation_metrics.csv")
    assert len(val) == 3 and val["residual_accuracy"].between(0, 1).all()


@pytest.mark.parametrize("stop", [2, 3])
def test_resume_across_the_stage_switch_gives_identical_results(tmp_path: Path, stop: int) -> None:
    """Stopped before the transition round (2) or right after it (3), the resumed run ends
    with the uninterrupted run's numbers, release and shared set included."""
    entry = {"name": "fedtpf", "distill_rounds": 2, "epsilon": 3.0, **SMALL}
    full = run_experiment(resolve_config(_job(tmp_path, entry, rounds=4, name="full")))
    part = run_experiment(resolve_config(_job(tmp_path, entry, rounds=4, name="part", stop_after_round=stop)))
    resume(Path(part["dir"]))
    a, b = Path(full["dir"]) / "fedtpf", Path(part["dir"]) / "fedtpf"
    for f in ("metrics.csv", "train_metrics.csv", "privacy.csv", "validation_metrics.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(a / f), pd.read_csv(b / f), check_exact=True, obj=f)
    ra, rb = (json.loads((d / "summary.json").read_text())["method_report"] for d in (a, b))
    assert ra == rb
