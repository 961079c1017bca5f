"""What every data_prep script shares: the command line, the output directory, the
manifest, cached arrays, the report of skipped items, and explicit resizing.

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
import errno
import json
import logging
import os
import shutil
import stat
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pandas as pd

from medfl.data.source import DataError

__all__ = [
    "PrepError", "PrepReport", "MANIFEST_COLUMNS", "base_parser", "check_dirs", "save_array",
    "write_manifest", "resize_image", "ASPECT_MODES", "run_script", "require_columns",
    "progress", "size_pair", "remove_stale_arrays", "staged_main", "NotDownloaded", "keep_present",
    "MAX_IMAGE_PIXELS", "FILE_SLACK_BYTES", "check_pixel_count", "check_file_size", "printable",
    "limit_per_split", "check_text_encoding", "file_problem", "check_file",
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


class PrepError(DataError):
    """Bad input to a data_prep script; the message names the file or field and what was
    expected. ``item`` is the file (or record) concerned, for the skip report."""

    def __init__(self, message: str, item: str | Path | None = None) -> None:
        super().__init__(message)
        self.item = str(item) if item is not None else ""


class NotDownloaded(PrepError):
    """A sample the metadata lists whose file is not under ``--raw`` at all: a partial
    download, which ``--present-only`` prepares without (a file that is there but unreadable
    is a plain :class:`PrepError`)."""


#: the skipped.csv stage of a sample whose file was not downloaded (``--present-only``)
NOT_DOWNLOADED = "not downloaded"

#: the hint a stop on an absent file ends with
PRESENT_ONLY_HINT = ("; if the download is partial, pass --present-only to prepare the samples "
                     "that are present (the others are listed in skipped.csv)")


def file_problem(path: str | Path) -> str:
    """What keeps ``path`` from being read as a file, in a few words: ``""`` for a non-empty
    regular file this process may read, ``"not found"`` where nothing is (not even a link),
    else ``"a directory"``, ``"a symlink loop (...)"``, ``"a broken symlink (...)"``,
    ``"an empty file (0 bytes)"``, ``"unreadable (permission denied)"``, ``"a FIFO, socket or
    device"``. Nothing is read (``stat`` only)."""
    try:
        st = os.stat(path)
    except OSError as exc:
        if not os.path.islink(path):
            return "not found" if exc.errno in (errno.ENOENT, errno.ENOTDIR) else f"unreadable ({exc.strerror})"
        target = os.readlink(path)
        if exc.errno == errno.ELOOP:
            return f"a symlink loop (-> {target}, which leads back to itself)"
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return f"a broken symlink (-> {target}, which does not exist)"
        return f"a symlink (-> {target}) that cannot be followed ({exc.strerror})"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    if not stat.S_ISREG(st.st_mode):
        return "a FIFO, socket or device"
    if st.st_size == 0:
        return "an empty file (0 bytes)"
    if not os.access(path, os.R_OK):
        return "unreadable (permission denied)"
    return ""


def check_file(path: Path, expected: str) -> Path:
    """``path``, when it is a non-empty regular file this process may read (:func:`file_problem`).

    Args:
        expected: what it should be, for the message ("the JPEG image of ...").

    Raises:
        NotDownloaded: nothing at ``path``, not even a broken link.
        PrepError: one line naming what is there instead (a directory, a symlink loop, an empty
            file...); never with the ``--present-only`` hint, since the path exists.
    """
    problem = file_problem(path)
    if problem:
        raise (NotDownloaded if problem == "not found" else PrepError)(f"{path}: {problem}; expected {expected}", path)
    return path


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
    pixels = 1
    for n in shape:
        pixels *= int(n)
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


