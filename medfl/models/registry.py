"""Build a model from a spec ``{"name": ..., **kwargs}`` through the model registry."""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Iterator

import torch
from torch import nn

from medfl.plugins import lookup

__all__ = ["build_model", "build_seeded", "building", "recorded_builds", "ModelConfigError"]

#: the names of the models whose factories are running, outermost first (:func:`building`)
_building: ContextVar[tuple[str, ...]] = ContextVar("medfl_models_building", default=())
#: the specs built in a :func:`recorded_builds` block, or None outside one
_built: ContextVar[list[dict[str, Any]] | None] = ContextVar("medfl_models_built", default=None)


class ModelConfigError(ValueError):
    """A model spec names an unknown model or passes arguments it does not take."""


def build_model(spec: dict[str, Any]) -> nn.Module:
    """Build the registered model ``spec["name"]`` with the other keys as keyword arguments.

    One key is reserved and never reaches the factory: ``"dp_compatible"`` (default false).
    When true, the built model goes through Opacus's fixer
    (:func:`medfl.privacy.dp_sgd.make_private_model`: BatchNorm -> GroupNorm...), so DP-SGD
    (:func:`medfl.privacy.dp_sgd.train_epochs_dp`) can train it; the run sets it on every
    model spec when local training is differentially private, so the coordinator's model
    and the clients' have the same layers and state-dict keys.

    Raises:
        PluginError: unknown model name (lists the valid ones).
        ModelConfigError: an argument the factory does not accept (lists the valid ones), or a
            ``dp_compatible`` that is not a bool.
        PrivacyConfigError: ``dp_compatible`` is true and Opacus cannot make the model
            trainable with per-sample gradients (the message lists the layers).
    """
    spec = dict(spec)
    record = _built.get()
    if record is not None:
        record.append(dict(spec))
    name = spec.pop("name")
    dp_compatible = spec.pop("dp_compatible", False)
    if not isinstance(dp_compatible, bool):
        raise ModelConfigError(f"model {name!r}: dp_compatible must be true or false, "
                               f"got {dp_compatible!r}")
    factory = lookup("model", name)
    sig = inspect.signature(factory)
    if not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        unknown = sorted(set(spec) - set(sig.parameters))
        if unknown:
            raise ModelConfigError(
                f"model {name!r} takes no argument(s) {', '.join(unknown)}; valid: "
                f"{', '.join(sig.parameters)}"
            )
    token = _building.set((*_building.get(), str(name)))
    try:
        model = factory(**spec)
    finally:
        _building.reset(token)
    if dp_compatible:
        from medfl.privacy.dp_sgd import make_private_model  # imports Opacus: only when asked

        model = make_private_model(model, where=f"model {name!r}")[0]
    return model


def building() -> tuple[str, ...]:
    """The names of the models :func:`build_model` is building in this thread or task,
    outermost first: inside a wrapper model's factory that builds an inner model,
    ``("stem_cnn",)``. A site's refusal of the inner model names the wrapper with it
    (:func:`medfl.approval.guarded_models`)."""
    return _building.get()


@contextmanager
def recorded_builds() -> Iterator[list[dict[str, Any]]]:
    """Within the block (this thread or task), every spec :func:`build_model` is given, an
    inner model's included, is appended to the list yielded: what a method's ``setup`` built
    already, which the engine need not build again to check it
    (:meth:`medfl.engine.checkpoints.Checkpoints.prepare`)."""
    specs: list[dict[str, Any]] = []
    token = _built.set(specs)
    try:
        yield specs
    finally:
        _built.reset(token)


def build_seeded(spec: dict[str, Any], seed: int, device: str = "cpu") -> nn.Module:
    """:func:`build_model` initialised from ``seed`` (the same weights on any machine), on
    ``device``, leaving the caller's torch random state untouched: the model is initialised on
    the CPU from the CPU generator alone (:func:`torch.manual_seed` would also reseed every
    GPU's generator, which ``fork_rng`` does not restore)."""
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(int(seed))
        return build_model(dict(spec)).to(device)
