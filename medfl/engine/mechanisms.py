"""What a run records of the method's mechanisms, round by round (a part of
:class:`medfl.engine.runner.Run`): ``mechanisms.csv`` (the engine's noise-to-signal rows of
every DP mechanism, :class:`medfl.privacy.signal.NoiseShare`, then the method's own rows,
:meth:`~medfl.method.Method.mechanisms`, and the method's ``scored_from``), the warnings of
both, and the rounds a method's scores may be read at: :meth:`Mechanisms.ask_scored_from`
asks :meth:`~medfl.method.Method.scored_from` after every round, and :meth:`Mechanisms.selection`
is the summary's ``selection`` block. :meth:`Mechanisms.judge_noise` gives, at the end of a DP
run, the verdict on its noise (:mod:`medfl.privacy.signal`: the worst-case ratio against the
run's own score and the majority-class score).
"""

from __future__ import annotations

import logging
import math
from typing import Any

import pandas as pd

from medfl.method import Method
from medfl.privacy.signal import BOUND_ONLY, DROWNED, STALE_BATCHNORM, NoiseShare, Utility, utility_of
from medfl.rundir import RunError

__all__ = ["Mechanisms"]

logger = logging.getLogger("medfl.engine.runner")


class Mechanisms:
    """The mechanism records of a :class:`~medfl.engine.runner.Run` (a mixin: it uses the
    run's ``coordinator``, ``label``, ``config``, ``early``, ``files``, ``noise_share``,
    ``warnings``, ``mechanism_log`` and ``scored_from``)."""

    coordinator: Any
    label: str
    config: dict[str, Any]
    early: Any
    files: Any
    noise_share: NoiseShare
    warnings: list[dict[str, Any]]
    mechanism_log: pd.DataFrame
    scored_from: int | None
    metrics: pd.DataFrame
    data: Any

    def ask_scored_from(self, r: int) -> int | None:
        """The method's :meth:`Method.scored_from` after round ``r``: the first round its own
        mechanism shaped (``None``: not yet), kept in :attr:`scored_from` (and every checkpoint).

        Raises:
            RunError: the answer is not ``None`` or a round >= 1, or differs from a round the
                method named before (the first round its mechanism shaped does not move).
        """
        answer = self.coordinator.scored_from(r)
        if answer is not None and (isinstance(answer, bool) or not isinstance(answer, int) or answer < 1):
            raise RunError(f"method {self.label!r}: scored_from({r}) must be None or a round >= 1, got {answer!r}")
        if self.scored_from is not None and answer != self.scored_from:
            raise RunError(f"method {self.label!r}: scored_from({r}) is {answer!r}, but the method said "
                           f"{self.scored_from} before: the first round its mechanism shaped cannot change once named")
        self.scored_from = answer
        return answer

    def _check_best_kept(self, r: int) -> None:
        """After early stopping observed round ``r``: a best round that ``scored_from`` made
        the best only now (the method named an earlier round late) must still have its
        checkpoint, or the best round's models would be lost at the end.

        Raises:
            RunError: that checkpoint was dropped already (``keep_checkpoints``).
        """
        best = self.early.best_round if self.early is not None else None
        if best is None or best >= r or best in self.files.kept_checkpoints():
            return
        raise RunError(f"method {self.label!r}: scored_from named round {self.scored_from} only after round {r}, "
                       f"and early stopping's best round among the rounds from it on, {best}, has no checkpoint "
                       f"left (fl.keep_checkpoints {self.config['keep_checkpoints']}): a method names that round "
                       "at the latest after the round itself, or the run keeps more checkpoints")

    def _selection_row(self) -> list[dict[str, Any]]:
        """The ``mechanisms.csv`` row of a method that declares :meth:`Method.scored_from`
        (mechanism ``selection``, scope ``run``, name ``scored_from``; empty value: not yet),
        so a reader of an unfinished run knows the rounds it may be scored at."""
        if type(self.coordinator).scored_from is Method.scored_from:
            return []
        return [{"mechanism": "selection", "scope": "run", "id": "", "scored_from": self.scored_from}]

    def selection(self, best: int | None, rounds: int) -> dict[str, Any]:
        """The summary's ``selection`` block: the first round the method's mechanism shaped
        (``scored_from``, ``None``: none), whether the method declares it, the round its final
        metrics come from (``reported_round``: early stopping's best round among the rounds
        from ``scored_from`` on, else the last round) and, with early stopping, the best round
        over every evaluated round when it differs (``overall_best_round``), with a note."""
        block: dict[str, Any] = {"scored_from": self.scored_from,
                                 "declared": type(self.coordinator).scored_from is not Method.scored_from,
                                 "reported_round": best if best is not None else rounds,
                                 "chosen_by": "early_stopping" if best is not None else "last round"}
        if self.early is not None:
            block["best_round"] = self.early.best_round
            overall = self.early.overall_best_round
            if overall is not None and overall != self.early.best_round:
                block["overall_best_round"] = overall
                block["overall_best_value"] = self.early.overall_best_value
                block["note"] = f"best round {self.early.best_round}{self.early.restriction()}"
        if self.scored_from is None:
            block["note"] = (f"the method's mechanism shaped no round of {rounds}: its scores are those of a model "
                             "its mechanism never acted on")
        elif best is None and self.scored_from > rounds:
            block["note"] = f"the method's mechanism acts from round {self.scored_from}, after the last round {rounds}"
        return block

    def record_mechanisms(self, r: int, dp_steps: dict[str, float] | None = None,
                          own_steps: dict[str, float] | None = None) -> None:
        """What the method's mechanisms did in round ``r`` (:meth:`Method.mechanisms`) to
        ``mechanisms.csv``, one line per value; what they could not do
        (:meth:`Method.mechanism_warnings`) on stderr and into the summary's ``warnings``; the
        method's ``scored_from`` when it declares one (:meth:`_selection_row`). In front, the engine's own rows: the DP noise against the clipped signal of every DP
        mechanism of the run (:class:`medfl.privacy.signal.NoiseShare`, from the round's
        screened replies and the steps they reported: ``dp_steps``, ``own_steps``), and per
        mechanism its worst ratio above 1, kept for :meth:`judge_noise` at the end of the run
        (which gives the warning when the score shows the noise drowned the signal); once per
        run, a warning and a row when a DP filter leaves the global model's BatchNorm statistics at
        their initial values (:meth:`NoiseShare.stale_statistics`)."""
        lines = []
        engine_rows, ratios = (self.noise_share.rows(dp_steps or {}, own_steps or {})
                               if self.noise_share.active else ([], []))
        bounds = self._noise_bounds()
        for mechanism, ratio, clients, change in ratios:
            # the warning waits for the run's score (judge_noise); the bound is kept for it
            if ratio > 1 and (mechanism not in bounds or ratio > bounds[mechanism][1]):
                first = bounds[mechanism][0] if mechanism in bounds else r
                if mechanism not in bounds:
                    logger.info(f"medfl [{self.label}] round {r}: {BOUND_ONLY} ({mechanism}): the worst-case "
                                f"noise_to_signal is {ratio:.3g}; whether the noise keeps the model from learning is "
                                "judged at the end of the run, from its score against the majority-class score")
                bounds[mechanism] = (first, ratio, clients, change)
        # once per session: the filters and the model spec do not change within a run
        if (self.noise_share.active and not getattr(self, "_stale_checked", False)
                and not any(str(w.get("warning", "")).startswith(STALE_BATCHNORM) for w in self.warnings)):
            self._stale_checked = True
            for mechanism, layers in self.noise_share.stale_statistics():
                text = NoiseShare.stale_warning(mechanism, layers)
                self.warnings.append({"round": r, "warning": text})
                logger.warning(f"medfl [{self.label}] round {r}: warning: {text}")
                engine_rows.append({"mechanism": mechanism, "scope": "run", "id": "batchnorm",
                                    "layers": len(layers), "statistics": "initial values (not sent)"})
        first = len(engine_rows)   # the method's rows follow the engine's (numbers and strings only)
        for i, row in enumerate([*engine_rows, *self.coordinator.mechanisms(r), *self._selection_row()],
                                start=-first):
            row = dict(row)
            head = {"round": r, "mechanism": str(row.pop("mechanism", "")), "scope": str(row.pop("scope", "run")),
                    "id": str(row.pop("id", ""))}
            for name, value in row.items():
                if isinstance(value, str):
                    lines.append({**head, "name": str(name), "value": float("nan"), "text": value})
                elif value is None or isinstance(value, (int, float)):
                    lines.append({**head, "name": str(name), "value": float("nan" if value is None else value),
                                  "text": ""})
                else:
                    raise RunError(f"method {self.label!r}: mechanisms({r})[{i}][{name!r}] must be a number or a "
                                   f"short string, got {type(value).__name__}")
        self._log_lines(lines)
        for text in self.coordinator.mechanism_warnings(r):
            self.warnings.append({"round": r, "warning": str(text)})
            logger.warning(f"medfl [{self.label}] round {r}: {text}")

    def _log_lines(self, lines: list[dict[str, Any]]) -> None:
        if lines:
            self.mechanism_log = pd.concat([self.mechanism_log, pd.DataFrame(lines)], ignore_index=True)
            self.files.write_rows("mechanisms.csv", self.mechanism_log)

    def _noise_bounds(self) -> dict[str, tuple[int, float, int, str]]:
        """Per DP mechanism, the first round its ratio after averaging was above 1, the worst
        ratio, its clients and what to change (kept over the rounds of this session; a resumed
        run reads the earlier rounds back from ``mechanisms.csv``)."""
        bounds = getattr(self, "_bounds", None)
        if bounds is None:
            bounds = {}
            log = self.mechanism_log
            if not log.empty and {"scope", "name", "value"} <= set(log.columns):
                rows = log[(log["scope"] == "round") & (log["name"] == "noise_to_signal") & (log["value"] > 1)]
                for mechanism, part in rows.groupby("mechanism", sort=False):
                    worst = part.loc[part["value"].idxmax()]
                    n = log[(log["mechanism"] == mechanism) & (log["round"] == worst["round"])
                            & (log["scope"] == "round") & (log["id"] == worst["id"]) & (log["name"] == "clients")]
                    bounds[str(mechanism)] = (int(part["round"].min()), float(worst["value"]),
                                              int(n["value"].iloc[0]) if len(n) else 0,
                                              "a larger epsilon or fewer rounds; or a smaller model")
            self._bounds = bounds
        return bounds

    def utility(self, reported_round: int) -> Utility | None:
        """The run's score against the majority-class score at ``reported_round``
        (:func:`medfl.privacy.signal.utility_of`: the split that did not choose the round when
        early stopping chose it), the labels from the run's data (``None``: no accuracy, or
        labels the coordinator does not hold)."""
        early = getattr(self, "early", None)
        chosen_on = None
        if early is not None and str(getattr(early, "metric", "")).partition("/")[0]:
            from medfl.engine.early_stopping import metrics_split

            chosen_on = metrics_split(str(early.metric).partition("/")[0])

        def labels(split: str, ids: list[str]) -> dict[str, Any]:
            role = split.removeprefix("local_")
            return {cid: self.data.rows("" if split == "global_test" else cid, role)["label"].to_numpy()
                    for cid in ([""] if split == "global_test" else ids)}

        try:
            return utility_of(self.metrics, reported_round, chosen_on, labels)
        except Exception:   # noqa: BLE001 - a transport whose coordinator holds no labels
            return None

    def judge_noise(self, rounds: int, reported_round: int) -> None:
        """At the end of a DP run (``rounds``: its last round): for each mechanism whose ratio
        after averaging was above 1 in some round, the :data:`DROWNED` warning when the run's
        score (:meth:`utility`, at ``reported_round``) is at the majority-class level, else a
        note; the verdict's row in ``mechanisms.csv`` (scope ``run``, id ``utility``) for
        every DP mechanism."""
        if not self.noise_share.active:
            return
        bounds = self._noise_bounds()
        utility = self.utility(reported_round)
        stale = any(str(w.get("warning", "")).startswith(STALE_BATCHNORM) for w in self.warnings)
        lines = []
        log = self.mechanism_log
        if not log.empty and "scope" in log.columns:   # a resumed finish judges again, once
            log = self.mechanism_log = log[~((log["scope"] == "run") & (log["id"] == "utility"))].reset_index(drop=True)
        mechanisms = ([str(x) for x in log.loc[log["scope"] == "round", "mechanism"].unique()]
                      if not log.empty and "scope" in log.columns else [])
        for mechanism in dict.fromkeys([*mechanisms, *bounds]):
            first, ratio, clients, change = bounds.get(mechanism, (0, math.nan, 0, ""))
            if utility is not None:
                worst = ratio
                if not math.isfinite(worst):
                    rows = log[(log["mechanism"] == mechanism) & (log["scope"] == "round")
                               & (log["name"] == "noise_to_signal")]
                    worst = float(rows["value"].max()) if len(rows) else math.nan
                row = utility.row(worst)
                head = {"round": rounds, "mechanism": mechanism, "scope": "run", "id": "utility"}
                lines += [{**head, "name": k, "value": float("nan"), "text": v} if isinstance(v, str) else
                          {**head, "name": k, "value": float(v), "text": ""} for k, v in row.items()]
            if mechanism not in bounds:
                continue
            text = NoiseShare.warning(first, mechanism, ratio, clients, change, utility, stale)
            said = f"{DROWNED} ({mechanism})"
            if text:
                if not any(str(w.get("warning", "")).startswith(said) for w in self.warnings):
                    self.warnings.append({"round": first, "warning": text})
                    logger.warning(f"medfl [{self.label}] round {rounds}: warning: {text}")
            else:
                logger.info(f"medfl [{self.label}]: {NoiseShare.bound_note(first, mechanism, ratio, utility)}")
        if utility is not None and not utility.learned and not bounds:
            logger.info(f"medfl [{self.label}]: {utility.text()}, but the DP noise cannot be why: its worst-case "
                        "noise_to_signal stayed at most 1 in every round (the clip, BatchNorm statistics, or the "
                        "training itself)")
        self._log_lines(lines)
