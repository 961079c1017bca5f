"""Old import paths of moved modules: the names they re-export, with a deprecation warning.

A module that moved leaves a small module at its old path whose module-level ``__getattr__``
is :func:`moved_names`: ``from medfl.engine.training import train_epochs`` still gives the
object of the new module (the same object), and warns with a :class:`DeprecationWarning`
that names the new path. Importing the old module itself stays quiet, so only code that
uses a moved name is told. The old paths go away in the next release (CHANGELOG.md).
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any, Callable

__all__ = ["moved_names"]


def moved_names(old: str, new: str) -> Callable[[str], Any]:
    """The module ``__getattr__`` of the old module ``old``, whose names now live in ``new``.

    Any attribute of ``new`` read through ``old`` is returned as it is in ``new``, with a
    :class:`DeprecationWarning` naming both paths (pointing at the line that read it); other
    names raise :class:`AttributeError` as usual."""

    def __getattr__(name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        module = importlib.import_module(new)
        try:
            value = getattr(module, name)
        except AttributeError:
            raise AttributeError(f"module {old!r} has no attribute {name!r}") from None
        warnings.warn(f"{old}.{name} moved to {new}.{name}; import it from {new} "
                      f"(the old path goes away in the next release)",
                      DeprecationWarning, stacklevel=2)
        return value

    return __getattr__
