"""medfl on Flower's simulation runtime (``fl.backend: ray``): the deployment's ServerApp
and ClientApp code with the clients in parallel Ray actors must give the in-process
engine's numbers for the same seed, resume like it, and refuse what cannot work.

Each run starts Ray (a few seconds); the jobs are the tiny ones of the Flower tests.
"""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from medfl.config import ConfigError, resolve_config
from medfl.engine.runner import RunError
from medfl.experiment import resume, run_experiment
from medfl.flower import simulation

from flower_cases import FEDBN, fl_config, numeric_equal, wait_until_empty, write_config

ray = pytest.importorskip("ray", reason="the simulation runtime needs Ray: pip install -e '.[test]' installs it")

# a stateless method with a DP filter (noise drawn at the sites) and a stateful one; cross_test
# under DP sends the models in the clear, so the job opts in (its runs say they are not private).
# Two rounds: a resume needs a stop after round 1 of 2, and round 2 carries the sites' state
JOB: dict[str, Any] = {"rounds": 2, "model": {"name": "small_cnn", "width": 4},
                       "train": {"batch_size": 8, "lr": 0.05}, "eval_splits": ["test", "global_test", "cross_test"],
                       "cross_test": {"under_dp": "send_models"},
                       "methods": [{"name": "fedavg", "filters": [{"name": "dp_gaussian", "epsilon": 50.0,
                                                                    "clip": 5.0}]},
                                   {"name": "fedbn"}]}
RAY = {"name": "ray", "client_cpus": 1, "num_cpus": 2}


def _compare(sim: Path, ref: Path, label: str) -> None:
    for f in ("metrics.csv", "train_metrics.csv", "cross_test.csv", "privacy.csv"):
        if (ref / label / f).is_file():
            numeric_equal(pd.read_csv(ref / label / f), pd.read_csv(sim / label / f), f"{label} {f}", atol=0)


