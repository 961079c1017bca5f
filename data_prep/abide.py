"""Prepare ABIDE-I Preprocessed (PCP) derivatives for medfl: manifest, cached arrays, atlas, report.

Usage::

    # PCP's S3 layout: <raw>/Phenotypic_V1_0b_preprocessed1.csv and
    # <raw>/Outputs/ccs/filt_noglobal/{reho,degree_weighted,lfcd,vmhc}/<FILE_ID>_<derivative>.nii.gz
    python data_prep/abide.py --raw ~/data/ABIDE_Initiative --out ~/data/abide_ccs

    # nilearn's fetch_abide_pcp layout (<raw>/ABIDE_pcp/<pipeline>/<strategy>/...), resized to
    # 48^3 as in FedSKD, motion threshold, CC200 atlas from PCP's repository
    python data_prep/abide.py --raw ~/nilearn_data --out ~/data/abide48 --size 48 \\
        --max-mean-fd 0.2 --atlas cc200 --atlas-file abide/preprocessing/resources/abide_rois/CC200.nii.gz

See ``python data_prep/abide.py --help`` and :mod:`medfl.prep.abide`.
"""

from medfl.prep.abide import main
from medfl.prep.common import run_script

if __name__ == "__main__":
    run_script(main)
