"""mini-MIAS as downloaded -> a medfl manifest of mammograms (or ROI crops).

The download (peipa's ``all-mias.tar.gz``, or Kaggle's copy with ``Info.txt`` beside an
``all-mias/`` folder) holds::

    Info.txt                 # header line, then one line per abnormality (330 for 322 images)
    [all-mias/]mdb001.pgm    # binary P5, 8-bit, 1024 x 1024, 200 micron pixels
    ...
    [all-mias/]mdb322.pgm

What this module does, and why:

* ``Info.txt`` is parsed as it is: an optional header line ``REFNUM BG CLASS SEVERITY X Y
  RADIUS`` (every column required when it is there), any whitespace between tokens
  (the real file uses single spaces and leaves a trailing space on many lines), no final
  newline. Lines have 3 tokens (``mdb003 D NORM``), 4 (an abnormality without coordinates,
  e.g. ``mdb059 F CIRC B``) or 7 (``mdb001 G CIRC B 535 425 197``); anything else, an
  unknown BG / CLASS / SEVERITY code or a coordinate off the image is an error naming the
  line and field.
* Several lines may describe one image (mdb005, 132, 144, 223, 226, 239, 249). In whole-image
  mode they make one sample whose label is the worst severity (malignant wins: mdb144 is B
  and M); the per-abnormality codes are kept in ``;``-joined columns.
* Coordinates have their origin at the **bottom-left**: pixel ``(row, col) = (1024 - Y, X)``.
  On an image that is not 1024 x 1024 (the fixtures write 128 x 128 by default) the same
  1024-pixel frame is scaled: ``row = (1024 - Y) * H / 1024``, ``col = X * W / 1024``
  (:func:`info_to_pixel`), so a real ``Info.txt`` line describes the same place on any size.
* Labels (``--classes``): ``normal-benign-malignant`` (default; 0/1/2) or
  ``benign-malignant`` (0/1; normal images are left out, as PFedCDP does).
* ``--roi`` writes one crop per abnormality line, centred on its coordinates, a square of
  ``max(--roi-size, 2 * RADIUS * --roi-margin)`` pixels of the 1024 frame (zero-padded at
  the border) labelled by that line's severity; a normal image gives one crop of
  ``--roi-size`` centred on the breast (the centroid of the pixels above Otsu's threshold).
  Lines without coordinates (mdb059, 216, 233, 245) cannot be cropped and are listed in
  ``skipped.csv`` with the reason.
* PGMs are read here, not through PIL, so that the header is checked: magic ``P5``, width,
  height and maxval as decimal numbers (``#`` comments allowed), and the raster length;
  a truncated file is an error naming the file and the byte count expected. The header is
  judged before the raster is read: more than ``MAX_IMAGE_PIXELS`` pixels, or a file far
  larger than its raster (a sparse file), is refused without reading it.
* MIAS has no patient id and no official split. Consecutive images are the left and right
  breasts of one woman (mdb001/002, 003/004, ...), so ``subject_id`` is the woman,
  ``(n + 1) // 2`` for ``mdbNNN`` (``mias_w001`` ...), and the ``--test-fraction`` split is
  drawn by woman: both breasts always land in the same split. It is stratified by each
  woman's worst label and seeded (``--seed``).
* ``site`` is ``MIAS`` for every image (one screening programme, one digitiser) and ``sex``
  is ``F``; ``tissue`` (the BG code: fatty, fatty-glandular, dense-glandular) is the natural
  grouping for a non-IID split (partition ``natural`` with ``column: tissue``).
"""

from __future__ import annotations

import argparse
import os
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from medfl.prep.common import (
    ASPECT_MODES, PrepError, PrepReport, base_parser, check_dirs, check_file_size, check_pixel_count, progress,
    resize_image, remove_stale_arrays, save_array, write_manifest, staged_main, NotDownloaded, keep_present,
)

__all__ = [
    "INFO_COLUMNS", "BACKGROUND", "ABNORMALITY", "SEVERITY", "CLASS_SETS", "COORD_FRAME",
    "InfoRow", "PgmImage", "PGM_HEADER_BYTES", "read_info_lines", "parse_info_line", "check_image_rows", "parse_info",
    "image_label",
    "subject_of", "info_to_pixel", "find_info", "index_images", "read_pgm", "crop_square",
    "breast_centre", "subject_split", "build_parser", "main",
]

