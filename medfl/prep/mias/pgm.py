"""Binary (P5) PGM files, read here rather than through PIL so that the header is checked
(magic, width, height, maxval, comments) and judged before the raster is read: a truncated,
huge or sparse file is refused with the byte counts.

Imports no other module of :mod:`medfl.prep.mias`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from medfl.prep.common import check_file_size, check_pixel_count
from medfl.prep.errors import PrepError

__all__ = ["PgmImage", "PGM_HEADER_BYTES", "read_pgm"]


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
        if not (cut and str(exc).endswith("(file ends there)")):
            raise
        pos = len(data)       # the header runs past the bytes read: said below
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
