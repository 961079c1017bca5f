"""HAM10000 as downloaded -> a medfl manifest of seven-class dermoscopy images.

The download (Harvard Dataverse doi:10.7910/DVN/DBW86T; the ISIC archive; a Kaggle mirror)
unpacks to::

    HAM10000_metadata.csv            # lesion_id,image_id,dx,dx_type,age,sex,localization,dataset
    HAM10000_images_part_1/          # ISIC_0024306.jpg ... ISIC_0029305.jpg (600 x 450 JPEGs)
    HAM10000_images_part_2/          # ISIC_0029306.jpg ... ISIC_0034320.jpg

What this module does, and why:

* The metadata is read as downloaded: the CSV, or the Dataverse's tab-separated
  ``HAM10000_metadata.tab`` (the delimiter is sniffed), or a file named with ``--metadata``.
* ``<image_id>.jpg`` is looked up in every image folder that exists, in this order:
  ``--images DIR`` (e.g. both parts unzipped into one folder), ``HAM10000_images_part_1``,
  ``HAM10000_images_part_2``, and the lower-case copies the Kaggle zip adds
  (``ham10000_images_part_1``/``_2``). An image found in several folders is used when the
  copies are byte-identical (the first in that order) and is an error naming both when they
  differ.
* ``dx`` gives seven classes, labels in alphabetical order (the ISIC 2018 Task 3 class set):
  akiec, bcc, bkl, df, mel, nv, vasc. An unknown ``dx`` or ``dx_type`` is an error.
* ``lesion_id`` is the subject: several images of one lesion share it, so the engine keeps
  them in one split. All images of one lesion must have one ``dx``.
* ``dataset`` (the source collection: vidir_modern, vidir_molemax, rosendahl, vienna_dias) is
  the manifest's ``site``, so the ``natural`` partitioner gives one client per collection.
  The Kaggle mirror's metadata lacks that column (7 columns): ``site`` is then empty, the
  report says so, and only the ``natural`` partitioner is refused (by the run, naming the
  empty column).
* HAM10000 has no official train/test split in this file, so the manifest's ``split`` column
  is empty: the run draws its global test set (``global_test_per_class`` or
  ``global_test_fraction``).
* Images are resized to ``--size`` (default 224) after an optional ``--crop-border``;
  arrays are float32 ``(3, H, W)`` RGB in [0, 1]. ``age`` (empty when unknown), ``sex``
  (``F``/``M``/empty), ``dx_type`` and ``localization`` are kept.
"""

from __future__ import annotations

import argparse
import csv
import filecmp
import os
import re
import shlex
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd

from medfl.prep.common import (
    ASPECT_MODES, PrepRun, base_parser, check_text_encoding, keep_present, prep_main, require_columns,
    run_script, save_array, size_pair,
)
from medfl.prep.errors import NotDownloaded, PrepError, check_file
from medfl.prep.derm7pt import preprocess_image

__all__ = [
    "CLASS_NAMES", "DX_TYPES", "COLUMNS", "IMAGE_FOLDERS", "METADATA_NAMES", "SEX_CODES", "find_metadata",
    "read_metadata", "dx_label", "parse_age", "image_folders", "find_image", "unzip_hint", "build_parser", "main",
]

#: The seven ``dx`` classes in label order (label = position), alphabetical as ISIC 2018
#: Task 3. Counts in the 10,015 images: akiec 327, bcc 514, bkl 1099, df 115, mel 1113,
#: nv 6705, vasc 142.
CLASS_NAMES: tuple[str, ...] = ("akiec", "bcc", "bkl", "df", "mel", "nv", "vasc")
#: How each diagnosis was confirmed (the ``dx_type`` column).
DX_TYPES: tuple[str, ...] = ("histo", "follow_up", "consensus", "confocal")
#: The metadata's columns, in file order.
COLUMNS: tuple[str, ...] = ("lesion_id", "image_id", "dx", "dx_type", "age", "sex", "localization", "dataset")
#: Image folders looked in after ``--images``, in order (the last two: the Kaggle zip's copies).
IMAGE_FOLDERS: tuple[str, ...] = ("HAM10000_images_part_1", "HAM10000_images_part_2",
                                  "ham10000_images_part_1", "ham10000_images_part_2")
