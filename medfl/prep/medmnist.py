"""MedMNIST v2 (and MedMNIST+) ``.npz`` files as downloaded -> a medfl manifest.

The download (Zenodo doi:10.5281/zenodo.10519652, https://medmnist.com) is one file per
dataset and size: ``pathmnist.npz`` (28 x 28), ``pathmnist_64.npz``, ``_128``, ``_224`` (2D)
or ``organmnist3d.npz`` / ``organmnist3d_64.npz`` (3D), each holding the official split as
six arrays: ``train_images``, ``val_images``, ``test_images`` (uint8; 2D grey ``(N, H, W)``,
2D colour ``(N, H, W, 3)``, 3D ``(N, D, H, W)``) and ``train_labels``, ``val_labels``,
``test_labels`` (integers, ``(N, 1)``; ChestMNIST ``(N, 14)``, one 0/1 column per finding).

What this module does, and why:

* ``--raw`` is a folder of ``.npz`` files (``--flag`` and ``--size`` pick one) or one file
  (its name gives flag and size; a file of another name takes them from ``--flag`` and
  ``--size``). The file must be a zip archive: a ``.npy`` array, an HTML page (a failed
  download) or a pickle saved as ``.npz`` is named as such before NumPy reads it
  (:func:`check_npz_file`). Every key, dtype and shape is checked against the dataset's known
  facts (:data:`DATASETS`: task, channels, 2D/3D, class names) and the size: every image
  (volume) must be size x size (x size), so 2D colour images in a 3D file or a 28 file renamed
  ``_64`` are refused. Each problem stops the script with one message naming the file and key.
  A bad file stops everything: there is no per-sample ``--skip-bad`` for an array file.
* Multi-class and binary tasks: label = the integer. RetinaMNIST's ordinal grades are used as
  five classes (the report says so). ChestMNIST is multi-label and medfl's metrics are
  single-label: it is refused unless ``--chest-label`` reduces it to a binary task (``any``:
  any finding vs none; an index or name: that finding vs not).
* The official split is kept (``split`` = train/val/test). MedMNIST has no patient ids:
  ``subject_id`` is the sample (the report notes that patients may repeat across samples).
* Arrays: float32 in [0, 1], channel first: ``(C, H, W)`` for 2D, ``(1, D, H, W)`` for 3D;
  ``--resize N`` resamples 2D images (default: as stored).
"""

from __future__ import annotations

import argparse
import os
import re
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from medfl.prep.common import PrepRun, base_parser, prep_main, progress, resize_image, run_script, save_array
from medfl.prep.errors import PrepError, file_problem

__all__ = ["Dataset", "DATASETS", "SPLITS", "SIZES", "parse_name", "find_file", "check_npz_file", "load_split",
           "chest_binary", "build_parser", "main"]

SPLITS = ("train", "val", "test")
#: Sizes MedMNIST+ publishes (28 is MedMNIST v2's file without a suffix; 3D: 28 and 64).
SIZES = {"2d": (28, 64, 128, 224), "3d": (28, 64)}


class Dataset(NamedTuple):
    """What a MedMNIST dataset is: its task, channels, dimensionality and class names."""

    task: str
    channels: int
    dims: int
    classes: tuple[str, ...]


# MedMNIST's published class names, by label, as medmnist's INFO table (medmnist/info.py, v3.0.2)
# spells them: the 2D organ sets share one list; OrganMNIST3D numbers the same organs otherwise
_ORGANS = ("bladder", "femur-left", "femur-right", "heart", "kidney-left", "kidney-right", "liver", "lung-left",
           "lung-right", "pancreas", "spleen")
_ORGANS_3D = ("liver", "kidney-right", "kidney-left", "femur-right", "femur-left", "bladder", "heart", "lung-right",
              "lung-left", "spleen", "pancreas")
_CHEST = ("atelectasis", "cardiomegaly", "effusion", "infiltration", "mass", "nodule", "pneumonia", "pneumothorax",
          "consolidation", "edema", "emphysema", "fibrosis", "pleural", "hernia")
