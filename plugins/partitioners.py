"""Built-in partitioners: dirichlet, label_skew (#C=k), quantity_skew, iid, natural, subset,
class_sample; each deals whole ``group_column`` groups (one subject's rows) to one client."""

from __future__ import annotations

from typing import Callable

from medfl import hookimpl
from medfl.data.partition import PARTITIONERS

__all__ = ["register_partitioners"]


@hookimpl
def register_partitioners(register: Callable[..., None]) -> None:
    """Register every partitioner of :mod:`medfl.data.partition`."""
    for name, func in PARTITIONERS.items():
        register(func, name=name)
