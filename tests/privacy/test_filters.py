"""Reply filters (medfl.filters and the built-in dp_gaussian and quantize): a chain applied at
the client and undone at the coordinator gives the method full states; what a hostile site
sends instead is refused; bad settings are refused before training with one clear error."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from medfl.config import ConfigError
from medfl.filters import FilterChain, FilterConfigError
from medfl.messages import PayloadError, validate_payload
from medfl.method import Federation
from medfl.models.registry import build_model
from medfl.privacy.quantize import quantization_step
from medfl_plugins.baselines import FedAvg

SPEC = {"name": "small_cnn", "width": 4, "spatial_dims": 2, "in_channels": 1, "num_classes": 2}


def _states(seed: int = 0, scale: float = 0.01) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    torch.manual_seed(seed)
    ref = build_model(SPEC).state_dict()
    new = {k: (v + scale * torch.randn_like(v)) if v.is_floating_point() else v + 3 for k, v in ref.items()}
    return ref, new


def _kw(**over: Any) -> dict[str, Any]:
    return {"client_id": "0", "round": 1, "step": 0, "seed": 123, "model_spec": SPEC, "where": "reply", **over}


def _federation(n: int = 4, rounds: int = 3, fraction: float = 1.0) -> Federation:
    ids = [str(i) for i in range(n)]
    return Federation(client_ids=ids, eval_client_ids=ids, num_examples={c: 20 for c in ids}, num_classes=2,
                      rounds=rounds, seed=0, fraction=fraction, model={"name": "small_cnn", "width": 4})


def _round_trip(specs: list[Any], ref: dict, new: dict, federation: Federation | None = None
                ) -> tuple[dict, dict]:
    chain = FilterChain.from_specs(specs)
    chain.check(FedAvg, "filters")
    chain.plan(federation or _federation(), "filters")
    sent = chain.apply(FedAvg, {"model": new, "score": 1.5}, {"model": ref}, **_kw())
    validate_payload(sent, "sent", allow_str=False)
    # the client side is built from the resolved entries, as a site builds it
    site = FilterChain.from_specs(chain.specs())
    assert site.apply(FedAvg, {"model": new, "score": 1.5}, {"model": ref}, **_kw()).keys() == sent.keys()
    back = chain.undo(FedAvg, sent, {"model": ref}, **_kw())
    assert back["score"] == 1.5 and list(back["model"]) == list(ref)   # the method's key order
    return sent, back["model"]


@pytest.mark.parametrize("bits", [1, 2, 4, 7, 8, 12, 16])
def test_quantize_round_trip_is_within_half_a_step(bits: int) -> None:
    ref, new = _states()
    sent, back = _round_trip([{"name": "quantize", "bits": bits}], ref, new)
    for k, v in new.items():
        if not v.is_floating_point():
            assert torch.equal(back[k], v) and sent["model"][k] is v
            continue
        enc = sent["model"][k]
        assert enc["codes"].dtype == torch.uint8 and enc["codes"].numel() == -(-v.numel() * bits // 8)
        step = quantization_step(enc["lo"], enc["hi"], bits)
        assert float((back[k].double() - v.double()).abs().max()) <= step / 2 + 1e-6 * (1 + step)


def test_quantize_after_dp_quantizes_the_noised_update() -> None:
    ref, new = _states()
    sent, back = _round_trip([{"name": "dp_gaussian", "noise_multiplier": 1e-9, "clip": 100.0, "keys": "all"},
                              {"name": "quantize", "bits": 16}], ref, new)
    enc = sent["model"]["layer1.0.weight"]
    upd = new["layer1.0.weight"] - ref["layer1.0.weight"]
    assert abs(enc["hi"] - float(upd.max())) < 1e-3 and abs(enc["lo"] - float(upd.min())) < 1e-3
    for k, v in new.items():   # almost no noise, no clipping, fine quantization: back where it was
        assert torch.allclose(back[k].double(), v.double(), atol=1e-4), k


def test_quantize_update_quantizes_returned_minus_received() -> None:
    """``update: true``: the chain subtracts the reference, the codes span the update's range,
    and the coordinator adds the reference back; the error is half a step of the update's
    range, not of the weights'. ``update: false`` (the default) encodes the weights."""
    ref, new = _states(scale=0.01)
    key = "layer1.0.weight"
    upd = new[key].double() - ref[key].double()
    sent, back = _round_trip([{"name": "quantize", "bits": 8, "update": True}], ref, new)
    enc = sent["model"][key]
    assert enc["lo"] == pytest.approx(float(upd.min()), abs=1e-6) and enc["hi"] == pytest.approx(float(upd.max()),
                                                                                                abs=1e-6)
    step = (float(upd.max()) - float(upd.min())) / 255
    assert float((back[key].double() - new[key].double()).abs().max()) <= step / 2 + 1e-6
    sent_w, back_w = _round_trip([{"name": "quantize", "bits": 8}], ref, new)
    assert sent_w["model"][key]["lo"] == pytest.approx(float(new[key].min()))   # the weights' range
    step_w = (float(new[key].max()) - float(new[key].min())) / 255
    err_w = float((back_w[key].double() - new[key].double()).abs().max())
    assert step_w > 10 * step and err_w > 2 * float((back[key].double() - new[key].double()).abs().max())
    assert FilterChain.from_specs([{"name": "quantize", "update": True}]).uses_update
    assert not FilterChain.from_specs([{"name": "quantize"}]).uses_update


