"""A site's own privacy policy: the least privacy its operator accepts.

The coordinator chooses a run's reply filters, their noise and DP-SGD; a site's approvals
(:mod:`medfl.approval`) pin which *code* runs, not with which parameters. The policy is
the site's say over the parameters: the operator writes it in the ``policy`` section of
the site's approvals file (``medfl policy --file approvals.json ...``), and the site checks
every message against it (:meth:`medfl.flower.site.Site.check`), after the approvals and
before the method's code runs, refusing with the rule that is broken::

    "policy": {
      "mechanisms": ["dp_gaussian", "dp_sgd"],
      "max_epsilon": 3.0,
      "max_epsilon_per_release": 1.0,
      "min_noise_multiplier": 0.8,
      "required_filters": [{"name": "quantize", "max": {"bits": 8}}],
      "cross_test": false
    }

``mechanisms``
    the DP mechanisms the site accepts (``dp_gaussian``, ``dp_sgd``, a method's own release
    such as FedTPF's ``feature_gaussian``, a method's own DP declared by ``own_dp``); a run
    using another one is refused.
``max_epsilon``
    the largest epsilon this site's data may spend over the run. The site computes it
    itself, with Opacus's accountant, from what it will apply: the noise multiplier, clip
    rate and delta of each release (the resolved filter entries, ``train.dp``, the
    method's ``release_plan`` and ``own_dp``), its own training-set size (DP-SGD's steps and sample rate)
    and the number of releases the run plans for this client (``releases`` of the control
    record); mechanisms compose by adding their epsilons. A run without any DP release
    has an infinite epsilon and is refused.
``max_epsilon_per_release``
    the same for one release (one reply of ``dp_gaussian``, one DP-SGD update, one
    release of a method's features).
``min_noise_multiplier``
    the smallest noise multiplier (noise std over the clip) of any Gaussian release.
``required_filters``
    reply filters the run must apply, each ``{"name": ..., "max": {param: bound},
    "min": {param: bound}}`` over its resolved parameters (``quantize`` with ``bits`` at
    most 8).
``cross_test``
    ``false``: the site never sends its evaluation model for the Global Test (default
    ``true``).

A rule the site cannot check, because the coordinator did not say how many releases the
run plans, refuses the message. The in-process engine and the simulation runtime check no
policy (the user runs every party).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable

from medfl.approval import ApprovalError

__all__ = ["PolicyError", "PolicyRefusal", "SitePolicy", "POLICY_RULES"]

#: The rules a policy may set, as they are spelt in the approvals file.
POLICY_RULES: tuple[str, ...] = ("mechanisms", "max_epsilon", "max_epsilon_per_release", "min_noise_multiplier",
                                 "required_filters", "cross_test")


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
        max_epsilon_per_release: largest epsilon of one release (``None``: no cap).
        min_noise_multiplier: smallest noise multiplier of a Gaussian release (``None``: any).
        required_filters: filters the run must apply, with bounds on their parameters.
        cross_test: whether the site sends its evaluation model for the Global Test.
    """

    mechanisms: tuple[str, ...] | None = None
    max_epsilon: float | None = None
    max_epsilon_per_release: float | None = None
    min_noise_multiplier: float | None = None
    required_filters: tuple[dict[str, Any], ...] = field(default_factory=tuple)
    cross_test: bool = True

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
        caps = {k: None if data.get(k) is None else _positive(data[k], f"{where}.{k}")
                for k in ("max_epsilon", "max_epsilon_per_release", "min_noise_multiplier")}
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
        cross = data.get("cross_test", True)
        if not isinstance(cross, bool):
            raise PolicyError(f"{where}.cross_test: expected true or false, got {cross!r}")
        return cls(mechanisms=None if mech is None else tuple(mech), required_filters=tuple(required),
                   cross_test=cross, **caps)

    def to_dict(self) -> dict[str, Any]:
        """The ``policy`` section as written in the approvals file (unset rules left out)."""
        out: dict[str, Any] = {}
        if self.mechanisms is not None:
            out["mechanisms"] = list(self.mechanisms)
        for k in ("max_epsilon", "max_epsilon_per_release", "min_noise_multiplier"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        if self.required_filters:
            out["required_filters"] = [{k: v for k, v in f.items() if v or k == "name"} for f in self.required_filters]
        if not self.cross_test:
            out["cross_test"] = False
        return out

    def describe(self) -> list[str]:
        """One line per rule, for ``medfl policy --show`` and the site's start."""
        lines = []
        if self.mechanisms is not None:
            lines.append(f"mechanisms: only {', '.join(self.mechanisms) or 'none'}")
        for k, what in (("max_epsilon", "largest epsilon over a run"),
                        ("max_epsilon_per_release", "largest epsilon of one release"),
                        ("min_noise_multiplier", "smallest noise multiplier")):
            if getattr(self, k) is not None:
                lines.append(f"{k}: {what} {getattr(self, k):g}")
        for f in self.required_filters:
            b = [f"{p} <= {v:g}" for p, v in f["max"].items()] + [f"{p} >= {v:g}" for p, v in f["min"].items()]
            lines.append(f"required_filters: {f['name']}{' with ' + ', '.join(b) if b else ''}")
        if not self.cross_test:
            lines.append("cross_test: this site never sends its evaluation model")
        return lines or ["no rule: any privacy (or none) is accepted"]

    # ------------------------------------------------------------------ the site's check
    def check(self, control: dict[str, Any], num_examples: Callable[[], int]) -> None:
        """Refuse a site message that asks for less privacy than this policy accepts.

        Args:
            control: the message's control record (method, resolved ``filters``, ``train``
                with its resolved ``dp``, ``releases``, ``want_model``).
            num_examples: this site's training-set size (called only for DP-SGD's steps).

        Raises:
            PolicyRefusal: naming the rule, what the message asks for and what the policy accepts.
        """
        if not self.cross_test and control.get("want_model"):
            raise PolicyRefusal("rule cross_test: the coordinator asks for this site's evaluation model (cross_test), "
                                "which its policy never sends; run without \"cross_test\" in eval_splits")
        if not isinstance(control.get("method"), dict):
            return   # hello: no data leaves but the split's sizes
        self._check_filters(list(control.get("filters") or []))
        releases = _releases(control, num_examples)
        for mech, sigma, _, delta, accountant, _ in releases:
            if self.mechanisms is not None and mech not in self.mechanisms:
                raise PolicyRefusal(f"rule mechanisms: the run releases with {mech}, this site accepts only "
                                    f"{', '.join(self.mechanisms) or 'no mechanism'}")
            if self.min_noise_multiplier is not None and accountant != "laplace" \
                    and sigma < self.min_noise_multiplier:
                raise PolicyRefusal(f"rule min_noise_multiplier: {mech} adds noise multiplier {sigma:g}, this site "
                                    f"requires at least {self.min_noise_multiplier:g}")
        if self.max_epsilon_per_release is not None:
            for mech, sigma, rate, delta, accountant, (steps, _) in releases:
                eps = _epsilon([(sigma, rate, steps)], delta, accountant)
                if eps > self.max_epsilon_per_release:
                    raise PolicyRefusal(f"rule max_epsilon_per_release: one {mech} release spends epsilon "
                                        f"{eps:.4g} (noise multiplier {sigma:g}, delta {delta:g}), this site accepts "
                                        f"at most {self.max_epsilon_per_release:g}")
        if self.max_epsilon is not None:
            if not releases:
                raise PolicyRefusal(f"rule max_epsilon: the run makes no differential-privacy release (epsilon "
                                    f"infinite), this site accepts at most epsilon {self.max_epsilon:g}")
            count = control.get("releases")
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise PolicyRefusal(f"rule max_epsilon: the coordinator does not say how many releases the run "
                                    f"plans for this site (control record 'releases': {count!r}), so its epsilon "
                                    "cannot be checked")
            total = sum(_epsilon([(sigma, rate, steps * (count if per_round else 1))], delta, accountant)
                        for _, sigma, rate, delta, accountant, (steps, per_round) in releases)
            if total > self.max_epsilon:
                mechs = ", ".join(sorted({r[0] for r in releases}))
                raise PolicyRefusal(f"rule max_epsilon: the run spends epsilon {total:.4g} of this site's data "
                                    f"({mechs} over {count} planned release(s)), this site accepts at most "
                                    f"{self.max_epsilon:g}")

    def _check_filters(self, filters: list[Any]) -> None:
        for req in self.required_filters:
            found = [f for f in filters if isinstance(f, dict) and f.get("name") == req["name"]]
            if not found:
                names = [f.get("name") for f in filters if isinstance(f, dict)]
                raise PolicyRefusal(f"rule required_filters: the run's reply filters {names or '(none)'} lack "
                                    f"{req['name']!r}, which this site requires")
            for f in found:
                for param, bound in req["max"].items():
                    if not _number(f.get(param)) or float(f[param]) > bound:
                        raise PolicyRefusal(f"rule required_filters: filter {req['name']!r} has {param} "
                                            f"{f.get(param)!r}, this site requires at most {bound:g}")
                for param, bound in req["min"].items():
                    if not _number(f.get(param)) or float(f[param]) < bound:
                        raise PolicyRefusal(f"rule required_filters: filter {req['name']!r} has {param} "
                                            f"{f.get(param)!r}, this site requires at least {bound:g}")


def _number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _epsilon(hist: list[tuple[float, float, int]], delta: float, accountant: str) -> float:
    from medfl.privacy.ledger import _epsilon as history_epsilon

    return history_epsilon(hist, delta, accountant)


def _releases(control: dict[str, Any], num_examples: Callable[[], int]
              ) -> list[tuple[str, float, float, float, str, tuple[int, bool]]]:
    """Every DP release the message's run makes at this site, as ``(mechanism, noise
    multiplier, sample rate, delta, accountant, (steps per release, repeated every planned
    release))``: from the resolved filter chain (built by the approved filter code), the
    resolved ``train.dp`` (DP-SGD, its steps from this site's own training-set size) and
    the method's ``release_plan`` (once per run)."""
    from medfl.config import build_method
    from medfl.filters import FilterChain

    out = []
    chain = FilterChain.from_specs(list(control.get("filters") or []), "filters sent to this site")
    for rel in chain.releases():
        out.append((rel.mechanism, float(rel.noise_multiplier), float(rel.sample_rate), float(rel.delta),
                    rel.accountant, (1, True)))
    dp = dict(control.get("train") or {}).get("dp")
    if isinstance(dp, dict) and dp:
        from medfl.privacy.dp_sgd import planned_steps

        train = dict(control["train"])
        steps, rate = planned_steps(max(int(num_examples()), 1), int(train.get("batch_size", 16)),
                                    int(train.get("epochs", 1)))
        out.append(("dp_sgd", float(dp.get("noise_multiplier") or 0.0), rate, float(dp.get("delta", 1e-5)),
                    str(dp.get("accountant", "rdp")), (steps, True)))
    method = build_method(dict(control["method"]))
    rel = method.release_plan()
    if rel is not None:
        out.append((rel.mechanism, float(rel.noise_multiplier), float(rel.sample_rate), float(rel.delta),
                    rel.accountant, (1, False)))
    own = _own_dp(method, control, num_examples)
    if own is not None:
        cid = str(control.get("client"))
        out.append((own.mechanism, float(own.per_client("noise_multiplier", cid)),
                    float(own.per_client("sample_rate", cid)), float(own.delta), own.accountant,
                    (int(own.per_client("steps", cid)), True)))
    return out


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
