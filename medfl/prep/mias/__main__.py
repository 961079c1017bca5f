"""``python -m medfl.prep.mias``: the same command line as ``python data_prep/mias.py``."""

from medfl.prep.common import run_script
from medfl.prep.mias.cli import main

if __name__ == "__main__":
    run_script(main)
