"""Sample-level differential privacy in local training: DP-SGD with Opacus.

Three pieces, used by the hub-and-spoke methods (:class:`medfl.hub.HubAndSpoke`) when
the run's local-training settings carry a ``dp`` section:

* :func:`make_private_model`: Opacus's own validator (``ModuleValidator.fix``: BatchNorm ->
  GroupNorm, LSTM -> DPLSTM...) and what it leaves unsolved, reported once and clearly. The
  model registry applies it to a model spec with ``"dp_compatible": true``
  (:func:`medfl.models.registry.build_model`), so the coordinator's global model and every
  client's model have the same structure.
* :func:`planned_steps`: the optimizer steps and Poisson sampling rate of one local update,
  exactly as :func:`train_epochs_dp` takes them; the coordinator accounts epsilon from them.
* :func:`train_epochs_dp`: DP-SGD (Abadi et al., CCS 2016). Each step samples every training
  example independently with probability ``q`` (Opacus's ``UniformWithReplacementSampler``),
  computes per-sample gradients, and lets Opacus's ``DPOptimizer`` clip each to
  ``max_grad_norm``, sum them, add ``N(0, (noise_multiplier * max_grad_norm)^2)`` noise and
  divide by the expected batch size ``q * N`` before the wrapped optimizer's step. The noise
  is medfl's (:class:`FiniteNoiseDPOptimizer`: :func:`medfl.privacy.noise.gaussian`, finite
  by construction), not Opacus's ``torch.normal``.

Per-sample gradients come from Opacus's ``GradSampleModuleExpandedWeights`` (``grad_sample_mode
"ew"``, PyTorch's ExpandedWeights) rather than its hook-based ``GradSampleModule``: the hooks
are full backward hooks, which PyTorch forbids before an in-place operation, and every
built-in model has some (MONAI's ResNet blocks add the shortcut with ``out += residual``; their
ReLUs are in place): a hooked ResNet fails at its first forward pass. ExpandedWeights has no
such restriction. It supports convolutions, linear, GroupNorm, LayerNorm, InstanceNorm and
embedding layers; another layer with parameters fails at the first batch with a
:class:`~medfl.privacy.accounting.PrivacyConfigError` naming it.
"""

from __future__ import annotations

import logging
import math
import numbers
import time
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torch.utils.data._utils.collate import default_collate

from medfl.training import LossFn, Regularizer, StepMeans, _ce, log_epoch
from medfl.training import logger as training_logger
from medfl.privacy.accounting import PrivacyConfigError
from medfl.privacy.noise import gaussian
from medfl.seeding import derive_noise_seed

try:
    from opacus.grad_sample import GradSampleModuleExpandedWeights
    from opacus.optimizers import DPOptimizer
    from opacus.optimizers.optimizer import _check_processed_flag, _mark_as_processed
    from opacus.utils.module_utils import trainable_modules
    from opacus.utils.uniform_sampler import UniformWithReplacementSampler
    from opacus.validators import ModuleValidator
except ImportError as exc:  # pragma: no cover - opacus is installed with medfl's test extra
    raise ImportError("medfl.privacy.dp_sgd needs Opacus: pip install 'opacus>=1.5'") from exc

__all__ = ["make_private_model", "planned_steps", "train_epochs_dp", "dp_problems", "FiniteNoiseDPOptimizer"]

class FiniteNoiseDPOptimizer(DPOptimizer):
    """Opacus's ``DPOptimizer`` with medfl's Gaussian noise: the same ``N(0, (noise_multiplier
    * max_grad_norm)^2)`` on every coordinate of the summed clipped gradients, drawn with
    :func:`medfl.privacy.noise.gaussian` from the optimizer's generator (Box-Muller in float64,
    so never infinite, whatever ``torch.normal`` does on the device) and cast to the gradient's
    dtype. Opacus's ``secure_mode`` (a defence against floating-point attacks on the noise)
    is not used by medfl and is refused here rather than silently dropped."""

    def add_noise(self) -> None:
        """Add the noise to each parameter's clipped summed gradient (``p.grad``), as
        ``DPOptimizer.add_noise`` does."""
        if self.secure_mode:
            raise PrivacyConfigError("FiniteNoiseDPOptimizer: secure_mode is not supported")
        std = float(self.noise_multiplier * self.max_grad_norm)
        for p in self.params:
            _check_processed_flag(p.summed_grad)
            noise = gaussian(p.summed_grad.shape, std, self.generator, dtype=p.summed_grad.dtype,
                             device=p.summed_grad.device)
            p.grad = (p.summed_grad + noise).view_as(p)
            _mark_as_processed(p.summed_grad)


