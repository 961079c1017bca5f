"""Experiment tracking: the :class:`Tracker` base class and :class:`Tracking`, which feeds a
run directory's per-round tables to every tracker an experiment names.

A tracker (MLflow, TensorBoard, or a plugin's, registered with ``register_trackers``) sees an
experiment as runs keyed by their path under the experiment directory: ``""`` is the
experiment itself (the parent of every method run, folds and seeds included), ``"fedavg"`` or
``"fold_0/fedavg"`` a method run. :class:`Tracking` builds the trackers of ``fl.tracking``,
watches each method run's :class:`medfl.rundir.RunDir` (every per-round table it writes and
each ``status.json``), and after each finished round hands the round's rows to the trackers as
scalars with ``step = round`` (:func:`round_scalars`: the across-client means, and each
client's value for a tracker whose entry says ``per_client: true``); at the end of a run its
``summary.json`` and plots go as artifacts, its final models as models and its headline
figures (:func:`headline_figures`) to the experiment's run; at the end of the experiment its
own files (``comparison.csv``, the CV and seeds reports and their plots).

Nothing here is on a run's critical path: each tracker is called from a background thread of
its own (the round's rows are turned into scalars in the run's thread, which then goes on), and
the queues are drained when a run ends. A tracker that raises (a server down mid-run) is left
out for the rest of the session: its later calls are skipped at once, and tracking never stops
or loses a run.

A failed tracker's runs are not left running for ever: at the end of each method run and of the
experiment, medfl tries once more to end the runs it started and left open, as ``"failed"``
(``Tracker.end_run(key, "failed")``: MLflow's FAILED), from a thread of its own and waiting at
most :data:`TRACKER_WAIT_S` (a refused connection fails in seconds); after a failed attempt, the
next is at the experiment's end. The ``trackers`` block of ``summary.json`` counts, per run, the
scalars the tracker logged and those it did not (``values_sent``, ``values_unsent``) and how the
run was ended, and at the experiment's end one warning line per failed tracker gives the count
and the runs still open, by id. No call is added while every tracker works.

A tracker whose server is down costs seconds, not minutes: a run waits for a tracker's call at
most :data:`TRACKER_WAIT_S` (10 s; ``MEDFL_TRACKER_WAIT_S`` sets another) after the call began;
a call still running then (a server that does not answer) has its tracker abandoned (its
thread is left to end on its own) and reported like a failure. The ``mlflow`` tracker also
bounds MLflow's own HTTP retries (``medfl_plugins.trackers.MLFLOW_HTTP_DEFAULTS``). Which
tracker failed, in which call and why is logged (``medfl.tracking``) from the run's own thread,
so its ``log.txt`` has it, and each finished run's ``summary.json`` gets a ``trackers`` block
(:meth:`Tracking.summary`): ``{"mlflow": {"status": "failed", "step": "start_run", ...},
"tensorboard": {"status": "ok"}}``.

``tracking.json`` in the experiment directory (written atomically) records each tracker's
runs (MLflow's run ids) and the last round each run logged from each table, so that a resumed
experiment continues the same runs and never logs a round twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import re
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable

import pandas as pd

from medfl.config import ConfigError
from medfl.plugins import lookup
from medfl.integrity import write_json
from medfl.rundir import RunDir

__all__ = ["Tracker", "TrackerWarning", "Tracking", "flatten_params", "round_scalars", "headline_figures",
           "TABLE_SECTIONS",
           "TRACKING_FILE", "TRACKER_WAIT_S", "WAIT_ENV", "ERROR_CHARS", "tracker_wait_s", "short_error",
           "missing_package"]

logger = logging.getLogger(__name__)

#: The experiment directory's file that records the trackers' runs and what each logged.
TRACKING_FILE = "tracking.json"

#: The longest a run waits for one call to a tracker, in seconds, counted from when the call
#: began: a call that has not returned by then (a server down or not answering) has its tracker
#: abandoned and reported as failed, and none of its later calls is made, so a tracker that is
#: down costs a session about this much in all. A tracker that answers is waited for call after
#: call (a run's end waits for its artifacts and models to be logged).
TRACKER_WAIT_S = 10.0
#: The environment variable that sets another bound (seconds), e.g. for large models sent to a
#: slow server, whose upload may need longer than :data:`TRACKER_WAIT_S`.
WAIT_ENV = "MEDFL_TRACKER_WAIT_S"
#: The longest text of a tracker's error in ``log.txt`` and ``summary.json`` (its start and its
#: end are kept: the root cause of an HTTP error is at its end).
ERROR_CHARS = 300


def tracker_wait_s() -> float:
    """The bound in force: :data:`WAIT_ENV` when set (a positive number of seconds), else
    :data:`TRACKER_WAIT_S`.

    Raises:
        ConfigError: :data:`WAIT_ENV` is set to something else.
    """
    text = os.environ.get(WAIT_ENV, "").strip()
    if not text:
        return TRACKER_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{WAIT_ENV}={text!r}: expected a positive number of seconds (default {TRACKER_WAIT_S:g})")
    return value


def short_error(exc: BaseException | str, limit: int = ERROR_CHARS) -> str:
    """``"<type>: <message>"`` of ``exc`` on one line, at most ``limit`` characters: a longer
    one keeps its start and its end (where an HTTP client's error names the root cause, such as
    ``Connection refused``)."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} ... {text[-(limit - head - 5):]}"


