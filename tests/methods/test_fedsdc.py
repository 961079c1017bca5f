"""FedSDC / FedSDC+ (paper 002): seeded head widths and shuffles, the body through the existing
FedAvgM (eqs. 4-5) by hand, the ensemble's vote fractions and mean probabilities, FedSDC+'s
top-gamma heads from the clients' validation micro-F1, a run of both, and exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

import pandas as pd
import pytest
import torch
from torch import nn

from medfl.config import resolve_config
from medfl.experiment import resume, run_experiment
from medfl.messages import Reply
from medfl.method import Federation, MethodConfigError, derive_seed
from medfl_plugins.fedsdc import FedSDC
from medfl_plugins.fedsdc.models import HeadEnsemble, head_assignment, head_widths


def test_head_widths_and_shuffle_are_seeded_and_switchable():
    w = head_widths(6, 100, seed=3, rho_min=0.4, rho_max=1.0, diversity=True)
    assert w == head_widths(6, 100, seed=3, rho_min=0.4, rho_max=1.0, diversity=True)
    assert all(40 <= v <= 100 for v in w) and len(set(w)) > 1
    assert head_widths(4, 100, 3, 0.4, 1.0, diversity=False) == [100] * 4          # ablation: no Diversity
    ids = ["0", "1", "2", "3", "4"]
    a1, a2 = head_assignment(ids, 0, 1, True), head_assignment(ids, 0, 2, True)
    assert sorted(a1.values()) == list(range(5)) and a1 != a2 and a1 == head_assignment(ids, 0, 1, True)
    assert head_assignment(ids, 0, 1, False) == {c: i for i, c in enumerate(ids)}  # ablation: no Shuffle
    with pytest.raises(MethodConfigError, match="gamma"):
        FedSDC(gamma=1.5)


def _fed() -> Federation:
    return Federation(client_ids=["0", "1"], eval_client_ids=["0", "1"], num_examples={"0": 30, "1": 10},
                      num_classes=2, rounds=2, seed=0, model={"name": "small_cnn", "width": 2})


def test_body_is_averaged_and_stepped_by_fedavgm_by_hand():
    m = FedSDC(beta=0.5)
    m.setup(_fed())
    k = m._avgm.param_keys[0]
    w0 = m.body[k].clone()

    def replies(d0: float, d1: float) -> dict[str, Reply]:
        return {cid: Reply(payload={"body": {kk: v + d for kk, v in m.body.items()}, "head": m.heads[0]},
                           num_examples=n) for cid, d, n in (("0", d0, 30), ("1", d1, 10))}

    m.server_update(1, replies(1.0, 3.0))          # avg = w0 + 1.5; v = w0 - avg = -1.5; w1 = w0 + 1.5
    torch.testing.assert_close(m.body[k], w0 + 1.5)
    m.server_update(2, replies(0.0, 0.0))          # avg = w1; v = 0.5 * -1.5 + 0 = -0.75; w2 = w1 + 0.75
    torch.testing.assert_close(m.body[k], w0 + 2.25)


def test_ensemble_votes_and_mean_probabilities():
    class Body(nn.Module):
        def embed(self, x):
            return x

    heads = [nn.Linear(2, 2, bias=False) for _ in range(3)]
    with torch.no_grad():
        heads[0].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))   # class = larger input
        heads[1].weight.copy_(torch.tensor([[1.0, 0.0], [0.0, 1.0]]))
        heads[2].weight.copy_(torch.tensor([[0.0, 1.0], [1.0, 0.0]]))   # the opposite
    x = torch.tensor([[2.0, 0.0], [0.0, 2.0]])
    votes = HeadEnsemble(Body(), heads, "majority", tie_break="lowest")(x)
    torch.testing.assert_close(votes, torch.tensor([[2 / 3, 1 / 3], [1 / 3, 2 / 3]]))
    mean = HeadEnsemble(Body(), heads, "mean")(x)
    p = torch.softmax(torch.tensor([2.0, 0.0]), 0)
    torch.testing.assert_close(mean[0], (2 * p + p.flip(0)) / 3)
    assert HeadEnsemble.returns_probabilities


def test_fedsdc_plus_keeps_the_top_gamma_heads_by_validation_micro_f1():
    m = FedSDC(gamma=0.5)
    m.setup(_fed())
    m.heads = m.heads + [m.heads[0], m.heads[1]]     # four heads
    m.widths = m.widths + m.widths
    nan = math.nan
    m.server_validate(1, {"0": {"micro_f1_0": 0.5, "micro_f1_1": 0.9, "micro_f1_2": 0.7, "micro_f1_3": 0.7},
                          "1": {"micro_f1_0": 0.7, "micro_f1_1": nan, "micro_f1_2": 0.7, "micro_f1_3": 0.7}})
    assert m.chosen == [1, 2]                        # means 0.6, 0.9, 0.7, 0.7: the tie goes to head 2
    assert len(m.configure_evaluate(1)["0"].payload["heads"]) == 2


def test_runs_and_the_evaluated_model_is_the_ensemble(tiny_fl):
    tiny_fl["methods"] = [{"name": "fedsdc"}, {"name": "fedsdc", "gamma": 0.3, "vote": "mean", "label": "fedsdc_plus"}]
    out = run_experiment(resolve_config(tiny_fl))
    plain, plus = out["summaries"]["fedsdc"], out["summaries"]["fedsdc_plus"]
    assert plain["method_report"]["ensemble_heads"] == [0, 1, 2]
    assert len(plus["method_report"]["ensemble_heads"]) == 1 and len(plus["method_report"]["validation_micro_f1"]) == 3
    for s in (plain, plus):   # micro-F1, the paper's primary metric, is in every summary
        assert 0 <= s["final"]["global_test"]["micro_f1"]["mean"] <= 1
    # ... and it is the ensemble's: medfl predict rebuilds body + all three checkpointed heads,
    # and the vote's accuracy (= micro-F1 for one label per image) on the held-out images
    # matches the summary's micro-F1
    from medfl.predict import predict

    run_dir = Path(out["dir"]) / "fedsdc"
    pred = pd.read_csv(predict(run_dir, split="global_test"), dtype={"client_id": str})
    state = torch.load(sorted((run_dir / "checkpoints").glob("*.pt"))[-1], weights_only=False)
    assert len(state["method"]["heads"]) == 3
    micro = pred.groupby("client_id").apply(lambda d: float((d["prediction"] == d["label"]).mean()))
    assert micro.mean() == pytest.approx(plain["final"]["global_test"]["micro_f1"]["mean"])


def test_a_stopped_run_resumes_to_the_uninterrupted_numbers(tiny_fl, tmp_path):
    """FedSDC+ (heads, chosen heads, FedAvgM velocity, observables and warnings in the
    checkpoint) and the issue's adaptive and FedDisco baselines resume exactly."""
    tiny_fl["rounds"] = 3
    tiny_fl["client_split"] = {"train": 0.6, "val": 0.2, "test": 0.2}
    tiny_fl["methods"] = [{"name": "fedsdc", "gamma": 0.5, "label": "fedsdc_plus"}, {"name": "fedyogi"},
                          {"name": "fedadagrad"}, {"name": "feddisco"}]
    full = run_experiment(resolve_config(dict(tiny_fl, name="full")))
    stopped = run_experiment(resolve_config(dict(tiny_fl, name="part", stop_after_round=2)))
    resume(stopped["dir"])
    for label in ("fedsdc_plus", "fedyogi", "fedadagrad", "feddisco"):
        for f in ("metrics.csv", "train_metrics.csv") + (("validation_metrics.csv", "mechanisms.csv")
                                                         if label == "fedsdc_plus" else ()):
            a = pd.read_csv(Path(full["dir"]) / label / f)
            b = pd.read_csv(Path(stopped["dir"]) / label / f)
            pd.testing.assert_frame_equal(a, b)
    summaries = [json.loads((Path(d) / "fedsdc_plus" / "summary.json").read_text()) for d in (full["dir"], stopped["dir"])]
    assert summaries[0]["method_report"] == summaries[1]["method_report"]
    assert summaries[0]["warnings"] == summaries[1]["warnings"] and len(summaries[0]["warnings"]) == 1


