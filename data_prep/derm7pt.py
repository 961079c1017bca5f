"""Prepare Derm7pt (release_v0) for medfl: manifest, cached arrays, report.

Usage::

    python data_prep/derm7pt.py --raw ~/data/release_v0 --out ~/data/derm7pt_224
    python data_prep/derm7pt.py --raw ~/data/release_v0 --out ~/data/derm7pt_64 --size 64 \\
        --crop-border 25 --clinic --skip-bad

See ``python data_prep/derm7pt.py --help`` and :mod:`medfl.prep.derm7pt`.
"""

from medfl.prep.common import run_script
from medfl.prep.derm7pt import main

if __name__ == "__main__":
    run_script(main)