#: The 18 MedMNIST v2 datasets: task, channels and dimensionality, and the class names exactly
#: as MedMNIST's INFO table publishes them (they become ``class_name``, the reports' labels and
#: the ``prob_<class>`` columns of predictions).
DATASETS: dict[str, Dataset] = {
    "pathmnist": Dataset("multi-class", 3, 2, (
        "adipose", "background", "debris", "lymphocytes", "mucus", "smooth muscle", "normal colon mucosa",
        "cancer-associated stroma", "colorectal adenocarcinoma epithelium")),
    "chestmnist": Dataset("multi-label", 1, 2, _CHEST),
    "dermamnist": Dataset("multi-class", 3, 2, (
        "actinic keratoses and intraepithelial carcinoma", "basal cell carcinoma", "benign keratosis-like lesions",
        "dermatofibroma", "melanoma", "melanocytic nevi", "vascular lesions")),
    "octmnist": Dataset("multi-class", 1, 2, ("choroidal neovascularization", "diabetic macular edema", "drusen",
                                              "normal")),
    "pneumoniamnist": Dataset("binary-class", 1, 2, ("normal", "pneumonia")),
    "retinamnist": Dataset("ordinal-regression", 3, 2, ("0", "1", "2", "3", "4")),
    "breastmnist": Dataset("binary-class", 1, 2, ("malignant", "normal, benign")),
    "bloodmnist": Dataset("multi-class", 3, 2, (
        "basophil", "eosinophil", "erythroblast", "immature granulocytes(myelocytes, metamyelocytes and promyelocytes)",
        "lymphocyte", "monocyte", "neutrophil", "platelet")),
    "tissuemnist": Dataset("multi-class", 1, 2, (
        "Collecting Duct, Connecting Tubule", "Distal Convoluted Tubule", "Glomerular endothelial cells",
        "Interstitial endothelial cells", "Leukocytes", "Podocytes", "Proximal Tubule Segments",
        "Thick Ascending Limb")),
    "organamnist": Dataset("multi-class", 1, 2, _ORGANS),
    "organcmnist": Dataset("multi-class", 1, 2, _ORGANS),
    "organsmnist": Dataset("multi-class", 1, 2, _ORGANS),
    "organmnist3d": Dataset("multi-class", 1, 3, _ORGANS_3D),
    "nodulemnist3d": Dataset("binary-class", 1, 3, ("benign", "malignant")),
    "adrenalmnist3d": Dataset("binary-class", 1, 3, ("normal", "hyperplasia")),
    "fracturemnist3d": Dataset("multi-class", 1, 3, ("buckle rib fracture", "nondisplaced rib fracture",
                                                     "displaced rib fracture")),
    "vesselmnist3d": Dataset("binary-class", 1, 3, ("vessel", "aneurysm")),
    "synapsemnist3d": Dataset("binary-class", 1, 3, ("inhibitory synapse", "excitatory synapse")),
}
_NAME = re.compile(r"([a-z0-9]+?)(?:_(\d+))?\.npz")


def parse_name(path: Path) -> tuple[str, int] | None:
    """``(flag, size)`` of a MedMNIST file name (``pathmnist.npz`` -> ``("pathmnist", 28)``),
    ``None`` when the name is not one."""
    m = _NAME.fullmatch(path.name.lower())
    if not m or m.group(1) not in DATASETS:
        return None
    return m.group(1), int(m.group(2) or 28)


def find_file(raw: Path, flag: str | None, size: int) -> tuple[Path, str, int]:
    """The ``.npz`` to read, its flag and its size.

    Raises:
        PrepError: unknown flag or size, a file whose name is not MedMNIST's without ``--flag``,
            no ``--flag`` for a folder, or the file is absent (the message lists the ``.npz``
            files that are there).
    """
    if flag is not None and flag not in DATASETS:
        raise PrepError(f"--flag {flag!r}: not a MedMNIST dataset; expected one of {', '.join(DATASETS)}", raw)
    if raw.is_file():
        named = parse_name(raw)
        if named is None and flag is None:
            raise PrepError(f"{raw}: not a MedMNIST file name (<flag>.npz or <flag>_<size>.npz); pass --flag", raw)
        got_flag, got_size = named if named else (flag, size)
        return raw, flag or got_flag, got_size
    if flag is None:
        raise PrepError(f"--raw {raw} is a folder: pass --flag (one of {', '.join(DATASETS)}) and --size", raw)
    kind = "3d" if DATASETS[flag].dims == 3 else "2d"
    if size not in SIZES[kind]:
        raise PrepError(f"--size {size}: {flag} comes in sizes {', '.join(map(str, SIZES[kind]))}", raw)
    path = raw / (f"{flag}.npz" if size == 28 else f"{flag}_{size}.npz")
    if not os.path.lexists(path):
        there = sorted(p.name for p in raw.glob("*.npz"))
        raise PrepError(f"{path}: not found; the folder holds {', '.join(there) or 'no .npz file'}", path)
    return path, flag, size