#: Metadata file names looked for in ``--raw``, in order.
METADATA_NAMES: tuple[str, ...] = ("HAM10000_metadata.csv", "HAM10000_metadata.tab", "HAM10000_metadata")
#: ``sex`` (lower case) -> manifest ``sex``.
SEX_CODES: dict[str, str] = {"female": "F", "male": "M", "unknown": "", "": ""}
_ID = re.compile(r"ISIC_\d+")


def find_metadata(raw: Path, given: Path | None = None) -> Path:
    """The metadata file: ``given`` (relative to ``raw`` or absolute), else the first of
    :data:`METADATA_NAMES` in ``raw``.

    Raises:
        PrepError: no such file.
    """
    if given is not None:
        path = given if given.is_absolute() else raw / given
        if not path.is_file():
            raise PrepError(f"--metadata {path}: not found; expected HAM10000's metadata table", path)
        return path
    for name in METADATA_NAMES:
        if (raw / name).is_file():
            return raw / name
    raise PrepError(f"--raw {raw}: no {', '.join(METADATA_NAMES)}; expected the HAM10000 download (the "
                    "metadata table and the HAM10000_images_part_1/_2 folders), or name the table with "
                    "--metadata", raw)


def read_metadata(path: Path) -> pd.DataFrame:
    """Read the metadata table (comma- or tab-separated) as strings; empty cells stay ``""``.
    The Kaggle mirror's metadata has no ``dataset`` column (7 columns): it reads as empty.

    Raises:
        PrepError: unreadable or empty, a column of :data:`COLUMNS` other than ``dataset``
            missing, an ``image_id``
            that is not ``ISIC_<digits>`` or appears twice, an empty ``lesion_id``.
    """
    check_text_encoding(path, "HAM10000's metadata")
    try:
        head = path.read_text(encoding="utf-8-sig", errors="strict")[:4096]
    except UnicodeDecodeError as exc:
        raise PrepError(f"{path}: not a text table ({exc}); expected HAM10000's metadata", path) from exc
    first = head.splitlines()[0] if head.strip() else ""
    if not first:
        raise PrepError(f"{path}: empty file; expected a header {','.join(COLUMNS)}", path)
    try:
        sep = csv.Sniffer().sniff(first, delimiters=",\t").delimiter
    except csv.Error:
        sep = ","
    try:
        table = pd.read_csv(path, sep=sep, dtype=str, keep_default_na=False, encoding="utf-8-sig")
    except (pd.errors.ParserError, pd.errors.EmptyDataError) as exc:
        raise PrepError(f"{path}: not a readable table ({exc}); expected HAM10000's metadata", path) from exc
    table.columns = [str(c).strip().strip('"') for c in table.columns]
    require_columns(table, [c for c in COLUMNS if c != "dataset"], path)
    if "dataset" not in table.columns:   # the Kaggle mirror's 7 columns: no source collection
        table["dataset"] = ""
    if table.empty:
        raise PrepError(f"{path}: no rows; expected one row per image", path)
    table = table.apply(lambda col: col.str.strip().str.strip('"'))
    for i, (image, lesion) in enumerate(zip(table["image_id"], table["lesion_id"])):
        if not _ID.fullmatch(image):
            raise PrepError(f"{path} line {i + 2}, column 'image_id': {image!r}; expected ISIC_<digits> "
                            "(e.g. ISIC_0027419)", path)
        if not lesion:
            raise PrepError(f"{path} line {i + 2}, column 'lesion_id': empty; expected the lesion's id "
                            "(e.g. HAM_0000118)", path)
    dup = table["image_id"].duplicated(keep=False)
    if dup.any():
        lines = [int(i) + 2 for i in dup.to_numpy().nonzero()[0][:2]]
        raise PrepError(f"{path} lines {lines[0]} and {lines[1]}, column 'image_id': "
                        f"{table['image_id'].iloc[lines[0] - 2]} appears twice; expected one row per image", path)
    return table


