"""The run directory's own files (:class:`RunDir` owns every one of them: atomic writes,
checksums, checkpoints, the lock, ``status.json``): checksums, the manifest a checkpoint
records of them, and writes that say which file a full disk stopped. A run directory holds::

    config.json        resolved config (and the method entry) - enough to resume
    partition.csv      which sample went to which client and role
    partition_report.json  whether the partition dealt whole subjects (``group_column``), groups
                       per client, and how many groups straddle clients, the global test or a
                       client's splits (:func:`medfl.engine.data.partition_report`)
    metrics.csv        one row per (round, client, split) with every metric; ``reported_by``
                       says whose word it is across sites (:data:`medfl.engine.evaluation.METRICS_PROVENANCE`)
    train_metrics.csv  one row per (round, client, step) with what the client reported
                       (``step``: the index, from 0, of the round's training step; a run
                       written before the column existed gets it on resume from its row
                       order); its (round, client_id) pairs are the record of the sampled clients;
                       ``bytes_to_client``/``bytes_from_client``: that training step's
                       instruction and reply (:func:`medfl.wire.encoded_size`; one row per step for a
                       method with several steps a round)
    mechanisms.csv     what the method's own mechanisms did each round (``Method.mechanisms``:
                       stop rounds, decay weights, noise-to-signal ratios...), one line per
                       value: round, mechanism, scope, id, name, value (a number) or text;
                       in front, the engine's rows of the run's DP mechanisms: their noise
                       against the clipped signal (:mod:`medfl.privacy.signal`)
    validation_metrics.csv  one row per (round, client) of a method's validation exchange
                       (``Method.configure_validate``), when it has one
    profile.csv        one row per client of a method's profile exchange before round 1
                       (``Method.configure_profile``: PFedCDP's capability scores), when it has one
    final_metrics.csv  the coordinator's final models (``Method.final_models``: PFedCDP's
                       refined student) on the public test split and every client's splits
    <name>.csv         the method's own tables after its post-hoc stage (``Method.final_tables``:
                       PFedCDP's ``student_metrics.csv``, the student after every epoch)
    groups.csv         the method's client groups (``Method.client_groups``), when it has any
    privacy.csv        per round and client of a differentially private run: mechanism,
                       noise, clip, steps, sampling rate, epsilon spent so far, delta
                       (:mod:`medfl.privacy.ledger`)
    releases.jsonl     every DP reply the coordinator received (round, step, client, the
                       parameters it was released under, a digest), written before the
                       round's checkpoint: a resume re-runs a released round under them
                       (:mod:`medfl.privacy.releases`)
    communication.csv  one row per (round, client, phase: train, validate, evaluate, score)
                       with ``bytes_to_client``, ``bytes_from_client`` and ``messages``: the
                       encoded size of the messages (:func:`medfl.wire.encoded_size`), the same
                       in process and deployed (:mod:`medfl.engine.traffic`)
    summary.json       final metrics: mean, std, worst and best client per split, and
                       the clients each mean covers (``clients`` of ``of``), their
                       ``reported_by`` provenance, the
                       ``forgetting`` block (:func:`medfl.metrics.forgetting.forgetting_report`)
                       and the ``communication`` block (:meth:`medfl.engine.traffic.Traffic.summary`);
                       with early stopping, ``final`` is the best round's, ``last_round`` the
                       last round's and ``early_stopping`` says what was decided (below);
                       ``selection``: the first round the method's mechanism shaped
                       (``Method.scored_from``), the round reported and, where it differs,
                       the best over every round (:meth:`medfl.engine.runner.Run.selection`)
    log.txt            everything medfl logged while the run held its lock (timestamps, levels;
                       appended on resume, with a "resumed at round k" line; :mod:`medfl.logs`)
    forgetting.csv     per evaluated round: global/local/worst accuracy, balance, BwT,
                       negative-flip rates, sampled clients
    checkpoints/       coordinator state per round (last ``keep_checkpoints`` kept, and with
                       early stopping the best round's: the checkpoints kept record it), the
                       client states it goes with, and a manifest of the run's own files
                       (size and SHA-256 at checkpoint time) that a resume checks first
                       (:mod:`medfl.rundir`)
    clients/           each client's persistent state, versioned by round
    eval_state/        each client's evaluation memory (last per-sample correctness, for
                       the negative-flip counts; client-side, never sent), versioned by round
    plots/             PNG curves and per-client heatmaps (the reporting plugin)


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
widened by a NaN: :class:`GrowingCsv`) no longer starts with the same
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
import logging
import os
import shlex
import shutil
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import pandas as pd
import torch

from medfl.logs import FileLog
from medfl.plugins import PluginError, lookup


__all__ = ["sha256_file", "with_step_column", "RUN_FILES", "file_manifest", "manifest_problems", "interrupted_write", "sum_path", "write_sum",
           "check_sum", "DiskFullError", "NO_SPACE", "disk_full", "full_disk_message", "writing",
           "append_text", "RunError", "GrowingCsv", "RunDir", "recorded_backend", "resume_command"]

logger = logging.getLogger(__name__)

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



def with_step_column(train_metrics: pd.DataFrame) -> pd.DataFrame:
    """``train_metrics.csv``'s rows with a ``step`` column (after ``client_id``): as they are
    when they have one, else (a run written before medfl recorded it) each row's index among
    its client's rows of the round, which is the step when every step asked the client, as
    the rows were written step by step. A resumed run then appends rows of one layout."""
    if "step" in train_metrics.columns or train_metrics.empty:
        return train_metrics
    out = train_metrics.copy()
    keys = [c for c in ("round", "client_id") if c in out.columns]
    step = out.groupby(keys, sort=False).cumcount() if keys else pd.Series(0, index=out.index)
    out.insert(min(len(keys), len(out.columns)), "step", step.astype(int))
    return out


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
    tmp = side.with_name("." + side.name + ".tmp")
    with writing(side, tmp):
        tmp.write_text(sha256_file(written) + "\n")
    tmp.replace(side)


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


#: ``status.json`` is written padded to at least this many bytes, so that a full disk's stop
#: can still rewrite it in place (:meth:`RunDir.status`).
STATUS_BYTES = 1024


class RunError(RuntimeError):
    """A run cannot start or continue (e.g. nothing to resume)."""


def _write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` as JSON, atomically (a full disk leaves the file before whole:
    :func:`medfl.rundir.writing`)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with writing(path, tmp):
        tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def _write_csv(path: Path, df: pd.DataFrame, text: str | None = None) -> None:
    """Write ``df`` (or its CSV ``text``, already formatted) atomically with a checksum
    sidecar (``<name>.sha256``) that a resume checks (:func:`_read_rounds`)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with writing(path, tmp):
        if text is None:
            df.to_csv(tmp, index=False)
        else:
            with open(tmp, "w", encoding="utf-8", newline="") as f:   # the text as pandas made it
                f.write(text)
    write_sum(tmp, path)
    tmp.replace(path)


