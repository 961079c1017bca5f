"""Built-in dataset sources: the generated ``synthetic2d`` set and any ``manifest`` CSV."""

from __future__ import annotations

from typing import Callable

from medfl import hookimpl
from medfl.data.manifest import manifest_source
from medfl.data.synthetic import synthetic2d

__all__ = ["register_datasets"]


@hookimpl
def register_datasets(register: Callable[..., None]) -> None:
    """Register ``synthetic2d`` and ``manifest``."""
    register(synthetic2d, name="synthetic2d")
    register(manifest_source, name="manifest")
