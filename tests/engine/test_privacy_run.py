"""Differential privacy in a whole run: the epsilon in privacy.csv and summary.json is what
Opacus's accountant gives for the run's noise, sampling rate and steps; a target epsilon is
reached (within the accountant's tolerance) and never exceeded; a resumed run reports the
same epsilon as an uninterrupted one; DP-SGD trains a ResNet with GroupNorm and gives each
client its own epsilon."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
from opacus.accountants import create_accountant

from medfl.experiment import resume, run_experiment


def _run(resolve: Any, fl: dict[str, Any]) -> Path:
    """Run a one-method experiment; its run directory."""
    cfg = resolve(fl)
    out = run_experiment(cfg)
    return Path(out["dir"]) / (cfg["methods"][0].get("label") or cfg["methods"][0]["name"])


def _opacus_epsilon(history: list[tuple[float, float, int]], delta: float, accountant: str = "rdp") -> float:
    acc = create_accountant(mechanism=accountant)
    acc.history = list(history)
    with np.errstate(divide="ignore"):   # PRV takes log(1 - q) at q = 1 on purpose
        return float(acc.get_epsilon(delta))


def _privacy(run: Path) -> pd.DataFrame:
    return pd.read_csv(run / "privacy.csv", dtype={"client_id": str})


@pytest.mark.plots
def test_dp_gaussian_run_reports_opacus_epsilon_and_reaches_the_target(tiny_fl: dict, resolve: Any) -> None:
    fl = {**tiny_fl, "rounds": 3, "filters": [{"name": "dp_gaussian", "epsilon": 4.0, "delta": 1e-3, "clip": 1.0}]}
    run = _run(resolve, fl)
    df = _privacy(run)
    assert list(df.columns) == ["round", "client_id", "mechanism", "unit", "noise_multiplier", "clip", "steps",
                                "total_steps", "sample_rate", "epsilon", "delta", "accountant"]
    assert len(df) == 3 * 3 and set(df["mechanism"]) == {"dp_gaussian"} and set(df["sample_rate"]) == {1.0}
    sigma = float(df["noise_multiplier"].iloc[0])
    for _, row in df.iterrows():    # each round's epsilon so far is Opacus's for that history
        assert row["epsilon"] == pytest.approx(_opacus_epsilon([(sigma, 1.0, int(row["round"]))], 1e-3), rel=1e-9)
    final = df[df["round"] == 3]["epsilon"]
    assert 4.0 - 0.01 <= final.max() <= 4.0          # every client takes part in every round
    summary = json.loads((run / "summary.json").read_text())["privacy"]
    block = summary["mechanisms"]["dp_gaussian"]
    assert summary["epsilon"] == pytest.approx(final.max()) and block["target_epsilon"] == 4.0
    assert block["accountant"] == "rdp" and block["delta"] == 1e-3 and block["unit"] == "client"
    assert "num_examples" in summary["not_covered"]
    cfg = json.loads((run / "config.json").read_text())["privacy"]
    assert cfg["dp_gaussian"]["noise_multiplier"] == sigma and cfg["filters"][0]["noise_multiplier"] == sigma
    assert (run / "plots" / "privacy.png").is_file()
    cmp = pd.read_csv(run.parent / "comparison.csv")
    assert np.allclose(cmp["epsilon"], final.max()) and set(cmp["dp_mechanisms"]) == {"dp_gaussian"}


def test_each_client_spends_only_in_the_rounds_it_takes_part_in(tiny_fl: dict, resolve: Any) -> None:
    fl = {**tiny_fl, "rounds": 4, "num_clients": 3, "fraction": 0.5,
          "filters": [{"name": "dp_gaussian", "noise_multiplier": 1.5, "delta": 1e-3}]}
    run = _run(resolve, fl)
    df = _privacy(run)
    tm = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
    assert sorted(zip(df["round"], df["client_id"])) == sorted(zip(tm["round"], tm["client_id"]))
    for cid, rows in df.groupby("client_id"):
        k = len(rows)
        assert rows["epsilon"].iloc[-1] == pytest.approx(_opacus_epsilon([(1.5, 1.0, k)], 1e-3), rel=1e-9)
    per_client = json.loads((run / "summary.json").read_text())["privacy"]["mechanisms"]["dp_gaussian"]["per_client"]
    assert len(set(per_client.values())) > 1       # clients sampled a different number of times


def test_a_resumed_dp_run_reports_the_same_epsilon(tiny_fl: dict, resolve: Any) -> None:
    fl = {**tiny_fl, "rounds": 3, "filters": [{"name": "dp_gaussian", "epsilon": 2.0, "delta": 1e-3},
                                              {"name": "quantize", "bits": 8}]}
    full = _run(resolve, {**fl, "name": "full"})
    stopped = _run(resolve, {**fl, "name": "stopped", "stop_after_round": 1})
    assert not (stopped / "summary.json").exists()
    resume(stopped)
    for f in ("privacy.csv", "metrics.csv"):
        a, b = pd.read_csv(full / f), pd.read_csv(stopped / f)
        pd.testing.assert_frame_equal(a, b)
    s1 = json.loads((full / "summary.json").read_text())["privacy"]
    s2 = json.loads((stopped / "summary.json").read_text())["privacy"]
    assert s1 == s2


def test_prv_accountant_is_selectable(tiny_fl: dict, resolve: Any) -> None:
    fl = {**tiny_fl, "rounds": 2, "filters": [{"name": "dp_gaussian", "epsilon": 3.0, "delta": 1e-3,
                                               "accountant": "prv"}]}
    df = _privacy(_run(resolve, fl))
    assert set(df["accountant"]) == {"prv"}
    last = df[df["round"] == 2].iloc[0]
    assert last["epsilon"] == pytest.approx(
        _opacus_epsilon([(float(last["noise_multiplier"]), 1.0, 2)], 1e-3, "prv"), rel=1e-6)
    assert last["epsilon"] <= 3.0 + 1e-9


def test_a_run_without_dp_says_it_guarantees_nothing(tiny_fl: dict, resolve: Any) -> None:
    run = _run(resolve, {**tiny_fl, "rounds": 1})
    assert not (run / "privacy.csv").exists()
    privacy = json.loads((run / "summary.json").read_text())["privacy"]
    assert privacy == {"private": False, "epsilon": None, "mechanisms": {}}
    cmp = pd.read_csv(run.parent / "comparison.csv")
    assert (cmp["epsilon"] == float("inf")).all() and set(cmp["dp_mechanisms"]) == {"none"}


def test_dp_sgd_trains_a_resnet_with_groupnorm_and_gives_each_client_its_epsilon(
        tiny_fl: dict, resolve: Any, capfd: pytest.CaptureFixture) -> None:
    fl = {**tiny_fl, "rounds": 2, "model": {"name": "resnet10", "width": 4},
          "train": {**tiny_fl["train"], "dp": {"epsilon": 5.0, "delta": 1e-3, "max_grad_norm": 1.0}}}
    run = _run(resolve, fl)
    err = capfd.readouterr().err
    assert "GroupNorm" in err and "dp_sgd" in err
    cfg = json.loads((run / "config.json").read_text())
    fix = cfg["privacy"]["dp_sgd"]["model_fix"]
    assert fix and all("BatchNorm" in line and "GroupNorm" in line for line in fix)
    state = __import__("torch").load(sorted((run / "checkpoints").glob("round_*.pt"))[-1], weights_only=True)
    assert not any("running_mean" in k for k in state["method"]["global"])
    df = _privacy(run)
    assert set(df["mechanism"]) == {"dp_sgd"} and set(df["unit"]) == {"sample"}
    sizes = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str}).groupby("client_id")["num_examples"].first()
    tm = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
    for cid, rows in df.groupby("client_id"):
        q, sigma = float(rows["sample_rate"].iloc[0]), float(rows["noise_multiplier"].iloc[0])
        bs = 8
        assert q == pytest.approx(1 / -(-int(sizes[cid]) // bs))
        steps = int(rows["total_steps"].iloc[-1])
        assert steps == int(tm[tm["client_id"] == cid]["dp_steps"].sum())
        eps = rows["epsilon"].iloc[-1]
        assert eps == pytest.approx(_opacus_epsilon([(sigma, q, steps)], 1e-3), rel=1e-9)
        assert 5.0 - 0.01 <= eps <= 5.0
    assert df.groupby("client_id")["noise_multiplier"].first().nunique() > 1   # each client its own N_k


def test_resuming_with_more_rounds_says_the_noise_changed_and_reports_the_true_epsilon(
        tiny_fl: dict, resolve: Any, capfd: pytest.CaptureFixture) -> None:
    fl = {**tiny_fl, "rounds": 2, "stop_after_round": 1,
          "filters": [{"name": "dp_gaussian", "epsilon": 2.0, "delta": 1e-3}]}
    run = _run(resolve, fl)
    capfd.readouterr()
    resume(run, rounds=4)
    assert "noise differs from the noise spent so far" in capfd.readouterr().err
    df = _privacy(run)
    sigma = df.groupby("round")["noise_multiplier"].first()
    s1, s2 = float(sigma[1]), float(sigma[4])
    assert s2 > s1      # four planned rounds need more noise than two for the same target
    last = df[df["round"] == 4].iloc[0]
    assert last["epsilon"] == pytest.approx(_opacus_epsilon([(s1, 1.0, 1), (s2, 1.0, 3)], 1e-3), rel=1e-9)


def _delta_avg_method() -> type:
    """An outside SCAFFOLD-like plugin: a ``HubAndSpoke`` subclass that replies its update
    under ``delta_y`` while its inherited ``reply_state`` still names ``model``."""
    from medfl.hub import HubAndSpoke
    from medfl.messages import Reply

    class DeltaAvg(HubAndSpoke):
        name = "test_delta_avg"

        def reply_keys(self, instruction):  # type: ignore[no-untyped-def]
            return frozenset({"delta_y"})   # declared (Method.reply_keys); only reply_state is stale

        def client_update(self, client, instruction):  # type: ignore[no-untyped-def]
            reply = super().client_update(client, instruction)
            old, new = instruction.payload["model"], reply.payload["model"]
            delta = {k: new[k] - old[k] if new[k].is_floating_point() else new[k] for k in new}
            return Reply(payload={"delta_y": delta}, metrics=reply.metrics, num_examples=reply.num_examples)

        def server_update(self, round, replies):  # type: ignore[no-untyped-def]
            n = len(replies)
            for k, v in self.global_state.items():
                if v.is_floating_point():
                    self.global_state[k] = v + sum(r.payload["delta_y"][k] for r in replies.values()) / n

    return DeltaAvg


def test_a_filter_chain_that_would_filter_nothing_stops_the_run(tiny_fl: dict, resolve: Any) -> None:
    """Issue 38: a method whose reply carries tensors outside its ``reply_state`` while it
    lacks a ``reply_state`` key passes the filters untouched; with ``dp_gaussian`` the run
    would record epsilon 3 for updates sent in the clear. It stops naming the method and the
    keys; without filters the same method runs."""
    from contract_methods import methods_registered

    from medfl.config import ConfigError
    from medfl.messages import PayloadError

    with methods_registered(_delta_avg_method(), name="delta-avg-test"):
        plain = _run(resolve, {**tiny_fl, "methods": [{"name": "test_delta_avg"}]})
        assert (plain / "summary.json").is_file() and not (plain / "privacy.csv").is_file()
        fl = {**tiny_fl, "name": "dp", "methods": [{"name": "test_delta_avg"}],
              "filters": [{"name": "dp_gaussian", "epsilon": 3.0, "delta": 1e-3, "clip": 1.0}]}
        # its declared reply keys say so before anything is written (issue 49, item 3) ...
        with pytest.raises(ConfigError, match=r"method 'test_delta_avg' replies \['delta_y'\] beside its model state "
                                              r"\['model'\] under differential privacy"):
            _run(resolve, fl)
        assert not (Path(tiny_fl["output_dir"]) / "dp").exists()
        # ... and with the opt-in to send uncovered entries, the reply without its model state still stops the run
        with pytest.raises(PayloadError, match=r"names \['model'\] in reply_state but its reply carries \['delta_y'\]"):
            _run(resolve, {**fl, "uncovered_entries": {"under_dp": "send_in_clear"}})
    runs = Path(tiny_fl["output_dir"]) / "dp" / "test_delta_avg"
    assert not (runs / "summary.json").is_file()
    privacy = runs / "privacy.csv"
    assert not privacy.is_file() or pd.read_csv(privacy).empty


def test_the_coordinator_drops_a_reply_that_the_filters_cannot_have_covered() -> None:
    """The coordinator's own check (a modified site may skip the client's): ``check_covered``
    refuses tensors outside ``reply_state`` while a ``reply_state`` key is missing, and
    passes a declared release's keys and a reply without tensors."""
    import torch

    from medfl.filters import FilterChain
    from medfl.messages import PayloadError

    chain = FilterChain.from_specs([{"name": "quantize", "bits": 8}])
    method = _delta_avg_method()
    state = {"w": torch.zeros(3)}
    with pytest.raises(PayloadError, match=r"carries \['delta_y'\] instead"):
        chain.check_covered(method, {"delta_y": state}, "reply of client 0")
    chain.check_covered(method, {"model": state, "delta_y": state}, "reply of client 0")   # model present
    chain.check_covered(method, {"shared_x": torch.zeros(2, 3)}, "reply", exempt={"shared_x"})
    chain.check_covered(method, {"count": 3.0}, "reply")
    FilterChain([]).check_covered(method, {"delta_y": state}, "reply")   # no filters: nothing to check