#: The columns of Info.txt, in order (the header line names them).
INFO_COLUMNS: tuple[str, ...] = ("REFNUM", "BG", "CLASS", "SEVERITY", "X", "Y", "RADIUS")
#: BG codes (character of the background tissue) -> the manifest's ``tissue``.
BACKGROUND: dict[str, str] = {"F": "fatty", "G": "fatty-glandular", "D": "dense-glandular"}
#: CLASS codes (class of abnormality) -> description.
ABNORMALITY: dict[str, str] = {
    "CALC": "calcification", "CIRC": "well-defined/circumscribed mass",
    "SPIC": "spiculated mass", "MISC": "other, ill-defined mass",
    "ARCH": "architectural distortion", "ASYM": "asymmetry", "NORM": "normal",
}
#: SEVERITY codes -> class name.
SEVERITY: dict[str, str] = {"B": "benign", "M": "malignant"}
#: ``--classes`` choices -> class names in label order.
CLASS_SETS: dict[str, tuple[str, ...]] = {
    "normal-benign-malignant": ("normal", "benign", "malignant"),
    "benign-malignant": ("benign", "malignant"),
}
#: Side of the square frame Info.txt's coordinates refer to (the mini-MIAS image size).
COORD_FRAME = 1024

_REFNUM = re.compile(r"mdb(\d{3})")
_SEVERITY_RANK = {None: 0, "B": 1, "M": 2}


@dataclass(frozen=True)
class InfoRow:
    """One data line of Info.txt.

    Attributes:
        refnum: image reference, e.g. ``mdb005``.
        number: its number (5).
        line: 1-based line number in Info.txt.
        background: BG code (``F``/``G``/``D``).
        abnormality: CLASS code (``NORM`` for a normal image).
        severity: ``B``, ``M``, or ``None`` for a normal image.
        x, y: centre of the abnormality on the 1024 frame, origin bottom-left (``None`` when
            the line has no coordinates).
        radius: radius of a circle enclosing it, pixels of the 1024 frame (or ``None``).
    """

    refnum: str
    number: int
    line: int
    background: str
    abnormality: str
    severity: str | None = None
    x: int | None = None
    y: int | None = None
    radius: int | None = None

    @property
    def has_coordinates(self) -> bool:
        """Whether the line gives X, Y and RADIUS."""
        return self.x is not None


@dataclass
class PgmImage:
    """A decoded P5 PGM: ``pixels`` ``(H, W)`` uint8 (maxval < 256) or uint16, and header
    facts."""

    pixels: np.ndarray
    maxval: int
    trailing_bytes: int = 0
    comments: int = 0

    @property
    def shape(self) -> tuple[int, int]:
        """``(height, width)``."""
        return int(self.pixels.shape[0]), int(self.pixels.shape[1])


# ---------------------------------------------------------------------------------- Info.txt