#: Columns of the per-round tables that name a row rather than measure something; their values
#: become parts of a scalar's name (``client_id`` its last part).
NAME_COLUMNS = ("split", "phase", "mechanism", "scope", "name", "id")
#: Columns never logged as scalars (they place a row: round, step, provenance, free text).
NOT_SCALARS = {"round", "step", "client_id", "client_name", "data_client_id", "reported_by", "text", *NAME_COLUMNS}


class TrackerWarning(UserWarning):
    """A finished run's final models could not be rebuilt for the trackers (the run's clients
    ran elsewhere); the run and its tracking go on. A tracker that fails is logged instead
    (``medfl.tracking``, in the run's ``log.txt``) and named in ``summary.json``."""


def missing_package(tracker: str, package: str, exc: ImportError) -> ConfigError:
    """The one error a built-in tracker gives when its package is not installed."""
    return ConfigError(f"fl.tracking: the {tracker!r} tracker needs the {package!r} package, which is not "
                       f"installed ({exc}); install it with: pip install \"medfl[tracking]\"")


class Tracker:
    """Base class of a tracker: where an experiment's params, per-round scalars, artifacts and
    final models go. Register a subclass with ``register_trackers`` (its ``name`` is what
    ``fl.tracking`` and ``--tracking`` choose); :class:`Tracking` builds it with the
    experiment directory and the options of its ``fl.tracking`` entry.

    Every method is called from a background thread of the tracker's own, in order:
    :meth:`start_run` for the experiment (key ``""``) before any method run, then per method run
    :meth:`start_run`, :meth:`log_metrics` once per round, :meth:`log_summary`,
    :meth:`log_artifact` and :meth:`log_model` at its end, :meth:`end_run`; :meth:`close` last. An exception from any of
    them, or a call that has not returned :data:`TRACKER_WAIT_S` after it began, leaves the
    tracker out for the rest of the session (logged once per run, named in ``summary.json``);
    the run goes on.

    Attributes:
        name: the registered name.
        description: one line for ``medfl plugins``.
        options: the keys an ``fl.tracking`` entry may set, with their defaults (anything
            else is refused by name).
        requires: the importable packages it needs: a config naming it is refused before
            anything runs when one is missing (``pip install "medfl[tracking]"``).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, root: Path, **options: Any) -> None:
        """Args:
            root: the experiment directory (the tracker's own files may go under it).
            **options: the ``fl.tracking`` entry's keys (checked against :attr:`options`;
                ``per_client``, where a tracker offers it, is true or false:
                :func:`medfl.config.check_tracking`).
        """
        self.root = Path(root)
        self.settings: dict[str, Any] = {**self.options, **options}

    @property
    def per_client(self) -> bool:
        """Whether :meth:`log_metrics` gets each client's value besides the across-client means:
        the entry's ``per_client`` where :attr:`options` has that key (the built-in trackers:
        default ``false``), else ``True`` (a tracker that does not offer the choice gets all)."""
        return bool(self.settings.get("per_client", True))

    def start_run(self, key: str, name: str, params: dict[str, Any], parent: dict[str, Any] | None,
                  saved: dict[str, Any] | None, last_step: int) -> dict[str, Any]:
        """Start (``saved is None``) or continue (``saved``: what this returned before) the run
        ``key`` (``""``: the experiment), named ``name``, under ``parent`` (what this returned
        for the experiment's run; ``None`` for the experiment itself). ``params``: the flattened resolved config (log them on a new run
        only: a continued run has them). ``last_step``: the last round the run logged (0:
        none); a continued run must drop anything it holds after it.

        Returns:
            What :class:`Tracking` stores in ``tracking.json`` to continue this run later
            (JSON-serialisable, e.g. ``{"run_id": ...}``).
        """
        raise NotImplementedError

    def log_metrics(self, key: str, metrics: dict[str, float], step: int) -> None:
        """Log the scalars of round ``step`` of run ``key``."""
        raise NotImplementedError

    def log_summary(self, key: str, figures: dict[str, float], step: int) -> None:
        """Keep the finished method run ``key``'s headline figures (:func:`headline_figures`:
        ``{"<key>/<split>/<metric>": mean, ...}``, ``step``: the round they come from) with the
        experiment's run, so the experiment compares its arms at a glance. Default: nothing."""

    def log_artifact(self, key: str, path: Path, artifact_path: str | None = None) -> None:
        """Keep the file ``path`` (a PNG, ``summary.json``, ``comparison.csv``...) with run
        ``key``, under ``artifact_path`` (``None``: at its top). Default: nothing."""

    def log_model(self, key: str, name: str, model: Any, example: Any = None) -> None:
        """Keep the final model ``model`` (a :class:`torch.nn.Module`) of run ``key`` as
        ``name`` (``"model"``, or ``"model_<client>"`` for a personalised one); ``example``:
        an input batch of one sample (a tensor ``(1, C, H, W[, D])``). Default: nothing."""

    def end_run(self, key: str, status: str) -> None:
        """End run ``key``: ``status`` is ``"finished"``, ``"stopped"`` (resumable),
        ``"interrupted"`` or ``"failed"``. Default: nothing."""

    def close(self) -> None:
        """Release what the tracker holds (files, connections). Default: nothing."""