class GrowingCsv:
    """Writes the CSV files a run rewrites every round (``metrics.csv``, ``train_metrics.csv``,
    ``communication.csv``...), formatting only the rows added since the file was last written.

    Every write still writes the whole file atomically with its checksum (:func:`_write_csv`),
    but a frame whose leading rows, columns and dtypes equal what was last written for that
    file has only its new rows formatted; any other frame (a row changed, a column added, a
    dtype widened by a NaN) is formatted whole. Formatting costs about 5 us per row, so
    formatting every row every round made a long run's rounds grow slower and slower (a run
    of 20 clients spent about 0.1 s a round on it by round 500).
    """

    def __init__(self) -> None:
        self._last: dict[Path, tuple[pd.DataFrame, str]] = {}

    def write(self, path: Path, df: pd.DataFrame) -> None:
        """Write ``df`` to ``path`` as :func:`_write_csv` does."""
        last = self._last.get(path)
        text = None
        if last is not None:
            old, old_text = last
            n = len(old)
            if (len(df) >= n and list(df.columns) == list(old.columns) and list(df.dtypes) == list(old.dtypes)
                    and df.iloc[:n].reset_index(drop=True).equals(old)):
                text = old_text + (df.iloc[n:].to_csv(index=False, header=False) if len(df) > n else "")
        if text is None:
            text = df.to_csv(index=False)
        _write_csv(path, df, text)
        # a copy: a caller changing its frame in place must not change what was written
        self._last[path] = (df.reset_index(drop=True).copy(), text)


def _read_rounds(path: Path, upto: int) -> pd.DataFrame | None:
    """The rows of a per-round CSV of a run up to round ``upto`` (``None``: no such file)."""
    if not path.is_file():
        return None
    tmp = interrupted_write(path)
    if tmp is not None:
        tmp.replace(path)        # killed between the checksum and the rename: finish the write
    problem = check_sum(path)
    if problem:
        raise RunError(f"{path}: {problem}; a resume would continue from rows that are not the ones the run "
                       "wrote (rows lost or changed). Restore the file, or start a new run")
    try:
        df = pd.read_csv(path, dtype={"client_id": str, "client_name": str, "data_client_id": str, "id": str,
                                      "text": str}, keep_default_na=False, na_values=["", "nan", "NaN"])
    except pd.errors.EmptyDataError:   # written with no row yet (a round no site answered): nothing to keep
        return None
    return df[df["round"] <= upto].reset_index(drop=True)


