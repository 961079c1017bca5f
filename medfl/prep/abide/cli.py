"""ABIDE-I Preprocessed (PCP) as downloaded -> a medfl manifest of 4-channel 3D derivative maps.

The command line of ``python data_prep/abide.py`` and ``python -m medfl.prep.abide``:
:func:`build_parser` and :func:`main`, which drives the other modules of
:mod:`medfl.prep.abide` (it is the only one that imports them all).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pandas as pd

from medfl.prep.abide.atlas import ATLASES, prepare_atlas, write_atlas
from medfl.prep.abide.layout import (
    DERIVATIVES, FEDSKD_DERIVATIVES, PIPELINES, STRATEGIES, find_layout, find_phenotypic,
)
from medfl.prep.abide.phenotypic import (
    CLASS_NAMES, PHENOTYPIC_FILE, REGION_ORDER, Subject, _row_item, assign_folds, parse_subject,
    read_phenotypic, select_rows,
)
from medfl.prep.abide.volumes import (
    GRID_SHAPE, RESAMPLE_MODES, RESIZE_ASPECTS, load_derivative, resize_volume,
)
from medfl.prep.common import PrepReport, PrepRun, base_parser, keep_present, prep_main, save_array
from medfl.prep.errors import NotDownloaded, PrepError, check_file

__all__ = ["build_parser", "main"]

logger = logging.getLogger(__name__)


def _test_fold(text: str) -> int | None:
    if text.lower() in ("none", "-1"):
        return None
    try:
        return int(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a fold number or 'none', got {text!r}") from exc


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python data_prep/abide.py``."""
    p = base_parser("abide", __doc__.split("\n\n")[0] + """

Reads the phenotypic CSV and the 3D derivative maps of one pipeline/strategy (PCP's
Outputs/ layout or nilearn's flat ABIDE_pcp/ layout), applies quality control, stacks
ReHo, DC, LFCD and VMHC as channels, and writes manifest.csv (label 1 = autism,
0 = control; site, region = FedSKD's four regional clients, sex, age, fold, split),
arrays/<FILE_ID>.npy, the atlas, excluded.csv, report.json and skipped.csv.

examples:
  python -m medfl.prep.abide --raw ~/data/ABIDE_Initiative --out ~/data/abide_ccs
  python -m medfl.prep.abide --raw ~/nilearn_data --out ~/data/abide48 --size 48 \\
      --pipeline cpac --strategy filt_noglobal --max-mean-fd 0.2 --atlas-file CC200.nii.gz""")
    p.add_argument("--phenotypic", type=Path, default=None, metavar="CSV",
                   help=f"the phenotypic file (default: {PHENOTYPIC_FILE} next to the derivatives)")
    p.add_argument("--layout", choices=("auto", "pcp", "nilearn"), default="auto",
                   help="PCP's Outputs/<pipeline>/<strategy>/<derivative>/ or nilearn's flat "
                        "ABIDE_pcp/<pipeline>/<strategy>/ (default: auto)")
    p.add_argument("--pipeline", choices=PIPELINES, default="ccs",
                   help="preprocessing pipeline (default: ccs, as FedSKD)")
    p.add_argument("--strategy", choices=STRATEGIES, default="filt_noglobal",
                   help="band-pass filtering / global signal regression (default: filt_noglobal, "
                        "as FedSKD)")
    p.add_argument("--derivatives", default=",".join(FEDSKD_DERIVATIVES), metavar="LIST",
                   help="comma-separated derivative maps stacked as channels, in order (default: "
                        f"{','.join(FEDSKD_DERIVATIVES)}; DC is also published as degree_binarize)")
    p.add_argument("--qc", choices=("nilearn", "none"), default="nilearn",
                   help="rater-based quality control: nilearn's quality_checked=True rules (871 "
                        "subjects) or none (default: nilearn)")
    p.add_argument("--max-mean-fd", type=float, default=None, metavar="MM",
                   help="also drop subjects with func_mean_fd above MM (or unknown), e.g. 0.2")
    p.add_argument("--resample", choices=RESAMPLE_MODES, default="error",
                   help="a volume not on the 61x73x61 3 mm grid: error (default), or resample it "
                        "explicitly (linear / nearest)")
    p.add_argument("--size", type=int, nargs="+", default=None, metavar="N",
                   help="resize arrays to N^3 (or N N N), e.g. 48 as in FedSKD (default: keep 61x73x61)")
    p.add_argument("--aspect", choices=RESIZE_ASPECTS, default="stretch",
                   help="with --size: stretch each axis (default, as FedSKD), pad or crop to keep "
                        "the aspect")
    p.add_argument("--folds", type=int, default=5, help="cross-validation folds (default 5)")
    p.add_argument("--test-fold", type=_test_fold, default=0, metavar="K",
                   help="fold written as split 'test' (default 0; 'none': every row 'train')")
    p.add_argument("--seed", type=int, default=0, help="seed of the fold assignment (default 0)")
    p.add_argument("--atlas", choices=ATLASES, default="auto",
                   help="region atlas written to atlas/ (default auto: --atlas-file, else CC200.nii.gz "
                        "under --raw, else Power-264 spheres, else none)")
    p.add_argument("--atlas-file", type=Path, default=None, metavar="NII",
                   help="atlas label NIfTI (CC200.nii.gz, CC400.nii.gz, rois_3mm.nii.gz or any label "
                        "volume, resampled onto the grid by nearest neighbour)")
    p.add_argument("--atlas-coords", type=Path, default=None, metavar="CSV",
                   help="ROI centres (MNI mm) for --atlas power264 (default: nilearn's power_2011.csv)")
    p.add_argument("--sphere-radius", type=float, default=5.0, metavar="MM",
                   help="sphere radius for --atlas power264 (default 5)")
    return p


