"""The in-process engine: outputs, determinism, resume, payload rule, config errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from medfl.config import ConfigError
from medfl.experiment import resume, run_experiment
from medfl.messages import PayloadError, SampleGuard, validate_payload
from medfl.plugins import get_plugin_manager
from medfl_plugins.baselines import FedAvg


@pytest.mark.plots
def test_run_outputs_and_determinism(tiny_fl, resolve, tmp_path, monkeypatch):
    tiny_fl["methods"] = [{"name": "fedavg"}, {"name": "local"}, {"name": "fedbn"},
                          {"name": "centralized"}, {"name": "fedprox", "mu": 0.1},
                          {"name": "fedavgm"}, {"name": "fedadam"}]
    out = run_experiment(resolve(tiny_fl))
    exp = Path(out["dir"])
    for label in ("fedavg", "local", "fedbn", "centralized", "fedprox", "fedavgm", "fedadam"):
        d = exp / label
        for f in ("config.json", "partition.csv", "metrics.csv", "summary.json", "plots/curves.png"):
            assert (d / f).is_file(), f"{label}: {f} missing"
        m = pd.read_csv(d / "metrics.csv")
        assert set(m["split"]) == {"local_test", "global_test"}
        assert sorted(m["round"].unique()) == [1, 2]
        assert len(m) == 2 * 3 * 2  # rounds x clients x splits
    assert (exp / "comparison.csv").is_file()
    # a second identical run lands in a new directory and gives identical metrics (its
    # figures are not looked at: drawing them would double the test's time)
    monkeypatch.setenv("MEDFL_NO_PLOTS", "1")
    out2 = run_experiment(resolve(tiny_fl))
    assert out2["dir"] != out["dir"]
    a = pd.read_csv(exp / "fedavg" / "metrics.csv")
    b = pd.read_csv(Path(out2["dir"]) / "fedavg" / "metrics.csv")
    pd.testing.assert_frame_equal(a, b)


def test_resume_after_lower_round_limit_matches_uninterrupted(tiny_fl, resolve, tmp_path):
    tiny_fl["rounds"] = 3
    tiny_fl["methods"] = [{"name": "fedavgm"}, {"name": "local"}]
    full = run_experiment(resolve(dict(tiny_fl, name="full")))
    stopped = run_experiment(resolve(dict(tiny_fl, name="part", stop_after_round=1)))
    assert stopped["summaries"]["fedavgm"] == {}
    resume(stopped["dir"])
    for label in ("fedavgm", "local"):
        a = pd.read_csv(Path(full["dir"]) / label / "metrics.csv")
        b = pd.read_csv(Path(stopped["dir"]) / label / "metrics.csv")
        pd.testing.assert_frame_equal(a, b)


KILLER = """
import os, sys
from medfl import hookimpl
from medfl.plugins import get_plugin_manager
from medfl.bundle import run
class Killer:
    @hookimpl
    def on_client_end(self, run, round, client_id, metrics):
        if round == 2 and client_id == "1":
            os._exit(3)  # killed in the middle of round 2, after client 0 saved its state
get_plugin_manager().register(Killer(), name="killer")
import json
run(json.loads(sys.argv[1]))
"""


def test_resume_after_kill_mid_round(tiny_fl, resolve, tmp_path):
    tiny_fl["rounds"] = 3
    tiny_fl["methods"] = [{"name": "fedbn"}]
    full = run_experiment(resolve(dict(tiny_fl, name="full")))
    cfg = dict(tiny_fl, name="killed")
    proc = subprocess.run([sys.executable, "-c", KILLER, json.dumps(cfg)], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    run_dir = Path(tiny_fl["output_dir"]) / "killed" / "fedbn"
    assert json.loads((run_dir / "status.json").read_text())["last_round"] == 1
    rc = subprocess.run([sys.executable, "-m", "medfl.cli", "resume", str(run_dir)],
                        capture_output=True, text=True)
    assert rc.returncode == 0, rc.stderr
    a = pd.read_csv(Path(full["dir"]) / "fedbn" / "metrics.csv")
    b = pd.read_csv(run_dir / "metrics.csv")
    pd.testing.assert_frame_equal(a, b)


class _Leaky(FedAvg):
    name = "leaky"

    def __init__(self, leak: str = "images") -> None:
        self.leak = leak

    def reply_keys(self, instruction):
        # declared (Method.reply_keys), so what refuses it is the content check
        return frozenset({"model", {"images": "x", "labels": "y", "path": "p"}.get(self.leak, "obj")})

    def client_update(self, client, instruction):
        reply = super().client_update(client, instruction)
        x, y = next(iter(client.loader("train", batch_size=client.num_examples("train"))))
        if self.leak == "images":
            reply.payload["x"] = x
        elif self.leak == "labels":
            reply.payload["y"] = y
        elif self.leak == "path":
            reply.payload["p"] = "/data/site1/img.npy"
        else:
            reply.payload["obj"] = object()
        return reply


@pytest.mark.parametrize("leak,match", [("images", "images"), ("labels", "labels"),
                                        ("path", "strings"), ("object", "only tensors")])
def test_engine_rejects_client_data_in_replies(tiny_fl, resolve, leak, match):
    class Plugin:
        @staticmethod
        def register_methods(register):
            register(_Leaky)

    from medfl import hookimpl

    Plugin.register_methods = hookimpl(Plugin.register_methods)
    pm = get_plugin_manager()
    pm.register(Plugin, name="leaky-test")
    try:
        tiny_fl["methods"] = [{"name": "leaky", "leak": leak}]
        with pytest.raises(PayloadError, match=match):
            run_experiment(resolve(tiny_fl))
    finally:
        pm.unregister(name="leaky-test")


def test_validate_payload_allows_state_dicts():
    sd = torch.nn.Conv2d(1, 4, 3).state_dict()
    validate_payload({"model": sd, "lr": 0.1, "names": ["a"]}, allow_str=True)
    guard = SampleGuard((1, 8, 8))
    validate_payload({"model": sd, "proto": torch.zeros(2, 16)}, allow_str=False, guard=guard)
    with pytest.raises(PayloadError):
        validate_payload({"x": torch.zeros(10, 1, 8, 8)}, guard=guard)
    # exempt keys skip only the sample check, never the type check
    validate_payload({"x": torch.zeros(10, 1, 8, 8)}, guard=guard, exempt=frozenset({"x"}))
    with pytest.raises(PayloadError):
        validate_payload({"x": b"bytes"}, exempt=frozenset({"x"}))


@pytest.mark.parametrize("patch,match", [
    ({"roundz": 3}, "unknown key.*'roundz'.*valid keys"),
    ({"methods": [{"name": "fedavgx"}]}, "unknown method 'fedavgx'; valid methods: .*fedavg"),
    ({"model": {"name": "resnet11"}}, "unknown model 'resnet11'; valid models: .*resnet10"),
    ({"methods": [{"name": "fedprox", "mew": 1}]}, "no parameter.*'mew'.*valid parameters: mu"),
    ({"train": {"epoch": 1}}, "fl.train: unknown key.*'epoch'"),
    ({"partition": {"name": "dirichlett"}}, "unknown partitioner"),
])
def test_config_errors_list_valid_choices(tiny_fl, resolve, patch, match):
    tiny_fl.update(patch)
    with pytest.raises(ConfigError, match=match):
        resolve(tiny_fl)
