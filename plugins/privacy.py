"""Built-in reply filters: ``dp_gaussian`` (client-level DP on updates) and ``quantize``.

Both follow PFedCDP (paper 000), section III-3: the update is clipped in L2 norm and
Gaussian noise is added (eqs. 12-13), then each tensor is min-max quantized to ``b`` bits
(eq. 14) and dequantized at the coordinator (eq. 15). See :mod:`medfl.filters` for how a
chain runs and docs/privacy.md for the guarantees.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from medfl import hookimpl
from medfl.filters import Filter, FilterConfigError, FilterContext, Release, float_buffer_keys
from medfl.messages import PayloadError
from medfl.method import Federation
from medfl.privacy.accounting import check_accountant, check_budget, check_delta, check_positive, noise_for_epsilon
from medfl.privacy.gaussian import add_noise, clip_update
from medfl.privacy.ledger import planned_releases
from medfl.privacy.quantize import dequantize_tensor, quantize_tensor
from medfl.logs import plugin_logger

__all__ = ["DpGaussian", "Quantize", "register_filters"]

logger = plugin_logger(__name__)

State = dict[str, torch.Tensor]
KEY_MODES = ("parameters", "all")


class DpGaussian(Filter):
    """Client-level differential privacy on the update (PFedCDP eqs. 12-13).

    At the client: ``delta = w_returned - w_received`` over the noised keys, clipped to global
    L2 norm ``clip`` (``delta / max(1, ||delta|| / clip)``), plus ``N(0, clip^2 sigma^2)`` on
    every coordinate; the coordinator adds the noised update back to the state it sent.

    ``sigma`` is ``noise_multiplier`` when given; otherwise it is derived with Opacus's
    accountant (:func:`medfl.privacy.accounting.noise_for_epsilon`) so that the client taking
    part in the most rounds of the planned run (the seeded sampling schedule) spends at most
    ``epsilon`` at ``delta``. Each release is accounted at sample rate 1: the coordinator,
    the party the noise protects against, chooses who takes part, so there is no
    amplification by sampling. The unit is a client's whole dataset under zero-out
    adjacency (the update replaced by zeros: sensitivity ``clip``), as in DP-FedAvg.

    Which keys are noised (``keys``):

    ``"parameters"`` (default)
        the model's parameters. Buffers (BatchNorm running mean and variance, batch counts)
        are statistics of the client's data that the clipped-and-noised update does not
        cover, so they are **not sent**: the coordinator keeps the values it sent, and the
        global model's BatchNorm statistics stay at their initial values for the whole run
        (the run says so at the start). Use a model without running statistics
        (``"norm": "instance"`` for the built-in ResNets) or ``keys: "all"``.
    ``"all"``
        every floating-point entry, buffers included, in one clipped vector (their noise may
        make a running variance negative: the method then sees what it receives).

    Args:
        clip: the L2 clipping norm C (> 0; PFedCDP uses 2.5).
        epsilon: target epsilon over the planned rounds (> 0); or give ``noise_multiplier``.
        noise_multiplier: sigma (> 0); when given, nothing is derived.
        delta: target delta, in (0, 1) and below 1 / (number of clients).
        accountant: ``"rdp"`` (default), ``"prv"`` or ``"gdp"`` (Opacus).
        keys: ``"parameters"`` or ``"all"`` (see above).
    """

    name = "dp_gaussian"
    description = "Client-level DP on updates: L2 clip + Gaussian noise (PFedCDP eqs. 12-13), Opacus accountant"
    uses_update = True

    def __init__(self, clip: float = 1.0, epsilon: float | None = None, noise_multiplier: float | None = None,
                 delta: float = 1e-5, accountant: str = "rdp", keys: str = "parameters") -> None:
        where = "dp_gaussian"
        self.clip = check_positive(clip, "clip", where)
        self.epsilon = None if epsilon is None else check_positive(epsilon, "epsilon", where)
        self.noise_multiplier = None if noise_multiplier is None else check_positive(
            noise_multiplier, "noise_multiplier", where)
        if self.epsilon is None and self.noise_multiplier is None:
            raise FilterConfigError("dp_gaussian: give a target epsilon (the noise is derived from it) or a "
                                    "noise_multiplier")
        self.delta = check_delta(delta, where)
        self.accountant = check_accountant(accountant, where)
        if keys not in KEY_MODES:
            raise FilterConfigError(f"dp_gaussian: keys must be one of {', '.join(KEY_MODES)}, got {keys!r}")
        self.keys = keys
        self._derived = False

    def plan(self, federation: Federation, where: str) -> None:
        """Check delta against the number of clients and derive sigma for the target epsilon."""
        check_budget(self.epsilon, self.delta, len(federation.client_ids), where, population_name="clients")
        if self.noise_multiplier is not None and self.epsilon is not None and not self._derived:
            raise FilterConfigError(f"{where}: give either epsilon (a target; the noise is derived) or "
                                    f"noise_multiplier, not both (got {self.epsilon} and {self.noise_multiplier})")
        if self.noise_multiplier is None:
            most = max(planned_releases(federation).values(), default=0)
            self.noise_multiplier = noise_for_epsilon(float(self.epsilon), self.delta, 1.0, max(most, 1),
                                                      self.accountant)
            self._derived = True
        if self.keys == "parameters":
            kept = float_buffer_keys(federation.model_spec())
            if kept:
                logger.warning(f"medfl: {where}: the model's {len(kept)} floating-point buffer(s) (BatchNorm running "
                               "statistics...) are not covered by the noise, so they are not sent: the global model keeps "
                               "its initial values for them. Use a model without running statistics "
                               "(e.g. \"norm\": \"instance\") or keys: \"all\"")

    def release(self) -> Release:
        """One Gaussian release per client and training step, at sample rate 1."""
        return Release("dp_gaussian", float(self.noise_multiplier or 0.0), self.clip, 1.0, self.delta,
                       self.accountant, "client")

    def _noised(self, update: State, ctx: FilterContext) -> list[str]:
        floats = [k for k, v in update.items() if v.is_floating_point()]
        if self.keys == "all":
            return floats
        params = set(ctx.parameter_keys())
        return [k for k in floats if k in params]

    def apply(self, state: State, ctx: FilterContext) -> State:
        """Clip the update of the noised keys, add the noise; other entries are not sent
        (``keys="parameters"``) or sent as they are (integer entries with ``keys="all"``)."""
        keys = self._noised(state, ctx)
        if not keys:
            raise PayloadError(f"{ctx.where}: dp_gaussian found no floating-point parameter to noise")
        sigma = float(self.noise_multiplier or 0.0)
        clipped, _norm = clip_update(state, self.clip, keys)
        noised = add_noise(clipped, self.clip * sigma, keys, ctx.generator("noise"))
        return {k: noised[k] for k in (state if self.keys == "all" else keys)}

    def undo(self, value: Any, ctx: FilterContext) -> State:
        """Check the noised update's keys and fill the entries that were not sent with a
        zero update (the coordinator keeps what it sent)."""
        ref = ctx.reference
        if ref is None:  # the chain refuses dp_gaussian without a reference; a guard for direct use
            raise PayloadError(f"{ctx.where}: dp_gaussian needs the state the client was sent")
        if not isinstance(value, dict) or not all(isinstance(v, torch.Tensor) for v in value.values()):
            raise PayloadError(f"{ctx.where}: expected dp_gaussian's noised update (a dict of tensors), "
                               f"got {type(value).__name__}")
        expected = self._noised(ref, ctx) if self.keys == "parameters" else list(ref)
        if set(value) != set(expected):
            extra, missing = sorted(set(value) - set(expected)), sorted(set(expected) - set(value))
            raise PayloadError(f"{ctx.where}: dp_gaussian's update should hold the noised keys only "
                               f"(unexpected {extra[:5]}, missing {missing[:5]})")
        return {k: value[k] if k in value else (torch.zeros_like(t) if t.is_floating_point() else t.clone())
                for k, t in ref.items()}


class Quantize(Filter):
    """Min-max quantization of each floating-point tensor to ``bits``-bit integers (PFedCDP
    eqs. 14-15), bit-packed, dequantized at the coordinator.

    Each tensor becomes its codes ``round((x - min) / (max - min) * (2^b - 1))`` packed densely
    (``b`` bits each: 8 bits cost a byte per value, 4 bits half a byte) plus its minimum and
    maximum; the coordinator computes ``min + code / (2^b - 1) * (max - min)``, within half a
    step of the value sent. Integer tensors (batch counts) pass as they are.

    What it encodes: after ``dp_gaussian`` (which makes the whole chain work on the update)
    the noised update, as PFedCDP's eq. 14 says. Without it, the state itself, unless
    ``update`` is true: then the chain subtracts the state the client started from first (the
    method must name it in ``reply_state``, as for ``dp_gaussian``) and adds it back after the
    dequantization, so the step is that of the update's range rather than the weights'. An
    update spans a far smaller range than the weights, and its error is smaller by as much.

    Args:
        bits: 1 to 16.
        stochastic: unbiased stochastic rounding (``floor(v + u)``, ``u ~ U[0, 1)``, seeded)
            instead of rounding to nearest: the dequantized value is right on average, within
            one step.
        update: quantize the update (returned minus received state) rather than the state
            (default ``False``: the state, unless ``dp_gaussian`` precedes it).
    """

    name = "quantize"
    description = "Min-max quantization of each tensor to 1-16 bits (PFedCDP eqs. 14-15), bit-packed"
    encodes = True

    def __init__(self, bits: int = 8, stochastic: bool = False, update: bool = False) -> None:
        if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= 16:
            raise FilterConfigError(f"quantize: bits must be an integer from 1 to 16, got {bits!r}")
        if not isinstance(stochastic, bool):
            raise FilterConfigError(f"quantize: stochastic must be true or false, got {stochastic!r}")
        if not isinstance(update, bool):
            raise FilterConfigError(f"quantize: update must be true (quantize the update) or false (the state), "
                                    f"got {update!r}")
        self.bits, self.stochastic, self.update, self.uses_update = bits, stochastic, update, update

    def apply(self, state: State, ctx: FilterContext) -> dict[str, Any]:
        """Each floating-point tensor as its packed codes and range."""
        gen = ctx.generator("quantize") if self.stochastic else None
        return {k: quantize_tensor(v, self.bits, stochastic=self.stochastic, generator=gen, where=f"{ctx.where}[{k!r}]")
                if v.is_floating_point() else v for k, v in state.items()}

    def undo(self, value: Any, ctx: FilterContext) -> State:
        """Dequantize every entry, checking each encoding (a site may send anything)."""
        if not isinstance(value, dict):
            raise PayloadError(f"{ctx.where}: expected quantized tensors (a dict), got {type(value).__name__}")
        out: State = {}
        for k, v in value.items():
            where = f"{ctx.where}[{k!r}]"
            if isinstance(v, dict):
                if v.get("bits") != self.bits:
                    raise PayloadError(f"{where}: quantized to {v.get('bits')!r} bits, the run uses {self.bits}")
                out[k] = dequantize_tensor(v, where)
            elif isinstance(v, torch.Tensor) and not v.is_floating_point():
                out[k] = v
            else:
                raise PayloadError(f"{where}: expected a quantized tensor or an integer tensor, got "
                                   f"{getattr(v, 'dtype', type(v).__name__)}")
        return out


@hookimpl
def register_filters(register: Callable[..., None]) -> None:
    """Register ``dp_gaussian`` and ``quantize``."""
    register(DpGaussian)
    register(Quantize)