# ------------------------------------------------------------------ issue 37: the vote's tie rule
def _expected_votes(logits: torch.Tensor, rule: str) -> list[int]:
    """The decided class of each sample, computed sample by sample with numpy."""
    z = logits.double().numpy()
    p = np.exp(z - z.max(2, keepdims=True))
    p /= p.sum(2, keepdims=True)
    out = []
    for b in range(z.shape[1]):
        votes = p[:, b].argmax(1)
        counts = np.bincount(votes, minlength=z.shape[2])
        tied = np.flatnonzero(counts == counts.max())
        if len(tied) == 1 or rule == "lowest":
            out.append(int(tied[0]))
        elif rule == "mean_probability":
            out.append(int(tied[p[:, b, tied].mean(0).argmax()]))
        else:   # logit_sum: the argmax of the summed logits over every class
            out.append(int(z[:, b].sum(0).argmax()))
    return out


#: four heads, three samples, three classes: sample 0 has a clear majority (class 2);
#: sample 1 ties classes 1 and 2 (head 3 is sure of 2, and class 0 is every head's close
#: second, so the summed logits pick 0); sample 2 ties 0 and 1, the heads voting 1 surer
TIE_LOGITS = torch.tensor([
    [[0.0, 1.0, 3.0], [4.9, 5.0, 0.0], [3.0, 1.0, 0.0]],
    [[0.0, 1.0, 3.0], [4.9, 0.0, 5.0], [3.0, 2.5, 0.0]],
    [[1.0, 0.0, 3.0], [4.9, 5.0, 0.0], [0.0, 4.0, 0.0]],
    [[0.0, 3.0, 1.0], [4.9, 0.0, 8.0], [0.0, 4.0, 0.0]],
])
TIE_CASES = [("lowest", [2, 1, 0]), ("mean_probability", [2, 2, 1]), ("logit_sum", [2, 0, 1])]


