"""Writes that leave a file whole and say when it is not: atomic writes, checksum sidecars,
the manifest a checkpoint records of a run's files, and a full disk named. A run directory's
files (:class:`medfl.rundir.RunDir`), the client states (:mod:`medfl.engine.store`) and the
journal of DP releases are written through it.

**Checksums.** Each file the engine writes whole (a per-round CSV, a checkpoint, a client
state) gets a ``<name>.sha256`` sidecar written before the file is renamed into place
(:func:`write_sum`), which a resume checks (:func:`check_sum`). A checkpoint without its
sidecar is set aside like a damaged one (it may have been changed together with deleting it).

**Manifest.** Each checkpoint (``checkpoints/round_NNNN.pt``) holds a manifest, ``files``:
the size and SHA-256 of each of the run's own files (:data:`RUN_FILES`) as they were when the
checkpoint was taken. A resume checks every file the manifest names before it changes
anything (:func:`manifest_problems`), so a deleted ``metrics.csv``, ``train_metrics.csv`` or
``communication.csv`` (which a resume used to write again with the later rounds only), or a
file changed together with its deleted ``.sha256``, stops the resume with one message naming
the file instead of continuing to wrong results.

A file passes when its first ``bytes`` bytes still have the recorded SHA-256: the run only
adds rows after a checkpoint (the rows of rounds after it, which a resume drops, and the
lines of the append-only logs), so the file as the checkpoint saw it is a prefix of the file
now. A CSV the engine wrote whole again after the checkpoint (a column added, a dtype
widened by a NaN: :class:`medfl.rundir.GrowingCsv`) no longer starts with the same
bytes; it passes when it matches the ``.sha256`` written with it (the engine's own last
write), and the resume's reading checks its rows as before. The sidecars stay: they cover
the time between two checkpoints and tell a kill between a file's checksum and its rename
(:func:`interrupted_write`); the manifest covers what a sidecar cannot, a file gone or
changed together with its sidecar.

**A full disk.** A write that runs out of space (``ENOSPC``, a quota's ``EDQUOT``, or
``EFBIG`` past a file size limit) raises :class:`DiskFullError` naming the file
(:func:`writing`): every file is written to a temporary name and renamed into place, so the
file before stays whole, and the partial temporary file is removed; an append is cut back
to where it started (:func:`append_text`). The engine then stops the run with one message
(:meth:`medfl.engine.runner.Run.execute`), and a resume once space is freed continues from
the last checkpoint as after any stop.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import pandas as pd

__all__ = ["sha256_file", "NO_SPACE", "DiskFullError", "disk_full", "full_disk_message", "writing", "append_text",
           "sum_path", "write_sum", "check_sum", "RUN_FILES", "file_manifest", "interrupted_write",
           "manifest_problems", "write_text", "write_json", "write_summed", "write_csv"]


def sha256_file(path: str | Path) -> str:
    """The SHA-256 of a file (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


#: The ``errno`` values of a write that found no room: no space left on the device, a disk
#: quota exceeded, a file larger than the process may write (``RLIMIT_FSIZE``).
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

class DiskFullError(OSError):
    """A file of the run could not be written: no space left on its device (or a quota or
    file size limit reached). ``filename`` is the file; the message names it."""

    def __init__(self, path: Path, cause: OSError) -> None:
        why = str(cause.strerror or cause)
        super().__init__(cause.errno, f"{path}: no space left on device"
                                      f"{'' if why.lower() == 'no space left on device' else f' ({why})'}; the "
                                      "file as it was before this write is intact", str(path))
        self.path = Path(path)

    def __str__(self) -> str:
        return str(self.strerror)


def disk_full(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` of a full disk (:data:`NO_SPACE`) behind ``exc`` (itself, its cause or
    its context: torch wraps a failed write of its own in a ``RuntimeError``), else ``None``."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in NO_SPACE:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def full_disk_message(exc: BaseException, where: Path | str) -> str | None:
    """The line a full disk behind ``exc`` (:func:`disk_full`) is reported with: the file
    (``where`` when the error does not name one) and "no space left on device"; ``None``
    when ``exc`` is something else."""
    full = disk_full(exc)
    if full is None:
        return None
    if isinstance(full, DiskFullError):
        return str(full)
    return f"{full.filename or where}: no space left on device ({full.strerror or full})"


@contextmanager
def writing(path: Path, tmp: Path | None = None) -> Iterator[None]:
    """Around the write of ``path`` (through its temporary file ``tmp``): a full disk raises
    :class:`DiskFullError` naming ``path``, after removing the partial ``tmp``.

    Raises:
        DiskFullError: the write ran out of space.
    """
    try:
        yield
    except Exception as exc:
        full = disk_full(exc)
        if full is None or isinstance(exc, DiskFullError):
            raise
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise DiskFullError(path, full) from exc


def append_text(path: Path, text: str, sync: bool = False) -> None:
    """Append ``text`` to ``path`` (an append-only log; ``sync``: flushed to disk before
    returning); a full disk cuts the file back to where the append started, so no half line
    is left for the next append to follow.

    Raises:
        DiskFullError: the append ran out of space.
    """
    start = path.stat().st_size if path.is_file() else 0
    try:
        with writing(path), open(path, "a", encoding="utf-8", newline="") as f:
            f.write(text)
            if sync:
                f.flush()
                os.fsync(f.fileno())
    except DiskFullError:
        with open(path, "r+b") as f:
            f.truncate(start)
        raise


def sum_path(path: Path) -> Path:
    """The checksum sidecar of ``path``: ``<name>.sha256`` beside it."""
    return path.with_name(path.name + ".sha256")


def write_sum(written: Path, final: Path) -> None:
    """Write ``final``'s checksum sidecar from the file ``written`` (about to be renamed to
    ``final``), atomically, before the rename: a file never exists without its sum.

    Raises:
        DiskFullError: no space left for it.
    """
    side = sum_path(final)
    write_text(side, sha256_file(written) + "\n", side.with_name("." + side.name + ".tmp"))


def check_sum(path: Path, sum_of: Path | None = None, required: bool = False) -> str:
    """Why ``path`` does not match the sidecar checksum of ``sum_of`` (default ``path``):
    "" when it does, or when there is no sidecar (files written before checksums) unless
    ``required`` (a checkpoint, always written with one: its sidecar deleted is a checkpoint
    that may have been changed with it)."""
    side = sum_path(sum_of or path)
    if required and not side.is_file():
        return (f"it has no {side.name} (every checkpoint is written with one; deleted, the checkpoint may have been "
                "changed with it)")
    if side.is_file() and sha256_file(path) != side.read_text().split()[0]:
        return "its SHA-256 differs from the one written with it (the file was changed or damaged)"
    return ""


#: The files of a run directory a checkpoint's manifest records, when they exist: the
#: partition, the profile exchange, the per-round tables a resume reads back, the journal of
#: DP releases and the log of refused replies. ``config.json`` (rewritten by every resume, with
#: ``--rounds``), ``status.json``, Flower's ``flower.json`` and ``flower_events.csv`` (a log of
#: every session, killed ones included) and the end-of-run files are not in it.
RUN_FILES = ("partition.csv", "profile.csv", "metrics.csv", "train_metrics.csv", "communication.csv",
             "cross_test.csv", "validation_metrics.csv", "mechanisms.csv", "privacy.csv", "releases.jsonl",
             "reply_events.csv")


def file_manifest(run_dir: Path) -> dict[str, list[Any]]:
    """``{name: [bytes, sha256]}`` of each of :data:`RUN_FILES` present in ``run_dir``: the
    ``files`` entry of a checkpoint."""
    out: dict[str, list[Any]] = {}
    for name in RUN_FILES:
        path = run_dir / name
        if path.is_file():
            out[name] = [path.stat().st_size, sha256_file(path)]
    return out


def _prefix_digest(path: Path, size: int) -> str | None:
    """The SHA-256 of the first ``size`` bytes of ``path`` (``None``: it is shorter)."""
    h = hashlib.sha256()
    left = int(size)
    with open(path, "rb") as f:
        while left > 0:
            block = f.read(min(left, 1 << 20))
            if not block:
                return None
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def interrupted_write(path: Path) -> Path | None:
    """``path``'s whole ``.tmp`` when a kill stopped the write of ``path`` between its checksum
    and its rename (the ``.sha256`` already describes the ``.tmp``, not the file); ``None``
    otherwise. The write is finished by renaming it into place."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    if not tmp.is_file() or not sum_path(path).is_file() or check_sum(tmp, sum_of=path):
        return None
    return tmp if not path.is_file() or check_sum(path) else None


def manifest_problems(run_dir: Path, manifest: dict[str, list[Any]], round: int) -> list[str]:
    """What is wrong with the files round ``round``'s checkpoint ``manifest`` names
    (:func:`file_manifest`), one sentence per file: missing, or not starting with the bytes
    the checkpoint saw (and not the engine's own later write either, see the module's
    docstring). Reads only: a file whose write a kill interrupted is judged by its ``.tmp``
    (:func:`interrupted_write`), which the resume then renames into place."""
    problems = []
    for name, (size, digest) in manifest.items():
        path = run_dir / name
        current = interrupted_write(path) or path
        seen = f"{int(size)} bytes, SHA-256 {str(digest)[:16]}..."
        if not current.is_file():
            problems.append(f"{path}: missing; round {round}'s checkpoint lists it ({seen})")
            continue
        if _prefix_digest(current, int(size)) == digest:
            continue
        problem = check_sum(current, sum_of=path)
        if not problem and sum_path(path).is_file():
            continue   # written whole again by the engine after the checkpoint: its rows are checked when read
        problems.append(f"{path}: {problem}, and its first bytes are not those round {round}'s checkpoint recorded "
                        f"({seen}): digest mismatch" if problem else
                        f"{path}: digest mismatch: its first bytes are not those round {round}'s checkpoint recorded "
                        f"({seen}), and it has no .sha256 written with it (the file was changed, its checksum deleted)")
    return problems


def write_text(path: Path, text: str, tmp: Path | None = None) -> None:
    """Write ``text`` to ``path`` through a temporary file (``tmp``, default ``<name>.tmp``)
    renamed into place (a full disk leaves the file before whole: :func:`writing`)."""
    tmp = tmp or path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        tmp.write_text(text)
    tmp.replace(path)


def write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` as JSON, atomically (:func:`write_text`)."""
    write_text(path, json.dumps(data, indent=2, default=str))


def write_summed(path: Path, write: Callable[[BinaryIO], Any], tmp: Path | None = None) -> None:
    """Write ``path`` atomically (through ``tmp``, default ``<name>.tmp``) with a checksum
    sidecar (:func:`write_sum`): ``write`` gets the temporary file, open for bytes (a file
    object: a full disk's ``OSError`` stays visible, :func:`writing`)."""
    tmp = tmp or path.with_name(path.name + ".tmp")
    with writing(path, tmp), open(tmp, "wb") as f:
        write(f)
    write_sum(tmp, path)
    tmp.replace(path)


def write_csv(path: Path, df: pd.DataFrame, text: str | None = None) -> None:
    """Write ``df`` (or its CSV ``text``, already formatted) atomically with a checksum
    sidecar (``<name>.sha256``) that a resume checks (:meth:`medfl.rundir.RunDir.read_rows`)."""
    write_summed(path, lambda f: f.write((df.to_csv(index=False) if text is None else text).encode("utf-8")))
