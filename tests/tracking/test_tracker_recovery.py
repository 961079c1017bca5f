"""A tracking server that dies mid-run (issue 64, item 5): the MLflow runs medfl opened are
ended as FAILED once the server answers again (at the method run's end, else at the
experiment's), ``summary.json`` counts the values the tracker did not log, and when the server
never comes back one warning line names the count and the run ids left open.

The server is a real ``mlflow server`` (SQLite store), started once for this module (it takes
a minute on a loaded machine); medfl reaches it through :class:`Plug`, a relay on a port of its
own, so that the server can die and come back at the same address without a restart: pulling
the plug drops every connection and refuses new ones, as a dead server does. A plugin's
``on_round_end`` pulls it after round 1 (once round 1 is logged) and, in the first test, puts
it back after round 2 (once round 2's call has failed): no step depends on how long anything
takes."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from medfl import hookimpl
from medfl.experiment import run_experiment
from medfl.plugins import get_plugin_manager
from medfl.tracking import WAIT_ENV, headline_figures, round_scalars
from medfl.tracking_feed import _RunWatch

pytest.importorskip("mlflow", reason="mlflow is not installed: pip install \"medfl[tracking]\"")

from mlflow.tracking import MlflowClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real ``mlflow server`` on loopback: SQLite backend and artifacts in a temporary folder."""
    folder = tmp_path_factory.mktemp("mlflow_server")
    port = _free_port()
    with open(folder / "mlflow_server.log", "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
             "--backend-store-uri", f"sqlite:///{folder / 'server.db'}",
             "--artifacts-destination", str(folder / "server_artifacts")],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 300   # generous: the machine may be loaded
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mlflow server did not start: {(folder / 'mlflow_server.log').read_text()[-2000:]}")
            time.sleep(0.5)
        yield port
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(timeout=120)


class Plug:
    """A TCP relay from a loopback port of its own to the server's: :meth:`pull` closes it
    and every connection through it (clients then see their connections dropped and new ones
    refused, as when the server dies); :meth:`put` listens on the same port again."""

    def __init__(self, target: int) -> None:
        self.target = target
        self.port = _free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self._lock = threading.Lock()
        self._conns: list[socket.socket] = []
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None

    def put(self) -> None:
        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, args=(listener,), daemon=True)
        self._acceptor.start()

    def pull(self) -> None:
        if self._listener is None:
            return
        listener, self._listener = self._listener, None
        try:
            listener.shutdown(socket.SHUT_RDWR)   # wakes the blocked accept()
        except OSError:
            pass
        listener.close()
        assert self._acceptor is not None
        self._acceptor.join(60)
        assert not self._acceptor.is_alive()
        with self._lock:
            conns, self._conns = self._conns, []
        for conn in conns:
            _close(conn)

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:   # pulled
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=60)
                upstream.settimeout(None)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _close(conn: socket.socket) -> None:
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    conn.close()


def _pump(a: socket.socket, b: socket.socket) -> None:
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    _close(a)
    _close(b)


class ServerDies:
    """Pulls the plug after round 1, once the tracker has logged it; after round 2, once the
    tracker's call for it has failed, notes the failed trackers and, with ``comes_back``, puts
    the plug back."""

    def __init__(self, plug: Plug, comes_back: bool) -> None:
        self.plug, self.comes_back = plug, comes_back
        self.watch: _RunWatch | None = None
        self.failed_after_round_1: set[str] | None = None
        self.failed_after_round_2: set[str] | None = None

    @hookimpl
    def on_round_end(self, run: Any, round: int, metrics: Any) -> None:
        watch = next(o for o in run.files.observers if isinstance(o, _RunWatch))
        self.watch = watch
        if round == 1:
            watch.tracking.drain()   # round 1's call made: it is in the store
            self.failed_after_round_1 = set(watch.tracking.failed)
            self.plug.pull()
        elif round == 2:
            watch.tracking.drain()   # round 2's call made, against a dead server
            self.failed_after_round_2 = set(watch.tracking.failed)
            if self.comes_back:
                self.plug.put()