@pytest.mark.parametrize("rule, decided", TIE_CASES)
def test_tie_rules_decide_ties_and_return_probabilities(rule: str, decided: list[int]) -> None:
    from medfl_plugins.fedsdc.models import ensemble_probabilities, vote_counts

    assert _expected_votes(TIE_LOGITS, rule) == decided            # the hand-built cases are what they claim
    p = ensemble_probabilities(TIE_LOGITS, "majority", rule)
    assert p.argmax(1).tolist() == decided
    assert (p >= 0).all() and torch.allclose(p.sum(1), torch.ones(3))
    torch.testing.assert_close(vote_counts(TIE_LOGITS), torch.tensor([[0.0, 1, 3], [0, 2, 2], [2, 2, 0]]))
    frac = vote_counts(TIE_LOGITS) / 4
    mean = torch.softmax(TIE_LOGITS, 2).mean(0)
    if rule == "lowest":
        torch.testing.assert_close(p, frac)                         # before issue 37: the vote fractions
    elif rule == "mean_probability":
        w = 1 / (2 * (4 + 1))
        torch.testing.assert_close(p, (1 - w) * frac + w * mean)
    else:   # the untied sample keeps its fractions; the tied ones are the summed logits' softmax
        torch.testing.assert_close(p[0], frac[0])
        torch.testing.assert_close(p[1:], torch.softmax(TIE_LOGITS.sum(0), 1)[1:])


def test_mean_probability_never_overturns_a_majority() -> None:
    """Random heads (H = 1..6): the decision is always a class with the most votes, the one of
    highest mean probability among them."""
    from medfl_plugins.fedsdc.models import ensemble_probabilities

    g = torch.Generator().manual_seed(0)
    for h in range(1, 7):
        logits = torch.randn(h, 200, 4, generator=g) * 3
        p = ensemble_probabilities(logits, "majority", "mean_probability")
        assert p.argmax(1).tolist() == _expected_votes(logits, "mean_probability")
        torch.testing.assert_close(ensemble_probabilities(logits, "mean"), torch.softmax(logits, 2).mean(0))


def test_head_kinds_and_activation() -> None:
    from medfl_plugins.fedsdc.models import make_head

    relu, plain = make_head(16, 8, 3, 0.5), make_head(16, 8, 3, 0.5, activation="none")
    assert list(relu.state_dict()) == list(plain.state_dict()) == ["0.weight", "0.bias", "3.weight", "3.bias"]
    assert isinstance(relu[1], nn.ReLU) and isinstance(plain[1], nn.Identity) and relu[2].p == 0.5
    plain.eval()
    z = torch.randn(5, 16)
    w1, b1, w2, b2 = (plain.state_dict()[k] for k in ("0.weight", "0.bias", "3.weight", "3.bias"))
    torch.testing.assert_close(plain(z), (z @ w1.T + b1) @ w2.T + b2)   # the authors' head is affine at test time
    linear = make_head(16, 8, 3, 0.5, kind="linear")
    assert [tuple(p.shape) for p in linear.parameters()] == [(3, 16), (3,)]


