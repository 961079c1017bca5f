"""FedKPer (paper 001) against hand-computed values: eq. 3 loss and lambda, eqs. 4-6
aggregation, ablation switches, payload audit, sampling shared with FedAvg, a 2-round run."""

from __future__ import annotations

import importlib.metadata as md
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from medfl.engine.client import run_client_update
from medfl.engine.data import split_data
from medfl.engine.runner import Run
from medfl.experiment import run_experiment
from medfl.messages import Reply
from medfl.method import Federation, MethodConfigError
from medfl.plugins import lookup, registry
from medfl_plugins import fedkper as fk
from medfl_plugins.fedkper import FedKPer, aggregation_score, kper_loss, label_entropy


def _softmax(z: list[float]) -> list[float]:
    e = [math.exp(v) for v in z]
    return [v / sum(e) for v in e]


def _hand_loss(s: list[list[float]], t: list[list[float]], y: list[int], cap: float, temp: float = 1.0):
    """Eq. 3 written out with the math module: CE, lambda from the teacher's batch CE, KL."""
    ce_s = sum(-math.log(_softmax(z)[c]) for z, c in zip(s, y)) / len(y)
    ce_t = sum(-math.log(_softmax(z)[c]) for z, c in zip(t, y)) / len(y)
    lam = min(1.0 / ce_t, cap) if ce_t > 0 else cap
    kl = 0.0
    for zs, zt in zip(s, t):
        qs, qt = _softmax([v / temp for v in zs]), _softmax([v / temp for v in zt])
        kl += sum(pt * math.log(pt / ps) for pt, ps in zip(qt, qs))
    kl = kl / len(y) * temp * temp
    return ce_s + lam * kl, lam


# ----------------------------------------------------------------------------- eq. 3
def test_loss_and_lambda_hand_computed():
    s, t, y = [[2.0, 0.0], [0.0, 0.0]], [[1.0, 0.0], [0.0, 1.0]], [0, 1]
    student = torch.tensor(s, requires_grad=True)
    loss, lam = kper_loss(student, torch.tensor(t), torch.tensor(y), lambda_cap=10.0)
    want, want_lam = _hand_loss(s, t, y, 10.0)
    # teacher CE = log(1 + e^-1) = 0.3133 on both samples: lambda = 3.192, under the cap
    assert want_lam == pytest.approx(1 / math.log(1 + math.exp(-1)))
    assert float(lam) == pytest.approx(want_lam, rel=1e-6)
    assert float(loss.detach()) == pytest.approx(want, rel=1e-6)
    loss.backward()  # the gradient reaches the student
    assert student.grad is not None and student.grad.abs().sum() > 0


def test_lambda_is_one_over_the_batch_mean_ce_not_per_sample():
    # one confident correct and one wrong teacher prediction: 1 / mean(CE) != mean(1 / CE)
    s, t, y = [[0.5, -0.5], [0.2, 0.1]], [[3.0, 0.0], [2.0, 0.0]], [0, 1]
    loss, lam = kper_loss(torch.tensor(s), torch.tensor(t), torch.tensor(y), lambda_cap=10.0)
    ce = [-math.log(_softmax([3.0, 0.0])[0]), -math.log(_softmax([2.0, 0.0])[1])]
    assert float(lam) == pytest.approx(1 / (sum(ce) / 2), rel=1e-6)  # 0.9347
    assert float(lam) != pytest.approx(sum(1 / c for c in ce) / 2, rel=1e-2)
    assert float(loss) == pytest.approx(_hand_loss(s, t, y, 10.0)[0], rel=1e-6)


def test_lambda_cap_and_temperature():
    s, y = [[0.3, -0.2], [-1.0, 0.4]], [0, 1]
    confident = [[20.0, 0.0], [0.0, 20.0]]  # CE about 2e-9: 1 / CE would be 5e8
    loss, lam = kper_loss(torch.tensor(s), torch.tensor(confident), torch.tensor(y), lambda_cap=10.0)
    assert float(lam) == 10.0
    assert float(loss) == pytest.approx(_hand_loss(s, confident, y, 10.0)[0], rel=1e-5)
    _, lam0 = kper_loss(torch.tensor(s), torch.tensor([[200.0, 0.0], [0.0, 200.0]]), torch.tensor(y),
                        lambda_cap=4.0)  # CE exactly 0 in float32: the cap, not inf
    assert float(lam0) == 4.0
    t = [[1.0, 0.0], [0.5, 1.5]]
    loss2, _ = kper_loss(torch.tensor(s), torch.tensor(t), torch.tensor(y), temperature=2.0)
    assert float(loss2) == pytest.approx(_hand_loss(s, t, y, 10.0, temp=2.0)[0], rel=1e-6)


