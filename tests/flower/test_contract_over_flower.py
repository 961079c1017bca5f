"""The method contract's extension points over Flower (the loop-back transport of
test_coordinator.py: the coordinator's and the sites' real code, one process): client state
across the steps of a round, the validation exchange, evaluation results at the coordinator,
and Global Test (cross_test) of an evaluation model that is not the client's registered model
(an ensemble returning probabilities). Each equals the in-process run exactly."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.engine import protocol as P  # noqa: E402

from contract_methods import ValidatingAvg, registered  # noqa: E402
from flower_cases import numeric_equal  # noqa: E402
from test_coordinator import _run_both, _no_state_at_coordinator  # noqa: E402

BASE: dict[str, Any] = {"rounds": 2, "model": {"name": "small_cnn", "width": 4},
                        "train": {"batch_size": 8, "lr": 0.05}}


@pytest.fixture(autouse=True)
def _register() -> Iterator[None]:
    yield from registered()


def _same(flower: Path, local: Path, files: tuple[str, ...]) -> None:
    for f in files:
        numeric_equal(pd.read_csv(local / f), pd.read_csv(flower / f), f, atol=0.0)


def test_state_of_the_first_step_reaches_the_second_at_the_site(tmp_path: Path) -> None:
    flower, local, _ = _run_both(tmp_path, "steps", {**BASE, "methods": [{"name": "test_step_counter"}]})
    tm = pd.read_csv(flower / "train_metrics.csv", dtype={"client_id": str})
    assert all(rows["count"].tolist() == [1.0, 2.0, 3.0, 4.0] for _, rows in tm.groupby("client_id"))
    _same(flower, local, ("train_metrics.csv", "metrics.csv"))
    _no_state_at_coordinator(flower)


def test_validation_exchange_and_evaluation_results_over_flower(tmp_path: Path) -> None:
    ValidatingAvg.received = {}
    flower, local, grid = _run_both(tmp_path, "val", {**BASE, "methods": [{"name": "test_validating_avg"}]})
    _same(flower, local, ("train_metrics.csv", "validation_metrics.csv", "metrics.csv"))
    kinds = [k for _, k, _ in grid.sent]
    assert kinds.count(P.VALIDATE) == 6
    # the coordinator got the same validation and evaluation results both ways
    validate = ValidatingAvg.received["validate"]
    evaluate = ValidatingAvg.received["evaluate"]
    assert len(validate) == 4 and json.dumps(validate[:2]) == json.dumps(validate[2:])
    assert len(evaluate) == 4 and json.dumps(evaluate[:2]) == json.dumps(evaluate[2:])  # NaN-aware


def test_global_test_of_a_probability_ensemble_over_flower(tmp_path: Path) -> None:
    job = {**BASE, "eval_splits": ["test", "cross_test"], "methods": [{"name": "test_ensemble_local"}]}
    flower, local, grid = _run_both(tmp_path, "ens", job)
    _same(flower, local, ("metrics.csv", "cross_test.csv"))
    assert [k for _, k, _ in grid.sent].count(P.SCORE) == 6
    m = pd.read_csv(flower / "metrics.csv")
    assert (m["split"] == "cross_test").sum() == 6 and m["accuracy"].notna().all()


def test_presets_and_the_mechanism_log_over_flower(tmp_path: Path) -> None:
    """A preset resolves the same at the sites (the entry travels with its preset's name), and
    mechanisms.csv and the warnings equal the in-process run's."""
    job = {**BASE, "methods": [{"name": "test_observed", "preset": "paper"}]}
    flower, local, _ = _run_both(tmp_path, "observed", job)
    _same(flower, local, ("train_metrics.csv", "metrics.csv"))
    assert (flower / "mechanisms.csv").read_bytes() == (local / "mechanisms.csv").read_bytes()
    for key in ("preset", "method_hparams"):
        assert (json.loads((flower / "config.json").read_text())[key]
                == json.loads((local / "config.json").read_text())[key])
    assert (json.loads((flower / "summary.json").read_text())["warnings"]
            == [{"round": 2, "warning": "the count cannot act in round 2"}])