def read_info_lines(path: Path) -> tuple[str | None, list[tuple[int, str]]]:
    """Split Info.txt into its header line (or ``None``) and its data lines.

    Lines are returned verbatim (trailing spaces kept, line ends removed) with their 1-based
    line numbers; blank lines are dropped.

    Raises:
        PrepError: the file is missing, not text, empty, has a header that lacks a column
            or orders them differently, has a header and nothing else, or starts with
            neither a header nor a data line.
    """
    path = Path(path)
    if not path.is_file():
        raise PrepError(f"{path}: not found; expected mini-MIAS's Info.txt", path)
    try:
        data = path.read_bytes()
        text = data.removeprefix(b"\xef\xbb\xbf").decode("ascii")     # a UTF-8 BOM, as the other scripts accept
    except UnicodeDecodeError as exc:
        raise PrepError(f"{path}: not a text file ({exc}); expected mini-MIAS's Info.txt",
                        path) from exc
    lines = [(i, s) for i, s in enumerate(text.splitlines(), start=1) if s.strip()]
    if not lines:
        raise PrepError(f"{path}: empty; expected a header line '{' '.join(INFO_COLUMNS)}' and "
                        "one line per abnormality", path)
    first_no, first = lines[0]
    tokens = first.split()
    if tokens[0].upper() == "REFNUM":
        missing = [c for c in INFO_COLUMNS if c not in [t.upper() for t in tokens]]
        if missing:
            raise PrepError(f"{path} line {first_no} (header): missing column(s) "
                            f"{', '.join(repr(c) for c in missing)}; expected "
                            f"'{' '.join(INFO_COLUMNS)}'", path)
        if [t.upper() for t in tokens] != list(INFO_COLUMNS):
            raise PrepError(f"{path} line {first_no} (header): columns {' '.join(tokens)}; "
                            f"expected exactly '{' '.join(INFO_COLUMNS)}' in this order", path)
        if len(lines) == 1:
            raise PrepError(f"{path}: a header line and no data lines; expected one line per "
                            "abnormality (or 'mdbNNN BG NORM' per normal image)", path)
        return first, lines[1:]
    if _REFNUM.fullmatch(tokens[0]):
        return None, lines
    raise PrepError(f"{path} line {first_no}: {first.strip()!r}; expected the header line "
                    f"'{' '.join(INFO_COLUMNS)}' or a data line 'mdbNNN BG CLASS ...'", path)


def parse_info_line(text: str, line: int, where: str | Path = "Info.txt") -> InfoRow:
    """Parse one data line of Info.txt (3, 4 or 7 whitespace-separated tokens).

    Raises:
        PrepError: wrong number of tokens, an unknown REFNUM / BG / CLASS / SEVERITY, a
            severity on a NORM line or none on an abnormal one, or X / Y / RADIUS that are
            not integers inside the 1024 frame. The message names ``where``, the line and
            the field.
    """
    at = f"{where} line {line}"
    tok = text.split()
    m = _REFNUM.fullmatch(tok[0]) if tok else None
    if m is None or int(m.group(1)) < 1:
        raise PrepError(f"{at}, field REFNUM: {tok[0] if tok else ''!r}; expected mdbNNN "
                        "(001-999)", at)
    if len(tok) not in (3, 4, 7):
        raise PrepError(f"{at}: {len(tok)} tokens in {text.strip()!r}; expected 3 (REFNUM BG "
                        "NORM), 4 (REFNUM BG CLASS SEVERITY, no coordinates) or 7 (REFNUM BG "
                        "CLASS SEVERITY X Y RADIUS)", at)
    refnum, bg, cls = tok[0], tok[1], tok[2]
    if bg not in BACKGROUND:
        raise PrepError(f"{at}, field BG: unknown code {bg!r}; expected one of "
                        f"{', '.join(f'{k} ({v})' for k, v in BACKGROUND.items())}", at)
    if cls not in ABNORMALITY:
        raise PrepError(f"{at}, field CLASS: unknown code {cls!r}; expected one of "
                        f"{', '.join(ABNORMALITY)}", at)
    number = int(m.group(1))
    if cls == "NORM":
        if len(tok) != 3:
            raise PrepError(f"{at}: {text.strip()!r}; a NORM line has exactly 3 tokens "
                            "(no SEVERITY, no coordinates)", at)
        return InfoRow(refnum, number, line, bg, cls)
    if len(tok) == 3:
        raise PrepError(f"{at}, field SEVERITY: missing for CLASS {cls}; expected B or M", at)
    sev = tok[3]
    if sev not in SEVERITY:
        raise PrepError(f"{at}, field SEVERITY: unknown code {sev!r}; expected B (benign) or "
                        "M (malignant)", at)
    if len(tok) == 4:
        return InfoRow(refnum, number, line, bg, cls, sev)
    vals: list[int] = []
    for name, value in zip(("X", "Y", "RADIUS"), tok[4:]):
        if not re.fullmatch(r"\d+", value):
            raise PrepError(f"{at}, field {name}: {value!r}; expected a non-negative integer "
                            "(pixels of the 1024 frame)", at)
        vals.append(int(value))
    x, y, r = vals
    if not (0 <= x <= COORD_FRAME and 0 <= y <= COORD_FRAME):
        raise PrepError(f"{at}, fields X Y: ({x}, {y}) lies outside the {COORD_FRAME} x "
                        f"{COORD_FRAME} image frame; expected 0..{COORD_FRAME}", at)
    if not 0 < r <= COORD_FRAME:
        raise PrepError(f"{at}, field RADIUS: {r}; expected 1..{COORD_FRAME}", at)
    return InfoRow(refnum, number, line, bg, cls, sev, x, y, r)