def _size(values: Sequence[int] | None) -> tuple[int, int, int] | None:
    if values is None:
        return None
    if len(values) == 1:
        values = list(values) * 3
    if len(values) != 3 or min(values) < 1:
        raise PrepError(f"--size: expected 1 or 3 positive sizes, got {list(values)}")
    return (int(values[0]), int(values[1]), int(values[2]))


def _derivatives(args: argparse.Namespace) -> list[str]:
    """``--derivatives`` as a list of distinct known names."""
    derivatives = [d.strip() for d in args.derivatives.split(",") if d.strip()]
    unknown = [d for d in derivatives if d not in DERIVATIVES]
    if not derivatives or unknown or len(set(derivatives)) != len(derivatives):
        raise PrepError(f"--derivatives: {args.derivatives!r}; expected distinct names from "
                        f"{', '.join(DERIVATIVES)}")
    return derivatives


def _check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    _derivatives(args)
    _size(args.size)
    if args.test_fold is not None and not 0 <= args.test_fold < args.folds:
        raise PrepError(f"--test-fold {args.test_fold}: expected 0..{args.folds - 1} or none")


def main(argv: list[str] | None = None) -> int:
    """Prepare ABIDE-I PCP derivatives: see ``python data_prep/abide.py --help``
    (:func:`~medfl.prep.common.prep_main`)."""
    return prep_main("abide", build_parser(), argv, _prepare, check=_check_args)


def _subjects(report: PrepReport, kept: pd.DataFrame, pheno: Path) -> list[Subject]:
    """The subjects of the phenotypic rows that passed quality control; a row that repeats
    an earlier SUB_ID or FILE_ID is an error (skipped with ``--skip-bad``)."""
    subjects: list[Subject] = []
    seen: dict[tuple[str, Any], int] = {}
    for _, row in kept.iterrows():
        item = _row_item(pheno, row)
        ok, subject = report.attempt(item, lambda r=row: parse_subject(r, pheno), "phenotypic")
        if not ok:
            continue
        keys = (("SUB_ID", subject.sub_id), ("FILE_ID", subject.file_id))
        twice = [key for key in keys if key in seen]
        if twice:
            field, value = twice[0]
            report.skip_or_raise(PrepError(f"{item}: {field} {value} already appears on line {seen[twice[0]]}; "
                                           "expected one row per subject", item), item, "phenotypic")
            continue
        seen[("SUB_ID", subject.sub_id)] = seen[("FILE_ID", subject.file_id)] = subject.line
        subjects.append(subject)
    return subjects


