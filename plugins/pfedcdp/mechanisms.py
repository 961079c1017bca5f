"""What PFedCDP's mechanisms did, so a person can see them act (:class:`MechanismRecords`, a
part of :class:`~medfl_plugins.pfedcdp.method.PFedCDP`): per cluster and round the DP noise in
the averaged update against the largest clipped update (``dp_noise``), quantization's error
(``quantization``), the cluster model's magnitudes (``cluster_model``); per client the scalars
of its own extractor its reply carries (``personalization``); the warnings when one of them
goes wrong; and from which round the evaluated models saw noise. ``docs/pfedcdp.md``, "What the
mechanisms do", says what each value is.
"""

from __future__ import annotations

import math
from typing import Any

from medfl.capability import CLUSTERS
from medfl_plugins.common import say_once
from medfl_plugins.pfedcdp.settings import AUTHORS_NOISE_MULTIPLIER, State

__all__ = ["ABOVE_ONE_WARN", "DRIFT_WARN", "NOISE_WARN_RATIO", "MechanismRecords", "norm", "personal_observables",
           "quantization_error"]

#: A cluster's noise-to-update ratio from which the run warns that the noise drowns the update.
NOISE_WARN_RATIO = 10.0
#: A client's share of own-extractor weights above 1 in magnitude from which the run warns.
ABOVE_ONE_WARN = 0.05
#: A client's relative change of its personal (Fisher-kept) weights in one round from which the run warns.
DRIFT_WARN = 1.0


def norm(tensors: Any) -> float:
    """The L2 norm of a collection of tensors taken together, in float64."""
    return math.sqrt(sum(float((t.double() ** 2).sum()) for t in tensors))


def personal_observables(new: State, prev: State | None, masks: State | None) -> dict[str, float]:
    """What a client reports of its own extractor after a round (scalars of its reply), so a
    person can see eq. 6 and the local training act on it.

    Args:
        new: the client's own extractor after this round (its personal model's weights).
        prev: its own extractor of the previous round (``None`` in its first round).
        masks: this round's personal masks (eq. 4; ``None`` in its first round).

    Returns:
        ``own_norm`` (L2 norm of ``new``) and ``above_one`` (the share of ``new``'s entries
        above 1 in magnitude: none in a trained CNN of this size without noise, most of them
        when eq. 6 copied a noise-drowned cluster model in); with ``prev`` and ``masks`` also
        ``personal_norm`` and ``personal_norm_prev`` (the norm of the personal entries, Fisher
        mask 1, now and in the previous round) and ``personal_drift``
        ``||M (new - prev)|| / ||M prev||`` (how far the kept entries moved this round).
    """
    total = sum(v.numel() for v in new.values())
    above = sum(int((v.abs() > 1.0).sum()) for v in new.values())
    out = {"own_norm": norm(new.values()), "above_one": above / max(total, 1)}
    if prev is not None and masks is not None:
        keys = [k for k in masks if k in new and k in prev]
        m = {k: masks[k].to("cpu") for k in keys}
        out["personal_norm"] = norm(new[k].cpu()[m[k]] for k in keys)
        out["personal_norm_prev"] = prev_norm = norm(prev[k].cpu()[m[k]] for k in keys)
        moved = norm((new[k].cpu() - prev[k].cpu())[m[k]] for k in keys)
        out["personal_drift"] = moved / prev_norm if prev_norm > 0 else 0.0
    return out


def quantization_error(state: State, bits: int) -> float:
    """The expected L2 norm of ``bits``-bit min-max quantization's error on ``state`` (eqs.
    14-15, per tensor): each tensor's step ``(max - min) / (2^b - 1)``, a rounding error
    uniform over one step (variance ``step^2 / 12``) on each of its entries, so
    ``sqrt(sum_t n_t step_t^2 / 12)``. What it is for: the coordinator's estimate of what
    quantization costs a reply, from the dequantized values alone (their minimum and maximum
    are decoded exactly)."""
    total = 0.0
    for v in state.values():
        if v.is_floating_point() and v.numel():
            step = (float(v.max()) - float(v.min())) / (2 ** bits - 1)
            total += v.numel() * step * step / 12.0
    return math.sqrt(total)


