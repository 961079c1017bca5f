"""mini-MIAS as downloaded -> a medfl manifest of mammograms (or ROI crops).

The command line of ``python data_prep/mias.py`` and ``python -m medfl.prep.mias``
(:func:`build_parser`, :func:`main`) and what only it needs: finding Info.txt and the
images under ``--raw``, cropping ROIs, and the test split drawn by woman. Imports
:mod:`medfl.prep.mias.info` and :mod:`medfl.prep.mias.pgm`.
"""

from __future__ import annotations

import argparse
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from medfl.prep.common import (
    ASPECT_MODES, PrepReport, PrepRun, base_parser, keep_present, prep_main, resize_image, save_array,
)
from medfl.prep.errors import NotDownloaded, PrepError, check_file
from medfl.prep.mias.info import (
    _REFNUM, BACKGROUND, CLASS_SETS, COORD_FRAME, SEVERITY, InfoRow, check_image_rows, image_label,
    info_to_pixel, parse_info_line, read_info_lines, subject_of,
)
from medfl.prep.mias.pgm import read_pgm

__all__ = ["find_info", "index_images", "crop_square", "breast_centre", "subject_split", "build_parser",
           "main"]


# -------------------------------------------------------------------------------- raw files

def find_info(raw: Path, info: Path | None = None) -> Path:
    """The Info.txt to read: ``info`` (absolute, or relative to ``raw``), else the one file
    named ``info.txt`` (any case) in ``raw`` or a folder directly below it.

    Raises:
        PrepError: ``info`` does not exist, or there is no such file, or several.
    """
    if info is not None:
        path = info if info.is_absolute() else raw / info
        if not path.is_file():
            raise PrepError(f"--info {info}: not found (looked at {path})", path)
        return path
    found = [p for p in sorted(raw.iterdir()) if p.is_file() and p.name.lower() == "info.txt"]
    if not found:
        found = [p for d in sorted(raw.iterdir()) if d.is_dir()
                 for p in sorted(d.iterdir()) if p.is_file() and p.name.lower() == "info.txt"]
    if not found:
        raise PrepError(f"--raw {raw}: no Info.txt in it or in a folder directly below it; "
                        "expected mini-MIAS's Info.txt (or pass --info PATH)", raw)
    if len(found) > 1:
        raise PrepError(f"--raw {raw}: several Info.txt files ({', '.join(map(str, found))}); "
                        "choose one with --info", raw)
    return found[0]


def index_images(raw: Path) -> dict[str, list[Path]]:
    """Every ``*.pgm`` under ``raw`` (any depth, suffix in any case) by lower-case stem,
    regular files first (then what else bears the name: a folder, a link, for the message)."""
    files: dict[str, list[Path]] = defaultdict(list)
    for p in sorted(raw.rglob("*"), key=lambda p: (not p.is_file(), p)):
        if p.suffix.lower() == ".pgm":
            files[p.stem.lower()].append(p)
    return dict(files)


def _resolve(files: dict[str, list[Path]], refnum: str, where: str, raw: Path) -> Path:
    found = files.get(refnum.lower(), [])
    if not found:
        raise NotDownloaded(f"{refnum}.pgm: image missing (listed by {where}); expected "
                            f"{refnum}.pgm under --raw {raw}", f"{refnum}.pgm")
    regular = [p for p in found if p.is_file()]
    if len(regular) > 1:
        raise PrepError(f"{refnum}.pgm: found {len(regular)} times ({', '.join(map(str, regular))}); "
                        "expected one file per image", regular[0])
    return check_file(found[0], f"the P5 PGM image {where} lists")


# --------------------------------------------------------------------------- image handling