def _rhos(seed: int, n: int, lo: float = 0.4, hi: float = 1.0, stratified: bool = False) -> list[float]:
    step = (hi - lo) / n
    return [float(np.random.default_rng(derive_seed(seed, "rho", i)).uniform(
        lo + i * step if stratified else lo, lo + (i + 1) * step if stratified else hi)) for i in range(n)]


def test_min_hidden_scales_rho_over_a_wider_base_and_stratified_rho() -> None:
    r = _rhos(3, 5)
    assert head_widths(5, 16, 3, 0.4, 1.0, True) == [max(1, round(x * 16)) for x in r]        # the paper's rule
    assert head_widths(5, 16, 3, 0.4, 1.0, True, min_hidden=64) == [round(x * 64) for x in r]  # same rho, base 64
    assert head_widths(5, 100, 3, 0.4, 1.0, True, min_hidden=64) == [round(x * 100) for x in r]  # no effect
    assert head_widths(3, 16, 3, 0.4, 1.0, False, min_hidden=64) == [64] * 3
    s = _rhos(3, 5, stratified=True)
    widths = head_widths(5, 1000, 3, 0.4, 1.0, True, sampling="stratified")
    assert widths == [round(x * 1000) for x in s]
    assert all(400 + 120 * i <= w <= 400 + 120 * (i + 1) for i, w in enumerate(widths))


KEEP_CASES = [(0.3, 5, "floor", 1), (0.3, 5, "round", 2), (0.3, 5, "ceil", 2), (0.5, 5, "floor", 2),
              (0.5, 5, "round", 3), (0.5, 5, "ceil", 3), (0.1, 3, "floor", 1), (0.7, 10, "ceil", 7),
              (1.0, 4, "floor", 4)]


@pytest.mark.parametrize("gamma, n, rule, kept", KEEP_CASES)
def test_kept_heads_rounding(gamma: float, n: int, rule: str, kept: int) -> None:
    from medfl_plugins.fedsdc.models import kept_heads

    assert kept_heads(gamma, n, rule) == kept      # 0.7 x 10 is 7.000000000000001 in floats: still 7


def test_fedsdc_plus_keeps_as_many_heads_as_the_rounding_says() -> None:
    scores = {"0": {f"micro_f1_{i}": v for i, v in enumerate([0.2, 0.9, 0.5, 0.7])}}
    for rule, chosen in (("floor", [1]), ("round", [1, 3]), ("ceil", [1, 3])):
        m = FedSDC(gamma=0.375, keep_rounding=rule)           # 0.375 x 4 = 1.5
        m.setup(_fed())
        m.heads, m.widths = m.heads * 2, m.widths * 2
        m.server_validate(1, scores)
        assert m.chosen == chosen


BAD_OPTIONS = [("tie_break", "random"), ("head", "conv"), ("head_activation", "tanh"), ("keep_rounding", "up"),
               ("rho_sampling", "normal"), ("min_hidden", 0), ("min_hidden", 2.5), ("vote", "plurality"),
               ("gamma", 0.0)]


@pytest.mark.parametrize("key, value", BAD_OPTIONS)
def test_every_option_is_checked_with_one_clear_error(key: str, value: Any) -> None:
    with pytest.raises(MethodConfigError, match=rf"fedsdc: {key} must be"):
        FedSDC(**{key: value})


def _results(n: list[int], ties: list[int], heads: int = 2) -> dict[str, dict[str, float]]:
    return {str(c): {"n_val": float(k), "vote_ties": float(t), "vote_disagreements": float(t), "vote_correct": 0.0,
                     **{f"{m}_{i}": 0.5 for i in range(heads) for m in ("micro_f1", "accuracy")}}
            for c, (k, t) in enumerate(zip(n, ties))}


