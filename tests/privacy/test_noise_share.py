"""The DP noise against the clipped signal (medfl.privacy.signal): the engine's rows in
mechanisms.csv for every DP mechanism, and the warning with what to change when the noise
drowns the signal (issue 48, item 7), given only when the run's own score shows it did not learn
(issue 63, item 4: tests/privacy/test_dp_warning_utility.py checks that criterion against the
utility table)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from medfl.experiment import run_experiment
from medfl.filters import parameter_keys, trainable_count
from medfl.privacy.signal import BOUND_ONLY, DROWNED, NoiseShare, Utility, clients_needed, noise_to_signal


#: tiny_fl's model as the federation builds it (synthetic2d: one channel, two classes)
MODEL = {"name": "small_cnn", "width": 4, "spatial_dims": 2, "in_channels": 1, "num_classes": 2}


def _run(resolve: Any, fl: dict[str, Any]) -> Path:
    cfg = resolve(fl)
    out = run_experiment(cfg)
    return Path(out["dir"]) / (cfg["methods"][0].get("label") or cfg["methods"][0]["name"])


def _rows(run: Path, mechanism: str) -> pd.DataFrame:
    df = pd.read_csv(run / "mechanisms.csv", dtype={"id": str})
    return df[df["mechanism"] == mechanism]


def _value(df: pd.DataFrame, r: int, scope: str, cid: str, name: str) -> float:
    hit = df[(df["round"] == r) & (df["scope"] == scope) & (df["id"] == cid) & (df["name"] == name)]
    assert len(hit) == 1, (r, scope, cid, name)
    return float(hit["value"].iloc[0])


#: a run that learned nothing: 0.30 accuracy where predicting one class scores 0.45 (N = 100)
FLAT = Utility(split="local_val", metric="accuracy", round=3, score=0.30, majority=0.45, majority_class=0, examples=100)
#: a run that learned: 0.80
LEARNED = Utility(split="local_val", metric="accuracy", round=3, score=0.80, majority=0.45, majority_class=0,
                  examples=100)


def _utility(run: Path) -> dict[str, Any]:
    """The verdict's row of mechanisms.csv (scope run, id utility): numbers, and texts for text values."""
    df = pd.read_csv(run / "mechanisms.csv", dtype={"id": str, "text": str})
    u = df[(df["scope"] == "run") & (df["id"] == "utility")]
    return {n: (t if isinstance(t, str) and t else v) for n, v, t in zip(u["name"], u["value"], u["text"])}


def _warnings(run: Path) -> list[str]:
    return [w["warning"] for w in json.loads((run / "summary.json").read_text()).get("warnings", [])]


def test_the_ratio_is_sigma_sqrt_d_over_the_square_root_of_clients_and_steps() -> None:
    assert noise_to_signal(400, [1.0] * 4, [1.0] * 4, [1.0] * 4) == pytest.approx(10.0)   # 1 * 20 / 2
    assert noise_to_signal(400, [1.0], [16.0], [8.0]) == pytest.approx(20 / 8 / 4)        # sigma sqrt(d) / (B sqrt(T))
    # unequal clients: sqrt(d sum sigma^2 T / B^2) / sum T
    assert noise_to_signal(100, [1.0, 2.0], [4.0, 1.0], [2.0, 1.0]) == pytest.approx(math.sqrt(100 * (1 + 4)) / 5)
    assert math.isnan(noise_to_signal(10, [], [], []))
    assert clients_needed(14.0, 3) == 588


def test_the_warning_needs_a_ratio_above_one_and_a_score_at_the_majority_level() -> None:
    assert NoiseShare.warning(2, "dp_gaussian", 0.9, 3, "x", FLAT) == ""      # the noise cannot be why
    assert NoiseShare.warning(2, "dp_gaussian", 3.0, 4, "x", LEARNED) == ""   # it learned: a note, not a warning
    assert NoiseShare.warning(2, "dp_gaussian", 3.0, 4, "x", None) == ""      # nothing to judge by
    text = NoiseShare.warning(2, "dp_gaussian", 3.0, 4, "a larger epsilon", FLAT)
    assert text.startswith(f"{DROWNED} (dp_gaussian): the model scored 0.300 accuracy on local_val at round 3, "
                           "not above 0.549 (0.450, the score of predicting class 0 for every input, plus 2 standard "
                           "errors over 100 examples)")
    assert "from round 2" in text and "up to 3 times" in text
    assert "about 36 per round" in text and "a larger epsilon" in text and "mechanisms.csv" in text
    assert NoiseShare.bound_note(2, "dp_gaussian", 3.0, LEARNED).startswith(f"{BOUND_ONLY} (dp_gaussian)")
    assert "the noise did not keep it from learning" in NoiseShare.bound_note(2, "dp_gaussian", 3.0, LEARNED)
    assert NoiseShare.bound_note(2, "dp_gaussian", 3.0, FLAT) == NoiseShare.bound_note(2, "dp_gaussian", 0.5, None) == ""