class MechanismRecords:
    """The coordinator's records of what the mechanisms did: ``observed`` (this round's),
    ``history`` (``{observable: {id: {round: value}}}``), ``warned`` (once each) and
    ``first_noised_round`` (:meth:`scored_from`)."""

    def _observe_cluster(self, c: str, old: State, states: list[State], weights: list[float]) -> None:
        """Cluster ``c``'s observables of this round: the noise the plan puts in its averaged
        update against the largest clipped update, quantization's error against the received
        updates, the new cluster model's magnitudes."""
        total = sum(weights)
        w2 = sum((w / total) ** 2 for w in weights)
        d = sum(v.numel() for v in old.values() if v.is_floating_point())
        new = self.extractors[c]
        received = [{k: s[k].double() - old[k].double() for k in old if old[k].is_floating_point()} for s in states]
        sigma = self.sigma if self.noised(c) else 0.0
        noise = sigma * self.clip * math.sqrt(d * w2)
        bound = self.signal_bound(c)
        obs: dict[str, Any] = {
            "dp_noise": {"clients": float(len(states)), "coordinates": float(d), "noised": float(self.noised(c)),
                         "target": "weights" if self.dp_mode == "weights_per_tensor" else "update",
                         "sigma": sigma, "clip": self.clip, "signal_bound": bound, "weights_sq_sum": w2,
                         "noise_norm": noise, "noise_per_coordinate": sigma * self.clip * math.sqrt(w2),
                         "noise_to_update_min": noise / bound,
                         "received_update_norm": norm(new[k].double() - old[k].double() for k in received[0])},
            "cluster_model": {"norm": norm(new.values()),
                              "above_one": sum(int((v.abs() > 1.0).sum()) for v in new.values()) / max(d, 1)}}
        bits = self.cluster_bits(c)
        if bits is not None:
            target = self._quantized()
            errors = [quantization_error(u if target == "update" else s, bits) for u, s in zip(received, states)]
            norms = [norm(u.values()) for u in received]
            err, upd = sum(errors) / len(errors), sum(norms) / len(norms)
            obs["quantization"] = {"bits": float(bits), "target": target, "error_norm": err,
                                   "update_norm": upd, "error_to_update": err / upd if upd > 0 else float("nan")}
        self.observed["clusters"][c] = obs
        if self.noised(c) and self.first_noised_round is None:
            self.first_noised_round = int(self.observed["round"])
        self._remember("noise_to_update_min", c, obs["dp_noise"]["noise_to_update_min"])
        if "quantization" in obs:
            self._remember("quantization_error_to_update", c, obs["quantization"]["error_to_update"])

    def _quantized(self) -> str:
        """What the quantization acts on: ``"update"`` or ``"weights"``."""
        return "update" if self.dp_mode == "update" and (self.dp or self.quantize == "update") else "weights"

    def _observe_client(self, cid: str, c: str, metrics: dict[str, float]) -> None:
        """Client ``cid``'s observables of this round: the scalars its reply reported
        (:func:`personal_observables`) and its personal share (eq. 4)."""
        names = ("personal_fraction", "own_norm", "above_one", "personal_norm", "personal_norm_prev",
                 "personal_drift")
        obs = {k: float(metrics[k]) for k in names if isinstance(metrics.get(k), (int, float))}
        self.observed["clients"][cid] = {"cluster": c, **obs}
        for k in ("above_one", "personal_drift"):
            if k in obs:
                self._remember(k, cid, obs[k])

    def _remember(self, what: str, who: str, value: float) -> None:
        self.history.setdefault(what, {}).setdefault(who, {})[str(self.observed["round"])] = float(value)

    def mechanisms(self, round: int) -> list[dict[str, Any]]:
        """The observables of ``round`` (``mechanisms.csv``): per cluster ``dp_noise``,
        ``quantization`` and ``cluster_model``, per client ``personalization`` (the module's
        docstring says what each value is)."""
        if self.observed.get("round") != round:
            return []
        return ([{"mechanism": name, "scope": "cluster", "id": c, **vals}
                 for c, obs in self.observed["clusters"].items() for name, vals in obs.items()]
                + [{"mechanism": "personalization", "scope": "client", "id": cid, **obs}
                   for cid, obs in self.observed["clients"].items()])

    def scored_from(self, round: int) -> int | None:
        """The first round whose evaluated (personal) models PFedCDP's noise shaped, as known after
        ``round``. A client's round-r personal model is its own extractor and classifier after its
        round-r training, which starts from the cluster model averaged in round r - 1 (eq. 6 takes
        the unkept share from it; without the masks it is all of it) and distils from it (eq. 11);
        the noise a client adds to its round-r reply reaches the cluster model only in that
        round's :meth:`server_update`, after the round's personal models were made (the client
        keeps its own, un-noised model). So with noise on, the first round whose personal models
        saw a noisy update is the round after the first round in which a noised cluster's
        replies were averaged: round 2 when round 1's clients send noised extractors (``None``
        after round 1, 2 from round 2 on). Without noise (``epsilon`` and ``noise_multiplier``
        null), or when no client is in a noised cluster (``dp_clusters``), nothing noisy ever
        reaches a personal model and the distillation from the cluster's model shapes round 1's
        already: 1. With ``score="global"`` a round's evaluation scores the cluster model averaged
        in that round, so the first noised round is itself the first one scored on noise."""
        if not self.dp or not any(self.noised(c) for c in self.assign.values()):
            return 1
        # score "global": the round's evaluation scores the cluster model averaged in that very
        # round, so the first round whose replies were noised is already scored on noise
        lag = 0 if self.score == "global" else 1
        if self.first_noised_round is None or self.first_noised_round + lag > round:
            return None
        return self.first_noised_round + lag

    def mechanism_warnings(self, round: int) -> list[str]:
        """Once each: the noise drowns a cluster's update (``NOISE_WARN_RATIO``); quantizing the
        weights errs more than the update; a noised cluster's replies are missing; a client's own
        weights blew up (``ABOVE_ONE_WARN``, ``DRIFT_WARN``)."""
        if self.observed.get("round") != round:
            return []
        out: list[str] = []
        say = say_once(self.warned, out)
        for c, obs in self.observed["clusters"].items():
            dp = obs["dp_noise"]
            if dp["noise_to_update_min"] >= NOISE_WARN_RATIO:
                say(f"noise:{c}", self._noise_warning(c, dp))
            q = obs.get("quantization")
            if q and q["target"] == "weights" and q["error_to_update"] > 1.0:
                say(f"quantization:{c}", f"cluster {c}: {int(q['bits'])}-bit quantization of the weights errs "
                    f"{q['error_to_update']:.3g}x the update itself (error norm {q['error_norm']:.3g}); "
                    "quantize 'update' (eq. 14) quantizes the update instead")
        missing = self.observed.get("noised_missing") or []
        if missing and len(CLUSTERS) > len(self.dp_clusters):
            say("noised_missing", f"client(s) {', '.join(missing)} of the noised cluster(s) "
                f"{', '.join(self.dp_clusters)} sent no usable reply this round (reply_events.csv says why), so no "
                "noised update reached the cluster's model: the other clusters send their weights in the clear, and "
                "until a noised reply is averaged no round is scored (scored_from)")
        return out + self._blowup_warning()

    def _noise_warning(self, c: str, dp: dict[str, Any]) -> str:
        """The warning that the noise drowns cluster ``c``'s update (its ``dp_noise`` row ``dp``)."""
        need = dp["signal_bound"] / (self.clip * math.sqrt(dp["coordinates"] * dp["weights_sq_sum"]))
        return (f"cluster {c}: the DP noise in the averaged extractor update has norm {dp['noise_norm']:.4g}, at "
                f"least {dp['noise_to_update_min']:.3g}x any clipped {dp['target']} (sigma {self.sigma:.3g}, C2 "
                f"{self.clip:g}, {int(dp['coordinates'])} coordinates, {int(dp['clients'])} client(s)): the "
                f"cluster model is mostly noise, and eq. 6 copies it into "
                + ("the unkept share of every member's own extractor." if self.apply_masks else
                   "every member's extractor (apply_masks false: all of it).")
                + f" A ratio of 1 needs sigma <= {need:.3g}: a larger epsilon, fewer rounds, more clients "
                f"per cluster or a smaller extractor"
                + (f" (the authors' formula at the paper's epsilon, sigma 0.969 a round, preset 'authors_formula', "
                   f"epsilon 31.4 over 20 rounds, would still give {AUTHORS_NOISE_MULTIPLIER / need:.3g}x)"
                   if abs(self.sigma - AUTHORS_NOISE_MULTIPLIER) > 1e-9 else "")
                + "; mechanisms.csv has the ratio per round")

    def _blowup_warning(self) -> list[str]:
        """The warning (once per client) that clients' own extractors blew up this round."""
        blown = [(cid, o) for cid, o in self.observed["clients"].items()
                 if o.get("above_one", 0.0) > ABOVE_ONE_WARN or o.get("personal_drift", 0.0) > DRIFT_WARN]
        new = [cid for cid, _ in blown if f"blowup:{cid}" not in self.warned]
        if not new:
            return []
        self.warned.extend(f"blowup:{cid}" for cid in new)
        now = [100 * o.get("above_one", 0.0) for cid, o in blown if cid in new]
        first = [100 * min(self.history.get("above_one", {}).get(cid, {}).items(), key=lambda kv: int(kv[0]),
                           default=("", float("nan")))[1] for cid in new]
        drifted = [cid for cid, o in blown if cid in new and o.get("personal_drift", 0.0) > DRIFT_WARN]
        return [f"the personal models blew up: client(s) {', '.join(new)} have {min(now):.0f}-{max(now):.0f} % "
                f"of their own extractor's weights above 1 in magnitude ({min(first):.0f}-{max(first):.0f} % "
                "in their first round)"
                + (f"; the Fisher-kept weights of client(s) {', '.join(drifted)} moved more than their own "
                   "norm" if drifted else "")
                + ". Eq. 6 takes the unkept share of each client's extractor from its cluster model, which the "
                "DP noise dominates (dp_noise in mechanisms.csv): a larger epsilon or fewer rounds, more "
                "clients per cluster, or no DP (epsilon null) to see the mechanism without it"]

    def _mechanism_report(self) -> dict[str, Any]:
        """The readable summary of what the mechanisms did (the method's report's ``mechanisms``)."""
        noise = self.history.get("noise_to_update_min", {})
        return {
            "dp": {"private": self.dp and len(self.dp_clusters) == len(CLUSTERS), "mode": self.dp_mode,
                   "clusters_noised": [c for c in CLUSTERS if self.noised(c)],
                   "clusters_in_clear": [c for c in CLUSTERS if not self.noised(c)],
                   "sigma_per_round": self.sigma, "clip": self.clip,
                   "epsilon_target": self.epsilon, "noise_multiplier_given": self.noise_multiplier,
                   "spent": "privacy.csv and summary.json's privacy block (the accountant's epsilon)"},
            "noise_to_update_min_by_round": noise,
            "noise_drowns_update_from_round": {c: min((int(r) for r, v in by.items() if v >= NOISE_WARN_RATIO),
                                                      default=None) for c, by in noise.items()},
            "quantization": {"target": self._quantized(), "bits": self.bits,
                             "error_to_update_by_round": self.history.get("quantization_error_to_update", {})},
            "own_weights_above_one_by_round": self.history.get("above_one", {}),
            "personal_drift_by_round": self.history.get("personal_drift", {}),
            "cluster_average": self.cluster_average,
            "warnings": len(self.warned),
        }