def _fold_of(run_dir: Path) -> int | None:
    """The cross-validation fold of a run: the ``fold`` of the ``config.json`` beside
    ``run_dir``, as :func:`medfl.engine.runner.run_experiment` writes it for each fold (``None``: none)."""
    cfg = run_dir.parent / "config.json"
    try:
        fold = json.loads(cfg.read_text()).get("fold") if cfg.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return None if fold is None else int(fold)


def _lock(run_dir: Path) -> Any:
    """Hold ``run_dir/.lock`` exclusively for this process (``fcntl.flock``: released when the
    process dies, so a crash never leaves a stale lock); the file names the holder's pid.

    Raises:
        RunError: another process holds it (two resumes of one run would corrupt it).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no locking
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunError(f"{run_dir} is in use by another medfl process (pid {holder}); wait for it to finish or "
                       "stop it, then resume") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def _unlock(handle: Any) -> None:
    """Release a lock :func:`_lock` took (``None``: none was taken)."""
    if handle is not None:
        handle.close()


class RunDir:
    """Every file of one run directory (``path``): the atomic writes of its JSON and CSV
    files, the per-round tables (:class:`GrowingCsv`), the append-only logs, its checkpoints
    and their checksums and manifest, its lock and ``status.json``. The engine's
    :class:`~medfl.engine.runner.Run` holds one (``run.files``) and writes through it;
    ``label`` names the run in what it logs; while it holds the lock the run's ``log.txt``
    is open (:attr:`log`)."""

    def __init__(self, path: str | Path, label: str = "") -> None:
        self.path = Path(path)
        self.label = label
        #: the run directory's lock while this process writes it (:meth:`lock`)
        self.handle: Any = None
        #: the run's ``log.txt`` while this process holds the lock (:mod:`medfl.logs`)
        self.log = FileLog(self.path)
        self._csv = GrowingCsv()   # the CSVs rewritten every round, formatted row by row once
        #: who is told of every per-round table written and every status (experiment tracking,
        #: :class:`medfl.tracking.Tracking`): objects with ``rows(name, df, appended)`` and
        #: ``status(status, round)``, called after the file is written
        self.observers: list[Any] = []

    # ------------------------------------------------------------------ the lock
    def lock(self) -> None:
        """Hold the run directory's lock (:func:`_lock`) unless this process holds it already.

        Raises:
            RunError: another process holds it.
        """
        if self.handle is None:
            self.handle = _lock(self.path)
            self.log.attach(f"run {self.label or self.path.name}")

    def unlock(self) -> None:
        """Release the run directory's lock (nothing when it is not held) and close the
        run's ``log.txt``."""
        self.log.detach()
        _unlock(self.handle)
        self.handle = None

    def discard(self) -> None:
        """Remove the run directory and everything in it, releasing its lock first: for a new
        run that stopped before its first round because its method refused its settings
        (:class:`~medfl.method.MethodConfigError` from ``setup``), so that the refusal leaves
        no run behind (``medfl runs`` would list it as crashed). Never called on a run that
        trained."""
        self.unlock()
        shutil.rmtree(self.path, ignore_errors=True)

    def locked_elsewhere(self) -> bool:
        """Whether a process (another one, or this one through another :class:`RunDir`) holds
        the run directory's lock now, i.e. the run is being written (``medfl runs``). Probed
        with a shared, non-blocking ``flock`` that is released at once: it never waits and
        never writes; ``False`` where there is no lock file or no ``fcntl`` (not POSIX)."""
        if self.handle is not None:
            return False
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no locking
            return False
        try:
            f = open(self.path / ".lock")
        except OSError:
            return False
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False

    # ------------------------------------------------------------------ files
    def create(self) -> None:
        """Create the run directory and its ``checkpoints/``."""
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / "checkpoints").mkdir(exist_ok=True)

    def write_json(self, name: str, data: Any) -> None:
        """Write ``data`` to the run's file ``name`` as JSON, atomically (:func:`_write_json`)."""
        _write_json(self.path / name, data)

    def write_csv(self, name: str, df: pd.DataFrame) -> None:
        """Write the run's CSV ``name`` once, atomically with its checksum (:func:`_write_csv`)."""
        _write_csv(self.path / name, df)

    def write_rows(self, name: str, df: pd.DataFrame) -> None:
        """Write the run's per-round CSV ``name`` (rewritten every round: :class:`GrowingCsv`)."""
        self._csv.write(self.path / name, df)
        for observer in self.observers:
            observer.rows(name, df, False)

    def append_rows(self, name: str, df: pd.DataFrame) -> None:
        """Append ``df``'s rows to the run's CSV log ``name`` (a header when it is new)."""
        path = self.path / name
        append_text(path, df.to_csv(header=not path.is_file(), index=False))
        for observer in self.observers:
            observer.rows(name, df, True)

    def read_rows(self, name: str, upto: int) -> pd.DataFrame | None:
        """The rows of the run's per-round CSV ``name`` up to round ``upto`` (:func:`_read_rounds`)."""
        return _read_rounds(self.path / name, upto)

    def status(self, status: str, r: int, rounds: int, reason: str = "") -> None:
        """Write ``status.json``: the run's ``status``, its last round ``r`` of ``rounds``, and
        the ``reason`` of a failure. On a full disk, where the atomic write finds no room for a
        second copy, the file is rewritten in place (its own blocks freed first), so a run the
        full disk stopped still says ``failed`` rather than its last status."""
        path = self.path / "status.json"
        data = {"status": status, "last_round": r, "rounds": rounds, **({"reason": reason} if reason else {})}
        text = json.dumps(data, indent=2, default=str)
        # padded with spaces (valid JSON) to a fixed size, so that it can be rewritten in place
        text += " " * max(0, STATUS_BYTES - 1 - len(text.encode())) + "\n"
        tmp = path.with_suffix(".json.tmp")
        try:
            with writing(path, tmp):
                tmp.write_text(text)
            tmp.replace(path)
        except DiskFullError:
            # no room for a second copy: overwrite the file's own bytes in place (no new space
            # on the device), the reason shortened to fit, so a full disk's stop says "failed"
            size = path.stat().st_size if path.is_file() else 0
            for cut in (len(reason), 200, 0):
                text = json.dumps({**data, **({"reason": reason[:cut]} if reason and cut else {})}, indent=2)
                if len(text.encode()) < size:
                    break
            else:
                raise
            with open(path, "r+b") as f:
                f.write((text + " " * (size - 1 - len(text.encode())) + "\n").encode())
                f.flush()
                os.fsync(f.fileno())
        for observer in self.observers:
            observer.status(status, r)

    # ------------------------------------------------------------------ checkpoints
    def checkpoint_path(self, r: int) -> Path:
        """Round ``r``'s checkpoint file."""
        return self.path / "checkpoints" / f"round_{r:04d}.pt"

    def last_checkpoint(self) -> int:
        """The last round with a complete checkpoint (0 if none)."""
        d = self.path / "checkpoints"
        rounds = [int(p.stem.split("_")[1]) for p in d.glob("round_*.pt")] if d.is_dir() else []
        return max(rounds, default=0)

    def kept_checkpoints(self) -> list[int]:
        """The rounds whose checkpoints are on disk, oldest first."""
        d = self.path / "checkpoints"
        return sorted(int(p.stem.split("_")[1]) for p in d.glob("round_*.pt")) if d.is_dir() else []

    def manifest(self) -> dict[str, list[Any]]:
        """The ``files`` entry of a checkpoint taken now (:func:`file_manifest`)."""
        return file_manifest(self.path)

    def manifest_problems(self, manifest: dict[str, list[Any]], round: int) -> list[str]:
        """What is wrong with the files round ``round``'s checkpoint ``manifest`` names
        (:func:`manifest_problems`)."""
        return manifest_problems(self.path, manifest, round)

    def save_checkpoint(self, r: int, ckpt: dict[str, Any]) -> None:
        """Write round ``r``'s checkpoint ``ckpt`` atomically, with a checksum sidecar."""
        path = self.checkpoint_path(r)
        tmp = path.with_suffix(".tmp")
        with writing(path, tmp), open(tmp, "wb") as f:   # a file object: a full disk's OSError stays visible
            torch.save(ckpt, f)
        write_sum(tmp, path)
        tmp.replace(path)

    def drop_checkpoints(self, keep: Iterable[int]) -> None:
        """Delete every checkpoint (and its sidecar) of a round not in ``keep``."""
        keep = set(keep)
        for old in self.kept_checkpoints():
            if old not in keep:
                old_path = self.checkpoint_path(old)
                old_path.unlink()
                old_path.with_name(old_path.name + ".sha256").unlink(missing_ok=True)

    def read_checkpoint(self, k: int, verify: Callable[[dict[str, Any]], list[str]] | None = None
                        ) -> tuple[str, dict[str, Any] | None]:
        """Round ``k``'s checkpoint and what is wrong with it (``""``: nothing): its checksum,
        whether it is a readable medfl checkpoint, and what ``verify`` finds lost of the client
        states it records (present and unchanged)."""
        path = self.checkpoint_path(k)
        if not path.is_file():
            return f"{path} is missing", None
        problem = check_sum(path, required=True)
        ckpt = None
        if not problem:
            try:
                ckpt = torch.load(path, map_location="cpu", weights_only=True)
                if not isinstance(ckpt, dict) or "method" not in ckpt:
                    problem = "not a medfl checkpoint"
            except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
                problem = f"unreadable ({type(exc).__name__}: {str(exc)[:120]})"
        if not problem and ckpt is not None and verify is not None:
            lost = verify(ckpt)
            problem = "; ".join(lost[:3]) + (f" (and {len(lost) - 3} more)" if len(lost) > 3 else "")
        return problem, ckpt

    def intact_checkpoint(self, read_only: bool, verify: Callable[[dict[str, Any]], list[str]] | None = None
                          ) -> tuple[int, dict[str, Any] | None]:
        """The newest checkpoint that is whole (:meth:`read_checkpoint`), newest first; a
        damaged newer one is renamed ``*.damaged`` (kept, never deleted; not when
        ``read_only``) and the run says which round it falls back to.

        Raises:
            RunError: checkpoints exist but none is intact.
        """
        problems = []
        for k in reversed(self.kept_checkpoints()):
            path = self.checkpoint_path(k)
            problem, ckpt = self.read_checkpoint(k, verify)
            if not problem:
                if problems and not read_only:
                    for bad, why in problems:
                        bad.replace(bad.with_name(bad.name + ".damaged"))
                        logger.warning(f"medfl [{self.label}]: {bad.name} is damaged ({why}); kept as "
                                       f"{bad.name}.damaged")
                    logger.warning(f"medfl [{self.label}]: resuming from the last intact checkpoint, round {k}")
                return k, ckpt
            problems.append((path, problem))
        if problems:
            detail = "; ".join(f"{p.name}: {why}" for p, why in problems)
            raise RunError(f"{self.path}: no intact checkpoint to resume from ({detail}); start a new run "
                           f"(or raise fl.keep_checkpoints, default 2, to keep more to fall back to)")
        return 0, None


