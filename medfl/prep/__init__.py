"""Dataset preparation: turn a dataset as downloaded into a manifest medfl reads.

One module per dataset (``medfl.prep.cbis_ddsm``, ``mias``, ``abide``, ``derm7pt``,
``ham10000``, ``medmnist``), each with a ``main(argv)`` that ``data_prep/<name>.py`` calls
and ``python -m medfl.prep.<name>`` runs (the same command line, in an installed medfl too);
:mod:`medfl.prep.common` holds what they share. ``abide`` and ``mias`` are packages, one
module per part of the download.
"""

from __future__ import annotations

from medfl.prep.common import MANIFEST_COLUMNS, PrepReport
from medfl.prep.errors import PrepError

__all__ = ["MANIFEST_COLUMNS", "PrepError", "PrepReport"]
