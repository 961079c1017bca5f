"""Deprecated path: the hub-and-spoke method base class (``HubAndSpoke``, ``norm_keys``) moved
to :mod:`medfl.hub`, beside the method contract.

Kept for plugins written against it until the next release: each name read from here is
the object of :mod:`medfl.hub`, with a :class:`DeprecationWarning` naming the new path.
"""

from __future__ import annotations

from medfl import hub as _new
from medfl._moved import moved_names

__all__ = list(_new.__all__)

__getattr__ = moved_names(__name__, "medfl.hub")
