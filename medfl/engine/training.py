"""Deprecated path: the training helpers (``train_epochs``, ``StepMeans``, ``make_optimizer``...)
moved to :mod:`medfl.training`, below both the method contract and the engine.

Kept for plugins written against it until the next release: each name read from here is
the object of :mod:`medfl.training`, with a :class:`DeprecationWarning` naming the new path.
"""

from __future__ import annotations

from medfl import training as _new
from medfl._moved import moved_names

__all__ = list(_new.__all__)

__getattr__ = moved_names(__name__, "medfl.training")