def test_quantize_update_needs_a_reference() -> None:
    from medfl.filters import FilterMismatchError
    from medfl_plugins.fedskd import FedSKD

    with pytest.raises(FilterMismatchError, match="quantize"):
        FilterChain.from_specs([{"name": "quantize", "update": True}]).check(FedSKD, "filters")
    FilterChain.from_specs([{"name": "quantize"}]).check(FedSKD, "filters")   # the state itself: fine


def test_dp_gaussian_clips_the_update_and_adds_the_stated_noise() -> None:
    ref, new = _states(scale=1.0)
    clip, sigma = 0.5, 2.0
    chain = FilterChain.from_specs([{"name": "dp_gaussian", "noise_multiplier": sigma, "clip": clip}])
    chain.plan(_federation(), "filters")
    params = [k for k, _ in build_model(SPEC).named_parameters()]
    sent = chain.apply(FedAvg, {"model": new}, {"model": ref}, **_kw())["model"]
    assert list(sent) == params       # buffers (BatchNorm statistics, counts) are not sent
    # the same with (almost) no noise shows the clipped update: its norm is clip
    quiet = FilterChain.from_specs([{"name": "dp_gaussian", "noise_multiplier": 1e-9, "clip": clip}])
    quiet.plan(_federation(), "filters")
    upd = quiet.apply(FedAvg, {"model": new}, {"model": ref}, **_kw())["model"]
    norm = torch.sqrt(sum((v.double() ** 2).sum() for v in upd.values()))
    assert abs(float(norm) - clip) < 1e-5
    noise = torch.cat([(sent[k] - upd[k]).flatten() for k in params]).double()
    n, std = noise.numel(), clip * sigma     # 5-sigma bands of the sample mean and std
    assert abs(float(noise.mean())) < 5 * std / n**0.5
    assert abs(float(noise.std()) - std) < 5 * std / (2 * n) ** 0.5
    back = chain.undo(FedAvg, {"model": sent}, {"model": ref}, **_kw())["model"]
    for k, v in ref.items():
        if k in sent:
            assert torch.allclose(back[k], v + sent[k])
        else:                          # not sent: the coordinator keeps what it sent
            assert torch.equal(back[k], v)


def test_dp_gaussian_noise_is_seeded_by_client_round_and_step() -> None:
    ref, new = _states()
    chain = FilterChain.from_specs([{"name": "dp_gaussian", "noise_multiplier": 1.0}])
    chain.plan(_federation(), "filters")
    a = chain.apply(FedAvg, {"model": new}, {"model": ref}, **_kw())["model"]
    b = chain.apply(FedAvg, {"model": new}, {"model": ref}, **_kw())["model"]
    c = chain.apply(FedAvg, {"model": new}, {"model": ref}, **_kw(step=1))["model"]
    d = chain.apply(FedAvg, {"model": new}, {"model": ref}, **_kw(client_id="1", seed=124))["model"]
    k = "layer1.0.weight"
    assert torch.equal(a[k], b[k]) and not torch.equal(a[k], c[k]) and not torch.equal(a[k], d[k])


def test_sigma_is_derived_for_the_client_taking_part_most_often() -> None:
    from medfl.privacy.accounting import epsilon_spent
    from medfl.privacy.ledger import planned_releases

    fed = _federation(n=5, rounds=6, fraction=0.4)
    chain = FilterChain.from_specs([{"name": "dp_gaussian", "epsilon": 2.0, "delta": 1e-3}])
    chain.plan(fed, "filters")
    most = max(planned_releases(fed).values())
    assert 1 <= most < 6
    rel = chain.releases()[0]
    eps = epsilon_spent([(rel.noise_multiplier, 1.0, most)], 1e-3, "rdp")
    assert 2.0 - 0.01 <= eps <= 2.0
    # the resolved entry a site receives carries sigma and does not re-derive it
    spec = chain.specs()[0]
    assert spec["noise_multiplier"] == rel.noise_multiplier and spec["epsilon"] == 2.0


