"""Local training and evaluation helpers shared by method plugins, the method contract
(:class:`medfl.context.ClientContext`), privacy (DP-SGD) and the engine.

Below all of them: this module imports nothing from :mod:`medfl.engine`, :mod:`medfl.context`,
:mod:`medfl.method` or :mod:`medfl.filters`.
"""

from __future__ import annotations

import logging
import math
import time
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Iterable, Iterator

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

__all__ = [
    "Compute",
    "compute_settings",
    "current_compute",
    "autocast",
    "grad_scaler",
    "backward_step",
    "NonFiniteError",
    "StepMeans",
    "log_epoch",
    "LOSS_READ_EVERY",
    "coordinate_median",
    "trimmed_mean",
    "make_optimizer",
    "train_epochs",
    "with_regularizer",
    "predict_proba",
    "get_state",
    "move_state",
    "weighted_average",
    "state_fingerprint",
]

logger = logging.getLogger(__name__)

LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
Regularizer = Callable[[nn.Module], torch.Tensor]


@dataclass(frozen=True)
class Compute:
    """How a step computes (not what it learns): mixed precision and memory format.

    Attributes:
        amp: ``"bf16"`` or ``"fp16"``: forward passes under :func:`torch.autocast` in that
            type (``fp16`` training also scales the loss with a :class:`torch.amp.GradScaler`);
            ``None``: full precision.
        channels_last: models and 4D/5D batches in channels-last memory format while training
            and predicting (faster convolutions on recent GPUs and on CPUs with oneDNN).
        device: the device type autocast applies to (``cpu``, ``cuda``, ``mps``).
    """

    amp: str | None = None
    channels_last: bool = False
    device: str = "cpu"

    @classmethod
    def from_train(cls, train: dict[str, Any], device: str) -> "Compute":
        """The settings of a ``train`` dict (``amp``, ``channels_last``) on ``device``."""
        return cls(amp=train.get("amp") or None, channels_last=bool(train.get("channels_last")),
                   device=torch.device(str(device)).type)

    @property
    def dtype(self) -> torch.dtype | None:
        """The autocast type, or ``None``."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.amp or "")


_COMPUTE: ContextVar[Compute] = ContextVar("medfl_compute", default=Compute())


def current_compute() -> Compute:
    """The settings of the step running now (full precision outside any step)."""
    return _COMPUTE.get()


@contextmanager
def compute_settings(train: dict[str, Any], device: str) -> Iterator[Compute]:
    """Run a client's (or the coordinator's) step with the ``amp`` and ``channels_last`` of
    its ``train`` settings: :func:`train_epochs`, :func:`predict_proba` and :func:`autocast`
    follow them. The engine wraps every method hook in it; a method never needs to."""
    token = _COMPUTE.set(Compute.from_train(train, device))
    try:
        yield _COMPUTE.get()
    finally:
        _COMPUTE.reset(token)


def autocast() -> ContextManager[Any]:
    """:func:`torch.autocast` with the step's ``amp`` type, or a no-op in full precision:
    for a method's own training or scoring loop (``with autocast(): loss = ...``), so that
    ``train.amp`` reaches it as it reaches :func:`train_epochs`."""
    c = _COMPUTE.get()
    return torch.autocast(device_type=c.device, dtype=c.dtype) if c.dtype is not None else nullcontext()


def grad_scaler(device: str) -> "torch.amp.GradScaler | None":
    """A :class:`torch.amp.GradScaler` when the step trains in ``fp16`` (small gradients would
    underflow without one), else ``None``: pass it to :func:`backward_step`."""
    return torch.amp.GradScaler(torch.device(str(device)).type) if _COMPUTE.get().amp == "fp16" else None


def backward_step(loss: torch.Tensor, optimizer: torch.optim.Optimizer, scaler: "torch.amp.GradScaler | None" = None,
                  clip_grad_norm: float | None = None, params: Iterable[torch.nn.Parameter] | None = None) -> None:
    """``loss.backward()``, optional gradient-norm clipping of ``params``, ``optimizer.step()``,
    through ``scaler`` when given (:func:`grad_scaler`): what a method's own training loop
    calls so that ``train.amp`` = ``fp16`` works there as in :func:`train_epochs`."""
    if scaler is None:
        loss.backward()
        if clip_grad_norm is not None:
            nn.utils.clip_grad_norm_(list(params or []), clip_grad_norm)
        optimizer.step()
        return
    scaler.scale(loss).backward()
    if clip_grad_norm is not None:
        scaler.unscale_(optimizer)
        nn.utils.clip_grad_norm_(list(params or []), clip_grad_norm)
    scaler.step(optimizer)   # skipped when the scaled gradients overflowed
    scaler.update()


def _memory_format(x: torch.Tensor) -> torch.memory_format | None:
    return {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())


def make_optimizer(params: Iterable[torch.nn.Parameter], train: dict[str, Any]) -> torch.optim.Optimizer:
    """Build the local optimizer named by ``train["optimizer"]`` (``sgd``, ``adam``, ``adamw``).

    Defaults, when ``train`` does not say: ``sgd`` with ``lr`` 0.01, ``momentum`` 0.9 and
    ``weight_decay`` 0 (Adam/AdamW: ``lr`` 0.01, ``weight_decay`` 0, torch's betas).

    Raises:
        ValueError: an unknown optimizer name.
    """
    name = str(train.get("optimizer", "sgd")).lower()
    lr = float(train.get("lr", 0.01))
    wd = float(train.get("weight_decay", 0.0))
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(train.get("momentum", 0.9)), weight_decay=wd)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=wd)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=wd)
    raise ValueError(f"train.optimizer: unknown optimizer {name!r}; valid: sgd, adam, adamw")


def _ce(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


def with_regularizer(loss_fn: LossFn | None, regularizer: Regularizer | None) -> LossFn | None:
    """The local loss plus a data-independent term, for plain (non-DP) training.

    What it is for: :meth:`medfl.hub.HubAndSpoke.local_regularizer` (FedProx's proximal
    term) in :func:`train_epochs`; DP-SGD instead adds the term's gradient after clipping and
    noise (:func:`medfl.privacy.dp_sgd.train_epochs_dp`).

    Args:
        loss_fn: ``loss_fn(model, x, y) -> loss``; ``None`` means cross-entropy of ``model(x)``.
        regularizer: ``regularizer(model) -> scalar tensor``, or ``None``.

    Returns:
        ``loss_fn`` itself (``None`` stays ``None``) when there is no regularizer; otherwise
        ``f(model, x, y) = loss_fn(model, x, y) + regularizer(model)``, the loss computed
        first.
    """
    if regularizer is None:
        return loss_fn
    base = loss_fn or _ce

    def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return base(model, x, y) + regularizer(model)

    return loss


def train_epochs(
    model: nn.Module,
    loader: DataLoader,
    optimizer: torch.optim.Optimizer,
    epochs: int = 1,
    *,
    device: str = "cpu",
    loss_fn: LossFn | None = None,
    clip_grad_norm: float | None = None,
    max_steps: int | None = None,
) -> dict[str, float]:
    """Train ``model`` for ``epochs`` passes over ``loader``.

    Batches without a sample (Opacus's Poisson sampling draws them) are skipped, and so
    are batches of one sample when the model has BatchNorm (it cannot train on them):
    neither runs the loss nor steps the optimizer, so neither turns the loss into NaN.

    Args:
        loss_fn: ``loss_fn(model, x, y) -> loss``; default cross-entropy of ``model(x)``.
        clip_grad_norm: clip the global gradient norm to this value when given.
        max_steps: stop after this many optimizer steps when given.

    The step's :class:`Compute` settings (``train.amp``, ``train.channels_last``, set by the
    engine with :func:`compute_settings`) apply: forward passes under autocast, an fp16
    gradient scaler (a step whose scaled gradients overflowed is skipped, as torch does),
    channels-last batches and model (the model is back in the usual layout on return).

    The step losses stay on the device and are read every :data:`LOSS_READ_EVERY` steps and
    at the end (:class:`StepMeans`: one wait for the GPU, not one per step). A NaN or infinite
    loss raises :class:`NonFiniteError` naming its step at that read, so up to that many steps
    run past it.

    When the ``medfl.training`` logger logs DEBUG (a run's ``log.txt`` under the ``medfl``
    command, ``-v``), each epoch ends with a line ``epoch e/E: loss L (B batches, b batches/s)``:
    the epoch's mean loss, read then (one more wait for the GPU per epoch; the sums, so the
    returned mean, are the same).

    Returns:
        ``{"loss": mean training loss over the samples trained on (0 when none),
        "steps": optimizer steps}``.
    """
    model.to(device).train()
    loss_fn = loss_fn or _ce
    compute = _COMPUTE.get()
    scaler = grad_scaler(device)
    has_bn = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
    losses = StepMeans(check=("loss",))
    fmt: torch.memory_format | None = None
    debug = logger.isEnabledFor(logging.DEBUG)
    try:
        for epoch in range(epochs):
            if debug:
                before, steps0, t0 = losses.total("loss"), losses.steps, time.perf_counter()
            for x, y in loader:
                if x.shape[0] == 0 or (x.shape[0] < 2 and has_bn):
                    continue  # nothing to learn from; BatchNorm cannot train on a batch of one
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                if compute.channels_last and _memory_format(x) is not None:
                    if fmt is None:
                        fmt = _memory_format(x)
                        model.to(memory_format=fmt)
                    x = x.contiguous(memory_format=fmt)
                optimizer.zero_grad(set_to_none=True)
                with autocast():
                    loss = loss_fn(model, x, y)
                losses.add(x.shape[0], loss=loss)
                backward_step(loss, optimizer, scaler, clip_grad_norm, model.parameters())
                if max_steps is not None and losses.steps >= max_steps:
                    return {"loss": losses.means().get("loss", 0.0), "steps": float(losses.steps)}
            if debug:
                log_epoch(epoch + 1, epochs, before, losses.total("loss"), losses.steps - steps0,
                          time.perf_counter() - t0)
        return {"loss": losses.means().get("loss", 0.0), "steps": float(losses.steps)}
    finally:
        if fmt is not None:   # states leave in the usual layout
            model.to(memory_format=torch.contiguous_format)


def log_epoch(epoch: int, epochs: int, before: tuple[float, float], after: tuple[float, float], batches: int,
               seconds: float) -> None:
    """The DEBUG line of one epoch of :func:`train_epochs` (and of DP-SGD's loop,
    :func:`medfl.privacy.dp_sgd.train_epochs_dp`), on the ``medfl.training`` logger: its mean loss (from the weighted
    sums ``before`` and ``after`` it, :meth:`StepMeans.total`), batches and batches per second."""
    weight = after[1] - before[1]
    loss = f"{(after[0] - before[0]) / weight:.4g}" if weight else "n/a (no batch trained)"
    rate = f"{batches / seconds:.3g}" if seconds > 0 else "n/a"
    logger.debug(f"epoch {epoch}/{epochs}: loss {loss} ({batches} batches, {rate} batches/s)")


#: :class:`StepMeans` (so :func:`train_epochs`) reads its step scalars from the device every
#: this many steps.
LOSS_READ_EVERY = 32


class StepMeans:
    """Scalars of training steps (losses and their parts), kept where they were computed and
    read in blocks of :data:`LOSS_READ_EVERY` steps.

    What it is for: a training loop's logging. ``float(loss)`` after every step waits for the
    GPU, so the Python loop cannot queue the next step's work while the GPU runs this one;
    here a block of steps costs one wait. The means are summed step by step in float64 from
    the values as computed (dtypes only widened), exactly what a per-step ``float()`` gives.

    Args:
        check: names whose value must be finite: a NaN or infinite one raises
            :class:`NonFiniteError` naming its step, at the read that sees it (so up to
            :data:`LOSS_READ_EVERY` steps run past it).

    Example::

        log = StepMeans(check=("loss",))
        for x, y in loader:
            ...
            log.add(x.shape[0], loss=loss, ce=ce)   # tensors or floats, weighted by the batch
        metrics = log.means()                     # {"loss": ..., "ce": ...}
    """

    def __init__(self, check: Iterable[str] = ()) -> None:
        self.steps = 0
        self._check = frozenset(check)
        self._sums: dict[str, float] = {}
        self._weights: dict[str, float] = {}
        self._pending: list[tuple[int, float, dict[str, torch.Tensor | float]]] = []

    def add(self, weight: float = 1, **values: torch.Tensor | float) -> None:
        """One step's scalars (one-element tensors or numbers), weighted by ``weight`` (the
        step's number of samples, or 1 for a mean over steps). A tensor is copied where it
        lies (no wait), so changing it in place afterwards does not change what was logged."""
        self.steps += 1
        kept = {k: v.detach().reshape(()).clone() if isinstance(v, torch.Tensor) else float(v)
                for k, v in values.items()}
        self._pending.append((self.steps, weight, kept))
        if len(self._pending) >= LOSS_READ_EVERY:
            self._read()

    def _read(self) -> None:
        """Bring the pending tensors over in one transfer per device and add everything up.

        Raises:
            NonFiniteError: a checked value is NaN or infinite (named by its step)."""
        if not self._pending:
            return
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for _, _, vals in self._pending:
            for v in vals.values():
                if isinstance(v, torch.Tensor):
                    by_device.setdefault(v.device, []).append(v)
        read = {d: iter(torch.stack(ts).cpu().tolist()) for d, ts in by_device.items()}   # stack widens dtypes
        pending, self._pending = self._pending, []
        for step, weight, vals in pending:
            for k, v in vals.items():
                value = next(read[v.device]) if isinstance(v, torch.Tensor) else v
                if k in self._check and not math.isfinite(value):
                    raise NonFiniteError(f"the training {k} became {value} at optimizer step {step}; lower "
                                         "train.lr or set train.clip_grad_norm")
                self._sums[k] = self._sums.get(k, 0.0) + value * weight
                self._weights[k] = self._weights.get(k, 0) + weight

    def total(self, name: str) -> tuple[float, float]:
        """``(weighted sum, total weight)`` of ``name`` over every step so far (read now): the
        mean over a stretch of steps is the difference of two totals (a training loop's
        per-epoch loss). Reading early changes no sum: they are added step by step in order."""
        self._read()
        return self._sums.get(name, 0.0), float(self._weights.get(name, 0))

    def means(self) -> dict[str, float]:
        """The weighted mean of each name over the steps that gave it."""
        self._read()
        return {k: total / self._weights[k] if self._weights[k] else 0.0 for k, total in self._sums.items()}


class NonFiniteError(ValueError):
    """Training produced a NaN or infinite loss or weights: the run stops, naming the client
    and round (:func:`medfl.engine.client.run_client_update` adds them)."""


@torch.no_grad()
def predict_proba(model: nn.Module, loader: DataLoader, device: str = "cpu") -> tuple[np.ndarray, np.ndarray]:
    """Return ``(labels (N,), class probabilities (N, K))`` of ``model`` over ``loader``.

    The model's outputs are logits, turned into probabilities with a softmax, unless the
    model declares ``returns_probabilities`` (:func:`medfl.models.as_probabilities`)."""
    from medfl.models.outputs import as_probabilities

    model.to(device).eval()
    channels_last = _COMPUTE.get().channels_last
    ys, ps = [], []
    fmt: torch.memory_format | None = None
    try:
        for x, y in loader:
            x = x.to(device, non_blocking=True)
            if channels_last and _memory_format(x) is not None:
                if fmt is None:
                    fmt = _memory_format(x)
                    model.to(memory_format=fmt)
                x = x.contiguous(memory_format=fmt)
            with autocast():
                out = model(x)
            ps.append(as_probabilities(model, out.float()).cpu())
            ys.append(torch.as_tensor(y))
    finally:
        if fmt is not None:
            model.to(memory_format=torch.contiguous_format)
    if not ys:
        return np.zeros(0, dtype=np.int64), np.zeros((0, 0), dtype=np.float32)
    return torch.cat(ys).numpy(), torch.cat(ps).numpy()


def get_state(model: nn.Module, keys: Iterable[str] | None = None) -> dict[str, torch.Tensor]:
    """A detached CPU copy of ``model``'s state dict (only ``keys`` when given). From a GPU
    the tensors come over in one transfer per dtype (:func:`move_state`), not one each."""
    state = model.state_dict()
    wanted = set(keys) if keys is not None else None
    picked = {k: v.detach() for k, v in state.items() if wanted is None or k in wanted}
    if any(v.device.type != "cpu" for v in picked.values()):
        return move_state(picked, "cpu")
    return {k: v.clone() for k, v in picked.items()}


def move_state(state: dict[str, Any], device: str | torch.device) -> dict[str, Any]:
    """A copy of ``state`` (a state dict) on ``device``, each tensor with its own storage
    (other values are kept as they are).

    What it is for: weights crossing between the CPU and a GPU. A copy per tensor waits for
    the GPU each time (a ResNet's state has 60-100 tensors), so the tensors of one dtype and
    device are packed into one buffer, moved in one transfer and cut apart there; a tensor
    already on ``device`` is cloned."""
    target = torch.device(device)
    if target.type == "cuda" and target.index is None:
        target = torch.device("cuda", torch.cuda.current_device())
    out: dict[str, Any] = {}
    groups: dict[tuple[torch.dtype, torch.device], list[str]] = {}
    for k, v in state.items():
        if not isinstance(v, torch.Tensor):
            out[k] = v
        elif v.device == target:
            out[k] = v.detach().clone()
        elif v.numel() == 0 or v.is_complex() or v.layout != torch.strided:
            out[k] = v.detach().to(target, copy=True)
        else:
            groups.setdefault((v.dtype, v.device), []).append(k)
    for keys in groups.values():
        flat = torch.cat([state[k].detach().reshape(-1) for k in keys]).to(target)
        for k, piece in zip(keys, flat.split([state[k].numel() for k in keys])):
            out[k] = piece.view(state[k].shape).clone() if len(keys) > 1 else piece.view(state[k].shape)
    return {k: out[k] for k in state}


def weighted_average(states: list[dict[str, torch.Tensor]], weights: list[float]) -> dict[str, torch.Tensor]:
    """Weighted average of state dicts with the same keys.

    Floating tensors are averaged in float64 and cast back; integer tensors (BatchNorm's
    ``num_batches_tracked``) take the weighted average rounded to the nearest integer.

    Raises:
        ValueError: no states, mismatched keys, or weights that do not sum to a positive number.
    """
    if not states:
        raise ValueError("weighted_average: no states to average")
    w = np.asarray(weights, dtype=np.float64)
    if w.shape != (len(states),) or w.sum() <= 0 or (w < 0).any():
        raise ValueError(f"weighted_average: need {len(states)} non-negative weights with a positive sum, got {weights}")
    w = w / w.sum()
    keys = list(states[0])
    for s in states[1:]:
        if list(s) != keys:
            raise ValueError("weighted_average: state dicts have different keys")
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        acc = sum(float(wi) * s[k].double() for wi, s in zip(w, states))
        ref = states[0][k]
        out[k] = acc.round().to(ref.dtype) if not ref.is_floating_point() else acc.to(ref.dtype)
    return out


def coordinate_median(states: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Coordinate-wise median of state dicts (Yin et al., ICML 2018), unweighted: with an
    even count the mean of the two middle values for floating tensors, the lower one for
    integer tensors (a value some client sent). Tolerates fewer than half the clients sending
    arbitrary values.

    Raises:
        ValueError: no states, or mismatched keys.
    """
    return _coordinatewise(states, 0.0, "coordinate_median")


def trimmed_mean(states: list[dict[str, torch.Tensor]], trim: float) -> dict[str, torch.Tensor]:
    """Coordinate-wise trimmed mean (Yin et al., ICML 2018): drop the ``floor(trim * n)``
    largest and smallest values of each coordinate and average the rest (float64), unweighted;
    integer tensors round. ``trim`` in [0, 0.5); 0 is the plain mean.

    Raises:
        ValueError: no states, mismatched keys, or ``trim`` outside [0, 0.5).
    """
    if not 0 <= trim < 0.5:
        raise ValueError(f"trimmed_mean: trim must be in [0, 0.5), got {trim}")
    return _coordinatewise(states, trim, "trimmed_mean")


def _coordinatewise(states: list[dict[str, torch.Tensor]], trim: float, what: str) -> dict[str, torch.Tensor]:
    if not states:
        raise ValueError(f"{what}: no states to aggregate")
    keys = list(states[0])
    if any(list(s) != keys for s in states[1:]):
        raise ValueError(f"{what}: state dicts have different keys")
    n = len(states)
    out: dict[str, torch.Tensor] = {}
    for k in keys:
        ref = states[0][k]
        stacked = torch.stack([s[k] for s in states]).double().sort(dim=0).values
        if what == "coordinate_median":
            if n % 2 or not ref.is_floating_point():
                agg = stacked[(n - 1) // 2]
            else:
                agg = (stacked[n // 2 - 1] + stacked[n // 2]) / 2
        else:
            cut = int(math.floor(trim * n))
            agg = stacked[cut:n - cut].mean(dim=0)
        out[k] = agg.to(ref.dtype) if ref.is_floating_point() else agg.round().to(ref.dtype)
    return out


def state_fingerprint(model: nn.Module) -> str:
    """A hash of a model's state (to reuse evaluation of identical models). A state on one
    device comes off it in one copy (a GPU waits once, not once per tensor)."""
    import hashlib

    h = hashlib.sha1()
    state = [(k, v.detach().contiguous().reshape(-1)) for k, v in model.state_dict().items()]
    if len({v.device for _, v in state}) == 1:
        whole = torch.cat([v.view(torch.uint8) for _, v in state]).cpu().numpy()
        at = 0
        for k, v in state:
            n = v.numel() * v.element_size()
            h.update(k.encode())
            h.update(whole[at:at + n].tobytes())
            at += n
        return h.hexdigest()
    for k, v in state:
        h.update(k.encode())
        h.update(v.cpu().numpy().tobytes())
    return h.hexdigest()