# ----------------------------------------------------------------------------- eqs. 4-6
def test_label_entropy_hand_computed():
    assert label_entropy([5, 5]) == pytest.approx(1.0, abs=1e-9)
    h = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(2)  # 0.811278
    assert label_entropy([6, 2]) == pytest.approx(h, abs=1e-9)
    h3 = -(2 * 0.25 * math.log(0.25) + 0.5 * math.log(0.5)) / math.log(3)  # 0.946395
    assert label_entropy([1, 1, 2]) == pytest.approx(h3, abs=1e-9)
    # a single class: 0, not the -1e-12 that eps inside the log gives; empty: 0
    assert label_entropy([8, 0]) == 0.0 and label_entropy([100, 0, 0]) == 0.0
    assert label_entropy([0, 0]) == 0.0
    assert aggregation_score(0.8, [6, 2]) == pytest.approx(0.8 * (1e-12 + h), rel=1e-9)
    assert aggregation_score(0.9, [8, 0]) == pytest.approx(0.9e-12, rel=1e-9)  # eps keeps it > 0


def _coordinator(method: FedKPer) -> FedKPer:
    method.param_keys = ["w"]
    method.global_state = {"w": torch.tensor([0.0]), "n": torch.tensor(4)}
    return method


def _reply(w: float, n: int, score: float | None = None) -> Reply:
    payload = {"model": {"w": torch.tensor([w]), "n": torch.tensor(2)}}
    if score is not None:
        payload["score"] = score
    return Reply(payload, num_examples=n)


def test_aggregation_weights_hand_computed():
    # A_k = 0.5, 0.9, 0.8; histograms [5,5] (d=1), [8,0] (d=0), [6,2] (d=0.811278)
    d3 = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)) / math.log(2)
    hand = [0.5 * (1e-12 + 1.0), 0.9 * 1e-12, 0.8 * (1e-12 + d3)]
    hists, accs = [[5, 5], [8, 0], [6, 2]], [0.5, 0.9, 0.8]
    scores = [aggregation_score(a, h) for a, h in zip(accs, hists)]
    assert scores == pytest.approx(hand, rel=1e-9)
    m = _coordinator(FedKPer())
    replies = {"0": _reply(1.0, 10, scores[0]), "1": _reply(4.0, 1000, scores[1]),
               "2": _reply(-2.0, 1, scores[2])}
    assert m.client_weights(replies) == pytest.approx(hand, rel=1e-9)
    m.server_update(1, replies)
    p = [h / sum(hand) for h in hand]  # 0.4351, ~0, 0.5649: sample counts play no part
    assert m.global_state["w"].item() == pytest.approx(p[0] * 1.0 + p[1] * 4.0 + p[2] * -2.0, rel=1e-6)
    assert m.global_state["w"].item() == pytest.approx((0.5 - 0.8 * d3 * 2) / (0.5 + 0.8 * d3), rel=1e-6)


def test_ablation_switches_and_parameters():
    assert lookup("method", "fedkper") is FedKPer
    eps = {ep.name: ep.value for ep in md.entry_points(group="medfl")}
    assert eps.get("fedkper") == "medfl_plugins.fedkper"  # registered like the baselines
    assert FedKPer.parameters() == {"distill": True, "aggregation": "fedkper", "lambda_cap": 10.0,
                                    "clip": 5.0, "eps": 1e-12, "temperature": 1.0}
    # KD only (eq. 3 with FedAvg weights): sample counts, whatever a reply says
    kd_only = _coordinator(FedKPer(aggregation="fedavg"))
    replies = {"0": _reply(1.0, 10, 0.9), "1": _reply(4.0, 30, 0.1)}
    assert kd_only.client_weights(replies) == [10.0, 30.0]
    kd_only.server_update(1, replies)
    assert kd_only.global_state["w"].item() == pytest.approx(3.25)
    # every score 0 (A_k = 0 everywhere): FedAvg weights instead of a division by zero
    full = _coordinator(FedKPer())
    assert full.client_weights({"0": _reply(1.0, 10, 0.0), "1": _reply(4.0, 30, 0.0)}) == [10.0, 30.0]
    # Agg only: plain cross-entropy locally; the full method and KD only distil
    assert FedKPer(distill=False).local_loss(None, None, None) is None
    with pytest.raises(ValueError, match="aggregation"):
        FedKPer(aggregation="median")
    with pytest.raises(ValueError, match="lambda_cap"):
        FedKPer(lambda_cap=0)
    with pytest.raises(ValueError, match="clip"):
        FedKPer(clip=-1)
    with pytest.raises(MethodConfigError, match="aggregate"):
        FedKPer.from_config({"aggregate": "fedavg"})