def crop_square(img: np.ndarray, row: float, col: float, side: float) -> np.ndarray:
    """The ``side x side`` square of ``img`` ``(H, W)`` centred on ``(row, col)`` (pixels),
    zero outside the image."""
    n = max(1, int(round(side)))
    top, left = int(round(row - n / 2)), int(round(col - n / 2))
    out = np.zeros((n, n), dtype=np.float32)
    h, w = img.shape
    r0, r1 = max(top, 0), min(top + n, h)
    c0, c1 = max(left, 0), min(left + n, w)
    if r0 < r1 and c0 < c1:
        out[r0 - top:r1 - top, c0 - left:c1 - left] = img[r0:r1, c0:c1]
    return out


def breast_centre(img: np.ndarray) -> tuple[float, float]:
    """``(row, col)`` of the centroid of the pixels above Otsu's threshold (the breast on a
    dark film background); the image centre for a flat image."""
    from skimage.filters import threshold_otsu

    if float(img.max()) <= float(img.min()):
        return img.shape[0] / 2, img.shape[1] / 2
    rows, cols = np.nonzero(img > threshold_otsu(img))
    return float(rows.mean()) + 0.5, float(cols.mean()) + 0.5


def subject_split(subjects: Sequence[str], labels: Sequence[int], fraction: float,
                  seed: int) -> dict[str, str]:
    """Assign whole subjects to ``train`` / ``test``, stratified by each subject's largest
    label (its worst finding).

    Per stratum, ``round(fraction * n)`` of its ``n`` subjects go to test, at least one and
    at most ``n - 1`` when ``n >= 2`` and ``fraction > 0``; the choice is a seeded
    permutation (``numpy.random.default_rng(seed)``, strata in label order).

    Args:
        subjects: subject id of each sample.
        labels: label of each sample (same length).
        fraction: wanted share of subjects in test, ``0 <= fraction < 1``.
        seed: random seed.

    Returns:
        subject id -> ``"train"`` or ``"test"``.
    """
    worst: dict[str, int] = {}
    for s, y in zip(subjects, labels):
        worst[s] = max(worst.get(s, -1), int(y))
    out = {s: "train" for s in worst}
    if fraction <= 0:
        return out
    rng = np.random.default_rng(seed)
    for stratum in sorted(set(worst.values())):
        members = sorted(s for s, y in worst.items() if y == stratum)
        n = len(members)
        k = int(round(fraction * n))
        if n >= 2:
            k = min(max(k, 1), n - 1)
        for i in rng.permutation(n)[:k]:
            out[members[int(i)]] = "test"
    return out


# ----------------------------------------------------------------------------------- script

def build_parser() -> argparse.ArgumentParser:
    """The command line (common options plus the MIAS ones)."""
    p = base_parser("mias", __doc__.split("\n\n")[0] + """

--raw is the mini-MIAS download: Info.txt (found in --raw or a folder directly below it, or
given by --info) and mdb001.pgm ... mdb322.pgm anywhere below --raw (flat, or in all-mias/).
Writes manifest.csv (label 0/1/2 = normal/benign/malignant, or 0/1 = benign/malignant with
--classes benign-malignant; subject_id = the woman, both breasts together; split = train/test
by --test-fraction, grouped by woman; columns refnum, background, tissue, abnormality,
severity, x, y, radius), arrays/ ((1, N, N) float32 in [0, 1]), report.json and skipped.csv.
Info.txt coordinates have their origin at the bottom-left of the 1024 x 1024 image.

examples:
  python -m medfl.prep.mias --raw ~/data/all-mias --out ~/data/mias_256
  python -m medfl.prep.mias --raw ~/data/all-mias --out ~/data/mias_bm_roi \\
      --classes benign-malignant --roi --size 128""")
    p.add_argument("--info", type=Path, default=None, metavar="PATH",
                   help="Info.txt to read (absolute or relative to --raw; default: the "
                        "info.txt in --raw or in a folder directly below it)")
    p.add_argument("--classes", choices=sorted(CLASS_SETS), default="normal-benign-malignant",
                   help="label set: normal-benign-malignant (default; 0/1/2) or "
                        "benign-malignant (0/1, normal images left out; PFedCDP's task)")
    p.add_argument("--size", type=int, default=256, metavar="N",
                   help="side of the cached square arrays in pixels (default 256)")
    p.add_argument("--aspect", choices=ASPECT_MODES, default="pad",
                   help="how a non-square image meets the square output: pad (default), "
                        "crop or stretch (mini-MIAS images are square, so this rarely matters)")
    p.add_argument("--roi", action="store_true",
                   help="one crop per abnormality line (centred on X, Y), plus one breast-centred "
                        "crop per normal image, instead of whole images")
    p.add_argument("--roi-size", type=float, default=256, metavar="PX",
                   help="smallest ROI side, pixels of the 1024 frame (default 256 = 51 mm)")
    p.add_argument("--roi-margin", type=float, default=1.2, metavar="F",
                   help="ROI side is at least 2 * RADIUS * F (default 1.2)")
    p.add_argument("--test-fraction", type=float, default=0.2, metavar="F",
                   help="share of women (both breasts together) in the test split, stratified "
                        "by each woman's worst label (default 0.2; 0: every row is 'train' and "
                        "no test split is written)")
    p.add_argument("--seed", type=int, default=0, help="seed of the test split (default 0)")
    return p