def dx_label(dx: str, where: str) -> int:
    """The label of a ``dx`` cell (case and spaces ignored).

    Raises:
        PrepError: not one of :data:`CLASS_NAMES`.
    """
    key = str(dx).strip().lower()
    if key not in CLASS_NAMES:
        raise PrepError(f"{where}, column 'dx': {dx!r}; expected one of {', '.join(CLASS_NAMES)}", where)
    return CLASS_NAMES.index(key)


def parse_age(value: str, where: str) -> str:
    """``age`` as written (``"80.0"``) when it is a number in [0, 120], ``""`` when empty.

    Raises:
        PrepError: anything else.
    """
    text = str(value).strip()
    if not text:
        return ""
    try:
        age = float(text)
    except ValueError:
        age = float("nan")
    if not 0 <= age <= 120:
        raise PrepError(f"{where}, column 'age': {value!r}; expected years (0-120) or empty", where)
    return text


def unzip_hint(raw: Path, folders: list[Path] | None = None) -> str:
    """How to unzip the image archives lying in ``raw`` (``HAM10000_images_part_1.zip``, the
    Kaggle archive: any ``.zip`` listing ``ISIC_*.jpg``) whose images are not unzipped beside
    them, as ``unzip`` commands; ``""`` when there is none. Only the archives' file lists are read.

    An archive of bare ``ISIC_*.jpg`` unzips into a folder named after it (``--images`` names
    that folder unless it is one of :data:`IMAGE_FOLDERS`); one holding folders unzips into ``raw``.
    """
    have = {f.name for f in folders or []}
    commands = []
    for z in sorted(p for p in raw.iterdir() if p.suffix.lower() == ".zip" and p.is_file()) if raw.is_dir() else []:
        try:
            with zipfile.ZipFile(z) as archive:
                jpgs = [n for n in archive.namelist() if re.search(r"(^|/)ISIC_\d+\.jpg$", n, re.IGNORECASE)]
        except (zipfile.BadZipFile, OSError):
            continue
        flat = any("/" not in n for n in jpgs)
        tops = {z.stem} if flat else {n.split("/")[0] for n in jpgs}
        if not jpgs or tops <= have:        # nothing to unzip, or unzipped already
            continue
        target = raw / z.stem if flat else raw
        command = f"unzip -q {shlex.quote(str(z))} -d {shlex.quote(str(target))}"
        if flat and z.stem not in IMAGE_FOLDERS:
            command += f" and pass --images {shlex.quote(str(target))}"
        commands.append(command)
    if not commands:
        return ""
    return ("the images are still zipped beside the metadata (this script reads unzipped folders): "
            + "; ".join(commands))


def image_folders(raw: Path, extra: Path | None = None) -> list[Path]:
    """The image folders that exist, in lookup order (``extra`` first).

    Raises:
        PrepError: ``extra`` is not a folder, or no folder exists (naming the archives to
            unzip where they lie in ``raw``, :func:`unzip_hint`).
    """
    found = []
    if extra is not None:
        path = extra if extra.is_absolute() else raw / extra
        if not path.is_dir():
            raise PrepError(f"--images {path}: not a folder; expected the folder holding ISIC_*.jpg", path)
        found.append(path)
    found += [raw / f for f in IMAGE_FOLDERS if (raw / f).is_dir() and raw / f not in found]
    if not found:
        zipped = unzip_hint(raw)
        raise PrepError(f"--raw {raw}: none of {', '.join(IMAGE_FOLDERS[:2])} exists; "
                        + (f"{zipped}; then run this again" if zipped else
                           "expected HAM10000's image folders (or pass the folder holding ISIC_*.jpg with --images)"),
                        raw)
    return found


