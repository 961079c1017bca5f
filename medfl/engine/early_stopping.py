"""Early stopping and best-round selection (``fl.early_stopping``), the same for every method.

After each evaluated round (``eval_every``, and always the last) the run reads one number
from its evaluation: the mean, over the clients that reported it, of ``<metric>`` on
``<split>`` (``val/micro_f1``: the ``micro_f1`` column of the round's ``local_val`` rows of
``metrics.csv``; NaN skipped). A round whose value beats the best so far by more than
``min_delta`` becomes the best round and the wait starts again; any other evaluated round
adds one to the wait; a round where no client reported the metric is no evidence and changes
nothing. Once the wait reaches ``patience`` evaluated rounds (and at least ``min_rounds``
rounds ran), the run stops after that round and finishes as a run that reached its last round
does, with the best round's models (:class:`medfl.engine.runner.Run` keeps that round's
checkpoint and the client states it records, restores its coordinator state before
``finalize``, and reports the best round's metrics as the final ones).

Only rounds the method's own mechanism shaped can be the best round: after every round the run
asks the coordinator :meth:`medfl.method.Method.scored_from` (FedFed: the first round trained
with the shared set; default 1, every round). An evaluated round before it is recorded in the
curve but is neither the best round nor counts toward ``patience``; while the answer is
``None`` (still in a first stage) no round is. The best round over every evaluated round, when
it differs, is kept beside it (``overall_best_round``), so a reader sees what the restriction
changed.

:class:`EarlyStopping` is the bookkeeping: its state travels in every checkpoint's
``engine`` block, so a resumed run decides exactly as an uninterrupted one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from medfl.config import TEST_SPLITS

__all__ = ["EarlyStopping", "metrics_split"]


def metrics_split(split: str) -> str:
    """The ``split`` value of ``metrics.csv`` rows for a split of ``fl.eval_splits``
    (``val`` -> ``local_val``; ``global_test`` and ``cross_test`` keep their names)."""
    return split if split in ("global_test", "cross_test") else "local_" + split


@dataclass
class EarlyStopping:
    """The state of a run's early stopping (``fl.early_stopping``, resolved by
    :func:`medfl.config.check_early_stopping`).

    Attributes:
        metric: ``"<split>/<metric>"``, e.g. ``"val/micro_f1"``.
        patience: evaluated rounds without improvement after which the run stops.
        min_delta: an improvement beats the best value by more than this.
        mode: ``"max"`` (higher is better) or ``"min"``.
        min_rounds: the run never stops before this round.
        curve: one entry per evaluated round: ``round``, ``value`` (``None``: no client
            reported the metric), ``best_round``, ``wait`` and ``scored_from`` after that round.
        best_round: the best round so far among the rounds from ``scored_from`` on
            (``None`` before any evidence there).
        best_value: its value.
        wait: evaluated rounds with evidence since the best round (from ``scored_from`` on).
        stopped_at: the round after which the run stopped early (``None``: it did not).
        scored_from: the first round the method's mechanism shaped, as the method said after
            the last observed round (``None``: not yet; :meth:`medfl.method.Method.scored_from`).
        overall_best_round: the best round over every evaluated round, ``scored_from`` or not.
        overall_best_value: its value.
    """

    metric: str
    patience: int
    min_delta: float = 0.0
    mode: str = "max"
    min_rounds: int = 0
    curve: list[dict[str, Any]] = field(default_factory=list)
    best_round: int | None = None
    best_value: float | None = None
    wait: int = 0
    stopped_at: int | None = None
    scored_from: int | None = 1
    overall_best_round: int | None = None
    overall_best_value: float | None = None

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> "EarlyStopping | None":
        """The early stopping of a resolved ``fl`` config (``None`` when it is off)."""
        spec = cfg.get("early_stopping")
        if not spec:
            return None
        return cls(metric=str(spec["metric"]), patience=int(spec["patience"]), min_delta=float(spec["min_delta"]),
                   mode=str(spec.get("mode") or "max"), min_rounds=int(spec.get("min_rounds", 0)))

    @property
    def split(self) -> str:
        """The selection split as ``fl.eval_splits`` names it (``val``)."""
        return self.metric.partition("/")[0]

    @property
    def column(self) -> str:
        """The ``metrics.csv`` column the selection reads (``micro_f1``)."""
        return self.metric.partition("/")[2]

    @property
    def on_test_split(self) -> bool:
        """Whether the best round is selected on test data (test-set leakage)."""
        return self.split in TEST_SPLITS

    def value(self, rows: list[dict[str, Any]]) -> float | None:
        """The round's value: the mean of the metric over the round's evaluation ``rows``
        (``metrics.csv`` rows) of the selection split whose value is not NaN; ``None``
        when there is none."""
        name = metrics_split(self.split)
        vals = [float(x[self.column]) for x in rows if x.get("split") == name and x.get(self.column) is not None]
        vals = [v for v in vals if v == v]
        return float(np.mean(np.asarray(vals, dtype=float))) if vals else None

    def _improves(self, value: float, best: float | None) -> bool:
        if best is None:
            return True
        return value < best - self.min_delta if self.mode == "min" else value > best + self.min_delta

    def _select(self, first: int | None) -> tuple[int | None, float | None, int]:
        """The best round, its value and the wait after the curve's last entry, counting
        only evaluated rounds from ``first`` on (``None``: none counts), as an uninterrupted
        run that had known ``first`` from the start would have decided."""
        best, value, wait = None, None, 0
        if first is None:
            return best, value, wait
        for e in self.curve:
            if e["value"] is None or e["round"] < first:
                continue
            if self._improves(float(e["value"]), value):
                best, value, wait = int(e["round"]), float(e["value"]), 0
            else:
                wait += 1
        return best, value, wait

    def observe(self, round: int, rows: list[dict[str, Any]], rounds: int, scored_from: int | None = 1) -> bool:
        """Take the evaluation ``rows`` of evaluated round ``round`` of a run planned for
        ``rounds`` rounds, with the method's ``scored_from`` as said after it; return whether
        the run stops after it (it never "stops" after its planned last round: it ends there
        anyway). Rounds before ``scored_from`` are recorded, never the best, and never count
        toward ``patience``."""
        value = self.value(rows)
        self.scored_from = None if scored_from is None else int(scored_from)
        self.curve.append({"round": int(round), "value": value})
        self.best_round, self.best_value, self.wait = self._select(self.scored_from)
        self.overall_best_round, self.overall_best_value, _ = self._select(1)
        if (value is not None and self.best_round is not None and self.wait >= self.patience
                and round >= self.min_rounds and round < rounds):
            self.stopped_at = int(round)
        self.curve[-1].update({"best_round": self.best_round, "wait": self.wait, "scored_from": self.scored_from})
        return self.stopped_at is not None

    def best_at(self, round: int) -> int | None:
        """The best round as it stood after ``round`` (what that round's checkpoint records)."""
        best = None
        for entry in self.curve:
            if entry["round"] > round:
                break
            best = entry["best_round"]
        return best

    def state_dict(self) -> dict[str, Any]:
        """The state a checkpoint keeps (plain numbers, lists and dicts)."""
        return {"curve": [dict(e) for e in self.curve], "best_round": self.best_round,
                "best_value": self.best_value, "wait": self.wait, "stopped_at": self.stopped_at,
                "scored_from": self.scored_from, "overall_best_round": self.overall_best_round,
                "overall_best_value": self.overall_best_value}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (a checkpoint's)."""
        self.curve = [dict(e) for e in state.get("curve", [])]
        self.best_round = None if state.get("best_round") is None else int(state["best_round"])
        self.best_value = None if state.get("best_value") is None else float(state["best_value"])
        self.wait = int(state.get("wait", 0))
        self.stopped_at = None if state.get("stopped_at") is None else int(state["stopped_at"])
        # a checkpoint written before scored_from existed: every round counted
        self.scored_from = None if state.get("scored_from", 1) is None else int(state.get("scored_from", 1))
        overall = state.get("overall_best_round", self.best_round if "scored_from" not in state else None)
        self.overall_best_round = None if overall is None else int(overall)
        value = state.get("overall_best_value", self.best_value if "scored_from" not in state else None)
        self.overall_best_value = None if value is None else float(value)

    def describe(self) -> str:
        """The criterion in words, for messages."""
        way = "decrease" if self.mode == "min" else "improve"
        return f"{self.metric} did not {way} by more than {self.min_delta:g} for {self.patience} evaluated rounds"

    def stop_message(self, label: str) -> str:
        """The line a run prints when it stopped early."""
        best = "no evaluated round reported it" if self.best_round is None else \
            f"best round {self.best_round} ({self.best_value:.4g}){self.restriction()}"
        return f"medfl [{label}]: early stopping: {self.describe()}; {best}, stopped after round {self.stopped_at}"

    def restriction(self) -> str:
        """What choosing among the rounds from ``scored_from`` on changed, in words for the
        best round's line ("" when every round counted or the overall best is the same)."""
        if self.scored_from == 1 or self.overall_best_round in (None, self.best_round):
            return ""
        overall = f"overall best round {self.overall_best_round} ({self.overall_best_value:.4g})"
        if self.scored_from is None:
            return f"; {overall}, but the method's mechanism acted in no round"
        before = ", before the method's mechanism acts" if self.overall_best_round < self.scored_from else ""
        return f" among rounds >= {self.scored_from}; {overall}{before}"

    def leakage_warning(self, label: str) -> str:
        """The line a run prints when it selects its best round on test data."""
        return (f"medfl [{label}]: early stopping selects the best round on {self.metric}, a test split: the final "
                "metrics are then chosen on the data that reports them (test-set leakage, optimistic); select on "
                "a validation split (add \"val\" to fl.eval_splits, metric \"val/...\") for an unbiased estimate")

    def summary(self, rounds_planned: int, rounds_run: int, checkpoint: str | None) -> dict[str, Any]:
        """The ``early_stopping`` block of ``summary.json``: the criterion, the best round and
        its value, where the run stopped (``None``: it ran every planned round), the rounds
        planned and run, the best round's checkpoint, the value of every evaluated round, the
        first round the best round was chosen from (``scored_from``: the method's
        :meth:`~medfl.method.Method.scored_from`, ``None``: its mechanism acted in no round)
        and the best round over every evaluated round (``overall_best_round``/``_value``)."""
        return {"metric": self.metric, "mode": self.mode, "patience": self.patience, "min_delta": self.min_delta,
                "min_rounds": self.min_rounds, "best_round": self.best_round, "best_value": self.best_value,
                "stopped_at_round": self.stopped_at, "rounds_planned": int(rounds_planned),
                "rounds_run": int(rounds_run), "best_checkpoint": checkpoint,
                "selected_on_test_split": self.on_test_split, "scored_from": self.scored_from,
                "overall_best_round": self.overall_best_round, "overall_best_value": self.overall_best_value,
                "values": [{"round": e["round"], "value": e["value"]} for e in self.curve]}
