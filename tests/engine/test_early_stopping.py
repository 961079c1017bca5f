"""Early stopping and best-round selection (``fl.early_stopping``), in process.

A run stops where the patience rule, computed here again from ``metrics.csv``, says; its
final metrics are the best round's rows, its coordinator ends in the best round's state
(what ``finalize`` and the method's report see), ``medfl predict`` uses the best round's
models, and a stopped, interrupted or finished run resumes to the uninterrupted result.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd
import pytest
import torch

from medfl import hookimpl
from medfl.config import ConfigError
from medfl.engine.early_stopping import EarlyStopping
from medfl.engine.evaluation import evaluate_metrics
from medfl.experiment import resume, run_experiment
from medfl.predict import predict
from medfl.plugins import get_plugin_manager
from medfl.report import summary_table
from medfl.report_repeats import cv_results
from medfl_plugins.baselines import FedBN

from contract_methods import methods_registered

#: the selection: mean val micro-F1 over clients, two evaluated rounds of patience
EARLY = {"metric": "val/micro_f1", "patience": 2}
METHOD = "test_best_round_probe"


class BestRoundProbe(FedBN):
    """FedBN whose coordinator state also counts the rounds it aggregated, and which records
    the state ``finalize`` starts from (class attribute ``seen``)."""

    name = METHOD
    seen: dict[str, Any] = {}

    def setup(self, federation: Any) -> None:
        super().setup(federation)
        self.trained = 0

    def server_update(self, round: int, replies: Any) -> None:
        super().server_update(round, replies)
        self.trained = round

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "trained": self.trained}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.trained = int(state["trained"])

    def finalize(self) -> None:
        BestRoundProbe.seen = {"trained": self.trained, "global": {k: v.clone() for k, v in self.global_state.items()}}

    def report(self) -> dict[str, Any]:
        return {"trained": self.trained}


@pytest.fixture(autouse=True)
def _probe() -> Iterator[None]:
    BestRoundProbe.seen = {}
    with methods_registered(BestRoundProbe, name="early-stopping-test"):
        yield


def _fl(tiny_fl: dict[str, Any], name: str, **extra: Any) -> dict[str, Any]:
    """The tiny job for 10 rounds with a validation split evaluated and early stopping on."""
    return {**tiny_fl, "name": name, "rounds": 10, "eval_splits": ["val", "test", "global_test"],
            "early_stopping": dict(EARLY), "methods": [{"name": METHOD}], **extra}


def _expected(metrics: pd.DataFrame, patience: int, rounds: int) -> tuple[int, int | None, list[float]]:
    """The patience rule applied to ``metrics.csv`` on its own: (best round, stop round or
    None, the value of every evaluated round)."""
    val = {int(r): float(np.mean(g["micro_f1"].dropna().to_numpy()))
           for r, g in metrics[metrics["split"] == "local_val"].groupby("round")}
    best, best_value, wait = None, -math.inf, 0
    for r, v in val.items():
        if v > best_value:
            best, best_value, wait = r, v, 0
        else:
            wait += 1
        if wait >= patience and r < rounds:
            return best, r, list(val.values())
    return best, None, list(val.values())


def _summary(run_dir: Path) -> dict[str, Any]:
    s = json.loads((run_dir / "summary.json").read_text())
    s.pop("wall_time_s_last_session")
    return s


# ------------------------------------------------------------------ the rule
BAD = [
    ({"metrik": "val/auc"}, r"fl.early_stopping: unknown key\(s\) 'metrik'; valid keys: metric, min_delta"),
    ({"metric": "val_auc"}, r"fl.early_stopping.metric: expected \"<split>/<metric>\""),
    ({"metric": "val/auc"}, r"fl.early_stopping.metric: 'val/auc' selects on split 'val', which the run does "
                            r"not evaluate; add 'val' to fl.eval_splits"),
    ({"metric": "test/auroc"}, r"fl.early_stopping.metric: unknown metric 'auroc'.*valid: accuracy, auc"),
    ({"metric": "test/auc", "patience": 0}, r"fl.early_stopping.patience: expected an integer >= 1, got 0"),
    ({"metric": "test/auc", "patience": 2.5}, r"fl.early_stopping.patience: expected an integer >= 1"),
    ({"metric": "test/auc", "min_delta": -0.1}, r"fl.early_stopping.min_delta: expected a finite number >= 0"),
    ({"metric": "test/auc", "min_delta": "0"}, r"fl.early_stopping.min_delta: expected a finite number >= 0"),
    ({"metric": "test/auc", "mode": "up"}, r"fl.early_stopping.mode: expected \"max\".*\"min\" or null"),
    ({"metric": "test/auc", "min_rounds": -1}, r"fl.early_stopping.min_rounds: expected an integer >= 0"),
    (5, r"fl.early_stopping: expected null or a dict like \{\"metric\": \"val/micro_f1\""),
]


@pytest.mark.parametrize("value,match", BAD)
def test_bad_settings_are_refused_naming_the_key(tiny_fl, resolve, value, match):
    with pytest.raises(ConfigError, match=match):
        resolve({**tiny_fl, "early_stopping": value})


def test_settings_are_filled_in_and_off_by_default(tiny_fl, resolve):
    assert resolve(tiny_fl)["early_stopping"] is None
    cfg = resolve({**tiny_fl, "eval_splits": ["val", "test"], "early_stopping": {"patience": 3}})
    assert cfg["early_stopping"] == {"metric": "val/micro_f1", "patience": 3, "min_delta": 0.0, "mode": "max",
                                     "min_rounds": 0}
    # a lower-is-better metric selects the lowest value unless told otherwise
    low = resolve({**tiny_fl, "early_stopping": {"metric": "test/neg_flip_rate"}})["early_stopping"]
    assert low["mode"] == "min"
    assert resolve(cfg)["early_stopping"] == cfg["early_stopping"]   # resolving again changes nothing
    with pytest.raises(ConfigError, match="fl.early_stopping: decides on rounds evaluated along the way, but "
                                          "fl.eval_every is 0"):
        resolve({**tiny_fl, "eval_every": 0, "early_stopping": {"metric": "test/auc"}})


def _rows(value: float | None, n: int = 2) -> list[dict[str, Any]]:
    """The evaluation rows of one round whose clients all report ``value`` on local_val."""
    v = float("nan") if value is None else value
    return [{"split": "local_val", "micro_f1": v} for _ in range(n)] + [{"split": "local_test", "micro_f1": 1.0}]


def test_the_rule_counts_evaluated_rounds_with_evidence():
    es = EarlyStopping("val/micro_f1", patience=2, min_delta=0.05)
    steps = [(2, 0.4), (4, 0.5), (6, 0.54), (8, None), (10, 0.3)]   # evaluated every 2 rounds
    stops = [es.observe(r, _rows(v), rounds=20) for r, v in steps]
    assert stops == [False, False, False, False, True]
    # 0.54 is not more than min_delta better than 0.5; round 8 (nobody reported) is no evidence
    assert (es.best_round, es.best_value, es.wait, es.stopped_at) == (4, 0.5, 2, 10)
    assert [e["value"] for e in es.curve] == [0.4, 0.5, 0.54, None, 0.3]
    assert [es.best_at(r) for r in (1, 2, 5, 10)] == [None, 2, 4, 4]
    # NaN-aware: the mean over the clients that reported a number
    assert es.value([{"split": "local_val", "micro_f1": 0.2}, {"split": "local_val", "micro_f1": float("nan")},
                     {"split": "local_val", "micro_f1": 0.4}]) == pytest.approx(0.3)
    # min_rounds holds the stop back; the planned last round is never an "early" stop
    late = EarlyStopping("val/micro_f1", patience=1, min_rounds=3)
    assert [late.observe(r, _rows(0.5), rounds=4) for r in (1, 2, 3)] == [False, False, True]
    last = EarlyStopping("val/micro_f1", patience=1)
    assert [last.observe(r, _rows(0.5), rounds=2) for r in (1, 2)] == [False, False]
    # mode min, and the state survives a checkpoint
    low = EarlyStopping("val/neg_flip_rate", patience=1, mode="min")
    low.observe(1, [{"split": "local_val", "neg_flip_rate": 0.3}], rounds=5)
    low.observe(2, [{"split": "local_val", "neg_flip_rate": 0.1}], rounds=5)
    again = EarlyStopping("val/neg_flip_rate", patience=1, mode="min")
    again.load_state_dict(low.state_dict())
    assert again == low and again.best_round == 2


# ------------------------------------------------------------------ a run that stops early
def test_run_stops_where_patience_says_with_the_best_rounds_models(tiny_fl, resolve, capsys):
    out = run_experiment(resolve(_fl(tiny_fl, "es")))
    run_dir = Path(out["dir"]) / METHOD
    metrics = pd.read_csv(run_dir / "metrics.csv", dtype={"client_id": str})
    best, stop, values = _expected(metrics, EARLY["patience"], 10)
    assert stop is not None and best != stop, "the job must stop early, after a best round it did not beat"
    assert int(metrics["round"].max()) == stop          # no round after the stop ran
    s = _summary(run_dir)
    es = s["early_stopping"]
    assert (es["best_round"], es["stopped_at_round"], es["rounds_planned"], es["rounds_run"]) == (best, stop, 10, stop)
    assert s["rounds"] == stop and es["best_checkpoint"] == f"checkpoints/round_{best:04d}.pt"
    assert [v["value"] for v in es["values"]] == values and es["best_value"] == max(values)
    assert es["selected_on_test_split"] is False
    # the final block is the best round's rows of metrics.csv, exactly; the last round's is kept too
    assert s["final"]["round"] == best and s["last_round"]["round"] == stop
    rows = metrics[metrics["round"] == best]
    for split, block in s["final"].items():
        if split == "round":
            continue
        part = rows[rows["split"] == split]
        for m in ("accuracy", "micro_f1", "auc", "neg_flip_rate"):
            col = part[m].astype(float).dropna()
            got = block[m]
            assert got["mean"] == col.mean() or (math.isnan(got["mean"]) and col.empty), (split, m)
            if len(col):
                assert (got["std"], got["best"]) == (col.std(ddof=0), col.max() if m != "neg_flip_rate" else col.min())
    table = summary_table(run_dir).set_index(["split", "metric"])["mean"]   # `medfl report` agrees
    assert table[("local_test", "accuracy")] == s["final"]["local_test"]["accuracy"]["mean"]
    fold = run_dir.parent / "cv" / "fold_0" / METHOD   # and so do cross-validation's tables
    fold.mkdir(parents=True)
    for f in ("metrics.csv", "summary.json"):
        shutil.copy(run_dir / f, fold / f)
    assert set(cv_results(fold.parent.parent, [METHOD], 1)["round"]) == {best}
    # finalize and the method's report saw the best round's coordinator state
    ckpt = torch.load(run_dir / es["best_checkpoint"], weights_only=True)
    assert BestRoundProbe.seen["trained"] == best and s["method_report"] == {"trained": best}
    assert all(torch.equal(v, ckpt["method"]["global"][k]) for k, v in BestRoundProbe.seen["global"].items())
    # the best round's checkpoint and client states are kept beside the last ones
    kept = sorted(p.name for p in (run_dir / "checkpoints").glob("round_*.pt"))
    assert kept == [f"round_{r:04d}.pt" for r in sorted({best, stop - 1, stop})]
    for cid, (r, _) in ckpt["client_states"].items():
        assert (run_dir / "clients" / cid / f"state_r{int(r):04d}.pt").is_file()
    status = json.loads((run_dir / "status.json").read_text())
    assert (status["status"], status["last_round"]) == ("finished", stop)
    err = capsys.readouterr().err
    assert (f"medfl [{METHOD}]: early stopping: val/micro_f1 did not improve by more than 0 for 2 evaluated rounds; "
            f"best round {best} ({max(values):.4g}), stopped after round {stop}") in err
    assert "test split" not in err
    # comparison.csv of the experiment holds the best round's means
    comparison = pd.read_csv(Path(out["dir"]) / "comparison.csv")
    local = comparison[comparison["split"] == "local_test"].iloc[0]
    assert local["accuracy_mean"] == s["final"]["local_test"]["accuracy"]["mean"]

    # `medfl predict` uses the best round's models: each client's predictions score exactly
    # what the best round's evaluation wrote, not what the last round's did
    pred = pd.read_csv(predict(run_dir, split="global_test", output=run_dir.parent / "pred.csv"),
                       dtype={"client_id": str})
    differs = False
    for cid, part in pred.groupby("client_id"):
        scored = evaluate_metrics(part["label"].to_numpy(), part[[c for c in part if c.startswith("prob_")]].to_numpy())
        at = {r: metrics[(metrics["round"] == r) & (metrics["client_id"] == cid) & (metrics["split"] == "global_test")]
              .iloc[0] for r in (best, stop)}
        for m in ("accuracy", "auc", "micro_f1"):
            assert scored[m] == pytest.approx(float(at[best][m]), abs=1e-12), (cid, m)
        differs |= any(not np.isclose(scored[m], float(at[stop][m])) for m in ("accuracy", "auc"))
    assert differs, "the best and the last round's models must score differently for this test to tell them apart"


def test_stopped_interrupted_and_finished_runs_resume_to_the_uninterrupted_result(tiny_fl, resolve, capsys):
    full = Path(run_experiment(resolve(_fl(tiny_fl, "full")))["dir"]) / METHOD
    best, stop = (_summary(full)["early_stopping"][k] for k in ("best_round", "stopped_at_round"))
    files = ("metrics.csv", "train_metrics.csv", "communication.csv", "forgetting.csv")
    # stopped before the best round, and between the best round and the stop
    for when in (best - 1, stop - 1):
        part = run_experiment(resolve(_fl(tiny_fl, f"part{when}", stop_after_round=when)))
        assert part["summaries"][METHOD] == {}
        resumed = resume(part["dir"])["summaries"][METHOD]
        run_dir = Path(part["dir"]) / METHOD
        assert _summary(run_dir) == _summary(full) and resumed["early_stopping"] == _summary(full)["early_stopping"]
        for f in files:
            assert (run_dir / f).read_text() == (full / f).read_text(), (when, f)
        assert BestRoundProbe.seen["trained"] == best

    # interrupted after the checkpoint of the stop round, before the run finished
    class Interrupt:
        @hookimpl
        def on_round_end(self, run: Any, round: int, metrics: Any) -> None:
            if round == stop:
                raise KeyboardInterrupt

    pm = get_plugin_manager()
    pm.register(Interrupt(), name="interrupt-at-stop")
    try:
        with pytest.raises(KeyboardInterrupt):
            run_experiment(resolve(_fl(tiny_fl, "killed")))
    finally:
        pm.unregister(name="interrupt-at-stop")
    killed = Path(tiny_fl["output_dir"]) / "killed" / METHOD
    assert not (killed / "summary.json").is_file()
    assert json.loads((killed / "status.json").read_text())["status"] == "interrupted"
    resume(killed.parent)
    assert _summary(killed) == _summary(full)
    assert (killed / "metrics.csv").read_text() == (full / "metrics.csv").read_text()

    # a finished run stays finished: resuming returns its summary; --rounds does not extend it
    capsys.readouterr()
    again = resume(full.parent, rounds=20)["summaries"][METHOD]
    assert again == json.loads((full / "summary.json").read_text())
    assert (f"early stopping ended this run after round {stop} (best round {best}): nothing left to train; "
            "--rounds 20 does not extend it") in capsys.readouterr().err
    assert json.loads((full / "config.json").read_text())["fl"]["rounds"] == 10
    assert int(pd.read_csv(full / "metrics.csv")["round"].max()) == stop


def test_selecting_on_a_test_split_is_warned_and_recorded(tiny_fl, resolve, capsys):
    fl = {**tiny_fl, "rounds": 3, "early_stopping": {"metric": "test/auc", "patience": 5}}
    run_dir = Path(run_experiment(resolve(fl))["dir"]) / "fedavg"
    err = capsys.readouterr().err
    assert err.count("early stopping selects the best round on test/auc, a test split") == 1
    es = _summary(run_dir)["early_stopping"]
    assert es["selected_on_test_split"] is True and es["stopped_at_round"] is None and es["rounds_run"] == 3
