"""The method contract's extension points: client state across steps, the validation
exchange, evaluation results at the coordinator, probability models, safe model reuse,
training on empty batches, dataset variants without augmentation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from medfl.config import resolve_config
from medfl.context import ClientContext
from medfl.experiment import run_experiment
from medfl.training import make_optimizer, predict_proba, train_epochs
from medfl.messages import Instruction, Reply
from medfl.models import ProbabilityModel
from medfl.plugins import registry

from contract_methods import EnsembleLocal, StepCounter, ValidatingAvg, registered  # noqa: F401

DATA: dict[str, Any] = {
    "seed": 0, "num_clients": 3, "progress": False, "rounds": 2,
    "dataset": {"name": "synthetic2d", "num_samples": 96, "num_classes": 2, "image_size": 16, "noise": 0.5},
    "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8},
    "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8, "lr": 0.05},
}


def _run(tmp_path: Path, name: str, method: dict[str, Any], **extra: Any) -> Path:
    fl = json.loads(json.dumps({**DATA, **extra}))
    fl["dataset"]["root"] = str(tmp_path / "data")
    fl.update(name=name, output_dir=str(tmp_path / "runs"), methods=[method])
    out = run_experiment(resolve_config(fl))
    return Path(out["dir"]) / method.get("label", method["name"])


@pytest.fixture(autouse=True)
def _register() -> Iterator[None]:
    yield from registered()


# ------------------------------------------------------------------ state across steps
def test_second_step_of_a_round_sees_the_state_the_first_saved(tmp_path: Path) -> None:
    run = _run(tmp_path, "steps", {"name": "test_step_counter"})
    tm = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
    for cid, rows in tm.groupby("client_id"):
        assert rows["count"].tolist() == [1.0, 2.0, 3.0, 4.0], cid   # two steps in each of two rounds


def test_stopped_and_resumed_steps_keep_counting(tmp_path: Path) -> None:
    from medfl.experiment import resume

    run = _run(tmp_path, "steps", {"name": "test_step_counter"}, stop_after_round=1, rounds=3)
    resume(run)
    tm = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
    assert all(rows["count"].tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0] for _, rows in tm.groupby("client_id"))


# ------------------------------------------------------------------ validation and evaluation results
def test_validation_exchange_and_evaluation_results_reach_the_coordinator(tmp_path: Path) -> None:
    ValidatingAvg.received = {}
    run = _run(tmp_path, "val", {"name": "test_validating_avg"}, eval_splits=["test", "global_test"])
    tm = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
    assert len(tm) == 6 and "val_accuracy" not in tm.columns   # no fake training rows
    vm = pd.read_csv(run / "validation_metrics.csv", dtype={"client_id": str})
    assert len(vm) == 6 and set(vm.columns) == {"round", "client_id", "val_accuracy", "val_n"}
    assert [r for r, _ in ValidatingAvg.received["validate"]] == [1, 2]
    r2 = dict(ValidatingAvg.received["validate"][1][1])
    for _, row in vm[vm["round"] == 2].iterrows():
        assert r2[row["client_id"]]["val_accuracy"] == row["val_accuracy"]
    # server_evaluate gets exactly what metrics.csv holds
    metrics = pd.read_csv(run / "metrics.csv", dtype={"client_id": str})
    rounds = [r for r, _ in ValidatingAvg.received["evaluate"]]
    assert rounds == [1, 2]
    results = ValidatingAvg.received["evaluate"][1][1]
    assert sorted(results) == ["0", "1", "2"] and set(results["0"]) == {"test", "global_test"}
    for _, row in metrics[metrics["round"] == 2].iterrows():
        split = "test" if row["split"] == "local_test" else row["split"]
        assert results[row["client_id"]][split]["accuracy"] == row["accuracy"]
        assert results[row["client_id"]][split]["n"] == row["n"]


def test_validation_scores_must_be_numbers(tmp_path: Path) -> None:
    from medfl.engine.client import run_client_validate

    class Bad(ValidatingAvg):
        def client_validate(self, client: ClientContext, instruction: Instruction) -> dict[str, float]:
            return {"per_sample": [0.0, 1.0]}  # type: ignore[dict-item]

    ctx = ClientContext("0", 1, 0, {}, {"name": "small_cnn"}, {})
    with pytest.raises(TypeError, match="flat dict of numbers"):
        run_client_validate(Bad(), ctx, Instruction())


def test_addressing_an_unknown_client_in_validation_is_refused(tmp_path: Path) -> None:
    from medfl.rundir import RunError

    with pytest.raises(RunError, match=r"unknown client\(s\) \['nobody'\] in configure_validate"):
        _run(tmp_path, "stray", {"name": "test_stray"})


# ------------------------------------------------------------------ probability models
def test_probability_model_is_scored_on_its_own_probabilities(tmp_path: Path) -> None:
    run = _run(tmp_path, "ens", {"name": "test_ensemble_local"}, eval_splits=["test", "cross_test"])
    metrics = pd.read_csv(run / "metrics.csv", dtype={"client_id": str})
    assert metrics["accuracy"].notna().all() and set(metrics["split"]) == {"local_test", "cross_test"}
    # the engine did not softmax the probabilities again: recompute client 1's test AUC by hand
    from medfl.reopen import reopen, saved_config

    saved = saved_config(run)
    r = reopen(run, saved, saved["fl"])
    r.prepare(read_only=True)
    ctx = r.context("1", 2, state_before=3)
    model = r.client_method.client_eval_model(ctx, Instruction())
    y, p = predict_proba(model, ctx.loader("test"), "cpu")
    with torch.no_grad():
        x = torch.stack([ctx.dataset("test")[i][0] for i in range(len(y))])
        manual = ((torch.softmax(model.a(x), 1) + torch.softmax(model.b(x), 1)) / 2).numpy()
    np.testing.assert_allclose(p, manual, atol=1e-6)
    from medfl.metrics.classification import roc_auc as auc

    row = metrics[(metrics["round"] == 2) & (metrics["client_id"] == "1") & (metrics["split"] == "local_test")]
    assert len(set(y.tolist())) == 2   # both classes: the AUC is defined
    assert float(row["auc"].iloc[0]) == pytest.approx(auc(y, manual), abs=1e-9)


def test_a_model_that_misdeclares_probabilities_gets_a_clear_error() -> None:
    class Liar(ProbabilityModel):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.randn(len(x), 2)   # logits, not probabilities

    loader = DataLoader(TensorDataset(torch.zeros(4, 1), torch.zeros(4, dtype=torch.long)), batch_size=4)
    with pytest.raises(ValueError, match="declares returns_probabilities.*not probabilities"):
        predict_proba(Liar(), loader)


# ------------------------------------------------------------------ model objects
def _ctx(cid: str) -> ClientContext:
    registry()
    return ClientContext(cid, 1, 0, {}, {"name": "small_cnn", "width": 4, "in_channels": 1, "num_classes": 2}, {})


def test_a_hooked_or_wrapped_model_is_never_handed_to_the_next_client() -> None:
    state = _ctx("a").build_model().state_dict()
    m1 = _ctx("a").load_model(state)
    m1.layer1.register_forward_hook(lambda *a: None)     # what Opacus's GradSampleModule does
    m2 = _ctx("b").load_model(state)
    assert m2 is not m1 and not any(mod._forward_hooks for mod in m2.modules())
    next(m2.parameters()).grad_sample = torch.zeros(1)   # a per-sample gradient left behind
    m3 = _ctx("c").load_model(state)
    assert m3 is not m2
    m3.head = nn.Linear(8, 5)                             # a structural change
    m4 = _ctx("d").load_model(state)
    assert m4 is not m3 and m4.head.out_features == 2
    m5 = _ctx("e").load_model(state)                      # untouched: reused
    assert m5 is m4
    m6 = _ctx("f").load_model(state, fresh=True)          # asked for a private object
    assert m6 is not m5
    for k, v in m6.state_dict().items():
        assert torch.equal(v, state[k])


def test_opacus_can_wrap_the_model_of_every_client_in_turn() -> None:
    opacus = pytest.importorskip("opacus", reason="opacus is a test dependency (pip install -e '.[test]')")
    spec = {"name": "small_cnn", "width": 4, "in_channels": 1, "num_classes": 2, "norm": "instance"}
    registry()
    state = ClientContext("a", 1, 0, {}, spec, {}).build_model().state_dict()
    seen = []
    for cid in "abc":   # as three clients of one round in one process
        model = ClientContext(cid, 1, 0, {}, spec, {}).load_model(state)
        wrapped = opacus.GradSampleModule(model)
        wrapped(torch.randn(4, 1, 8, 8)).sum().backward()
        assert next(model.parameters()).grad_sample.shape[0] == 4
        seen.append(model)
    assert len({id(m) for m in seen}) == 3


# ------------------------------------------------------------------ training helpers
def test_train_epochs_skips_empty_batches() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    x, y = torch.randn(6, 4), torch.tensor([0, 1, 0, 1, 0, 1])
    batches = [(x[:0], y[:0]), (x[:3], y[:3]), (x[3:3], y[3:3]), (x[3:], y[3:])]
    stats = train_epochs(model, batches, torch.optim.SGD(model.parameters(), lr=0.1))  # type: ignore[arg-type]
    assert stats["steps"] == 2.0 and np.isfinite(stats["loss"])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_default_optimizer_is_sgd_with_momentum() -> None:
    opt = make_optimizer(nn.Linear(2, 2).parameters(), {})
    assert isinstance(opt, torch.optim.SGD)
    assert opt.defaults["momentum"] == 0.9 and opt.defaults["lr"] == 0.01 and opt.defaults["weight_decay"] == 0.0


def test_small_cnn_takes_a_norm_option() -> None:
    from medfl.models.registry import build_model

    registry()
    m = build_model({"name": "small_cnn", "width": 4, "norm": "instance"})
    assert not any(isinstance(x, nn.BatchNorm2d) for x in m.modules())
    assert m(torch.zeros(1, 1, 8, 8)).shape == (1, 2)


# ------------------------------------------------------------------ datasets
def test_training_split_without_augmentation_in_any_order() -> None:
    built: list[bool | None] = []

    def factory(augment: bool | None = None) -> TensorDataset:
        built.append(augment)
        value = 1.0 if augment in (None, True) else 0.0
        return TensorDataset(torch.full((2, 1), value), torch.zeros(2, dtype=torch.long))

    ctx = ClientContext("0", 1, 0, {"train": factory, "test": factory}, {"name": "small_cnn"}, {})
    assert float(ctx.dataset("train")[0][0]) == 1.0            # augmented by default
    assert float(ctx.dataset("train", augment=False)[0][0]) == 0.0
    assert float(ctx.dataset("train")[0][0]) == 1.0            # cached, not rebuilt
    assert built == [None, False]
    assert float(ctx.dataset("test")[0][0]) == 1.0 and built[-1] is None
    with pytest.raises(KeyError, match="has no split 'val'"):
        ctx.dataset("val")


def test_the_contract_modules_do_not_import_the_engine() -> None:
    import subprocess
    import sys

    code = ("import sys, medfl.method, medfl.context; "
            "bad = sorted(m for m in sys.modules if m.startswith('medfl.engine') or m.startswith('medfl.flower')); "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)
