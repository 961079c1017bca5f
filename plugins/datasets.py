"""Built-in dataset sources: the generated ``synthetic2d`` set, any ``manifest`` CSV and the
lazily drawn ``random_blocks`` (benchmarks: no files, any size, 2D or 3D)."""

from __future__ import annotations

from typing import Callable

from medfl import hookimpl
from medfl.data.manifest import manifest_source
from medfl.data.random_blocks import random_blocks
from medfl.data.synthetic import synthetic2d

__all__ = ["register_datasets"]


@hookimpl
def register_datasets(register: Callable[..., None]) -> None:
    """Register ``synthetic2d``, ``manifest`` and ``random_blocks``."""
    register(synthetic2d, name="synthetic2d")
    register(manifest_source, name="manifest")
    register(random_blocks, name="random_blocks")