def check_image_rows(rows: Sequence[InfoRow], where: str | Path = "Info.txt") -> None:
    """Check that the lines of one image agree: one BG code, and NORM only on its own.

    Raises:
        PrepError: naming the image and the lines that disagree.
    """
    ref = rows[0].refnum
    lines = ", ".join(str(r.line) for r in rows)
    if len({r.background for r in rows}) > 1:
        raise PrepError(f"{where} lines {lines}: {ref} has BG codes "
                        f"{'/'.join(sorted({r.background for r in rows}))}; expected one "
                        "background tissue per image", f"{where} line {rows[0].line}")
    if len(rows) > 1 and any(r.abnormality == "NORM" for r in rows):
        raise PrepError(f"{where} lines {lines}: {ref} is NORM on one line and has other lines; "
                        "expected a normal image to have exactly one line",
                        f"{where} line {rows[0].line}")
    seen: set[tuple[Any, ...]] = set()
    for r in rows:
        key = (r.abnormality, r.severity, r.x, r.y, r.radius)
        if key in seen:
            raise PrepError(f"{where} line {r.line}: repeats an earlier line of {ref}; expected "
                            "each abnormality once", f"{where} line {r.line}")
        seen.add(key)


def parse_info(path: Path) -> dict[str, list[InfoRow]]:
    """Parse a whole Info.txt strictly (no skipping): image reference -> its lines, in file
    order.

    Raises:
        PrepError: as :func:`read_info_lines`, :func:`parse_info_line` and
            :func:`check_image_rows`.
    """
    _, lines = read_info_lines(path)
    images: dict[str, list[InfoRow]] = defaultdict(list)
    for no, text in lines:
        row = parse_info_line(text, no, path)
        images[row.refnum].append(row)
    for rows in images.values():
        check_image_rows(rows, path)
    return dict(images)


def image_label(rows: Sequence[InfoRow]) -> str:
    """The image-level class of an image's lines: ``normal``, ``benign``, or ``malignant``
    (malignant wins over benign)."""
    worst = max((r.severity for r in rows), key=lambda s: _SEVERITY_RANK[s])
    return "normal" if worst is None else SEVERITY[worst]


def subject_of(number: int) -> str:
    """The woman an image belongs to: consecutive images ``2k - 1`` and ``2k`` are the two
    breasts of woman ``k`` (``mias_w{k:03d}``)."""
    return f"mias_w{(number + 1) // 2:03d}"


def info_to_pixel(x: float, y: float, shape: Sequence[int]) -> tuple[float, float]:
    """Info.txt ``(X, Y)`` (1024 frame, origin bottom-left) -> pixel ``(row, col)`` of an
    image of ``shape = (H, W)``: ``row = (1024 - Y) * H / 1024``, ``col = X * W / 1024``."""
    h, w = int(shape[0]), int(shape[1])
    return (COORD_FRAME - y) * h / COORD_FRAME, x * w / COORD_FRAME


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
    """Every ``*.pgm`` under ``raw`` (any depth, suffix in any case) by lower-case stem."""
    files: dict[str, list[Path]] = defaultdict(list)
    for p in sorted(raw.rglob("*")):
        if p.suffix.lower() == ".pgm" and p.is_file():
            files[p.stem.lower()].append(p)
    return dict(files)


def _resolve(files: dict[str, list[Path]], refnum: str, where: str, raw: Path) -> Path:
    found = files.get(refnum.lower(), [])
    if not found:
        raise NotDownloaded(f"{refnum}.pgm: image missing (listed by {where}); expected "
                            f"{refnum}.pgm under --raw {raw}", f"{refnum}.pgm")
    if len(found) > 1:
        raise PrepError(f"{refnum}.pgm: found {len(found)} times ({', '.join(map(str, found))}); "
                        "expected one file per image", found[0])
    return found[0]


