"""A tracker whose server is down costs seconds, not minutes (issue 50, item 5): the run's wait
for a tracker call is bounded (``medfl.tracking.TRACKER_WAIT_S``), a tracker that failed or
was abandoned is skipped from then on, MLflow's own HTTP retries are bounded for a medfl run
(an environment variable the user set wins), and which tracker failed, where and why is in the
run's ``log.txt`` and ``summary.json``."""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from medfl import hookimpl
from medfl.config import ConfigError
from medfl.plugins import get_plugin_manager
from medfl.tracking import TRACKER_WAIT_S, WAIT_ENV, Tracker, short_error, tracker_wait_s
from medfl.tracking_feed import Tracking


class Stuck(Tracker):
    """Never answers its first call (a server that accepts and says nothing) until released."""

    name = "stuck"
    entered = threading.Event()
    release = threading.Event()
    calls: list[str] = []

    def start_run(self, key, name, params, parent, saved, last_step):
        self.calls.append("start_run")
        self.entered.set()
        self.release.wait(60)   # the test releases it; 60 s only so that a broken test cannot hang
        return {"late": True}

    def end_run(self, key, status):
        self.calls.append("end_run")

    def close(self):
        self.calls.append("close")


class Refused(Tracker):
    """Its server refuses the connection."""

    name = "refused"
    calls: list[str] = []

    def start_run(self, key, name, params, parent, saved, last_step):
        self.calls.append("start_run")
        raise ConnectionRefusedError(111, "Connection refused")

    def end_run(self, key, status):
        self.calls.append("end_run")

    def close(self):
        self.calls.append("close")


class Fine(Tracker):
    """Answers every call at once."""

    name = "fine"
    calls: list[tuple[Any, ...]] = []

    def start_run(self, key, name, params, parent, saved, last_step):
        self.calls.append(("start_run", key))
        return {"id": key or "experiment"}

    def end_run(self, key, status):
        self.calls.append(("end_run", key, status))

    def close(self):
        self.calls.append(("close",))


class BoundPlugin:
    @hookimpl
    def register_trackers(self, register):
        register(Stuck)
        register(Refused)
        register(Fine)


@pytest.fixture
def fake_trackers():
    """Stuck, Refused and Fine registered (and their records cleared) for one test."""
    pm = get_plugin_manager()
    pm.register(BoundPlugin(), name="test-bound-trackers")
    for cls in (Stuck, Refused, Fine):
        cls.calls.clear()
    Stuck.entered.clear()
    Stuck.release.clear()
    try:
        yield
    finally:
        Stuck.release.set()
        pm.unregister(name="test-bound-trackers")


