"""Derm7pt (release_v0) as downloaded -> a medfl manifest of five-class dermoscopy images.

The download (http://derm.cs.sfu.ca) unpacks to::

    release_v0/
        images/<folder>/<file>          # e.g. NEL/Nel026.jpg, FAL/FAL038.JPG, FCl/Fcl068.jpg
        meta/meta.csv                   # 19 columns, one row per case (1011)
        meta/train_indexes.csv          # one column ``indexes``: 0-based rows of meta.csv (413)
        meta/valid_indexes.csv          # (203)
        meta/test_indexes.csv           # (395)

What this module does, and why:

* The ``derm`` column (and ``clinic`` with ``--clinic``) is a path relative to ``images/``
  used **verbatim**: folders ``FCL`` and ``FCl`` are different folders and extensions are
  mixed ``.jpg``/``.JPG``; nothing is lower-cased or guessed. A missing file whose name
  differs only in case from one that exists is reported as such.
* Diagnoses are grouped into the five classes of FedSkin and of the dataset's own
  ``Derm7PtDatasetGroupInfrequent`` (BCC, NEV, MEL, MISC, SK); every diagnosis string of the
  release is mapped in :data:`DIAGNOSIS_CLASSES` and an unknown one is an error.
* The official index files define the split (``train``/``val``/``test`` in the manifest).
* Images have black frames: ``--crop-border`` px (default 25, as in the dataset's own
  example) are cut at each border, then the image is resized to ``--size`` (FedSkin: 224).
  Arrays are float32 ``(3, H, W)`` RGB in [0, 1].
* ``sex`` is kept (``F``/``M``) for fairness metrics; ``site`` is the image folder (an
  atlas chapter, the closest thing the release has to a source).
* Derm7pt has no patient identifier: each case is one lesion, so ``subject_id`` is the case.
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter
from pathlib import Path, PurePosixPath
from typing import Any, Sequence

import numpy as np
import pandas as pd

from medfl.prep.common import (
    ASPECT_MODES, MAX_IMAGE_PIXELS, PrepRun, base_parser, check_pixel_count, check_text_encoding, keep_present,
    prep_main, require_columns, resize_image, run_script, save_array, size_pair,
)
from medfl.prep.errors import NotDownloaded, PrepError, check_file

__all__ = [
    "CLASS_NAMES", "DIAGNOSIS_CLASSES", "META_COLUMNS", "REQUIRED_COLUMNS", "SPLIT_FILES",
    "SEX_CODES", "find_release", "diagnosis_class", "sex_code", "read_meta", "read_splits",
    "resolve_image", "load_rgb", "crop_border", "preprocess_image", "build_parser", "main",
]

#: The five classes, in label order (label = position).
CLASS_NAMES: tuple[str, ...] = ("BCC", "NEV", "MEL", "MISC", "SK")

#: Every diagnosis string of Derm7pt release_v0 (lower case) -> its class name. Counts over
#: the 1011 cases: BCC 42, NEV 575, MEL 252, MISC 97, SK 45.
DIAGNOSIS_CLASSES: dict[str, str] = {diagnosis: cls for cls, diagnoses in (
    ("BCC", ("basal cell carcinoma",)),
    ("NEV", ("nevus", "blue nevus", "clark nevus", "combined nevus", "congenital nevus", "dermal nevus",
             "recurrent nevus", "reed or spitz nevus")),
    ("MEL", ("melanoma", "melanoma (in situ)", "melanoma (less than 0.76 mm)", "melanoma (0.76 to 1.5 mm)",
             "melanoma (more than 1.5 mm)", "melanoma metastasis")),
    ("MISC", ("dermatofibroma", "lentigo", "melanosis", "miscellaneous", "vascular lesion")),
    ("SK", ("seborrheic keratosis",)),
) for diagnosis in diagnoses}

#: The 19 columns of release_v0's meta.csv, in file order.
META_COLUMNS: tuple[str, ...] = (
    "case_num", "diagnosis", "seven_point_score", "pigment_network", "streaks", "pigmentation",
    "regression_structures", "dots_and_globules", "blue_whitish_veil", "vascular_structures",
    "level_of_diagnostic_difficulty", "elevation", "location", "sex", "management", "clinic",
    "derm", "case_id", "notes",
)
#: Columns this script needs (``clinic`` too with ``--clinic``).
REQUIRED_COLUMNS: tuple[str, ...] = ("case_num", "diagnosis", "sex", "derm")
#: Manifest split -> official index file in ``meta/``.
SPLIT_FILES: dict[str, str] = {"train": "train_indexes.csv", "val": "valid_indexes.csv",
                               "test": "test_indexes.csv"}
#: meta.csv ``sex`` (lower case) -> manifest ``sex``; an empty cell means unknown.
SEX_CODES: dict[str, str] = {"female": "F", "male": "M", "": ""}
#: meta.csv columns copied into the manifest when present (besides the ones used).
_KEPT = ("seven_point_score", "level_of_diagnostic_difficulty", "elevation", "location",
         "management")


def find_release(raw: Path) -> Path:
    """The ``release_v0`` folder: ``raw`` itself or ``raw/release_v0``.

    Raises:
        PrepError: neither holds ``meta/meta.csv`` and ``images/``.
    """
    for cand in (raw, raw / "release_v0"):
        if (cand / "meta" / "meta.csv").is_file() and (cand / "images").is_dir():
            return cand
    raise PrepError(f"--raw {raw}: expected Derm7pt's release_v0 folder (meta/meta.csv and "
                    "images/), or a folder holding release_v0/; found neither", raw)


def diagnosis_class(diagnosis: str, where: str = "diagnosis") -> int:
    """The label (index into :data:`CLASS_NAMES`) of a meta.csv ``diagnosis`` string.

    Matching ignores case and surrounding spaces; anything else must be exact.

    Raises:
        PrepError: the string is not a Derm7pt diagnosis (the message lists the valid ones).
    """
    key = str(diagnosis).strip().lower()
    if key not in DIAGNOSIS_CLASSES:
        raise PrepError(f"{where}: unknown diagnosis {diagnosis!r}; expected one of "
                        + ", ".join(repr(d) for d in DIAGNOSIS_CLASSES), where)
    return CLASS_NAMES.index(DIAGNOSIS_CLASSES[key])


def sex_code(value: str, where: str = "sex") -> str:
    """``F``, ``M`` or ``""`` (unknown) for a meta.csv ``sex`` cell.

    Raises:
        PrepError: a value other than female, male or empty.
    """
    key = str(value).strip().lower()
    if key not in SEX_CODES:
        raise PrepError(f"{where}: unknown sex {value!r}; expected 'female', 'male' or empty",
                        where)
    return SEX_CODES[key]


def read_meta(path: Path, required: Sequence[str] = REQUIRED_COLUMNS) -> pd.DataFrame:
    """Read meta.csv as strings (empty cells stay ``""``; nothing is parsed as NaN).

    Raises:
        PrepError: the file is missing, unreadable or empty, lacks a ``required`` column,
            or ``case_num`` (when required) is not a unique positive integer per row.
    """
    path = Path(path)
    if not path.is_file():
        raise PrepError(f"{path}: not found; expected Derm7pt's meta.csv", path)
    check_text_encoding(path, "Derm7pt's meta.csv")
    try:
        table = pd.read_csv(path, dtype=str, keep_default_na=False)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise PrepError(f"{path}: not a readable CSV ({exc}); expected Derm7pt's meta.csv",
                        path) from exc
    require_columns(table, list(required), path)
    if table.empty:
        raise PrepError(f"{path}: no rows; expected one row per case", path)
    if "case_num" in required:
        nums = table["case_num"].str.strip()
        bad = ~nums.str.fullmatch(r"\d+")
        if bad.any():
            i = int(np.flatnonzero(bad.to_numpy())[0])
            raise PrepError(f"{path} line {i + 2}, column 'case_num': "
                            f"{table['case_num'].iloc[i]!r}; expected a positive integer", path)
        dup = nums.astype(int).duplicated()
        if dup.any():
            i = int(np.flatnonzero(dup.to_numpy())[0])
            raise PrepError(f"{path} line {i + 2}, column 'case_num': {nums.iloc[i]} appears "
                            "twice; expected one row per case", path)
    return table


def read_splits(meta_dir: Path, num_rows: int) -> tuple[pd.Series, dict[str, int]]:
    """Read the three official index files.

    Returns:
        ``(split, sizes)``: ``split`` is indexed by meta.csv row (0-based) with values
        ``train``/``val``/``test`` (rows in no file are absent); ``sizes`` counts each file.

    Raises:
        PrepError: a file is missing, lacks the ``indexes`` column, has no rows (an empty
            split), holds a value that is not an integer in ``[0, num_rows)``, repeats a row,
            or names a row another index file names too.
    """
    owner: dict[int, str] = {}
    sizes: dict[str, int] = {}
    for split, name in SPLIT_FILES.items():
        path = meta_dir / name
        if not path.is_file():
            raise PrepError(f"{path}: not found; expected the official {split} index file "
                            "(one column 'indexes', 0-based rows of meta.csv)", path)
        check_text_encoding(path, f"{split} index file")
        try:
            table = pd.read_csv(path, dtype=str, keep_default_na=False)
        except pd.errors.EmptyDataError as exc:
            raise PrepError(f"{path}: empty file; expected a column 'indexes' listing the "
                            f"{split} rows of meta.csv", path) from exc
        except (pd.errors.ParserError, UnicodeDecodeError) as exc:
            raise PrepError(f"{path}: not a readable CSV ({exc})", path) from exc
        require_columns(table, ["indexes"], path)
        if table.empty:
            raise PrepError(f"{path}: no rows; the {split} split would be empty (expected the "
                            f"0-based meta.csv rows of the {split} cases)", path)
        for line, value in enumerate(table["indexes"], start=2):
            text = str(value).strip()
            if not re.fullmatch(r"\d+", text) or int(text) >= num_rows:
                raise PrepError(f"{path} line {line}, column 'indexes': {value!r}; expected a "
                                f"0-based row of meta.csv (0..{num_rows - 1})", path)
            row = int(text)
            if row in owner:
                other = SPLIT_FILES[owner[row]]
                where = "twice in this file" if other == name else f"in {other} too"
                raise PrepError(f"{path} line {line}: meta.csv row {row} is listed {where}; "
                                "expected each case in exactly one split", path)
            owner[row] = split
        sizes[split] = len(table)
    return pd.Series(owner, dtype=object).sort_index(), sizes


def _case_variant(images: Path, rel: str) -> str | None:
    """A file under ``images`` whose relative path equals ``rel`` ignoring case, if any."""
    cur, found = images, []
    for part in PurePosixPath(rel).parts:
        if not cur.is_dir():
            return None
        match = [c for c in sorted(os.listdir(cur)) if c.lower() == part.lower()]
        if not match:
            return None
        found.append(match[0])
        cur = cur / match[0]
    return "/".join(found) if cur.is_file() else None


def resolve_image(images: Path, rel: str, column: str, where: str,
                  listed: frozenset[str] = frozenset()) -> Path:
    """The file a ``derm``/``clinic`` cell names, taken verbatim under ``images/``.
    ``listed``: every path meta.csv names; a file differing only in case that meta.csv names
    itself (the real release has ``Nel016.jpg`` and ``NEL016.JPG`` as two images) is not
    offered as a mix-up.

    Raises:
        PrepError: the cell is empty or leaves ``images/``, the file does not exist (the
            message names a file that differs only in case, when there is one), or what is
            there is not a readable file (:func:`~medfl.prep.errors.check_file`).
    """
    if not rel:
        raise PrepError(f"{where}, column {column!r}: empty; expected a path under images/", where)
    pure = PurePosixPath(rel)
    if pure.is_absolute() or ".." in pure.parts:
        raise PrepError(f"{where}, column {column!r}: {rel!r}; expected a path relative to images/",
                        where)
    path = images / rel
    if not os.path.lexists(path):
        variant = _case_variant(images, rel)
        if variant in listed:
            variant = None
        hint = (f"; images/{variant} exists but differs in case (paths are used verbatim, "
                "folders such as FCL and FCl are different)" if variant else "")
        raise (PrepError if variant else NotDownloaded)(
            f"{path}: image not found (named by {where}, column {column!r}){hint}", path)
    return check_file(path, f"the image {where} names in column {column!r}")


def load_rgb(path: Path) -> tuple[np.ndarray, str]:
    """Read an image file fully as ``(H, W, 3)`` uint8 RGB, upright; return it and PIL's
    format name.

    The EXIF orientation is applied (a phone or camera photo stored sideways is turned as a
    viewer shows it). 16-bit grayscale images (PNG/TIFF modes ``I;16``, ``I``) are scaled
    from 0..65535 to 0..255 (PIL's own conversion clips them: a 16-bit PNG became a constant
    white image); floating-point images are refused.

    The size the header announces is checked before anything is decoded: more than
    :data:`~medfl.prep.common.MAX_IMAGE_PIXELS` pixels is a bad file (a decompression bomb,
    e.g. a PNG header announcing 20000 x 20000 named ``.jpg``), as PIL's own far larger limit
    would otherwise stop the script with ``DecompressionBombError`` even under ``--skip-bad``.

    Raises:
        PrepError: the file is not a readable image, is truncated, announces more than
            ``MAX_IMAGE_PIXELS`` pixels, holds negative or floating-point pixel values.
    """
    import warnings

    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)   # refused below by our limit
            im_open = Image.open(path)
        with im_open as im:
            fmt = str(im.format)
            check_pixel_count(path, (im.height, im.width))
            im.load()  # decodes everything: a truncated JPEG fails here
            im = ImageOps.exif_transpose(im)
            if im.mode == "F":
                raise PrepError(f"{path}: a floating-point image (mode F); expected an 8- or 16-bit photograph",
                                path)
            if im.mode.startswith("I"):
                wide = np.asarray(im).astype(np.float64)
                if wide.min() < 0:
                    raise PrepError(f"{path}: negative pixel values (mode {im.mode}); expected an 8- or 16-bit "
                                    "photograph", path)
                scale = 255.0 / 65535.0 if (im.mode.startswith("I;16") or wide.max() > 255) else 1.0
                grey = np.clip(np.round(wide * scale), 0, 255).astype(np.uint8)
                rgb = np.repeat(grey[..., None], 3, axis=2)
            else:
                rgb = np.asarray(im.convert("RGB"))
    except PrepError:      # our own check, said as it is (a PrepError is a ValueError)
        raise
    except FileNotFoundError as exc:
        raise PrepError(f"{path}: image not found", path) from exc
    except Image.DecompressionBombError as exc:   # above PIL's own limit: raised by open, before decoding
        announced = re.search(r"\((\d+) pixels\)", str(exc))
        if announced is None:
            raise PrepError(f"{path}: too many pixels to decode ({exc}); expected at most {MAX_IMAGE_PIXELS} "
                            "(medfl.prep.common.MAX_IMAGE_PIXELS)", path) from exc
        check_pixel_count(path, (int(announced.group(1)),))   # PIL's limit is above ours: this raises
        raise
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise PrepError(f"{path}: corrupt or truncated image ({exc}); expected a readable JPEG",
                        path) from exc
    return rgb, fmt


def crop_border(img: np.ndarray, border: int, path: Path | str = "") -> np.ndarray:
    """Cut ``border`` pixels at each side of an ``(H, W[, C])`` image (Derm7pt's black frames).

    Raises:
        PrepError: the image is not larger than ``2 * border`` in both directions.
    """
    if border <= 0:
        return img
    h, w = img.shape[:2]
    if h <= 2 * border or w <= 2 * border:
        raise PrepError(f"{path}: image is {w} x {h} pixels; expected more than {2 * border} in "
                        f"each direction to crop {border} px at each border (--crop-border)", path)
    return img[border:h - border, border:w - border]


def preprocess_image(path: Path, border: int, size: Sequence[int], aspect: str
                     ) -> tuple[np.ndarray, dict[str, Any]]:
    """Read, crop the frame, resize: returns float32 ``(3, size[0], size[1])`` in [0, 1] and
    facts for the report (``format``, original ``shape``).

    Raises:
        PrepError: unreadable, truncated or too small image.
    """
    rgb, fmt = load_rgb(path)
    cropped = crop_border(rgb, border, path)
    chw = np.moveaxis(cropped, -1, 0).astype(np.float32) / 255.0
    out = np.clip(resize_image(chw, size, aspect), 0.0, 1.0).astype(np.float32)
    return out, {"format": fmt, "shape": f"{rgb.shape[1]}x{rgb.shape[0]}"}


def build_parser() -> argparse.ArgumentParser:
    """The command line (common options plus the Derm7pt ones)."""
    p = base_parser("derm7pt", __doc__.split("\n\n")[0] + """

--raw is Derm7pt's release_v0 folder (images/, meta/meta.csv, meta/{train,valid,test}_indexes.csv)
or a folder that holds release_v0/. Writes manifest.csv (label 0..4 = BCC, NEV, MEL, MISC, SK;
split = train/val/test from the official index files; sex F/M; site = image folder), arrays/
((3, H, W) float32 RGB in [0, 1]), report.json and skipped.csv.

example:
  python -m medfl.prep.derm7pt --raw ~/data/release_v0 --out ~/data/derm7pt_224
  python -m medfl.prep.derm7pt --raw ~/data/release_v0 --out ~/data/derm7pt_64 --size 64 --clinic""")
    p.add_argument("--size", type=int, nargs="+", default=[224], metavar="N",
                   help="output size: N (square) or H W (default 224, as FedSkin)")
    p.add_argument("--crop-border", type=int, default=25, metavar="PX",
                   help="pixels cut at each border to remove the black frame before resizing "
                        "(default 25, as the dataset's own example; 0 keeps the frame)")
    p.add_argument("--aspect", choices=ASPECT_MODES, default="stretch",
                   help="how the (3:2) image meets the output shape: stretch (default, the usual "
                        "plain resize), pad (keep aspect, zero bars) or crop (keep aspect, cut "
                        "the sides)")
    p.add_argument("--clinic", action="store_true",
                   help="also prepare each case's clinical (macroscopic) image: column "
                        "clinic_path, arrays/clinic/ (default: dermoscopy only)")
    p.add_argument("--clinic-crop-border", type=int, default=None, metavar="PX",
                   help="pixels cut at each border of the clinical images (default: as "
                        "--crop-border)")
    return p


def _check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    args.size = size_pair(args.size, parser)
    if args.clinic_crop_border is None:
        args.clinic_crop_border = args.crop_border
    if min(args.crop_border, args.clinic_crop_border) < 0:
        parser.error("--crop-border, --clinic-crop-border: expected 0 or more pixels")


def main(argv: list[str] | None = None) -> int:
    """Prepare Derm7pt as ``argv`` says (:func:`~medfl.prep.common.prep_main`)."""
    return prep_main("derm7pt", build_parser(), argv, _prepare, check=_check_args)


def _prepare(run: PrepRun) -> None:
    """The Derm7pt part of :func:`main`: meta.csv, the official split, one sample per case."""
    args, raw, out, report = run.args, run.raw, run.out, run.report
    size = args.size
    release = find_release(raw)
    images, meta_dir = release / "images", release / "meta"
    meta_path = meta_dir / "meta.csv"
    prefix = release.relative_to(raw).as_posix()
    img_prefix = "images" if prefix == "." else f"{prefix}/images"
    report.options = {"size": list(size), "crop_border": args.crop_border, "aspect": args.aspect,
                      "clinic": args.clinic, "clinic_crop_border": args.clinic_crop_border if args.clinic else None,
                      "limit": args.limit, "release": str(release)}
    meta = read_meta(meta_path, list(REQUIRED_COLUMNS) + (["clinic"] if args.clinic else []))
    split_of, split_sizes = read_splits(meta_dir, len(meta))
    unassigned = len(meta) - len(split_of)
    if unassigned:
        report.note(f"{unassigned} meta.csv row(s) are in no index file and were left out")
    meta_rel = meta_path.relative_to(raw).as_posix()
    listed = frozenset(str(v) for c in ("derm", "clinic") if c in meta.columns for v in meta[c] if v)

    def locate(r: int) -> None:
        where = f"{meta_rel} line {r + 2} (case_num {meta.iloc[r]['case_num']})"
        for column in ("derm", "clinic") if args.clinic else ("derm",):
            resolve_image(images, meta.iloc[r][column], column, where, listed)

    rows_todo = keep_present(list(split_of.index), locate, report)
    absent_splits = [s for s in SPLIT_FILES if (split_of == s).any() and not any(split_of[r] == s for r in rows_todo)]
    if absent_splits:
        s = absent_splits[0]
        raise PrepError(f"split {s!r} ({meta_dir / SPLIT_FILES[s]}): none of its {int((split_of == s).sum())} "
                        "case(s) has its images under --raw (--present-only); a bundle needs every split: "
                        "download some of its images", meta_dir / SPLIT_FILES[s])
    if args.limit is not None:
        rows_todo = rows_todo[:args.limit]
    formats: Counter[str] = Counter()
    shapes: Counter[str] = Counter()

    def image(rec: pd.Series, where: str, column: str, border: int) -> tuple[np.ndarray, dict[str, Any]]:
        file = run.step(where, lambda: resolve_image(images, rec[column], column, where, listed), column)
        return run.step(file, lambda: preprocess_image(file, border, size, args.aspect), column)

    def make(r: int) -> dict[str, Any]:
        rec = meta.iloc[r]
        case = int(rec["case_num"])
        where = f"{meta_rel} line {r + 2} (case_num {case})"
        label = run.step(where, lambda: diagnosis_class(rec["diagnosis"], f"{where}, column 'diagnosis'"),
                         "diagnosis")
        sex = run.step(where, lambda: sex_code(rec["sex"], f"{where}, column 'sex'"), "sex")
        derm, facts = image(rec, where, "derm", args.crop_border)
        clinic = image(rec, where, "clinic", args.clinic_crop_border) if args.clinic else None
        formats[facts["format"]] += 1
        shapes[facts["shape"]] += 1
        sample_id = f"derm7pt_{case:04d}"
        row: dict[str, Any] = {
            "sample_id": sample_id,
            "path": save_array(out, f"arrays/derm/{sample_id}.npy", derm),
            "image_path": f"{img_prefix}/{rec['derm']}",
            "label": label, "class_name": CLASS_NAMES[label], "subject_id": sample_id,
            "site": PurePosixPath(rec["derm"]).parts[0] if "/" in rec["derm"] else "",
            "sex": sex, "split": str(split_of[r]), "case_num": case, "meta_row": r,
            "diagnosis": rec["diagnosis"],
        }
        if clinic is not None:
            row["clinic_path"] = save_array(out, f"arrays/clinic/{sample_id}.npy", clinic[0])
        if "clinic" in meta.columns:
            row["clinic_image_path"] = f"{img_prefix}/{rec['clinic']}" if rec["clinic"] else ""
        return {**row, **{col: rec[col] for col in _KEPT if col in meta.columns}}

    rows = run.each(rows_todo, make)
    _write(run, rows, Counter(split_of[r] for r in rows_todo), meta_dir, {
        "cases_in_meta": len(meta), "index_files": split_sizes, "considered": len(rows_todo)},
        {"formats": dict(formats), "original_sizes": dict(shapes.most_common(10))})


def _write(run: PrepRun, rows: list[dict[str, Any]], todo_per_split: Counter[str], meta_dir: Path,
           read: dict[str, Any], images: dict[str, Any]) -> None:
    """Counts and notes, then the manifest; a split whose every case was skipped stops."""
    report = run.report
    done_per_split = Counter(row["split"] for row in rows)
    report.counts = {
        **read, "written": len(rows), "skipped": len(report.skipped),
        "splits": {s: done_per_split.get(s, 0) for s in SPLIT_FILES},
        "classes": {c: sum(1 for row in rows if row["class_name"] == c) for c in CLASS_NAMES},
        "sex": dict(Counter(row["sex"] or "unknown" for row in rows)),
        "sites": len({row["site"] for row in rows}),
        **images,
    }
    report.note("Derm7pt has no patient identifier; subject_id is the case (one lesion per case)")
    emptied = [s for s in SPLIT_FILES if todo_per_split.get(s, 0) and not done_per_split.get(s, 0)]
    if emptied:
        s = emptied[0]
        run.stop(f"split {s!r} ({meta_dir / SPLIT_FILES[s]}) is empty: all its "
                 f"{todo_per_split[s]} case(s) were skipped; see {run.out / 'skipped.csv'}", meta_dir / SPLIT_FILES[s])
    missing = [s for s in SPLIT_FILES if not todo_per_split.get(s, 0)]
    if missing:
        report.note(f"--limit {run.args.limit} left split(s) {', '.join(missing)} without cases")
    run.manifest(rows, ["case_num", "meta_row", "diagnosis"], CLASS_NAMES)


if __name__ == "__main__":   # python -m medfl.prep.derm7pt: the command line of data_prep/derm7pt.py
    run_script(main)