def _header_field(data: bytes, pos: int, name: str, path: Path) -> tuple[int, int, int]:
    """Read one decimal header field of a PGM after whitespace and comments; returns
    ``(value, position after it, comments skipped)``."""
    comments = 0
    while pos < len(data):
        c = data[pos:pos + 1]
        if c.isspace():
            pos += 1
        elif c == b"#":
            end = data.find(b"\n", pos)
            pos = len(data) if end < 0 else end + 1
            comments += 1
        else:
            break
    start = pos
    while pos < len(data) and data[pos:pos + 1].isdigit():
        pos += 1
    if pos == start:
        found = data[start:start + 12]
        raise PrepError(f"{path}: bad P5 PGM header: expected {name} as a decimal number at byte "
                        f"{start}, found {found!r}" + (" (file ends there)" if not found else ""),
                        path)
    return int(data[start:pos]), pos, comments


#: How much of a PGM is read to find its header (the real ones have 15 bytes of header).
PGM_HEADER_BYTES = 1 << 16


def read_pgm(path: Path) -> PgmImage:
    """Read a binary (P5) PGM, checking the header and the raster length.

    The header is ``P5``, width, height and maxval as decimal numbers separated by
    whitespace (``#`` comments allowed), then exactly one whitespace byte; the raster is
    ``width * height`` bytes (maxval < 256) or big-endian 16-bit words (maxval >= 256).
    Bytes after the raster are ignored and counted.

    Only the header is read before the file is judged: its first
    :data:`PGM_HEADER_BYTES`, the size the header announces against
    :data:`~medfl.prep.common.MAX_IMAGE_PIXELS` and against the file's size (``stat``), and
    only then the raster itself, so a huge or sparse file named ``.pgm`` is refused without
    being read.

    Raises:
        PrepError: missing or empty file, another magic number (an ASCII ``P2`` PGM, a PNG
            renamed ``.pgm``...), a malformed header or one longer than ``PGM_HEADER_BYTES``,
            a maxval outside 1..65535, more pixels than ``MAX_IMAGE_PIXELS``, a file far
            larger than its raster (:func:`~medfl.prep.common.check_file_size`), pixels above
            maxval, or a truncated raster (the message gives the byte count expected).
    """
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            data = f.read(PGM_HEADER_BYTES)
            width, height, maxval, pos, comments = _pgm_header(data, size, path)
            depth = 1 if maxval < 256 else 2
            expected = width * height * depth
            check_pixel_count(path, (height, width))
            check_file_size(path, size, pos, expected, f"{width} x {height}, maxval {maxval}")
            if size - pos < expected:
                raise PrepError(f"{path}: truncated P5 PGM: expected {expected} bytes of pixel data "
                                f"({width} x {height}, maxval {maxval}, {depth} byte(s) per pixel) after "
                                f"the {pos}-byte header, found {max(size - pos, 0)}", path)
            f.seek(pos)
            raster = f.read(expected)
    except FileNotFoundError as exc:
        raise PrepError(f"{path}: image missing", path) from exc
    except OSError as exc:
        raise PrepError(f"{path}: cannot read ({exc})", path) from exc
    if len(raster) < expected:       # shrank while read
        raise PrepError(f"{path}: truncated P5 PGM: expected {expected} bytes of pixel data after the "
                        f"{pos}-byte header, found {len(raster)}", path)
    dtype = np.uint8 if depth == 1 else np.dtype(">u2")
    pixels = np.frombuffer(raster, dtype=dtype).reshape(height, width)
    if maxval not in (255, 65535) and int(pixels.max()) > maxval:
        raise PrepError(f"{path}: pixel value {int(pixels.max())} above the header's maxval "
                        f"{maxval}; expected 0..{maxval}", path)
    return PgmImage(pixels.astype(np.uint16) if depth == 2 else pixels.copy(), maxval,
                    size - pos - expected, comments)


