"""CBIS-DDSM as downloaded -> an image-level benign/malignant manifest (plus optional ROI crops).

Reads the four case-description CSVs as TCIA publishes them (``breast_density`` in the mass
files, ``breast density`` in the calc files; ``N/A``, ``NA`` and empty as missing; path fields
with a newline inside the quotes) and finds each DICOM in any of the three download layouts:

1. the classic layout that matches the CSV paths literally
   (``<Subject>/<StudyUID>/<SeriesUID>/00000N.dcm``, under ``--raw`` or ``--raw/CBIS-DDSM``);
2. the TCIA tree with ``metadata.csv`` (``Series UID`` -> ``File Location``);
3. the same tree without ``metadata.csv``, matched by the last five digits of the study and
   series UIDs (``<MM-DD-YYYY>-DDSM-...-<5>/<n>.000000-<description>-<5>/1-1.dcm``, or the
   older ``1-full mammogram images-<5>/000000.dcm``).

The file numbers inside an ROI series are unreliable, so the mask (8-bit, 0/255) and the
crop (16-bit) are told apart by content. Images are read with pydicom (:mod:`medfl.prep.dicom`):
MONOCHROME1 is inverted, values are scaled to [0, 1] by ``BitsStored``, compressed transfer syntaxes are
decoded by pydicom's own decoders (``pip install "medfl[dicom]"``: pylibjpeg with its JPEG,
JPEG-LS and JPEG 2000 plugins) and otherwise stop naming the syntax and that extra.

Labels are per mammogram: malignant if any of its abnormalities is MALIGNANT, otherwise benign
(BENIGN_WITHOUT_CALLBACK is benign). No patient is in both the train and the test split:
``--patient-overlap`` says what happens to the 31 patients of the real CSVs who are.
"""

from __future__ import annotations

import argparse
import csv
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from medfl.prep.common import (
    ASPECT_MODES, PrepRun, base_parser, check_text_encoding, keep_present, limit_per_split, prep_main,
    require_columns, resize_image, run_script, save_array,
)
from medfl.prep.dicom import is_mask, read_dicom
from medfl.prep.errors import NotDownloaded, PrepError, check_file

__all__ = ["main", "build_parser", "read_case_csvs", "Resolver", "image_table", "CSV_FILES", "PATHOLOGY",
           "CLASS_NAMES"]

CSV_FILES = {
    ("mass", "train"): "mass_case_description_train_set.csv",
    ("mass", "test"): "mass_case_description_test_set.csv",
    ("calc", "train"): "calc_case_description_train_set.csv",
    ("calc", "test"): "calc_case_description_test_set.csv",
}
#: pathology string -> label (0 benign, 1 malignant)
PATHOLOGY = {"MALIGNANT": 1, "BENIGN": 0, "BENIGN_WITHOUT_CALLBACK": 0}
CLASS_NAMES = ["benign", "malignant"]
REQUIRED = ["patient_id", "left or right breast", "image view", "abnormality id", "abnormality type",
            "pathology", "image file path", "cropped image file path", "ROI mask file path"]
MISSING = {"", "N/A", "NA"}


def _find_csv(raw: Path, name: str) -> Path | None:
    cands = [raw / name, *sorted(raw.glob(f"*/{name}")), *sorted(raw.glob(f"*/*/{name}"))]
    return next((c for c in cands if c.is_file()), None) or next((c for c in cands if os.path.lexists(c)), None)


