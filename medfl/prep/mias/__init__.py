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

The package's modules: :mod:`.info` (Info.txt), :mod:`.pgm` (the P5 PGM reader), and
:mod:`.cli` (:func:`build_parser`, :func:`main` and the helpers only they use), which imports
the other two. Every name is importable from here.
"""

from __future__ import annotations

from medfl.prep.mias.info import (
    ABNORMALITY, BACKGROUND, CLASS_SETS, COORD_FRAME, INFO_COLUMNS, SEVERITY, InfoRow,
    check_image_rows, image_label, info_to_pixel, parse_info, parse_info_line, read_info_lines,
    subject_of,
)
from medfl.prep.mias.pgm import PGM_HEADER_BYTES, PgmImage, read_pgm
from medfl.prep.mias.cli import (
    breast_centre, build_parser, crop_square, find_info, index_images, main, subject_split,
)

__all__ = [
    "INFO_COLUMNS", "BACKGROUND", "ABNORMALITY", "SEVERITY", "CLASS_SETS", "COORD_FRAME",
    "InfoRow", "PgmImage", "PGM_HEADER_BYTES", "read_info_lines", "parse_info_line", "check_image_rows", "parse_info",
    "image_label",
    "subject_of", "info_to_pixel", "find_info", "index_images", "read_pgm", "crop_square",
    "breast_centre", "subject_split", "build_parser", "main",
]