def _prepare(run: PrepRun) -> None:
    """The ABIDE part of :func:`main`: phenotypic rows, quality control, the atlas, one
    stacked array of derivative maps per subject."""
    args, raw, out, report = run.args, run.raw, run.out, run.report
    derivatives, size = _derivatives(args), _size(args.size)
    report.options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    layout = find_layout(raw, args.pipeline, args.strategy, derivatives, args.layout)
    pheno = find_phenotypic(raw, args.phenotypic, layout)
    table = read_phenotypic(pheno)
    kept, excluded = select_rows(table, args.qc, args.max_mean_fd, pheno)
    report.note(f"layout {layout.kind}: {layout.root}; phenotypic {pheno}")

    def locate(s: Subject) -> None:
        for d in derivatives:
            path = layout.path(s.file_id, d)
            what = f"the {d} map of {s.file_id} (listed by {pheno.name} line {s.line}, SUB_ID {s.sub_id})"
            if not os.path.lexists(path):
                raise NotDownloaded(f"{path}: file not found (nor {path.name.removesuffix('.gz')}); expected {what}",
                                    path)
            check_file(path, what)

    subjects = keep_present(_subjects(report, kept, pheno), locate, report, name=lambda s: s.file_id)
    if args.limit is not None:
        subjects = subjects[:args.limit]
    folds = assign_folds(subjects, args.folds, args.seed)
    atlas = prepare_atlas(args.atlas, raw, args.atlas_file, args.atlas_coords, args.sphere_radius)
    atlas_paths: dict[str, str] = {}
    if atlas is not None:
        name, labels, labels_table, source, notes = atlas
        atlas_paths = write_atlas(out, labels, labels_table, size, args.aspect)
        for n in notes:
            report.note(n)
        report.counts.update({"atlas": atlas_paths["data"], "atlas_grid": atlas_paths["grid"],
                              "atlas_labels": atlas_paths["labels_csv"], "atlas_name": name,
                              "atlas_source": source, "atlas_regions": int(len(labels_table))})

    nonfinite: dict[str, dict[str, dict[str, int]]] = {}   # FILE_ID -> file -> NaN and inf voxels zeroed

    def read(s: Subject) -> tuple[np.ndarray, bool, dict[str, tuple[int, int]]]:
        channels, flags, bad = [], [], {}
        locate(s)
        for d in derivatives:
            vol, res, (nan, inf) = load_derivative(layout.path(s.file_id, d), args.resample,
                                                   f"{d} map of {s.file_id}")
            channels.append(vol)
            flags.append(res)
            if nan or inf:
                bad[d] = (nan, inf)
        arr = np.stack(channels)
        if size is not None:
            arr, _ = resize_volume(arr, size, args.aspect, order=1)
        return arr, any(flags), bad

    def make(item: tuple[Subject, int]) -> dict[str, Any]:
        subject, fold = item
        arr, resampled, bad = run.step(subject.file_id, lambda: read(subject), "derivatives")
        rel = save_array(out, f"arrays/{subject.file_id}.npy", arr)
        files = {d: layout.path(subject.file_id, d).relative_to(raw).as_posix() for d in derivatives}
        if bad:
            nonfinite[subject.file_id] = {files[d]: {"nan": n, "inf": i} for d, (n, i) in bad.items()}
            logger.warning(f"warning: subject {subject.file_id} (SUB_ID {subject.sub_id}): zeroed non-finite voxels in "
                           + "; ".join(f"{files[d]} ({n} NaN, {i} inf)" for d, (n, i) in bad.items()))
        return {
            "sample_id": subject.file_id, "path": rel, "image_path": files[derivatives[0]],
            "label": subject.label, "class_name": subject.class_name, "subject_id": str(subject.sub_id),
            "site": subject.site, "sex": subject.sex,
            "split": "train" if args.test_fold is None or fold != args.test_fold else "test",
            "region": subject.region, "region_client": REGION_ORDER.index(subject.region) + 1,
            "site_id": subject.site_id, "age": "" if subject.age is None else subject.age,
            "mean_fd": "" if subject.mean_fd is None else subject.mean_fd, "fold": fold,
            "dx_group": subject.dx_group, "file_id": subject.file_id,
            "channels": ",".join(derivatives), "resampled": resampled,
            "atlas": atlas_paths.get("data", ""),
            **{f"image_{d}": f for d, f in files.items()},
        }

    rows = run.each(list(zip(subjects, folds)), make)
    _write(run, rows, excluded, nonfinite, {
        "phenotypic_rows": int(len(table)), "selected": len(subjects), "array_shape": [len(derivatives), *(size or GRID_SHAPE)],
        "channels": derivatives, "layout": layout.kind})


