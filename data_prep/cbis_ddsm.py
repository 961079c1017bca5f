"""Prepare CBIS-DDSM as downloaded from TCIA for medfl.

    python data_prep/cbis_ddsm.py --raw ~/data/CBIS-DDSM-download --out ~/data/cbis_512 \\
        [--abnormality both|mass|calc] [--size 512 320] [--aspect pad|crop|stretch] \\
        [--roi-crops --roi-size 224 224] [--patient-overlap move-to-test|drop-train|error] \\
        [--skip-bad] [--overwrite] [--limit N]

See ``--help`` and bundles/cbis_ddsm/docs/README.md.
"""

from medfl.prep.cbis_ddsm import main
from medfl.prep.common import run_script

if __name__ == "__main__":
    run_script(main)
