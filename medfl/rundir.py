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
                       (:mod:`medfl.integrity`)
    clients/           each client's persistent state, versioned by round
    eval_state/        each client's evaluation memory (last per-sample correctness, for
                       the negative-flip counts; client-side, never sent), versioned by round
    plots/             PNG curves and per-client heatmaps (the reporting plugin)
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd
import torch

from medfl.integrity import (DiskFullError, append_text, check_sum, interrupted_write, sum_path, write_csv,
                             write_json, write_summed, write_text)
from medfl.logs import FileLog
from medfl.plugins import PluginError, lookup

__all__ = ["with_step_column", "STATUS_BYTES", "RunError", "GrowingCsv", "RunDir", "recorded_backend", "resume_command"]

logger = logging.getLogger(__name__)


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


#: ``status.json`` is written padded to at least this many bytes, so that a full disk's stop
#: can still rewrite it in place (:meth:`RunDir.status`).
STATUS_BYTES = 1024


class RunError(RuntimeError):
    """A run cannot start or continue (e.g. nothing to resume)."""


class GrowingCsv:
    """Writes the CSV files a run rewrites every round (``metrics.csv``, ``train_metrics.csv``,
    ``communication.csv``...), formatting only the rows added since the file was last written.

    Every write still writes the whole file atomically with its checksum
    (:func:`medfl.integrity.write_csv`), but a frame whose leading rows, columns and dtypes
    equal what was last written for that file has only its new rows formatted; any other
    frame (a row changed, a column added, a dtype widened by a NaN) is formatted whole. Formatting costs about 5 us per row, so
    formatting every row every round made a long run's rounds grow slower and slower (a run
    of 20 clients spent about 0.1 s a round on it by round 500).
    """

    def __init__(self) -> None:
        self._last: dict[Path, tuple[pd.DataFrame, str]] = {}

    def write(self, path: Path, df: pd.DataFrame) -> None:
        """Write ``df`` to ``path`` as :func:`medfl.integrity.write_csv` does."""
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
        write_csv(path, df, text)
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
        #: :class:`medfl.tracking_feed.Tracking`): objects with ``rows(name, df, appended)`` and
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
        if self.handle is not None:
            self.handle.close()
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
        """Write ``data`` to the run's file ``name`` as JSON, atomically (:func:`medfl.integrity.write_json`)."""
        write_json(self.path / name, data)

    def write_csv(self, name: str, df: pd.DataFrame) -> None:
        """Write the run's CSV ``name`` once, atomically with its checksum (:func:`medfl.integrity.write_csv`)."""
        write_csv(self.path / name, df)

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
        try:
            write_text(path, text)
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

    def kept_checkpoints(self) -> list[int]:
        """The rounds whose checkpoints are on disk, oldest first."""
        d = self.path / "checkpoints"
        return sorted(int(p.stem.split("_")[1]) for p in d.glob("round_*.pt")) if d.is_dir() else []

    def save_checkpoint(self, r: int, ckpt: dict[str, Any]) -> None:
        """Write round ``r``'s checkpoint ``ckpt`` atomically, with a checksum sidecar."""
        path = self.checkpoint_path(r)
        write_summed(path, lambda f: torch.save(ckpt, f), path.with_suffix(".tmp"))

    def drop_checkpoints(self, keep: Iterable[int]) -> None:
        """Delete every checkpoint (and its sidecar) of a round not in ``keep``."""
        keep = set(keep)
        for old in self.kept_checkpoints():
            if old not in keep:
                old_path = self.checkpoint_path(old)
                old_path.unlink()
                sum_path(old_path).unlink(missing_ok=True)

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
    return f"medfl resume {shlex.quote(str(path))}" if command is None else str(command(Path(path), record))
