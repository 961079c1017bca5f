"""``python -m medfl.prep.abide``: the same command line as ``python data_prep/abide.py``."""

from medfl.prep.abide.cli import main
from medfl.prep.common import run_script

if __name__ == "__main__":
    run_script(main)
