"""ABIDE-I Preprocessed (PCP) as downloaded -> a medfl manifest of 4-channel 3D derivative maps.

Two download layouts are accepted (``--layout auto`` tells them apart)::

    # PCP's S3 bucket (ABIDE_Initiative/), e.g. with aws s3 sync or the PCP download script
    <raw>/Phenotypic_V1_0b_preprocessed1.csv
    <raw>/Outputs/<cpac|ccs|dparsf|niak>/<filt|nofilt>_<global|noglobal>/<derivative>/<FILE_ID>_<derivative>.nii.gz

    # nilearn.datasets.fetch_abide_pcp(data_dir=<raw>) (flat: no derivative folder)
    <raw>/ABIDE_pcp/Phenotypic_V1_0b_preprocessed1.csv
    <raw>/ABIDE_pcp/<pipeline>/<strategy>/<FILE_ID>_<derivative>.nii.gz

``--raw`` may also point at ``Outputs/``'s parent's ``ABIDE_pcp`` folder itself, or at
``Outputs``; ``--phenotypic`` names the CSV when it lives elsewhere.

What this module does, and why:

* The phenotypic CSV is parsed as it is: its first two header cells are ``""`` and
  ``Unnamed: 0`` (an index column written twice by pandas), some quoted fields hold commas
  (rater notes), ``-9999`` or an empty field means missing. ``DX_GROUP`` 1 = autism
  (label 1), 2 = control (label 0); ``SEX`` 1 = male (``M``), 2 = female (``F``). An unknown
  ``DX_GROUP``/``SEX``/``SITE_ID`` value is an error naming the row.
* Rows with ``FILE_ID == no_filename`` (77 in the real file) have no derivatives and are
  excluded, as nilearn does. Quality control (``--qc nilearn``, the default) keeps the rows
  nilearn's ``fetch_abide_pcp(quality_checked=True)`` keeps: ``qc_rater_1`` OK,
  ``qc_anat_rater_2`` and ``qc_func_rater_2`` OK or maybe, ``qc_anat_rater_3`` and
  ``qc_func_rater_3`` OK. On the real file this leaves 871 subjects (403 autism, 468
  control), exactly the FedSKD cohort (Table I). ``--max-mean-fd`` additionally drops
  subjects whose mean framewise displacement (``func_mean_fd``, mm) is above a threshold
  (or unknown). Exclusions are listed in ``excluded.csv``; they are choices, not errors.
* The four FedSKD derivatives (``reho``, ``degree_weighted``, ``lfcd``, ``vmhc``; DC also
  exists as ``degree_binarize``) are stacked as channels in that order: arrays are float32
  ``(4, 61, 73, 61)`` in NIfTI voxel order (i, j, k), non-finite voxels set to 0.
* Every volume's shape and affine are checked against the PCP grid (61 x 73 x 61, 3 mm,
  :data:`GRID_AFFINE`). A different grid is an error unless ``--resample linear|nearest``
  asks for explicit resampling (``scipy.ndimage``; exact slicing when the grids differ by
  whole voxels); resampled samples are flagged in the manifest.
* ``SITE_ID`` (20 values) -> the 17 sites of FedSKD's Table I (``LEUVEN_1/2``, ``UCLA_1/2``
  and ``UM_1/2`` merged) -> its four regional clients (:data:`REGIONS`), written as the
  ``region`` column for the ``natural`` partitioner; ``site`` is the Table I site and
  ``site_id`` the original value.
* ABIDE has no official split. Subjects get a ``fold`` (``--folds``, default 5, as the
  paper's 5-fold cross-validation), stratified by site and label and seeded; the fold
  ``--test-fold`` (default 0) is the ``test`` split, the rest ``train``. Each subject is one
  sample, so no subject is in two splits.
* ``--size 48`` resizes to 48^3 as in the paper (``--aspect stretch`` by default, as the
  paper's "downscaled to 48 x 48 x 48"; ``pad``/``crop`` keep the aspect ratio).
* Atlas preparation (``--atlas``) writes ``atlas/atlas.nii.gz`` (labels on the 61 x 73 x 61
  grid), ``atlas/atlas_labels.csv`` and, with ``--size``, the atlas resized like the data
  (nearest neighbour). ``cc200``/``cc400``: PCP's ``CC200.nii.gz``/``CC400.nii.gz`` are on a
  63 x 75 x 61 grid and are cropped ``[1:62, 1:74, :]`` (all labels kept); ``rois_3mm``:
  the Dosenbach-160 volume, already on the grid, minus its stray label 223; ``power264``:
  5 mm spheres around the Power-264 coordinates (nilearn's bundled ``power_2011.csv`` or
  ``--atlas-coords``); ``file``: any label NIfTI, resampled onto the grid by nearest
  neighbour. ``auto`` takes ``--atlas-file`` if given, else a ``CC200.nii.gz`` found under
  ``--raw``, else the Power-264 spheres when the coordinates are available, else none.
  :func:`load_atlas` / :func:`atlas_for_manifest` read it back as a label array.

The package's modules, each importing only those listed before it: :mod:`.volumes` (the PCP
grid: reading, resampling, resizing), :mod:`.phenotypic` (the CSV, subjects, quality control,
folds), :mod:`.layout` (PCP's and nilearn's folders), :mod:`.atlas` (atlases and region masks)
and :mod:`.cli` (:func:`build_parser`, :func:`main`). Every name is importable from here.
"""

from __future__ import annotations

from medfl.prep.abide.volumes import (
    GRID_AFFINE, GRID_SHAPE, RESAMPLE_MODES, RESIZE_ASPECTS, load_derivative, load_volume,
    resample_to_grid, resize_volume, same_grid,
)
from medfl.prep.abide.phenotypic import (
    CLASS_NAMES, NILEARN_QC, PHENOTYPIC_FILE, REGION_ORDER, REGIONS, SITES, Subject, assign_folds,
    is_missing, parse_subject, read_phenotypic, select_rows,
)
from medfl.prep.abide.layout import (
    DERIVATIVES, FEDSKD_DERIVATIVES, PIPELINES, STRATEGIES, DerivativeLayout, find_layout,
    find_phenotypic,
)
from medfl.prep.abide.atlas import (
    ATLASES, atlas_for_manifest, atlas_table, check_label_volume, crop_cc_atlas, label_atlas,
    load_atlas, prepare_atlas, read_coordinates, rois_3mm_atlas, sphere_atlas, write_atlas,
)
from medfl.prep.abide.cli import build_parser, main

__all__ = [
    "GRID_SHAPE", "GRID_AFFINE", "PHENOTYPIC_FILE", "PIPELINES", "STRATEGIES", "DERIVATIVES",
    "FEDSKD_DERIVATIVES", "CLASS_NAMES", "SITES", "REGIONS", "REGION_ORDER", "NILEARN_QC",
    "ATLASES", "RESIZE_ASPECTS", "RESAMPLE_MODES", "Subject", "DerivativeLayout", "is_missing",
    "read_phenotypic", "select_rows", "parse_subject", "assign_folds", "find_phenotypic",
    "find_layout", "load_volume", "load_derivative", "same_grid", "resample_to_grid",
    "resize_volume", "crop_cc_atlas", "rois_3mm_atlas", "read_coordinates", "sphere_atlas",
    "label_atlas", "check_label_volume", "atlas_table", "prepare_atlas", "write_atlas", "load_atlas",
    "atlas_for_manifest", "build_parser", "main",
]
