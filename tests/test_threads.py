"""``fl.threads`` / ``--threads``: torch's intra-op threads in each process that trains, checked
in medfl.config, ``"auto"`` sharing the cores among the processes that train at once."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from medfl.config import (LOCAL_SITES_ENV, THREADS_ENV, ConfigError, actor_threads, auto_threads, check_threads,
                          local_sites, resolve_threads, set_threads, sharing_processes, threads_setting)

GOOD = [("auto", "auto"), ("AUTO", "auto"), (1, 1), (4, 4), ("2", 2), (" 3 ", 3)]
BAD = [0, -1, 1.5, True, False, None, "many", "", "0", [2], {"n": 2}]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """No --threads, local-sites or xdist setting leaks in or out; torch's threads restored."""
    for name in (THREADS_ENV, LOCAL_SITES_ENV, "PYTEST_XDIST_WORKER_COUNT"):
        monkeypatch.delenv(name, raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(("value", "expected"), GOOD)
def test_check_threads_accepts(value: Any, expected: Any) -> None:
    assert check_threads(value) == expected


@pytest.mark.parametrize("value", BAD)
def test_check_threads_refuses_with_the_field_named(value: Any) -> None:
    with pytest.raises(ConfigError, match=r"^fl\.threads: expected a positive number of torch threads or \"auto\""):
        check_threads(value)


def test_resolve_config_checks_fl_threads(tiny_fl: dict[str, Any], resolve) -> None:
    assert resolve({**tiny_fl, "threads": "2"})["threads"] == 2
    assert resolve(tiny_fl).get("threads", "auto") == "auto"
    with pytest.raises(ConfigError, match="fl.threads: .* got 0"):
        resolve({**tiny_fl, "threads": 0})


def test_auto_divides_the_cores_among_the_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("medfl.config.threads.available_cores", lambda: 8)
    assert auto_threads() == 8 and auto_threads(2) == 4 and auto_threads(3) == 2 and auto_threads(16) == 1
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")    # each xdist worker is a process that trains
    assert sharing_processes(1) == 2 and auto_threads() == 4 and auto_threads(2) == 2
    assert auto_threads(cores=2) == 1


def test_available_cores_reads_the_affinity_mask() -> None:
    from medfl.config import available_cores

    expected = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert available_cores() == expected


def test_threads_env_wins_over_the_config(monkeypatch: pytest.MonkeyPatch) -> None:
    assert threads_setting(3) == 3 and threads_setting(None) == "auto"
    monkeypatch.setenv(THREADS_ENV, "1")
    assert threads_setting(3) == 1 and resolve_threads("auto") == 1
    monkeypatch.setenv(THREADS_ENV, "lots")
    with pytest.raises(ConfigError, match=r"MEDFL_THREADS \(--threads\): expected"):
        threads_setting(3)


def test_ray_actors_share_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    """auto: the cores Ray may use over the actors that run at once (min(clients, cores // client_cpus))."""
    monkeypatch.setattr("medfl.config.threads.available_cores", lambda: 8)
    cfg = {"backend": {"name": "ray", "client_cpus": 1, "num_cpus": None}}
    assert actor_threads(cfg, clients=4) == 2      # 4 actors on 8 cores
    assert actor_threads(cfg, clients=16) == 1     # 8 actors at once
    assert actor_threads(cfg, clients=1) == 8
    assert actor_threads({"backend": {"name": "ray", "client_cpus": 2, "num_cpus": 4}}, clients=8) == 4
    assert actor_threads({**cfg, "threads": 3}, clients=4) == 3
    monkeypatch.setenv(THREADS_ENV, "1")
    assert actor_threads({**cfg, "threads": 3}, clients=4) == 1


def test_local_sites_count(monkeypatch: pytest.MonkeyPatch) -> None:
    assert local_sites() == 1
    monkeypatch.setenv(LOCAL_SITES_ENV, "3")
    assert local_sites() == 3
    monkeypatch.setenv(LOCAL_SITES_ENV, "x")
    assert local_sites() == 1




def test_set_threads_sets_torch() -> None:
    assert set_threads(1) == 1 and torch.get_num_threads() == 1
    assert set_threads(2) == 2 and torch.get_num_threads() == 2


def test_in_process_run_trains_with_fl_threads_and_records_them(tiny_fl: dict[str, Any], resolve) -> None:
    from medfl.experiment import run_experiment

    torch.set_num_threads(2)
    result = run_experiment(resolve({**tiny_fl, "rounds": 1, "threads": 1}))
    assert torch.get_num_threads() == 1
    summary = json.loads((Path(result["dir"]) / "fedavg" / "summary.json").read_text())
    assert summary["threads"] == {"setting": 1, "torch_threads": 1}


def test_flower_site_sets_its_threads(tmp_path: Path, tiny_fl: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """A deployed site's worker trains in its own process: fl.threads or --threads there; auto
    shares the cores with the other sites medfl started on the machine."""
    from medfl.site import Site, SiteSettings

    config = tmp_path / "train.json"
    config.write_text(json.dumps({"fl": {**tiny_fl, "threads": 2}}))
    settings = SiteSettings(client_id="0", config=config, state_dir=tmp_path / "state")
    assert Site(settings).threads == 2 and torch.get_num_threads() == 2
    monkeypatch.setenv(THREADS_ENV, "1")
    assert Site(settings).threads == 1 and torch.get_num_threads() == 1
    monkeypatch.delenv(THREADS_ENV)
    # "auto": `medfl flower site` set it before (set_threads(None, local_sites())); the Site keeps it
    config.write_text(json.dumps({"fl": tiny_fl}))
    monkeypatch.setattr("medfl.config.threads.available_cores", lambda: 4)
    monkeypatch.setenv(LOCAL_SITES_ENV, "4")
    assert set_threads(None, local_sites()) == 1
    assert Site(settings).threads == 1 and torch.get_num_threads() == 1
    monkeypatch.setenv(LOCAL_SITES_ENV, "2")
    assert set_threads(None, local_sites()) == 2 and Site(settings).threads == 2


def test_auto_leaves_a_library_callers_threads_alone(tiny_fl: dict[str, Any], resolve) -> None:
    """run_experiment applies a number, not "auto": a caller's torch.set_num_threads stands
    (the entry points apply "auto": medfl run, a bundle run, medfl resume, medfl flower site)."""
    from medfl.experiment import run_experiment

    torch.set_num_threads(1)
    assert set_threads("auto", apply_auto=False) == 1
    run_experiment(resolve({**tiny_fl, "rounds": 1}))
    assert torch.get_num_threads() == 1


def test_simulated_sites_take_the_actor_threads(tmp_path: Path, tiny_fl: dict[str, Any], resolve) -> None:
    """What the Ray backend hands each actor (SimulatedSites) is the number its sites train with."""
    pytest.importorskip("flwr")
    from medfl.flower.simulation import SimulatedSites

    torch.set_num_threads(2)
    handler = SimulatedSites(resolve(tiny_fl), ["0", "1", "2"], tmp_path / "state", tmp_path, threads=1)
    site = handler.site(0)
    assert torch.get_num_threads() == 1 and not hasattr(site, "threads")


def _cli(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "medfl.cli", *args], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "MEDFL_NO_PROGRESS": "1", **(env or {})}, cwd=cwd)