# ------------------------------------------------------------------------------ models
def _first_sentence(text: str) -> str:
    """The first sentence of an Opacus error message (they run to a paragraph)."""
    text = " ".join(str(text).split())
    head, sep, _ = text.partition(". ")
    return head + "." if sep else text


def _short(module: nn.Module) -> str:
    """``BatchNorm2d(4)``: a module's type and the positional part of its ``extra_repr``."""
    args = [a for a in module.extra_repr().split(", ") if a and "=" not in a]
    return f"{type(module).__name__}({', '.join(args)})"


def dp_problems(model: nn.Module) -> list[str]:
    """What keeps Opacus from training ``model`` with per-sample gradients, one line each.

    What it is for: the check :func:`make_private_model` runs after Opacus's fix and
    :func:`train_epochs_dp` runs before training. Three sources, each line naming the module:

    * Opacus's module validators (``ModuleValidator.validate``, run module by module so each
      error names its layer; its "model must be in training mode" check is left out, since
      training switches the mode): BatchNorm, LSTM/GRU, MultiheadAttention, InstanceNorm
      that tracks running statistics.
    * Opacus's per-sample-gradient check (``GradSampleModule.validate``): a layer with
      trainable parameters and buffers (the buffers are neither private nor per-sample).
    * Normalisation layers Opacus's validator skips because they have no trainable
      parameter (``BatchNorm2d(affine=False)``, a frozen BatchNorm, an InstanceNorm with
      running statistics): in training mode they still mix the samples of a batch and
      record statistics of the data, which DP-SGD does not protect.

    Args:
        model: any module.

    Returns:
        ``["<module name>: <what is wrong>", ...]``; empty when Opacus can train it.
    """
    problems: list[str] = []
    reported: set[str] = set()
    for name, module in trainable_modules(model):
        label = f"{name or '(model)'}: {_short(module)}"
        validator = ModuleValidator.VALIDATORS.get(type(module))
        errors = list(validator(module)) if validator is not None else []
        for err in errors:
            problems.append(f"{label}: {_first_sentence(err)}")
        buffers = [b for b, _ in module.named_buffers()]
        if buffers and not errors:
            problems.append(f"{label}: a layer with trainable parameters and buffers "
                            f"({', '.join(buffers)}); Opacus cannot make its buffers private")
        if errors or buffers:
            reported.add(name)
    norm_stats = (nn.modules.batchnorm._BatchNorm, nn.modules.instancenorm._InstanceNorm)
    for name, module in model.named_modules():
        if name in reported or not isinstance(module, norm_stats):
            continue
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            problems.append(f"{name or '(model)'}: {_short(module)}: BatchNorm without trainable "
                            "parameters (Opacus's fix replaces only trainable ones) still mixes "
                            "the samples of a batch and keeps running statistics of the data")
        elif module.track_running_stats:
            problems.append(f"{name or '(model)'}: {_short(module)}: InstanceNorm keeping running "
                            "statistics of the data, which DP-SGD does not protect")
    return problems


def _refuse(where: str, problems: list[str], advice: str) -> PrivacyConfigError:
    lines = "\n".join(f"  {p}" for p in problems)
    return PrivacyConfigError(
        f"{where}: Opacus cannot train this model with per-sample gradients:\n{lines};\n{advice}")


def _replacements(before: nn.Module, after: nn.Module) -> list[str]:
    """``"layer1.0.bn1: BatchNorm2d(4) -> GroupNorm(4, 4)"`` for each module ``after`` replaced
    or reconfigured (descendants of a replaced module are not listed again)."""
    new = dict(after.named_modules())
    out: list[str] = []
    done: list[str] = []
    for name, old in before.named_modules():
        if any(name == d or name.startswith(d + ".") for d in done) or name not in new:
            continue
        repl = new[name]
        if type(repl) is not type(old):
            out.append(f"{name or '(model)'}: {_short(old)} -> {_short(repl)}")
        elif repl.extra_repr() != old.extra_repr():
            out.append(f"{name or '(model)'}: {type(old).__name__}({old.extra_repr()}) -> "
                       f"{type(repl).__name__}({repl.extra_repr()})")
        else:
            continue
        done.append(name)
    return out


