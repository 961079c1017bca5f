"""Evaluation metrics (NumPy) and per-client summaries."""

from __future__ import annotations

from medfl.metrics.classification import *  # noqa: F403 - its __all__, re-exported
from medfl.metrics.classification import __all__  # noqa: F401