def _pgm_header(data: bytes, size: int, path: Path) -> tuple[int, int, int, int, int]:
    """Parse a P5 header from ``data``, the first bytes of a ``size``-byte file: returns
    ``(width, height, maxval, raster offset, comments)``.

    Raises:
        PrepError: as :func:`read_pgm` says of the header.
    """
    if not data:
        raise PrepError(f"{path}: empty file; expected a binary P5 PGM", path)
    if data[:2] != b"P5" or (len(data) > 2 and not data[2:3].isspace()):
        what = {b"P2": "an ASCII (P2) PGM", b"P1": "a PBM", b"P4": "a PBM", b"P3": "a PPM",
                b"P6": "a PPM", b"\x89P": "a PNG", b"\xff\xd8": "a JPEG"}.get(data[:2], "")
        raise PrepError(f"{path}: not a binary PGM: starts with {data[:8]!r}"
                        + (f" ({what})" if what else "") + "; expected the magic number 'P5'",
                        path)
    cut = len(data) < size        # only the start of the file is in data
    try:
        width, pos, c1 = _header_field(data, 2, "width", path)
        height, pos, c2 = _header_field(data, pos, "height", path)
        maxval, pos, c3 = _header_field(data, pos, "maxval", path)
    except PrepError as exc:
        if cut and str(exc).endswith("(file ends there)"):
            raise PrepError(f"{path}: bad P5 PGM header: it does not end in the first {len(data)} bytes; "
                            "expected a header of a few bytes (P5, width, height, maxval)", path) from None
        raise
    if cut and pos >= len(data):
        raise PrepError(f"{path}: bad P5 PGM header: it does not end in the first {len(data)} bytes; "
                        "expected a header of a few bytes (P5, width, height, maxval)", path)
    if width < 1 or height < 1:
        raise PrepError(f"{path}: bad P5 PGM header: size {width} x {height}; expected a positive "
                        "width and height", path)
    if not 0 < maxval < 65536:
        raise PrepError(f"{path}: bad P5 PGM header: maxval {maxval}; expected 1..65535", path)
    if pos >= len(data) or not data[pos:pos + 1].isspace():
        if pos < len(data):
            raise PrepError(f"{path}: bad P5 PGM header: expected one whitespace byte after "
                            f"maxval at byte {pos}, found {data[pos:pos + 1]!r}", path)
        pos = len(data) - 1  # header ends at EOF: an empty raster, reported as truncated
    return width, height, maxval, pos + 1, c1 + c2 + c3


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
  python data_prep/mias.py --raw ~/data/all-mias --out ~/data/mias_256
  python data_prep/mias.py --raw ~/data/all-mias --out ~/data/mias_bm_roi \\
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
    if args.limit is not None and args.limit < 1:
        p.error("--limit: expected a positive number")


def _joined(rows: Sequence[InfoRow], attr: str) -> str:
    return ";".join("" if getattr(r, attr) is None else str(getattr(r, attr)) for r in rows)


