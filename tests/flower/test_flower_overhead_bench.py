"""``benchmarks/flower_overhead.py``'s own logic, without starting a deployment: the CPU
figures it prints (which process is which, a round's share of each) and the bundle job it
runs with ``--bundle`` (the demo's, as docs/flower.md's figures are). Nothing is timed."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def bench():  # noqa: ANN201 - the benchmark module, loaded by path as `python benchmarks/...` runs it
    spec = importlib.util.spec_from_file_location("flower_overhead_bench", REPO / "benchmarks" / "flower_overhead.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(module)
    return module


def test_each_process_of_a_loopback_deployment_is_named(bench) -> None:  # noqa: ANN001
    kind = bench._kind
    assert kind("flower-supernod", " python /x/bin/flower-supernode --superlink 127.0.0.1:1 ") == "SuperNodes"
    assert kind("python", " python /x/flwr_launcher.py supervise --superexec [] -- flower-superlink --port 1 ") == \
        "SuperLink's supervisor"
    assert kind("flower-superlin", " python /x/bin/flower-superlink --host 127.0.0.1 ") == "SuperLink"
    assert kind("python", " python -m medfl.cli flower site --client-id 0 ") == "site workers (train, evaluate)"
    assert kind("flower-superexe", " python flower-superexec --insecure ") .startswith("SuperExecs")
    assert kind("flwr-serverapp", " ") == "ServerApp (medfl's coordinator)"
    assert kind("flwr-clientapp", " python /x/bin/flwr-clientapp ") is None   # short-lived: counted by its reaper
    assert kind("bash", " bash ") is None


def test_a_rounds_cpu_counts_the_processes_alive_at_both_ends(bench) -> None:  # noqa: ANN001
    cpu = bench.CpuSampler()
    cpu.samples = [(10.0, {1: ("SuperLink", 5.0), 2: ("SuperNodes", 1.0), 3: ("SuperNodes", 2.0)}),
                   (10.9, {1: ("SuperLink", 5.5), 2: ("SuperNodes", 1.2), 3: ("SuperNodes", 2.1)}),
                   (20.1, {1: ("SuperLink", 9.0), 2: ("SuperNodes", 2.0), 4: ("site workers (train, evaluate)", 3.0)})]
    per_round = cpu.per_round(10.0, 20.0, 4)
    assert per_round == {"SuperLink": 1.0, "SuperNodes": 0.25}    # pid 3 ended, pid 4 began: neither counts
    assert list(per_round) == ["SuperLink", "SuperNodes"]          # the largest first
    assert cpu.per_round(10.0, 20.0, 0) == {} and bench.CpuSampler().per_round(0.0, 1.0, 1) == {}


def test_the_demo_bundle_job_keeps_its_clients_data_and_model(bench, tmp_path: Path) -> None:  # noqa: ANN001
    fl = bench.bundle_job(str(REPO / "bundles" / "demo" / "configs" / "train.json"), tmp_path, rounds=6, seed=None)
    assert fl["num_clients"] == 4 and fl["rounds"] == 6 and fl["seed"] == 0
    assert fl["model"]["name"] == "resnet10" and fl["dataset"]["name"] == "synthetic2d"
    assert [m["name"] for m in fl["methods"]] == ["fedavg"]             # the first method only
    assert fl["dataset"]["root"] == str(tmp_path / "bundle" / "data")   # generated data stays in the work folder
    assert bench._label(fl) == "fedavg"
    assert bench.bundle_job(str(REPO / "bundles" / "demo" / "configs" / "train.json"), tmp_path, 2, seed=3)["seed"] == 3