def chest_binary(labels: np.ndarray, choice: str) -> tuple[np.ndarray, tuple[str, str]]:
    """ChestMNIST's ``(N, 14)`` findings as one binary label: ``any`` finding, or one finding
    by index or name. Returns the labels and the two class names.

    Raises:
        PrepError: ``choice`` names no finding.
    """
    if choice == "any":
        return (labels.max(axis=1) > 0).astype(np.int64), ("no finding", "any finding")
    key = choice.strip().lower()
    index = int(key) if key.isdigit() else (_CHEST.index(key) if key in _CHEST else -1)
    if not 0 <= index < len(_CHEST):
        raise PrepError(f"--chest-label {choice!r}: expected 'any', an index 0-13 or one of {', '.join(_CHEST)}")
    return labels[:, index].astype(np.int64), (f"no {_CHEST[index]}", _CHEST[index])


def load_split(npz: Any, path: Path, split: str, info: Dataset, size: int | None = None,
               size_from: str = "--size") -> tuple[np.ndarray, np.ndarray]:
    """One split's images and raw labels, checked against ``info`` and, given ``size``, the
    side every image (volume) must have (``size_from`` says where that size came from, for
    the message).

    Raises:
        PrepError: a missing key, an image array of the wrong dtype or dimensions, images of
            another size than ``size`` (2D colour images in a 3D file among them), labels of
            the wrong shape, non-integers or out of range, lengths that differ, an empty split.
    """
    names = {f"{split}_images", f"{split}_labels"}
    missing = sorted(names - set(npz.files))
    if missing:
        keys = sorted(f"{s}_{k}" for s in SPLITS for k in ("images", "labels"))
        raise PrepError(f"{path}: no key {missing[0]!r}; a MedMNIST file holds {', '.join(keys)} "
                        f"(found {', '.join(sorted(npz.files))})", path)
    try:
        images, labels = npz[f"{split}_images"], npz[f"{split}_labels"]
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise PrepError(f"{path}, {split}: unreadable array ({exc})", path) from exc
    want = "(N, D, H, W)" if info.dims == 3 else ("(N, H, W, 3)" if info.channels == 3 else "(N, H, W)")
    ndim = 4 if info.dims == 3 or info.channels == 3 else 3
    if images.dtype != np.uint8 or images.ndim != ndim or (info.channels == 3 and images.shape[-1] != 3):
        raise PrepError(f"{path}, key '{split}_images': {images.dtype} array of shape {images.shape}; expected "
                        f"uint8 {want} for this dataset", path)
    if len(images) == 0:
        raise PrepError(f"{path}, key '{split}_images': no images; expected the official {split} split", path)
    sides = images.shape[1:1 + info.dims]
    if size is not None and any(side != size for side in sides):
        kind = "volumes" if info.dims == 3 else "images"
        found = " x ".join(map(str, sides))
        if info.dims == 3 and images.shape[-1] == 3 and images.shape[1] == images.shape[2]:
            found, why = (f"2D colour images {images.shape[1]} x {images.shape[2]} x 3 (shape {images.shape})",
                          "probably a 2D MedMNIST file saved under this 3D dataset's name")
        else:
            found, why = f"{kind} of {found}", "probably a file of another size saved under this name"
        raise PrepError(f"{path}, key '{split}_images': {found}; expected {kind} of "
                        f"{' x '.join([str(size)] * info.dims)} (size {size}, {size_from}): {why}", path)
    width = len(_CHEST) if info.task == "multi-label" else 1
    if labels.ndim == 1 and width == 1:
        labels = labels.reshape(-1, 1)
    if labels.ndim != 2 or labels.shape[1] != width:
        raise PrepError(f"{path}, key '{split}_labels': shape {labels.shape}; expected (N, {width})", path)
    if len(labels) != len(images):
        raise PrepError(f"{path}: {len(images)} {split} images but {len(labels)} labels; expected one label row "
                        "per image", path)
    if not np.issubdtype(labels.dtype, np.integer):
        if not np.issubdtype(labels.dtype, np.floating) or not np.all(np.mod(labels, 1) == 0):
            raise PrepError(f"{path}, key '{split}_labels': {labels.dtype} values; expected integer labels", path)
        labels = labels.astype(np.int64)
    top = 1 if info.task == "multi-label" else len(info.classes) - 1
    bad = (labels < 0) | (labels > top)
    if bad.any():
        i = int(np.argwhere(bad)[0][0])
        expected = ("0/1 per finding" if info.task == "multi-label"
                    else f"values in 0..{top} ({len(info.classes)} classes)")
        raise PrepError(f"{path}, key '{split}_labels', row {i}: {labels[i].tolist()}; expected {expected}", path)
    return images, labels.astype(np.int64)


