"""FedSDC / FedSDC+ (paper 002): seeded head widths and shuffles, the body through the existing
FedAvgM (eqs. 4-5) by hand, the ensemble's vote fractions and mean probabilities, FedSDC+'s
top-gamma heads from the clients' validation micro-F1, a run of both, and exact resume."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch
from torch import nn

from medfl.config import resolve_config
from medfl.engine.runner import resume, run_experiment
from medfl.messages import Reply
from medfl.method import Federation, MethodConfigError
from medfl_plugins.fedsdc import FedSDC, HeadEnsemble, head_assignment, head_widths


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
    votes = HeadEnsemble(Body(), heads, "majority")(x)
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
    from medfl.engine.runner import predict

    run_dir = Path(out["dir"]) / "fedsdc"
    pred = pd.read_csv(predict(run_dir, split="global_test"), dtype={"client_id": str})
    state = torch.load(sorted((run_dir / "checkpoints").glob("*.pt"))[-1], weights_only=False)
    assert len(state["method"]["heads"]) == 3
    micro = pred.groupby("client_id").apply(lambda d: float((d["prediction"] == d["label"]).mean()))
    assert micro.mean() == pytest.approx(plain["final"]["global_test"]["micro_f1"]["mean"])


def test_a_stopped_run_resumes_to_the_uninterrupted_numbers(tiny_fl, tmp_path):
    """FedSDC+ (heads, chosen heads, FedAvgM velocity in the checkpoint) and the issue's
    adaptive and FedDisco baselines resume exactly."""
    tiny_fl["rounds"] = 3
    tiny_fl["client_split"] = {"train": 0.6, "val": 0.2, "test": 0.2}
    tiny_fl["methods"] = [{"name": "fedsdc", "gamma": 0.5, "label": "fedsdc_plus"}, {"name": "fedyogi"},
                          {"name": "fedadagrad"}, {"name": "feddisco"}]
    full = run_experiment(resolve_config(dict(tiny_fl, name="full")))
    stopped = run_experiment(resolve_config(dict(tiny_fl, name="part", stop_after_round=2)))
    resume(stopped["dir"])
    for label in ("fedsdc_plus", "fedyogi", "fedadagrad", "feddisco"):
        for f in ("metrics.csv", "train_metrics.csv") + (("validation_metrics.csv",) if label == "fedsdc_plus" else ()):
            a = pd.read_csv(Path(full["dir"]) / label / f)
            b = pd.read_csv(Path(stopped["dir"]) / label / f)
            pd.testing.assert_frame_equal(a, b)
    reports = [json.loads((Path(d) / "fedsdc_plus" / "summary.json").read_text())["method_report"]
               for d in (full["dir"], stopped["dir"])]
    assert reports[0] == reports[1]