@pytest.fixture
def plug(mlflow_server, monkeypatch):
    """The server behind a :class:`Plug` (pulled at the end); MLflow's HTTP settings left to
    medfl's bounds, and a generous wait bound so that a slow machine decides nothing."""
    from medfl_plugins.trackers import MLFLOW_HTTP_DEFAULTS

    for key in (*MLFLOW_HTTP_DEFAULTS, "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv(WAIT_ENV, "120")
    relay = Plug(mlflow_server)
    relay.put()
    try:
        yield relay
    finally:
        relay.pull()


def _run(tiny_fl: dict[str, Any], resolve: Any, plug: Plug, experiment: str, rounds: int,
         comes_back: bool) -> tuple[Path, ServerDies]:
    hook = ServerDies(plug, comes_back)
    pm = get_plugin_manager()
    pm.register(hook, name="test-server-dies")
    try:
        cfg = resolve({**tiny_fl, "rounds": rounds,
                       "tracking": [{"name": "mlflow", "uri": plug.uri, "experiment": experiment}]})
        out = run_experiment(cfg)
    finally:
        pm.unregister(name="test-server-dies")
    assert out["summaries"]["fedavg"]["rounds"] == rounds   # the run never stops for its tracker
    assert hook.failed_after_round_1 == set() and hook.failed_after_round_2 == {"mlflow"}
    return Path(out["dir"]), hook


def _runs(client: MlflowClient, experiment: str) -> tuple[Any, Any]:
    """The experiment's run and fedavg's run of the MLflow experiment ``experiment``."""
    exp = client.get_experiment_by_name(experiment)
    runs = {r.info.run_name: r for r in client.search_runs([exp.experiment_id])}
    child = runs.pop("fedavg")
    (parent,) = runs.values()
    assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
    return parent, child


def _stored(client: MlflowClient, run: Any) -> int:
    """How many metric values the store has for ``run`` (every step of every key)."""
    return sum(len(client.get_metric_history(run.info.run_id, key)) for key in run.data.metrics)


def _handed(hook: ServerDies) -> int:
    """The scalars of every round of the run's per-round tables (the mlflow tracker's default:
    the across-client means), recomputed from the frames the tracker watched."""
    assert hook.watch is not None
    return sum(len(v) for table, df in hook.watch.latest.items() if "round" in df
               for v in round_scalars(table, df[df["round"] >= 1], per_client=False).values())


def _check_counts(exp: Path, hook: ServerDies, client: MlflowClient, parent: Any, child: Any) -> dict[str, Any]:
    """summary.json's runs of the failed tracker: the ids, and as not logged exactly what the
    tracker was handed less what the store has (round 1 of the method run; nothing of the
    experiment's headline figures)."""
    summary = json.loads((exp / "fedavg" / "summary.json").read_text())
    block = summary["trackers"]["mlflow"]
    assert block["status"] == "failed" and block["step"] == "log_metrics", block
    runs = block["runs"]
    assert set(runs) == {"fedavg", "(experiment)"}
    mine, top = runs["fedavg"], runs["(experiment)"]
    assert mine["run"]["run_id"] == child.info.run_id and top["run"]["run_id"] == parent.info.run_id
    assert {m.step for key in child.data.metrics for m in client.get_metric_history(child.info.run_id, key)} == {1}
    stored = _stored(client, child)
    assert mine["values_sent"] == stored > 0
    assert mine["values_unsent"] == _handed(hook) - stored > 0
    figures, _ = headline_figures("fedavg", summary)
    assert top["values_sent"] == _stored(client, parent) == 0 and top["values_unsent"] == len(figures) > 0
    return runs


def _said(exp: Path) -> list[str]:
    """The experiment log's lines on what the mlflow tracker did not log."""
    return [line for line in (exp / "log.txt").read_text().splitlines() if "tracker 'mlflow' did not log" in line]


def test_runs_are_ended_failed_when_the_server_comes_back(tiny_fl, resolve, plug, mlflow_server):
    """Gone after round 1 and back after round 2: both MLflow runs end FAILED (not RUNNING for
    ever), summary.json says so and counts what was not logged, tracking.json records it."""
    exp, hook = _run(tiny_fl, resolve, plug, "back", rounds=3, comes_back=True)
    client = MlflowClient(tracking_uri=f"http://127.0.0.1:{mlflow_server}")
    parent, child = _runs(client, "back")
    assert parent.info.status == "FAILED" and child.info.status == "FAILED"
    runs = _check_counts(exp, hook, client, parent, child)
    assert runs["fedavg"]["ended"] == "failed" and runs["(experiment)"]["ended"] == "failed"
    state = json.loads((exp / "tracking.json").read_text())["runs"]["mlflow"]
    assert state["fedavg"]["status"] == "failed" and state[""]["status"] == "failed"
    said = _said(exp)
    assert len(said) == 1 and "ended 2 run(s) as failed" in said[0] and "left open" not in said[0], said


def test_a_server_that_never_comes_back_is_named_with_the_runs_left_open(tiny_fl, resolve, plug, mlflow_server):
    """Gone after round 1 for good: the run finishes, its runs stay RUNNING (nothing can end
    them), summary.json counts what was not logged, and one warning line at the end gives that
    count and the run ids left open."""
    t0 = time.monotonic()
    exp, hook = _run(tiny_fl, resolve, plug, "gone", rounds=2, comes_back=False)
    assert time.monotonic() - t0 < 300   # generous; a refused call fails in about 3 s
    client = MlflowClient(tracking_uri=f"http://127.0.0.1:{mlflow_server}")   # the store, past the plug
    parent, child = _runs(client, "gone")
    assert parent.info.status == "RUNNING" and child.info.status == "RUNNING"
    runs = _check_counts(exp, hook, client, parent, child)
    assert runs["fedavg"]["ended"] is None and runs["(experiment)"]["ended"] is None
    unsent = runs["fedavg"]["values_unsent"] + runs["(experiment)"]["values_unsent"]
    said = _said(exp)
    assert len(said) == 1, said
    assert f"did not log {unsent} of the " in said[0] and "Connection refused" in said[0], said
    assert f"'fedavg' run_id {child.info.run_id}" in said[0], said
    assert f"'(experiment)' run_id {parent.info.run_id}" in said[0], said