def _check_args(args: argparse.Namespace, p: argparse.ArgumentParser) -> None:
    if args.size < 1:
        p.error(f"--size: expected a positive number of pixels, got {args.size}")
    if not 0 <= args.test_fraction < 1:
        p.error(f"--test-fraction: expected a number in [0, 1), got {args.test_fraction}")
    if args.roi_size <= 0 or args.roi_margin <= 0:
        p.error("--roi-size, --roi-margin: expected positive numbers")


def _joined(rows: Sequence[InfoRow], attr: str) -> str:
    return ";".join("" if getattr(r, attr) is None else str(getattr(r, attr)) for r in rows)


def main(argv: list[str] | None = None) -> int:
    """Prepare mini-MIAS as ``argv`` says (:func:`~medfl.prep.common.prep_main`); an empty
    split stops even with ``--skip-bad``."""
    return prep_main("mias", build_parser(), argv, _prepare, check=_check_args)


def _read_info(report: PrepReport, info_path: Path, info_rel: str
               ) -> tuple[str | None, list[tuple[int, str]], dict[str, list[InfoRow]], dict[str, int]]:
    """Info.txt's header and lines, its rows by image and the images with an invalid line
    (refnum -> line). The file itself must be sound; a bad line drops its image (with
    ``--skip-bad``), and so does an image whose lines disagree."""
    header, lines = read_info_lines(info_path)
    images: dict[str, list[InfoRow]] = defaultdict(list)
    bad: dict[str, int] = {}
    for no, text in lines:
        ok, row = report.attempt(f"{info_rel} line {no}",
                                 lambda: parse_info_line(text, no, info_rel), "Info.txt")
        if ok:
            images[row.refnum].append(row)
        else:
            m = _REFNUM.fullmatch(text.split()[0]) if text.split() else None
            if m:
                bad.setdefault(text.split()[0], no)
    for ref, no in bad.items():
        if images.pop(ref, None):
            report.skip(ref, f"dropped: another Info.txt line of {ref} is invalid (line {no})",
                        "Info.txt")
    for ref in list(images):
        ok, _ = report.attempt(f"{info_rel} line {images[ref][0].line}",
                               lambda: check_image_rows(images[ref], info_rel), "Info.txt")
        if not ok:
            del images[ref]
    return header, lines, images, bad