@pytest.fixture
def one_thread():
    """torch on one thread, as each simulated client (``client_cpus`` 1): the same float
    sums in the same order, so the numbers can be compared exactly."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_simulation_runtime_matches_in_process_and_resumes(tmp_path: Path, one_thread: None) -> None:
    ref = run_experiment(resolve_config(fl_config(tmp_path, "ref", JOB)))
    term = signal.getsignal(signal.SIGTERM)
    sim = run_experiment(resolve_config({**fl_config(tmp_path, "sim", JOB), "backend": RAY}))
    # ray.init's SIGTERM handler is not left in this process (a later fork inherited it)
    assert signal.getsignal(signal.SIGTERM) is term
    ref_dir, sim_dir = Path(ref["dir"]), Path(sim["dir"])
    assert json.loads((sim_dir / "config.json").read_text())["engine"] == "simulation"
    for label in ("fedavg", "fedbn"):
        _compare(sim_dir, ref_dir, label)
        events = pd.read_csv(sim_dir / label / "flower_events.csv")
        assert (events[events["phase"] == "train"]["status"] == "ok").sum() == JOB["rounds"] * 3   # x clients
        # the client state stays at the (simulated) sites, as in a deployment
        assert not list((sim_dir / label / "clients").rglob("state_r*.pt"))
    run_id = json.loads((sim_dir / "fedbn" / "flower.json").read_text())["run_id"]
    assert list((tmp_path / "runs" / simulation.STATE_FOLDER / run_id).rglob("state_r*.pt"))
    privacy = pd.read_csv(sim_dir / "fedavg" / "privacy.csv")
    assert len(privacy) and (privacy["epsilon"] > 0).all()
    static = json.loads((sim_dir / "fedavg" / "config.json").read_text())
    assert "simulation runtime" in static["privacy"]["noise_seeds"]

    # stopped after round 1, continued with `medfl resume`: the uninterrupted run's numbers
    stopped = run_experiment(resolve_config({**fl_config(tmp_path, "stop", JOB), "backend": RAY,
                                             "stop_after_round": 1}))
    status = json.loads((Path(stopped["dir"]) / "fedbn" / "status.json").read_text())
    assert status["last_round"] == 1
    resumed = resume(stopped["dir"])
    for label in ("fedavg", "fedbn"):
        _compare(Path(resumed["dir"]), ref_dir, label)


def test_early_stopping_on_the_simulation_runtime_matches_in_process(tmp_path: Path, one_thread: None) -> None:
    """Early stopping decides in the coordinator (``Run``), whatever delivers the messages:
    the same best round, stop round and final metrics on Ray as in process. Patience 1: the
    run stops at round 2 of 4, its best round 1 (this seed's val/micro_f1 falls in round 2)."""
    job = {**FEDBN, "rounds": 4, "eval_every": 1, "eval_splits": ["val", "test", "global_test"],
           "early_stopping": {"metric": "val/micro_f1", "patience": 1}}
    ref = Path(run_experiment(resolve_config(fl_config(tmp_path, "ref", job)))["dir"])
    sim = Path(run_experiment(resolve_config({**fl_config(tmp_path, "sim", job), "backend": RAY}))["dir"])
    a, b = (json.loads((d / "fedbn" / "summary.json").read_text()) for d in (ref, sim))
    assert a["early_stopping"]["stopped_at_round"] is not None
    for block in ("early_stopping", "final", "last_round", "rounds"):
        assert json.dumps(a[block], sort_keys=True) == json.dumps(b[block], sort_keys=True), block
    _compare(sim, ref, "fedbn")


def test_cli_backend_option_runs_on_the_simulation_runtime_and_ctrl_c_stops_it(tmp_path: Path) -> None:
    """`medfl run CONFIG --backend ray` as a user runs it (a process of its own), stopped with
    Ctrl-C once a round is saved: the coordinator runs in Flower's ServerApp thread while
    Ctrl-C reaches the main thread, which must stop it, not leave it waiting for clients whose
    actors Ctrl-C ended. It exits 130 within seconds (Flower's runtime ends once the clients
    answered their current message), status.json says "interrupted" and the message says how to
    resume; the option keeps the config's backend resources."""
    import signal
    import subprocess
    import sys
    import time

    fl = fl_config(tmp_path, "cli", {**JOB, "rounds": 200, "methods": [{"name": "fedavg"}],
                                     "eval_splits": ["test"],
                                     "backend": {"name": "inprocess", "client_cpus": 1, "num_cpus": 2}})
    cfg = write_config(tmp_path / "train.json", fl)
    status = tmp_path / "runs" / "cli" / "fedavg" / "status.json"
    # output to files, not pipes: Ray's daemons inherit them and may outlive medfl for a while
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "medfl.cli", "run", str(cfg), "--backend", "ray"],
                                stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 900   # a condition, with a generous limit (loaded machine)
        while time.monotonic() < deadline and proc.poll() is None:
            if status.is_file() and json.loads(status.read_text() or "{}").get("last_round", 0) >= 1:
                break
            time.sleep(0.1)
        assert proc.poll() is None, log.read_text()[-3000:]
        proc.send_signal(signal.SIGINT)
        # before the fix the coordinator waited for replies for round_timeout (600 s); now it
        # saves at its next poll and Flower's runtime stops once the clients answered
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    err = log.read_text()
    assert proc.returncode == 130, err[-3000:]
    saved = json.loads(status.read_text())
    assert saved["status"] == "interrupted" and 1 <= saved["last_round"] < 200
    assert "interrupted" in err and f"continue with: medfl resume {tmp_path / 'runs' / 'cli'}" in err
    assert "Traceback" not in err and "Ctrl-C again to stop at once" in err, err[-3000:]
    config = json.loads((tmp_path / "runs" / "cli" / "config.json").read_text())
    assert config["engine"] == "simulation"
    assert config["fl"]["backend"] == {"name": "ray", "client_cpus": 1, "client_gpus": 0.0, "num_cpus": 2,
                                       "num_gpus": None, "connect_timeout": 600.0}   # the config's resources kept


