"""Forgetting measures (FedKPer paper, eqs. 7-10) on hand-computed trajectories, the negative
flips counted at the client, and the ``forgetting`` block every run writes."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from medfl.engine.client import ClientContext
from medfl.engine.client_eval import run_client_evaluate
from medfl.experiment import resume, run_experiment
from medfl.messages import Instruction
from medfl.method import Method
from medfl.metrics.forgetting import (
    RecoveryInterval,
    aipfr,
    backward_transfer,
    backward_transfer_per_client,
    balance,
    consistency,
    forgetting_report,
    ipfr,
    negative_flip_rate,
    negative_flips,
    recovery_intervals,
    worst_client,
)


# ----------------------------------------------------------------------------- eqs. 7-9
def test_monotone_curve_is_fully_consistent():
    acc = [0.1, 0.2, 0.2, 0.3]  # the tie at 0.2 closes an interval with no round inside it
    assert recovery_intervals(acc) == []
    assert aipfr(acc) == 0.0 and consistency(acc) == 1.0


def test_dip_and_recovery():
    # peak 0.5, dip to 0.25, back to 0.5: (0 + 0.5 + 0) / 2 = 0.25
    assert recovery_intervals([0.5, 0.25, 0.5]) == [RecoveryInterval(0, 2, 0.25, True)]
    assert consistency([0.5, 0.25, 0.5]) == pytest.approx(0.75)
    # peak 0.8 at 1, two rounds below, tie at 4 closes: (0 + .25 + .125 + 0) / 3; 0.9 is a new peak
    acc = [0.4, 0.8, 0.6, 0.7, 0.8, 0.9]
    ivs = recovery_intervals(acc)
    assert [(iv.start, iv.end, iv.recovered) for iv in ivs] == [(1, 4, True)]
    assert ivs[0].ipfr == pytest.approx(0.125)
    assert consistency(acc) == pytest.approx(0.875)
    # NaN rounds (not evaluated) are skipped
    assert consistency([0.5, float("nan"), 0.25, 0.5]) == pytest.approx(0.75)


def test_paper_example_peak_not_regained_has_no_interval():
    """Eq. 7 by hand on [.6, .4, .7, .5, .3]: peaks at 0 (.6) and 2 (.7). Round 2 regains .6,
    closing [0, 2]: IPFR = (|.6-.6| + |.6-.4| + |.6-.7|) / .6 / (2 - 0) = (0 + .2 + .1) / 1.2
    = .25. The peak .7 is never regained, so it starts no interval (paper): M = 1,
    AIPFR = .25, C = .75."""
    acc = [0.6, 0.4, 0.7, 0.5, 0.3]
    assert recovery_intervals(acc) == [RecoveryInterval(0, 2, pytest.approx(0.25), True)]
    assert aipfr(acc) == pytest.approx(0.25)
    assert consistency(acc) == pytest.approx(0.75)


def test_open_interval_variant_hand_computed():
    """medfl's open-interval reading of [.6, .4, .7, .5, .3]: the unfinished [2, 4] also
    counts, closed at the last round: (|.7-.7| + |.7-.5| + |.7-.3|) / .7 / (4 - 2) = 3/7;
    AIPFR = (.25 + 3/7) / 2 = 19/56, C = 37/56 = 0.6607."""
    acc = [0.6, 0.4, 0.7, 0.5, 0.3]
    ivs = recovery_intervals(acc, include_unfinished=True)
    assert [(iv.start, iv.end, iv.recovered) for iv in ivs] == [(0, 2, True), (2, 4, False)]
    assert ivs[1].ipfr == pytest.approx((0 + 0.2 / 0.7 + 0.4 / 0.7) / 2)
    assert aipfr(acc, include_unfinished=True) == pytest.approx(19 / 56)
    assert consistency(acc, include_unfinished=True) == pytest.approx(37 / 56)
    assert consistency(acc, include_unfinished=True) == pytest.approx(0.6607, abs=1e-4)


def test_never_recovering_after_a_peak():
    acc = [0.4, 0.8, 0.6, 0.4]
    # the paper: the peak 0.8 is never regained, so there is no interval and C = 1
    assert recovery_intervals(acc) == []
    assert aipfr(acc) == 0.0 and consistency(acc) == 1.0
    # open intervals: [1, 3] closed at the last round, (0 + 0.25 + 0.5) / 2
    assert recovery_intervals(acc, include_unfinished=True) == [
        RecoveryInterval(1, 3, pytest.approx(0.375), False)]
    assert consistency(acc, include_unfinished=True) == pytest.approx(0.625)
    # a drop in the very last round is an unfinished interval with one round after the peak
    assert aipfr([0.5, 0.6, 0.3]) == 0.0
    assert aipfr([0.5, 0.6, 0.3], include_unfinished=True) == pytest.approx((0 + 0.5) / 1)


def test_single_round_and_empty():
    assert recovery_intervals([0.7]) == [] and aipfr([0.7]) == 0.0 and consistency([0.7]) == 1.0
    assert math.isnan(consistency([])) and math.isnan(aipfr([float("nan")]))


def test_ties_and_overshoot():
    # peaks at 0 (0.5), 2 (0.5 == peak: closes, new peak) and 4 (0.6)
    acc = [0.5, 0.4, 0.5, 0.3, 0.6]
    ivs = recovery_intervals(acc)
    assert [(iv.start, iv.end) for iv in ivs] == [(0, 2), (2, 4)]
    assert ivs[0].ipfr == pytest.approx((0 + 0.2 + 0) / 2)
    # eq. 7 literally: the overshoot of the closing round counts |0.5 - 0.6| / 0.5
    assert ivs[1].ipfr == pytest.approx((0 + 0.4 + 0.2) / 2)
    assert aipfr(acc) == pytest.approx(0.2) and consistency(acc) == pytest.approx(0.8)
    assert recovery_intervals([0.5, 0.5, 0.5]) == []
    with pytest.raises(ValueError):
        ipfr(acc, 2, 2)


# ----------------------------------------------------------------------------- eq. 10
ACC = {1: {"a": 0.5, "b": 0.6, "c": 0.7, "d": 0.2},
       2: {"a": 0.4, "b": 0.6, "c": 0.9, "d": 0.3},
       3: {"a": 0.8, "b": 0.5, "c": 0.6, "d": 0.3},
       4: {"a": 0.6, "b": 0.3, "c": 0.7, "d": 0.9}}
SAMPLED = {1: ["a", "b"], 2: ["c"], 3: ["a"], 4: ["d"]}


def test_backward_transfer_with_partial_sampling():
    # T = 4: a last sampled in 3, b in 1, c in 2; d only in round 4 is not a prior client
    per = backward_transfer_per_client(ACC, SAMPLED)
    assert per == pytest.approx({"a": 0.6 - 0.8, "b": 0.3 - 0.6, "c": 0.7 - 0.9})
    assert backward_transfer(ACC, SAMPLED) == pytest.approx(-0.7 / 3)
    assert backward_transfer(ACC, SAMPLED, final_round=2) == pytest.approx(((0.4 - 0.5) + 0.0) / 2)
    assert math.isnan(backward_transfer(ACC, SAMPLED, final_round=1))
    # round 3 not evaluated: a's last round has no evaluation before T, so a drops out
    no3 = {r: v for r, v in ACC.items() if r != 3}
    assert backward_transfer_per_client(no3, SAMPLED) == pytest.approx({"b": -0.3, "c": -0.2})
    # round 1 not evaluated: b's update is first seen in round 2's evaluation
    no1 = {r: v for r, v in ACC.items() if r != 1}
    assert backward_transfer_per_client(no1, SAMPLED)["b"] == pytest.approx(0.3 - 0.6)


# ----------------------------------------------------------------------------- flips, balance
def test_negative_flips_balance_worst_client():
    prev, now = [1, 1, 0, 0, 1], [1, 0, 1, 0, 0]
    assert negative_flips(prev, now) == 2  # samples 1 and 4; sample 2 is a positive flip
    assert negative_flip_rate(prev, now) == pytest.approx(0.4)
    assert math.isnan(negative_flip_rate([], []))
    with pytest.raises(ValueError):
        negative_flips([1, 0], [1, 0, 1])
    assert balance(0.4, 0.8) == pytest.approx(0.6)
    assert worst_client({"a": 0.5, "b": 0.3, "c": 0.3, "d": float("nan")}) == ("b", 0.3)
    wc, wv = worst_client({})
    assert wc is None and math.isnan(wv)


def _metrics_rows() -> pd.DataFrame:
    """Two clients, three rounds; global-test accuracy shared (one global model)."""
    rows = []
    glob = {1: 0.6, 2: 0.45, 3: 0.6}
    local = {1: {"0": 0.8, "1": 0.4}, 2: {"0": 0.6, "1": 0.5}, 3: {"0": 0.7, "1": 0.3}}
    gflip = {1: float("nan"), 2: 0.25, 3: 0.1}
    lflip = {1: {"0": float("nan"), "1": float("nan")}, 2: {"0": 0.2, "1": 0.0}, 3: {"0": 0.1, "1": 0.3}}
    for r in (1, 2, 3):
        for c in ("0", "1"):
            rows.append({"round": r, "client_id": c, "split": "local_test", "accuracy": local[r][c],
                         "neg_flip_rate": lflip[r][c]})
            rows.append({"round": r, "client_id": c, "split": "global_test", "accuracy": glob[r],
                         "neg_flip_rate": gflip[r]})
    return pd.DataFrame(rows)


def test_forgetting_report_hand_computed():
    train = pd.DataFrame({"round": [1, 2, 3], "client_id": ["0", "1", "0"]})
    block, per = forgetting_report(_metrics_rows(), train)
    assert per["round"].tolist() == [1, 2, 3]
    assert per["global_acc"].tolist() == pytest.approx([0.6, 0.45, 0.6])
    assert per["local_acc"].tolist() == pytest.approx([0.6, 0.55, 0.5])
    assert per["worst_local_acc"].tolist() == pytest.approx([0.4, 0.5, 0.3])
    assert per["worst_client"].tolist() == ["1", "1", "1"]
    assert per["balance"].tolist() == pytest.approx([0.6, 0.5, 0.55])
    # BwT: round 2 -> client 0 (sampled in 1): 0.6 - 0.8; round 3 -> 0 (in 1): 0.7 - 0.8, 1 (in 2): 0.3 - 0.5
    assert math.isnan(per["bwt"].iloc[0])
    assert per["bwt"].iloc[1:].tolist() == pytest.approx([-0.2, (-0.1 - 0.2) / 2])
    assert per["sampled"].tolist() == ["0", "1", "0"]
    g, l = block["global"], block["local"]
    assert g["acc_final"] == pytest.approx(0.6) and g["acc_mean"] == pytest.approx(0.55)
    assert g["consistency"] == pytest.approx(1 - 0.125)  # (0 + .25 + 0) / 2
    assert g["aipfr"] == pytest.approx(0.125) and g["n_intervals"] == 1
    assert g["intervals"] == [{"start_round": 1, "end_round": 3, "ipfr": pytest.approx(0.125), "recovered": True}]
    # the last round regains the peak: nothing open, both readings agree
    assert g["open_interval"] is None
    assert g["consistency_open_intervals"] == pytest.approx(g["consistency"])
    assert g["aipfr_open_intervals"] == pytest.approx(g["aipfr"])
    assert g["bwt_final"] == pytest.approx(-0.15) and g["bwt_clients"] == 2
    assert g["bwt_mean"] == pytest.approx((-0.2 - 0.15) / 2)
    assert g["neg_flip_rate_final"] == pytest.approx(0.1) and g["neg_flip_rate_mean"] == pytest.approx(0.175)
    # local mean curve 0.6, 0.55, 0.5 never regains its peak: no interval (paper), C = 1;
    # open intervals: the unfinished [1, 3], (0 + 1/12 + 1/6) / 2
    assert l["consistency"] == 1.0 and l["aipfr"] == 0.0
    assert l["intervals"] == [] and l["n_intervals"] == 0
    assert l["consistency_open_intervals"] == pytest.approx(1 - (0.05 / 0.6 + 0.1 / 0.6) / 2)
    assert l["aipfr_open_intervals"] == pytest.approx((0.05 / 0.6 + 0.1 / 0.6) / 2)
    assert l["open_interval"] == {"start_round": 1, "end_round": 3,
                                  "ipfr": pytest.approx(0.125), "recovered": False}
    # client 0: 0.8, 0.6, 0.7 and client 1: 0.4, 0.5, 0.3 never regain their peaks: C = 1 each;
    # open intervals: client 0 (0 + .25 + .125) / 2, client 1 (0 + .4) / 1
    assert l["client_consistency_mean"] == 1.0
    assert l["client_consistency_mean_open_intervals"] == pytest.approx(
        ((1 - 0.1875) + (1 - 0.4)) / 2)
    assert l["worst_client_acc_final"] == pytest.approx(0.3) and l["worst_client_final"] == "1"
    assert l["worst_client_acc_mean"] == pytest.approx(0.4)
    assert l["neg_flip_rate_final"] == pytest.approx(0.2) and l["neg_flip_rate_mean"] == pytest.approx(0.15)
    assert block["balance"] == {"final": pytest.approx(0.55), "mean": pytest.approx((0.55 + 0.55) / 2)}
    json.dumps(block, allow_nan=False)  # NaNs become None: valid JSON
    empty, per0 = forgetting_report(pd.DataFrame(), None)
    assert per0.empty and empty["rounds"] == []


def test_forgetting_report_consistency_is_the_papers_on_the_worked_example():
    """The [.6, .4, .7, .5, .3] trajectory through the whole report: summary's consistency
    0.75 (paper), the open-interval reading 37/56 beside it."""
    curve = [0.6, 0.4, 0.7, 0.5, 0.3]
    rows = [{"round": r + 1, "client_id": c, "split": s, "accuracy": v}
            for r, v in enumerate(curve) for c in ("0", "1") for s in ("local_test", "global_test")]
    block, _ = forgetting_report(pd.DataFrame(rows), None)
    for part in ("global", "local"):
        b = block[part]
        assert b["consistency"] == pytest.approx(0.75) and b["aipfr"] == pytest.approx(0.25)
        assert b["intervals"] == [{"start_round": 1, "end_round": 3, "ipfr": pytest.approx(0.25),
                                   "recovered": True}]
        assert b["consistency_open_intervals"] == pytest.approx(37 / 56)
        assert b["aipfr_open_intervals"] == pytest.approx(19 / 56)
        assert b["open_interval"] == {"start_round": 3, "end_round": 5,
                                      "ipfr": pytest.approx(3 / 7), "recovered": False}
    assert block["local"]["client_consistency_mean"] == pytest.approx(0.75)
    assert block["local"]["client_consistency_mean_open_intervals"] == pytest.approx(37 / 56)


# ----------------------------------------------------------------------------- at the client
class _Table(nn.Module):
    """Returns fixed logits per sample index (the input holds the index)."""

    def __init__(self, logits: list[list[float]]) -> None:
        super().__init__()
        self.register_buffer("table", torch.tensor(logits))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.table[x[:, 0].long()]


class _Fixed(Method):
    name = "fixed"

    def __init__(self) -> None:
        self.model: nn.Module = nn.Identity()

    def client_eval_model(self, client, instruction):
        return self.model


def _ctx(cid: str, rnd: int) -> ClientContext:
    x = torch.arange(5, dtype=torch.float32).reshape(5, 1)
    y = torch.tensor([0, 1, 0, 1, 0])
    return ClientContext(client_id=cid, round=rnd, seed=rnd, datasets={"global_test": TensorDataset(x, y)},
                         model_spec={}, train={"eval_batch_size": 2}, sample_shape=(1,),
                         split_sizes={"global_test": 5})


def _acc(y: np.ndarray, p: np.ndarray) -> dict[str, float]:
    return {"n": float(len(y)), "accuracy": float((p.argmax(1) == y).mean())}


def test_negative_flips_are_counted_at_the_client():
    y = [0, 1, 0, 1, 0]
    right, wrong = lambda c: [2.0, 0.0] if c == 0 else [0.0, 2.0], lambda c: [0.0, 2.0] if c == 0 else [2.0, 0.0]
    m = _Fixed()
    m.model = _Table([right(y[0]), right(y[1]), wrong(y[2]), wrong(y[3]), right(y[4])])  # 1 1 0 0 1
    mem_a: dict = {}
    first = run_client_evaluate(m, _ctx("a", 1), Instruction(), ["global_test"], _acc, {}, memory=mem_a)
    assert math.isnan(first["global_test"]["neg_flip_rate"]) and math.isnan(first["global_test"]["neg_flips"])
    assert mem_a["global_test"].dtype == torch.bool and mem_a["global_test"].tolist() == [1, 1, 0, 0, 1]
    mem_b = {"global_test": torch.tensor([False, False, False, False, False])}  # another client's past
    m.model = _Table([right(y[0]), wrong(y[1]), right(y[2]), wrong(y[3]), wrong(y[4])])  # 1 0 1 0 0
    cache: dict = {}
    out_a = run_client_evaluate(m, _ctx("a", 2), Instruction(), ["global_test"], _acc, cache, memory=mem_a)
    out_b = run_client_evaluate(m, _ctx("b", 2), Instruction(), ["global_test"], _acc, cache, memory=mem_b)
    assert len(cache) == 1  # b reused a's predictions, but compared them with its own memory
    assert out_a["global_test"] == {"n": 5.0, "accuracy": 0.4, "neg_flips": 2.0, "neg_flip_rate": 0.4}
    assert out_b["global_test"]["neg_flips"] == 0.0 and out_b["global_test"]["accuracy"] == 0.4
    assert mem_a["global_test"].tolist() == mem_b["global_test"].tolist() == [1, 0, 1, 0, 0]
    # only scalars leave the client; without a memory there are no flip columns
    assert all(isinstance(v, float) for v in out_a["global_test"].values())
    plain = run_client_evaluate(m, _ctx("a", 3), Instruction(), ["global_test"], _acc)
    assert set(plain["global_test"]) == {"n", "accuracy"}


# ----------------------------------------------------------------------------- every run
@pytest.mark.plots
def test_summary_block_for_fedavg_and_local_and_resume(tiny_fl, resolve):
    tiny_fl.update(fraction=0.67, methods=[{"name": "fedavg"}, {"name": "local"}])
    out = run_experiment(resolve(tiny_fl))
    exp = Path(out["dir"])
    for label in ("fedavg", "local"):
        d = exp / label
        summary = json.loads((d / "summary.json").read_text())
        block = summary["forgetting"]
        assert block["rounds"] == [1, 2] and out["summaries"][label]["forgetting"] == block
        assert (d / "plots" / "forgetting.png").is_file() and (d / "forgetting.csv").is_file()
        m = pd.read_csv(d / "metrics.csv", dtype={"client_id": str})
        tm = pd.read_csv(d / "train_metrics.csv", dtype={"client_id": str})
        last = m[m["round"] == 2]
        loc = last[last["split"] == "local_test"].set_index("client_id")["accuracy"]
        glob = last[last["split"] == "global_test"]["accuracy"]
        assert block["global"]["acc_final"] == pytest.approx(glob.mean())
        assert block["local"]["acc_final"] == pytest.approx(loc.mean())
        assert block["local"]["worst_client_acc_final"] == pytest.approx(loc.min())
        assert block["balance"]["final"] == pytest.approx((glob.mean() + loc.mean()) / 2)
        # BwT by hand: clients that trained in round 1, local-test accuracy round 2 - round 1
        r1 = m[(m["round"] == 1) & (m["split"] == "local_test")].set_index("client_id")["accuracy"]
        prior = tm.loc[tm["round"] == 1, "client_id"].tolist()
        assert len(prior) == 2
        assert block["global"]["bwt_final"] == pytest.approx(float(np.mean([loc[c] - r1[c] for c in prior])))
        # negative flips: none at the first evaluation, a count at the second
        assert m.loc[m["round"] == 1, "neg_flip_rate"].isna().all()
        assert m.loc[m["round"] == 2, "neg_flip_rate"].between(0, 1).all()
        assert (m["neg_flips"].dropna() == (m["neg_flip_rate"] * m["n"]).dropna().round()).all()
        # every consistency of the block is the paper's, the open-interval reading beside it
        for part, split in (("global", "global_test"), ("local", "local_test")):
            curve = m[m["split"] == split].groupby("round")["accuracy"].mean().to_numpy()
            assert block[part]["consistency"] == pytest.approx(consistency(curve))
            assert block[part]["consistency_open_intervals"] == pytest.approx(
                consistency(curve, include_unfinished=True))
        per_client = m[m["split"] == "local_test"].pivot_table(index="round", columns="client_id",
                                                                 values="accuracy")
        assert block["local"]["client_consistency_mean"] == pytest.approx(
            float(np.mean([consistency(per_client[c].to_numpy()) for c in per_client])))
    fa = pd.read_csv(exp / "fedavg" / "metrics.csv")
    g2 = fa[(fa["round"] == 2) & (fa["split"] == "global_test")]
    assert g2["neg_flip_rate"].nunique() == 1  # one global model: the same flips at every client
    # Local: a client that trained in round 1 but not in round 2 keeps its model: no flips
    lm = pd.read_csv(exp / "local" / "metrics.csv", dtype={"client_id": str})
    ltm = pd.read_csv(exp / "local" / "train_metrics.csv", dtype={"client_id": str})
    idle = set(ltm.loc[ltm["round"] == 1, "client_id"]) - set(ltm.loc[ltm["round"] == 2, "client_id"])
    assert idle and (lm.loc[(lm["round"] == 2) & lm["client_id"].isin(idle), "neg_flips"] == 0).all()
    comp = pd.read_csv(exp / "comparison_forgetting.csv")
    assert comp["method"].tolist() == ["fedavg", "local"] and "global_consistency" in comp
    assert "global_consistency_open_intervals" in comp
    assert "local_client_consistency_mean_open_intervals" in comp
    # stopped after round 1 and resumed: the same flips and forgetting table
    stopped = run_experiment(resolve(dict(tiny_fl, name="part", stop_after_round=1,
                                          methods=[{"name": "fedavg"}])))
    resume(stopped["dir"])
    for f in ("metrics.csv", "forgetting.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(exp / "fedavg" / f), pd.read_csv(Path(stopped["dir"]) / "fedavg" / f))


def test_summary_worst_of_a_lower_is_better_metric_is_the_highest():
    import pandas as pd

    from medfl.engine.evaluation import summarize_metrics

    m = pd.DataFrame({"round": [2, 2, 2], "client_id": ["0", "1", "2"], "client_name": ["a", "b", "c"],
                      "split": ["global_test"] * 3, "accuracy": [0.5, 0.9, 0.7],
                      "neg_flip_rate": [0.1, 0.3, 0.0]})
    s = summarize_metrics(m)["global_test"]
    assert s["accuracy"]["worst"] == 0.5 and s["accuracy"]["worst_client"] == "0"
    assert s["neg_flip_rate"]["worst"] == 0.3 and s["neg_flip_rate"]["worst_client"] == "1"
    assert s["neg_flip_rate"]["best"] == 0.0
