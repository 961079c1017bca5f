"""What every data_prep script shares: the body of its ``main`` (:func:`prep_main`), the
command line, the manifest, cached arrays, the report of skipped items, and explicit
resizing (the errors are in :mod:`medfl.prep.errors`, the output folder's staging in
:mod:`medfl.prep.staging`).

A data_prep script reads a dataset exactly as downloaded (``--raw``), never writes into
it, and writes to ``--out``:

``manifest.csv``
    one row per sample, columns :data:`MANIFEST_COLUMNS` first (``path`` is the cached
    array relative to ``--out``; ``image_path`` the raw file relative to ``--raw``), then
    any dataset-specific columns.
``arrays/``
    the cached preprocessed arrays (``.npy``, float32, channel first).
``report.json`` and ``skipped.csv``
    what was read, written and skipped, and why.

Per-file problems raise :class:`PrepError` naming the file and what was expected; with
``--skip-bad`` they are recorded and skipped, otherwise the script stops with that message
(exit status 2) and writes nothing further.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import numpy as np
import pandas as pd

from medfl.data.source import DataError
from medfl.prep.errors import NOT_DOWNLOADED, PRESENT_ONLY_HINT, NotDownloaded, PrepError, printable
from medfl.prep.staging import check_dirs, final_out, staged_main

__all__ = [
    "PrepReport", "PrepRun", "prep_main", "MANIFEST_COLUMNS", "base_parser", "save_array", "write_manifest",
    "resize_image", "ASPECT_MODES", "run_script", "require_columns", "progress", "size_pair", "keep_present",
    "MAX_IMAGE_PIXELS", "FILE_SLACK_BYTES", "check_pixel_count", "check_file_size", "limit_per_split",
    "check_text_encoding",
]

logger = logging.getLogger(__name__)

#: Columns every manifest starts with (empty where unknown).
MANIFEST_COLUMNS = ["sample_id", "path", "image_path", "label", "class_name", "subject_id",
                    "site", "sex", "split"]
#: How :func:`resize_image` handles an aspect ratio different from the target's.
ASPECT_MODES = ("pad", "crop", "stretch")
#: The most pixels (rows x columns x frames) an image file may announce: 8192 x 8192, above
#: the largest image of every supported dataset (a CBIS-DDSM mammogram is about 3000 x 5000).
#: A header announcing more is a bad file, refused before anything is decoded (a
#: decompression bomb, or a damaged header): decoding it would take gigabytes.
MAX_IMAGE_PIXELS = 8192 * 8192
#: What a DICOM or PGM file may hold beyond its header and twice the pixel data its header
#: announces (trailing elements, padding, compressed data that did not shrink) before it is
#: refused, unread, as not the image it is named as.
FILE_SLACK_BYTES = 1 << 20


def check_pixel_count(path: str | Path, shape: Sequence[int], limit: int = MAX_IMAGE_PIXELS) -> None:
    """Refuse an image whose header announces more than ``limit`` pixels, before it is
    decoded.

    Args:
        path: the file, for the message.
        shape: the sizes its header gives (e.g. ``(rows, columns)``, with frames, or only
            the pixel count).

    Raises:
        PrepError: ``prod(shape) > limit``, naming the file, its size and the limit.
    """
    pixels = math.prod(int(n) for n in shape)
    if pixels > limit:
        size = " x ".join(str(int(n)) for n in shape) + " = " if len(shape) > 1 else ""
        raise PrepError(f"{path}: its header announces {size}{pixels} pixels, above the limit of {limit} "
                        "(medfl.prep.common.MAX_IMAGE_PIXELS); expected an image of at most that many pixels "
                        "(a larger header is a damaged file or a decompression bomb, refused before decoding)",
                        path)


def check_file_size(path: str | Path, size: int, header: int, need: int, what: str) -> None:
    """Refuse a file far larger than its header says its image needs, before it is read.

    Args:
        path: the file, for the message.
        size: its size in bytes (``stat``, nothing read).
        header: bytes before the pixel data.
        need: bytes of pixel data the header announces.
        what: the header's description of the image (e.g. ``"128 x 128, 8-bit"``).

    Raises:
        PrepError: ``size > header + 2 * need + FILE_SLACK_BYTES``.
    """
    most = header + 2 * need + FILE_SLACK_BYTES
    if size > most:
        raise PrepError(f"{path}: {size} bytes, far more than its header's image ({what}) needs: {need} bytes "
                        f"of pixel data after a {header}-byte header; expected at most {most} bytes "
                        "(medfl.prep.common.FILE_SLACK_BYTES), so it is not the image it is named as "
                        "(a sparse or padded file?); it was not read", path)


def limit_per_split(splits: Sequence[str], limit: int) -> list[int]:
    """The positions ``--limit`` keeps of items in splits ``splits`` (one split name per
    item, in order), so that every split keeps at least one item: one each, the rest shared
    in proportion to the splits' sizes (the first items of each split, in order).

    Raises:
        PrepError: ``limit`` is smaller than the number of splits (some split would be empty).
    """
    order = list(dict.fromkeys(splits))
    if limit >= len(splits):
        return list(range(len(splits)))
    sizes = {s: sum(1 for x in splits if x == s) for s in order}
    if limit < len(order):
        raise PrepError(f"--limit {limit}: the listed samples fall in {len(order)} splits ("
                        + ", ".join(f"{s} {sizes[s]}" for s in order) + f"); expected --limit {len(order)} or "
                        "more, so that every split keeps a sample", "--limit")
    take = {s: 1 for s in order}
    for _ in range(limit - len(order)):
        s = max((s for s in order if take[s] < sizes[s]), key=lambda s: limit * sizes[s] / len(splits) - take[s])
        take[s] += 1
    kept: list[int] = []
    seen = {s: 0 for s in order}
    for i, s in enumerate(splits):
        if seen[s] < take[s]:
            kept.append(i)
            seen[s] += 1
    return kept


#: Byte-order marks of the text encodings other than UTF-8 (longest first) -> (name, iconv's name).
_BOMS = ((b"\xff\xfe\x00\x00", "UTF-32 (little-endian)", "UTF-32"),
         (b"\x00\x00\xfe\xff", "UTF-32 (big-endian)", "UTF-32"),
         (b"\xff\xfe", "UTF-16 (little-endian)", "UTF-16"), (b"\xfe\xff", "UTF-16 (big-endian)", "UTF-16"))


def check_text_encoding(path: Path, what: str) -> None:
    """Refuse a metadata file saved as UTF-16 or UTF-32 (Excel's "Unicode Text", some
    editors' "Unicode"), naming the encoding and how to convert it, before a UTF-8 reader
    fails on its first byte with ``can't decode byte 0xff``. Found by its byte-order mark, or,
    without one, by the NUL in every other byte of the first 4 KiB.

    Args:
        path: the file (not read beyond its first 4 KiB).
        what: what it should be, for the message ("HAM10000's metadata").

    Raises:
        PrepError: naming the encoding (and the mark) and the command that converts it.
    """
    with open(path, "rb") as f:
        head = f.read(4096)
    found = next(((bom, name, codec) for bom, name, codec in _BOMS if head.startswith(bom)), None)
    even, odd = head[0::2].count(0), head[1::2].count(0)      # "a\0b\0" (LE): NULs at odd offsets
    if found is None and len(head) >= 4 and max(even, odd) >= 0.9 * (len(head) // 2) and min(even, odd) == 0:
        little = odd > even
        endian = "little" if little else "big"
        found = (b"", f"UTF-16 ({endian}-endian, no byte-order mark)", "UTF-16LE" if little else "UTF-16BE")
    if found is None:
        return
    bom, name, codec = found
    mark = f" (byte-order mark {bom.hex(' ').upper()})" if bom and "mark" not in name else ""
    raise PrepError(f"{path}: {name} text{mark}; expected UTF-8 (or ASCII) {what}. Save it as UTF-8 "
                    f"(Excel: CSV UTF-8) or convert it: iconv -f {codec} -t UTF-8 {path.name} > utf8.tmp "
                    f"&& mv utf8.tmp {path.name}", path)


def require_columns(table: pd.DataFrame, columns: Sequence[str], where: str | Path) -> None:
    """Raise :class:`PrepError` naming ``where`` and the missing columns, if any (a table
    without any column: an empty file)."""
    if len(table.columns) == 0:
        raise PrepError(f"{where}: empty (no header row, no columns, no rows); expected a CSV with columns "
                        f"{', '.join(map(repr, columns))}", where)
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise PrepError(f"{where}: missing column(s) {', '.join(repr(c) for c in missing)}; "
                        f"found {', '.join(map(str, table.columns))}", where)


@dataclass
class PrepReport:
    """What a data_prep run read, wrote and skipped (written as ``report.json`` and
    ``skipped.csv``)."""

    dataset: str
    raw: str
    out: str
    skip_bad: bool = False
    options: dict[str, Any] = field(default_factory=dict)
    #: skip samples whose files were not downloaded (``--present-only``)
    present_only: bool = False
    skipped: list[dict[str, str]] = field(default_factory=list)
    counts: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        # a script writes into its staging folder (check_dirs); the report names the --out
        # the dataset ends up in
        self.out = str(final_out(self.out))

    def skip(self, item: str | Path, reason: str, stage: str = "") -> None:
        """Record a skipped item."""
        self.skipped.append({"item": str(item), "stage": stage, "reason": reason})

    def note(self, text: str) -> None:
        """Record a remark for the reader (e.g. a choice the script made)."""
        self.notes.append(text)

    def skip_or_raise(self, exc: PrepError, item: str | Path, stage: str = "") -> None:
        """Record ``exc`` as a skip of ``item`` when ``skip_bad`` (a :class:`NotDownloaded`
        also when ``present_only``), or raise it (an absent file's message then ends with the
        ``--present-only`` hint)."""
        absent = isinstance(exc, NotDownloaded)
        if not (self.skip_bad or (absent and self.present_only)):
            if absent and exc.args and PRESENT_ONLY_HINT not in str(exc.args[0]):
                exc.args = (f"{exc.args[0]}{PRESENT_ONLY_HINT}", *exc.args[1:])
            raise exc
        self.skip(exc.item or item, str(exc), NOT_DOWNLOADED if absent else stage)

    def attempt(self, item: str | Path, fn: Callable[[], Any], stage: str = "") -> tuple[bool, Any]:
        """Call ``fn``, a per-item step; returns ``(True, result)``, or ``(False, None)`` when it
        raised a :class:`PrepError` that :meth:`skip_or_raise` recorded as skipped."""
        try:
            return True, fn()
        except PrepError as exc:
            self.skip_or_raise(exc, item, stage)
            return False, None

    @property
    def not_downloaded(self) -> int:
        """How many listed samples were skipped because their files are absent."""
        return sum(1 for s in self.skipped if s["stage"] == NOT_DOWNLOADED)

    def write(self, out: Path) -> None:
        """Write ``report.json`` and ``skipped.csv`` into ``out``."""
        # a file name that is not UTF-8 is written with \xNN escapes (printable): a UTF-8 CSV
        # cannot hold its bytes, and failing here would discard the finished dataset
        skipped = [{k: printable(v) for k, v in s.items()} for s in self.skipped]
        doc = {"dataset": self.dataset, "raw": printable(self.raw), "out": printable(self.out),
               "skip_bad": self.skip_bad, "present_only": self.present_only, "options": self.options,
               "counts": self.counts, "notes": [printable(n) for n in self.notes], "num_skipped": len(self.skipped),
               "num_not_downloaded": self.not_downloaded, "seconds": round(time.time() - self.started, 2),
               "skipped": skipped}
        (out / "report.json").write_text(json.dumps(doc, indent=2, default=lambda v: printable(str(v))))
        pd.DataFrame(skipped, columns=["item", "stage", "reason"]).to_csv(out / "skipped.csv", index=False)

    def summary(self) -> str:
        """A few lines for the terminal."""
        lines = [f"{self.dataset}: " + ", ".join(f"{k} {v}" for k, v in self.counts.items())]
        if self.not_downloaded:
            lines.append(f"partial download: {self.not_downloaded} listed sample(s) not present under "
                         "--raw were left out (--present-only); they are in skipped.csv as 'not downloaded'")
        if self.skipped:
            lines.append(f"skipped {len(self.skipped)} item(s); see {Path(self.out) / 'skipped.csv'}")
            for s in self.skipped[:5]:
                lines.append(f"  {s['item']}: {s['reason']}")
            if len(self.skipped) > 5:
                lines.append(f"  ... and {len(self.skipped) - 5} more")
        lines.extend(f"note: {n}" for n in self.notes)
        return printable("\n".join(lines))


def base_parser(name: str, description: str, partial: bool = True) -> argparse.ArgumentParser:
    """The options every data_prep script takes: ``--raw``, ``--out``, ``--skip-bad``,
    ``--overwrite``, ``--limit``, and ``--present-only`` where a dataset is downloaded file
    by file (``partial``). Its usage names ``python -m medfl.prep.<name>``, which runs the same
    script in a checkout and in an installed medfl (``data_prep/<name>.py`` is only in the first)."""
    p = argparse.ArgumentParser(prog=f"python -m medfl.prep.{name}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--raw", required=True, type=Path, help="the dataset as downloaded (read only)")
    p.add_argument("--out", required=True, type=Path,
                   help="output directory: manifest.csv, arrays/, report.json, skipped.csv")
    p.add_argument("--skip-bad", action="store_true",
                   help="skip unreadable or inconsistent files and list them in skipped.csv "
                        "(default: stop at the first one with its error)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace the manifest and arrays of an earlier run in --out "
                        "(default: refuse to touch an --out that has a manifest.csv)")
    p.add_argument("--limit", type=int, default=None, metavar="N",
                   help="prepare only the first N samples (for a quick look)")
    if partial:
        p.add_argument("--present-only", action="store_true",
                       help="a partial download: prepare the samples whose files are present and "
                            "list the absent ones in skipped.csv as 'not downloaded' (report.json "
                            "counts them; --limit counts present samples). Default: stop at the "
                            "first absent file")
    return p


def keep_present(items: Sequence[Any], locate: Callable[[Any], Any], report: PrepReport,
                 name: Callable[[Any], str] = str) -> list[Any]:
    """With ``report.present_only``, the items whose files are present, in order: ``locate``
    raises :class:`NotDownloaded` for an absent one, which is recorded as skipped (any other
    error is left for the item's own step to meet). Without it, ``items`` unchanged. Run it
    before ``--limit`` so that the limit counts samples that can be prepared."""
    if not report.present_only:
        return list(items)
    kept = []
    for item in items:
        try:
            locate(item)
        except NotDownloaded as exc:
            report.skip_or_raise(exc, name(item), NOT_DOWNLOADED)   # present_only: recorded as skipped
            continue
        except PrepError:
            pass
        kept.append(item)
    if items and not kept:
        raise PrepError(f"--present-only: none of the {len(items)} listed sample(s) has its file under "
                        f"--raw {report.raw}; check --raw (the folder the archive was extracted to)",
                        report.raw)
    return kept


def save_array(out: Path, rel: str, arr: np.ndarray) -> str:
    """Write ``arr`` as float32 ``out/rel`` (atomically); return ``rel``."""
    path = out / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npy")
    np.save(tmp, np.ascontiguousarray(arr, dtype=np.float32))
    os.replace(tmp, path)
    return rel


def write_manifest(out: Path, rows: list[dict[str, Any]], extra_order: Sequence[str] = (), *,
                   classes: Sequence[str] | None = None, report: "PrepReport | None" = None) -> pd.DataFrame:
    """Write ``out/manifest.csv`` with :data:`MANIFEST_COLUMNS` first.

    With ``classes`` (the dataset's class names, by label), a class left without any sample
    (every one skipped by ``--skip-bad``, cut by ``--limit``, or missing from a partial
    download) is reported: a warning on stderr and a note in ``report``, because a run on the
    manifest can neither learn nor score it. An expected split that ended up empty is the
    script's to check: only it knows which splits the dataset has.

    Raises:
        PrepError: no rows at all, or a duplicated ``sample_id``.
    """
    if not rows:
        raise PrepError(f"{out}: no samples left to write (every sample was skipped or none "
                        "matched); see skipped.csv", out)
    # every cell a Python object until the names are escaped: pandas 3 with pyarrow installed
    # (mlflow brings it) stores text as UTF-8 arrow strings, which cannot hold a name that is
    # not UTF-8 (a surrogate escape), so a typed frame would fail before _escape_names ran
    df = pd.DataFrame(rows, dtype=object)
    for c in MANIFEST_COLUMNS:
        if c not in df.columns:
            df[c] = ""
    rest = [c for c in extra_order if c in df.columns and c not in MANIFEST_COLUMNS]
    rest += [c for c in df.columns if c not in MANIFEST_COLUMNS and c not in rest]
    df = df[MANIFEST_COLUMNS + rest]
    _escape_names(df, report)
    df = df.infer_objects()   # the column types pd.DataFrame(rows) infers, now that text is UTF-8
    df["label"] = df["label"].astype(np.int64)
    if df["sample_id"].duplicated().any():
        dup = df.loc[df["sample_id"].duplicated(), "sample_id"].iloc[0]
        raise PrepError(f"{out}: sample_id {dup!r} appears twice; expected one row per sample", out)
    df.to_csv(out / "manifest.csv", index=False)
    if classes is not None:
        present = set(df["label"].astype(int))
        empty = [f"{i} {name}" for i, name in enumerate(classes) if i not in present]
        if empty:
            why = []
            if report is not None and report.skipped:
                why.append(f"{len(report.skipped)} item(s) skipped")
            if report is not None and report.options.get("limit"):
                why.append(f"--limit {report.options['limit']}")
            text = (f"class(es) {', '.join(empty)} have no sample in the manifest"
                    + (f" ({', '.join(why)})" if why else " (not in the download?)")
                    + ": a run can neither learn nor score them")
            logger.warning(f"warning: {text}")
            if report is not None:
                report.note(text)
    return df


def _escape_names(df: pd.DataFrame, report: "PrepReport | None") -> None:
    """Rewrite, in place, text cells holding a file name that is not UTF-8 (bytes such as
    ``b'\\xff'`` from the download's folder or file names) with ``\\xNN`` escapes
    (:func:`printable`), and say so on stderr and in ``report``: the manifest stays a valid
    UTF-8 CSV that medfl reads, and the prepared samples are kept; only the escaped raw
    path no longer opens its file."""
    escaped: list[str] = []
    for c in df.columns:
        if pd.api.types.is_numeric_dtype(df[c]) or pd.api.types.is_bool_dtype(df[c]):
            continue
        # in Python, not pandas: a text column pandas types (arrow) cannot hold the raw names
        values = df[c].tolist()
        new = [printable(v) if isinstance(v, str) else v for v in values]
        changed = [n for v, n in zip(values, new) if isinstance(v, str) and n != v]
        if changed:
            escaped += [f"{c}={n}" for n in changed]
            df[c] = pd.Series(new, index=df.index, dtype=object)
    if escaped:
        text = (f"{len(escaped)} manifest value(s) name a file whose name is not valid UTF-8 (e.g. "
                f"{escaped[0]}); they are written with \\xNN escapes, since a UTF-8 CSV cannot hold those "
                "bytes: the samples are prepared, but such a path does not open its file (rename the file "
                "and prepare again to load from that column)")
        logger.warning(f"warning: {text}")
        if report is not None:
            report.note(text)


def resize_image(img: np.ndarray, size: Sequence[int], aspect: str = "pad") -> np.ndarray:
    """Resize a 2D image ``(H, W)`` or ``(C, H, W)`` to ``size = (h, w)`` with anti-aliasing,
    handling a different aspect ratio explicitly.

    ``pad`` scales the longer side to fit and pads the rest with zeros (nothing is cut,
    nothing is distorted); ``crop`` scales the shorter side to fit and crops the centre;
    ``stretch`` scales each axis independently (distorts).
    """
    from skimage.transform import resize

    if aspect not in ASPECT_MODES:
        raise PrepError(f"--aspect: unknown {aspect!r}; valid: {', '.join(ASPECT_MODES)}")
    chan = img.ndim == 3
    x = img if chan else img[None]
    c, h, w = x.shape
    th, tw = int(size[0]), int(size[1])
    if aspect == "stretch":
        canvas = resize(x, (c, th, tw), order=1, anti_aliasing=True, preserve_range=True).astype(np.float32)
        return canvas if chan else canvas[0]
    scale = min(th / h, tw / w) if aspect == "pad" else max(th / h, tw / w)
    nh, nw = max(1, round(h * scale)), max(1, round(w * scale))
    y = resize(x, (c, nh, nw), order=1, anti_aliasing=True, preserve_range=True).astype(np.float32)
    canvas = np.zeros((c, th, tw), dtype=np.float32)
    if aspect == "pad":
        top, left = (th - nh) // 2, (tw - nw) // 2
        canvas[:, top:top + nh, left:left + nw] = y
    else:
        top, left = (nh - th) // 2, (nw - tw) // 2
        canvas[:] = y[:, top:top + th, left:left + tw]
    return canvas if chan else canvas[0]


def progress(iterable: Any, desc: str, total: int | None = None) -> Any:
    """A tqdm progress bar on stderr where stderr is a terminal (none in a redirected stderr;
    none when ``MEDFL_NO_PROGRESS`` is set: :func:`medfl.logs.progress_bar_disabled`)."""
    from tqdm.auto import tqdm

    from medfl.logs import progress_bar_disabled

    return tqdm(iterable, desc=desc, total=total, unit="file", file=sys.stderr, disable=progress_bar_disabled())


def run_script(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> None:
    """Run a data_prep ``main`` as a script: a :class:`DataError` becomes ``error: ...`` on
    stderr and exit status 2, with no traceback. Its warnings go to stderr through the
    ``medfl`` logger (:func:`medfl.logs.configure_console`)."""
    from medfl.logs import configure_console

    configure_console()
    try:
        code = main(argv)
    except DataError as exc:
        logger.error(f"error: {printable(str(exc))}")
        sys.exit(2)
    sys.exit(code or 0)


def size_pair(values: Sequence[int], parser: argparse.ArgumentParser) -> tuple[int, int]:
    """``--size N`` or ``--size H W`` as ``(H, W)``; anything else is a usage error."""
    if len(values) not in (1, 2) or min(values) < 1:
        parser.error(f"--size: expected N or H W, positive, got {' '.join(map(str, values))}")
    return (values[0], values[0]) if len(values) == 1 else (values[0], values[1])


class _Skipped(Exception):
    """A step of one item that :meth:`PrepRun.step` recorded as skipped: the item is left out."""


@dataclass
class PrepRun:
    """One run of a data_prep script, as :func:`prep_main` hands it to the script's own part:
    the parsed ``args``, the checked ``--raw`` (``raw``), the staging folder that becomes
    ``--out`` (``out``, :func:`~medfl.prep.staging.check_dirs`) and the ``report``."""

    args: argparse.Namespace
    raw: Path
    out: Path
    report: PrepReport

    def step(self, item: str | Path, fn: Callable[[], Any], stage: str = "") -> Any:
        """``fn()``, for one item of :meth:`each`: a :class:`PrepError` the report skips
        (:meth:`PrepReport.attempt`) is recorded and leaves that item out; any other stops."""
        ok, result = self.report.attempt(item, fn, stage)
        if not ok:
            raise _Skipped
        return result

    def each(self, items: Sequence[Any], make: Callable[[Any], Any]) -> list[dict[str, Any]]:
        """The manifest rows of ``items``, under a progress bar named after the dataset:
        ``make(item)`` returns one row, a list of rows or ``None``; an item one of whose
        :meth:`step` calls was skipped adds none."""
        rows: list[dict[str, Any]] = []
        for item in progress(items, self.report.dataset, total=len(items)):
            try:
                made = make(item)
            except _Skipped:
                continue
            rows.extend([made] if isinstance(made, dict) else made or [])
        return rows

    def stop(self, message: str, item: str | Path) -> NoReturn:
        """Write the report (kept in ``<out>.failed/``) and stop with ``PrepError(message, item)``."""
        self.report.write(self.out)
        raise PrepError(message, item)

    def manifest(self, rows: list[dict[str, Any]], extra_order: Sequence[str] = (),
                 classes: Sequence[str] | None = None) -> pd.DataFrame:
        """:func:`write_manifest` into ``out``, empty classes noted in the report."""
        return write_manifest(self.out, rows, extra_order, classes=classes, report=self.report)


def prep_main(dataset: str, parser: argparse.ArgumentParser, argv: list[str] | None,
              prepare: Callable[[PrepRun], None],
              check: Callable[[argparse.Namespace, argparse.ArgumentParser], None] | None = None) -> int:
    """The body of every data_prep script's ``main``: parse ``argv`` (``check``: the script's
    own usage checks; then a positive ``--limit``), check ``--raw`` and stage ``--out``
    (:func:`~medfl.prep.staging.check_dirs`), run ``prepare`` (the script's own part: read the
    download, fill ``report.options``, write the arrays and :meth:`PrepRun.manifest`, count),
    write ``report.json`` and ``skipped.csv``, print the summary, and move the output into
    ``--out`` (:func:`~medfl.prep.staging.staged_main`). ``dataset`` names the report and the
    progress bar. Returns 0; raises :class:`PrepError` on bad input (per-item problems only
    without ``--skip-bad``)."""
    def body(argv: list[str] | None) -> int:
        args = parser.parse_args(argv)
        if check is not None:
            check(args, parser)
        if args.limit is not None and args.limit < 1:
            parser.error(f"--limit: expected a positive number, got {args.limit}")
        raw, out = check_dirs(args.raw, args.out, args.overwrite)
        run = PrepRun(args, raw, out, PrepReport(dataset, str(raw), str(out), skip_bad=args.skip_bad,
                                                 present_only=getattr(args, "present_only", False)))
        prepare(run)
        run.report.write(out)
        print(run.report.summary())
        return 0

    return staged_main(body)(argv)
