"""Prepare mini-MIAS for medfl: manifest, cached arrays, report.

Usage::

    python data_prep/mias.py --raw ~/data/all-mias --out ~/data/mias_256
    python data_prep/mias.py --raw ~/data/all-mias --out ~/data/mias_bm_roi \\
        --classes benign-malignant --roi --size 128 --test-fraction 0.2 --seed 0 --skip-bad

``--raw`` holds Info.txt and mdb001.pgm ... mdb322.pgm (flat, or in all-mias/). See
``python data_prep/mias.py --help`` and :mod:`medfl.prep.mias`.
"""

from medfl.prep.common import run_script
from medfl.prep.mias import main

if __name__ == "__main__":
    run_script(main)