@pytest.mark.parametrize("bad, match", [
    (lambda s: s["model"].pop("layer1.0.weight"), "missing"),
    (lambda s: s["model"].__setitem__("extra", torch.zeros(3)), "unexpected"),
    (lambda s: s["model"].__setitem__("layer1.0.weight", torch.zeros(2)), "shape"),
    (lambda s: s["model"]["layer1.0.weight"].fill_(float("nan")), "finite"),
    (lambda s: s.__setitem__("model", [1, 2]), "dict of tensors"),
])
def test_a_hostile_dp_update_is_refused(bad: Any, match: str) -> None:
    ref, new = _states()
    chain = FilterChain.from_specs([{"name": "dp_gaussian", "noise_multiplier": 1.0}])
    chain.plan(_federation(), "filters")
    sent = chain.apply(FedAvg, {"model": new}, {"model": ref}, **_kw())
    bad(sent)
    with pytest.raises(PayloadError, match=match):
        chain.undo(FedAvg, sent, {"model": ref}, **_kw())


@pytest.mark.parametrize("bad, match", [
    (lambda e: e.__setitem__("bits", 4), "bits"),
    (lambda e: e.__setitem__("codes", e["codes"][:-1]), "codes|byte"),
    (lambda e: e.__setitem__("lo", float("nan")), "finite|lo"),
    (lambda e: e.__setitem__("shape", (999,)), "shape|bytes"),
    (lambda e: e.__setitem__("shape", (e["codes"].numel(),)), "expected torch.float32 of shape"),
    (lambda e: e.__setitem__("dtype", 1), "expected torch.float32"),
])
def test_a_hostile_quantized_entry_is_refused(bad: Any, match: str) -> None:
    ref, new = _states()
    chain = FilterChain.from_specs([{"name": "quantize", "bits": 8}])
    sent = chain.apply(FedAvg, {"model": new}, {"model": ref}, **_kw())
    bad(sent["model"]["layer1.0.weight"])
    with pytest.raises(PayloadError, match=match):
        chain.undo(FedAvg, sent, {"model": ref}, **_kw())
    sent = chain.apply(FedAvg, {"model": new}, {"model": ref}, **_kw())
    sent["model"]["layer1.0.weight"] = new["layer1.0.weight"]   # a float tensor where codes belong
    with pytest.raises(PayloadError, match="quantized"):
        chain.undo(FedAvg, sent, {"model": ref}, **_kw())


# ------------------------------------------------------------------ bad settings, before training
BAD_FILTERS = [
    ([{"name": "dp_gaussian", "epsilon": 0}], "epsilon"),
    ([{"name": "dp_gaussian", "epsilon": -1}], "epsilon"),
    ([{"name": "dp_gaussian", "epsilon": 3, "delta": 1.5}], "delta"),
    ([{"name": "dp_gaussian", "epsilon": 3, "delta": 0}], "delta"),
    ([{"name": "dp_gaussian", "epsilon": 3, "clip": 0}], "clip"),
    ([{"name": "dp_gaussian", "epsilon": 3, "clip": -2}], "clip"),
    ([{"name": "dp_gaussian"}], "epsilon"),
    ([{"name": "dp_gaussian", "epsilon": 3, "accountant": "moments"}], "accountant"),
    ([{"name": "dp_gaussian", "epsilon": 3, "keys": "weights"}], "keys"),
    ([{"name": "quantize", "bits": 0}], "bits"),
    ([{"name": "quantize", "bits": 17}], "bits"),
    ([{"name": "quantize", "bits": True}], "bits"),
    ([{"name": "quantize", "bits": 8, "levels": 3}], "levels"),
    ([{"name": "quantize", "bits": 8, "update": "perhaps"}], r"update: expected true or false"),
    ([{"name": "quantize"}, {"name": "dp_gaussian", "epsilon": 3}], "last"),
    ([{"name": "dp_gaussian", "epsilon": 3}, {"name": "dp_gaussian", "epsilon": 3}], "one mechanism"),
    ([{"name": "zip"}], "unknown filter 'zip'"),
    ({"name": "quantize"}, "list"),
]


