"""Deprecated path: the public dataset methods receive (``PublicData``...) moved to
:mod:`medfl.public`.

Kept for plugins written against it until the next release: each name read from here is
the object of :mod:`medfl.public`, with a :class:`DeprecationWarning` naming the new path.
"""

from __future__ import annotations

from medfl import public as _new
from medfl._moved import moved_names

__all__ = list(_new.__all__)

__getattr__ = moved_names(__name__, "medfl.public")
