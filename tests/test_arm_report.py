"""Experiment arms at their best validation round or the mean of their last rounds
(medfl.arm_report), on metrics.csv files written by hand."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from medfl.arm_report import arm_scores, arm_table, round_curves, write_arm_report

# per round: (local_val micro_f1 of client 0, of client 1), local_test, global_test (same for both clients)
ROUNDS = {1: ((0.2, 0.4), 0.30, 0.10), 2: ((0.6, 0.8), 0.50, 0.20), 3: ((0.7, 0.7), 0.90, 0.30),
          4: ((0.5, 0.3), 0.40, 0.40)}


def _write_run(path: Path, shift: float = 0.0, early_best: int | None = None) -> Path:
    rows = []
    for r, (val, test, glob) in ROUNDS.items():
        for cid in ("0", "1"):
            base = {"round": r, "client_id": cid, "client_name": f"site{cid}", "reported_by": "self", "n": 10}
            rows.append({**base, "split": "local_val", "micro_f1": val[int(cid)] + shift, "accuracy": 0.5})
            rows.append({**base, "split": "local_test", "micro_f1": test + shift, "accuracy": 0.6})
            rows.append({**base, "split": "global_test", "micro_f1": glob + shift,
                         "accuracy": float("nan") if cid == "1" else 0.7})
    path.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(path / "metrics.csv", index=False)
    if early_best is not None:
        (path / "summary.json").write_text(json.dumps({"early_stopping": {"best_round": early_best}}))
    return path


def test_round_curves_average_clients_per_round_and_split(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "a")
    c = round_curves(pd.read_csv(run / "metrics.csv", dtype={"client_id": str}))
    val = c[c["split"] == "local_val"].set_index("round")["micro_f1"]
    assert val.to_dict() == pytest.approx({1: 0.3, 2: 0.7, 3: 0.7, 4: 0.4})
    glob = c[c["split"] == "global_test"].set_index("round")["accuracy"]
    assert glob.tolist() == [0.7] * 4   # NaN-aware: the client without a score is left out
    assert c["clients"].eq(2).all()


def test_best_validation_round_is_the_earliest_maximum_and_reads_every_split_there(tmp_path: Path) -> None:
    s = arm_scores(_write_run(tmp_path / "a"))
    assert s["rounds"] == [2] and s["selected_by"] == "local_val/micro_f1"   # 0.7 in rounds 2 and 3: the earlier
    assert s["value"] == pytest.approx(0.7)
    assert s["scores"]["local_test"]["micro_f1"] == pytest.approx(0.5)    # not test's best (0.9, round 3)
    assert s["scores"]["global_test"]["micro_f1"] == pytest.approx(0.2)


def test_an_early_stopped_run_is_read_at_its_own_best_round(tmp_path: Path) -> None:
    s = arm_scores(_write_run(tmp_path / "a", early_best=3))
    assert s["rounds"] == [3] and s["selected_by"] == "early_stopping"
    assert s["scores"]["local_test"]["micro_f1"] == pytest.approx(0.9)


def test_mean_of_the_last_rounds(tmp_path: Path) -> None:
    s = arm_scores(_write_run(tmp_path / "a"), select="last_mean", last=2)
    assert s["rounds"] == [3, 4] and s["selected_by"] == "last 2 rounds"
    assert s["scores"]["local_test"]["micro_f1"] == pytest.approx((0.9 + 0.4) / 2)
    assert arm_scores(tmp_path / "a", select="last_mean", last=10)["rounds"] == [1, 2, 3, 4]


def test_bad_selection_arguments_are_clear_errors(tmp_path: Path) -> None:
    run = _write_run(tmp_path / "a")
    with pytest.raises(ValueError, match="select must be one of best_val, last_mean"):
        arm_scores(run, select="final")
    with pytest.raises(ValueError, match="last must be a positive integer"):
        arm_scores(run, select="last_mean", last=0)
    with pytest.raises(ValueError, match=r"no 'local_train' rows with 'micro_f1'.*select='last_mean'"):
        arm_scores(run, selection_split="local_train")
    with pytest.raises(FileNotFoundError, match="no metrics.csv"):
        arm_scores(tmp_path / "missing")


def test_arm_table_mean_and_population_std_over_seeds(tmp_path: Path) -> None:
    runs = {"a": [_write_run(tmp_path / "s0"), _write_run(tmp_path / "s1", shift=0.1)]}
    t = arm_table(runs)
    row = t.iloc[0]
    assert row["arm"] == "a" and row["seeds"] == 2 and row["rounds"] == "2;2"
    assert row["local_test/micro_f1"] == pytest.approx(0.55)
    assert row["local_test/micro_f1 std"] == pytest.approx(0.05)
    assert row["local_test/micro_f1 values"] == "0.5000;0.6000"
    assert np.isnan(row["global_test/auc"])   # a metric the runs do not have


@pytest.mark.plots
def test_write_arm_report_writes_table_curves_and_plot(tmp_path: Path) -> None:
    runs = {"a": [_write_run(tmp_path / "s0")], "b": [_write_run(tmp_path / "t0", shift=0.05)]}
    table = write_arm_report(tmp_path / "out", runs, title="test")
    assert list(table["arm"]) == ["a", "b"]
    md = (tmp_path / "out" / "arms_table.md").read_text()
    assert "best validation round" in md and "| a | 1 | 2 | 0.200 ± 0.000 |" in md
    curves = pd.read_csv(tmp_path / "out" / "arms_curves.csv")
    assert len(curves) == 2 * 4 * 3 and set(curves["arm"]) == {"a", "b"}
    assert (tmp_path / "out" / "arms_curves.png").stat().st_size > 0
