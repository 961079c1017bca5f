"""Seeds: every random draw in medfl is seeded from parts such as (run seed, round, client)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

__all__ = ["derive_seed", "round_half_up"]


def derive_seed(*parts: Any) -> int:
    """Derive a 31-bit seed from any parts (run seed, round, client id...), stably.

    Every random draw in medfl is seeded from ``(seed, round, client)`` this way, so a run
    resumed at round k draws exactly what an uninterrupted run draws.
    """
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


def round_half_up(x: float) -> int:
    """Round to the nearest integer, halves up (Python's round() rounds halves to even)."""
    return int(np.floor(x + 0.5))