def test_cli_threads_reaches_the_process_that_trains(tmp_path: Path, tiny_fl: dict[str, Any],
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """``medfl run --threads 1`` trains with one thread (summary.json says so, whatever the
    config says); ``medfl resume --threads 2`` continues with two; without --threads the
    config's number, else "auto"; a bad value is one error line."""
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"fl": {**tiny_fl, "rounds": 2, "stop_after_round": 1, "threads": 2}}))
    proc = _cli("run", str(config), "--threads", "1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    run_dir = Path(tiny_fl["output_dir"]) / "t" / "fedavg"
    assert not (run_dir / "summary.json").exists()          # stopped after round 1
    proc = _cli("resume", str(run_dir.parent), "--threads", "2")
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["threads"] == {"setting": 2, "torch_threads": 2}
    config.write_text(json.dumps({"fl": {**tiny_fl, "name": "auto", "rounds": 1}}))
    proc = _cli("run", str(config), env={"PYTEST_XDIST_WORKER_COUNT": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    summary = json.loads((Path(tiny_fl["output_dir"]) / "auto" / "fedavg" / "summary.json").read_text())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert summary["threads"] == {"setting": "auto", "torch_threads": cores}
    from medfl.cli import main

    threads = torch.get_num_threads()
    capsys.readouterr()
    assert main(["run", str(config), "--threads", "0"]) == 2   # refused before anything is set
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "medfl: error: --threads: expected a positive number")
    assert torch.get_num_threads() == threads


def test_threads_option_is_on_every_command_that_trains() -> None:
    from medfl.cli import _chosen, build_parser

    for names in (("run",), ("resume",), ("flower", "site"), ("flower", "run")):
        command = argparse.Namespace(command=names[0], flower_command=names[-1])
        options = {o for a in _chosen(build_parser(), command)._actions for o in a.option_strings}
        assert "--threads" in options, names


def test_flower_site_command_sets_threads_before_its_worker_starts(tmp_path: Path, tiny_fl: dict[str, Any],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``medfl flower site --threads 1``: the process whose worker trains runs torch on one
    thread, and MEDFL_THREADS reaches what it starts (its SuperNode's environment);
    ``auto`` there is the cores over MEDFL_LOCAL_SITES."""
    import medfl.flower.worker as worker
    from medfl.cli import main

    seen: list[tuple[int, str | None]] = []
    monkeypatch.setattr(worker, "run_site", lambda settings, cmd, env=None, restart=True:
                        seen.append((torch.get_num_threads(), (env or {}).get(THREADS_ENV))) or 0)
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"fl": tiny_fl}))
    base = ["flower", "site", "--client-id", "0", "--config", str(config), "--state-dir", str(tmp_path / "s"),
            "--insecure"]
    monkeypatch.setenv(THREADS_ENV, "")   # recorded, so that the value main() sets is undone after the test
    torch.set_num_threads(2)
    assert main([*base, "--threads", "1"]) == 0
    assert seen[-1] == (1, "1")
    monkeypatch.delenv(THREADS_ENV)
    monkeypatch.setattr("medfl.config.threads.available_cores", lambda: 4)
    monkeypatch.setenv(LOCAL_SITES_ENV, "2")
    assert main(base) == 0
    assert seen[-1] == (2, None)
