"""Seeds: every random draw in medfl is seeded from parts such as (run seed, round, client)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

__all__ = ["derive_seed", "derive_noise_seed", "round_half_up", "seed_torch"]


def derive_seed(*parts: Any) -> int:
    """Derive a 31-bit seed from any parts (run seed, round, client id...), stably.

    Every random draw in medfl is seeded from ``(seed, round, client)`` this way, so a run
    resumed at round k draws exactly what an uninterrupted run draws.
    """
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).hexdigest()
    return int(digest[:8], 16) & 0x7FFFFFFF


def derive_noise_seed(*parts: Any) -> int:
    """Derive a 63-bit seed for privacy noise from any parts, stably (as :func:`derive_seed`).

    What it is for: the seed of every differential-privacy draw. A 31-bit seed could be found
    by trying every value against a released vector (2^31 draws of a few coordinates); 63 bits
    cannot. The parts must name the release's own parameters (mechanism, noise multiplier,
    clip) and the step, so that one seed never gives "the same draw at another scale", and
    the site's secret where there is one (:attr:`medfl.context.ClientContext.noise_key`).
    """
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).hexdigest()
    return int(digest[:16], 16) & 0x7FFFFFFFFFFFFFFF


def seed_torch(seed: int) -> None:
    """Seed torch's global generators as :func:`torch.manual_seed` does: the CPU's, and every
    CUDA device's where CUDA is available (queued until CUDA starts, as torch does), and MPS's
    where it is available.

    What it is for: seeding every client step (several times a round per client).
    :func:`torch.manual_seed` also seeds backends medfl never uses (XPU, MTIA), and for each
    one not started it records the caller's stack, which costs about 0.3 ms a call; this
    costs microseconds and draws the same numbers."""
    import torch

    seed = int(seed)
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)
    if torch.backends.mps.is_available():
        torch.mps.manual_seed(seed)


def round_half_up(x: float) -> int:
    """Round to the nearest integer, halves up (Python's round() rounds halves to even)."""
    return int(np.floor(x + 0.5))