def test_warnings_say_once_what_cannot_act() -> None:
    m = FedSDC(gamma=0.5, tie_break="lowest", min_hidden=None)    # 2 clients: one head kept; 2-unit heads
    m.setup(_fed())
    m.server_validate(1, _results([10, 10], [1, 1]))              # 10 % tied: not frequent
    first = m.mechanism_warnings(1)
    assert len(first) == 2 and "keeps 1 of 2 heads (ceil(0.5 x 2))" in first[0] and "not a vote" in first[0]
    assert "units wide" in first[1] and "819-2048" in first[1]
    m.server_validate(2, _results([10, 10], [3, 0]))              # 15 % tied under 'lowest'
    (tie,) = m.mechanism_warnings(2)
    assert "tied on 15.0 %" in tie and "tie_break 'lowest'" in tie
    m.server_validate(3, _results([10, 10], [5, 5]))
    assert m.mechanism_warnings(3) == []                          # said once
    m.server_validate(4, _results([0, 0], [0, 0]))
    (none,) = m.mechanism_warnings(4)
    assert "no client has validation data" in none and "cannot rank" in none
    quiet = FedSDC(tie_break="mean_probability")
    quiet.setup(Federation(client_ids=["0", "1", "2"], eval_client_ids=["0", "1", "2"],
                           num_examples={"0": 5, "1": 5, "2": 5}, num_classes=2, rounds=1, seed=0,
                           model={"name": "small_cnn", "width": 2}))
    quiet.server_validate(1, _results([10, 10, 10], [9, 9, 9], heads=3))
    assert quiet.mechanism_warnings(1) == []                      # 3 heads of 819+ units, ties by probability
    linear = FedSDC(head="linear")
    linear.setup(_fed())
    assert any("Diversity (rho) cannot act" in w for w in linear.mechanism_warnings(1))


def test_a_client_that_sends_impossible_counts_is_left_out_of_the_pooling() -> None:
    m = FedSDC()
    m.setup(_fed())
    good = _results([10, 30], [2, 6])
    bad = {**good, "1": {**good["1"], "vote_ties": 31.0}}           # more ties than samples
    m.server_validate(1, bad)
    assert m.observed["clients"] == 1 and m.observed["tie_rate"] == pytest.approx(0.2)


# ------------------------------------------------------------------ issue 37: the mechanisms of a run
def _pooled_from_validation(run: Path, heads: int) -> pd.DataFrame:
    """mechanisms.csv's numbers recomputed from validation_metrics.csv (pooled by val size)."""
    v = pd.read_csv(run / "validation_metrics.csv", dtype={"client_id": str})
    v = v[v["n_val"] > 0]
    rows = []
    for r, part in v.groupby("round"):
        n = part["n_val"].sum()
        for i in range(heads):
            for name in ("accuracy", "micro_f1"):
                rows.append({"round": r, "mechanism": "head", "id": str(i), "name": name,
                             "value": float((part["n_val"] * part[f"{name}_{i}"]).sum() / n)})
        for name, col in (("tie_rate", "vote_ties"), ("disagreement_rate", "vote_disagreements"),
                          ("accuracy", "vote_correct")):
            rows.append({"round": r, "mechanism": "vote", "id": "validated", "name": name,
                         "value": float(part[col].sum() / n)})
    return pd.DataFrame(rows)


def _log(run: Path) -> pd.DataFrame:
    return pd.read_csv(run / "mechanisms.csv", dtype={"id": str, "text": str}, keep_default_na=False)


def _value(log: pd.DataFrame, r: int, mech: str, id_: str, name: str) -> Any:
    row = log[(log["round"] == r) & (log["mechanism"] == mech) & (log["id"] == id_) & (log["name"] == name)]
    assert len(row) == 1, (r, mech, id_, name)
    return row["text"].iloc[0] if row["text"].iloc[0] != "" else float(row["value"].iloc[0])