def _prepare(run: PrepRun) -> None:
    """The MIAS part of :func:`main`: Info.txt, one sample per image (or per ROI), the split."""
    args, raw, out, report = run.args, run.raw, run.out, run.report
    info_path = find_info(raw, args.info)
    info_rel = info_path.relative_to(raw).as_posix() if raw in info_path.parents else str(info_path)
    names = CLASS_SETS[args.classes]
    report.options = {
        "info": str(info_path), "classes": args.classes, "size": args.size, "aspect": args.aspect,
        "roi": args.roi, "roi_size": args.roi_size if args.roi else None,
        "roi_margin": args.roi_margin if args.roi else None, "test_fraction": args.test_fraction,
        "seed": args.seed, "limit": args.limit}
    header, lines, images, bad = _read_info(report, info_path, info_rel)
    order = sorted(images, key=lambda r: images[r][0].number)
    files = index_images(raw)
    order = keep_present(order, lambda r: _resolve(files, r, f"{info_rel} line {images[r][0].line}", raw),
                         report, name=lambda r: f"{r}.pgm")
    considered = order[:args.limit] if args.limit is not None else order

    listed = {r.lower() for r in images} | {r.lower() for r in bad}
    unlisted = sorted(k for k in files if k not in listed)
    if unlisted:
        report.note(f"{len(unlisted)} .pgm file(s) not listed in Info.txt were ignored: "
                    + ", ".join(unlisted[:10]) + (" ..." if len(unlisted) > 10 else ""))

    sizes: Counter[str] = Counter()
    tally: Counter[str] = Counter()

    def make(ref: str) -> list[dict[str, Any]] | None:
        rows = images[ref]
        image_class = image_label(rows)
        if image_class not in names:
            tally["excluded_normal"] += 1
            return None
        where = f"{info_rel} line {rows[0].line}"
        path = run.step(f"{ref}.pgm", lambda: _resolve(files, ref, where, raw), "image")
        pgm = run.step(path, lambda: read_pgm(path), "image")
        sizes[f"{pgm.shape[1]}x{pgm.shape[0]}"] += 1
        tally["trailing"] += pgm.trailing_bytes > 0
        img = pgm.pixels.astype(np.float32) / float(pgm.maxval)
        base = {
            "image_path": path.relative_to(raw).as_posix(),
            "subject_id": subject_of(rows[0].number),
            "site": "MIAS", "sex": "F", "refnum": ref, "image_number": rows[0].number,
            "background": rows[0].background, "tissue": BACKGROUND[rows[0].background],
            "image_class": image_class,
        }
        if args.roi:
            return _roi_samples(run, rows, img, base, info_rel)
        arr = resize_image(img, (args.size, args.size), args.aspect)[None]
        return {**base, "sample_id": ref, "class_name": image_class,
                "path": save_array(out, f"arrays/{ref}.npy", arr),
                "abnormality": _joined(rows, "abnormality"),
                "severity": _joined(rows, "severity"), "x": _joined(rows, "x"),
                "y": _joined(rows, "y"), "radius": _joined(rows, "radius"),
                "num_abnormalities": sum(r.abnormality != "NORM" for r in rows),
                "info_lines": _joined(rows, "line")}

    samples = run.each(considered, make)
    read = {"info_lines": len(lines), "info_header": header is not None,
            "images_in_info": len({t.split()[0] for _, t in lines}), "pgm_files": len(files),
            "considered": len(considered), "excluded_normal": tally["excluded_normal"],
            "images_read": sum(sizes.values())}
    _write(run, samples, names, read, sizes, tally["trailing"])


