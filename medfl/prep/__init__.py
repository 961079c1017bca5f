"""Dataset preparation: turn a dataset as downloaded into a manifest medfl reads.

One module per dataset (``medfl.prep.cbis_ddsm``, ``mias``, ``abide``, ``derm7pt``), each
with a ``main(argv)`` that ``data_prep/<name>.py`` calls; :mod:`medfl.prep.common` holds
what they share. ``abide`` and ``mias`` are packages, one module per part of the download
(``python -m medfl.prep.abide`` / ``mias`` runs their ``main`` too).
"""

from __future__ import annotations

from medfl.prep.common import MANIFEST_COLUMNS, PrepError, PrepReport

__all__ = ["MANIFEST_COLUMNS", "PrepError", "PrepReport"]
