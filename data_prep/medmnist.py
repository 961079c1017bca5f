"""Prepare one MedMNIST v2 / MedMNIST+ file for medfl: manifest, cached arrays, report.

Usage::

    python data_prep/medmnist.py --raw ~/data/medmnist --flag pathmnist --out ~/data/pathmnist_28
    python data_prep/medmnist.py --raw ~/data/medmnist/pathmnist_64.npz --out ~/data/pathmnist_64

See ``python data_prep/medmnist.py --help`` and :mod:`medfl.prep.medmnist`.
"""

from medfl.prep.common import run_script
from medfl.prep.medmnist import main

if __name__ == "__main__":
    run_script(main)