# ----------------------------------------------------------------------------- client side
def _run(cfg: dict, spec: dict, tmp_path: Path) -> Run:
    registry()
    src_spec = dict(cfg["dataset"])
    source = lookup("dataset", src_spec.pop("name"))(**src_spec)
    run = Run(cfg, spec, tmp_path / spec.get("label", spec["name"]), split_data(source, cfg))
    run.prepare()
    return run


def test_payload_audit_score_and_clipping(tiny_fl, resolve, tmp_path, monkeypatch):
    cfg = resolve(tiny_fl)
    seen: list[dict] = []
    real_train = fk.train_epochs

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real_train(*args, **kwargs)

    monkeypatch.setattr(fk, "train_epochs", spy)
    run = _run(cfg, {"name": "fedkper"}, tmp_path)
    ins = run.coordinator.configure_round(1)
    cid = sorted(ins)[0]
    ctx = run.context(cid, 1)
    reply = run_client_update(run.client_method, ctx, ins[cid])
    # only the model and one scalar score travel; metrics are the usual loss and steps
    assert set(reply.payload) == {"model", "score"}
    assert set(reply.payload["model"]) == set(run.coordinator.global_state)
    assert isinstance(reply.payload["score"], float)
    assert set(reply.metrics) == {"loss", "steps"}
    assert seen[-1]["clip_grad_norm"] == 5.0 and seen[-1]["loss_fn"] is not None
    # the score is A_k (eps + d_k) of the *trained* model on the client's training split
    check = run.context(cid, 1)
    model = check.load_model(reply.payload["model"]).eval()
    x, y = next(iter(check.loader("train", shuffle=False, batch_size=10_000, augment=False)))
    with torch.no_grad():
        acc = float((model(x).argmax(1) == y).float().mean())
    hist = np.bincount(y.numpy(), minlength=2)
    assert reply.payload["score"] == pytest.approx(acc * (1e-12 + label_entropy(hist)), rel=1e-6)
    # KD only sends the model alone; Agg only trains with plain CE
    for spec, keys, distils in (({"name": "fedkper", "aggregation": "fedavg", "label": "kd"}, {"model"}, True),
                                ({"name": "fedkper", "distill": False, "label": "agg"}, {"model", "score"}, False)):
        r = _run(cfg, spec, tmp_path)
        ins = r.coordinator.configure_round(1)
        rep = run_client_update(r.client_method, r.context(cid, 1), ins[cid])
        assert set(rep.payload) == keys
        assert (seen[-1]["loss_fn"] is not None) == distils


def test_score_accuracy_is_measured_on_the_unaugmented_training_split(tiny_fl, resolve, tmp_path):
    """A_k of eq. 6 comes from the plain training split, not from the augmented loader.

    The source's training-time ("augmented", ``make_dataset(rows, train=True)``) variant
    flips every label, so on it the accuracy of any model is exactly ``1 - `` its accuracy
    on the plain split: a score computed through augmentation cannot match the plain one."""
    import dataclasses

    from medfl.data.source import ArrayDataset

    cfg = resolve(tiny_fl)
    registry()
    src_spec = dict(cfg["dataset"])
    source = lookup("dataset", src_spec.pop("name"))(**src_spec)
    root = Path(source.info["directory"])
    calls: list[bool] = []

    def make_dataset(rows: pd.DataFrame, train: bool) -> ArrayDataset:
        calls.append(bool(train))
        labels = rows["label"].to_numpy()
        return ArrayDataset(rows["path"].tolist(), 1 - labels if train else labels, root=root)

    garbled = dataclasses.replace(source, make_dataset=make_dataset)
    run = Run(cfg, {"name": "fedkper"}, tmp_path / "fedkper", split_data(garbled, cfg))
    run.prepare()
    ins = run.coordinator.configure_round(1)
    cid = sorted(ins)[0]
    reply = run_client_update(run.client_method, run.context(cid, 1), ins[cid])
    assert False in calls  # the client built its training split without augmentation

    check = run.context(cid, 1)
    model = check.load_model(reply.payload["model"]).eval()

    def accuracy(augment: bool) -> tuple[float, np.ndarray]:
        x, y = next(iter(check.loader("train", shuffle=False, batch_size=10_000, augment=augment)))
        with torch.no_grad():
            return float((model(x).argmax(1) == y).float().mean()), y.numpy()

    plain, y_plain = accuracy(False)
    augmented, _ = accuracy(True)
    assert augmented == pytest.approx(1 - plain)
    assert abs(plain - augmented) > 0.05  # the two readings are told apart
    d = label_entropy(np.bincount(y_plain, minlength=2))  # binary: flipping keeps d_k
    assert reply.payload["score"] == pytest.approx(plain * (1e-12 + d), rel=1e-6)
    assert reply.payload["score"] != pytest.approx(augmented * (1e-12 + d), rel=1e-3)


