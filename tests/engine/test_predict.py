"""medfl.predict.predict: a finished run's client models predict, read-only."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from medfl.bundle import infer
from medfl.engine.runner import RunError
from medfl.experiment import run_experiment
from medfl.predict import predict


def _digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def test_predict_matches_the_last_evaluation(tiny_fl, resolve, tmp_path):
    tiny_fl["methods"] = [{"name": "fedbn"}]
    tiny_fl["eval_splits"] = ["global_test"]
    out = run_experiment(resolve(tiny_fl))
    run_dir = Path(out["dir"]) / "fedbn"
    before = _digest(run_dir)
    csv = infer(run_dir, output=tmp_path / "pred.csv", clients=["0", "2"])
    assert _digest(run_dir) == before  # nothing in the run directory changes
    pred = pd.read_csv(csv, dtype={"client_id": str, "sample_id": str})
    assert set(pred["client_id"]) == {"0", "2"}
    probs = pred[[c for c in pred.columns if c.startswith("prob_")]].to_numpy()
    assert probs.shape[1] == 2 and np.allclose(probs.sum(1), 1, atol=1e-5)
    assert (pred["prediction"] == probs.argmax(1)).all()
    # the run's own global-test accuracy of client 0, recomputed from the predictions
    metrics = pd.read_csv(run_dir / "metrics.csv", dtype={"client_id": str})
    last = metrics[(metrics["round"] == 2) & (metrics["split"] == "global_test") & (metrics["client_id"] == "0")]
    part = pd.read_csv(run_dir / "partition.csv", dtype={"client_id": str, "sample_id": str}, keep_default_na=False)
    test_ids = set(part.loc[part["role"] == "global_test", "sample_id"])
    mine = pred[(pred["client_id"] == "0") & pred["sample_id"].isin(test_ids)]
    assert len(mine) == len(test_ids)
    assert (mine["prediction"] == mine["label"]).mean() == pytest.approx(float(last["accuracy"].iloc[0]))
    # split "global_test": exactly the run's held-out samples, from its own data or a dataset spec
    held = pd.read_csv(infer(run_dir, output=tmp_path / "held.csv", clients=["0"], split="global_test"),
                       dtype={"sample_id": str})
    assert set(held["sample_id"]) == test_ids and len(held) == len(test_ids)
    spec = dict(tiny_fl["dataset"])
    again = pd.read_csv(predict(run_dir, spec, tmp_path / "again.csv", ["0"], "global_test"), dtype={"sample_id": str})
    pd.testing.assert_frame_equal(held, again)


def test_predict_errors_name_the_problem(tiny_fl, resolve, tmp_path):
    out = run_experiment(resolve(tiny_fl))
    with pytest.raises(RunError, match="experiment directory; pass one method's run directory"):
        predict(out["dir"])
    with pytest.raises(RunError, match=r"unknown client\(s\) \['9'\]"):
        predict(Path(out["dir"]) / "fedavg", clients=["9"])
    with pytest.raises(RunError, match="no config.json"):
        predict(tmp_path)