def test_the_margin_is_two_binomial_standard_errors_of_the_majority_score() -> None:
    from medfl.privacy.signal import majority_score

    assert FLAT.margin == pytest.approx(2 * math.sqrt(0.45 * 0.55 / 100))
    # the best constant prediction, scored as the summary scores: the mean over clients
    score, cls, n = majority_score({"a": [0, 0, 0, 1], "b": [1, 1, 2, 2, 2, 2]})
    assert (cls, n) == (0, 10) and score == pytest.approx((0.75 + 0.0) / 2)
    assert math.isnan(majority_score({"a": []})[0])


def test_dp_gaussian_rows_and_one_warning_with_what_to_change(tiny_fl: dict, resolve: Any,
                                                              capfd: pytest.CaptureFixture) -> None:
    fl = {**tiny_fl, "rounds": 2, "filters": [{"name": "dp_gaussian", "epsilon": 4.0, "delta": 1e-3, "clip": 1.0}]}
    run = _run(resolve, fl)
    err = capfd.readouterr().err
    sigma = float(pd.read_csv(run / "privacy.csv")["noise_multiplier"].iloc[0])
    d = trainable_count(MODEL)
    df = _rows(run, "dp_gaussian")
    for r in (1, 2):
        n = _value(df, r, "round", "mean", "clients")
        assert n == 3 and _value(df, r, "round", "mean", "noised_values") == d
        ratio = _value(df, r, "round", "mean", "noise_to_signal")
        assert ratio == pytest.approx(sigma * math.sqrt(d / n))
        noise = _value(df, r, "round", "mean", "noise_norm")
        assert noise == pytest.approx(sigma * 1.0 * math.sqrt(d / n))
        received = _value(df, r, "round", "mean", "received_norm")
        assert _value(df, r, "round", "mean", "signal_norm_estimate") == pytest.approx(
            math.sqrt(max(0.0, received ** 2 - noise ** 2)))
        for cid in ("0", "1", "2"):
            assert _value(df, r, "client", cid, "noise_to_signal") == pytest.approx(sigma * math.sqrt(d))
            # the received update is the clipped one plus the noise: its norm is near the noise's
            assert _value(df, r, "client", cid, "received_norm") == pytest.approx(sigma * math.sqrt(d), rel=0.25)
    # the verdict: the tiny model's score on local_test (no val split evaluated) against the majority class
    u = _utility(run)
    assert u["split"] == "local_test" and u["reported_round"] == 2 and u["noise_to_signal"] == pytest.approx(ratio)
    drowned = [w for w in _warnings(run) if w.startswith(DROWNED)]
    assert u["learned"] == 0 and u["score"] <= u["majority_score"] + u["margin"]   # sigma ~ 4: it learns nothing
    assert len(drowned) == 1 and "from round 1" in drowned[0]          # once, not every round
    assert "on local_test at round 2" in drowned[0]
    assert "more clients per round" in drowned[0] and "epsilon" in drowned[0] and "fewer rounds" in drowned[0]
    assert f"about {clients_needed(ratio, 3)} per round" in drowned[0]
    assert err.count(DROWNED) == 1


def test_no_warning_when_the_noise_cannot_dominate(tiny_fl: dict, resolve: Any) -> None:
    fl = {**tiny_fl, "rounds": 1, "filters": [{"name": "dp_gaussian", "noise_multiplier": 0.01, "delta": 1e-3,
                                                "clip": 1.0}]}
    run = _run(resolve, fl)
    df = _rows(run, "dp_gaussian")
    assert _value(df, 1, "round", "mean", "noise_to_signal") < 1
    assert not [w for w in _warnings(run) if w.startswith(DROWNED)]


