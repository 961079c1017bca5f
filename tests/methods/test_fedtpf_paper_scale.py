"""FedTPF on the paper's scale (issue 48, items 1, 3 and 4): the noise added to x_s of
standardized inputs and its noise-to-signal on both scales, the cosine test as |cos| (the
signed reading an option), the "5 %" and "95 % confidence interval" readings, the warning
when eq. 8's decay cannot change the aggregate, the first round scored (``scored_from``),
and a source for every value of the ``paper`` preset. Coordinator and client steps are
driven by hand on tiny seeded tensors (no run)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.data import TensorDataset

from medfl.context import ClientContext
from medfl.losses.feature_distill import residual_cosine, stop_condition_check, wilson_lower
from medfl.messages import Instruction, Reply
from medfl.method import SOURCE_KINDS, Federation, MethodConfigError, derive_seed
from medfl.models.feature_distill import DistillVAE
from medfl.privacy.feature_release import perturb_features
from medfl_plugins.fedtpf import PAPER_PRESET, PAPER_SOURCES, FedFed, FedTPF

SMALL = {"vae_width": 4, "critic_width": 4, "distill_steps": 2}


def _fed(channels: int = 1, rounds: int = 6) -> Federation:
    return Federation(client_ids=["0", "1", "2"], eval_client_ids=["0", "1", "2"],
                      num_examples={"0": 30, "1": 10, "2": 20}, num_classes=2, rounds=rounds, seed=0,
                      fraction=1.0, model={"name": "small_cnn", "width": 2}, in_channels=channels, spatial_dims=2)


# ---------------------------------------------------------------------------- sources
def test_every_value_and_train_key_of_the_paper_preset_names_its_source() -> None:
    keys = set(PAPER_PRESET.values) | {f"train.{k}" for k in PAPER_PRESET.train}
    assert set(PAPER_PRESET.sources) == keys and PAPER_PRESET.sources is PAPER_SOURCES
    for key, text in PAPER_PRESET.sources.items():
        kind, _, citation = text.partition(": ")
        assert kind in SOURCE_KINDS and citation, key
    # what the issue found recorded as "paper": readings, each quoting the sentence and the other reading
    for key in ("window", "max_change", "change_reading", "accuracy_ci", "cosine_reading", "standardize",
                "epsilon"):
        assert PAPER_SOURCES[key].startswith("reading: ") and "other reading" in PAPER_SOURCES[key], key
    # the paper says it uses DP but gives no epsilon: null is a reading; l. 232's "proportional" is answered
    assert "differential privacy" in PAPER_SOURCES["epsilon"]
    assert "l. 232" in PAPER_SOURCES["noise"] and "proportional to the magnitude of x_s" in PAPER_SOURCES["noise"]
    assert "standardized scale this preset uses" in PAPER_SOURCES["distill_steps"]
    assert "three consecutive training epochs" in PAPER_SOURCES["window"]
    assert "95% confidence" in PAPER_SOURCES["accuracy_ci"] and "below 0.15" in PAPER_SOURCES["cosine_reading"]
    assert "standardized through preprocessing" in PAPER_SOURCES["standardize"]
    # the preset cites through `sources` alone (config.json's "from" is the kind)
    assert PAPER_PRESET.sources == PAPER_SOURCES and not PAPER_PRESET.source_problems()
    m = FedTPF(**PAPER_PRESET.values)
    assert (m.standardize, m.cosine_reading, m.change_reading, m.accuracy_ci) == ("client", "absolute",
                                                                                   "absolute", "none")


# ---------------------------------------------------------------------------- the stop condition's readings
def test_the_cosine_test_reads_the_absolute_cosine_and_the_signed_reading_is_an_option() -> None:
    acc, anti = [0.91, 0.90, 0.92], [-0.60, -0.61, -0.60]
    code, reason = stop_condition_check(acc, anti)          # x_r anti-aligned with x_s: not separated
    assert code == 3 and reason == "|cosine(x_r, x_s)| 0.610 >= 0.15"
    assert stop_condition_check(acc, anti, cosine_reading="signed") == (0, "met")
    # per sample: +0.6 and -0.6 average to 0 signed, 0.6 in absolute value
    x_r = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    x_s = torch.tensor([[0.6, 0.8], [-0.6, 0.8]])
    assert residual_cosine(x_r, x_s) == pytest.approx(0.0, abs=1e-7)
    assert residual_cosine(x_r, x_s, absolute=True) == pytest.approx(0.6)
    with pytest.raises(ValueError, match="cosine_reading must be one of absolute, signed, got 'both'"):
        stop_condition_check(acc, anti, cosine_reading="both")
    with pytest.raises(MethodConfigError, match="cosine_reading must be one of absolute, signed"):
        FedTPF(cosine_reading="abs")


def test_the_five_percent_and_the_confidence_interval_readings() -> None:
    acc, cos = [0.90, 0.93, 0.94], [0.10, 0.10, 0.10]
    assert stop_condition_check(acc, cos) == (0, "met")                        # 0.04 points: absolute reading
    code, reason = stop_condition_check(acc, [0.05, 0.06, 0.07], change_reading="relative")
    assert code == 5 and reason == "cosine moved 0.333 (relative) > 0.05 over 3 evaluations"  # 0.02 / 0.06
    assert stop_condition_check(acc, cos, change_reading="relative") == (0, "met")  # 0.04 / 0.923 = 0.043
    # the 95 % Wilson interval of 0.9 on 100 samples: [0.8256, 0.9448] (by hand)
    assert wilson_lower(0.9, 100) == pytest.approx(0.82564, abs=1e-5)
    assert math.isnan(wilson_lower(0.9, 0))
    code, reason = stop_condition_check([0.95] * 3, cos, support=40)  # lower bound 0.835 < 0.88
    assert code == 2 and reason.startswith("lower 95 % Wilson bound of the residual accuracy 0.835")
    assert stop_condition_check([0.95] * 3, cos, support=2000)[0] == 0
    with pytest.raises(MethodConfigError, match="change_reading must be one of absolute, relative"):
        FedTPF(change_reading="percent")
    with pytest.raises(MethodConfigError, match="accuracy_ci must be one of none, wilson"):
        FedTPF(accuracy_ci="95")


# ---------------------------------------------------------------------------- the standardized scale
def _client(seed: int = 3) -> ClientContext:
    """A client of 3-channel 8 x 8 images whose channels have means 0.2, 0.5, 0.8 and stds 0.05,
    0.1, 0.2 (pixels in [0, 1] as the fixtures'), 24 train and 16 val samples."""
    g = torch.Generator().manual_seed(seed)
    mean, std = torch.tensor([0.2, 0.5, 0.8]).view(1, 3, 1, 1), torch.tensor([0.05, 0.1, 0.2]).view(1, 3, 1, 1)

    def images(n: int) -> TensorDataset:
        return TensorDataset(mean + std * torch.randn(n, 3, 8, 8, generator=g), torch.arange(n) % 2)

    spec = {"name": "small_cnn", "width": 2, "in_channels": 3, "num_classes": 2}
    return ClientContext(client_id="0", round=1, seed=seed, datasets={"train": images(24), "val": images(16)},
                         model_spec=spec, train={"batch_size": 8}, sample_shape=(3, 8, 8),
                         split_sizes={"train": 24, "val": 16})


def test_the_paper_noise_is_added_to_standardized_x_s_and_its_noise_to_signal_is_reported_on_both_scales() -> None:
    m = FedTPF(noise={"variance": 0.15}, epsilon=None, standardize="client", distill_rounds=2, **SMALL)
    m.setup(_fed(channels=3))
    client = _client()
    out = m.client_validate(client, Instruction(payload={"distill": m.distill_state}, config={"stage": "validate"}))
    # the client's own per-channel statistics, kept in its state
    x = torch.stack([client.dataset("val")[i][0] for i in range(16)])
    train = torch.stack([client.dataset("train")[i][0] for i in range(24)]).double()
    mean = train.mean(dim=(0, 2, 3)).view(1, 3, 1, 1)
    std = train.std(dim=(0, 2, 3), unbiased=False).view(1, 3, 1, 1)
    kept = client.state["fedtpf_scale"]
    torch.testing.assert_close(torch.tensor(kept["mean"]).double(), mean.flatten())
    torch.testing.assert_close(torch.tensor(kept["std"]).double(), std.flatten())
    # recomputed: x' = (x - mean) / std, x_s' = x' - x_hat', x_p' = x_s' + n, n of variance 0.15
    vae = DistillVAE(3, int(m.distill_state["vae.mu.weight"].shape[0]), 2, width=4, grid=4)
    vae.load_state_dict({k[4:]: v for k, v in m.distill_state.items() if k.startswith("vae.")})
    vae.eval()
    xs = ((x - mean.float()) / std.float())
    with torch.no_grad():
        x_s = xs - vae.decode(vae.encode(xs)[0], (8, 8))
    g = torch.Generator().manual_seed(derive_seed(client.seed, "validate_noise"))
    noise = perturb_features(x_s, clip=None, noise=math.sqrt(0.15), mechanism="gaussian", generator=g) - x_s
    assert float(noise.var()) == pytest.approx(0.15, rel=0.1)
    norm = lambda t: float(t.flatten(1).double().norm(dim=1).mean())  # noqa: E731
    assert out["noise_to_signal"] == pytest.approx(norm(noise) / norm(x_s), rel=1e-5)
    assert out["noise_to_signal_input"] == pytest.approx(norm(noise * std.float()) / norm(x_s * std.float()),
                                                         rel=1e-5)
    # the same variance on the [0, 1] pixels (standardize="none", the old reading): one noise, one scale, and
    # more noise per unit of signal than on the standardized scale (this untrained model's x_s is nearly x,
    # whose pixel norm includes the channel means that standardization removes: 0.67 against 0.39)
    plain = FedTPF(noise={"variance": 0.15}, epsilon=None, distill_rounds=2, **SMALL)
    plain.setup(_fed(channels=3))
    other = plain.client_validate(_client(), Instruction(payload={"distill": plain.distill_state},
                                                         config={"stage": "validate"}))
    assert other["noise_to_signal"] == other["noise_to_signal_input"]
    assert other["noise_to_signal_input"] > out["noise_to_signal_input"]
    # the release plan says what the standardized release carries
    assert any("standard deviation" in note for note in m.release_plan().not_covered)


def test_a_fixed_normalization_is_checked_and_public_quantile_refuses_per_client_statistics() -> None:
    m = FedTPF(standardize={"mean": [0.5], "std": [0.25]}, **SMALL)
    assert m.standardize == {"mean": [0.5], "std": [0.25]}
    with pytest.raises(MethodConfigError, match="standardize gives 1 channel"):
        FedTPF(standardize={"mean": [0.5], "std": [0.25]}, distill_rounds=2, **SMALL).setup(_fed(channels=3))
    for bad in ("zscore", {"mean": [0.5], "std": [0.0]}, {"mean": [0.5, 0.1], "std": [1.0]}, {"mean": [1.0]}):
        with pytest.raises(MethodConfigError, match="standardize must be one of none, client or"):
            FedTPF(standardize=bad)
    with pytest.raises(MethodConfigError, match="cannot standardize as each client does"):
        FedTPF(clip="public_quantile", standardize="client")


def test_stage_2_maps_the_standardized_shared_set_back_to_the_clients_input_scale(monkeypatch) -> None:
    import medfl_plugins.fedtpf.method as mod

    m = FedTPF(noise={"variance": 0.15}, epsilon=None, standardize="client", distill_rounds=2, **SMALL)
    m.setup(_fed(channels=3))
    client = _client()
    seen = {}

    class Spy(mod.SharedSet):
        def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
            seen["x"] = x.clone()
            super().__init__(x, y)

    monkeypatch.setattr(mod, "SharedSet", Spy)
    shared = torch.ones(4, 3, 8, 8)
    m.client_update(client, Instruction(payload={"model": m.global_state, "shared_x": shared,
                                                 "shared_y": torch.tensor([0, 1, 0, 1])}, config={"stage": "train"}))
    # x = x_shared * std + mean with the client's own training statistics: the local tiles' coordinates
    # (the std alone left the shared set about mean / std below them: issue 63)
    mean = torch.tensor(client.state["fedtpf_scale"]["mean"]).view(1, 3, 1, 1)
    std = torch.tensor(client.state["fedtpf_scale"]["std"]).view(1, 3, 1, 1)
    torch.testing.assert_close(seen["x"], shared * std + mean)


# ---------------------------------------------------------------------------- eq. 8's decay and scoring
def _replies(m: FedTPF, cids: str = "012") -> dict[str, Reply]:
    sizes = _fed().num_examples
    return {c: Reply(payload={"model": dict(m.global_state), "distill": dict(m.distill_state)},
                     num_examples=sizes[c]) for c in cids}


def test_a_decay_that_cannot_change_the_aggregate_is_warned_with_the_lambda_that_would() -> None:
    m = FedTPF(distill_rounds=3, decay_lambda=1.0, stop_on="x_s", **SMALL)
    m.setup(_fed())
    m.server_update(1, _replies(m))
    m.server_validate(1, {"0": {"residual_accuracy": 0.5, "converged": 1.0},
                          "1": {"residual_accuracy": 0.4, "converged": 0.0},
                          "2": {"residual_accuracy": 0.3, "converged": 0.0}})
    assert m.mechanism_warnings(1) == []
    m.server_update(2, _replies(m))
    m.server_validate(2, {"0": {"residual_accuracy": 0.5}, "1": {"residual_accuracy": 0.402},
                          "2": {"residual_accuracy": 0.304}})           # Delta_perf(2) = 0.003
    m.server_update(3, _replies(m))                                     # alpha_0(3) = exp(-0.003) = 0.997
    m.server_validate(3, {"0": {"residual_accuracy": 0.5}, "1": {"residual_accuracy": 0.41},
                          "2": {"residual_accuracy": 0.31}})
    assert m.log[-1]["alpha"]["0"] == pytest.approx(math.exp(-0.003))
    warned = [w for w in m.mechanism_warnings(3) if "weight of stage 1" in w]
    assert len(warned) == 1 and "alpha >= 0.9970 with decay_lambda 1" in warned[0]
    assert f"a lambda of at least {-math.log(0.99) / 0.003:.3g}" in warned[0]   # 3.35
    assert m.report()["decay"]["inert"] is True
    # a lambda large enough acts, and nobody warns
    m2 = FedTPF(distill_rounds=3, decay_lambda=10.0, stop_on="x_s", **SMALL)
    m2.setup(_fed())
    m2.server_update(1, _replies(m2))
    m2.server_validate(1, {"0": {"residual_accuracy": 0.5, "converged": 1.0}, "1": {"residual_accuracy": 0.4},
                           "2": {"residual_accuracy": 0.3}})
    m2.server_update(2, _replies(m2))
    m2.server_validate(2, {"0": {"residual_accuracy": 0.5}, "1": {"residual_accuracy": 0.402},
                           "2": {"residual_accuracy": 0.304}})
    m2.server_update(3, _replies(m2))
    m2.server_validate(3, {c: {"residual_accuracy": 0.5} for c in "012"})
    assert m2.log[-1]["alpha"]["0"] == pytest.approx(math.exp(-0.03))
    assert not [w for w in m2.mechanism_warnings(3) if "weight of stage 1" in w]
    # nobody stopped: no lambda can act, and the warning says the stop condition comes first
    m3 = FedTPF(distill_rounds=2, decay_lambda=100.0, stop_on="x_s", **SMALL)
    m3.setup(_fed())
    for rnd in (1, 2):
        m3.server_update(rnd, _replies(m3))
        m3.server_validate(rnd, {c: {"residual_accuracy": 0.2 * rnd} for c in "012"})
    warned = [w for w in m3.mechanism_warnings(2) if "weight of stage 1" in w]
    assert len(warned) == 1 and "no client met the stop condition" in warned[0]
    assert "a stop condition this data can meet comes first" in warned[0]


def test_scored_from_is_the_first_round_trained_with_the_shared_set() -> None:
    for cls in (FedTPF, FedFed):
        small = {"vae_width": 4, "distill_steps": 2}
        m = cls(distill_rounds=2, **small)
        m.setup(_fed())
        for rnd in (1, 2):
            m.configure_round(rnd)
            m.server_update(rnd, _replies(m))
            assert m.scored_from(rnd) is None                               # stage 1: plain FedAvg of phi
        assert m.pending_release and m.round_steps(3) == 2
        m.configure_round(3)                                                # the release step of round 3
        m.server_update(3, {c: Reply(payload={"shared_x": torch.randn(k, 1, 12, 12),
                                              "shared_y": torch.arange(k) % 2}, metrics={"released": float(k)},
                                     num_examples=k) for c, k in _fed().num_examples.items()})
        assert m.configure_round(3)["0"].config["stage"] == "train"         # round 3 trains with D^s
        assert m.scored_from(3) == 3 and m.scored_from(6) == 3
        restored = cls(distill_rounds=2, **small)
        restored.setup(_fed())
        restored.load_state_dict(m.state_dict())
        assert restored.scored_from(4) == 3


# ---------------------------------------------------------------------------- the lambda sweep's helpers
def test_the_probe_runs_each_fedtpf_entry_once_per_lambda_and_tabulates_alpha(tmp_path, monkeypatch) -> None:
    import importlib
    import json
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "experiments"))
    probe = importlib.import_module("fedtpf_probe")
    entries = [{"name": "fedavg"}, {"name": "fedtpf", "label": "tpf", "preset": "paper"},
               {"name": "fedtpf", "decay": False}]
    got = probe.with_lambdas(entries, [1.0, 30.0])
    assert got == [{"name": "fedavg"},
                   {"name": "fedtpf", "label": "tpf_lambda1", "preset": "paper", "decay_lambda": 1.0},
                   {"name": "fedtpf", "label": "tpf_lambda30", "preset": "paper", "decay_lambda": 30.0},
                   {"name": "fedtpf", "decay": False}]
    assert probe.with_lambdas(entries, []) == entries
    runs = {}
    for label, lam, alphas in (("a", 1.0, (0.997, 1.0)), ("b", 30.0, (0.91, 1.0))):
        (tmp_path / label).mkdir()
        report = {"decay": {"on": True, "lambda": lam, "min_alpha": alphas[0], "max_alpha": alphas[1],
                            "inert": alphas[0] >= 0.99},
                  "stopped_at": {"0": 2}, "stop_condition": {"clients": 3}}
        (tmp_path / label / "summary.json").write_text(json.dumps({"method_report": report}))
        runs[label] = tmp_path / label
    table = probe.alpha_table(runs)
    assert table[["arm", "lambda", "min_alpha", "inert"]].values.tolist() == [["a", 1.0, 0.997, True],
                                                                               ["b", 30.0, 0.91, False]]


def test_noise_too_small_for_the_content_guard_is_warned_before_the_release() -> None:
    m = FedTPF(noise={"variance": 0.15}, epsilon=None, distill_rounds=3, stop_on="x_s", **SMALL)
    m.setup(_fed())
    m.server_update(1, _replies(m))
    m.server_validate(1, {c: {"residual_accuracy": 0.5, "noise_to_signal": 0.2} for c in "012"})
    warned = [w for w in m.mechanism_warnings(1) if "content guard" in w]
    assert len(warned) == 1 and "0.2x the signal's" in warned[0] and "about 0.981" in warned[0]
    # every client above 1.5 x 0.329 (x_p correlates below 0.95 with x_s with a margin): no such warning
    m2 = FedTPF(noise={"variance": 0.15}, epsilon=None, distill_rounds=3, stop_on="x_s", **SMALL)
    m2.setup(_fed())
    m2.server_update(1, _replies(m2))
    m2.server_validate(1, {c: {"residual_accuracy": 0.5, "noise_to_signal": 0.6} for c in "012"})
    assert not [w for w in m2.mechanism_warnings(1) if "content guard" in w]