def printable(text: str) -> str:
    """``text`` as valid UTF-8 text: the bytes of a file name that is not UTF-8 (which
    Python holds as surrogate escapes, ``b'\\xff'`` as ``'\\udcff'``) become ``\\xNN``
    escapes, so that a manifest, ``skipped.csv``, a report or a message can hold it."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:       # a lone surrogate that is not an escaped byte
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
        for work, final in _STAGED:
            if Path(self.out) == work:
                self.out = str(final)

    def skip(self, item: str | Path, reason: str, stage: str = "") -> None:
        """Record a skipped item."""
        self.skipped.append({"item": str(item), "stage": stage, "reason": reason})

    def note(self, text: str) -> None:
        """Record a remark for the reader (e.g. a choice the script made)."""
        self.notes.append(text)

    def _handle(self, exc: PrepError, item: str | Path, stage: str) -> None:
        """Record ``exc`` as a skip when the options allow it, or re-raise it."""
        absent = isinstance(exc, NotDownloaded)
        if not (self.skip_bad or (absent and self.present_only)):
            if absent and exc.args and PRESENT_ONLY_HINT not in str(exc.args[0]):
                exc.args = (f"{exc.args[0]}{PRESENT_ONLY_HINT}", *exc.args[1:])
            raise exc
        self.skip(exc.item or item, str(exc), NOT_DOWNLOADED if absent else stage)

    @contextmanager
    def guard(self, item: str | Path, stage: str = "") -> Iterator[None]:
        """Run a per-item step: a :class:`PrepError` inside is skipped and recorded when
        ``skip_bad`` (a :class:`NotDownloaded` also when ``present_only``), and re-raised
        otherwise. Use ``with report.guard(path): ...``; :meth:`attempt` is the function form
        that says whether the step succeeded."""
        try:
            yield
        except PrepError as exc:
            self._handle(exc, item, stage)

    def attempt(self, item: str | Path, fn: Callable[[], Any], stage: str = "") -> tuple[bool, Any]:
        """Call ``fn``; returns ``(True, result)``, or ``(False, None)`` when it raised a
        :class:`PrepError` that :meth:`guard` would skip (recorded), re-raising otherwise."""
        try:
            return True, fn()
        except PrepError as exc:
            self._handle(exc, item, stage)
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
            report._handle(exc, name(item), NOT_DOWNLOADED)   # present_only: recorded as skipped
            continue
        except PrepError:
            pass
        kept.append(item)
    if items and not kept:
        raise PrepError(f"--present-only: none of the {len(items)} listed sample(s) has its file under "
                        f"--raw {report.raw}; check --raw (the folder the archive was extracted to)",
                        report.raw)
    return kept


def check_dirs(raw: Path, out: Path, overwrite: bool) -> tuple[Path, Path]:
    """Resolve and check ``--raw`` and ``--out``; create ``out``.

    Raises:
        PrepError: ``raw`` is not a directory, ``out`` is inside ``raw`` (the raw directory is
            never written to), or ``out`` holds an earlier manifest and not ``overwrite``.
    """
    for option, path in (("--raw", raw), ("--out", out)):
        if "symlink loop" in file_problem(path):        # resolve() stops on it
            raise PrepError(f"{option} {path}: {file_problem(path)}; expected a folder", path)
    raw, out = Path(raw).resolve(), Path(out).resolve()
    if not raw.is_dir():
        raise PrepError(f"--raw {raw}: not a directory; expected the dataset as downloaded", raw)
    if out == raw or raw in out.parents:
        raise PrepError(f"--out {out} is inside --raw {raw}; data_prep never writes into the raw "
                        "dataset, choose an --out outside it", out)
    if out.exists() and not out.is_dir():
        raise PrepError(f"--out {out} is a file; expected a folder to write the prepared dataset into", out)
    if (out / "manifest.csv").exists() and not overwrite:
        raise PrepError(f"--out {out} already holds a manifest.csv from an earlier run; pass "
                        "--overwrite to replace it, or choose another --out", out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise PrepError(f"--out {out}: cannot create it ({exc.strerror or exc}); choose a folder you can write to",
                        out) from None
    if not os.access(out.parent, os.W_OK | os.X_OK) or (out.is_dir() and not os.access(out, os.W_OK | os.X_OK)):
        raise PrepError(f"--out {out}: not writable; choose a folder you can write to", out)
    return raw, _stage(out)


#: the staging folders of the scripts running in this process: (staging, final --out)
_STAGED: list[tuple[Path, Path]] = []


def _stage(out: Path) -> Path:
    """A fresh folder beside ``out`` that the script writes everything into;
    :func:`staged_main` renames it into place when the script succeeds, so a stop never
    leaves half an output and a failed ``--overwrite`` never touches the earlier dataset."""
    for old in out.parent.glob(f".{out.name}.partial-*"):   # left by a killed run (kill -9)
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    work = out.parent / f".{out.name}.partial-{os.getpid()}"
    if work.exists():
        shutil.rmtree(work)
    work.mkdir()
    _STAGED.append((work, out))
    return work


def _alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (its staging folder is in use)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _finish_stage(work: Path, out: Path, ok: bool) -> None:
    """Move what the script wrote in ``work`` into ``out`` (``work`` renamed when ``out`` does
    not exist; otherwise each entry replaces the one of its name, others are kept), or, after a
    failure, keep only the report (``report.json``, ``skipped.csv``) in ``<out>.failed/`` and
    remove the rest."""
    report = work / "report.json"
    if report.is_file():       # the report names the folder the dataset ends up in (as JSON text)
        report.write_text(report.read_text().replace(json.dumps(printable(str(work)))[1:-1],
                                                     json.dumps(printable(str(out)))[1:-1]))
    if ok:
        if not out.exists():
            work.rename(out)
            return
        # an existing --out (an earlier dataset with --overwrite, or a folder with other files):
        # each entry the script wrote replaces the entry of that name; nothing else is touched
        for entry in sorted(work.iterdir()):
            target = out / entry.name
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            entry.rename(target)
        shutil.rmtree(work, ignore_errors=True)
        failed = out.parent / f"{out.name}.failed"
        if failed.is_dir():
            shutil.rmtree(failed)   # an earlier failure's report: this run succeeded
        return
    reports = [work / n for n in ("report.json", "skipped.csv") if (work / n).is_file()]
    if reports:
        failed = out.parent / f"{out.name}.failed"
        failed.mkdir(exist_ok=True)
        for f in reports:
            f.replace(failed / f.name)
    shutil.rmtree(work, ignore_errors=True)


def staged_main(main: Callable[[list[str] | None], int]) -> Callable[[list[str] | None], int]:
    """Decorate a script's ``main``: the ``--out`` its :func:`check_dirs` staged is renamed
    into place when ``main`` returns 0, and removed when it fails or stops (Ctrl-C), keeping
    only the report in ``<out>.failed/``; messages that name the staging folder name that
    instead. Nothing the user had in ``--out`` changes unless the script succeeds."""
    import functools

    @functools.wraps(main)
    def wrapper(argv: list[str] | None = None) -> int:
        depth = len(_STAGED)
        try:
            code = main(argv)
        except BaseException as exc:
            while len(_STAGED) > depth:
                work, out = _STAGED.pop()
                _finish_stage(work, out, ok=False)
                if isinstance(exc, PrepError) and exc.args:
                    exc.args = (str(exc.args[0]).replace(str(work), str(out.parent / f"{out.name}.failed")),
                                *exc.args[1:])
            raise
        while len(_STAGED) > depth:
            work, out = _STAGED.pop()
            _finish_stage(work, out, ok=code == 0)
        return code

    return wrapper


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
        return _squeeze(resize(x, (c, th, tw), order=1, anti_aliasing=True, preserve_range=True), chan)
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
    return _squeeze(canvas, chan)


def _squeeze(x: np.ndarray, chan: bool) -> np.ndarray:
    x = x.astype(np.float32)
    return x if chan else x[0]


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


def remove_stale_arrays(out: Path, keep: set[str], report: PrepReport, subfolders: Sequence[str] = ("",)) -> None:
    """After ``--overwrite``: delete the ``.npy`` files an earlier run wrote under
    ``out/arrays/<subfolder>`` (``""``: ``arrays/`` itself) that the new manifest does not
    name (``keep``: paths relative to ``out``); a folder left empty is removed, and the count
    goes into the report."""
    stale = 0
    for sub in subfolders:
        folder = out / "arrays" / sub if sub else out / "arrays"
        if not folder.is_dir():
            continue
        prefix = f"arrays/{sub}/" if sub else "arrays/"
        for f in sorted(folder.glob("*.npy")):
            if prefix + f.name not in keep:
                f.unlink()
                stale += 1
        if not any(folder.iterdir()):
            shutil.rmtree(folder)
    if stale:
        report.note(f"--overwrite: removed {stale} array(s) of an earlier run not in this manifest")