def find_image(folders: list[Path], image_id: str, where: str, hint: str = "") -> Path:
    """``<image_id>.jpg`` in the first folder holding it; identical copies elsewhere are fine.
    ``hint`` ends the not-found message (:func:`unzip_hint`: archives still to unzip).

    Raises:
        NotDownloaded: in no folder (names them).
        PrepError: what is there is not a readable file (a directory, a symlink loop, an empty
            file...: :func:`~medfl.prep.errors.check_file`), or two copies differ (names both).
    """
    paths = [f / f"{image_id}.jpg" for f in folders]
    hits = [p for p in paths if p.is_file()] or [p for p in paths if os.path.lexists(p)]
    if not hits:
        raise NotDownloaded(f"{where}: image {image_id}.jpg not found in {', '.join(str(f) for f in folders)}"
                            + (f"; {hint}" if hint else ""), where)
    check_file(hits[0], f"the JPEG image {where} names")
    for other in hits[1:]:
        if not filecmp.cmp(hits[0], other, shallow=False):
            raise PrepError(f"{hits[0]} and {other}: two different files for image {image_id}; expected "
                            "identical copies (remove the wrong one)", other)
    return hits[0]


def build_parser() -> argparse.ArgumentParser:
    """The command line (common options plus the HAM10000 ones)."""
    p = base_parser("ham10000", __doc__.split("\n\n")[0] + """

--raw is the folder holding HAM10000_metadata.csv (or .tab) and HAM10000_images_part_1/ and
_part_2/. Writes manifest.csv (label 0..6 = akiec, bcc, bkl, df, mel, nv, vasc; subject_id =
lesion_id; site = the source collection of the `dataset` column; sex F/M; split empty),
arrays/ ((3, H, W) float32 RGB in [0, 1]), report.json and skipped.csv.

example:
  python -m medfl.prep.ham10000 --raw ~/data/HAM10000 --out ~/data/ham10000_224
  python -m medfl.prep.ham10000 --raw ~/data/HAM10000 --out ~/data/ham10000_64 --size 64 --images all_images""")
    p.add_argument("--size", type=int, nargs="+", default=[224], metavar="N",
                   help="output size: N (square) or H W (default 224)")
    p.add_argument("--aspect", choices=ASPECT_MODES, default="stretch",
                   help="how the 4:3 image meets the output shape: stretch (default), pad (zero bars) or crop")
    p.add_argument("--crop-border", type=int, default=0, metavar="PX",
                   help="pixels cut at each border before resizing (default 0)")
    p.add_argument("--metadata", type=Path, default=None, metavar="FILE",
                   help="the metadata table (default: HAM10000_metadata.csv, .tab or no extension in --raw)")
    p.add_argument("--images", type=Path, default=None, metavar="DIR",
                   help="a folder of ISIC_*.jpg looked in first (e.g. both parts unzipped into one folder)")
    return p


def _check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    args.size = size_pair(args.size, parser)
    if args.crop_border < 0:
        parser.error("--crop-border: expected 0 or more pixels")


def main(argv: list[str] | None = None) -> int:
    """Prepare HAM10000 as ``argv`` says (:func:`~medfl.prep.common.prep_main`)."""
    return prep_main("ham10000", build_parser(), argv, _prepare, check=_check_args)


def _check_row(rec: pd.Series, where: str) -> tuple[int, str, str]:
    """A metadata row's label, sex code and age (:class:`PrepError` naming a bad field)."""
    label = dx_label(rec["dx"], where)
    if rec["dx_type"].lower() not in DX_TYPES:
        raise PrepError(f"{where}, column 'dx_type': {rec['dx_type']!r}; expected one of "
                        f"{', '.join(DX_TYPES)}", where)
    sex = rec["sex"].lower()
    if sex not in SEX_CODES:
        raise PrepError(f"{where}, column 'sex': {rec['sex']!r}; expected male, female, unknown or empty",
                        where)
    return label, SEX_CODES[sex], parse_age(rec["age"], where)


