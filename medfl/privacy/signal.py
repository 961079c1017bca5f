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

**The warning is judged on the run's score, not on the ratio alone** (issue 63, item 4). The
ratio is a worst case: it takes every client's update at the clip and pointing the same way in
one round, while training averages the noise over rounds and steps and adds the signal up.
On the demo bundle's model it is 7.8 at epsilon 1000 over 5 rounds; on the CBIS-DDSM fixture
with that model (GroupNorm) FedAvg at that epsilon learns nearly as well as without DP (0.88
against 0.89 test accuracy: docs/privacy.md, *The criterion against utility*, has the table). So the run says
:data:`DROWNED` ("the model learns little or nothing") only when both hold at the end of the
run (:func:`drowned`): the ratio was above 1 in some round, and the run's own score shows it
did not learn (:class:`Utility`, :func:`utility_of`): its mean ``accuracy`` over clients at the
round the run reports (early stopping's best, else the last), on ``local_val``, else
``local_test``, else ``global_test``, passing over the split early stopping chose the round
on while another is evaluated (the best of several rounds on a split is pushed up by the
choice), is at most the **majority-class score** (the best mean accuracy over clients a model that
predicts one class for every input scores on that split: a model that learned nothing) plus
:data:`MARGIN_SE` binomial standard errors of that score over the split's examples
(``sqrt(p (1 - p) / N)``: the spread of a score on ``N`` examples). A ratio above 1 with a
score above that prints a note (:data:`BOUND_ONLY`, on the log, and the verdict in
``mechanisms.csv``), not the warning. ``mechanisms.csv`` gets the verdict's row at the last
round, scope ``run``, id ``utility``: ``split``, ``reported_round``, ``score``,
``majority_score``, ``margin``, ``examples``, ``learned`` (1 or 0) and the run's worst
``noise_to_signal``.

BatchNorm: ``dp_gaussian`` with ``keys: "parameters"`` (the default) noises the parameters
only; the BatchNorm running statistics are data statistics the noise does not cover, so they
are not sent and the global model keeps its initial ones (mean 0, variance 1) for the whole
run. :meth:`NoiseShare.stale_statistics` names those layers; the run warns once
(:data:`STALE_BATCHNORM`) and writes a row (scope ``run``, id ``batchnorm``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["DROWNED", "BOUND_ONLY", "STALE_BATCHNORM", "MARGIN_SE", "noise_to_signal", "clients_needed",
           "majority_score", "Utility", "JUDGED_SPLITS", "utility_of", "drowned", "NoiseShare"]

#: the start of the warning that the DP noise kept the model from learning (one per mechanism
#: and run, at its end: the ratio above 1 and the score at the majority-class level)
DROWNED = "DP noise drowns the signal"
#: the start of the note that the ratio's worst-case bound is above 1 but the run learned
BOUND_ONLY = "DP noise bound above 1"
#: the start of the warning that a DP run leaves the BatchNorm statistics at their initial values
STALE_BATCHNORM = "DP leaves the BatchNorm statistics at their initial values"
#: the margin over the majority-class score, in binomial standard errors of that score
MARGIN_SE = 2.0


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


def majority_score(labels: Mapping[str, Any]) -> tuple[float, int, int]:
    """The best mean over clients of the accuracy of one constant prediction: what a model
    that learned nothing scores at most on these labels (per client, the labels of its split).

    Returns:
        ``(score, class, examples)``: the score, the class predicted, the labels in all;
        ``(nan, -1, 0)`` when no client has a label.
    """
    import numpy as np

    per = [np.asarray(v, dtype=np.int64).ravel() for v in labels.values()]
    per = [v for v in per if v.size]
    if not per:
        return math.nan, -1, 0
    k = int(max(int(v.max()) for v in per)) + 1
    share = np.mean([np.bincount(v, minlength=k) / v.size for v in per], axis=0)
    c = int(np.argmax(share))
    return float(share[c]), c, int(sum(v.size for v in per))


@dataclass(frozen=True)
class Utility:
    """What a run's own score says about whether it learned (:func:`drowned`).

    Attributes:
        split: the ``metrics.csv`` split scored (``local_val``...).
        metric: the metric (``accuracy``).
        round: the round the run reports.
        score: the model's mean over clients of ``metric`` on ``split`` at ``round``.
        majority: :func:`majority_score` on the same clients' labels of that split.
        majority_class: the class it predicts.
        examples: the split's labels in all (the clients that reported the score).
    """

    split: str
    metric: str
    round: int
    score: float
    majority: float
    majority_class: int
    examples: int

    @property
    def margin(self) -> float:
        """:data:`MARGIN_SE` binomial standard errors of the majority score on ``examples``."""
        p = min(max(self.majority, 0.0), 1.0)
        return MARGIN_SE * math.sqrt(p * (1 - p) / max(self.examples, 1))

    @property
    def learned(self) -> bool:
        """The score is above the majority-class score plus the margin."""
        return self.score > self.majority + self.margin

    def row(self, worst_ratio: float) -> dict[str, Any]:
        """Its ``mechanisms.csv`` values (scope ``run``, id ``utility``)."""
        return {"split": self.split, "metric": self.metric, "reported_round": self.round, "score": self.score,
                "majority_score": self.majority, "majority_class": self.majority_class, "margin": self.margin,
                "examples": self.examples, "learned": int(self.learned), "noise_to_signal": worst_ratio}

    def text(self) -> str:
        """The score against the majority-class score, in words."""
        return (f"the model scored {self.score:.3f} {self.metric} on {self.split} at round {self.round}, "
                f"{'above' if self.learned else 'not above'} {self.majority + self.margin:.3f} ({self.majority:.3f}, "
                f"the score of predicting class {self.majority_class} for every input, plus {MARGIN_SE:g} standard "
                f"errors over {self.examples} examples)")


#: the splits a verdict may read, in the order it prefers them (``metrics.csv``'s names)
JUDGED_SPLITS = ("local_val", "local_test", "global_test")


def utility_of(metrics: Any, reported_round: int, chosen_on: str | None,
               labels: Callable[[str, list[str]], Mapping[str, Any]]) -> Utility | None:
    """A run's :class:`Utility` from its ``metrics.csv`` rows: the mean ``accuracy`` over
    clients at ``reported_round`` (else the last evaluated round) on the first evaluated of
    :data:`JUDGED_SPLITS`, passing over ``chosen_on``, the split that chose the round (early
    stopping's), while another is evaluated: the best of several rounds on a split is that
    split's score pushed up by the choice, most of all for a model whose scores only jump
    around; and the majority-class score of the same clients' labels of that split.

    Args:
        metrics: the run's ``metrics.csv`` as a DataFrame.
        reported_round: the round the run reports (early stopping's best, else the last).
        chosen_on: the split that chose that round, or ``None``.
        labels: ``(split, client ids) -> {client id: labels}``.

    Returns:
        ``None`` without an ``accuracy`` on any of those splits.
    """
    if metrics is None or metrics.empty or "accuracy" not in metrics.columns or "split" not in metrics.columns:
        return None
    have = [s for s in JUDGED_SPLITS if ((metrics["split"] == s) & metrics["accuracy"].notna()).any()]
    if chosen_on in have and len(have) > 1:
        have.remove(chosen_on)
    if not have:
        return None
    split = have[0]
    part = metrics[(metrics["split"] == split) & metrics["accuracy"].notna()]
    at = part[part["round"] == reported_round]
    if at.empty:
        at = part[part["round"] == part["round"].max()]
    majority, cls, n = majority_score(labels(split, [str(c) for c in at["client_id"]]))
    if not math.isfinite(majority):
        return None
    return Utility(split=split, metric="accuracy", round=int(at["round"].iloc[0]), score=float(at["accuracy"].mean()),
                   majority=majority, majority_class=cls, examples=n)


def drowned(ratio: float, utility: Utility | None) -> bool:
    """The warning's criterion: the worst-case ratio above 1 **and** the run's score at the
    majority-class level (within the margin). No score, no verdict (``False``)."""
    return bool(ratio > 1) and utility is not None and not utility.learned


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
        buffer_keys: its floating-point buffers' names (:func:`medfl.filters.float_buffer_keys`;
            ``None``: not known, :meth:`stale_statistics` names none).
    """

    def __init__(self, plan: Any, federation: Any, reply_state: Mapping[str, str | None],
                 parameter_keys: Callable[[dict[str, Any]], list[str]],
                 trainable_count: Callable[[dict[str, Any]], int],
                 buffer_keys: Callable[[dict[str, Any]], list[str]] | None = None) -> None:
        self.plan = plan
        self.federation = federation
        self.reply_state = dict(reply_state)
        self.filters = [f for f in plan.chain.filters if f.release() is not None
                        and getattr(f, "noise_multiplier", None) is not None]
        self._parameter_keys = parameter_keys
        self._trainable = trainable_count
        self._buffer_keys = buffer_keys
        #: (step, filter, reply key, the noised tensors' names and shapes) -> their sum
        self._sums: dict[tuple[int, str, str, tuple[Any, ...]], _Sum] = {}
        self._dims: dict[tuple[int, str, str, tuple[Any, ...]], int] = {}
        self._release: dict[str, tuple[float, float]] = {}

    @property
    def active(self) -> bool:
        """Whether the run has a DP mechanism to account for."""
        return bool(self.filters) or self.plan.dp_sgd is not None or self.plan.own is not None \
            or self.plan.method_release is not None

    def stale_statistics(self) -> list[tuple[str, list[str]]]:
        """For each DP reply filter that noises the parameters only (``keys: "parameters"``),
        the layers of the global model whose running statistics it does not send (BatchNorm:
        the names before ``.running_mean``/``.running_var``): ``(filter, layers)``; the
        coordinator keeps the values it sent, the initial ones, for the whole run."""
        if self._buffer_keys is None:
            return []
        out = []
        for f in self.filters:
            if getattr(f, "keys", "all") != "parameters":
                continue
            names = self._buffer_keys(self.federation.model_spec())
            stats = [k for k in names if k.rsplit(".", 1)[-1] in ("running_mean", "running_var")]
            layers = list(dict.fromkeys(k.rsplit(".", 1)[0] for k in stats))   # in the model's order
            if layers:
                out.append((f.name, layers))
        return out

    @staticmethod
    def stale_warning(mechanism: str, layers: list[str]) -> str:
        """The warning that ``mechanism`` leaves the global model's BatchNorm ``layers`` at
        their initial statistics (once per run)."""
        shown = ", ".join(layers[:4]) + (f" and {len(layers) - 4} more" if len(layers) > 4 else "")
        return (f"{STALE_BATCHNORM} ({mechanism}): the model's {len(layers)} BatchNorm layer(s) ({shown}) keep "
                "running mean 0 and variance 1 in the global model for the whole run: their running statistics are "
                f"statistics of the clients' data that {mechanism} (keys \"parameters\") does not noise, so they are "
                "not sent and the coordinator keeps the values it sent. The global model normalizes with them when "
                "it is evaluated, so its scores mix the DP noise with statistics it never learned. For statistics DP "
                "covers: a model without running statistics (\"norm\": \"instance\", or \"dp_compatible\": true, "
                f"which makes BatchNorm GroupNorm), or {mechanism} with keys \"all\" (the statistics clipped and "
                "noised with the update)")

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
    def warning(r: int, mechanism: str, ratio: float, clients: int, change: str,
                utility: Utility | None = None, stale: bool = False) -> str:
        """The warning that the noise kept the model from learning, when :func:`drowned`
        (``ratio``: the worst round's ratio after averaging, first above 1 in round ``r``;
        ``utility``: the run's score against the majority-class score), saying what to
        change; "" otherwise. ``stale``: the global model's BatchNorm statistics stayed at
        their initial values (:meth:`stale_statistics`), which the warning then names."""
        if not drowned(ratio, utility):
            return ""
        assert utility is not None
        if clients:
            more = (f"more clients per round: the ratio falls with their square root, so {ratio:.3g} over "
                    f"{clients} client(s) needs about {clients_needed(ratio, clients)} per round; or ")
            what = (f"the noise in the mean of the round's {clients} client update(s) has up to {ratio:.3g} times "
                    "the norm their clipped signal can have at most")
        else:
            more = ""
            what = f"each released sample carries noise of {ratio:.3g} times the norm of its clipped features"
        bn = ("; the global model's BatchNorm statistics are also still their initial values, which can keep it "
              "from learning without any noise (the warning on them says why)" if stale else "")
        return (f"{DROWNED} ({mechanism}): {utility.text()}: it learned little or nothing, and from round {r} "
                f"{what}, so what the coordinator uses is mostly noise{bn}. To change it: {more}{change}. "
                "mechanisms.csv has noise_to_signal for every round and the verdict (id utility)")

    @staticmethod
    def bound_note(r: int, mechanism: str, ratio: float, utility: Utility | None) -> str:
        """The note for a ratio above 1 that is not a :data:`DROWNED` warning (the run learned,
        or has no score to judge by); "" for a ratio of at most 1."""
        if not ratio > 1 or drowned(ratio, utility):
            return ""
        bound = (f"{BOUND_ONLY} ({mechanism}): from round {r} the worst-case noise_to_signal is up to {ratio:.3g} "
                 "(every client's update at the clip and pointing the same way, in one round; training averages the "
                 "noise over rounds and steps)")
        if utility is None:
            return f"{bound}; the run has no accuracy to judge whether the model learned by"
        return f"{bound}, but {utility.text()}: the noise did not keep it from learning"