@pytest.fixture(scope="module")
def mechanism_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny seeded run of FedSDC (defaults), FedSDC+ (gamma 0.5 of 3 heads: 2 kept) and
    FedSDC with the 'lowest' tie rule, 2 rounds, every client with a val split."""
    tmp = tmp_path_factory.mktemp("mech")
    fl = {"name": "t", "output_dir": str(tmp / "runs"), "seed": 0, "rounds": 2, "num_clients": 3, "progress": False,
          "dataset": {"name": "synthetic2d", "root": str(tmp / "data"), "num_samples": 120, "num_classes": 3,
                      "image_size": 12, "noise": 0.8},
          "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 12},
          "client_split": {"train": 0.6, "val": 0.3, "test": 0.1}, "eval_splits": ["test"], "eval_every": 0,
          "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8, "lr": 0.05},
          "methods": [{"name": "fedsdc"}, {"name": "fedsdc", "gamma": 0.5, "label": "plus"},
                      {"name": "fedsdc", "tie_break": "lowest", "min_hidden": None, "label": "lowest"}]}
    out = run_experiment(resolve_config(fl))
    return {label: Path(out["dir"]) / label for label in ("fedsdc", "plus", "lowest")}


def test_mechanisms_equal_a_recomputation_from_the_validation_scalars(mechanism_runs: dict[str, Path]) -> None:
    for label, run in mechanism_runs.items():
        log = _log(run)
        expected = _pooled_from_validation(run, heads=3)
        assert len(expected) == 2 * (3 * 2 + 3)
        for e in expected.itertuples():
            assert _value(log, e.round, e.mechanism, e.id, e.name) == pytest.approx(e.value, abs=1e-12), (label, e)
        tm = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
        for r, part in tm.groupby("round"):     # Shuffle: who trained which head, from the seed alone
            assign = head_assignment(["0", "1", "2"], 0, int(r), True)
            for cid in part["client_id"]:
                assert _value(log, r, "head", str(assign[cid]), "trained_by") == cid


def test_fedsdc_plus_keeps_the_heads_its_ranking_says(mechanism_runs: dict[str, Path]) -> None:
    run = mechanism_runs["plus"]
    log = _log(run)
    v = pd.read_csv(run / "validation_metrics.csv", dtype={"client_id": str})
    previous = [0, 1, 2]
    for r, part in v.groupby("round"):
        score = [float(part[f"micro_f1_{i}"].mean()) for i in range(3)]    # unweighted over clients
        kept = sorted(sorted(range(3), key=lambda i: (-score[i], i))[:2])
        for i in range(3):
            assert _value(log, r, "head", str(i), "rank_score") == pytest.approx(score[i])
            assert _value(log, r, "head", str(i), "kept") == float(i in kept)
        assert _value(log, r, "sparse_heads", "", "head_ids") == " ".join(map(str, kept))
        # the vote measured in round r is the ensemble kept the round before (all heads in round 1)
        assert _value(log, r, "vote", "validated", "head_ids") == " ".join(map(str, previous))
        previous = kept
    summary = json.loads((run / "summary.json").read_text())
    assert summary["method_report"]["kept_heads"] == "2 of 3 (ceil(0.5 x 3))"
    assert [w["round"] for w in summary["warnings"]] == [1] and "keeps 2 of 3 heads" in summary["warnings"][0]["warning"]


def test_the_vote_at_the_clients_matches_the_run_predictions(mechanism_runs: dict[str, Path]) -> None:
    """With the 'lowest' rule the ensemble's probabilities are the vote fractions: the last
    round's tie and disagreement rates and accuracy on the clients' val splits follow from
    `medfl predict`'s rows of those splits."""
    from medfl.predict import predict

    run = mechanism_runs["lowest"]
    pred = pd.read_csv(predict(run, split="all"), dtype={"client_id": str, "sample_id": str})
    part = pd.read_csv(run.parent / "partition.csv", dtype={"client_id": str, "sample_id": str},
                       keep_default_na=False)
    val = part[part["role"] == "val"][["client_id", "sample_id"]]
    rows = pred.merge(val, on=["client_id", "sample_id"])          # each client's model on its own val rows
    assert len(rows) == len(val) > 0
    fractions = rows[[c for c in rows.columns if c.startswith("prob_")]].to_numpy()
    top = fractions.max(1, keepdims=True)
    ties = ((np.abs(fractions - top) < 1e-6).sum(1) > 1).mean()
    disagree = (top[:, 0] < 1 - 1e-6).mean()
    log = _log(run)
    assert _value(log, 2, "vote", "validated", "tie_rate") == pytest.approx(ties)
    assert _value(log, 2, "vote", "validated", "disagreement_rate") == pytest.approx(disagree)
    assert _value(log, 2, "vote", "validated", "accuracy") == pytest.approx((rows["prediction"] == rows["label"]).mean())
    assert _value(log, 2, "vote", "validated", "tie_break") == "lowest"
    report = json.loads((run / "summary.json").read_text())["method_report"]
    assert report["last_validation"]["tie_rate"] == pytest.approx(ties, abs=1e-4)