#: the first bytes of a zip archive (a ``.npz``), as :func:`numpy.load` tells one
_ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")


def check_npz_file(path: Path) -> None:
    """Refuse a file that is not a ``.npz`` archive before NumPy reads it, saying what it is.

    :func:`numpy.load` picks the format by the first bytes: a zip archive is a ``.npz``, the
    ``.npy`` magic a single array (and ``with`` on it fails with a ``TypeError``), anything else
    a pickle, refused with ``allow_pickle=False`` in words about pickles. An HTML page saved in
    place of the download (an error or login page) is the usual "anything else".

    Raises:
        PrepError: the file is not a readable file (a directory, a symlink loop...:
            :func:`~medfl.prep.errors.file_problem`), is empty, or is not a zip archive (a ``.npy``
            array, an HTML or XML page, a pickle, or other bytes), naming what was found.
    """
    problem = file_problem(path)       # an empty file is said below
    if problem and not problem.startswith("an empty file"):
        raise PrepError(f"{path}: {problem}; expected MedMNIST's .npz download", path)
    try:
        with open(path, "rb") as f:
            head = f.read(1024)
    except OSError as exc:
        raise PrepError(f"{path}: cannot read ({exc}); expected MedMNIST's .npz download", path) from exc
    if head.startswith(_ZIP_MAGIC):
        return
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n").lower()
    if not head:
        what = "an empty file (0 bytes), probably an interrupted download"
    elif head.startswith(b"\x93NUMPY"):
        what = "a single NumPy array (.npy format) named .npz, not MedMNIST's archive of six arrays"
    elif text.startswith((b"<!doctype html", b"<html", b"<head", b"<body")) or (
            text.startswith(b"<") and b"<html" in text):
        what = "an HTML page, probably a failed download (an error or sign-in page saved under this name)"
    elif text.startswith(b"<?xml") or text.startswith(b"<"):
        what = "an XML or HTML document, probably a failed download (an error page saved under this name)"
    elif head[:1] == b"\x80":
        what = "a Python pickle, not read (loading a pickle can run code)"
    else:
        what = f"not a .npz file (it starts with {head[:16]!r})"
    raise PrepError(f"{path}: {what}; expected MedMNIST's .npz (a zip archive of train/val/test images and "
                    "labels) as downloaded from https://medmnist.com", path)


def _chw(img: np.ndarray, info: Dataset) -> np.ndarray:
    """One stored image as float32 channel-first in [0, 1]."""
    x = img.astype(np.float32) / 255.0
    return np.moveaxis(x, -1, 0) if info.dims == 2 and info.channels == 3 else x[None]


def build_parser() -> argparse.ArgumentParser:
    """The command line (common options plus the MedMNIST ones)."""
    p = base_parser("medmnist", __doc__.split("\n\n")[0] + """

--raw is a folder of MedMNIST .npz files (choose one with --flag and --size) or one .npz file.
Writes manifest.csv (label, class_name, split = the official train/val/test; subject_id = the
sample, MedMNIST has no patient ids), arrays/<split>/ (float32 (C, H, W) or (1, D, H, W) in
[0, 1]), report.json. A bad file stops the script (--skip-bad has nothing per sample to skip).

example:
  python -m medfl.prep.medmnist --raw ~/data/medmnist --flag pathmnist --out ~/data/pathmnist_28
  python -m medfl.prep.medmnist --raw ~/data/medmnist/chestmnist_64.npz --chest-label any --out ~/data/chest""", partial=False)
    p.add_argument("--flag", choices=sorted(DATASETS), default=None, help="the dataset (default: from the file name)")
    p.add_argument("--size", type=int, default=28, help="28 (default: <flag>.npz), 64, 128 or 224 (<flag>_<size>.npz)")
    p.add_argument("--resize", type=int, default=None, metavar="N", help="resample 2D images to N x N (default: as stored)")
    p.add_argument("--chest-label", default=None, metavar="any|INDEX|NAME",
                   help="ChestMNIST only: reduce the 14 findings to one binary label (default: refuse ChestMNIST)")
    return p


