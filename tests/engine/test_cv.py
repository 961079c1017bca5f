"""k-fold cross-validation (fl.cv) and the sex fairness gap (eq. 16 of the FedSKD paper)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from medfl.config import ConfigError
from medfl.data.source import DataError
from medfl.engine.data import cv_folds, sample_attributes, split_data
from medfl.engine.runner import build_source
from medfl.experiment import resume, run_experiment
from medfl.metrics.classification import roc_auc
from medfl.metrics.fairness import fairness_report, subgroup_scores
from medfl.report_repeats import cv_summary, cv_table


def _manifest(tmp_path: Path, n_subjects: int = 60, images_per_subject: int = 2) -> Path:
    """A manifest of tiny .npy images: two per subject, a label per subject, sex M/F/blank."""
    rng = np.random.default_rng(0)
    (tmp_path / "arrays").mkdir()
    rows = []
    for s in range(n_subjects):
        label = s % 2
        sex = ["M", "F", "M", ""][(s // 3) % 4]   # independent of the site (s % 3)
        for k in range(images_per_subject):
            x = rng.normal(size=(1, 8, 8)).astype(np.float32) + label
            rel = f"arrays/s{s}_{k}.npy"
            np.save(tmp_path / rel, x)
            rows.append({"sample_id": f"s{s}_{k}", "path": rel, "label": label, "subject_id": f"sub{s}",
                         "sex": sex, "site": f"site{s % 3}", "fold": s % 5})
    path = tmp_path / "manifest.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    return path


@pytest.fixture
def cv_fl(tmp_path: Path) -> dict:
    manifest = _manifest(tmp_path)
    return {
        "name": "cv", "output_dir": str(tmp_path / "runs"), "seed": 0, "rounds": 2, "num_clients": 3,
        "progress": False, "dataset": {"name": "manifest", "path": str(manifest), "num_classes": 2},
        "partition": {"name": "natural", "column": "site"}, "global_test_fraction": 0.0,
        "client_split": {"train": 0.6, "val": 0.2, "test": 0.2},
        "cv": {"folds": 3}, "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8, "lr": 0.05},
        "eval_splits": ["test", "cross_test"], "methods": [{"name": "fedavg"}, {"name": "local"}],
    }


# ---------------------------------------------------------------- folds
def test_drawn_folds_are_grouped_stratified_and_complete() -> None:
    labels = np.repeat(np.arange(40) % 2, 3)
    groups = np.repeat(np.arange(40), 3).astype(str)
    which = cv_folds(labels, groups, 4, seed=1)
    assert set(which) == {0, 1, 2, 3}
    for g in np.unique(groups):                      # one subject, one fold
        assert len(set(which[groups == g])) == 1
    for k in range(4):                               # 10 subjects per fold, 5 of each class
        assert (which == k).sum() == 30 and labels[which == k].sum() == 15
    assert (cv_folds(labels, groups, 4, seed=1) == which).all()
    assert not (cv_folds(labels, groups, 4, seed=2) == which).all()


def test_fold_column_is_used_and_dealt_round_robin() -> None:
    col = np.array([3, 0, 1, 2, 4, 0, 3])
    assert cv_folds(np.zeros(7), np.arange(7), 5, 0, col).tolist() == [3, 0, 1, 2, 4, 0, 3]
    # five fold values into two folds: ranks 0,2,4 -> fold 0; ranks 1,3 -> fold 1
    assert cv_folds(np.zeros(7), np.arange(7), 2, 0, col).tolist() == [1, 0, 1, 0, 0, 0, 1]
    with pytest.raises(DataError, match="2 distinct value"):
        cv_folds(np.zeros(4), np.arange(4), 3, 0, np.array([0, 1, 0, 1]))
    with pytest.raises(DataError, match="blank"):
        cv_folds(np.zeros(3), np.arange(3), 2, 0, np.array([0, None, 1], dtype=object))


def test_split_data_folds_partition_the_client_data(cv_fl, resolve) -> None:
    cfg = resolve(cv_fl)
    source = build_source(cfg["dataset"])
    folds = [split_data(source, cfg, fold=k).assignments for k in range(3)]
    base = folds[0]
    for a in folds:
        # the same partition every fold: each row belongs to the same client
        assert dict(zip(a["row"], a["client_id"])) == dict(zip(base["row"], base["client_id"]))
        assert set(a["role"]) == {"train", "val", "test"}        # no global hold-out (fraction 0)
        subj = source.table["subject_id"].to_numpy()[a["row"].to_numpy()]
        assert (pd.Series(a["role"].to_numpy()).groupby(subj).nunique() == 1).all()   # subjects never straddle
    for cid in base["client_id"].unique():
        tests = [set(a.loc[(a["client_id"] == cid) & (a["role"] == "test"), "row"]) for a in folds]
        assert all(tests) and not (tests[0] & tests[1]) and not (tests[1] & tests[2]) and not (tests[0] & tests[2])
        assert set().union(*tests) == set(base.loc[base["client_id"] == cid, "row"])
    a = folds[1]
    n_train, n_val = (a["role"] == "train").sum(), (a["role"] == "val").sum()
    assert 0.15 < n_val / (n_train + n_val) < 0.35                    # train:val = 0.6:0.2
    no_val = split_data(source, resolve({**cv_fl, "client_split": {"train": 0.8, "val": 0.0, "test": 0.2}}), fold=0)
    assert set(no_val.assignments["role"]) == {"train", "test"}
    by_col = split_data(source, resolve({**cv_fl, "cv": {"folds": 5, "column": "fold"}}), fold=2).assignments
    test_rows = by_col.loc[by_col["role"] == "test", "row"]
    assert (source.table["fold"].to_numpy()[test_rows.to_numpy()] == 2).all() and len(test_rows) == 24
    with pytest.raises(DataError, match="fold 3 asked for"):
        split_data(source, cfg, fold=3)
    with pytest.raises(DataError, match="'nope' is not a column"):
        split_data(source, resolve({**cv_fl, "cv": {"folds": 3, "column": "nope"}}), fold=0)


@pytest.mark.parametrize("cv, message", [
    ({"folds": 1}, "at least 2"), ({"folds": 3, "metric": "kappa"}, "unknown metric 'kappa'"),
    ({"folds": 3, "colum": "fold"}, "unknown key"), ({"folds": 3, "column": 3}, "column name"),
])
def test_cv_config_errors(cv_fl, resolve, cv, message) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve({**cv_fl, "cv": cv})
    with pytest.raises(ConfigError, match="no 'test'"):
        resolve({**cv_fl, "client_split": {"train": 0.8, "val": 0.2}, "eval_splits": ["val"]})


# ---------------------------------------------------------------- fairness
def test_subgroup_scores_by_hand() -> None:
    y = np.array([0, 1, 0, 1, 1, 0, 1])
    p1 = np.array([0.1, 0.9, 0.8, 0.3, 0.6, 0.2, 0.7])
    probs = np.stack([1 - p1, p1], axis=1)
    sex = np.array(["M", "M", "M", "M", "F", "F", ""], dtype=object)
    s = subgroup_scores(y, probs, {"sex": sex})
    # male: positives {0.9, 0.3}, negatives {0.1, 0.8}: pairs won 0.9>0.1, 0.9>0.8, 0.3>0.1 -> 3/4
    assert s["auc_M"] == pytest.approx(0.75) and s["n_M"] == 4
    assert s["auc_F"] == pytest.approx(1.0) and s["n_F"] == 2
    assert s["auc_M"] == pytest.approx(roc_auc(y[:4], probs[:4]))
    assert np.isnan(subgroup_scores(y[:4], probs[:4], {"sex": sex[:4]})["auc_F"])
    assert subgroup_scores(y, probs, None) == {} and subgroup_scores(y, probs, {"sex": sex[:3]}) == {}
    codes = sample_attributes(pd.DataFrame({"sex": ["male", "F", None, "2", " m "]}))["sex"]
    assert codes.tolist() == ["M", "F", "", "F", "M"]


def test_fairness_report_is_eq16() -> None:
    rows = [  # round 1 is ignored: the report reads the last round
        {"round": 1, "client_id": "0", "split": "local_test", "auc_M": 0.0, "auc_F": 0.0},
        {"round": 2, "client_id": "0", "split": "local_test", "auc_M": 0.8, "auc_F": 0.6, "n_M": 5, "n_F": 4},
        {"round": 2, "client_id": "1", "split": "local_test", "auc_M": 0.6, "auc_F": np.nan, "n_M": 3, "n_F": 0},
        {"round": 2, "client_id": "2", "split": "local_test", "auc_M": 0.7, "auc_F": 0.9, "n_M": 2, "n_F": 6},
        {"round": 2, "client_id": "0", "split": "cross_test", "auc_M": 0.0, "auc_F": 1.0},
    ]
    f = fairness_report(pd.DataFrame(rows))
    assert f["auc_M"] == pytest.approx(0.7) and f["auc_F"] == pytest.approx(0.75)
    assert f["delta_auc"] == pytest.approx(0.05) and f["avg"] == pytest.approx(0.725)
    assert f["clients_M"] == 3 and f["clients_F"] == 2 and f["round"] == 2
    assert fairness_report(pd.DataFrame([{"round": 1, "split": "local_test", "auc": 0.5}])) == {}


# ---------------------------------------------------------------- report
def test_cv_summary_and_table_by_hand() -> None:
    rows = []
    values = {("a", 0): [0.6, 0.8], ("a", 1): [0.7, np.nan], ("b", 0): [0.5, 0.5], ("b", 1): [0.9, 0.7]}
    for (method, fold), (v0, v1) in values.items():
        for cid, v in (("0", v0), ("1", v1)):
            rows.append({"fold": fold, "method": method, "client_id": cid, "client_name": f"site{cid}",
                         "split": "local_test", "auc": v})
    s = cv_summary(pd.DataFrame(rows), ["a", "b"], 2)
    a = s["methods"]["a"]["local_test"]
    assert a["clients"]["0"]["mean"] == pytest.approx(0.65) and a["clients"]["0"]["std"] == pytest.approx(0.05)
    assert a["clients"]["1"]["mean"] == pytest.approx(0.8) and a["clients"]["1"]["std"] == 0  # NaN fold skipped
    # overall: per fold the mean over clients (0.7, 0.7), then over folds
    assert a["overall"]["mean"] == pytest.approx(0.7) and a["overall"]["std"] == pytest.approx(0.0)
    b = s["methods"]["b"]["local_test"]["overall"]
    assert b["folds"] == [pytest.approx(0.5), pytest.approx(0.8)] and b["std"] == pytest.approx(0.15)
    assert a["overall"]["clients"] == {"with_value": [2, 1], "evaluated": [2, 2]}
    table = cv_table(s)
    assert list(table.columns) == ["method", "Local Test: site0", "Local Test: site1", "Local Test: Mean",
                                   "Local Test: support"]
    assert table.loc[1, "Local Test: Mean"] == "0.650 ± 0.150"
    # every mean says how many clients and folds stand behind it; a client missing a fold says so
    assert table.loc[1, "Local Test: support"] == "2 of 2 clients, 2 folds"
    assert table.loc[0, "Local Test: support"] == "1-2 of 2 clients (by fold: 2, 1), 2 folds"
    assert table.loc[0, "Local Test: site1"] == "0.800 ± 0.000 (1 of 2 folds)"


# ---------------------------------------------------------------- end to end
def test_cross_validated_experiment_and_resume(cv_fl, resolve) -> None:
    full = run_experiment(resolve(cv_fl))
    exp = Path(full["dir"])
    for k in range(3):
        for label in ("fedavg", "local"):
            summary = json.loads((exp / f"fold_{k}" / label / "summary.json").read_text())
            assert {"local_test", "cross_test"} <= set(summary["final"])
            assert set(summary["fairness"]) >= {"auc_M", "auc_F", "delta_auc", "per_client"}
        m = pd.read_csv(exp / f"fold_{k}" / "fedavg" / "metrics.csv")
        local = m[m["split"] == "local_test"]
        assert {"auc_M", "auc_F", "n_M", "n_F"} <= set(m.columns)
        assert ((local["n_M"] + local["n_F"]) <= local["n"]).all()      # blank sex counts in neither
        assert local["n_M"].sum() > 0 and local["n_F"].sum() > 0
        assert local.loc[local["n_F"] == 0, "auc_F"].isna().all()      # no female sample: no AUC
        assert (exp / f"fold_{k}" / "comparison.csv").is_file()
    results = pd.read_csv(exp / "cv_results.csv")
    assert sorted(results["fold"].unique()) == [0, 1, 2] and set(results["round"]) == {2}
    summary = json.loads((exp / "cv_summary.json").read_text())
    table = pd.read_csv(exp / "cv_table.csv")
    assert table["method"].tolist() == ["fedavg", "local"]
    assert {"Local Test: Mean", "Global Test: Mean", "Fairness: ΔAUC"} <= set(table.columns)
    overall = summary["methods"]["local"]["local_test"]["overall"]
    by_fold = results[(results["method"] == "local") & (results["split"] == "local_test")].groupby("fold")["auc"].mean()
    assert overall["mean"] == pytest.approx(by_fold.mean()) and overall["std"] == pytest.approx(by_fold.std(ddof=0))
    assert (exp / "cv_table.md").read_text().count("±") >= 8 and not (exp / "cv_auc.png").exists()
    # the run drew no figure (MEDFL_NO_PLOTS); `medfl report` draws them from the saved results
    from medfl.cli import main as cli

    table_md = (exp / "cv_table.md").read_text()
    assert cli(["report", str(exp)]) == 0
    assert (exp / "cv_auc.png").read_bytes()[:4] == b"\x89PNG" and (exp / "cv_table.md").read_text() == table_md
    assert all((exp / f"fold_{k}" / "comparison.png").is_file() for k in range(3))

    # stopped after round 1 in every fold; resume finishes every fold and writes the same report
    part = run_experiment(resolve({**cv_fl, "name": "part", "stop_after_round": 1}))
    assert part["cv"] is None and not (Path(part["dir"]) / "cv_table.csv").exists()
    resumed = resume(part["dir"])
    assert resumed["cv"] is not None
    pd.testing.assert_frame_equal(pd.read_csv(Path(part["dir"]) / "cv_results.csv"), results)


def test_a_fold_killed_before_its_config_was_written_is_rebuilt_on_resume(cv_fl, resolve) -> None:
    """Killed right after fold_2/partition.csv (issue 19: fold_2/config.json then stayed
    missing for good): a resume writes it and runs the fold."""
    import shutil

    part = run_experiment(resolve({**cv_fl, "name": "kill", "stop_after_round": 1}))
    fold = Path(part["dir"]) / "fold_2"
    (fold / "config.json").unlink()
    for label in ("fedavg", "local"):
        shutil.rmtree(fold / label)
    resumed = resume(part["dir"])
    assert resumed["cv"] is not None and json.loads((fold / "config.json").read_text())["fold"] == 2
    assert json.loads((fold / "fedavg" / "summary.json").read_text())["rounds"] == 2
