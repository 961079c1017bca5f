"""mini-MIAS's ``Info.txt``: its codes, one :class:`InfoRow` per line, strict parsing (each
error names the line and field), the image-level label, the woman an image belongs to, and
the 1024 frame its coordinates refer to.

Imports no other module of :mod:`medfl.prep.mias`.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from medfl.prep.common import check_text_encoding
from medfl.prep.errors import PrepError

__all__ = [
    "INFO_COLUMNS", "BACKGROUND", "ABNORMALITY", "SEVERITY", "CLASS_SETS", "COORD_FRAME", "InfoRow",
    "read_info_lines", "parse_info_line", "check_image_rows", "parse_info", "image_label", "subject_of",
    "info_to_pixel",
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
    check_text_encoding(path, "mini-MIAS Info.txt")
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
