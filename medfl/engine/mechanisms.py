"""What a run records of the method's mechanisms, round by round (a part of
:class:`medfl.engine.runner.Run`): ``mechanisms.csv`` (the engine's noise-to-signal rows of
every DP mechanism, :class:`medfl.privacy.signal.NoiseShare`, then the method's own rows,
:meth:`~medfl.method.Method.mechanisms`, and the method's ``scored_from``), the warnings of
both, and the rounds a method's scores may be read at: :meth:`Mechanisms.ask_scored_from`
asks :meth:`~medfl.method.Method.scored_from` after every round, and :meth:`Mechanisms.selection`
is the summary's ``selection`` block.
"""

from __future__ import annotations

import logging
from typing import Any

import pandas as pd

from medfl.method import Method
from medfl.privacy.signal import DROWNED, NoiseShare
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
        screened replies and the steps they reported: ``dp_steps``, ``own_steps``), and once
        per mechanism a warning with what to change when the noise drowns the signal."""
        lines = []
        engine_rows, ratios = (self.noise_share.rows(dp_steps or {}, own_steps or {})
                               if self.noise_share.active else ([], []))
        for mechanism, ratio, clients, change in ratios:
            text = NoiseShare.warning(r, mechanism, ratio, clients, change)
            said = f"{DROWNED} ({mechanism})"
            if text and not any(str(w.get("warning", "")).startswith(said) for w in self.warnings):
                self.warnings.append({"round": r, "warning": text})
                logger.warning(f"medfl [{self.label}] round {r}: warning: {text}")
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
        if lines:
            self.mechanism_log = pd.concat([self.mechanism_log, pd.DataFrame(lines)], ignore_index=True)
            self.files.write_rows("mechanisms.csv", self.mechanism_log)
        for text in self.coordinator.mechanism_warnings(r):
            self.warnings.append({"round": r, "warning": str(text)})
            logger.warning(f"medfl [{self.label}] round {r}: {text}")