def _prepare(run: PrepRun) -> None:
    """The HAM10000 part of :func:`main`: the metadata, one sample per image, counts."""
    args, raw, out, report = run.args, run.raw, run.out, run.report
    size = args.size
    meta_path = find_metadata(raw, args.metadata)
    folders = image_folders(raw, args.images)
    report.options = {"size": list(size), "aspect": args.aspect, "crop_border": args.crop_border,
                      "metadata": str(meta_path), "images": [str(f) for f in folders], "limit": args.limit}
    meta = read_metadata(meta_path)
    meta_rel = meta_path.relative_to(raw).as_posix() if raw in meta_path.parents else str(meta_path)
    lesion_dx: dict[str, tuple[str, int]] = {}
    for i, (lesion, dx) in enumerate(zip(meta["lesion_id"], meta["dx"])):
        key = dx.strip().lower()
        if key not in CLASS_NAMES:  # reported by the row's own check
            continue
        first = lesion_dx.setdefault(lesion, (key, i + 2))
        if first[0] != key:
            raise PrepError(f"{meta_rel} lines {first[1]} and {i + 2}: lesion {lesion} has dx {first[0]!r} and "
                            f"{dx!r}; expected one diagnosis per lesion", meta_path)
    zipped = unzip_hint(raw, folders)   # ends a not-found message where archives lie unzipped
    todo = keep_present(range(len(meta)), lambda r: find_image(
        folders, meta.iloc[r]["image_id"], f"{meta_rel} line {r + 2} ({meta.iloc[r]['image_id']})", zipped), report)
    todo = todo[:args.limit]
    formats: Counter[str] = Counter()
    shapes: Counter[str] = Counter()

    def make(r: int) -> dict[str, Any]:
        rec = meta.iloc[r]
        where = f"{meta_rel} line {r + 2} ({rec['image_id']})"
        label, sex, age = run.step(where, lambda: _check_row(rec, where), "metadata")
        image = run.step(where, lambda: find_image(folders, rec["image_id"], where, zipped), "image")
        arr, facts = run.step(image, lambda: preprocess_image(image, args.crop_border, size, args.aspect), "image")
        formats[facts["format"]] += 1
        shapes[facts["shape"]] += 1
        sample_id = f"ham10000_{rec['image_id']}"
        return {
            "sample_id": sample_id, "path": save_array(out, f"arrays/{sample_id}.npy", arr),
            "image_path": image.relative_to(raw).as_posix() if raw in image.parents else str(image),
            "label": label, "class_name": CLASS_NAMES[label], "subject_id": rec["lesion_id"],
            "site": rec["dataset"], "sex": sex, "lesion_id": rec["lesion_id"], "image_id": rec["image_id"],
            "dx": rec["dx"], "dx_type": rec["dx_type"], "age": age, "localization": rec["localization"],
            "dataset": rec["dataset"], "meta_row": r,
        }

    rows = run.each(todo, make)
    if not rows:
        run.stop(f"{meta_path}: every one of {len(todo)} row(s) was skipped; see {out / 'skipped.csv'}", meta_path)
    per_lesion = Counter(row["lesion_id"] for row in rows)
    report.counts = {
        "rows_in_metadata": len(meta), "considered": len(todo), "written": len(rows),
        "skipped": len(report.skipped),
        "classes": {c: sum(1 for row in rows if row["class_name"] == c) for c in CLASS_NAMES},
        "sites": dict(Counter(row["site"] for row in rows)),
        "sex": dict(Counter(row["sex"] or "unknown" for row in rows)),
        "dx_type": dict(Counter(row["dx_type"] for row in rows)),
        "lesions": len(per_lesion), "max_images_per_lesion": max(per_lesion.values()),
        "formats": dict(formats), "original_sizes": dict(shapes.most_common(10)),
    }
    report.note("HAM10000 has no official train/test split in its metadata: the manifest's split column is empty "
                "(a run draws its global test set: global_test_per_class or global_test_fraction)")
    if not any(row["site"] for row in rows):
        report.note(f"{meta_rel} has no 'dataset' column (the Kaggle mirror's 7 columns) or no value in it: the "
                    "manifest's site is empty, so the natural partitioner (one client per source collection) "
                    "cannot split it; use dirichlet, iid or another partitioner, or the Dataverse metadata")
    run.manifest(rows, ["lesion_id", "image_id", "dx", "dx_type", "age", "localization", "dataset", "meta_row"],
                 CLASS_NAMES)


if __name__ == "__main__":   # python -m medfl.prep.ham10000: the command line of data_prep/ham10000.py
    run_script(main)
