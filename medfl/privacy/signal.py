"""How much of what the coordinator aggregates is differential-privacy noise (issue 48, item 7).

A DP mechanism clips a signal to norm ``C`` and adds Gaussian noise of std ``sigma C`` per
coordinate. In ``d`` coordinates the noise vector has norm ``sigma C sqrt(d)`` (to within
``1 / sqrt(d)``), while the clipped signal has norm **at most** ``C``. Averaging ``n`` clients'
replies leaves the signal's bound at ``C`` (if every client's signal points the same way) and
divides the noise's norm by ``sqrt(n)`` (independent noises). So after averaging

    noise_to_signal = sigma sqrt(d) / sqrt(n)        (dp_gaussian on a model update)

is a **lower bound** on the noise's norm over the signal's in the aggregate: the best case
for the signal. Above 1, the aggregate is mostly noise whatever the data; it is the threshold
the run warns at. (Central DP-FedAvg, where the coordinator adds one noise to the sum,
divides by ``n``; here every client adds its own noise, as ``dp_gaussian`` and DP-SGD do, so
the sum's noise grows with ``sqrt(n)`` and the mean's falls only with ``sqrt(n)``.)

Noise that is applied ``T`` times (DP-SGD's steps, a method's own DP) to a mean over an
expected batch of ``B`` records adds up in quadrature over the steps (``sqrt(T)``) while the
clipped signal adds up at most linearly (``T C``), each step's noise being divided by ``B``:

    noise_to_signal = sqrt(d sum_i sigma_i^2 T_i / B_i^2) / sum_i T_i

over the round's clients ``i`` (one client: ``sigma sqrt(d) / (B sqrt(T))``), for an optimizer
that steps along the noisy averaged gradient (SGD; an adaptive optimizer rescales both).
``B`` is ``q N`` (the expected Poisson batch) for a sample-level mechanism and 1 for a
client-level one.

What the run can also **measure** for ``dp_gaussian`` (at the coordinator, from the updates
it receives and nothing else): the norm of the mean received update ``u``, and from it an
unbiased estimate of the mean clipped signal's squared norm, ``||u||^2 - d (sigma C)^2 / n``
(the noise's expected contribution removed; 0 when the noise accounts for all of it). The
noise's squared norm itself varies by ``d (sigma C)^2 / n * sqrt(2 / d)``, so the estimate
means something only above that (``signal_norm_estimate_error``): with a drowning noise it
does not, which is the point of the ratio above.

Per-sample releases (``Method.release_plan``) are not averaged: each released sample is used
on its own, so their ratio is per sample, from the record medfl makes at the client of the
release it performed (the reply metrics ``signal_norm`` and ``noise_norm``,
:data:`medfl.privacy.feature_release.RELEASE_METRICS`).

:class:`NoiseShare` keeps these per round for the engine, which writes its rows to
``mechanisms.csv`` (in front of the method's own) and its warnings to stderr and
``summary.json`` (once per mechanism and run). The rows, under the mechanism's name
(``dp_gaussian``, ``dp_sgd``, the method's ``own_dp`` or release mechanism): scope
``client`` (id: the client) with ``noise_to_signal`` (the ratio for that client's reply
alone), and ``received_norm`` for a reply filter or ``steps`` and ``expected_batch`` for a
stepped mechanism, or ``signal_norm`` and ``noise_norm`` for a release; scope ``round``
(id ``mean``; ``mean of <d> values`` for each model when the clients sent different ones,
as PFedCDP's clusters do: each is averaged apart) with ``clients``, ``noise_norm`` (the noise's expected norm in the mean),
``signal_bound`` (the largest norm the mean clipped signal can have) and ``noise_to_signal``
(their ratio: the warning's criterion), plus for a reply filter ``received_norm``,
``signal_norm_estimate``, ``signal_norm_estimate_error`` and ``measured_noise_to_signal``.
Norms of stepped mechanisms are in units of the learning rate.
Nothing it records is a per-sample value: the norms are of clipped, noised client updates as
the coordinator received them, or the release's own declared metrics.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DROWNED", "noise_to_signal", "clients_needed", "NoiseShare"]

#: the start of every warning :class:`NoiseShare` gives (one per mechanism and run)
DROWNED = "DP noise drowns the signal"


def noise_to_signal(dim: int, sigmas: list[float], steps: list[float], batches: list[float]) -> float:
    """The noise's norm over the largest norm the clipped signal can have, in the mean of the
    clients' replies (see the module docstring): ``sqrt(d sum sigma_i^2 T_i / B_i^2) / sum T_i``.

    Args:
        dim: the noised coordinates ``d``.
        sigmas, steps, batches: per client, the noise multiplier, the noise applications in
            its reply ``T_i`` (1 for a reply filter) and the expected records per
            application ``B_i`` (1 for a client-level mechanism).

    Returns:
        The ratio; ``nan`` for no client or no step.
    """
    total = sum(steps)
    if not sigmas or not total > 0:
        return math.nan
    var = sum(s * s * t / (b * b) for s, t, b in zip(sigmas, steps, batches))
    return math.sqrt(dim * var) / total


def clients_needed(ratio: float, clients: int) -> int:
    """The clients per round that bring ``ratio`` (measured over ``clients``) to 1, at equal
    clients: the ratio falls with the square root of their number."""
    return int(math.ceil(clients * ratio * ratio))


@dataclass
class _Sum:
    """The received updates of one reply entry in one training step, summed at the coordinator."""

    total: torch.Tensor | None = None
    norms: dict[str, float] = field(default_factory=dict)


class NoiseShare:
    """The engine's per-round record of the DP noise against the clipped signal, for every DP
    mechanism the run applies: reply filters that are releases (``dp_gaussian``), DP-SGD
    (``train.dp``), a method's own DP (``Method.own_dp``) and per-sample releases.

    Args:
        plan: the run's :class:`medfl.privacy.ledger.PrivacyPlan`.
        federation: the run's federation (model spec, client sizes).
        reply_state: the method's ``reply_state`` (reply key -> instruction key of the state
            the client started from).
        parameter_keys: the parameter names of a model spec's model (what ``dp_gaussian``
            noises: :func:`medfl.filters.parameter_keys`, passed in by the engine, which sits
            above both).
        trainable_count: its number of trainable values (:func:`medfl.filters.trainable_count`).
    """

    def __init__(self, plan: Any, federation: Any, reply_state: Mapping[str, str | None],
                 parameter_keys: Callable[[dict[str, Any]], list[str]],
                 trainable_count: Callable[[dict[str, Any]], int]) -> None:
        self.plan = plan
        self.federation = federation
        self.reply_state = dict(reply_state)
        self.filters = [f for f in plan.chain.filters if f.release() is not None
                        and getattr(f, "noise_multiplier", None) is not None]
        self._parameter_keys = parameter_keys
        self._trainable = trainable_count
        #: (step, filter, reply key, the noised tensors' names and shapes) -> their sum
        self._sums: dict[tuple[int, str, str, tuple[Any, ...]], _Sum] = {}
        self._dims: dict[tuple[int, str, str, tuple[Any, ...]], int] = {}
        self._release: dict[str, tuple[float, float]] = {}

    @property
    def active(self) -> bool:
        """Whether the run has a DP mechanism to account for."""
        return bool(self.filters) or self.plan.dp_sgd is not None or self.plan.own is not None \
            or self.plan.method_release is not None

    # ------------------------------------------------------------------ during the round
    def observe(self, step: int, client_id: str, payload: Mapping[str, Any], ins_payload: Mapping[str, Any],
                metrics: Mapping[str, Any]) -> None:
        """One screened reply of the round, as the method will receive it: for each DP reply
        filter, the received update (the reply's state minus the state the client was sent,
        over the keys the filter noised) is added to the step's sum and its norm kept; a
        release reply's declared ``signal_norm`` and ``noise_norm`` are kept."""
        if "signal_norm" in metrics and "noise_norm" in metrics and self.plan.method_release is not None:
            self._release[client_id] = (float(metrics["signal_norm"]), float(metrics["noise_norm"]))
        for f in self.filters:
            for key, ref_key in self.reply_state.items():
                state, ref = payload.get(key), ins_payload.get(ref_key) if ref_key else None
                if not isinstance(state, Mapping) or not isinstance(ref, Mapping):
                    continue
                names = [k for k, v in ref.items() if isinstance(v, torch.Tensor) and v.is_floating_point()]
                if getattr(f, "keys", "all") == "parameters":
                    params = set(self._parameter_keys(self.federation.model_spec(client_id)))
                    names = [k for k in names if k in params]
                if not names or any(k not in state for k in names):
                    continue
                u = torch.cat([(state[k].detach().double().cpu() - ref[k].detach().double().cpu()).flatten()
                               for k in names])
                # clients sent different models (PFedCDP's clusters) are averaged apart, as the
                # method averages them: one group per (names, shapes) of what was noised
                shape = tuple((k, tuple(ref[k].shape)) for k in names)
                slot = (step, f.name, key, shape)
                entry = self._sums.setdefault(slot, _Sum())
                entry.total = u if entry.total is None else entry.total.add_(u)
                entry.norms[client_id] = float(u.norm())
                self._dims[slot] = u.numel()

    # ------------------------------------------------------------------ after the round
    def rows(self, dp_steps: Mapping[str, float], own_steps: Mapping[str, float]
             ) -> tuple[list[dict[str, Any]], list[tuple[str, float, int, str]]]:
        """The round's rows of ``mechanisms.csv`` (then forgets the round), and for each
        mechanism the round's ratio after averaging as ``(mechanism, ratio, clients, what to
        change)`` for :meth:`warning`.

        Args:
            dp_steps: DP-SGD's optimizer steps each client reported in the round.
            own_steps: the method's own DP applications each client reported.
        """
        rows: list[dict[str, Any]] = []
        found: list[tuple[str, float, int, str]] = []
        for slot in sorted(self._sums, key=lambda x: (x[0], x[1], x[2], self._dims[x])):
            rows_f, item = self._filter_rows(slot)
            rows += rows_f
            found.append(item)
        if self.plan.dp_sgd is not None and dp_steps:
            p = self.plan.dp_sgd
            rows_d, item = self._stepped("dp_sgd", dp_steps, p.noise, p.sample_rate, float(p.settings["max_grad_norm"]),
                                         "sample")
            rows += rows_d
            found.append((*item[:3], "a larger train.batch_size (each step's noise is divided by the expected "
                          "batch), " + item[3]))
        own = self.plan.own
        if own is not None and own_steps:
            noise = {c: float(own.per_client("noise_multiplier", c)) for c in own_steps}
            rate = {c: float(own.per_client("sample_rate", c)) for c in own_steps}
            dims = (None if own.noised_values is None else
                    {c: int(own.per_client("noised_values", c)) for c in own_steps})
            rows_o, item = self._stepped(own.mechanism, own_steps, noise, rate, float(own.clip), own.unit, dims)
            rows += rows_o
            found.append(item)
        if self._release:
            rows_r, item = self._release_rows()
            rows += rows_r
            found.append(item)
        self._sums, self._dims, self._release = {}, {}, {}
        return rows, found

    def _filter_rows(self, slot: tuple[int, str, str, tuple[Any, ...]]
                     ) -> tuple[list[dict[str, Any]], tuple[str, float, int, str]]:
        """The rows of one DP reply filter in one step and reply entry: per client the
        received update's norm and the bound ratio ``sigma sqrt(d)``; after averaging the
        clients, ``d``, the clip, the mean received update's norm, the noise's expected norm
        in it, the bound ratio, the measured signal estimate with its error (the square root
        of the standard deviation of the noise's squared norm, ``noise_mean2 sqrt(2 / d)``)
        and the measured ratio (missing unless the squared estimate exceeds twice that
        standard deviation: below, the estimate is the noise's own fluctuation). Quantization
        after the noise adds its error to the received norm, and so to the estimate."""
        step, name, key, _ = slot
        f = next(f for f in self.filters if f.name == name)
        sigma, clip, d = float(f.noise_multiplier), float(f.clip), self._dims[slot]
        entry = self._sums[slot]
        n = len(entry.norms)
        where = {"entry": key, **({"step": step} if step else {})}
        groups = sum(1 for s in self._sums if s[:3] == slot[:3])
        mean_id = "mean" if groups == 1 else f"mean of {d} values"
        rows: list[dict[str, Any]] = [
            {"mechanism": name, "scope": "client", "id": cid, **where, "received_norm": norm,
             "noise_to_signal": sigma * math.sqrt(d)} for cid, norm in sorted(entry.norms.items())]
        ratio = noise_to_signal(d, [sigma] * n, [1.0] * n, [1.0] * n)
        mean = entry.total / n
        noise_mean2 = d * (sigma * clip) ** 2 / n
        estimate2 = float(mean.dot(mean)) - noise_mean2
        # the noise's squared norm varies by noise_mean2 * sqrt(2 / d) (chi-square, d degrees):
        # an estimate within two of those is the noise's own fluctuation, not a signal
        error2 = noise_mean2 * math.sqrt(2.0 / d)
        estimate = math.sqrt(max(0.0, estimate2))
        rows.append({"mechanism": name, "scope": "round", "id": mean_id, **where, "clients": n, "noised_values": d,
                     "signal_bound": clip, "received_norm": float(mean.norm()), "noise_norm": math.sqrt(noise_mean2),
                     "noise_to_signal": ratio, "signal_norm_estimate": estimate,
                     "signal_norm_estimate_error": math.sqrt(error2),
                     "measured_noise_to_signal": math.sqrt(noise_mean2) / estimate if estimate2 > 2 * error2 else None})
        change = (f"a noise multiplier below {sigma / ratio:.3g} (now {sigma:.3g}): a larger epsilon or fewer rounds; "
                  f"or a smaller model ({d} noised values). The clip does not change this ratio (the noise and the "
                  "signal's bound both scale with it)")
        return rows, (name, ratio, n, change)

    def _stepped(self, name: str, steps: Mapping[str, float], noise: Mapping[str, float],
                 rate: Mapping[str, float], clip: float, unit: str, dims: Mapping[str, int] | None = None
                 ) -> tuple[list[dict[str, Any]], tuple[str, float, int, str]]:
        """The rows of a mechanism applied at every step of local training (DP-SGD, or a
        method's own DP): noise and signal bound in units of the learning rate. ``dims``: the
        values each client's noise covers (default: its model's trainable parameters). Clients
        whose noise covers different numbers of values train different models (PFedCDP's
        clusters), which are averaged apart: one round row for each (``mean of <d> values``),
        the warning from the worst."""
        cids = sorted(c for c in steps if c in noise)
        dim = {c: int(dims[c]) if dims is not None else self._trainable(self.federation.model_spec(c)) for c in cids}
        rows: list[dict[str, Any]] = []
        batch: dict[str, float] = {}
        for cid in cids:
            batch[cid] = max(rate[cid] * self.federation.num_examples.get(cid, 0), 1e-12) if unit == "sample" else 1.0
            rows.append({"mechanism": name, "scope": "client", "id": cid, "steps": float(steps[cid]),
                         "expected_batch": batch[cid],
                         "noise_to_signal": noise_to_signal(dim[cid], [float(noise[cid])], [float(steps[cid])],
                                                            [batch[cid]])})
        groups = sorted(set(dim.values())) or [0]
        worst: tuple[float, int, float] = (-1.0, 0, 0.0)
        for d in groups:
            members = [c for c in cids if dim[c] == d]
            sigmas = [float(noise[c]) for c in members]
            ts = [float(steps[c]) for c in members]
            ratio = noise_to_signal(d, sigmas, ts, [batch[c] for c in members])
            n = len(members)
            rows.append({"mechanism": name, "scope": "round", "id": "mean" if len(groups) == 1 else f"mean of {d} values",
                         "clients": n, "noised_values": d,
                         "noise_norm": ratio * clip * sum(ts) / max(n, 1) if n else 0.0,
                         "signal_bound": clip * sum(ts) / max(n, 1), "noise_to_signal": ratio})
            if ratio > worst[0]:
                worst = (ratio, n, max(sigmas, default=0.0))
        ratio, n, top = worst
        ratio = max(ratio, 0.0)
        change = (f"a noise multiplier below {top / ratio if ratio > 0 else math.inf:.3g} (now up to {top:.3g}): a "
                  "larger epsilon or fewer rounds; or a smaller model")
        return rows, (name, ratio, n, change)

    def _release_rows(self) -> tuple[list[dict[str, Any]], tuple[str, float, int, str]]:
        """The rows of a per-sample release: per client its declared mean signal and noise
        norms per sample; for the round the ratio of their means."""
        name = self.plan.method_release.mechanism
        rows = [{"mechanism": name, "scope": "client", "id": cid, "signal_norm": s, "noise_norm": z,
                 "noise_to_signal": z / s if s > 0 else math.inf} for cid, (s, z) in sorted(self._release.items())]
        signal = sum(s for s, _ in self._release.values()) / len(self._release)
        noise = sum(z for _, z in self._release.values()) / len(self._release)
        ratio = noise / signal if signal > 0 else math.inf
        rows.append({"mechanism": name, "scope": "round", "id": "mean", "clients": len(self._release),
                     "signal_norm": signal, "noise_norm": noise, "noise_to_signal": ratio})
        return rows, (name, ratio, 0, "a larger epsilon, a clip near the features' norms, or smaller features")

    @staticmethod
    def warning(r: int, mechanism: str, ratio: float, clients: int, change: str) -> str:
        """The warning for a round whose ratio after averaging is above 1 (see the module
        docstring), saying what to change; "" otherwise."""
        if not ratio > 1:
            return ""
        if clients:
            more = (f"more clients per round: the ratio falls with their square root, so {ratio:.3g} over "
                    f"{clients} client(s) needs about {clients_needed(ratio, clients)} per round; or ")
            what = (f"the noise in the mean of the round's {clients} client update(s) has {ratio:.3g} times the norm "
                    "their clipped signal can have at most")
        else:
            more = ""
            what = f"each released sample carries noise of {ratio:.3g} times the norm of its clipped features"
        return (f"{DROWNED} ({mechanism}): in round {r} {what}, so what the coordinator uses is mostly noise and "
                f"the model learns little or nothing from it. To change it: {more}{change}. mechanisms.csv has "
                f"noise_to_signal for every round")