def _write(run: PrepRun, rows: list[dict[str, Any]], excluded: list[dict[str, Any]],
           nonfinite: dict[str, dict[str, dict[str, int]]], facts: dict[str, Any]) -> None:
    """An empty split stops; the manifest, excluded.csv, notes and counts."""
    args, out, report = run.args, run.out, run.report
    if rows:
        splits = {r["split"] for r in rows}
        wanted = {"train"} | ({"test"} if args.test_fold is not None else set())
        for split in sorted(wanted - splits):
            raise PrepError(f"{out}: split {split!r} is empty after quality control and skipping "
                            f"({len(rows)} sample(s), folds {sorted({r['fold'] for r in rows})}, test "
                            f"fold {args.test_fold}); expected at least one sample - use fewer --folds, "
                            "another --test-fold, or --test-fold none", out)
    df = run.manifest(rows, ["region", "region_client", "site_id", "age", "mean_fd", "fold", "dx_group",
                             "file_id", "channels", "resampled", "atlas"], CLASS_NAMES)
    pd.DataFrame(excluded, columns=["sub_id", "file_id", "site_id", "line", "rule", "reason"]).to_csv(
        out / "excluded.csv", index=False)
    missing_regions = [r for r in REGION_ORDER if r not in set(df["region"])]
    if missing_regions:
        report.note(f"no samples from region(s) {', '.join(missing_regions)}: the natural split "
                    "by region will have fewer clients")
    resampled_n = int(sum(r["resampled"] for r in rows))
    if resampled_n:
        report.note(f"{resampled_n} sample(s) had a volume on another grid, resampled ({args.resample})")
    rules = [e["rule"] for e in excluded]
    report.counts.update({
        "phenotypic_rows": facts["phenotypic_rows"], "excluded": len(excluded),
        "excluded_no_filename": rules.count("no_filename"), "excluded_qc": rules.count("qc"),
        "excluded_mean_fd": rules.count("mean_fd"),
        "selected": facts["selected"], "written": int(len(df)), "skipped": len(report.skipped),
        "autism": int((df["label"] == 1).sum()), "control": int((df["label"] == 0).sum()),
        "train": int((df["split"] == "train").sum()), "test": int((df["split"] == "test").sum()),
        "per_region": {r: int((df["region"] == r).sum()) for r in REGION_ORDER},
        "array_shape": facts["array_shape"], "channels": facts["channels"],
        "resampled": resampled_n,
        "nonfinite_voxels_zeroed": sum(c["nan"] + c["inf"] for f in nonfinite.values() for c in f.values()),
        "nonfinite_voxels_zeroed_per_subject": nonfinite,
        "layout": facts["layout"], "excluded_csv": "excluded.csv",
    })