def flatten_params(data: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"train.lr": "0.01", "methods.0.name": "fedavg", ...}``: dotted
    keys, values as text (lists of scalars as JSON-like text)."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            out.update(flatten_params(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(data, list) and any(isinstance(v, (dict, list)) for v in data):
        for i, v in enumerate(data):
            out.update(flatten_params(v, f"{prefix}.{i}" if prefix else str(i)))
    else:
        out[prefix or "value"] = "null" if data is None else str(data)
    return out


_BAD = re.compile(r"[^\w\-. /:]")


def _part(value: Any) -> str:
    return _BAD.sub("_", str(value)) or "_"


def _numeric(series: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(series) and not pd.api.types.is_bool_dtype(series)


#: The first part of a scalar's name for the per-round tables not named by their stem: the
#: evaluation's come first where names are sorted (MLflow's and TensorBoard's charts), before
#: the run's bookkeeping (``traffic/...``: the bytes and messages of ``communication.csv``).
TABLE_SECTIONS = {"metrics": "eval", "cross_test": "eval_cross_test", "communication": "traffic"}


def round_scalars(table: str, rows: pd.DataFrame, per_client: bool = True) -> dict[int, dict[str, float]]:
    """The scalars of a per-round table's ``rows``, per round: ``{round: {name: value}}``.

    A scalar is named ``<section>/<name columns...>/<column>/<client>`` (``section``: the
    file's stem without ``_metrics``, or :data:`TABLE_SECTIONS`' name: ``metrics.csv`` is
    ``eval``, ``communication.csv`` ``traffic``), and for every column measured per client
    also ``.../mean`` over the round's clients; with ``per_client`` false only the means (and
    the columns not measured per client). A table with several rows of one client a round (a
    method with several training steps a round) names the later steps ``<section>/step<k>/...``
    (its ``step`` column when it has one, else the rows' order)."""
    stem = table[:-4] if table.endswith(".csv") else table
    prefix = TABLE_SECTIONS.get(stem, stem.removesuffix("_metrics"))
    if rows.empty or "round" not in rows:
        return {}
    rows = rows.reset_index(drop=True)
    names = [c for c in NAME_COLUMNS if c in rows]
    keys = ["round", *names, *(["client_id"] if "client_id" in rows else [])]
    step = rows["step"].astype(int) if "step" in rows else rows.groupby(keys, sort=False).cumcount()
    values = [c for c in rows if c not in NOT_SCALARS and _numeric(rows[c])]
    out: dict[int, dict[str, float]] = {}
    sums: dict[tuple[int, str], list[float]] = {}
    for i, rec in enumerate(rows.to_dict("records")):
        r = int(rec["round"])
        base = [prefix, *([f"step{int(step.iloc[i])}"] if int(step.iloc[i]) else []),
                *(_part(rec[c]) for c in names if not pd.isna(rec[c]))]
        client = _part(rec["client_id"]) if "client_id" in rec and not pd.isna(rec["client_id"]) else None
        for col in values:
            v = rec[col]
            if v is None or pd.isna(v) or not math.isfinite(float(v)):
                continue
            stat = "/".join([*base, _part(col)])
            if client:
                sums.setdefault((r, stat), []).append(float(v))
            if per_client or not client:
                out.setdefault(r, {})[f"{stat}/{client}" if client else stat] = float(v)
    for (r, stat), vs in sums.items():
        out.setdefault(r, {})[f"{stat}/mean"] = sum(vs) / len(vs)
    return out


def headline_figures(key: str, summary: dict[str, Any]) -> tuple[dict[str, float], int]:
    """A finished method run's headline figures, as its ``summary.json`` has them and
    ``comparison.csv`` shows them, named for the experiment's run: ``<key>/<split>/<metric>``,
    the mean over the clients of each metric of the summary's ``final`` block (the best round
    under early stopping, else the last round), ``<key>/mb_to_clients_per_round`` and
    ``<key>/mb_from_clients_per_round`` (megabytes, 1e6 bytes) and, with differential
    privacy, ``<key>/epsilon`` (the worst client's). Non-finite values are left out.

    Returns:
        ``(figures, round)``: ``round`` is the ``final`` block's round (0 when it has none).
    """
    final = summary.get("final") if isinstance(summary.get("final"), dict) else {}
    out: dict[str, float] = {}

    def put(name: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value)):
            out["/".join(_part(p) for p in (*key.split("/"), *name.split("/")))] = float(value)

    for split, block in final.items():
        if isinstance(block, dict):
            for metric, stats in block.items():
                if isinstance(stats, dict):
                    put(f"{split}/{metric}", stats.get("mean"))
    per_round = (summary.get("communication") or {}).get("per_round") or {}
    for side in ("to", "from"):
        value = per_round.get(f"bytes_{side}_clients")
        put(f"mb_{side}_clients_per_round", float(value) / 1e6 if isinstance(value, (int, float)) else None)
    put("epsilon", (summary.get("privacy") or {}).get("epsilon"))
    return out, int(final.get("round") or 0)


