"""A run's privacy: what it applies (:class:`PrivacyPlan`) and what it has spent (:class:`PrivacyLedger`).

The coordinator plans a run's differential privacy once, before any training, from the
config: the reply filter chain (``dp_gaussian``: client-level DP on updates) and DP-SGD in
local training (``train.dp``: sample-level DP, :mod:`medfl.privacy.dp_sgd`). Where a target
epsilon is given, the noise multiplier is derived with Opacus's accountant over what the
run will do: every client's planned releases are known in advance, because the clients of
each round are drawn from the run seed (:meth:`medfl.method.Federation.sample`).

The ledger then records, after every round, each client's releases of that round and its
epsilon spent so far (Opacus's accountant over the client's whole history): ``privacy.csv``
and the ``privacy`` block of ``summary.json``. It counts a release for every client that was
*sent* a training instruction, whether or not its reply arrived (a reply lost on the way may
still have been seen), so a client's epsilon is never under-reported. The accounting needs
nothing from the clients; a DP-SGD client's own step count (its reply's ``dp_steps`` metric)
is checked against the plan, and a mismatch stops the run.

Whose guarantee, against whom:

``dp_gaussian`` (unit: a client's whole dataset)
    each release is the Gaussian mechanism on the clipped update (sensitivity ``clip``,
    zero-out adjacency: the client's update replaced by zeros), seen by the coordinator.
    The coordinator picks who takes part, so there is no amplification by sampling: the
    sample rate is 1 and a client's epsilon composes over the rounds it took part in.
a method's own release (``Method.release_plan``; unit: one training sample of one client)
    FedTPF's shared features: each sample's features are clipped and noised once, by medfl at
    the client after the method's client step (``SampleRelease``), the
    Gaussian mechanism at sample rate 1 accounted by Opacus's accountant (``feature_gaussian``)
    or the Laplace mechanism with its pure epsilon, composed by summation
    (``feature_laplace``, accountant ``laplace``). A release with noise multiplier 0 (a
    measurement with the noise off, or noise of a fixed variance on unclipped features,
    which no sensitivity bounds) records an infinite epsilon. The method's release is asked
    again when it is recorded, so a clip the method chose during the run (from public data,
    no privacy cost) is the one ``privacy.csv`` shows; a release may name what its epsilon
    does not cover (``Release.not_covered``: the summary lists it).
``dp_sgd`` (unit: one training sample of one client)
    Opacus's DP-SGD with Poisson sampling at rate ``1 / ceil(N_k / batch_size)`` for
    ``epochs * ceil(N_k / batch_size)`` steps per local update, composed over the client's
    updates; each client's epsilon is its own (its own N_k and steps).

What the epsilon does not cover: the training metrics a reply carries (mean loss, step
counts), ``num_examples``, evaluation and validation scalars, and reply entries other than
the filtered model state (``PrivacyPlan.uncovered``); the summary lists them. What the run
sends in the clear beside its releases (``cross_test``'s evaluation models, with the opt-in
``fl.cross_test: {"under_dp": "send_models"}``: :meth:`PrivacyPlan.send_in_clear`) voids
the guarantee: ``config.json`` and the summary then say ``"private": false`` and name it
under ``sent_in_clear``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import pandas as pd

from medfl.filters import FilterChain
from medfl.method import Federation, Method, OwnDp
from medfl.privacy.accounting import PrivacyConfigError, check_budget, epsilon_spent, noise_for_epsilon
from medfl.privacy.feature_release import method_release
from medfl.seeding import round_half_up

__all__ = ["PrivacyPlan", "PrivacyLedger", "DpSgdPlan", "PRIVACY_COLUMNS", "planned_releases",
           "RELEASE_GUARD_NOTE", "UNNOISED_RELEASE_NOTE"]

#: What the content guard does with a method's noised per-sample release (``config.json``).
RELEASE_GUARD_NOTE = ("the content guard checks the released features as they leave, after medfl's noise; "
                      "every other reply key as the method returned it")
#: What happens to a release without noise (``epsilon: null``): ``config.json`` and ``summary.json``.
UNNOISED_RELEASE_NOTE = ("not private: the features are sent clipped, without noise; the content guard checks them "
                         "as the method returned them and as they leave, and stops the run if they repeat the "
                         "client's images")

#: Columns of ``privacy.csv``.
PRIVACY_COLUMNS = ["round", "client_id", "mechanism", "unit", "noise_multiplier", "clip", "steps", "total_steps",
                   "sample_rate", "epsilon", "delta", "accountant"]


def planned_releases(federation: Federation, rounds: int | None = None) -> dict[str, int]:
    """How many rounds each training client takes part in over ``rounds`` (default: the
    federation's), from the seeded sampling schedule."""
    counts = {cid: 0 for cid in federation.client_ids}
    for r in range(1, int(rounds or federation.rounds) + 1):
        for cid in federation.sample(r):
            counts[cid] += 1
    return counts


@dataclass
class DpSgdPlan:
    """DP-SGD (``train.dp``) resolved per client.

    Attributes:
        settings: the checked ``train.dp`` section (:func:`medfl.config.check_dp_sgd`).
        noise: each client's noise multiplier.
        sample_rate: each client's Poisson sampling rate.
        steps: each client's optimizer steps per local update.
        model_fix: what Opacus's validator replaced in the model (e.g. BatchNorm -> GroupNorm).
    """

    settings: dict[str, Any]
    noise: dict[str, float]
    sample_rate: dict[str, float]
    steps: dict[str, int]
    model_fix: list[str] = field(default_factory=list)


class PrivacyPlan:
    """The DP a run applies, resolved at the coordinator before training.

    Args:
        chain: the run's reply filter chain (already checked against the method).
        federation: the run's federation; its model spec gains ``dp_compatible`` when
            DP-SGD is on (Opacus's validator replaces BatchNorm by GroupNorm everywhere).
        method: the coordinator's method (its reply keys, for ``uncovered``).
        where: config location for error messages.

    Raises:
        PrivacyConfigError: a budget no noise can reach, delta >= 1/N, a model Opacus cannot
            train, a method without DP-SGD support.
    """

    def __init__(self, chain: FilterChain, federation: Federation, method: Method, where: str = "fl") -> None:
        self.chain = chain
        self.federation = federation
        self.chain_keys = list(type(method).reply_state)
        #: the method's own per-sample release (``Method.release_plan``), or None
        self.method_release = method_release(method)
        self.method_target = getattr(method, "epsilon", None) if self.method_release is not None else None
        chain.plan(federation, f"{where}, filters")
        self.dp_sgd: DpSgdPlan | None = None
        dp = federation.train.get("dp")
        if dp:
            self.dp_sgd = self._plan_dp_sgd(dict(dp), federation, type(method), f"{where}, train.dp")
        #: the DP the method applies in its own client step (``Method.own_dp``), or None
        self.own: OwnDp | None = self._check_own(method.own_dp(federation), method, federation, where)
        self.uncovered: list[str] = []
        if self.private:
            self.uncovered = ["training metrics in replies (mean loss, step counts)", "num_examples",
                              "evaluation and validation scalars"]
        self._extra: set[str] = set()
        #: what the run sends in the clear beside its DP releases (:meth:`send_in_clear`)
        self.in_clear: list[str] = []
        rel = self.method_release
        if rel is not None:
            self.uncovered += [f"labels and everything else in the release replies beside the features "
                               f"({sorted(rel.keys)}: labels travel in the clear"
                               f"{f' under {rel.labels!r}' if rel.labels else ''})",
                               "every other reply entry (model states are sent without DP)"]
        for rel in [*chain.releases(), *([self.method_release] if self.method_release is not None else [])]:
            self.uncovered += [u for u in rel.not_covered if u not in self.uncovered]
        self._method = method
        if self.own is not None:
            self.uncovered.append(f"{self.own.mechanism} is applied by method {method.name!r}'s own code (approved at "
                                  "each site), not by medfl: medfl accounts it from the method's declaration and "
                                  "checks the steps each client reports")

    def _check_own(self, own: Any, method: Method, federation: Federation, where: str) -> OwnDp | None:
        """``Method.own_dp``'s declaration, checked: a known accountant, a unit, a name that is
        not one of medfl's mechanisms, and for every training client a noise multiplier >= 0,
        a sampling rate in (0, 1], a whole number of steps, a positive clip and delta < 1.

        Raises:
            PrivacyConfigError: naming the method and the field.
        """
        if own is None:
            return None
        at = f"{where}: method {method.name!r}'s own_dp()"
        if not isinstance(own, OwnDp):
            raise PrivacyConfigError(f"{at} returned {type(own).__name__}, expected medfl.OwnDp or None")
        taken = {"dp_sgd", *(r.mechanism for r in self.chain.releases())}
        if self.method_release is not None:
            taken.add(self.method_release.mechanism)
        if not own.mechanism or own.mechanism in taken or own.mechanism in ("dp_gaussian", "quantize"):
            raise PrivacyConfigError(f"{at}: mechanism {own.mechanism!r} is empty or one of medfl's own "
                                     f"({sorted(taken | {'dp_gaussian'})}); give it a name of its own")
        if own.unit not in ("sample", "client"):
            raise PrivacyConfigError(f"{at}: unit {own.unit!r}, expected 'sample' or 'client'")
        if own.accountant not in ("rdp", "prv", "gdp"):
            raise PrivacyConfigError(f"{at}: accountant {own.accountant!r}, expected rdp, prv or gdp")
        if not (own.clip > 0 and math.isfinite(own.clip)) or not 0 < own.delta < 1:
            raise PrivacyConfigError(f"{at}: clip {own.clip!r} must be > 0 and delta {own.delta!r} in (0, 1)")
        for cid in federation.client_ids:
            try:
                sigma, q, steps = (own.per_client(f, cid) for f in ("noise_multiplier", "sample_rate", "steps"))
            except KeyError:
                raise PrivacyConfigError(f"{at}: no noise_multiplier, sample_rate or steps for client {cid}") from None
            if not (isinstance(sigma, (int, float)) and sigma >= 0 and math.isfinite(sigma)):
                raise PrivacyConfigError(f"{at}: noise_multiplier {sigma!r} of client {cid} must be a number >= 0")
            if not (isinstance(q, (int, float)) and 0 < q <= 1):
                raise PrivacyConfigError(f"{at}: sample_rate {q!r} of client {cid} must be in (0, 1]")
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
                raise PrivacyConfigError(f"{at}: steps {steps!r} of client {cid} must be a whole number >= 0")
        return own

    def note_reply(self, payload: dict[str, Any]) -> None:
        """Note reply entries a DP filter chain did not cover (entries outside the method's
        ``reply_state``, e.g. FedKPer's aggregation score): they join :attr:`uncovered`."""
        if not self.chain.releases():
            return
        extra = set(payload) - set(self.chain_keys) - self._extra
        if extra:
            self._extra |= extra
            self.uncovered = [u for u in self.uncovered if not u.startswith("reply entries")]
            self.uncovered.append(f"reply entries outside the filtered model state: {sorted(self._extra)}")

    def send_in_clear(self, what: str) -> None:
        """Record that the run sends ``what`` (client data or models no release covers, e.g.
        ``cross_test``'s evaluation models) in the clear: ``config.json`` and the summary then
        say the run is not private (``"private": false``, the summary's ``epsilon`` null) and
        list ``what`` under ``sent_in_clear`` and ``not_covered``; ``privacy.csv`` still
        records what the releases spent."""
        if what not in self.in_clear:
            self.in_clear.append(what)
            self.uncovered.append(what)

    @property
    def private(self) -> bool:
        """Whether the run makes any DP release (the ledger records them; whether the run as
        a whole is private also needs :attr:`in_clear` empty)."""
        return (bool(self.chain.releases()) or self.dp_sgd is not None or self.method_release is not None
                or self.own is not None)

    # ------------------------------------------------------------------ DP-SGD
    @staticmethod
    def _plan_dp_sgd(dp: dict[str, Any], federation: Federation, cls: type[Method], where: str) -> DpSgdPlan:
        from medfl.privacy.dp_sgd import make_private_model, planned_steps

        if not cls.supports_dp_sgd:
            raise PrivacyConfigError(f"{where}: method {cls.name!r} does not support DP-SGD")
        train = federation.train
        bs, epochs = int(train.get("batch_size", 16)), int(train.get("epochs", 1))
        rounds = planned_releases(federation)
        noise, rate, steps = {}, {}, {}
        for cid in federation.client_ids:
            n = int(federation.num_examples.get(cid, 0))
            check_budget(dp.get("epsilon"), float(dp["delta"]), max(n, 1), f"{where} (client {cid})")
            steps[cid], rate[cid] = planned_steps(n, bs, epochs)
            if dp.get("noise_multiplier") is not None:
                noise[cid] = float(dp["noise_multiplier"])
            else:
                # a client the schedule never samples still gets the noise of one update
                noise[cid] = noise_for_epsilon(float(dp["epsilon"]), float(dp["delta"]), rate[cid],
                                               steps[cid] * max(rounds[cid], 1), dp["accountant"])
        spec = federation.model_spec()
        from medfl.models.registry import build_model

        _, fixed = make_private_model(build_model(spec), where=f"model {spec['name']!r}")
        federation.model = {**federation.model, "dp_compatible": True}
        return DpSgdPlan(settings=dp, noise=noise, sample_rate=rate, steps=steps, model_fix=fixed)

    def client_train(self, client_id: str) -> dict[str, Any]:
        """A client's local-training settings: the run's, with ``dp`` resolved for it
        (its own ``noise_multiplier``) when DP-SGD is on."""
        train = dict(self.federation.train)
        if self.dp_sgd is not None and client_id in self.dp_sgd.noise:
            train["dp"] = {**self.dp_sgd.settings, "noise_multiplier": self.dp_sgd.noise[client_id]}
        return train

    def describe(self) -> dict[str, Any]:
        """The plan as JSON for ``config.json`` (what is noised, with what, and what is not covered)."""
        # a release without noise (FedTPF's epsilon null, a fixed variance) makes the plan not private
        unnoised = self.method_release is not None and not self.method_release.noise_multiplier > 0
        out: dict[str, Any] = {"private": self.private and not self.in_clear and not unnoised,
                               "filters": self.chain.specs()}
        if self.in_clear:
            out["sent_in_clear"] = list(self.in_clear)
        for rel in self.chain.releases():
            out[rel.mechanism] = {"unit": rel.unit, "noise_multiplier": rel.noise_multiplier, "clip": rel.clip,
                                  "sample_rate": rel.sample_rate, "delta": rel.delta, "accountant": rel.accountant,
                                  "planned_releases": planned_releases(self.federation)}
        rel = self.method_release
        if rel is not None:
            out[rel.mechanism] = {"unit": rel.unit, "noise_multiplier": rel.noise_multiplier, "clip": _finite(rel.clip),
                                  "sample_rate": rel.sample_rate, "delta": rel.delta, "accountant": rel.accountant,
                                  "target_epsilon": self.method_target,
                                  "private": rel.noise_multiplier > 0,
                                  "releases": "each training sample once, when the method asks for it",
                                  "keys": list(rel.keys), "labels": rel.labels,
                                  "performed_by": "medfl at the client, after the method's client step returned the "
                                                  "features unnoised",
                                  "content_guard": RELEASE_GUARD_NOTE if rel.noised else UNNOISED_RELEASE_NOTE}
        if self.dp_sgd is not None:
            p = self.dp_sgd
            out["dp_sgd"] = {"unit": "sample", **p.settings, "noise_multiplier": p.noise, "sample_rate": p.sample_rate,
                             "steps_per_update": p.steps, "planned_updates": planned_releases(self.federation),
                             "model_fix": p.model_fix}
        own = self.own
        if own is not None:
            ids = self.federation.client_ids
            out[own.mechanism] = {"unit": own.unit, "performed_by": "method", "statement": own.statement,
                                  "noise_multiplier": {c: float(own.per_client("noise_multiplier", c)) for c in ids},
                                  "sample_rate": {c: float(own.per_client("sample_rate", c)) for c in ids},
                                  "steps_per_update": {c: int(own.per_client("steps", c)) for c in ids},
                                  "clip": own.clip, "delta": own.delta, "accountant": own.accountant,
                                  "planned_updates": planned_releases(self.federation)}
        if self.uncovered:
            out["not_covered"] = self.uncovered
        return out

    def released_under(self, records: list[dict[str, Any]] | None) -> Callable[[], None]:
        """Until the returned function is called, the plan's filter chain and DP-SGD noise
        are those a round was released under before a crash (``records``: that round's
        :class:`medfl.privacy.releases.ReleaseJournal` records, which hold the resolved filter
        entries and each client's DP-SGD settings), so the round re-runs as it was released
        (the same bytes come back) and is accounted at the noise it was released with; a
        noise re-derived for a new number of rounds applies from the next round. Nothing
        changes for ``None`` or no records."""
        saved = (self.chain, self.dp_sgd)
        if records:
            self.chain = FilterChain.from_specs(records[0]["filters"], "filters of a round released before a crash")
            if self.dp_sgd is not None:
                noise = {**self.dp_sgd.noise, **{str(r["client"]): float(r["dp"]["noise_multiplier"])
                                                 for r in records if isinstance(r.get("dp"), dict)}}
                self.dp_sgd = replace(self.dp_sgd, noise=noise)

        def restore() -> None:
            self.chain, self.dp_sgd = saved
        return restore

    def release_as_made(self) -> Any:
        """The method's own release as the method states it now (``Method.release_plan``
        asked again): a clip the method chose during the run at no privacy cost (from public
        data) is recorded as it was used. The mechanism and noise multiplier must be the
        planned ones.

        Raises:
            PrivacyConfigError: the method changed its release's mechanism or noise since the
                plan (its epsilon would not be the planned one).
        """
        planned = self.method_release
        now = self._method.release_plan() if planned is not None else None
        if planned is None or now is None:
            return planned
        if now.mechanism != planned.mechanism or now.noise_multiplier != planned.noise_multiplier:
            raise PrivacyConfigError(
                f"method {self._method.name!r}: its release is now {now.mechanism} at noise multiplier "
                f"{now.noise_multiplier:.6g}, planned as {planned.mechanism} at {planned.noise_multiplier:.6g}")
        return now


class PrivacyLedger:
    """Every client's DP releases and epsilon, round by round (``privacy.csv``).

    Args:
        plan: the run's :class:`PrivacyPlan`.
    """

    def __init__(self, plan: PrivacyPlan) -> None:
        self.plan = plan
        self.history: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
        self.rows: list[dict[str, Any]] = []

    def load(self, df: pd.DataFrame) -> None:
        """Rebuild the histories from ``privacy.csv`` rows (a resumed run)."""
        self.rows = df.to_dict("records")
        self.history.clear()
        for row in self.rows:
            key = (str(row["client_id"]), str(row["mechanism"]))
            self.history.setdefault(key, []).append(
                (float(row["noise_multiplier"]), float(row["sample_rate"]), int(row["steps"])))

    def changed_noise(self) -> list[str]:
        """After :meth:`load`: the mechanisms and clients whose planned noise multiplier
        differs from the one their history was spent at (a run resumed with another number of
        rounds re-derives the noise for a target epsilon), one line each. The epsilon the
        ledger reports stays exact; the target may no longer hold."""
        planned: dict[tuple[str, str], float] = {}
        for rel in self.plan.chain.releases():
            for cid in self.plan.federation.client_ids:
                planned[(cid, rel.mechanism)] = rel.noise_multiplier
        if self.plan.dp_sgd is not None:
            for cid, sigma in self.plan.dp_sgd.noise.items():
                planned[(cid, "dp_sgd")] = sigma
        if self.plan.method_release is not None:
            for cid in self.plan.federation.client_ids:
                planned[(cid, self.plan.method_release.mechanism)] = self.plan.method_release.noise_multiplier
        if self.plan.own is not None:
            for cid in self.plan.federation.client_ids:
                planned[(cid, self.plan.own.mechanism)] = float(self.plan.own.per_client("noise_multiplier", cid))
        out = []
        for (cid, mech), hist in sorted(self.history.items()):
            now = planned.get((cid, mech))
            if hist and now is not None and abs(hist[-1][0] - now) > 1e-12 * max(1.0, now):
                out.append(f"{mech}: client {cid} spent at noise multiplier {hist[-1][0]:.4g}, continues at {now:.4g}")
        return out

    def record(self, round: int, addressed: dict[str, int], reported_steps: dict[str, float] | None = None,
               released: list[str] | None = None, own_steps: dict[str, float] | None = None,
               extra: dict[str, int] | None = None) -> list[dict[str, Any]]:
        """Record round ``round``: ``addressed`` maps each client sent a training instruction
        to how many times (train steps), in the order its rows are written. ``reported_steps`` (DP-SGD clients' ``dp_steps``)
        is checked against the plan. ``released``: the clients asked for the method's own
        per-sample release this round (``Method.round_releases``), one release each.
        ``own_steps``: what each client reported in the method's own DP's ``steps_metric``
        (:class:`~medfl.method.OwnDp`), checked against its declaration.
        ``extra``: releases of the round's filter chain and DP-SGD the coordinator received
        beyond ``addressed`` (a round re-run after a crash whose first replies differ from
        the second: :meth:`medfl.privacy.releases.ReleaseJournal.extra`), counted too.

        Raises:
            PrivacyConfigError: a client reports other DP-SGD steps (or other steps of the
                method's own DP) than planned (the accounting would be wrong).
        """
        new = []
        extra = extra or {}
        seen = {cid: addressed.get(cid, 0) + extra.get(cid, 0) for cid in [*addressed, *extra]}
        for rel in self.plan.chain.releases():
            for cid in seen:
                new.append(self._add(round, cid, rel.mechanism, rel.unit, rel.noise_multiplier, rel.clip,
                                     rel.sample_rate, seen[cid], rel.delta, rel.accountant))
        p = self.plan.dp_sgd
        if p is not None:
            for cid in seen:
                planned = p.steps[cid] * addressed.get(cid, 0)
                got = (reported_steps or {}).get(cid)
                if got is not None and round_half_up(got) != planned:
                    raise PrivacyConfigError(
                        f"round {round}: client {cid} reports {got:g} DP-SGD steps, the privacy plan accounts "
                        f"{planned}; its epsilon would be wrong (a method or dataset that changes the number of "
                        "local steps cannot use train.dp)")
                new.append(self._add(round, cid, "dp_sgd", "sample", p.noise[cid], float(p.settings["max_grad_norm"]),
                                     p.sample_rate[cid], p.steps[cid] * seen[cid], float(p.settings["delta"]),
                                     p.settings["accountant"]))
        own = self.plan.own
        if own is not None:
            for cid in addressed:
                planned = int(own.per_client("steps", cid)) * addressed[cid]
                got = (own_steps or {}).get(cid)
                if got is not None and round_half_up(got) != planned:
                    raise PrivacyConfigError(
                        f"round {round}: client {cid} reports {got:g} steps of {own.mechanism} "
                        f"({own.steps_metric!r}), the method's own_dp() declares {planned}; its epsilon would be wrong")
                new.append(self._add(round, cid, own.mechanism, own.unit, float(own.per_client("noise_multiplier", cid)),
                                     float(own.clip), float(own.per_client("sample_rate", cid)), planned,
                                     float(own.delta), own.accountant))
        rel = self.plan.release_as_made() if released else None
        if rel is not None:
            for cid in released or []:
                new.append(self._add(round, str(cid), rel.mechanism, rel.unit, rel.noise_multiplier, rel.clip,
                                     rel.sample_rate, 1, rel.delta, rel.accountant))
        self.rows.extend(new)
        return new

    def _add(self, round: int, cid: str, mech: str, unit: str, sigma: float, clip: float, q: float, steps: int,
             delta: float, accountant: str) -> dict[str, Any]:
        hist = self.history.setdefault((cid, mech), [])
        if steps > 0:
            if hist and hist[-1][0] == sigma and hist[-1][1] == q:
                hist[-1] = (sigma, q, hist[-1][2] + steps)
            else:
                hist.append((sigma, q, steps))
        eps = _epsilon(hist, delta, accountant)
        return {"round": round, "client_id": cid, "mechanism": mech, "unit": unit, "noise_multiplier": sigma,
                "clip": clip, "steps": steps, "total_steps": sum(h[2] for h in hist), "sample_rate": q,
                "epsilon": eps, "delta": delta, "accountant": accountant}

    def frame(self) -> pd.DataFrame:
        """The rows as a DataFrame with :data:`PRIVACY_COLUMNS`."""
        return pd.DataFrame(self.rows, columns=PRIVACY_COLUMNS)

    def summary(self) -> dict[str, Any]:
        """The ``privacy`` block of ``summary.json``: per mechanism the worst client's final
        epsilon (and which client), delta, accountant and noise; ``epsilon`` is the worst
        over mechanisms (``null`` for a run without DP, which guarantees nothing)."""
        plan = self.plan
        out: dict[str, Any] = {"private": plan.private, "epsilon": None, "mechanisms": {}}
        if not plan.private:
            return out
        df = self.frame()
        for mech, g in df.groupby("mechanism", sort=False):
            last = g.groupby("client_id").tail(1)
            worst = last.loc[last["epsilon"].astype(float).idxmax()]
            block = {"unit": str(worst["unit"]), "epsilon": float(worst["epsilon"]),
                     "worst_client": str(worst["client_id"]), "delta": float(worst["delta"]),
                     "accountant": str(worst["accountant"]),
                     "per_client": {str(c): float(e) for c, e in zip(last["client_id"], last["epsilon"])},
                     "noise_multiplier": {str(c): float(s) for c, s in zip(last["client_id"], last["noise_multiplier"])},
                     "clip": _finite(float(worst["clip"]))}
            target = _target(plan, str(mech))
            if target is not None:
                block["target_epsilon"] = target
            if self.plan.own is not None and mech == self.plan.own.mechanism:
                block["performed_by"] = "method"
            out["mechanisms"][str(mech)] = block
        eps = [b["epsilon"] for b in out["mechanisms"].values()]
        out["epsilon"] = max(eps) if eps else 0.0
        open_ = [m for m, b in out["mechanisms"].items() if not math.isfinite(b["epsilon"])]
        if open_:
            # a release with the noise off (a measurement): no guarantee; JSON has no infinity
            out["private"], out["epsilon"] = False, None
            out["non_private_releases"] = open_
            rel = plan.method_release
            if rel is not None and rel.mechanism in open_ and not rel.noised:
                out["unnoised_release"] = UNNOISED_RELEASE_NOTE
            for m in open_:
                block = out["mechanisms"][m]
                block["epsilon"] = None
                block["per_client"] = {c: (e if math.isfinite(e) else None) for c, e in block["per_client"].items()}
        if plan.in_clear:
            # models (or data) left the clients outside every release: no guarantee for the run
            out["private"], out["epsilon"] = False, None
            out["sent_in_clear"] = list(plan.in_clear)
        out["not_covered"] = list(plan.uncovered)
        return out


def _finite(value: float) -> float | None:
    """``value``, or ``None`` where it is not finite (an unclipped release's clip): JSON has
    no infinity."""
    return float(value) if math.isfinite(float(value)) else None


def _epsilon(hist: list[tuple[float, float, int]], delta: float, accountant: str) -> float:
    """Epsilon of a history of ``(noise_multiplier, sample_rate, steps)``: Opacus's
    accountant; for the Laplace mechanism (``accountant == "laplace"``, noise multiplier
    ``1 / epsilon`` of one release) the sum of the releases' pure epsilons; infinite when
    any release carried no noise."""
    if not hist:
        return 0.0
    if any(sigma <= 0 for sigma, _, steps in hist if steps > 0):
        return float("inf")
    if accountant == "laplace":
        return float(sum(steps / sigma for sigma, _, steps in hist))
    return epsilon_spent(hist, delta, accountant)


def _target(plan: PrivacyPlan, mech: str) -> float | None:
    if mech == "dp_sgd" and plan.dp_sgd is not None:
        return plan.dp_sgd.settings.get("epsilon")
    if plan.method_release is not None and mech == plan.method_release.mechanism:
        return plan.method_target
    for f in plan.chain.filters:
        rel = f.release()
        if rel is not None and rel.mechanism == mech:
            return getattr(f, "epsilon", None)
    return None