def test_dp_sgd_rows_follow_its_steps_batches_and_noise(tiny_fl: dict, resolve: Any) -> None:
    fl = {**tiny_fl, "rounds": 1, "train": {**tiny_fl["train"], "dp": {"epsilon": 5.0, "delta": 1e-3,
                                                                       "max_grad_norm": 1.0}}}
    run = _run(resolve, fl)
    priv = pd.read_csv(run / "privacy.csv", dtype={"client_id": str}).set_index("client_id")
    tm = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str}).set_index("client_id")
    d = trainable_count(MODEL)
    df = _rows(run, "dp_sgd")
    sigmas, steps, batches = [], [], []
    for cid in priv.index:
        sigma, q = float(priv.loc[cid, "noise_multiplier"]), float(priv.loc[cid, "sample_rate"])
        t, b = float(tm.loc[cid, "dp_steps"]), q * int(tm.loc[cid, "num_examples"])
        assert _value(df, 1, "client", cid, "steps") == t
        assert _value(df, 1, "client", cid, "expected_batch") == pytest.approx(b)
        assert _value(df, 1, "client", cid, "noise_to_signal") == pytest.approx(sigma * math.sqrt(d) / (b * math.sqrt(t)))
        sigmas.append(sigma), steps.append(t), batches.append(b)
    ratio = _value(df, 1, "round", "mean", "noise_to_signal")
    assert ratio == pytest.approx(noise_to_signal(d, sigmas, steps, batches))
    drowned = [w for w in _warnings(run) if w.startswith(f"{DROWNED} (dp_sgd)")]
    assert bool(drowned) == (ratio > 1 and _utility(run)["learned"] == 0)
    if drowned:
        assert "batch_size" in drowned[0]


def test_a_run_without_dp_has_no_noise_rows(tiny_fl: dict, resolve: Any) -> None:
    run = _run(resolve, {**tiny_fl, "rounds": 1})
    path = run / "mechanisms.csv"
    assert not path.is_file() or _rows(run, "dp_gaussian").empty


def _share(filters: list, release: str | None = None) -> NoiseShare:
    from types import SimpleNamespace

    plan = SimpleNamespace(chain=SimpleNamespace(filters=filters), dp_sgd=None, own=None,
                           method_release=SimpleNamespace(mechanism=release) if release else None)
    federation = SimpleNamespace(model_spec=lambda cid=None: MODEL, num_examples={})
    return NoiseShare(plan, federation, {"model": "global"}, parameter_keys, trainable_count)


def test_a_release_ratio_is_the_declared_noise_over_the_clipped_signal_per_sample() -> None:
    share = _share([], release="feature_gaussian")
    assert share.active
    share.observe(0, "a", {}, {}, {"signal_norm": 2.0, "noise_norm": 5.0, "released": 10.0})
    share.observe(0, "b", {}, {}, {"signal_norm": 4.0, "noise_norm": 5.0, "released": 10.0})
    rows, found = share.rows({}, {})
    by = {(r["scope"], r["id"]): r for r in rows}
    assert by["client", "a"]["noise_to_signal"] == 2.5 and by["client", "b"]["noise_to_signal"] == 1.25
    assert by["round", "mean"]["noise_to_signal"] == pytest.approx(5 / 3)
    (mechanism, ratio, clients, change), = found
    text = NoiseShare.warning(4, mechanism, ratio, clients, change, FLAT)
    assert "(feature_gaussian): the model scored" in text
    assert "from round 4 each released sample carries noise of 1.67 times" in text
    assert share.rows({}, {}) == ([], [])     # the round is forgotten


