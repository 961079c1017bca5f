"""Experiment tracking at work: :class:`Tracking` builds the trackers of ``fl.tracking``,
watches each method run's :class:`medfl.rundir.RunDir` (its per-round tables and each
``status.json``) and hands each finished round's scalars to the trackers; at the end of a run
its ``summary.json``, plots, final models and headline figures, at the end of the experiment
its own files (``comparison.csv``, the CV and seeds reports and their plots).

Nothing here is on a run's critical path: each tracker is called in order from a background
thread of its own (the round's rows are turned into scalars in the run's thread, which then
goes on), and the queues are drained when a run ends. A tracker that raises, or whose call has
not returned :data:`medfl.tracking.TRACKER_WAIT_S` after it began, is left out for the rest of
the session; which one failed, in which call and why is logged (``medfl.tracking``) from the
run's own thread, so its ``log.txt`` has it, and each finished run's ``summary.json`` gets a
``trackers`` block (:meth:`Tracking.summary`). At the end of each method run and of the
experiment, a failed tracker's runs still open are ended once more as ``"failed"`` from a
thread of its own, waiting at most that bound; no call is added while every tracker works.
docs/plugins.md ("Trackers") says all this to a tracker's author.

``tracking.json`` in the experiment directory (written atomically) records each tracker's
runs (MLflow's run ids) and the last round each run logged from each table, so that a resumed
experiment continues the same runs and never logs a round twice.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import pandas as pd

from medfl.config import ConfigError
from medfl.integrity import write_json
from medfl.plugins import lookup
from medfl.rundir import RunDir
from medfl.tracking import (WAIT_ENV, Tracker, TrackerWarning, flatten_params, headline_figures, round_scalars,
                            short_error, tracker_wait_s)

__all__ = ["Tracking", "TRACKING_FILE"]

#: what goes wrong is logged as ``medfl.tracking``, the logger docs/plugins.md names
logger = logging.getLogger("medfl.tracking")

#: The experiment directory's file that records the trackers' runs and what each logged.
TRACKING_FILE = "tracking.json"


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
        summary = _summary(Path(watch.run.run_dir))
        if summary is not None:   # None: no summary to add to (a run that wrote none)
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
        figures, step = headline_figures(watch.key, _summary(run_dir) or {})   # no summary: no figures
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

    def finish(self, status: str) -> None:
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


def _summary(run_dir: Path) -> dict[str, Any] | None:
    """A run's ``summary.json`` (``None``: there is none, or it is not a JSON object)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


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
