"""Build a model from a spec ``{"name": ..., **kwargs}`` through the model registry."""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from medfl.plugins import lookup

__all__ = ["build_model", "ModelConfigError"]


class ModelConfigError(ValueError):
    """A model spec names an unknown model or passes arguments it does not take."""


def build_model(spec: dict[str, Any]) -> nn.Module:
    """Build the registered model ``spec["name"]`` with the other keys as keyword arguments.

    Raises:
        PluginError: unknown model name (lists the valid ones).
        ModelConfigError: an argument the factory does not accept (lists the valid ones).
    """
    spec = dict(spec)
    name = spec.pop("name")
    factory = lookup("model", name)
    sig = inspect.signature(factory)
    if not any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
        unknown = sorted(set(spec) - set(sig.parameters))
        if unknown:
            raise ModelConfigError(
                f"model {name!r} takes no argument(s) {', '.join(unknown)}; valid: "
                f"{', '.join(sig.parameters)}"
            )
    return factory(**spec)