def _roi_samples(run: PrepRun, rows: Sequence[InfoRow], img: np.ndarray, base: dict[str, Any],
                 info_rel: str) -> list[dict[str, Any]]:
    """With ``--roi``: one crop per abnormality line of an image (centred on X, Y), or one
    breast-centred crop of a normal image; a line without coordinates is skipped."""
    args, ref = run.args, base["refnum"]
    samples = []
    w = img.shape[1]
    for i, r in enumerate(rows, start=1):
        if r.abnormality == "NORM":
            crow, ccol = breast_centre(img)
            side, sid, cls = args.roi_size, f"{ref}_roi", "normal"
        elif not r.has_coordinates:
            run.report.skip(f"{info_rel} line {r.line}",
                            f"{ref}: {r.abnormality} {r.severity} has no coordinates in "
                            "Info.txt, so no ROI can be cropped (not an error)", "roi")
            continue
        else:
            crow, ccol = info_to_pixel(r.x, r.y, img.shape)  # type: ignore[arg-type]
            side = max(args.roi_size, 2 * r.radius * args.roi_margin)  # type: ignore[operator]
            sid, cls = f"{ref}_roi{i}", SEVERITY[r.severity]  # type: ignore[index]
        side_px = side * w / COORD_FRAME
        crop = crop_square(img, crow, ccol, side_px)
        arr = resize_image(crop, (args.size, args.size), "stretch")[None]
        samples.append({**base, "sample_id": sid, "class_name": cls,
                        "path": save_array(run.out, f"arrays/{sid}.npy", arr),
                        "abnormality": r.abnormality, "severity": r.severity or "",
                        "x": "" if r.x is None else r.x, "y": "" if r.y is None else r.y,
                        "radius": "" if r.radius is None else r.radius,
                        "num_abnormalities": sum(q.abnormality != "NORM" for q in rows),
                        "info_lines": str(r.line), "roi_row": round(crow, 2),
                        "roi_col": round(ccol, 2), "roi_side": round(side_px, 2)})
    return samples


def _write(run: PrepRun, samples: list[dict[str, Any]], names: Sequence[str], read: dict[str, Any],
           sizes: Counter[str], trailing: int) -> None:
    """Labels, the test split by woman, counts and notes, then the manifest (an empty split
    stops, the report kept)."""
    args, report = run.args, run.report
    for s in samples:
        s["label"] = names.index(s["class_name"])
    split_of = subject_split([s["subject_id"] for s in samples], [s["label"] for s in samples],
                             args.test_fraction, args.seed)
    for s in samples:
        s["split"] = split_of[s["subject_id"]]
    splits = Counter(s["split"] for s in samples)
    report.counts = {
        **read, "samples": len(samples), "skipped": len(report.skipped),
        "classes": {c: sum(s["class_name"] == c for s in samples) for c in names},
        "splits": {k: splits.get(k, 0) for k in ("train", "test")},
        "subjects": len(split_of),
        "test_subjects": sum(v == "test" for v in split_of.values()),
        "tissue": dict(Counter(s["tissue"] for s in samples)),
        "original_sizes": dict(sizes),
    }
    report.note("MIAS has no patient id: subject_id is the woman, (n + 1) // 2 for mdbNNN "
                "(consecutive images are her two breasts); the test split keeps both together")
    if any(k != f"{COORD_FRAME}x{COORD_FRAME}" for k in sizes):
        report.note(f"images other than {COORD_FRAME} x {COORD_FRAME} ({', '.join(sizes)}): "
                    "Info.txt coordinates were scaled from the 1024 frame to each image")
    if trailing:
        report.note(f"{trailing} PGM file(s) carry bytes after the raster; they were ignored")
    if args.test_fraction == 0:
        report.note("--test-fraction 0: no test split; medfl will hold out a global test set "
                    "by label only, which can put both breasts of a woman on both sides")
    if samples and args.test_fraction > 0:
        for split in ("train", "test"):
            if not splits.get(split):
                run.stop(f"--test-fraction {args.test_fraction}: the {split} split is "
                         f"empty ({len(split_of)} woman/women in {len(samples)} sample(s) "
                         "after skipping); expected at least two women per class, or "
                         "use --test-fraction 0", "--test-fraction")
        missing = [c for c in names if not any(s["split"] == "test" and s["class_name"] == c
                                               for s in samples)]
        if missing:
            report.note(f"the test split has no {', '.join(missing)} sample")
    if not samples:
        report.write(run.out)
    run.manifest(samples, ["refnum", "image_number", "background", "tissue", "image_class", "abnormality",
                           "severity", "x", "y", "radius", "num_abnormalities", "info_lines"], names)