@pytest.mark.parametrize("extra", [
    {"filters": [{"name": "dp_gaussian", "epsilon": 3.0, "delta": 1e-3, "clip": 1.0}]},
    {"train": {"batch_size": 8, "lr": 0.05, "dp": {"epsilon": 3.0, "delta": 1e-3}}},
    {"methods": [{"name": "pfedcdp"}]},     # its default filters: dp_gaussian epsilon 5, quantize
], ids=["dp_gaussian", "dp_sgd", "pfedcdp"])
def test_cross_test_under_dp_is_refused_without_the_opt_in(tiny_fl: dict, resolve: Any, extra: dict) -> None:
    """Issue 38, item 2: ``cross_test`` sends every client's personalised model in the clear;
    under any DP plan it ran and the summary still said ``private: true``. It is refused
    before round 1, naming the option; without DP it still runs."""
    from medfl.config import ConfigError

    fl = {**tiny_fl, "eval_splits": ["test", "cross_test"], **extra}
    with pytest.raises(ConfigError, match=r"cross_test.*in the clear.*fl\.cross_test \{\"under_dp\": \"send_models\"\}"):
        resolve(fl)
    with pytest.raises(ConfigError, match=r"fl\.cross_test\.under_dp: expected one of 'refuse', 'send_models'"):
        resolve({**fl, "cross_test": {"under_dp": "yes"}})
    resolve({**tiny_fl, "eval_splits": ["test", "cross_test"]})   # no DP: nothing to refuse
    # a run reopened from a config saved before the refusal (resume, predict) is recorded as sending them
    from medfl.config import cross_test_in_clear
    assert cross_test_in_clear(fl, True, "a reopened run", refuse=False)
    assert not cross_test_in_clear({**fl, "eval_splits": ["test"]}, True, "a reopened run", refuse=False)


