"""What FedTPF's mechanisms did, every run: the rows of ``mechanisms.csv`` (stop condition,
eq. 8's decay, the noise, the release, the stage-2 mix), the warnings when a mechanism
cannot act, and ``summary.json``'s ``method_report``.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from medfl.guard.params import PLANE_MIN_CORR
from medfl.losses.feature_distill import STOP_CRITERIA
from medfl.messages import Reply
from medfl_plugins.common import say_once

__all__ = ["DECAY_INERT", "CHANCE_MARGIN", "CHANCE_ROUNDS", "VALIDATION_KEYS", "MechanismRecords", "as_float"]

#: the alpha all of stage 1 must stay at or above (within 1 % of 1) for the decay warning
DECAY_INERT = 0.99
#: how far above chance an accuracy may sit and still count as "at chance" in the warnings
#: (a client's chance is the larger of 1/K and its validation split's most common class)
CHANCE_MARGIN = 0.05
#: how many validations in a row (at least; ``window`` if larger) an accuracy must stay at chance
#: before the warnings say so
CHANCE_ROUNDS = 3
#: the validation scalars each client reports (:meth:`FedTPF.client_validate`) and the history keeps
VALIDATION_KEYS = ("residual_accuracy", "residual_accuracy_p", "cosine", "cosine_signed", "unmet", "noise_to_signal",
                   "noise_to_signal_input", "clipped_fraction", "majority_share")


def as_float(value: Any) -> float:
    """``value`` as a float, NaN where it is none."""
    try:
        return float(value)
    except (TypeError, ValueError):
        return math.nan


def _median(values: list[float]) -> float:
    """The upper median of ``values`` (not empty)."""
    return sorted(values)[len(values) // 2]


def _fmt_ids(ids: list[str]) -> str:
    return ", ".join(ids[:8]) + (f" and {len(ids) - 8} more" if len(ids) > 8 else "")


class MechanismRecords:
    """The rows, warnings and report of :class:`~medfl_plugins.fedtpf.method.FedTPF`, from the
    settings and the bookkeeping it keeps (``history``, ``log``, ``stopped_at``: its ``setup``)."""

    def _record_decay(self, replies: dict[str, Reply], alpha: dict[str, float], frozen: list[str]) -> None:
        """A stage-1 aggregation: each client's eq. 8 weight, whether it was frozen, its
        training accuracy on ``x_p`` and steps; the ``Delta_perf`` used."""
        for cid, r in replies.items():
            self._rows.append({"mechanism": "decay", "scope": "client", "id": cid, "alpha": alpha[cid],
                               "frozen": 1 if cid in frozen else 0,
                               "train_accuracy_x_p": as_float(r.metrics.get("distill_residual_accuracy")),
                               "distill_steps": as_float(r.metrics.get("distill_steps"))})
        self._rows.append({"mechanism": "decay", "scope": "run", "delta_perf_used": self.delta_perf,
                           "reading": self.decay_reading if self.decay else "off"})

    def _record_mix(self, replies: dict[str, Reply]) -> None:
        """A stage-2 aggregation: the share of shared samples each client trained on."""
        self._rows += [{"mechanism": "mix", "scope": "client", "id": cid,
                        "shared_fraction": as_float(r.metrics.get("shared_fraction")),
                        "shared_mean_gap": as_float(r.metrics.get("shared_mean_gap"))}
                       for cid, r in replies.items() if "shared_fraction" in r.metrics]

    def _record_validation(self, round: int, results: dict[str, dict[str, float]]) -> None:
        """A validation exchange: the scalars into ``history``, and per client the stop
        condition and the noise, for the run eq. 9's ``Delta_perf``, the clients converged and the clip."""
        for cid, m in sorted(results.items()):
            row = {"round": float(round), **{k: as_float(m.get(k)) for k in VALIDATION_KEYS}}
            self.history.setdefault(cid, []).append(row)
            code = row["unmet"]
            unmet = STOP_CRITERIA[int(code)] if math.isfinite(code) and 0 <= code < len(STOP_CRITERIA) else None
            self._rows.append({"mechanism": "stop_condition", "scope": "client", "id": cid,
                               "residual_accuracy_x_s": row["residual_accuracy"],
                               "residual_accuracy_x_p": row["residual_accuracy_p"], "cosine": row["cosine"],
                               "cosine_signed": row["cosine_signed"], "cosine_reading": self.cosine_reading,
                               "unmet": unmet, "stop_round": self._stop_round(cid)})
            self._rows.append({"mechanism": "noise", "scope": "client", "id": cid, "scale": self._scale_text(),
                               "noise_to_signal": row["noise_to_signal"],
                               "noise_to_signal_input": row["noise_to_signal_input"],
                               "clipped_fraction": row["clipped_fraction"]})
        self._rows.append({"mechanism": "decay", "scope": "run", "delta_perf": self.delta_perf})
        self._rows.append({"mechanism": "stop_condition", "scope": "run", "converged": len(self.stopped_at),
                           "clients": len(self.federation.client_ids), "chance": 1.0 / self.federation.num_classes})
        self._rows.append({"mechanism": "noise", "scope": "run", "clip": self._finite_clip(),
                           "noise_per_coordinate": self.noise_scale(self._finite_clip())})

    def _record_release(self, replies: dict[str, Reply]) -> None:
        """The release: each contributing client's measured noise-to-signal, norms, clipped
        fraction and count; for the run the clip, the noise and the shared set's size."""
        for cid, r in replies.items():
            self.release_stats[cid] = {m: float(v) for m, v in r.metrics.items()}
            self._rows.append({"mechanism": "release", "scope": "client", "id": cid,
                               **{k: as_float(r.metrics.get(k)) for k in (
                                   "noise_to_signal", "noise_norm", "signal_norm", "clipped_fraction", "released")}})
        self._rows.append({"mechanism": "release", "scope": "run", "clip": self.transition["clip"],
                           "clip_source": self._clip_source(), "noise": self._noise_text(), "scale": self._scale_text(),
                           "noise_per_coordinate": self.noise_scale(self.transition["clip"]),
                           "shared_samples": self.transition["shared_samples"]})

    def mechanisms(self, round: int) -> list[dict[str, Any]]:
        """This round's rows (the ``_record_*`` methods'), and stop round ``"cap"`` for the
        clients that never met the stop condition once stage 1 ended."""
        rows = list(self._rows) if self._rows_round == round else []
        capped = self.transition.get("after_round") == round and self.stop_condition
        return rows + [{"mechanism": "stop_condition", "scope": "client", "id": cid, "stop_round": "cap"}
                       for cid in self.federation.client_ids if capped and cid not in self.stopped_at]

    def _stop_key(self) -> str:
        """The validation scalar the stop condition and eq. 9 read (``stop_on``)."""
        return "residual_accuracy_p" if self.stop_on == "x_p" else "residual_accuracy"

    def _stop_round(self, cid: str) -> int | str | None:
        """The round client ``cid`` met the stop condition, ``"cap"`` once stage 1 ended
        without it, ``None`` while it still distils."""
        if cid in self.stopped_at:
            return self.stopped_at[cid] - 1
        return "cap" if self.transition and self.stop_condition else None

    def report(self) -> dict[str, Any]:
        """The stage switch, who stopped when (or ``"cap"``), eq. 8-9's weights, the residual
        classifier's accuracy on ``x_s`` and ``x_p``, the release's norms and noise."""
        stats = self.release_stats
        n = {cid: s.get("released", 0.0) for cid, s in stats.items()}
        total = sum(n.values())

        def mean(key: str) -> float | None:
            vals = [(n[c], s[key]) for c, s in stats.items() if key in s and math.isfinite(s[key])]
            return sum(w * v for w, v in vals) / sum(w for w, _ in vals) if vals and total else None

        last = {cid: h[-1] for cid, h in self.history.items() if h}

        def avg(key: str) -> float | None:
            vals = [r[key] for r in last.values() if math.isfinite(r[key])]
            return sum(vals) / len(vals) if vals else None

        alphas = [a for entry in self.log for a in entry["alpha"].values()]
        return {"transition": self.transition, "stopped_at": dict(self.stopped_at),
                "stop_rounds": {cid: self._stop_round(cid) for cid in self.federation.client_ids},
                "stage1": self.log,
                "stop_condition": {
                    "target": self.target_accuracy - self.tolerance, "chance": 1.0 / self.federation.num_classes,
                    "met": len(self.stopped_at), "clients": len(self.federation.client_ids),
                    "residual_accuracy_x_s_last_mean": avg("residual_accuracy"),
                    "residual_accuracy_x_p_last_mean": avg("residual_accuracy_p"),
                    "noise_to_signal_last_median": (_median([r["noise_to_signal"] for r in last.values()])
                                                    if last else None),
                    "last": {cid: {"x_s": r["residual_accuracy"], "x_p": r["residual_accuracy_p"],
                                   "cosine": r["cosine"], "unmet": (STOP_CRITERIA[int(r["unmet"])]
                                                                    if math.isfinite(r["unmet"]) else None)}
                             for cid, r in last.items()}},
                "decay": {"on": self.decay, "reading": self.decay_reading, "lambda": self.decay_lambda,
                          "min_alpha": min(alphas) if alphas else None, "max_alpha": max(alphas) if alphas else None,
                          "inert": bool(alphas) and min(alphas) >= DECAY_INERT,
                          "delta_perf": {r: d for r, d in sorted(self.delta_used.items())}},
                "release": {
                    "mechanism": self.mechanism, "noise": self._noise_text(), "scale": self._scale_text(),
                    "epsilon": self.epsilon,
                    "delta": self.delta, "clip": self._finite_clip(), "clip_source": self._clip_source(),
                    "noise_per_coordinate": self.noise_scale(self._finite_clip()),
                    "private": self.epsilon is not None and self.noise is None,
                    "x_norm_mean": mean("x_norm"), "x_s_norm_mean": mean("x_s_norm"),
                    "x_s_to_x_norm": mean("x_s_norm_ratio"), "clipped_fraction": mean("clipped_fraction"),
                    "noise_to_signal": mean("noise_to_signal"), "per_client": stats},
                "mix": self.mix}

    def _chance(self, row: dict[str, float]) -> float:
        share = row.get("majority_share", math.nan)
        return max(1.0 / self.federation.num_classes, share if math.isfinite(share) else 0.0)

    def _at_chance(self, cid: str, key: str) -> bool:
        need = max(self.window, CHANCE_ROUNDS)
        last = self.history.get(cid, [])[-need:]
        if len(last) < need:
            return False
        return all(math.isfinite(r[key]) and r[key] <= self._chance(r) + CHANCE_MARGIN for r in last)

    def _fix_noise(self) -> str:
        return ("lower the noise: noise={'variance': 0.15} is the paper's (not private), or a larger epsilon"
                if self.noise is None else "lower noise.variance")

    def mechanism_warnings(self, round: int) -> list[str]:
        """What keeps a mechanism from acting, said once each: in stage 1
        (:meth:`_stage1_warnings`), at its end (:meth:`_transition_warnings`), and noise that
        drowns the released features' signal (noise norm >= signal norm)."""
        out: list[str] = []
        say = say_once(self.warned, out)
        if self.stage == "distill" or self.transition.get("after_round") == round:
            self._stage1_warnings(round, say)
        if self.transition.get("after_round") == round:
            self._transition_warnings(say)
        if self.release_round == round and self.release_stats:
            ratios = [s["noise_to_signal"] for s in self.release_stats.values()
                      if math.isfinite(s.get("noise_to_signal", math.nan))]
            if ratios and _median(ratios) >= 1.0:
                say("noise", f"the released features' noise norm is {_median(ratios):.3g}x their "
                             f"(clipped) signal's (median over clients): the shared set is mostly noise; "
                             f"{self._fix_noise()}")
        return out

    def _stage1_warnings(self, round: int, say: Callable[[str, str], None]) -> None:
        """The validations' warnings: the residual classifier at chance on ``stop_on`` (the
        stop condition cannot fire) or on ``x_p`` (the shared set carries no label), noise
        over signal, the paper's fixed noise too small for the content guard to let a still
        image-like ``x_s`` leave (noise-to-signal below about 0.33: ``x_p`` correlates >= 0.95
        with ``x_s``), the best accuracy below the target halfway to the cap."""
        cap, target = f"distill_rounds={self.distill_rounds}", self.target_accuracy - self.tolerance
        fix_noise = self._fix_noise()
        ids = sorted(self.history)
        stuck = [c for c in ids if self._at_chance(c, self._stop_key())]
        if stuck and self.stop_condition:
            say("chance_stop", f"the residual classifier has stayed at chance on {self.stop_on} (accuracy <= "
                               f"chance + {CHANCE_MARGIN:g} over {max(self.window, CHANCE_ROUNDS)} validations) "
                               f"on client(s) {_fmt_ids(stuck)}: while it does, the stop condition (accuracy >= "
                               f"{target:g}) cannot fire and stage 1 runs to the cap ({cap}); give the classifier "
                               f"more steps (distill_steps, distill_epochs, distill_lr) or {fix_noise}")
        drowned = [c for c in ids if self._at_chance(c, "residual_accuracy_p")
                   and (self.stop_on == "x_s" or c not in stuck)]
        if drowned:
            say("chance_x_p", f"the residual classifier's accuracy on x_p (x_s perturbed as the release "
                              f"perturbs it) is at chance on client(s) {_fmt_ids(drowned)}: the shared features "
                              f"will carry no label information it can use; {fix_noise}")
        ratios = [self.history[c][-1]["noise_to_signal"] for c in ids
                  if math.isfinite(self.history[c][-1]["noise_to_signal"])]
        if ratios and _median(ratios) >= 1.0:
            say("noise", f"the noise's norm is {_median(ratios):.3g}x the (clipped) signal's "
                         f"on the clients' validation data (median): each released feature is more noise than "
                         f"signal; {fix_noise}" + (", or a clip nearer the features' norms "
                                                   "(clip='public_quantile'), though no clip brings a Gaussian "
                                                   "release below z * sqrt(d)"
                                                   if self.noise is None and self.clip != "public_quantile"
                                                   else ""))
        # x_p = x_s + n correlates with x_s at about 1 / sqrt(1 + r^2), r the noise-to-signal; a client's
        # samples spread around its mean r (label_skew_2 fixture, seed 1: a client at r = 0.41-0.44 on its
        # validation split had 5 training samples refused), hence the margin of 1.5 on the lowest client
        copy = math.sqrt(1.0 / PLANE_MIN_CORR ** 2 - 1.0)
        low = min(ratios, default=math.inf)
        if self.noise is not None and low < 1.5 * copy:
            say("copy", f"the noise's norm is {low:.3g}x the signal's on the lowest client (on the "
                        f"{self._scale_text()} scale): x_p correlates with x_s at about "
                        f"{1 / math.sqrt(1 + low ** 2):.3f} on average and more on some samples, so where x_s "
                        f"is still nearly the image the content guard refuses the release as a noisy copy "
                        f"(correlation >= {PLANE_MIN_CORR:g}) and the run stops; distill longer "
                        f"(distill_steps, distill_rounds, a stop condition that fires later) or raise "
                        f"noise.variance")
        n_val = min((len(h) for h in self.history.values()), default=0)
        if (self.stop_condition and round >= math.ceil(self.distill_rounds / 2) and n_val >= self.window
                and self.stage == "distill"):
            short = {c: max(r[self._stop_key()] for r in self.history[c]) for c in ids if c not in self.stopped_at}
            short = {c: a for c, a in short.items() if math.isfinite(a) and a < target}
            if short:
                say("target", f"after {round} of at most {self.distill_rounds} stage-1 rounds the residual "
                              f"accuracy on {self.stop_on} of client(s) {_fmt_ids(sorted(short))} has not reached "
                              f"target_accuracy - tolerance = {target:g} (best {max(short.values()):.3g}): the "
                              f"stop condition may not fire before the cap; raise distill_steps or "
                              f"distill_rounds, lower target_accuracy, or {fix_noise}")

    def _transition_warnings(self, say: Callable[[str, str], None]) -> None:
        """The end of stage 1's warnings: clients that never met the stop condition, and eq.
        8's decay that left every weight within 1 % of 1."""
        if self.stop_condition:
            capped = [c for c in self.federation.client_ids if c not in self.stopped_at]
            if capped:
                say("cap", f"stage 1 ended at the cap (distill_rounds={self.distill_rounds}): {len(capped)} of "
                           f"{len(self.federation.client_ids)} client(s) never met the stop condition (stop round "
                           f"'cap': {_fmt_ids(capped)}), so eq. 8's decay never acted on them")
        alphas = [a for entry in self.log for a in entry["alpha"].values()]
        if self.decay and alphas and min(alphas) >= DECAY_INERT:
            biggest = max((d for d in self.delta_used.values() if math.isfinite(d)), default=0.0)
            why = ("no client met the stop condition, so no weight could decay" if not self.stopped_at else
                   f"the largest Delta_perf used was {biggest:.3g}" + (
                       f": under eq. 8 as printed a lambda of at least {-math.log(DECAY_INERT) / biggest:.3g} "
                       f"would bring alpha below {DECAY_INERT:g} at that change" if biggest > 0
                       and self.decay_reading == "printed" else ""))
            fix = ("raise decay_lambda (the paper gives no value; experiments/fedtpf_probe.py --decay-lambdas "
                   "sweeps it)" if self.stopped_at else "a stop condition this data can meet comes first")
            say("decay", f"eq. 8's decay left every aggregation weight of stage 1 within {1 - DECAY_INERT:.0%} of 1 "
                         f"(alpha >= {min(alphas):.4f} with decay_lambda {self.decay_lambda:g}): it cannot change "
                         f"the aggregated distillation model measurably; {why}; {fix}, or set decay=False to say so")