def test_dp_gaussian_measures_the_mean_received_update_at_the_coordinator() -> None:
    import torch

    from medfl.filters import parameter_keys
    from medfl.plugins import lookup

    f = lookup("filter", "dp_gaussian")(noise_multiplier=0.5, clip=1.0)
    share = _share([f])
    keys = parameter_keys(MODEL)
    from medfl.models.registry import build_model

    ref = {k: v.detach().clone() for k, v in build_model(MODEL).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    updates = {}
    for cid in ("0", "1", "2", "3"):
        u = {k: torch.randn(ref[k].shape, generator=g) * 0.05 for k in keys}
        updates[cid] = torch.cat([u[k].flatten() for k in keys]).double()
        state = {k: (v + u[k] if k in u else v) for k, v in ref.items()}
        share.observe(0, cid, {"model": state}, {"global": ref}, {})
    rows, found = share.rows({}, {})
    by = {(r["scope"], r["id"]): r for r in rows}
    d = sum(ref[k].numel() for k in keys)
    mean = sum(updates.values()) / 4
    assert by["round", "mean"]["noised_values"] == d == trainable_count(MODEL)
    assert by["round", "mean"]["received_norm"] == pytest.approx(float(mean.norm()), rel=1e-6)
    assert by["client", "2"]["received_norm"] == pytest.approx(float(updates["2"].norm()), rel=1e-6)
    noise2 = d * 0.25 / 4
    assert by["round", "mean"]["signal_norm_estimate"] == pytest.approx(
        math.sqrt(max(0.0, float(mean.dot(mean)) - noise2)), rel=1e-6)
    assert by["round", "mean"]["noise_to_signal"] == pytest.approx(0.5 * math.sqrt(d / 4))
    assert found[0][:3] == ("dp_gaussian", by["round", "mean"]["noise_to_signal"], 4)


def test_the_readme_dp_example_shows_the_warning_this_code_gives() -> None:
    """docs/privacy.md's first DP command (the demo bundle with dp_gaussian at epsilon 3, clip 1)
    does not learn and says so at the end of the run: the numbers the page quotes are the ones
    the run computes."""
    from medfl.privacy.accounting import noise_for_epsilon

    root = Path(__file__).resolve().parents[2]
    fl = json.loads((root / "bundles" / "demo" / "configs" / "train.json").read_text())["fl"]
    readme = (root / "docs" / "privacy.md").read_text()
    assert '--fl#filters \'[{"name": "dp_gaussian", "epsilon": 3, "clip": 1.0}' in readme
    n, rounds = fl["num_clients"], fl["rounds"]
    sigma = noise_for_epsilon(3.0, 1e-5, 1.0, rounds, "rdp")     # every client in every round
    d = trainable_count({**fl["model"], "spatial_dims": 2, "in_channels": 1, "num_classes": fl["dataset"]["num_classes"]})
    ratio = noise_to_signal(d, [sigma] * n, [1.0] * n, [1.0] * n)
    assert ratio > 1
    quoted = f"medfl [fedavg] round {rounds}: warning: {DROWNED} (dp_gaussian): the model scored "
    assert quoted in readme and "it learned little or nothing" in readme
    assert (f"from round 1 the noise in the mean of the round's {n} client update(s) has up to {ratio:.3g} times "
            "the norm") in readme
    assert "BatchNorm statistics are also still their initial values" in readme
    assert f"needs about {clients_needed(ratio, n)} per round" in readme
    assert f"a noise multiplier below {sigma / ratio:.3g} (now {sigma:.3g})" in readme
    assert f"({d} noised values)" in readme and f"d = {d:,}" in readme and f"σ = {sigma:.3g}" in readme


def test_the_last_privacy_line_repeats_that_the_noise_drowned_the_signal() -> None:
    from medfl.report import _privacy_line

    block = {"epsilon": 3.0, "worst_client": "0", "unit": "client", "delta": 1e-5, "accountant": "rdp"}
    text = NoiseShare.warning(1, "dp_gaussian", 466.0, 4, "a larger epsilon", FLAT)
    line = _privacy_line({"privacy": {"mechanisms": {"dp_gaussian": block}},
                          "warnings": [{"round": 1, "warning": "something else"}, {"round": 1, "warning": text}]})
    assert line.startswith("privacy: dp_gaussian epsilon 3 (worst client 0")
    assert f"; {DROWNED} (dp_gaussian) from round 1: what it learned is mostly noise" in line
    assert DROWNED not in _privacy_line({"privacy": {"mechanisms": {"dp_gaussian": block}}})


def test_clients_that_send_different_models_are_averaged_apart() -> None:
    import torch

    from medfl.plugins import lookup

    share = _share([lookup("filter", "dp_gaussian")(noise_multiplier=0.5, clip=1.0, keys="all")])
    for cid, key, n in (("a", "w", 3), ("b", "w", 3), ("c", "w", 5)):   # PFedCDP: a cluster per model
        share.observe(0, cid, {"model": {key: torch.ones(n)}}, {"global": {key: torch.zeros(n)}}, {})
    rows, found = share.rows({}, {})
    by = {(r["scope"], r["id"]): r for r in rows}
    assert by["round", "mean of 3 values"]["clients"] == 2 and by["round", "mean of 5 values"]["clients"] == 1
    assert by["round", "mean of 3 values"]["received_norm"] == pytest.approx(math.sqrt(3))
    assert [item[2] for item in found] == [2, 1]