def read_case_csvs(raw: Path, abnormality: str = "both", csv_dir: Path | None = None) -> pd.DataFrame:
    """Read the case-description CSVs (mass, calc or both) into one table of abnormalities.

    Adds ``kind`` (mass/calc), ``split`` (train/test), ``csv`` and ``csv_line``; unifies the two
    density column names as ``breast_density``; strips every path field; missing values
    (``N/A``, ``NA``, empty) become empty strings.

    Raises:
        PrepError: a CSV is missing, unreadable, lacks a required column, or has an unknown
            pathology (naming the file, line and value).
    """
    kinds = ["mass", "calc"] if abnormality == "both" else [abnormality]
    frames = []
    for kind in kinds:
        for split in ("train", "test"):
            name = CSV_FILES[(kind, split)]
            path = (csv_dir / name) if csv_dir else _find_csv(raw, name)
            if path is None or not os.path.lexists(path):
                raise PrepError(f"{name}: case-description CSV not found under {csv_dir or raw} "
                                "(expected the four CSVs TCIA publishes beside the images)", name)
            check_file(path, "a CBIS-DDSM case-description CSV")
            check_text_encoding(path, "CBIS-DDSM case-description CSV")
            try:
                with open(path, newline="", encoding="utf-8-sig") as f:
                    reader = csv.DictReader(f)
                    rows, header = list(reader), list(reader.fieldnames or [])
            except (OSError, UnicodeDecodeError, csv.Error) as exc:
                raise PrepError(f"{path}: not a readable CSV ({exc})", path) from exc
            df = pd.DataFrame(rows, columns=header, dtype=str).fillna("")
            if "breast density" in df.columns and "breast_density" not in df.columns:
                df = df.rename(columns={"breast density": "breast_density"})
            require_columns(df, REQUIRED + ["breast_density"], path)
            if df.empty:
                raise PrepError(f"{path}: no rows, only the header (expected one row per abnormality)", path)
            for c in df.columns:
                df[c] = df[c].astype(str).str.strip()
                df.loc[df[c].isin(MISSING), c] = ""
            bad = ~df["pathology"].isin(PATHOLOGY)
            if bad.any():
                i = int(np.flatnonzero(bad.to_numpy())[0])
                raise PrepError(f"{path} line {i + 2}: unknown pathology {df['pathology'].iloc[i]!r}; expected "
                                f"one of {', '.join(PATHOLOGY)}", path)
            df["kind"], df["split"], df["csv"] = kind, split, name
            df["csv_line"] = np.arange(len(df)) + 2
            frames.append(df)
    table = pd.concat(frames, ignore_index=True)
    return _drop_repeated_rows(table)


#: one abnormality of one mammogram: a CSV row is unique by these
ABNORMALITY_KEY = ["patient_id", "left or right breast", "image view", "abnormality id", "kind"]


def _drop_repeated_rows(table: pd.DataFrame) -> pd.DataFrame:
    """Drop rows repeating an earlier row of the same abnormality word for word (a CSV
    concatenated twice, or a line pasted again: counted twice they double the abnormality);
    ``table.attrs["repeated_rows"]`` lists them for the report.

    Raises:
        PrepError: two rows of one abnormality that differ (which one is right is unknown).
    """
    data_cols = [c for c in table.columns if c not in ("csv", "csv_line", "split")]
    dup_key = table.duplicated(ABNORMALITY_KEY, keep=False)
    repeated: list[str] = []
    if dup_key.any():
        for _, group in table[dup_key].groupby(ABNORMALITY_KEY, sort=False):
            first = group.iloc[0]
            for _, other in group.iloc[1:].iterrows():
                if not other[data_cols].equals(first[data_cols]):
                    diff = [c for c in data_cols if other[c] != first[c]][:3]
                    raise PrepError(f"{other['csv']} line {other['csv_line']} and {first['csv']} line "
                                    f"{first['csv_line']}: abnormality {first['abnormality id']} of "
                                    f"{first['patient_id']} {first['left or right breast']} {first['image view']} "
                                    f"appears twice with different {', '.join(diff)}; expected one row per "
                                    "abnormality", other["csv"])
                repeated.append(f"{other['csv']} line {other['csv_line']} (= line {first['csv_line']})")
        table = table[~table.duplicated(ABNORMALITY_KEY, keep="first")].reset_index(drop=True)
    table.attrs["repeated_rows"] = repeated
    return table


def image_table(abn: pd.DataFrame, overlap: str = "move-to-test") -> tuple[pd.DataFrame, list[str]]:
    """One row per mammogram from the abnormality table: label = malignant if any abnormality is.

    ``overlap`` for patients in both splits: ``move-to-test`` (their train images join the test
    split), ``drop-train`` (their train images are dropped) or ``error``. Returns the table and
    the overlapping patients.

    Raises:
        PrepError: ``overlap == "error"`` and a patient is in both splits.
    """
    abn = abn.copy()
    abn["label"] = abn["pathology"].map(PATHOLOGY).astype(int)
    abn["subject"] = abn["image file path"].str.split("/").str[0]
    grouped = abn.groupby("image file path", sort=True)
    img = grouped.agg(patient_id=("patient_id", "first"), subject=("subject", "first"),
                      split=("split", "first"), kind=("kind", "first"), label=("label", "max"),
                      laterality=("left or right breast", "first"), view=("image view", "first"),
                      breast_density=("breast_density", "first"), n_abnormalities=("label", "size"),
                      pathologies=("pathology", lambda s: ";".join(sorted(set(s)))),
                      csv=("csv", "first"), csv_line=("csv_line", "min")).reset_index()
    both = sorted(set(img.loc[img["split"] == "train", "patient_id"]) & set(img.loc[img["split"] == "test", "patient_id"]))
    if both:
        if overlap == "error":
            raise PrepError(f"{len(both)} patient(s) in both the train and the test CSVs, e.g. {both[0]}; "
                            "use --patient-overlap move-to-test or drop-train", "patient_id")
        leak = img["patient_id"].isin(both) & (img["split"] == "train")
        if overlap == "move-to-test":
            img.loc[leak, "split"] = "test"
        elif overlap == "drop-train":
            img = img[~leak].reset_index(drop=True)
    return img, both