def _check_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    """The usage checks and the ``.npz`` to read (:func:`find_file`): ``args.npz``, its ``flag``,
    ``size`` and ``size_from`` (where that size came from); ``--raw`` becomes its folder."""
    if args.limit is not None and args.limit < 1:
        parser.error("--limit: expected a positive number")
    if args.resize is not None and args.resize < 1:
        parser.error("--resize: expected a positive size")
    raw_given = Path(args.raw)
    problem = file_problem(raw_given)
    if problem == "not found" or "symlink" in problem:    # resolve() stops on a loop
        raise PrepError(f"--raw {raw_given}: {problem}; expected a folder of MedMNIST .npz files or one .npz file",
                        raw_given)
    path, flag, size = find_file(raw_given.resolve(), args.flag, args.size)
    info = DATASETS[flag]
    if info.task == "multi-label" and args.chest_label is None:
        raise PrepError(f"{path}: {flag} is multi-label (14 findings per image) and medfl's tasks are single-label; "
                        "pass --chest-label any (any finding vs none) or one finding's index or name", path)
    if args.chest_label is not None and info.task != "multi-label":
        parser.error(f"--chest-label applies to chestmnist only, not {flag}")
    if args.resize is not None and info.dims == 3:
        parser.error("--resize: 2D datasets only")
    args.size_from = f"as the file name {path.name} says" if parse_name(path) else f"--size {size}"
    args.raw, args.npz, args.flag, args.size = path.parent, path, flag, size


def main(argv: list[str] | None = None) -> int:
    """Prepare one MedMNIST file as ``argv`` says (:func:`~medfl.prep.common.prep_main`)."""
    return prep_main("medmnist", build_parser(), argv, _prepare, check=_check_args)


def _prepare(run: PrepRun) -> None:
    """The MedMNIST part of :func:`main`: the file's six arrays, one sample per image, counts."""
    args, out, report = run.args, run.out, run.report
    path, flag, size, info = args.npz, args.flag, args.size, DATASETS[args.flag]
    report.raw, report.skip_bad = str(path), False   # the file read; a bad file stops (nothing per sample to skip)
    report.options = {"flag": flag, "size": size, "resize": args.resize, "chest_label": args.chest_label,
                      "limit": args.limit}
    check_npz_file(path)
    try:
        npz = np.load(path, allow_pickle=False)
    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as exc:
        raise PrepError(f"{path}: not a readable .npz file ({exc}); expected MedMNIST's download", path) from exc
    rows: list[dict[str, Any]] = []
    classes = info.classes
    with npz:
        data = {s: load_split(npz, path, s, info, size, args.size_from) for s in SPLITS}
    shapes: Counter[str] = Counter()
    for split in SPLITS:
        images, labels = data[split]
        if info.task == "multi-label":
            flat, classes = chest_binary(labels, args.chest_label)
        else:
            flat = labels[:, 0]
        count = len(images) if args.limit is None else min(len(images), args.limit)
        for i in progress(range(count), f"medmnist {split}", total=count):
            x = _chw(images[i], info)
            if args.resize is not None:
                x = np.clip(resize_image(x, (args.resize, args.resize), "stretch"), 0, 1).astype(np.float32)
            shapes["x".join(map(str, x.shape))] += 1
            sample_id = f"{flag}_{split}_{i:06d}"
            rows.append({"sample_id": sample_id, "path": save_array(out, f"arrays/{split}/{sample_id}.npy", x),
                         "image_path": f"{path.name}:{split}_images[{i}]", "label": int(flat[i]),
                         "class_name": classes[int(flat[i])], "subject_id": sample_id, "split": split,
                         "index": i})
    run.manifest(rows, ["index"], classes)
    report.counts = {"flag": flag, "size": size, "task": info.task,
                     "splits": {s: sum(1 for r in rows if r["split"] == s) for s in SPLITS},
                     "classes": {c: sum(1 for r in rows if r["class_name"] == c) for c in classes},
                     "array_shapes": dict(shapes), "written": len(rows)}
    report.note("MedMNIST has no patient ids: subject_id is the sample, so one patient's images may fall in "
                "different splits of a run (the official split is kept as given)")
    if info.task == "ordinal-regression":
        report.note(f"{flag}'s grades are ordinal; medfl treats them as {len(classes)} classes")
    if info.task == "multi-label":
        report.note(f"{flag} reduced to a binary task with --chest-label {args.chest_label}: {classes[1]} vs "
                    f"{classes[0]}")


if __name__ == "__main__":   # python -m medfl.prep.medmnist: the command line of data_prep/medmnist.py
    run_script(main)