@pytest.mark.parametrize("filters, match", BAD_FILTERS)
def test_bad_filter_settings_fail_at_config_time(tiny_fl: dict, resolve: Any, filters: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve({**tiny_fl, "filters": filters})


def test_delta_must_be_below_one_over_the_number_of_clients(tiny_fl: dict, resolve: Any) -> None:
    from medfl.experiment import run_experiment
    from medfl.privacy.accounting import PrivacyConfigError

    cfg = resolve({**tiny_fl, "filters": [{"name": "dp_gaussian", "epsilon": 3, "delta": 0.4}]})
    with pytest.raises(PrivacyConfigError, match=r"delta.*1/N.*3 clients"):
        run_experiment(cfg)


@pytest.mark.parametrize("method, match", [
    ("local", "sends no model state"),
    ("fedskd", "work on the update"),
    ("fedcross_het", "work on the update"),
])
def test_filters_on_a_method_without_the_state_they_need(tiny_fl: dict, resolve: Any, method: str,
                                                          match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve({**tiny_fl, "methods": [{"name": method, "filters": [{"name": "dp_gaussian", "epsilon": 3}]}]})


def test_fl_filters_skip_a_method_that_cannot_take_them_and_the_run_says_so(
        tiny_fl: dict, resolve: Any, capfd: pytest.CaptureFixture) -> None:
    """``local`` sends metrics only: fl.filters does not apply to it, and its run records why
    (config.json, stderr, comparison.csv's epsilon column says inf)."""
    import json
    from pathlib import Path

    import pandas as pd

    from medfl.experiment import run_experiment

    cfg = resolve({**tiny_fl, "rounds": 1, "methods": ["fedavg", "local"],
                   "filters": [{"name": "dp_gaussian", "noise_multiplier": 1.0, "delta": 1e-3}]})
    out = Path(run_experiment(cfg)["dir"])
    assert "[local] privacy: runs without fl.filters: fl.filters: method 'local' sends no model state" in \
        capfd.readouterr().err
    plan = json.loads((out / "local" / "config.json").read_text())["privacy"]
    assert plan["private"] is False and "sends no model state" in plan["filters_not_applied"]
    assert json.loads((out / "fedavg" / "config.json").read_text())["privacy"]["private"] is True
    cmp = pd.read_csv(out / "comparison.csv").groupby("method")["epsilon"].first()
    assert cmp["local"] == float("inf") and cmp["fedavg"] < float("inf")


def test_quantize_applies_to_peer_to_peer_methods_and_entries_override_fl_filters(tiny_fl: dict,
                                                                                 resolve: Any) -> None:
    resolve({**tiny_fl, "methods": ["fedskd"], "filters": [{"name": "quantize", "bits": 8}]})
    cfg = resolve({**tiny_fl, "filters": [{"name": "dp_gaussian", "epsilon": 3}],
                   "methods": [{"name": "local", "filters": []}, "fedavg",
                               {"name": "fedavg", "label": "q4", "filters": [{"name": "quantize", "bits": 4}]}]})
    assert [m.get("filters") for m in cfg["methods"]] == [[], None, [{"name": "quantize", "bits": 4}]]


@pytest.mark.parametrize("dp, match", [
    ({"epsilon": 3, "noise_multiplier": 1.0}, "exactly one"),
    ({"max_grad_norm": 1.0}, "exactly one"),
    ({"epsilon": 0}, "epsilon"),
    ({"epsilon": 3, "delta": 2}, "delta"),
    ({"epsilon": 3, "max_grad_norm": 0}, "max_grad_norm"),
    ({"epsilon": 3, "accountant": "x"}, "accountant"),
    ({"epsilon": 3, "sigma": 1}, "unknown key"),
    ("on", "expected null or a dict"),
])
def test_bad_dp_sgd_settings_fail_at_config_time(tiny_fl: dict, resolve: Any, dp: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve({**tiny_fl, "train": {**tiny_fl["train"], "dp": dp}})


def test_dp_sgd_is_refused_for_methods_that_cannot_use_it(tiny_fl: dict, resolve: Any) -> None:
    dp = {**tiny_fl["train"], "dp": {"epsilon": 3}}
    for method in ("fedkper", "fedskd", "centralized"):
        with pytest.raises(ConfigError, match="does not support DP-SGD"):
            resolve({**tiny_fl, "methods": [method], "train": dp})
    # an entry's own train section turns it off for that method
    resolve({**tiny_fl, "methods": [{"name": "fedkper", "train": {"dp": None}}, "fedavg"], "train": dp})
    # local sends no model: fl.train.dp does not apply to it; named in its own entry, it is refused
    resolve({**tiny_fl, "methods": ["local", "fedavg"], "train": dp})
    with pytest.raises(ConfigError, match="does not support DP-SGD"):
        resolve({**tiny_fl, "methods": [{"name": "local", "train": {"dp": {"epsilon": 3}}}]})


def test_filter_config_error_is_a_value_error() -> None:
    assert issubclass(FilterConfigError, ValueError)