@pytest.mark.parametrize("backend, message", [
    ("threads", "expected one of 'inprocess', 'ray'"),
    ({"name": "ray", "cpus": 1}, "unknown key(s) 'cpus'"),
    ({"name": "ray", "client_cpus": 0}, "client_cpus: expected a whole number of cores >= 1"),
    ({"name": "ray", "client_gpus": -1}, "client_gpus: expected a non-negative number"),
    ({"name": "ray", "num_cpus": "all"}, "num_cpus: expected a non-negative number"),
    ({"name": "ray", "connect_timeout": 0}, "connect_timeout: expected the seconds every simulated node has"),
    ({"name": "ray", "connect_timeout": "1h"}, "connect_timeout: expected the seconds every simulated node has"),
])
def test_bad_backend_entries_are_refused(tmp_path: Path, backend: Any, message: str) -> None:
    with pytest.raises(ConfigError, match="fl.backend") as err:
        resolve_config({**fl_config(tmp_path, "bad", JOB), "backend": backend})
    assert message in str(err.value)


def _simulate(cfg: dict[str, Any]) -> Any:
    """The experiment of ``cfg`` in the simulation runtime's runs, as the ``ray`` backend runs it."""
    with simulation.simulated_runs(cfg) as factory:
        return run_experiment(cfg, run_factory=factory, meta={"engine": "simulation"})


def test_simulation_refuses_what_cannot_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = resolve_config({**fl_config(tmp_path, "x", JOB), "backend": RAY, "device": "cuda"})
    with pytest.raises(RunError, match="client_gpus is 0"):
        _simulate(cfg)
    monkeypatch.setattr(simulation.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RunError, match=r'pip install "medfl\[simulation\]"'):
        cfg = resolve_config({**fl_config(tmp_path, "y", JOB), "backend": RAY})
        _simulate(cfg)
    assert not (tmp_path / "runs" / "y").exists()


def test_a_simulated_site_that_cannot_serve_stops_the_run_with_its_reason(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every simulated node exists from the start: when one cannot serve its client (here
    node 2 is told to serve client 7, which the partition lacks) the run stops as soon as
    every node has answered, quoting the refusal, instead of waiting for a node to come."""
    monkeypatch.setattr(simulation, "_client_ids", lambda cfg: ["0", "1", "7"])
    cfg = resolve_config({**fl_config(tmp_path, "missing", {**JOB, "rounds": 1, "methods": [{"name": "fedavg"}]}),
                          "backend": {**RAY, "connect_timeout": 900}})
    with pytest.raises(RunError, match=r"no SuperNode serves client\(s\) \['2'\]") as caught:
        _simulate(cfg)
    no_ray_left()
    message = str(caught.value)
    # the site's own words, without Ray's traceback around them
    assert re.search(r"refused node \d+ failed to answer medfl's hello: medfl site: client id '7' is not in "
                     r"this config's partition \(clients \['0', '1', '2'\]\); check client-id and num_clients; "
                     r"every simulated node serves", message), message
    assert "ray::" not in message and "Traceback" not in message


def no_ray_left() -> None:
    """Ray is shut down in this process and no Ray process (an actor, a daemon) it started is left."""
    from local_federation import descendants

    assert not ray.is_initialized(), "Ray still runs after the simulation ended"

    def running() -> list[str]:
        left = []
        for pid in descendants(os.getpid()):
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except (OSError, IndexError):
                continue
            if state not in ("Z", "X"):   # a process that has exited, not yet reaped, runs nothing
                left.append(f"{pid} ({state}): {cmd[:120]}")
        return left

    left = wait_until_empty(running, 120.0)   # a Ray process told to stop may take a moment to exit
    assert not left, f"Ray processes left running: {left}"


def test_the_simulated_hello_wait_is_the_backend_connect_timeout(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """Every simulated node's actor must start (torch, the dataset) before it answers its hello,
    which a loaded machine slows down: the coordinator waits ``fl.backend.connect_timeout``
    seconds (default 600) for it (before: a fixed 120 s, and the key was refused)."""
    assert resolve_config({**fl_config(tmp_path, "d", JOB), "backend": RAY})["backend"]["connect_timeout"] == 600.0
    cfg = resolve_config({**fl_config(tmp_path, "w", JOB), "backend": {**RAY, "connect_timeout": 1800}})
    # the run the simulation builds gets the config's wait (RemoteRun caught: no Ray needed)
    monkeypatch.setattr(simulation, "RemoteRun", lambda cfg, spec, run_dir, data, transport, settings: settings)
    settings = simulation._factory(grid=None)(cfg, {"name": "fedavg"}, tmp_path / "run", None)
    assert settings.connect_timeout == 1800.0