# ---------------------------------------------------------------------- which backend ran it
#: the ``"engine"`` of an experiment's ``config.json`` written before it recorded its
#: ``"backend"``: the backend that wrote it
_ENGINES = {"flower": "flower", "simulation": "ray"}


def _experiment_record(path: Path) -> dict[str, Any]:
    """The ``config.json`` of the experiment the run, fold, seed or experiment directory
    ``path`` belongs to (the topmost directory above it holding one); ``{}`` when there is
    none or it is not a JSON object (:func:`medfl.experiment.resume` names that problem)."""
    top = Path(path)
    while (top.parent / "config.json").is_file():
        top = top.parent
    try:
        saved = json.loads((top / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def recorded_backend(path: str | Path) -> tuple[str, dict[str, Any]]:
    """The name of the backend that ran the run or experiment in ``path``, and its
    experiment's ``config.json``: its ``"backend"`` (:func:`medfl.experiment.run_experiment`
    records it); for a directory written before medfl recorded it, the backend its
    ``"engine"`` names, else its ``fl.backend`` (``inprocess`` when it names none)."""
    record = _experiment_record(Path(path))
    name = record.get("backend") or _ENGINES.get(str(record.get("engine")))
    if not name:
        fl = record.get("fl") if isinstance(record.get("fl"), dict) else {}
        backend = fl.get("backend") or "inprocess"
        name = backend if isinstance(backend, str) else backend.get("name") or "inprocess"
    return str(name), record


def resume_command(path: str | Path) -> str:
    """The command that continues the stopped run or experiment ``path`` where its clients
    are: the ``resume_command(path, record)`` of the backend that ran it
    (:func:`recorded_backend`; :meth:`medfl.backend.Backend.resume_command`), what every
    "continue with" hint names. A backend that is not installed any more gets ``medfl
    resume PATH`` (which then names the missing backend)."""
    name, record = recorded_backend(path)
    try:
        command = getattr(lookup("backend", name)(), "resume_command", None)
    except PluginError:   # its plugin is gone: the plain command, which says so
        command = None
    if command is None:
        return f"medfl resume {shlex.quote(str(path))}"
    return str(command(Path(path), record))