@staged_main
def main(argv: list[str] | None = None) -> int:
    """Prepare mini-MIAS: parse ``argv``, write the manifest, arrays and report into ``--out``.

    Returns:
        0 on success.

    Raises:
        PrepError: bad input (see the module docstring); per-image problems only without
            ``--skip-bad``; an empty split in any case.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(args, parser)
    raw, out = check_dirs(args.raw, args.out, args.overwrite)
    info_path = find_info(raw, args.info)
    if args.overwrite:  # arrays are rewritten below: never leave an old manifest naming them
        (out / "manifest.csv").unlink(missing_ok=True)
    info_rel = info_path.relative_to(raw).as_posix() if raw in info_path.parents else str(info_path)
    names = CLASS_SETS[args.classes]
    report = PrepReport("mias", str(raw), str(out), skip_bad=args.skip_bad, options={
        "info": str(info_path), "classes": args.classes, "size": args.size, "aspect": args.aspect,
        "roi": args.roi, "roi_size": args.roi_size if args.roi else None,
        "roi_margin": args.roi_margin if args.roi else None, "test_fraction": args.test_fraction,
        "seed": args.seed, "limit": args.limit}, present_only=args.present_only)

    # Info.txt: the file itself must be sound; a bad line drops its image (with --skip-bad).
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

    samples: list[dict[str, Any]] = []
    sizes: Counter[str] = Counter()
    excluded_normal = 0
    trailing = 0
    for ref in progress(considered, "mias", total=len(considered)):
        rows = images[ref]
        image_class = image_label(rows)
        if image_class not in names:
            excluded_normal += 1
            continue
        where = f"{info_rel} line {rows[0].line}"
        ok, path = report.attempt(f"{ref}.pgm", lambda: _resolve(files, ref, where, raw), "image")
        if not ok:
            continue
        ok, pgm = report.attempt(path, lambda: read_pgm(path), "image")
        if not ok:
            continue
        sizes[f"{pgm.shape[1]}x{pgm.shape[0]}"] += 1
        trailing += pgm.trailing_bytes > 0
        img = pgm.pixels.astype(np.float32) / float(pgm.maxval)
        base = {
            "image_path": path.relative_to(raw).as_posix(),
            "subject_id": subject_of(rows[0].number),
            "site": "MIAS", "sex": "F", "refnum": ref, "image_number": rows[0].number,
            "background": rows[0].background, "tissue": BACKGROUND[rows[0].background],
            "image_class": image_class,
        }
        if not args.roi:
            arr = resize_image(img, (args.size, args.size), args.aspect)[None]
            samples.append({**base, "sample_id": ref, "class_name": image_class,
                            "path": save_array(out, f"arrays/{ref}.npy", arr),
                            "abnormality": _joined(rows, "abnormality"),
                            "severity": _joined(rows, "severity"), "x": _joined(rows, "x"),
                            "y": _joined(rows, "y"), "radius": _joined(rows, "radius"),
                            "num_abnormalities": sum(r.abnormality != "NORM" for r in rows),
                            "info_lines": _joined(rows, "line")})
            continue
        w = img.shape[1]
        for i, r in enumerate(rows, start=1):
            if r.abnormality == "NORM":
                crow, ccol = breast_centre(img)
                side, sid, cls = args.roi_size, f"{ref}_roi", "normal"
            elif not r.has_coordinates:
                report.skip(f"{info_rel} line {r.line}",
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
                            "path": save_array(out, f"arrays/{sid}.npy", arr),
                            "abnormality": r.abnormality, "severity": r.severity or "",
                            "x": "" if r.x is None else r.x, "y": "" if r.y is None else r.y,
                            "radius": "" if r.radius is None else r.radius,
                            "num_abnormalities": sum(q.abnormality != "NORM" for q in rows),
                            "info_lines": str(r.line), "roi_row": round(crow, 2),
                            "roi_col": round(ccol, 2), "roi_side": round(side_px, 2)})

    for s in samples:
        s["label"] = names.index(s["class_name"])
    split_of = subject_split([s["subject_id"] for s in samples], [s["label"] for s in samples],
                             args.test_fraction, args.seed)
    for s in samples:
        s["split"] = split_of[s["subject_id"]]
    splits = Counter(s["split"] for s in samples)
    report.counts = {
        "info_lines": len(lines), "info_header": header is not None,
        "images_in_info": len({t.split()[0] for _, t in lines}), "pgm_files": len(files),
        "considered": len(considered), "excluded_normal": excluded_normal,
        "images_read": sum(sizes.values()), "samples": len(samples),
        "skipped": len(report.skipped),
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
                report.write(out)
                raise PrepError(f"--test-fraction {args.test_fraction}: the {split} split is "
                                f"empty ({len(split_of)} woman/women in {len(samples)} sample(s) "
                                "after skipping); expected at least two women per class, or "
                                "use --test-fraction 0", "--test-fraction")
        missing = [c for c in names if not any(s["split"] == "test" and s["class_name"] == c
                                               for s in samples)]
        if missing:
            report.note(f"the test split has no {', '.join(missing)} sample")
    if not samples:
        report.write(out)
    table = write_manifest(out, samples, extra_order=[
        "refnum", "image_number", "background", "tissue", "image_class", "abnormality",
        "severity", "x", "y", "radius", "num_abnormalities", "info_lines"], classes=names, report=report)
    if args.overwrite:
        remove_stale_arrays(out, set(table["path"]), report)
    report.write(out)
    print(report.summary())
    return 0