# ------------------------------------------------------------------ issue 37: presets
_PAPER = {"beta": 0.5, "server_lr": 1.0, "rho_min": 0.4, "rho_max": 1.0, "diversity": True, "shuffle": True,
          "vote": "majority", "head": "mlp", "dropout": 0.2, "head_activation": "relu", "tie_break": "mean_probability",
          "rho_sampling": "uniform", "min_hidden": 2048}
_AUTHORS = {**_PAPER, "head_activation": "none", "tie_break": "logit_sum", "rho_sampling": "stratified",
            "min_hidden": None}
_NIID1 = {"optimizer": "sgd", "lr": 1e-3, "batch_size": 64, "momentum": 0.0, "weight_decay": 0.0, "epochs": 1}
_NIID2 = {**_NIID1, "lr": 1e-4, "batch_size": 32}
_AUTHORS_TRAIN = {**_NIID1, "momentum": 0.01, "weight_decay": 1e-3, "epochs": 5}
_PLUS = {"gamma": 0.3, "keep_rounding": "ceil"}
#: where each value of the paper presets comes from (issue 48): min_hidden 2048, the vote, the
#: ReLU, FedSDC+'s gamma and plain SGD are readings of sec. 2.2 / 3.3, not values it states
_PAPER_KINDS = {**dict.fromkeys(["beta", "server_lr", "rho_min", "rho_max", "diversity", "shuffle", "head",
                                 "train.optimizer", "train.lr", "train.batch_size"], "paper"),
                **dict.fromkeys(["vote", "head_activation", "min_hidden", "gamma", "train.momentum"], "reading"),
                **dict.fromkeys(["dropout", "keep_rounding"], "authors_code"),
                **dict.fromkeys(["tie_break", "rho_sampling", "train.weight_decay", "train.epochs"], "open")}
#: every FedSDC preset as docs/plugins.md documents it: (values, train settings)
PRESET_TABLE = {
    "paper": (_PAPER, _NIID1),
    "paper_plus": ({**_PAPER, **_PLUS}, _NIID1),
    "paper_niid2": (_PAPER, _NIID2),
    "paper_niid2_plus": ({**_PAPER, **_PLUS}, _NIID2),
    "authors": (_AUTHORS, _AUTHORS_TRAIN),
    "authors_plus": ({**_AUTHORS, **_PLUS}, _AUTHORS_TRAIN),
}


def test_every_preset_resolves_to_its_documented_values(tiny_fl: dict[str, Any]) -> None:
    """config.json's preset block of a one-round run, and every preset through the function
    that writes that block."""
    from medfl.config import build_method, preset_record

    tiny_fl["rounds"] = 1
    entry = {"name": "fedsdc", "preset": "paper_plus", "train": {"batch_size": 8}}
    tiny_fl["methods"] = [entry]
    out = run_experiment(resolve_config(tiny_fl))
    saved = json.loads((Path(out["dir"]) / "fedsdc" / "config.json").read_text())
    assert saved["preset"] == preset_record(entry, build_method(entry))
    assert saved["preset"]["train"]["batch_size"] == {"value": 8, "from": "config"}
    gamma = saved["preset"]["values"]["gamma"]
    assert gamma["value"] == 0.3 and gamma["from"] == "reading" and "other reading" in gamma["source"]
    assert saved["method_hparams"]["gamma"] == 0.3 and saved["method_hparams"]["dropout"] == 0.2
    for name, (values, train) in PRESET_TABLE.items():
        spec = {"name": "fedsdc", "preset": name}
        block = preset_record(spec, build_method(spec))
        assert block["name"] == name and ("wpnine/FedSDC" in block["source"]) == name.startswith("authors")
        assert {k: v["value"] for k, v in block["values"].items()} == values
        assert {k: v["value"] for k, v in block["train"].items()} == train
        kinds = {**{k: v["from"] for k, v in block["values"].items()},
                 **{f"train.{k}": v["from"] for k, v in block["train"].items()}}
        want = dict.fromkeys(kinds, "authors_code") if name.startswith("authors") else _PAPER_KINDS
        assert kinds == {k: want[k] for k in kinds}, name
        assert set(block["medfl_defaults"]) == {"gamma", "keep_rounding"} - set(values)
        assert block["experiment"]["rounds"] == 1500