@dataclass
class Resolver:
    """Finds the DICOM files of a CSV path in whichever layout ``raw`` holds."""

    raw: Path
    series_dirs: dict[str, Path] = field(default_factory=dict)
    layout: str = "unknown"

    def __post_init__(self) -> None:
        meta = next((c for c in [self.raw / "metadata.csv", *sorted(self.raw.glob("*/metadata.csv"))]
                     if c.is_file()), None)
        if meta is not None:
            table = pd.read_csv(meta, dtype=str, keep_default_na=False)
            missing = [c for c in ("Series UID", "File Location") if c not in table.columns]
            if missing:
                raise PrepError(f"{meta}: missing column(s) {', '.join(missing)}; expected TCIA's metadata.csv", meta)
            for uid, loc in zip(table["Series UID"], table["File Location"]):
                loc = loc.replace("\\", "/")
                # normalised, not resolved: a CBIS-DDSM folder that is a symlink to another disk
                # stays under --raw, so image paths in the manifest stay relative to it
                self.series_dirs[uid.strip()] = Path(os.path.normpath(meta.parent / loc))
            self.layout = "tcia (metadata.csv)"
        self.bases = [b for b in (self.raw, self.raw / "CBIS-DDSM") if b.is_dir()]

    def series_dir(self, csv_path: str) -> Path:
        """The folder holding the series a CSV path names.

        Raises:
            PrepError: no layout has it.
        """
        parts = csv_path.split("/")
        if len(parts) != 4:
            raise PrepError(f"path {csv_path!r}: expected <Subject>/<StudyUID>/<SeriesUID>/<file>.dcm", csv_path)
        subject, study, series, _ = parts
        for base in self.bases:  # classic
            d = base / subject / study / series
            if d.is_dir():
                if self.layout == "unknown":
                    self.layout = "classic"
                return d
        if series in self.series_dirs and self.series_dirs[series].is_dir():
            return self.series_dirs[series]
        for base in self.bases:  # last five digits of the UIDs
            sdir = base / subject
            if not sdir.is_dir():
                continue
            for st in sorted(p for p in sdir.iterdir() if p.is_dir() and p.name.endswith(study[-5:])):
                for se in sorted(p for p in st.iterdir() if p.is_dir() and p.name.endswith(series[-5:])):
                    if self.layout == "unknown":
                        self.layout = "uid5"
                    return se
        raise NotDownloaded(f"{csv_path}: image not found in any layout under {self.raw} (classic path, "
                            "metadata.csv series, or a <Subject>/...-<last5 study>/...-<last5 series> folder)",
                            csv_path)

    def files(self, csv_path: str) -> list[Path]:
        """The .dcm files of the series (the literal file first when it exists)."""
        d = self.series_dir(csv_path)
        literal = d / csv_path.split("/")[-1]
        files = sorted(p for p in d.iterdir() if p.suffix.lower() == ".dcm")
        if not files:
            raise PrepError(f"{d}: no .dcm file in the series folder of {csv_path}", d)
        return [literal] + [f for f in files if f != literal] if literal.is_file() else files


def _roi_files(resolver: Resolver, crop_path: str, mask_path: str) -> tuple[Path, Path]:
    """(crop, mask) of one abnormality, told apart by content."""
    cands = {p: None for p in resolver.files(crop_path) + resolver.files(mask_path)}
    masks = [p for p in cands if is_mask(p)]
    crops = [p for p in cands if p not in masks]
    if not masks:
        raise PrepError(f"{mask_path}: no ROI mask (8-bit 0/255 image) in its series folder", mask_path)
    mask_name = mask_path.split("/")[-1]
    mask = next((m for m in masks if m.name == mask_name), masks[0])
    crop = crops[0] if crops else mask
    return crop, mask


