"""communication.csv over Flower (the loop-back transport of test_coordinator.py: every message
crosses as its bytes to the sites' real ``answer_message``): the coordinator measures the
messages it sends and receives, and the in-process run of the same config counts exactly the
same bytes, exchange by exchange (training steps, validation, evaluation, cross_test scoring,
a reply filter)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.config import resolve_config  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl.flower.server import run_flower_experiment  # noqa: E402

from contract_methods import registered  # noqa: E402
from flower_cases import FEDAVG, fl_config  # noqa: E402
from test_coordinator import FAST, LoopTransport, _run_both, _sites  # noqa: E402


BASE: dict[str, Any] = {"rounds": 2, "model": {"name": "small_cnn", "width": 4},
                        "train": {"batch_size": 8, "lr": 0.05}}

JOBS: dict[str, dict[str, Any]] = {
    # the Global Test: every evaluation model to every site (score), heterogeneous models
    "cross_test": {**BASE, "client_models": [{"width": 4}, {"width": 3}, {"width": 2}],
                   "eval_splits": ["test", "cross_test"], "methods": [{"name": "local"}]},
    # a validation exchange, and two training steps a round
    "validate": {**BASE, "methods": [{"name": "test_validating_avg"}]},
    "steps": {**BASE, "methods": [{"name": "test_step_counter"}]},
    # a reply filter: the bytes counted are the quantized reply's
    "quantize": {**FEDAVG, "methods": [{"name": "fedavg", "filters": [{"name": "quantize", "bits": 8}]}]},
}


@pytest.fixture(autouse=True)
def _register() -> Iterator[None]:
    yield from registered()


def _comm(run_dir: Path) -> pd.DataFrame:
    return pd.read_csv(run_dir / "communication.csv", dtype={"client_id": str})


@pytest.mark.parametrize("job", sorted(JOBS))
def test_in_process_counts_the_bytes_flower_sends(tmp_path: Path, job: str) -> None:
    flower, local, _ = _run_both(tmp_path, job, JOBS[job])
    over_flower, in_process = _comm(flower), _comm(local)
    assert len(over_flower) and (over_flower["bytes_to_client"] > 0).all()
    assert (over_flower["bytes_from_client"] > 0).all()
    pd.testing.assert_frame_equal(over_flower, in_process)
    phases = set(over_flower["phase"])
    assert {"train", "evaluate"} <= phases
    assert ("score" in phases) == (job == "cross_test") and ("validate" in phases) == (job == "validate")
    if job == "steps":   # two steps a round: two exchanges summed in one row
        assert (over_flower.loc[over_flower["phase"] == "train", "messages"] == 2).all()
    summaries = [json.loads((d / "summary.json").read_text())["communication"] for d in (flower, local)]
    assert summaries[0] == summaries[1]
    cols = ["round", "client_id", "bytes_to_client", "bytes_from_client"]
    pd.testing.assert_frame_equal(pd.read_csv(flower / "train_metrics.csv")[cols],
                                  pd.read_csv(local / "train_metrics.csv")[cols])


def test_a_site_that_does_not_answer_counts_its_request_only(tmp_path: Path) -> None:
    fl = fl_config(tmp_path, "drop", {**FEDAVG, "eval_every": 0})

    def rule(node: int, kind: str, ctl: dict[str, Any]) -> str:
        return "unavailable" if node == 103 and kind == P.TRAIN and ctl["round"] == 2 else "ok"

    out = run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl), rule=rule), FAST)
    comm = _comm(Path(out["dir"]) / "fedavg").set_index(["round", "client_id", "phase"])
    lost, kept = comm.loc[(2, "2", "train")], comm.loc[(2, "1", "train")]
    assert lost["messages"] == 1 and lost["bytes_from_client"] == 0
    assert lost["bytes_to_client"] == kept["bytes_to_client"] > 0 and kept["bytes_from_client"] > 0