def test_two_round_run_samples_like_fedavg(tiny_fl, resolve):
    tiny_fl.update(fraction=0.67, methods=[{"name": "fedavg"}, {"name": "fedkper"}])
    cfg = resolve(tiny_fl)
    out = run_experiment(cfg)
    exp = Path(out["dir"])
    fed = Federation(client_ids=["0", "1", "2"], eval_client_ids=["0", "1", "2"], num_examples={},
                     num_classes=2, rounds=2, seed=0, fraction=0.67)
    tm = {m: pd.read_csv(exp / m / "train_metrics.csv", dtype={"client_id": str}) for m in ("fedavg", "fedkper")}
    for r in (1, 2):
        want = fed.sample(r)
        assert len(want) == 2  # round_half_up(0.67 * 3)
        for m in tm:
            assert tm[m].loc[tm[m]["round"] == r, "client_id"].tolist() == want
    metrics = pd.read_csv(exp / "fedkper" / "metrics.csv", dtype={"client_id": str})
    glob = metrics[metrics["split"] == "global_test"]
    assert (glob.groupby("round")["accuracy"].nunique() == 1).all()  # one global model
    assert np.isfinite(metrics["accuracy"]).all()
    summary = json.loads((exp / "fedkper" / "summary.json").read_text())
    assert summary["forgetting"]["global"]["acc_final"] == pytest.approx(
        glob.loc[glob["round"] == 2, "accuracy"].iloc[0])
    comp = pd.read_csv(exp / "comparison_forgetting.csv")
    assert comp["method"].tolist() == ["fedavg", "fedkper"]
    # same clients, same initial model, different local loss and weights: different model
    ck = {m: torch.load(exp / m / "checkpoints" / "round_0002.pt", weights_only=True)["method"]["global"]
          for m in ("fedavg", "fedkper")}
    assert set(ck["fedavg"]) == set(ck["fedkper"])
    assert any(not torch.allclose(ck["fedavg"][k].float(), ck["fedkper"][k].float()) for k in ck["fedavg"])


#: FedKPer's presets as docs/plugins.md documents them: (values, open values, train, open train)
_KPER = {"distill": True, "aggregation": "fedkper", "lambda_cap": 10.0, "clip": 5.0, "eps": 1e-12, "temperature": 1.0}
_KPER_TRAIN = {"optimizer": "sgd", "lr": 0.01, "epochs": 5, "momentum": 0.9, "weight_decay": 1e-5, "batch_size": 50}
#: where each value comes from (issue 48): the temperature is a reading of eq. 3's "KL
#: divergence-based distillation"; momentum, weight decay and batch come from the authors' code
_PAPER_KINDS = {**dict.fromkeys(["distill", "aggregation", "lambda_cap", "clip", "eps", "train.optimizer", "train.lr",
                                 "train.epochs"], "paper"), "temperature": "reading",
                **dict.fromkeys(["train.momentum", "train.weight_decay", "train.batch_size"], "authors_code")}
_AUTHORS_KINDS = {**dict.fromkeys(_PAPER_KINDS, "authors_code"), "eps": "open"}
KPER_PRESETS = {
    "paper": (_KPER, _KPER_TRAIN, _PAPER_KINDS, 100),
    "authors": ({**_KPER, "clip": None}, _KPER_TRAIN, _AUTHORS_KINDS, 200),
}


def test_presets_resolve_to_their_documented_values(tiny_fl, resolve):
    tiny_fl["rounds"] = 1
    tiny_fl["methods"] = [{"name": "fedkper", "preset": name, "label": name} for name in KPER_PRESETS]
    out = run_experiment(resolve(tiny_fl))
    for name, (values, train, kinds, rounds) in KPER_PRESETS.items():
        saved = json.loads((Path(out["dir"]) / name / "config.json").read_text())
        block = saved["preset"]
        assert {k: v["value"] for k, v in block["values"].items()} == values
        assert {k: v["value"] for k, v in block["train"].items()} == train
        assert {**{k: v["from"] for k, v in block["values"].items()},
                **{f"train.{k}": v["from"] for k, v in block["train"].items()}} == kinds
        assert block["experiment"]["rounds"] == rounds and block["experiment"]["fraction"] == 0.1
        assert block["experiment"]["partition"] == {"name": "dirichlet", "alpha": 0.1}
        assert saved["method_hparams"]["clip"] == (None if name == "authors" else 5.0)
        steps = pd.read_csv(Path(out["dir"]) / name / "train_metrics.csv")["steps"]
        sizes = pd.read_csv(Path(out["dir"]) / name / "train_metrics.csv")["num_examples"]
        assert (steps == 5 * np.ceil(sizes / 50)).all()          # 5 epochs of batches of 50
