"""Side channels any method could use (issue 38, item 3): metric and validation names are
strings a method chooses, and ``num_examples`` a number it chooses. A method declares its
names before round 1 (``Method.train_metrics``, ``validate_metrics``, ``profile_metrics``,
``Method.reported_names``) and its ``num_examples`` rule (``Method.expected_num_examples``:
the training split's size by default); the client refuses anything else before it leaves
(the run stops naming the method and the name), the coordinator drops it
(tests/engine/test_reply_screening.py, tests/flower/test_coordinator.py). Here: outside
plugins, defined in the test, that put the labels in names or in the count."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from contract_methods import methods_registered
from medfl.hub import HubAndSpoke
from medfl.experiment import run_experiment
from medfl.messages import Instruction, PayloadError, Reply
from medfl.method import ENGINE_TRAIN_METRICS


def _labels(client: Any) -> list[int]:
    data = client.dataset("train", augment=False)
    return [int(data[i][1]) for i in range(len(data))]


class LabelNames(HubAndSpoke):
    """FedAvg whose reply metrics name every training label (``y<i>_<label>``)."""

    name = "test_label_names"

    def client_update(self, client: Any, instruction: Instruction) -> Reply:
        reply = super().client_update(client, instruction)
        reply.metrics.update({f"y{i}_{y}": 1.0 for i, y in enumerate(_labels(client))})
        return reply


class LabelCount(HubAndSpoke):
    """FedAvg whose ``num_examples`` is the number of class-1 samples (a label statistic
    within 0..the split size, which the old range check let through)."""

    name = "test_label_count"

    def client_update(self, client: Any, instruction: Instruction) -> Reply:
        reply = super().client_update(client, instruction)
        reply.num_examples = sum(_labels(client))
        return reply


class LabelValidation(HubAndSpoke):
    """FedAvg with a validation exchange whose scalars name the first label."""

    name = "test_label_validation"
    validate_metrics = frozenset({"val_n"})

    def configure_validate(self, round: int) -> dict[str, Instruction]:
        return {cid: Instruction() for cid in self.federation.eval_client_ids}

    def client_validate(self, client: Any, instruction: Instruction) -> dict[str, float]:
        return {"val_n": float(client.num_examples("val")), f"first_label_{_labels(client)[0]}": 1.0}


class Declared(HubAndSpoke):
    """An honest plugin: one more training metric and a subsample, both declared."""

    name = "test_declared"
    train_metrics = ENGINE_TRAIN_METRICS | {"half"}

    def expected_num_examples(self, instruction: Instruction, train_size: int) -> int:
        return train_size // 2

    def client_update(self, client: Any, instruction: Instruction) -> Reply:
        reply = super().client_update(client, instruction)
        reply.metrics["half"] = 1.0
        reply.num_examples = client.num_examples("train") // 2
        return reply


def _run(tiny_fl: dict, resolve: Any, method: str) -> Path:
    out = run_experiment(resolve({**tiny_fl, "name": method, "methods": [{"name": method}]}))
    return Path(out["dir"]) / method


@pytest.mark.parametrize("method, match, unwritten", [
    ("test_label_names", r"reply of method 'test_label_names' from client 0: train value name\(s\) 'y0_\d'.* "
                         r"that method 'test_label_names' does not declare", "train_metrics.csv"),
    ("test_label_count", r"reply of method 'test_label_count' from client 0: num_examples \d+ is not the \d+ that "
                         r"method 'test_label_count' declares", "train_metrics.csv"),
    ("test_label_validation", r"validate of method 'test_label_validation' at client 0: validate value name\(s\) "
                              r"'first_label_\d' that method 'test_label_validation' does not declare",
     "validation_metrics.csv"),
])
def test_a_plugin_that_encodes_labels_in_names_or_counts_is_stopped_at_the_client(
        tiny_fl: dict, resolve: Any, method: str, match: str, unwritten: str) -> None:
    """On main these runs finished with the labels in train_metrics.csv's column names, in
    its num_examples column, or in validation_metrics.csv's column names."""
    with methods_registered(LabelNames, LabelCount, LabelValidation, name="side-channels-test"):
        with pytest.raises(PayloadError, match=match):
            _run(tiny_fl, resolve, method)
    run = Path(tiny_fl["output_dir"]) / method / method
    assert not (run / "summary.json").is_file() and not (run / unwritten).is_file()


def test_declared_names_and_a_declared_count_run(tiny_fl: dict, resolve: Any) -> None:
    """A plugin that declares its extra metric and its subsample count runs as before."""
    with methods_registered(Declared, name="side-channels-declared"):
        run = _run(tiny_fl, resolve, "test_declared")
    train = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
    rows = pd.read_csv(run / "partition.csv", dtype={"client_id": str})
    halves = (rows[rows["role"] == "train"].groupby("client_id").size() // 2).to_dict()
    assert set(train["half"]) == {1.0} and not (run / "reply_events.csv").is_file()
    assert {c: int(n) for c, n in zip(train["client_id"], train["num_examples"])} == halves
    assert json.loads((run / "summary.json").read_text())["rounds"] == 2


def test_the_default_declaration_covers_the_engine_and_the_builtins() -> None:
    """The default is what the engine's local training reports; FedSDC's per-head names
    follow its instruction; an undeclared exchange name is refused by the shared check."""
    from medfl.config import build_method
    from medfl.engine.client import reported_problem

    fedavg = build_method({"name": "fedavg"})
    assert fedavg.reported_names("train", Instruction()) == ENGINE_TRAIN_METRICS == frozenset(
        {"loss", "steps", "dp_steps", "dp_sample_rate", "dp_noise_multiplier"})
    assert fedavg.reported_names("validate", Instruction()) == frozenset()
    sdc = build_method({"name": "fedsdc"})
    names = sdc.reported_names("validate", Instruction(payload={"heads": [{}, {}]}))
    assert {"micro_f1_0", "micro_f1_1", "accuracy_1", "n_val", "vote_ties"} <= names and "micro_f1_2" not in names
    assert reported_problem(fedavg, "train", Instruction(), {"loss": 0.1}, 5, 5) == ""
    assert "num_examples 4 is not the 5" in reported_problem(fedavg, "train", Instruction(), {"loss": 0.1}, 4, 5)
    assert "num_examples True" in reported_problem(fedavg, "train", Instruction(), {}, True, 1)
    long = "x" * 500
    assert repr("x" * 40) in reported_problem(fedavg, "profile", Instruction(), {long: 1.0})