class _RunWatch:
    """Watches one method run's :class:`RunDir`: keeps the newest frame of each per-round
    table, and on each ``status.json`` hands :class:`Tracking` what is new."""

    def __init__(self, tracking: "Tracking", run: Any, key: str) -> None:
        self.tracking, self.run, self.key = tracking, run, key
        self.latest: dict[str, pd.DataFrame] = {}

    def rows(self, name: str, df: pd.DataFrame, appended: bool) -> None:
        old = self.latest.get(name)
        self.latest[name] = pd.concat([old, df], ignore_index=True) if appended and old is not None else df

    def status(self, status: str, r: int) -> None:
        self.tracking._status(self, status, r)


@dataclass
class _Worker:
    """One tracker's calls, made in order by a daemon thread of its own (a tracker that hangs
    holds up no other). ``pending`` and ``current`` change under :attr:`Tracking._cond`."""

    name: str
    jobs: "queue.SimpleQueue[tuple[str, str, Callable[[Tracker], None]] | None]" = field(
        default_factory=queue.SimpleQueue)
    #: calls queued or being made
    pending: int = 0
    #: the call being made: (step, what, when it began on Tracking's clock)
    current: tuple[str, str, float] | None = None
    thread: threading.Thread | None = None


class Tracking:
    """The trackers of one experiment (``fl.tracking``) for this session.

    Args:
        root: the experiment directory (``tracking.json`` goes there).
        specs: the checked ``fl.tracking`` entries (:func:`check_tracking`).
        name: the experiment's name (MLflow's experiment, unless an entry says otherwise).
        params: the experiment's resolved config (logged flattened, :func:`flatten_params`).
        final_models: ``run -> {name: (torch.nn.Module, example batch)}``: a finished run's
            final models (the global model, each client's personalised one), or ``None``:
            none logged.
        wait_s: the longest a run waits for one tracker call (default: :func:`tracker_wait_s`).
        clock: the time source of that bound (``time.monotonic``).
    """

    def __init__(self, root: Path, specs: list[dict[str, Any]], name: str, params: dict[str, Any],
                 final_models: Callable[[Any], dict[str, Any]] | None = None, wait_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = Path(root)
        self.name = name
        self.params = params
        self.final_models = final_models
        self.wait_s = float(tracker_wait_s() if wait_s is None else wait_s)
        self._clock = clock
        self.state: dict[str, Any] = self._read_state()
        known = [dict(s) for s in self.state.get("trackers", [])]
        for spec in specs:   # the saved trackers go on; a new one joins
            if not any(k["name"] == spec["name"] for k in known):
                known.append(dict(spec))
        self.specs = known
        self._cond = threading.Condition()
        #: tracker -> what failed (:meth:`summary`); the first failure of a tracker is kept
        self._failures: dict[str, dict[str, Any]] = {}
        #: (tracker, run key) whose failure the run's log has said ("": the experiment's log)
        self._told: set[tuple[str, str]] = set()
        self._closed = False
        self.trackers: dict[str, Tracker] = {}
        for spec in self.specs:
            opts = {k: v for k, v in spec.items() if k != "name"}
            try:
                self.trackers[spec["name"]] = lookup("tracker", spec["name"])(self.root, **opts)
            except ConfigError:   # a mistake in the entry (a uri MLflow refuses): said before anything runs
                raise
            except Exception as exc:  # noqa: BLE001 - a tracker that cannot start must not stop the run
                self._fail(spec["name"], "init", "building the tracker", short_error(exc), 0.0)
        self._tell("")
        self.state["trackers"] = self.specs
        self.state.setdefault("runs", {})
        self._lock = threading.RLock()
        #: the last round queued for each (tracker, run key, table): what the next round leaves out
        self._queued: dict[tuple[str, str], dict[str, int]] = {}
        self._workers: dict[str, _Worker] = {}
        for tname in self.trackers:
            worker = self._workers[tname] = _Worker(tname)
            worker.thread = threading.Thread(target=self._work, args=(worker,), name=f"medfl-tracking-{tname}",
                                             daemon=True)
            worker.thread.start()
        self._started: set[str] = set()
        self._ran: set[str] = set()   # the runs that trained a round in this session
        #: (tracker, run key) -> [scalars handed to the tracker for the run, scalars it logged]
        self._values: dict[tuple[str, str], list[int]] = {}
        #: (tracker, run key) of each run a tracker started or continued in this session
        self._opened: set[tuple[str, str]] = set()
        #: (tracker, run key) -> the status a run was ended with in this session
        self._ended: dict[tuple[str, str], str] = {}
        #: failed tracker -> the thread of its last attempt to end the runs it left open
        self._mending: dict[str, threading.Thread] = {}
        #: failed tracker -> why its last attempt to end its runs failed
        self._unreachable: dict[str, str] = {}
        #: the finished runs whose summary.json has the trackers block (rewritten at the end
        #: of a session in which a tracker failed: how its runs ended)
        self._recorded: dict[str, _RunWatch] = {}

    # ------------------------------------------------------------------ state
    def _read_state(self) -> dict[str, Any]:
        path = self.root / TRACKING_FILE
        if not path.is_file():
            return {}
        try:
            return json.loads(path.read_text())
        except ValueError as exc:
            raise ConfigError(f"{path}: not valid JSON ({exc}); the trackers' run ids are lost: move the file away "
                              "to start new tracking runs") from exc

    def _save_state(self) -> None:
        with self._lock:
            if self._closed:   # a call abandoned at the session's end returned later: the session is over
                return
            write_json(self.root / TRACKING_FILE, self.state)

    def _entry(self, tracker: str, key: str) -> dict[str, Any]:
        with self._lock:
            return self.state["runs"].setdefault(tracker, {}).setdefault(key, {"run": None, "logged": {}})

    # ------------------------------------------------------------------ the workers
    def _work(self, worker: _Worker) -> None:
        """A tracker's thread: its calls in order, until ``None``; a failed tracker's are skipped."""
        while True:
            job = worker.jobs.get()
            if job is None:
                return
            step, what, fn = job
            try:
                with self._cond:
                    skip = worker.name in self._failures
                    began = self._clock()
                    worker.current = None if skip else (step, what, began)
                    self._cond.notify_all()
                if not skip:
                    try:
                        fn(self.trackers[worker.name])
                    except Exception as exc:  # noqa: BLE001 - a tracker must never stop a run
                        self._fail(worker.name, step, what, short_error(exc), self._clock() - began)
            finally:
                with self._cond:
                    worker.current = None
                    worker.pending -= 1
                    self._cond.notify_all()

    def _fail(self, tracker: str, step: str, what: str, error: str, seconds: float) -> None:
        """Record that ``tracker`` failed in ``step`` (the :class:`Tracker` method; ``what``: the
        call in words) with ``error``, after ``seconds``; its later calls are skipped. The first
        failure of a tracker is the one kept."""
        with self._cond:
            self._failures.setdefault(tracker, {"status": "failed", "step": step, "call": what, "error": error,
                                                "seconds": round(float(seconds), 3)})
            self._cond.notify_all()

    def _call(self, tracker: str, step: str, what: str, fn: Callable[[Tracker], None]) -> bool:
        """Queue ``fn(tracker)`` on the tracker's thread (nothing when the tracker has failed);
        ``step``: the :class:`Tracker` method it calls, ``what``: the call in words. Returns
        whether it was queued."""
        with self._cond:
            if tracker in self._failures or tracker not in self._workers:
                return False
            worker = self._workers[tracker]
            worker.pending += 1
        worker.jobs.put((step, what, fn))
        return True

    def _count(self, tracker: str, key: str, handed: int = 0, sent: int = 0) -> None:
        """Count scalars of run ``key`` handed to ``tracker`` (queued, or dropped because it
        had failed) and those it logged."""
        with self._lock:
            counts = self._values.setdefault((tracker, key), [0, 0])
            counts[0] += handed
            counts[1] += sent

    def _wait(self, block: bool = True) -> None:
        """Abandon each tracker whose call has run :attr:`wait_s` (recorded as failed with a
        ``TimeoutError``); with ``block``, first wait until every other tracker has made its
        queued calls. Never longer than :attr:`wait_s` for a tracker that does not answer."""
        with self._cond:
            while True:
                now = self._clock()
                busy: list[_Worker] = []
                for worker in self._workers.values():
                    if worker.name in self._failures or not worker.pending:
                        continue
                    if worker.current is not None and now - worker.current[2] >= self.wait_s:
                        step, what, began = worker.current
                        self._fail(worker.name, step, what, f"TimeoutError: no answer {self.wait_s:g} s after the "
                                   f"call began; medfl stopped waiting for it ({WAIT_ENV} sets the bound)", now - began)
                        continue
                    busy.append(worker)
                if not busy or not block:
                    return
                due = [w.current[2] + self.wait_s - now for w in busy if w.current is not None]
                self._cond.wait(timeout=max(0.01, min(due)) if due else self.wait_s)

    def drain(self) -> None:
        """Wait until every tracker has made its queued calls or failed; a tracker whose call
        has not returned :attr:`wait_s` after it began is abandoned (:meth:`_wait`)."""
        self._wait()

    @property
    def failed(self) -> set[str]:
        """The trackers left out after a failure."""
        with self._cond:
            return set(self._failures)

    def summary(self, key: str | None = None) -> dict[str, dict[str, Any]]:
        """The ``trackers`` block of a run's ``summary.json``: per tracker of ``fl.tracking``,
        ``{"status": "ok"}`` while every call so far worked, else ``{"status": "failed", "step":
        <the Tracker method: init, start_run, log_metrics, log_summary, log_artifact, log_model,
        end_run, close>, "call": <the call in words>, "error": "<type>: <message>", "seconds": <how long
        the failed call ran>, "runs": ...}``.

        ``runs`` (a failed tracker that was built): per run, the method run ``key`` and the
        experiment's (``"(experiment)"``; ``key`` ``None``: every run of the session),
        ``{"run": <what the tracker returned for it, e.g. {"run_id": ...}; null: never
        started>, "values_sent": <scalars it logged>, "values_unsent": <scalars it was handed
        and did not log, those after its failure included>, "ended": <the status the run was
        ended with in this session: "failed" for one ended after the failure; null: not ended
        (left open, when the tracker started it)>}``. A tracker that worked has no ``runs``.
        """
        with self._cond:
            out = {s["name"]: dict(self._failures.get(s["name"], {"status": "ok"})) for s in self.specs}
        for tname, entry in out.items():
            if entry["status"] != "ok" and tname in self.trackers:
                entry["runs"] = self._runs_of(tname, None if key is None else [key, ""])
        return out

    def _runs_of(self, tracker: str, keys: list[str] | None) -> dict[str, dict[str, Any]]:
        """``summary()``'s ``runs`` of ``tracker``: ``keys``, or (``None``) every run it was
        handed scalars for or started in this session."""
        with self._lock:
            if keys is None:
                keys = sorted({k for t, k in (*self._values, *self._opened) if t == tracker},
                              key=lambda k: (k == "", k))   # the experiment's last
            saved = self.state["runs"].get(tracker, {})
            out = {}
            for k in keys:
                handed, sent = self._values.get((tracker, k), [0, 0])
                out[k or "(experiment)"] = {"run": (saved.get(k) or {}).get("run"), "values_sent": sent,
                                            "values_unsent": handed - sent, "ended": self._ended.get((tracker, k))}
            return out

    def _tell(self, key: str, label: str = "") -> None:
        """Log, from the calling thread (so that the ``log.txt`` open there has it), each
        tracker failure not said yet: for run ``key`` (its ``label`` names it), or with ``key``
        ``""`` the experiment's, each one no run has said."""
        with self._cond:
            news = [(n, f) for n, f in self._failures.items() if (n, key) not in self._told
                    and (key or not any(t == n for t, _ in self._told))]
            self._told.update((n, key) for n, _ in news)
        for tname, f in news:
            who, what = (f"medfl [{label or key}]", "this run") if key else ("medfl", "the experiment")
            logger.warning(f"{who}: warning: tracker {tname!r} failed ({f['step']}, {f['call']}: {f['error']}); "
                           f"{what} goes on without it (its results are in the run directory as always)")

    # ------------------------------------------------------------------ runs
    def start(self) -> None:
        """Start (or continue) the experiment's own run, the parent of every method run."""
        self._start("", self.root.name, flatten_params(self.params), parent=False)

    def _start(self, key: str, name: str, params: dict[str, str], parent: bool) -> None:
        if key in self._started:
            return
        self._started.add(key)
        for tname in self.trackers:
            entry = self._entry(tname, key)

            def start(t: Tracker, _e: dict[str, Any] = entry, _n: str = tname) -> None:
                up = self.state["runs"][_n].get("", {}).get("run") if parent else None
                last = max([0, *(int(v) for v in _e["logged"].values())])
                _e["run"] = t.start_run(key, name, params, up, _e["run"], last)
                with self._lock:
                    self._opened.add((_n, key))
                self._save_state()

            what = f"starting run {key!r}" if key else f"starting the experiment's run {name!r}"
            self._call(tname, "start_run", what, start)

    def watch(self, run: Any) -> Any:
        """Watch the method run ``run`` (an engine ``Run``): its per-round tables and status
        reach the trackers. Returns ``run``."""
        files: RunDir = run.files
        key = Path(run.run_dir).resolve().relative_to(self.root.resolve()).as_posix()
        files.observers.append(_RunWatch(self, run, key))
        return run

    def _status(self, watch: _RunWatch, status: str, r: int) -> None:
        key, run = watch.key, watch.run
        if status in ("running", "finished"):
            self._start(key, str(run.label), flatten_params({**self.params, "method": run.method_spec,
                                                             "rounds": run.config.get("rounds")}), parent=True)
            self._rounds(watch, r)
        if status == "running":
            self._ran.add(key)
        self._wait(block=False)
        self._tell(key, str(run.label))
        if status == "finished":
            if key not in self._ran and all(self._entry(t, key).get("status") == "finished" for t in self.trackers):
                return   # a finished run that a resume found finished (no round ran): tracked already
            self._finished(watch)
        if status in ("finished", "stopped", "failed", "interrupted"):
            if key not in self._started:   # stopped before its first round: nothing to end
                return
            for tname in self.trackers:
                self._call(tname, "end_run", f"ending run {key!r}",
                           lambda t, _s=status, _n=tname: self._end(t, _n, key, _s))
            self.drain()
            self._tell(key, str(run.label))
            self._end_left([key])
            if status == "finished":
                self._record(watch)

    def _record(self, watch: _RunWatch) -> None:
        """Add the trackers' :meth:`summary` to the finished run's ``summary.json``."""
        path = Path(watch.run.run_dir) / "summary.json"
        try:
            summary = json.loads(path.read_text())
        except (OSError, ValueError):   # no summary to add to (a run that wrote none)
            return
        if isinstance(summary, dict):
            summary["trackers"] = self.summary(watch.key)
            watch.run.files.write_json("summary.json", summary)
            self._recorded[watch.key] = watch

    def _end(self, tracker: Tracker, tname: str, key: str, status: str) -> None:
        tracker.end_run(key, status)
        with self._lock:
            self._entry(tname, key)["status"] = status
            self._ended[(tname, key)] = status
        self._save_state()

    def _end_left(self, keys: list[str] | None) -> None:
        """One attempt, per failed tracker, to end as ``"failed"`` the runs it started in this
        session and left open (``keys``: those runs only; ``None``: all of them, the
        experiment's last), each tracker in a thread of its own (its own may still be stuck
        in a call), waited for at most :attr:`wait_s` in all. Nothing is tried for a tracker
        whose last attempt has not returned; with ``keys``, nor for one whose last attempt
        failed (the experiment's end tries once more). No call is made while every tracker
        works."""
        threads = []
        for tname in sorted(self.failed & set(self.trackers)):
            last = self._mending.get(tname)
            if (last is not None and last.is_alive()) or (keys is not None and tname in self._unreachable):
                continue
            with self._lock:
                todo = sorted((k for t, k in self._opened if t == tname and (t, k) not in self._ended
                               and (keys is None or k in keys)), key=lambda k: (k == "", k))
            if todo:
                thread = threading.Thread(target=self._mend, args=(tname, todo), daemon=True,
                                          name=f"medfl-tracking-{tname}-end")
                self._mending[tname] = thread
                thread.start()
                threads.append(thread)
        deadline = time.monotonic() + self.wait_s
        for thread in threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def _mend(self, tname: str, keys: list[str]) -> None:
        """End the runs ``keys`` of the failed tracker ``tname`` as ``"failed"``, in order; the
        first that fails (its server still down) stops the attempt."""
        for key in keys:
            try:
                self.trackers[tname].end_run(key, "failed")
            except Exception as exc:  # noqa: BLE001 - still unreachable: said at the session's end
                with self._lock:
                    self._unreachable[tname] = short_error(exc)
                return
            with self._lock:
                self._ended[(tname, key)] = "failed"
                self._entry(tname, key)["status"] = "failed"
                self._unreachable.pop(tname, None)
            self._save_state()

    def _rounds(self, watch: _RunWatch, r: int) -> None:
        """Hand the trackers the rows of the rounds up to ``r`` that they have not logged."""
        for tname in self.trackers:
            logged = self._entry(tname, watch.key)["logged"]
            with self._lock:
                queued = self._queued.setdefault((tname, watch.key), {k: int(v) for k, v in logged.items()})
            per_round: dict[int, dict[str, float]] = {}
            done: dict[str, int] = {}
            for table, df in watch.latest.items():
                if df.empty or "round" not in df:
                    continue
                after = int(queued.get(table, 0))
                new = df[(df["round"] > after) & (df["round"] <= r)]
                for rr, scalars in round_scalars(table, new, self.trackers[tname].per_client).items():
                    per_round.setdefault(rr, {}).update(scalars)
                done[table] = max(after, r)

            def log(t: Tracker, _p: dict[int, dict[str, float]] = per_round, _d: dict[str, int] = done,
                    _l: dict[str, Any] = logged, _n: str = tname) -> None:
                for rr in sorted(_p):
                    t.log_metrics(watch.key, _p[rr], rr)
                    self._count(_n, watch.key, sent=len(_p[rr]))
                with self._lock:
                    _l.update(_d)
                self._save_state()

            queued.update(done)
            # a failed tracker's rounds are counted (summary.json's values_unsent), not queued
            self._count(tname, watch.key, handed=sum(len(v) for v in per_round.values()))
            if (per_round or done) and tname not in self.failed:
                self._call(tname, "log_metrics", f"logging round {r} of {watch.key!r}", log)

    def _finished(self, watch: _RunWatch) -> None:
        """A finished run's summary, plots and final models, and its headline figures for the
        experiment's run."""
        run_dir = Path(watch.run.run_dir)
        files = [run_dir / "summary.json", *sorted((run_dir / "plots").glob("*.png"))]
        try:
            summary = json.loads((run_dir / "summary.json").read_text())
        except (OSError, ValueError):   # a run that wrote no summary: no figures
            summary = {}
        figures, step = headline_figures(watch.key, summary if isinstance(summary, dict) else {})
        models: dict[str, Any] = {}
        if self.final_models is not None and set(self.trackers) - self.failed:
            try:
                models = self.final_models(watch.run)
            except Exception as exc:  # noqa: BLE001 - the models are extra; the run is finished
                warnings.warn(f"medfl: the final models of {watch.key!r} are not tracked ({type(exc).__name__}: "
                              f"{exc})", TrackerWarning, stacklevel=1)
        for tname in self.trackers:
            if figures:
                def summarise(t: Tracker, _n: str = tname) -> None:
                    t.log_summary(watch.key, figures, step)
                    self._count(_n, "", sent=len(figures))

                self._count(tname, "", handed=len(figures))
                self._call(tname, "log_summary", f"logging the headline figures of {watch.key!r}", summarise)
            for path in files:
                if path.is_file():
                    where = "plots" if path.parent.name == "plots" else None
                    self._call(tname, "log_artifact", f"logging {path.name}",
                               lambda t, _p=path, _w=where: t.log_artifact(watch.key, _p, _w))
            for mname, (model, example) in models.items():
                self._call(tname, "log_model", f"logging model {mname!r}",
                           lambda t, _n=mname, _m=model, _x=example: t.log_model(watch.key, _n, _m, _x))

    def finish(self, status: str, result: dict[str, Any] | None = None) -> None:
        """End the experiment's run: its own files (comparison, CV and seeds reports) as
        artifacts when ``status`` is ``"finished"``, then close every tracker. Waits for the
        trackers as :meth:`drain` does (a tracker that does not answer: at most :attr:`wait_s`),
        then logs the failures no run has said, in the calling thread's ``log.txt``."""
        if "" in self._started:
            if status == "finished":
                for path in _experiment_files(self.root):
                    rel = path.parent.relative_to(self.root).as_posix()
                    for tname in self.trackers:
                        self._call(tname, "log_artifact", f"logging {path.name}",
                                   lambda t, _p=path, _r=rel: t.log_artifact("", _p, None if _r == "." else _r))
            for tname in self.trackers:
                self._call(tname, "end_run", "ending the experiment's run",
                           lambda t, _n=tname: self._end(t, _n, "", status))
        for tname in self.trackers:
            self._call(tname, "close", "closing", lambda t: t.close())
        for worker in self._workers.values():
            worker.jobs.put(None)
        self._wait()
        for worker in self._workers.values():   # each one not abandoned is past its last call
            if worker.thread is not None and worker.name not in self.failed:
                worker.thread.join(timeout=self.wait_s)
        self._end_left(None)
        self._tell("")
        if self.failed & set(self.trackers):
            for watch in list(self._recorded.values()):   # how the failed trackers' runs ended
                self._record(watch)
            self._tell_left()
        with self._lock:
            self._closed = True

    def _tell_left(self) -> None:
        """Log one line per failed tracker that lost scalars or started runs: how many scalars it
        did not log, how many runs were ended as failed, and those left open (their ids), which
        its server did not let medfl end."""
        for tname in sorted(self.failed & set(self.trackers)):
            runs = self._runs_of(tname, None)
            unsent = sum(r["values_unsent"] for r in runs.values())
            handed = unsent + sum(r["values_sent"] for r in runs.values())
            ended = [k for k, r in runs.items() if r["ended"] == "failed"]
            with self._lock:
                still = {k or "(experiment)" for t, k in self._opened if t == tname and (t, k) not in self._ended}
            left = [(k, r["run"]) for k, r in runs.items() if k in still]
            if not (unsent or ended or left):   # nothing lost, nothing to end: its failure was said
                continue
            text = (f"medfl: warning: tracker {tname!r} did not log {unsent} of the {handed} values it was handed "
                    "(all are in the run directories)")
            if ended:
                text += f"; it ended {len(ended)} run(s) as failed"
            if left:
                mending = self._mending.get(tname)
                why = f"no answer within {self.wait_s:g} s" if mending is not None and mending.is_alive() else \
                    self._unreachable.get(tname, "not tried")
                names = ", ".join(f"{k!r} run_id {r['run_id']}" if isinstance(r, dict) and "run_id" in r
                                  else f"{k!r} {json.dumps(r)}" for k, r in left)
                text += f"; runs left open (ending them as failed did not work: {why}): {names}"
            logger.warning(text)


def _experiment_files(root: Path) -> Iterable[Path]:
    """The experiment's own result files: at its top and in each fold or seed directory (not
    the method runs', which their own runs hold)."""
    skip = {TRACKING_FILE, "partition.csv"}
    dirs = [root, *sorted(d for d in root.iterdir() if d.is_dir() and (d.name.startswith(("fold_", "seed_"))))]
    for d in dirs:
        for path in sorted(d.iterdir()):
            if path.is_file() and path.suffix in (".csv", ".png", ".json", ".md") and path.name not in skip \
                    and not path.name.endswith(".sha256"):
                yield path


def run_status(status: str) -> str:
    """MLflow's word for a medfl run status."""
    return {"finished": "FINISHED", "failed": "FAILED"}.get(status, "KILLED")


def now_ms() -> int:
    """The time now in milliseconds (MLflow's timestamps)."""
    return int(time.time() * 1000)