def _mask_on(mask: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """The mask resampled (nearest neighbour) onto the mammogram's grid when sizes differ."""
    if mask.shape == shape:
        return mask > 0.5
    ri = (np.arange(shape[0]) * mask.shape[0] / shape[0]).astype(int)
    ci = (np.arange(shape[1]) * mask.shape[1] / shape[1]).astype(int)
    return mask[np.ix_(ri, ci)] > 0.5


def _roi_crop(img: np.ndarray, mask: np.ndarray, size: tuple[int, int], margin: float) -> np.ndarray:
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    if not len(rows):
        raise PrepError("ROI mask is empty (no pixel of the abnormality)")
    cy, cx = (rows[0] + rows[-1]) / 2, (cols[0] + cols[-1]) / 2
    half = max(rows[-1] - rows[0], cols[-1] - cols[0], 8) * margin / 2
    r0, r1 = int(max(0, cy - half)), int(min(img.shape[0], cy + half + 1))
    c0, c1 = int(max(0, cx - half)), int(min(img.shape[1], cx + half + 1))
    return resize_image(img[r0:r1, c0:c1], size, "pad")


def _relative(file: Path, raw: Path) -> str:
    """``file`` relative to ``raw`` when it lies under it, else its absolute path."""
    try:
        return file.relative_to(raw).as_posix()
    except ValueError:
        return os.path.relpath(file, raw) if os.path.isabs(file) else str(file)


def build_parser() -> argparse.ArgumentParser:
    """The command line (common options plus the CBIS-DDSM ones)."""
    p = base_parser("cbis_ddsm", __doc__.split("\n\n")[0] + "\n\nLayouts, labels and the patient rule: "
                    "see medfl/prep/cbis_ddsm.py and bundles/cbis_ddsm/docs/README.md.")
    p.add_argument("--abnormality", choices=["both", "mass", "calc"], default="both",
                   help="which case-description CSVs to use (default both)")
    p.add_argument("--csv-dir", type=Path, default=None,
                   help="folder with the four CSVs (default: found under --raw)")
    p.add_argument("--size", type=int, nargs=2, default=[512, 320], metavar=("H", "W"),
                   help="output size of a mammogram (default 512 320; real ones are about 5000 x 3000)")
    p.add_argument("--aspect", choices=ASPECT_MODES, default="pad",
                   help="pad (default: keep the aspect, pad), crop (keep the aspect, crop) or stretch")
    p.add_argument("--roi-crops", action="store_true",
                   help="write one sample per abnormality: a crop around its ROI mask (label = its "
                        "pathology) instead of whole mammograms")
    p.add_argument("--roi-size", type=int, nargs=2, default=[224, 224], metavar=("H", "W"),
                   help="size of an ROI crop (default 224 224)")
    p.add_argument("--roi-margin", type=float, default=1.2, help="crop side / ROI extent (default 1.2)")
    p.add_argument("--patient-overlap", choices=["move-to-test", "drop-train", "error"], default="move-to-test",
                   help="patients in both the train and the test CSVs (31 in the real ones): move their "
                        "train images to test (default), drop them, or stop")
    return p


def main(argv: list[str] | None = None) -> int:
    """Prepare CBIS-DDSM: see ``python -m medfl.prep.cbis_ddsm --help``
    (:func:`~medfl.prep.common.prep_main`)."""
    return prep_main("cbis_ddsm", build_parser(), argv, _prepare)


def _prepare(run: PrepRun) -> None:
    """The CBIS-DDSM part of :func:`main`: the case CSVs, the images to read, one sample per
    mammogram (or per abnormality with ``--roi-crops``)."""
    a, raw, out, report = run.args, run.raw, run.out, run.report
    report.options = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k not in ("raw", "out")}
    abn = read_case_csvs(raw, a.abnormality, a.csv_dir)
    repeated = abn.attrs.get("repeated_rows", [])
    if repeated:
        report.note(f"{len(repeated)} CSV row(s) repeat an earlier row word for word and were counted once: "
                    + "; ".join(repeated[:5]) + (" ..." if len(repeated) > 5 else ""))
    images, both = image_table(abn, a.patient_overlap)
    if both:
        report.note(f"{len(both)} patient(s) in both train and test CSVs ({a.patient_overlap}): "
                    + ", ".join(both[:10]) + (" ..." if len(both) > 10 else ""))
    resolver = Resolver(raw)
    present = keep_present(range(len(images)), lambda i: resolver.series_dir(images.iloc[i, 0]), report,
                           name=lambda i: images.iloc[i, 0])
    images = images.iloc[present]
    if a.limit and a.limit < len(images):
        # the first images of each split, in proportion, at least one each: a plain cut of the
        # table (sorted by path: Calc-Test first) left the train split empty
        images = images.iloc[limit_per_split(list(images["split"]), a.limit)]
        report.note(f"--limit {a.limit}: kept the first " + ", ".join(
            f"{int((images['split'] == s).sum())} {s}" for s in dict.fromkeys(images["split"]))
                    + " image(s), in proportion to the splits and at least one of each")
    headerless: list[str] = []

    def make(rec: Any) -> list[dict[str, Any]]:
        img_path = rec[0]

        def full() -> tuple[np.ndarray, dict[str, Any], Path]:
            files = resolver.files(img_path)
            x, facts = read_dicom(files[0])
            return x, facts, files[0]

        x, facts, file = run.step(img_path, full, "image")
        if not facts["part10"]:
            headerless.append(_relative(file, raw))
        common = {"subject_id": rec.patient_id, "site": "CBIS-DDSM", "sex": "F", "split": rec.split,
                  "image_path": _relative(file, raw), "abnormality_type": rec.kind,
                  "laterality": rec.laterality, "view": rec.view, "breast_density": rec.breast_density,
                  "source_csv": f"{rec.csv} line {rec.csv_line}"}
        if a.roi_crops:
            return _roi_samples(run, abn[abn["image file path"] == img_path], resolver, x, rec.subject, common)
        rel = save_array(out, f"arrays/{rec.subject}.npy", resize_image(x, a.size, a.aspect)[None])
        return [{"sample_id": rec.subject, "path": rel, "label": int(rec.label),
                 "class_name": CLASS_NAMES[int(rec.label)], "n_abnormalities": int(rec.n_abnormalities),
                 "pathologies": rec.pathologies, "original_rows": facts["rows"],
                 "original_cols": facts["cols"], **common}]

    rows = run.each(list(images.itertuples(index=False)), make)
    for split in ("train", "test"):
        if split in set(images["split"]) and not any(r["split"] == split for r in rows):
            report.counts = {"images_listed": len(images), "samples_written": len(rows)}
            run.stop(f"the {split} split is empty after skipping {len(report.skipped)} item(s); "
                     f"see {out / 'skipped.csv'}", split)
    if headerless:
        report.note(f"{len(headerless)} image(s) without the DICOM Part-10 header (no preamble, 'DICM' or file "
                    "meta; a data set as older archives write it) were read by their own encoding: "
                    + ", ".join(headerless[:3]) + (", ..." if len(headerless) > 3 else ""))
    df = run.manifest(rows, classes=CLASS_NAMES)
    report.counts = {"abnormalities": len(abn), "images_listed": len(images), "samples_written": len(df),
                     "layout": resolver.layout,
                     "per_split": {s: int((df["split"] == s).sum()) for s in ("train", "test")},
                     "malignant": int(df["label"].sum()), "benign": int((df["label"] == 0).sum()),
                     "patients_in_both_splits": len(both)}


