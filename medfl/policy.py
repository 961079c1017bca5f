"""A site's own privacy policy: the least privacy its operator accepts.

The coordinator chooses a run's reply filters, their noise and DP-SGD; a site's approvals
(:mod:`medfl.approval`) pin which *code* runs, not with which parameters. The policy is
the site's say over the parameters: the operator writes it in the ``policy`` section of
the site's approvals file (``medfl policy --file approvals.json ...``), and the site checks
every message against it (:meth:`medfl.site.Site.check`), after the approvals and
before the method's code runs, refusing with the rule that is broken::

    "policy": {
      "mechanisms": ["dp_gaussian", "dp_sgd"],
      "max_epsilon": 3.0,
      "max_epsilon_total": 8.0,
      "max_epsilon_per_release": 1.0,
      "max_delta": 1e-5,
      "min_noise_multiplier": 0.8,
      "required_filters": [{"name": "quantize", "max": {"bits": 8}}],
      "cross_test": false
    }

Each rule is checked twice: against the plan the coordinator sends with every message (a run
whose plan breaks a rule is refused before any training), and against what the site itself
has released (:mod:`medfl.budget`): before every DP reply leaves, the site composes its own
records of what it released with what the reply would add, and refuses the reply that would
pass a cap. The coordinator's ``releases`` number is a plan the site checks requests against
(a round outside it, a second training reply in one round, a per-sample release asked twice,
more release rounds than planned are refused), never a factor it trusts.

``mechanisms``
    the DP mechanisms the site accepts (``dp_gaussian``, ``dp_sgd``, a method's own release
    such as FedTPF's ``feature_gaussian``, a method's own DP declared by ``own_dp``); a run
    using another one is refused.
``max_epsilon``
    the largest epsilon this site's data may spend over the run. The site computes it
    itself, with Opacus's accountant, from what it applies: the noise multiplier, clip
    rate and delta of each release (the resolved filter entries, ``train.dp``, the
    method's ``release_plan`` and ``own_dp``) and its own training-set size (DP-SGD's steps
    and sample rate); mechanisms compose by adding their epsilons. At a run's start it
    projects the plan (``releases`` of the control record); before every DP reply it counts
    what it has released itself (``<state-dir>/budget.jsonl``). A run without any DP release
    has an infinite epsilon and is refused. It caps each run anew: ``medfl policy
    --max-epsilon`` asks for ``--max-epsilon-total`` too (a number, or ``none`` for no cap
    over runs).
``max_epsilon_total``
    the largest epsilon this site's data set may spend over every run the site serves
    (its budget file across runs, composed the same way): a run whose plan would pass it,
    and any reply that would, is refused.
``max_epsilon_per_release``
    the same for one release (one reply of ``dp_gaussian``, one DP-SGD update, one
    release of a method's features).
``max_delta``
    the largest delta of any release (a filter's, ``train.dp``'s, a method's per-sample
    release's and its own DP's); unset, :data:`DEFAULT_MAX_DELTA` (1e-5). A release asking a
    larger delta is refused (an (epsilon, 0.5) guarantee is none), and every epsilon the site
    computes (a release's, a run's, over every run) is at this delta, whatever delta the
    coordinator named: each mechanism's history composed by its accountant at the site's
    delta, the mechanisms' epsilons added (so the deltas add too: at most one ``max_delta``
    per mechanism).
``min_noise_multiplier``
    the smallest noise multiplier (noise std over the clip) of any Gaussian release.
``required_filters``
    reply filters the run must apply, each ``{"name": ..., "max": {param: bound},
    "min": {param: bound}}`` over its resolved parameters (``quantize`` with ``bits`` at
    most 8).
``cross_test``
    whether the site sends its evaluation model for the Global Test of other sites. A model
    sent for ``cross_test`` leaves without noise (its BatchNorm statistics are averages of the
    site's images), so no epsilon covers it: unset, a site with ``max_epsilon`` or
    ``max_epsilon_total`` never sends it and any other site does; ``true`` sends it whatever
    the caps, ``false`` never.

A rule the site cannot check, because the coordinator did not say how many releases the
run plans, refuses the message. The in-process engine and the simulation runtime check no
policy (the user runs every party).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

from medfl.code_identity import ApprovalError

__all__ = ["PolicyError", "PolicyRefusal", "SitePolicy", "POLICY_RULES", "DEFAULT_MAX_DELTA", "Spend",
           "composed_epsilon", "site_releases", "request_releases"]

#: The rules a policy may set, as they are spelt in the approvals file.
POLICY_RULES: tuple[str, ...] = ("mechanisms", "max_epsilon", "max_epsilon_total", "max_epsilon_per_release",
                                 "max_delta", "min_noise_multiplier", "required_filters", "cross_test")

#: The largest delta a site with a policy accepts when the policy sets no ``max_delta``.
DEFAULT_MAX_DELTA = 1e-5


@dataclass(frozen=True)
class Spend:
    """One DP mechanism applied to one reply of a site, as the site accounts it.

    Attributes:
        mechanism: ``dp_gaussian``, ``dp_sgd``, a method's release (``feature_gaussian``) or
            its own DP (``Method.own_dp``'s name).
        unit: ``client`` or ``sample``.
        noise_multiplier: noise std over the sensitivity (for ``laplace``: 1 / epsilon).
        sample_rate: the sampling rate of one step (1 for a release of the whole set).
        steps: applications of the mechanism in this reply (DP-SGD's optimizer steps).
        delta: the mechanism's delta.
        accountant: ``rdp``, ``prv``, ``gdp`` or ``laplace``.
        clip: the sensitivity (for the ledger's description).
        per_round: whether the run repeats it in every planned release (filters, DP-SGD, own
            DP) or makes it once (a method's per-sample release).
    """

    mechanism: str
    unit: str
    noise_multiplier: float
    sample_rate: float
    steps: int
    delta: float
    accountant: str
    clip: float = math.inf
    per_round: bool = True

    def ledger_entry(self) -> dict[str, Any]:
        """What the site's release ledger (:class:`medfl.privacy.releases.SiteReleaseLedger`) says of it."""
        return {"mechanism": self.mechanism, "noise_multiplier": float(self.noise_multiplier), "clip": float(self.clip)}


def composed_epsilon(entries: Iterable[dict[str, Any] | Spend], delta: float) -> float:
    """The epsilon of a set of spends (budget records or :class:`Spend`) at the site's
    ``delta`` (whatever delta each names): per (mechanism, accountant) the history
    ``(noise_multiplier, sample_rate, steps)`` composed by Opacus's accountant (``privacy.csv``'s
    arithmetic, :mod:`medfl.privacy.ledger`), the groups' epsilons added. Infinite when any
    spend has no noise."""
    groups: dict[tuple[str, str], list[tuple[float, float, int]]] = {}
    for e in entries:
        d = asdict(e) if isinstance(e, Spend) else e
        if int(d["steps"]) <= 0:
            continue
        key = (str(d["mechanism"]), str(d["accountant"]))
        groups.setdefault(key, []).append((float(d["noise_multiplier"]), float(d["sample_rate"]), int(d["steps"])))
    return float(sum(_epsilon(hist, delta, acc) for (_, acc), hist in groups.items()))


class PolicyError(ApprovalError):
    """A site's policy section is malformed (the message names the field and what was expected)."""


class PolicyRefusal(ApprovalError):
    """A message asks for less privacy than the site's policy accepts (the message names the rule)."""


def _positive(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise PolicyError(f"{where}: expected a finite number > 0, got {value!r}")
    return float(value)


def _bounds(value: Any, where: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise PolicyError(f"{where}: expected an object of parameter bounds like {{\"bits\": 8}}, got {value!r}")
    out = {}
    for k, v in value.items():
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
            raise PolicyError(f"{where}[{k!r}]: expected a finite number, got {v!r}")
        out[str(k)] = float(v)
    return out


@dataclass(frozen=True)
class SitePolicy:
    """The least privacy a site accepts (see the module docstring for each rule).

    Attributes:
        mechanisms: DP mechanisms accepted (``None``: any).
        max_epsilon: largest epsilon over the run (``None``: no cap).
        max_epsilon_total: largest epsilon over every run on the site's data set (``None``: no cap).
        max_epsilon_per_release: largest epsilon of one release (``None``: no cap).
        max_delta: largest delta of any release, and the delta every epsilon is computed at
            (``None``: :data:`DEFAULT_MAX_DELTA`, :attr:`delta`).
        min_noise_multiplier: smallest noise multiplier of a Gaussian release (``None``: any).
        required_filters: filters the run must apply, with bounds on their parameters.
        cross_test: whether the site sends its evaluation model for cross_test (``None``:
            only where no epsilon cap is set, :attr:`sends_models`).
    """

    mechanisms: tuple[str, ...] | None = None
    max_epsilon: float | None = None
    max_epsilon_per_release: float | None = None
    min_noise_multiplier: float | None = None
    required_filters: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    cross_test: bool | None = None
    max_epsilon_total: float | None = None
    max_delta: float | None = None

    @property
    def delta(self) -> float:
        """The largest delta this site accepts, and the delta it computes every epsilon at."""
        return DEFAULT_MAX_DELTA if self.max_delta is None else self.max_delta

    @property
    def capped(self) -> bool:
        """Whether the policy caps the epsilon a run or the site's data set may spend."""
        return self.max_epsilon is not None or self.max_epsilon_total is not None

    @property
    def sends_models(self) -> bool:
        """Whether the site sends its evaluation model for ``cross_test``: as ``cross_test``
        says, and where it is unset only when no epsilon cap is set (a model leaves without
        noise)."""
        return self.cross_test if self.cross_test is not None else not self.capped

    @classmethod
    def from_dict(cls, data: Any, where: str = "policy") -> "SitePolicy":
        """Read a ``policy`` section.

        Raises:
            PolicyError: not an object, an unknown rule, a value of the wrong type (naming
                ``where``, the rule and what was expected).
        """
        if not isinstance(data, dict):
            raise PolicyError(f"{where}: expected an object of rules ({', '.join(POLICY_RULES)}), got {data!r}")
        unknown = sorted(set(data) - set(POLICY_RULES))
        if unknown:
            raise PolicyError(f"{where}: unknown rule(s) {unknown}; rules: {', '.join(POLICY_RULES)}")
        mech = data.get("mechanisms")
        if mech is not None and (not isinstance(mech, list) or not all(isinstance(m, str) and m for m in mech)):
            raise PolicyError(f"{where}.mechanisms: expected a list of mechanism names like [\"dp_gaussian\", "
                              f"\"dp_sgd\"], got {mech!r}")
        caps = {k: None if data.get(k) is None else _positive(data[k], f"{where}.{k}") for k in _NUMBERS}
        if caps["max_delta"] is not None and caps["max_delta"] >= 1:
            raise PolicyError(f"{where}.max_delta: expected a delta in (0, 1) such as 1e-05, got {data['max_delta']!r}")
        filters = data.get("required_filters", [])
        if not isinstance(filters, list):
            raise PolicyError(f"{where}.required_filters: expected a list like [{{\"name\": \"quantize\", "
                              f"\"max\": {{\"bits\": 8}}}}], got {filters!r}")
        required = []
        for i, f in enumerate(filters):
            w = f"{where}.required_filters[{i}]"
            if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
                raise PolicyError(f"{w}: expected {{\"name\": FILTER, \"max\": {{...}}, \"min\": {{...}}}}, got {f!r}")
            extra = sorted(set(f) - {"name", "max", "min"})
            if extra:
                raise PolicyError(f"{w}: unknown key(s) {extra}; expected name, max, min")
            required.append({"name": f["name"], "max": _bounds(f.get("max", {}), f"{w}.max"),
                             "min": _bounds(f.get("min", {}), f"{w}.min")})
        cross = data.get("cross_test")
        if cross is not None and not isinstance(cross, bool):
            raise PolicyError(f"{where}.cross_test: expected true or false, got {cross!r}")
        return cls(mechanisms=None if mech is None else tuple(mech), required_filters=tuple(required),
                   cross_test=cross, **caps)

    def to_dict(self) -> dict[str, Any]:
        """The ``policy`` section as written in the approvals file (unset rules left out)."""
        out: dict[str, Any] = {}
        if self.mechanisms is not None:
            out["mechanisms"] = list(self.mechanisms)
        for k in _NUMBERS:
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.required_filters:
            out["required_filters"] = [{k: v for k, v in f.items() if v or k == "name"} for f in self.required_filters]
        if self.cross_test is not None:
            out["cross_test"] = self.cross_test
        return out

    def describe(self) -> list[str]:
        """One line per rule, for ``medfl policy --show`` and the site's start."""
        if not self.to_dict():
            return ["no rule: any privacy (or none) is accepted"]
        lines = []
        if self.mechanisms is not None:
            lines.append(f"mechanisms: only {', '.join(self.mechanisms) or 'none'}")
        for k, what in (("max_epsilon", "largest epsilon over a run"),
                        ("max_epsilon_total", "largest epsilon over every run on this site's data set"),
                        ("max_epsilon_per_release", "largest epsilon of one release"),
                        ("min_noise_multiplier", "smallest noise multiplier")):
            if getattr(self, k) is not None:
                lines.append(f"{k}: {what} {getattr(self, k):g}")
        if self.max_epsilon is not None and self.max_epsilon_total is None:
            lines.append("max_epsilon_total: none, so every run may spend max_epsilon anew on this site's data set")
        lines.append(f"max_delta: largest delta of any release, the delta every epsilon is computed at, "
                     f"{self.delta:g}{' (the default)' if self.max_delta is None else ''}")
        for f in self.required_filters:
            b = [f"{p} <= {v:g}" for p, v in f["max"].items()] + [f"{p} >= {v:g}" for p, v in f["min"].items()]
            lines.append(f"required_filters: {f['name']}{' with ' + ', '.join(b) if b else ''}")
        if self.cross_test is False:
            lines.append("cross_test: this site never sends its evaluation model")
        elif self.cross_test:
            lines.append("cross_test: this site sends its evaluation model (without noise) when asked")
        elif self.capped:
            lines.append("cross_test: not set, so this capped site never sends its evaluation model (it leaves "
                         "without noise); --cross-test yes sends it")
        return lines

    # ------------------------------------------------------------------ the site's check
    def check(self, control: dict[str, Any], num_examples: Callable[[], int], budget: Any = None) -> None:
        """Refuse a site message that asks for less privacy than this policy accepts.

        Args:
            control: the message's control record (method, resolved ``filters``, ``train``
                with its resolved ``dp``, ``releases``, ``want_model``).
            num_examples: this site's training-set size (called only for DP-SGD's steps).
            budget: the site's ``medfl.budget.SiteBudget`` (its ``spends()``): ``max_epsilon_total``
                projects the run's plan on top of what the other runs on its data set spent.

        Raises:
            PolicyRefusal: naming the rule, what the message asks for and what the policy accepts.
        """
        if not self.sends_models and control.get("want_model"):
            why = ("which its policy never sends" if self.cross_test is False else
                   "which a site with an epsilon cap sends only when its policy says cross_test: true (the model "
                   "leaves without noise; medfl policy --cross-test yes)")
            raise PolicyRefusal(f"rule cross_test: the coordinator asks for this site's evaluation model (cross_test), "
                                f"{why}; run without \"cross_test\" in eval_splits")
        if not isinstance(control.get("method"), dict):
            return   # hello: no data leaves but the split's sizes
        self._check_filters(list(control.get("filters") or []))
        releases = site_releases(control, num_examples)
        for r in releases:
            if self.mechanisms is not None and r.mechanism not in self.mechanisms:
                raise PolicyRefusal(f"rule mechanisms: the run releases with {r.mechanism}, this site accepts only "
                                    f"{', '.join(self.mechanisms) or 'no mechanism'}")
            if r.delta > self.delta:
                raise PolicyRefusal(f"rule max_delta: {r.mechanism} releases at delta {r.delta:g}, this site "
                                    f"accepts at most {self.delta:g} (medfl policy --max-delta)")
            if self.min_noise_multiplier is not None and r.accountant != "laplace" \
                    and r.noise_multiplier < self.min_noise_multiplier:
                raise PolicyRefusal(f"rule min_noise_multiplier: {r.mechanism} adds noise multiplier "
                                    f"{r.noise_multiplier:g}, this site requires at least {self.min_noise_multiplier:g}")
        if self.max_epsilon_per_release is not None:
            for r in releases:
                eps = _epsilon([(r.noise_multiplier, r.sample_rate, r.steps)], self.delta, r.accountant)
                if eps > self.max_epsilon_per_release:
                    raise PolicyRefusal(f"rule max_epsilon_per_release: one {r.mechanism} release spends epsilon "
                                        f"{eps:.4g} (noise multiplier {r.noise_multiplier:g}, at delta "
                                        f"{self.delta:g}), this site accepts at most {self.max_epsilon_per_release:g}")
        for cap, name in ((self.max_epsilon, "max_epsilon"), (self.max_epsilon_total, "max_epsilon_total")):
            if cap is not None and not releases:
                raise PolicyRefusal(f"rule {name}: the run makes no differential-privacy release (epsilon "
                                    f"infinite), this site accepts at most epsilon {cap:g}")
        if not self.capped:
            return
        count = control.get("releases")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise PolicyRefusal(f"rule {'max_epsilon' if self.max_epsilon is not None else 'max_epsilon_total'}: "
                                f"the coordinator does not say how many releases the run plans for this site "
                                f"(control record 'releases': {count!r}), so its epsilon cannot be checked")
        from dataclasses import replace

        # the plan projected: every per-round mechanism over the planned releases, a
        # per-sample release once (what the site then counts itself, reply by reply)
        plan = [replace(r, steps=r.steps * (count if r.per_round else 1)) for r in releases]
        mechs = ", ".join(sorted({r.mechanism for r in releases}))
        total = composed_epsilon(plan, self.delta)
        if self.max_epsilon is not None and total > self.max_epsilon:
            raise PolicyRefusal(f"rule max_epsilon: the run spends epsilon {total:.4g} of this site's data "
                                f"({mechs} over {count} planned release(s)), this site accepts at most "
                                f"{self.max_epsilon:g}")
        if self.max_epsilon_total is not None and budget is not None:
            run = str(control.get("run", ""))
            others = [r for r in budget.spends() if r.get("run") != run]
            total = composed_epsilon([*others, *plan], self.delta)
            if total > self.max_epsilon_total:
                runs = len({r["run"] for r in others})
                raise PolicyRefusal(f"rule max_epsilon_total: the run's plan ({mechs} over {count} planned "
                                    f"release(s)) on top of what {runs} earlier run(s) spent of this site's data set "
                                    f"({composed_epsilon(others, self.delta):.4g}) comes to epsilon {total:.4g}, this "
                                    f"site accepts at most {self.max_epsilon_total:g} in all")

    def _check_filters(self, filters: list[Any]) -> None:
        for req in self.required_filters:
            found = [f for f in filters if isinstance(f, dict) and f.get("name") == req["name"]]
            if not found:
                names = [f.get("name") for f in filters if isinstance(f, dict)]
                raise PolicyRefusal(f"rule required_filters: the run's reply filters {names or '(none)'} lack "
                                    f"{req['name']!r}, which this site requires")
            for f in found:
                for side, words, sign in (("max", "at most", 1), ("min", "at least", -1)):
                    for param, bound in req[side].items():
                        if not _number(f.get(param)) or sign * float(f[param]) > sign * bound:
                            raise PolicyRefusal(f"rule required_filters: filter {req['name']!r} has {param} "
                                                f"{f.get(param)!r}, this site requires {words} {bound:g}")


#: The rules that are one number > 0.
_NUMBERS = ("max_epsilon", "max_epsilon_total", "max_epsilon_per_release", "max_delta", "min_noise_multiplier")


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _epsilon(hist: list[tuple[float, float, int]], delta: float, accountant: str) -> float:
    from medfl.privacy.ledger import _epsilon as history_epsilon

    return history_epsilon(hist, delta, accountant)


def site_releases(control: dict[str, Any], num_examples: Callable[[], int], method: Any = None,
                  chain: Any = None) -> list[Spend]:
    """Every DP mechanism the message's run applies at this site, each as one application
    (:class:`medfl.budget.Spend`): the resolved filter chain's releases (built by the
    approved filter code), the resolved ``train.dp`` (DP-SGD, its steps and sample rate from
    this site's own training-set size), the method's ``release_plan`` (``per_round`` false:
    once per run) and its ``own_dp`` (as the approved method code computes it for this site).
    ``method`` and ``chain``: the message's method and filter chain, already built (default:
    built from ``control``)."""
    from medfl.config import build_method
    from medfl.filters import FilterChain

    out = []
    if chain is None:
        chain = FilterChain.from_specs(list(control.get("filters") or []), "filters sent to this site")
    for rel in chain.releases():
        out.append(Spend(rel.mechanism, rel.unit, float(rel.noise_multiplier), float(rel.sample_rate), 1,
                         float(rel.delta), rel.accountant, float(rel.clip)))
    dp = dict(control.get("train") or {}).get("dp")
    if isinstance(dp, dict) and dp:
        from medfl.privacy.dp_sgd import planned_steps

        train = dict(control["train"])
        steps, rate = planned_steps(max(int(num_examples()), 1), int(train.get("batch_size", 16)),
                                    int(train.get("epochs", 1)))
        out.append(Spend("dp_sgd", "sample", float(dp.get("noise_multiplier") or 0.0), rate, steps,
                         float(dp.get("delta", 1e-5)), str(dp.get("accountant", "rdp")),
                         float(dp.get("max_grad_norm", math.inf))))
    method = method if method is not None else build_method(dict(control["method"]))
    rel = method.release_plan()
    if rel is not None:
        out.append(Spend(rel.mechanism, rel.unit, float(rel.noise_multiplier), float(rel.sample_rate), 1,
                         float(rel.delta), rel.accountant, float(rel.clip), per_round=False))
    own = _own_dp(method, control, num_examples)
    if own is not None:
        cid = str(control.get("client"))
        out.append(Spend(own.mechanism, own.unit, float(own.per_client("noise_multiplier", cid)),
                         float(own.per_client("sample_rate", cid)), int(own.per_client("steps", cid)),
                         float(own.delta), own.accountant, float(own.clip)))
    return out


def request_releases(control: dict[str, Any], num_examples: Callable[[], int], method: Any,
                     is_release: bool, chain: Any = None) -> list[Spend]:
    """The DP mechanisms one training request applies at this site (what its reply spends):
    every per-round mechanism of :func:`site_releases`, and the method's per-sample release
    only when the request is that release (``is_release``: the instruction carries
    :data:`medfl.messages.RELEASE_FLAG`). Empty: the reply is no DP release."""
    return [r for r in site_releases(control, num_examples, method, chain) if r.per_round or is_release]


def _own_dp(method: Any, control: dict[str, Any], num_examples: Callable[[], int]) -> Any:
    """The method's own DP (``Method.own_dp``) as it applies at this site: asked with a
    federation of this site alone (its own training-set size, the message's ``train``
    settings and model), as the approved method code computes it.

    Raises:
        PolicyRefusal: the method's declaration cannot be computed for this site.
    """
    from medfl.method import Federation, Method

    if type(method).own_dp is Method.own_dp:
        return None
    cid = str(control.get("client"))
    fed = Federation(client_ids=[cid], eval_client_ids=[cid], num_examples={cid: max(int(num_examples()), 1)},
                     num_classes=int(dict(control.get("model") or {}).get("num_classes", 2)),
                     rounds=int(control.get("releases") or 1), seed=int(control.get("seed") or 0),
                     model=dict(control.get("model") or {}), train=dict(control.get("train") or {}))
    try:
        return method.own_dp(fed)
    except (KeyError, TypeError, ValueError) as exc:
        raise PolicyRefusal(f"rule mechanisms: the method's own differential privacy (own_dp) cannot be computed "
                            f"for this site: {exc}") from None
