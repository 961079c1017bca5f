"""Prepare HAM10000 for medfl: manifest, cached arrays, report.

Usage::

    python data_prep/ham10000.py --raw ~/data/HAM10000 --out ~/data/ham10000_224
    python data_prep/ham10000.py --raw ~/data/HAM10000 --out ~/data/ham10000_64 --size 64 \\
        --images all_images --skip-bad

See ``python data_prep/ham10000.py --help`` and :mod:`medfl.prep.ham10000`.
"""

from medfl.prep.common import run_script
from medfl.prep.ham10000 import main

if __name__ == "__main__":
    run_script(main)