def _roi_samples(run: PrepRun, abns: pd.DataFrame, resolver: Resolver, x: np.ndarray, subject: str,
                 common: dict[str, Any]) -> list[dict[str, Any]]:
    """With ``--roi-crops``: one crop around each abnormality's ROI mask of the mammogram
    ``x``; an abnormality whose mask fails is skipped (with ``--skip-bad``), not the image."""
    a, rows = run.args, []
    for ab in abns.itertuples(index=False):
        sid = f"{subject}_{ab[abns.columns.get_loc('abnormality id')]}"
        crop_path = ab[abns.columns.get_loc("cropped image file path")]
        mask_path = ab[abns.columns.get_loc("ROI mask file path")]

        def roi() -> np.ndarray:
            _, mask_file = _roi_files(resolver, crop_path, mask_path)
            m, _ = read_dicom(mask_file)
            try:
                return _roi_crop(x, _mask_on(m, x.shape), tuple(a.roi_size), a.roi_margin)
            except PrepError as exc:
                raise PrepError(f"{mask_file}: {exc}", mask_file) from exc

        ok, arr = run.report.attempt(mask_path, roi, "roi")
        if not ok:
            continue
        label = PATHOLOGY[ab.pathology]
        rel = save_array(run.out, f"arrays/{sid}.npy", arr[None])
        rows.append({"sample_id": sid, "path": rel, "label": label, "class_name": CLASS_NAMES[label],
                     "pathologies": ab.pathology, **common})
    return rows


if __name__ == "__main__":   # python -m medfl.prep.cbis_ddsm: the command line of data_prep/cbis_ddsm.py
    run_script(main)
