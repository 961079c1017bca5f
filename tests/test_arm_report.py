"""Experiment arms at their best validation round or the mean of their last rounds
(medfl.arm_report), on metrics.csv files written by hand: chosen among the rounds from the
method's scored_from on, with the support of every mean, and arms that cannot be told apart
said to be so (issue 48, items 1, 2 and 8)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from medfl.arm_report import arm_scores, arm_table, final_separation, round_curves, write_arm_report
from medfl.report import print_result

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
    assert "best validation round" in md and "| a | 1 | 2 | 0.200 ± 0.000 (1 seed, 2 clients) |" in md
    curves = pd.read_csv(tmp_path / "out" / "arms_curves.csv")
    assert len(curves) == 2 * 4 * 3 and set(curves["arm"]) == {"a", "b"}
    assert (tmp_path / "out" / "arms_curves.png").stat().st_size > 0


# ------------------------------------------------------------------ scored_from (issue 48, item 1)
def _mechanisms(run: Path, answers: dict[int, float | None]) -> None:
    """An unfinished run's mechanisms.csv: the method's scored_from after each round."""
    rows = [{"round": r, "mechanism": "selection", "scope": "run", "id": "", "name": "scored_from",
             "value": float("nan") if v is None else v, "text": ""} for r, v in answers.items()]
    pd.DataFrame(rows).to_csv(run / "mechanisms.csv", index=False)


def test_the_best_round_is_chosen_from_scored_from_on_and_the_overall_best_is_flagged(tmp_path: Path) -> None:
    # local_val 0.3, 0.7, 0.7, 0.4: the overall best is round 2 (the earlier of the two 0.7)
    run = _write_run(tmp_path / "fin")
    (run / "summary.json").write_text(json.dumps({"selection": {"scored_from": 3}}))
    s = arm_scores(run)
    assert s["rounds"] == [3] and s["scored_from"] == 3 and s["overall_best"] == 2
    assert s["flag"] == "overall best 2, before the mechanism acts"
    assert s["scores"]["local_test"]["micro_f1"] == pytest.approx(0.9)
    # an unfinished run: read from mechanisms.csv (the last answer), none yet, or a method without the hook
    part = _write_run(tmp_path / "part")
    _mechanisms(part, {1: None, 2: None, 3: 3, 4: 3})
    assert arm_scores(part)["rounds"] == [3] and arm_scores(part)["overall_best"] == 2
    _mechanisms(part, {1: None, 2: None, 3: None, 4: None})
    none = arm_scores(part)
    assert none["rounds"] == [2] and none["scored_from"] is None
    assert none["flag"] == "the method's mechanism acted in no evaluated round"
    assert arm_scores(_write_run(tmp_path / "plain"))["scored_from"] == 1
    # an early-stopped run: its own best round, and the overall best it recorded
    es = _write_run(tmp_path / "es")
    (es / "summary.json").write_text(json.dumps({"early_stopping": {"best_round": 4, "overall_best_round": 2},
                                                 "selection": {"scored_from": 4}}))
    assert arm_scores(es)["rounds"] == [4] and arm_scores(es)["flag"] == "overall best 2, before the mechanism acts"
    # the table: the chosen round with its flag; the CSV keeps numbers apart
    table = write_arm_report(tmp_path / "out", {"m": [run, part]}, plots=False)
    row = table.iloc[0]
    assert (row["rounds"], row["scored_from"], row["overall_best"]) == ("3;2", "3;none", "2;")
    md = (tmp_path / "out" / "arms_table.md").read_text()
    assert ("| m | 2 | 3 (overall best 2, before the mechanism acts); 2 (the method's mechanism acted in no "
            "evaluated round) |") in md


# ------------------------------------------------------------------ support (issue 48, item 8)
def test_every_mean_says_how_many_seeds_and_reporting_clients_stand_behind_it(tmp_path: Path) -> None:
    runs = {"a": [_write_run(tmp_path / "s0"), _write_run(tmp_path / "s1", shift=0.1)]}
    t = arm_table(runs)
    row = t.iloc[0]
    # global_test accuracy: client 1 has no value (NaN), so 1 client, not 2 rows
    assert row["global_test/accuracy clients"] == "1;1" and row["global_test/accuracy seeds"] == 2
    assert row["local_test/micro_f1 clients"] == "2;2" and np.isnan(row["global_test/auc"])
    assert row["global_test/auc seeds"] == 0
    last = arm_table(runs, select="last_mean", last=2).iloc[0]
    assert last["local_test/micro_f1 clients"] == "2,2;2,2"
    write_arm_report(tmp_path / "out", runs, plots=False)
    md = (tmp_path / "out" / "arms_table.md").read_text()
    assert "0.700 ± 0.000 (2 seeds, 1 client)" in md and "0.550 ± 0.050 (2 seeds, 2 clients)" in md
    csv = pd.read_csv(tmp_path / "out" / "arms_table.csv")
    assert {"global_test/accuracy clients", "global_test/accuracy seeds"} <= set(csv.columns)


# ------------------------------------------------------------------ arms that cannot be told apart (item 2)
def _write_flat(path: Path, value: float) -> Path:
    """A run whose every client scores ``value`` on every split in every round."""
    rows = [{"round": r, "client_id": c, "client_name": f"site{c}", "reported_by": "self", "n": 10, "split": sp,
             "micro_f1": value, "accuracy": value, "auc": value}
            for r in (1, 2, 3) for c in ("0", "1") for sp in ("local_val", "local_test", "global_test")]
    path.mkdir(parents=True)
    pd.DataFrame(rows).to_csv(path / "metrics.csv", index=False)
    return path


def test_an_arm_equal_to_another_in_every_round_is_said_to_be_identical(tmp_path: Path) -> None:
    runs = {"fedavg": [_write_run(tmp_path / "a0"), _write_run(tmp_path / "a1", shift=0.1)],
            "fedtpf": [_write_run(tmp_path / "b0", shift=1e-9), _write_run(tmp_path / "b1", shift=0.1)],
            "moon": [_write_run(tmp_path / "c0", shift=0.01), _write_run(tmp_path / "c1", shift=0.1)]}
    table = write_arm_report(tmp_path / "out", runs, plots=False)
    notes = dict(zip(table["arm"], table["indistinguishable"]))
    assert notes["fedtpf"] == ("identical to fedavg in every round (4 evaluated rounds, 2 seeds; local_val, "
                               "global_test, local_test; within 1e-06)")
    assert notes["fedavg"] == "" and notes["moon"] == ""   # moon differs by 0.01 in one seed
    md = (tmp_path / "out" / "arms_table.md").read_text()
    assert "- fedtpf: identical to fedavg in every round (4 evaluated rounds, 2 seeds" in md
    assert "cannot separate" not in md


def test_every_arm_at_the_ceiling_is_said_to_separate_nothing(tmp_path: Path) -> None:
    runs = {"fedavg": [_write_flat(tmp_path / "a", 1.0)], "fedfed": [_write_flat(tmp_path / "b", 1.0)]}
    table = write_arm_report(tmp_path / "out", runs, plots=False)
    ceiling = ("every arm at 1.000 on global_test/micro_f1, global_test/accuracy, global_test/auc, "
               "local_test/micro_f1, local_test/accuracy, local_test/auc in every seed: this setting cannot separate "
               "the methods")
    assert table.set_index("arm").loc["fedavg", "indistinguishable"] == ceiling
    assert table.set_index("arm").loc["fedfed", "indistinguishable"].startswith("identical to fedavg in every round")
    assert f"- {ceiling}" in (tmp_path / "out" / "arms_table.md").read_text()
    # one arm below the ceiling: nothing said about the ceiling
    mixed = arm_table({"fedavg": [runs["fedavg"][0]], "moon": [_write_flat(tmp_path / "c", 0.999)]})
    assert mixed["indistinguishable"].tolist() == ["", ""]


def test_the_experiments_last_lines_say_which_methods_cannot_be_told_apart(tmp_path: Path, capsys) -> None:
    exp = tmp_path / "exp"
    for label, value in (("fedavg", 1.0), ("fedtpf", 1.0)):
        _write_flat(exp / label, value)
    final = {sp: {m: {"mean": 1.0, "std": 0.0} for m in ("accuracy", "micro_f1", "auc")}
             for sp in ("local_test", "global_test")}
    summaries = {label: {"final": {"round": 3, **final}} for label in ("fedavg", "fedtpf")}
    summaries["fedtpf"]["selection"] = {"scored_from": 3, "note": "best round 3 among rounds >= 3; overall best "
                                        "round 2 (1), before the method's mechanism acts"}
    lines = final_separation(exp, summaries)
    assert lines[0].startswith("fedtpf: identical to fedavg in every round (3 evaluated rounds, 1 seed")
    assert lines[1].startswith("every arm at 1.000 on global_test/accuracy") and lines[1].endswith(
        "in the reported round of every run: this setting cannot separate the methods")
    print_result({"dir": str(exp), "summaries": summaries})
    out = capsys.readouterr().out
    assert "== methods that cannot be told apart\nfedtpf: identical to fedavg in every round" in out
    assert ("selection (scored from round 3): best round 3 among rounds >= 3; overall best round 2 (1), before the "
            "method's mechanism acts") in out
    # over seeds: the runs under seed_<s>/<label>, compared seed by seed
    seeds = tmp_path / "seeds"
    _write_run(seeds / "seed_0" / "fedavg")
    _write_run(seeds / "seed_0" / "moon", shift=0.2)
    _write_run(seeds / "seed_0" / "fedfed")
    nested = {"seed_0": {label: {"final": {}} for label in ("fedavg", "moon", "fedfed")}}
    assert final_separation(seeds, nested) == [
        "fedfed: identical to fedavg in every round (4 evaluated rounds, 1 seed; local_val, global_test, local_test; "
        "within 1e-06)"]
    # a single method, or methods that differ: nothing is said
    assert final_separation(exp, {"fedavg": summaries["fedavg"]}) == []
    assert final_separation(seeds, {"seed_0": {"fedavg": {"final": {}}, "moon": {"final": {}}}}) == []