def _group_count(model: nn.Module) -> int | None:
    """The ``num_groups`` to hand Opacus's BatchNorm fixer, or ``None`` for its default.

    Opacus's default, ``GroupNorm(gcd(32, C), C)`` per layer, puts a single channel in each
    group when ``C`` divides 32 (every BatchNorm of a ResNet of width <= 32 in its first
    stage, all of them at width 4). On a 1x1 feature map (a ResNet-10 on 16x16 or 32x32
    images) such a group normalises one value: the layer outputs its bias whatever the
    input, and PyTorch refuses it outright for a batch of one sample, which Poisson sampling
    draws often. So when the default leaves some group with a single channel, one count is
    used for every layer instead: the largest divisor of ``gcd(32, C_1, C_2, ...)`` that
    leaves at least two channels in the narrowest layer. When every group of the default has
    two channels or more (any width-64 ResNet), the default stands."""
    batchnorm = nn.modules.batchnorm._BatchNorm
    fixable = [m for _, m in trainable_modules(model) if type(m) in ModuleValidator.FIXERS]
    widths = [int(m.num_features) for m in fixable if isinstance(m, batchnorm)]
    if not widths or all(c // math.gcd(32, c) >= 2 for c in widths):
        return None
    if any(not isinstance(m, batchnorm) for m in fixable):
        return None  # Opacus's other fixers take no num_groups
    common, narrowest = math.gcd(32, *widths), min(widths)
    return max((d for d in range(1, common + 1) if common % d == 0 and narrowest // d >= 2),
               default=1)


def make_private_model(model: nn.Module, where: str = "model") -> tuple[nn.Module, list[str]]:
    """``model`` made trainable by DP-SGD with Opacus's own fixer, and what was replaced.

    What it is for: building models that :func:`train_epochs_dp` can train (the registry's
    ``"dp_compatible": true``). Opacus's ``ModuleValidator.fix`` deep-copies the model (it
    pickles it, so the class and every attribute, e.g. ``head_prefix``, ``forward_features``,
    ``body_keys``, are kept) and replaces each fixable layer: BatchNorm by GroupNorm with
    fresh affine parameters (weight 1, bias 0; the running statistics leave the state dict),
    LSTM/GRU/MultiheadAttention by Opacus's DP versions, InstanceNorm's running statistics
    switched off. The GroupNorms have Opacus's default ``gcd(32, C)`` groups, unless that
    leaves a group with a single channel (narrow models): then every one gets the same,
    smaller count that leaves each group two channels or more (see :func:`_group_count`;
    ``resnet10(width=4)``: ``GroupNorm(2, C)``). Then :func:`dp_problems` checks what is left.

    Args:
        model: the model as built.
        where: what the model is, for the error message (default ``"model"``; the registry
            passes ``"model 'resnet10'"``).

    Returns:
        ``(model, replaced)``: a model already valid is returned as is (the same object)
        with ``[]``; otherwise the fixed copy and one line per replaced layer, e.g.
        ``"layer1.0.bn1: BatchNorm2d(64) -> GroupNorm(32, 64)"``.

    Raises:
        PrivacyConfigError: problems remain after the fix (e.g. a BatchNorm without trainable
            parameters, a layer with trainable parameters and buffers): one message
            ``"<where>: Opacus cannot train this model with per-sample gradients: ..."``
            listing them one per line.
    """
    if not dp_problems(model):
        return model, []
    groups = _group_count(model)
    fixed = ModuleValidator.fix(model) if groups is None else ModuleValidator.fix(model, num_groups=groups)
    remaining = dp_problems(fixed)
    if remaining:
        raise _refuse(where, remaining, "use a model without these layers")
    replaced = _replacements(model, fixed)
    if replaced and getattr(fixed, "norm", None) == "batch":
        fixed.norm = "group"   # the built-in models report their norm layers in repr and attributes
    return fixed, replaced


# ------------------------------------------------------------------------------ training
def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def planned_steps(num_examples: int, batch_size: int, epochs: int) -> tuple[int, float]:
    """The optimizer steps of one local update and its Poisson sampling rate.

    What it is for: the coordinator accounts the clients' epsilon from these numbers, so they
    are exactly what :func:`train_epochs_dp` does: ``ceil(num_examples / batch_size)``
    batches per epoch (the length of a plain loader, which Opacus's ``DPDataLoader`` also
    keeps), each a Poisson draw with rate ``1 / batches_per_epoch`` (expected batch
    ``num_examples / batches_per_epoch <= batch_size``), and every draw one noisy step, empty
    draws included.

    Args:
        num_examples: training-set size (``>= 1``).
        batch_size: the nominal batch size (``>= 1``).
        epochs: local epochs (``>= 0``).

    Returns:
        ``(steps, sample_rate)`` with ``steps = epochs * ceil(num_examples / batch_size)`` and
        ``sample_rate = 1 / ceil(num_examples / batch_size)``.

    Raises:
        ValueError: an argument that is not an integer in range (the message names it).
    """
    n = _check_int("num_examples", num_examples, 1)
    b = _check_int("batch_size", batch_size, 1)
    e = _check_int("epochs", epochs, 0)
    batches = -(-n // b)
    return e * batches, 1.0 / batches


def _collate_or_none(batch: list[Any]) -> Any:
    """``default_collate``, except that an empty Poisson draw gives ``None``."""
    return default_collate(batch) if batch else None


class _LossOf(nn.Module):
    """``forward(x, y) = loss_fn(model, x, y)``: the model's parameters are this module's, so
    Opacus's ExpandedWeights wrapper swaps them for the whole loss (any method of the model,
    ``forward_features`` included, gets per-sample gradients) and ``loss_fn`` still receives
    the caller's model object."""

    def __init__(self, model: nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.model = model
        object.__setattr__(self, "loss_fn", loss_fn)  # never a submodule: its parameters stay out

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_fn(self.model, x, y)


def _generator(seed: int | None, tag: str, device: str | torch.device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(derive_noise_seed(seed, tag))
    return gen


def _check_arguments(model: nn.Module, dataset: Dataset, batch_size: int, epochs: int,
                     noise_multiplier: float, max_grad_norm: float) -> int:
    """:func:`train_epochs_dp`'s argument checks, in its order; returns ``len(dataset)``."""
    if isinstance(noise_multiplier, bool) or not isinstance(noise_multiplier, numbers.Real) \
            or not noise_multiplier >= 0:
        raise ValueError(f"noise_multiplier must be a number >= 0, got {noise_multiplier!r}")
    if isinstance(max_grad_norm, bool) or not isinstance(max_grad_norm, numbers.Real) \
            or not (max_grad_norm > 0 and math.isfinite(max_grad_norm)):
        raise ValueError(f"max_grad_norm must be a finite number > 0, got {max_grad_norm!r}")
    _check_int("batch_size", batch_size, 1)
    _check_int("epochs", epochs, 0)
    num_examples = len(dataset)  # type: ignore[arg-type]
    if num_examples < 1:
        raise ValueError("dataset: DP-SGD needs at least one training example, got none")
    problems = dp_problems(model)
    if problems:
        raise _refuse("model", problems, "build it with medfl.privacy.dp_sgd.make_private_model "
                      "(model spec key 'dp_compatible': true) or use a model without these layers")
    return num_examples


def _add_regularizer(dp_opt: DPOptimizer, regularizer: Regularizer, model: nn.Module) -> None:
    """Make ``dp_opt`` add ``regularizer(model)``'s gradient to the clipped, noised and scaled
    gradient before the wrapped optimizer's step (after any step hook it already has)."""
    previous = dp_opt.step_hook

    def add_regularizer_grad(opt: DPOptimizer) -> None:
        # runs after clipping, noise and scaling, before the wrapped optimizer's step
        if previous is not None:
            previous(opt)
        with torch.enable_grad():
            term = regularizer(model)
            grads = torch.autograd.grad(term, opt.params, allow_unused=True)
        for p, g in zip(opt.params, grads):
            if g is not None:
                p.grad.add_(g)

    dp_opt.attach_step_hook(add_regularizer_grad)


def _per_sample_grads(wrapped: GradSampleModuleExpandedWeights, params: list[nn.Parameter],
                      x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The batch's loss, after its backward pass has left each of ``params`` a ``grad_sample``
    (zeros for a parameter the loss does not use) and no ``grad``."""
    try:
        loss = wrapped(x, y)
        loss.backward()
    except (RuntimeError, NotImplementedError) as exc:
        if "Expanded Weights" in str(exc) or "ExpandedWeights" in str(exc):
            raise PrivacyConfigError("model: Opacus cannot compute per-sample gradients through "
                                     f"this model or loss: {exc}") from exc
        raise
    for p in params:
        if p.grad is not None:
            raise RuntimeError("train_epochs_dp: loss_fn produced a gradient outside the per-sample path "
                               "(it must compute the loss from the model it receives, not from tensors "
                               "captured before the call); put data-independent terms in regularizer")
        if getattr(p, "grad_sample", None) is None:  # not used by the loss
            p.grad_sample = torch.zeros((int(x.shape[0]), *p.shape), dtype=p.dtype, device=p.device)
    return loss


def _dp_epochs(epochs: int, loader: DataLoader, wrapped: GradSampleModuleExpandedWeights,
               dp_opt: DPOptimizer, params: list[nn.Parameter], device: str, losses: StepMeans) -> int:
    """``epochs`` passes of DP-SGD over ``loader``: a noisy step per Poisson draw, empty draws
    included (noise only); the batches' losses go to ``losses``, and each epoch logs
    :func:`medfl.training.log_epoch`'s DEBUG line. Returns the steps taken."""
    debug, steps = training_logger.isEnabledFor(logging.DEBUG), 0   # log_epoch's logger
    for epoch in range(epochs):
        if debug:
            before, steps0, t0 = losses.total("loss"), steps, time.perf_counter()
        for batch in loader:
            dp_opt.zero_grad(set_to_none=True)
            for p in params:  # also those the optimizer does not hold: ExpandedWeights fills them
                p.grad_sample = None
                p.grad = None
            if batch is None:  # an empty Poisson draw: a step of noise only
                for p in params:
                    p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)
            else:
                x, y = batch[0].to(device), batch[1].to(device)
                losses.add(int(x.shape[0]), loss=_per_sample_grads(wrapped, params, x, y))
            dp_opt.step()
            steps += 1
        if debug:   # the same per-epoch line as train_epochs (noisy steps included in the batches)
            log_epoch(epoch + 1, epochs, before, losses.total("loss"), steps - steps0, time.perf_counter() - t0)
    return steps


def _restore(model: nn.Module, built: dict[int, set[str]], dp_opt: DPOptimizer | None,
             wrapped: GradSampleModuleExpandedWeights | None) -> None:
    """Take Opacus off ``model``: no gradient, and on no parameter or module an attribute that
    it did not have before (``built``: their names by ``id``)."""
    if dp_opt is not None:
        dp_opt.zero_grad(set_to_none=True)
    if wrapped is not None:
        wrapped._close()  # Opacus's clean-up: grad_sample, _forward_counter... off the parameters
    for obj in [*model.parameters(), *model.modules()]:
        for attr in set(vars(obj)) - built.get(id(obj), set()):
            delattr(obj, attr)
    for p in model.parameters():
        p.grad = None


def train_epochs_dp(model: nn.Module, dataset: Dataset, optimizer: torch.optim.Optimizer, epochs: int, *,
                    batch_size: int, noise_multiplier: float, max_grad_norm: float, seed: int | None,
                    device: str = "cpu", loss_fn: LossFn | None = None, num_workers: int = 0,
                    regularizer: Regularizer | None = None) -> dict[str, float]:
    """Train ``model`` in place for ``epochs`` with DP-SGD (Opacus).

    What it is for: the local training of a client under sample-level DP. The steps are
    exactly :func:`planned_steps` ``(len(dataset), batch_size, epochs)``, each a Poisson draw
    of the training set followed by Opacus's clipped, noised and scaled step (the module
    docstring); an empty draw is a step too (noise only, as the privacy analysis assumes).

    The model object is trained in place and, when this returns or raises, is left as it was
    built: no Opacus hook or attribute on any module or parameter, every ``p.grad`` None, in
    training mode. ``optimizer`` (a plain torch optimizer over its parameters) keeps its
    state (momentum).

    Args:
        model: a model :func:`dp_problems` finds nothing wrong with (build it with
            :func:`make_private_model`, or the model spec key ``"dp_compatible": true``).
        dataset: the training set; items ``(x, y)``.
        optimizer: the local optimizer over ``model``'s parameters.
        epochs: local epochs (``>= 0``).
        batch_size: nominal batch size; the expected Poisson batch is
            ``len(dataset) / ceil(len(dataset) / batch_size)``.
        noise_multiplier: sigma (``>= 0``; ``0`` gives no privacy and is for tests only).
        max_grad_norm: per-sample clipping norm C (``> 0``).
        seed: seeds the Poisson sampler and the noise (two ``torch.Generator`` derived from
            it), so one seed gives bit-identical weights in any process; ``None`` draws them
            from the operating system's entropy.
        device: torch device (default ``"cpu"``).
        loss_fn: ``loss_fn(model, x, y) -> loss``, the MEAN over the batch of per-sample
            losses (default cross-entropy of ``model(x)``). It gets the caller's model; any
            of its methods may be called. A term that mixes samples or does not depend on
            the data belongs in ``regularizer``.
        num_workers: DataLoader worker processes (default 0).
        regularizer: ``regularizer(model) -> scalar tensor`` (default none), a data-independent
            term of the objective (FedProx's proximal term): its gradient is added to the
            clipped, noised gradient before every step, empty draws included (post-processing,
            no privacy cost; composed with any ``DPOptimizer`` step hook).

    Returns:
        ``{"loss": mean training loss over the samples drawn (0 when none), "steps":
        optimizer steps, "dp_steps": the same, "dp_sample_rate": q,
        "dp_noise_multiplier": sigma}``.

    Raises:
        ValueError: ``noise_multiplier < 0``, ``max_grad_norm <= 0``, ``batch_size < 1``,
            ``epochs < 0``, or an empty dataset (the message names the argument).
        PrivacyConfigError: Opacus cannot train the model (:func:`dp_problems`), or a layer
            or operation has no per-sample-gradient rule.
        RuntimeError: ``loss_fn`` produced a gradient outside the per-sample path (it used
            parameters it captured before the call).
    """
    num_examples = _check_arguments(model, dataset, batch_size, epochs, noise_multiplier, max_grad_norm)
    batches, sample_rate = planned_steps(num_examples, batch_size, 1)
    model.to(device).train()
    params = [p for p in model.parameters() if p.requires_grad]
    built = {id(obj): set(vars(obj)) for obj in [*model.parameters(), *model.modules()]}
    sampler = UniformWithReplacementSampler(num_samples=num_examples, sample_rate=sample_rate, steps=batches,
                                            generator=_generator(seed, "dp_sgd.poisson", "cpu"))
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=_collate_or_none,
                        num_workers=int(num_workers), generator=_generator(seed, "dp_sgd.workers", "cpu"))
    wrapped: GradSampleModuleExpandedWeights | None = None
    dp_opt: DPOptimizer | None = None
    losses = StepMeans()   # the losses read every few steps, not every step
    try:
        wrapped = GradSampleModuleExpandedWeights(_LossOf(model, loss_fn or _ce), batch_first=True,
                                                  loss_reduction="mean")
        dp_opt = FiniteNoiseDPOptimizer(optimizer, noise_multiplier=float(noise_multiplier),
                                         max_grad_norm=float(max_grad_norm),
                                         expected_batch_size=num_examples * sample_rate,
                                         loss_reduction="mean",
                                         generator=_generator(seed, "dp_sgd.noise", device))
        if regularizer is not None:
            _add_regularizer(dp_opt, regularizer, model)
        steps = _dp_epochs(int(epochs), loader, wrapped, dp_opt, params, device, losses)
    finally:
        _restore(model, built, dp_opt, wrapped)
    return {"loss": losses.means().get("loss", 0.0), "steps": float(steps), "dp_steps": float(steps),
            "dp_sample_rate": float(sample_rate), "dp_noise_multiplier": float(noise_multiplier)}