class Clock:
    """A clock that moves only when the test says."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _idle(tracking: Tracking, *names: str) -> None:
    """Wait (30 s at most) until the trackers ``names`` have made every call queued so far."""
    with tracking._cond:
        assert tracking._cond.wait_for(lambda: not any(tracking._workers[n].pending for n in names), timeout=30)


def test_a_tracker_that_never_answers_is_abandoned_at_the_deadline(tmp_path, fake_trackers, caplog):
    """finish() stops waiting for a call that has run TRACKER_WAIT_S (here on a fake clock: no
    real waiting): the hung tracker is recorded failed (TimeoutError, in start_run) and its later
    calls are never made, even once it returns; a refused one is skipped after its first call;
    the one that works gets every call, held up by neither; the log says each failure once."""
    clock = Clock()
    tracking = Tracking(tmp_path, [{"name": "stuck"}, {"name": "refused"}, {"name": "fine"}], "t", {"rounds": 1},
                        clock=clock)
    assert tracking.wait_s == TRACKER_WAIT_S
    tracking.start()
    assert Stuck.entered.wait(30), "the stuck tracker's call never began"
    _idle(tracking, "refused", "fine")   # their first calls made before the clock moves
    clock.now = TRACKER_WAIT_S + 5   # the stuck call has now run past the bound
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="medfl.tracking"):
        tracking.finish("finished")
    assert time.monotonic() - t0 < 20   # no wait for the stuck one (generous: a loaded machine)
    report = tracking.summary()
    assert report["fine"] == {"status": "ok"}
    assert report["stuck"]["status"] == "failed" and report["stuck"]["step"] == "start_run"
    assert report["stuck"]["error"].startswith(f"TimeoutError: no answer {TRACKER_WAIT_S:g} s after the call began")
    assert report["stuck"]["seconds"] == TRACKER_WAIT_S + 5
    assert report["refused"]["step"] == "start_run"
    assert report["refused"]["error"] == "ConnectionRefusedError: [Errno 111] Connection refused"
    assert tracking.failed == {"stuck", "refused"}
    assert Fine.calls == [("start_run", ""), ("end_run", "", "finished"), ("close",)]
    assert Refused.calls == ["start_run"]   # ending and closing it were skipped
    said = [r.getMessage() for r in caplog.records if r.name == "medfl.tracking"]
    assert len(said) == 2, said
    assert any("tracker 'stuck' failed (start_run" in m and "TimeoutError" in m for m in said)
    assert any("tracker 'refused' failed (start_run" in m and "Connection refused" in m for m in said)
    # released after the session: its result is not saved and none of its later calls is made
    Stuck.release.set()
    worker = tracking._workers["stuck"].thread
    assert worker is not None
    worker.join(30)
    assert not worker.is_alive() and Stuck.calls == ["start_run"]
    state = json.loads((tmp_path / "tracking.json").read_text())
    assert state["runs"]["stuck"][""]["run"] is None and state["runs"]["fine"][""]["status"] == "finished"


def test_drain_waits_for_a_call_until_its_deadline_only(tmp_path, fake_trackers):
    """drain() (a run's end) with a call still inside the bound waits; past it, gives up."""
    clock = Clock()
    tracking = Tracking(tmp_path, [{"name": "stuck"}], "t", {}, wait_s=3.0, clock=clock)
    tracking.start()
    assert Stuck.entered.wait(30)
    tracking._wait(block=False)          # what a run's round does: inside the bound, nothing happens
    assert tracking.failed == set()
    clock.now = 3.0
    tracking.drain()
    assert tracking.summary()["stuck"]["error"].startswith("TimeoutError: no answer 3 s")
    tracking.finish("finished")          # nothing left to wait for


def test_tracker_wait_env(monkeypatch):
    monkeypatch.delenv(WAIT_ENV, raising=False)
    assert tracker_wait_s() == TRACKER_WAIT_S == 10.0
    monkeypatch.setenv(WAIT_ENV, "120")
    assert tracker_wait_s() == 120.0
    for bad in ("0", "-1", "soon", "nan"):
        monkeypatch.setenv(WAIT_ENV, bad)
        with pytest.raises(ConfigError, match=WAIT_ENV):
            tracker_wait_s()


def test_short_error_keeps_the_root_cause():
    long = RuntimeError("API request to http://127.0.0.1:1/api failed " + "x" * 500 + " [Errno 111] Connection refused")
    text = short_error(long)
    assert len(text) <= 300 and text.startswith("RuntimeError: API request") and text.endswith("Connection refused")
    assert short_error(ValueError("a\n  b")) == "ValueError: a b"


def test_mlflow_http_defaults_fill_only_what_the_user_did_not_set(monkeypatch):
    """MLflow's HTTP retries are bounded while the tracker calls a server: a variable the user
    set wins, the others are set for the call and removed after."""
    from medfl_plugins.trackers import MLFLOW_HTTP_DEFAULTS, mlflow_http_defaults

    for key in MLFLOW_HTTP_DEFAULTS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")
    with mlflow_http_defaults():
        with mlflow_http_defaults():   # nested (several calls at once): one setting
            assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"
            assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == MLFLOW_HTTP_DEFAULTS["MLFLOW_HTTP_REQUEST_TIMEOUT"]
        assert os.environ["MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"] == "1"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "5"
    assert "MLFLOW_HTTP_REQUEST_TIMEOUT" not in os.environ and "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR" not in os.environ


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed): connections are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_an_unreachable_mlflow_server_costs_seconds(tiny_fl, resolve, monkeypatch):
    """An MLflow tracker pointed at a closed local port: the run finishes in seconds (MLflow's
    own retries took about 4 minutes), its summary.json and log.txt (and the experiment's)
    name the tracker, the call and the refused connection, and the environment is as it was."""
    pytest.importorskip("mlflow", reason="mlflow is not installed: pip install \"medfl[tracking]\"")
    from medfl.experiment import run_experiment
    from medfl_plugins.trackers import MLFLOW_HTTP_DEFAULTS

    for key in (*MLFLOW_HTTP_DEFAULTS, "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", WAIT_ENV):
        monkeypatch.delenv(key, raising=False)
    cfg = resolve({**tiny_fl, "tracking": [{"name": "mlflow", "uri": f"http://127.0.0.1:{_closed_port()}"}]})
    t0 = time.monotonic()
    out = run_experiment(cfg)
    wall = time.monotonic() - t0
    assert out["summaries"]["fedavg"]["rounds"] == 2
    assert wall < 60, f"the run took {wall:.0f} s"   # generous; MLflow's default retries alone: ~240 s
    exp = Path(out["dir"])
    trackers = json.loads((exp / "fedavg" / "summary.json").read_text())["trackers"]
    failed = trackers["mlflow"]
    assert failed["status"] == "failed" and failed["step"] == "start_run", failed
    assert failed["error"].startswith("MlflowException") and "Connection refused" in failed["error"], failed
    assert failed["seconds"] < TRACKER_WAIT_S + 5, failed
    for log in (exp / "fedavg" / "log.txt", exp / "log.txt"):
        said = [line for line in log.read_text().splitlines() if "tracker 'mlflow' failed" in line]
        assert len(said) == 1 and "start_run" in said[0] and "Connection refused" in said[0], (log, said)
    assert not any(key in os.environ for key in MLFLOW_HTTP_DEFAULTS)