def test_cross_test_under_dp_with_the_opt_in_says_the_run_is_not_private(tiny_fl: dict, resolve: Any) -> None:
    """With ``fl.cross_test: {"under_dp": "send_models"}`` the models are sent (cross_test.csv)
    and the run's privacy record says what left in the clear: ``private: false``, no epsilon
    claimed, ``sent_in_clear`` and ``not_covered`` naming the models; privacy.csv still
    records what the releases spent."""
    from medfl.config import CROSS_TEST_IN_CLEAR

    fl = {**tiny_fl, "eval_splits": ["test", "cross_test"], "cross_test": {"under_dp": "send_models"},
          "filters": [{"name": "dp_gaussian", "epsilon": 3.0, "delta": 1e-3, "clip": 1.0}]}
    run = _run(resolve, fl)
    assert CROSS_TEST_IN_CLEAR == "cross_test: every site's personalised model, sent in the clear"
    summary = json.loads((run / "summary.json").read_text())["privacy"]
    assert summary["private"] is False and summary["epsilon"] is None
    assert summary["sent_in_clear"] == [CROSS_TEST_IN_CLEAR] and CROSS_TEST_IN_CLEAR in summary["not_covered"]
    assert summary["mechanisms"]["dp_gaussian"]["epsilon"] <= 3.0    # what the releases alone spent
    plan = json.loads((run / "config.json").read_text())["privacy"]
    assert plan["private"] is False and plan["sent_in_clear"] == [CROSS_TEST_IN_CLEAR]
    assert len(_privacy(run)) == 2 * 3 and (run / "cross_test.csv").is_file()
    cmp = pd.read_csv(run.parent / "comparison.csv")
    assert np.isinf(cmp["epsilon"]).all()
