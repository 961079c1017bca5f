"""The demo bundle runs through MONAI's bundle CLI, as the README says."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BUNDLE = Path(__file__).resolve().parents[1] / "bundles" / "demo"


@pytest.mark.plots
def test_demo_bundle_runs_with_monai_bundle_cli(tmp_path):
    """The command of bundles/demo/docs/README.md's "Try it on fixture data", as written
    (tests/test_bundle_readmes.py leaves the demo to this test, so it trains once)."""
    from bundle_readme import run_readme

    (proc,), exp = run_readme("demo", tmp_path)
    assert exp == tmp_path / "bundles" / "demo" / "runs" / "demo"
    for label in ("fedavg", "local"):
        summary = json.loads((exp / label / "summary.json").read_text())
        assert summary["rounds"] == 1 and summary["num_clients"] == 4
        assert 0 <= summary["final"]["local_test"]["accuracy"]["mean"] <= 1
    assert (exp / "comparison.csv").is_file() and (exp / "comparison.png").is_file()
    assert "local_test" in proc.stdout
    # configs/logging.conf is there, so MONAI applies it instead of warning on every run
    assert "Default logging file" not in proc.stdout + proc.stderr
    assert "Setting logging properties based on config" in proc.stdout + proc.stderr
    # MONAI warns on every config it executes; the README says the warning is expected
    warning = 'any `"_target_"` value in it is resolved to an importable callable'
    assert warning in proc.stderr
    assert warning in " ".join((Path(__file__).resolve().parents[1] / "README.md").read_text().split())


def test_demo_bundle_unknown_key_lists_valid_keys(tmp_path, run_bundle):
    proc = run_bundle(BUNDLE / "configs" / "train.json", "--bundle_root", tmp_path, "--fl#roundz", "1", check=False)
    assert proc.returncode != 0
    assert "unknown key(s) 'roundz'; valid keys:" in proc.stderr


def test_trace_plugins_env_prints_hook_calls(tmp_path):
    env = {"MEDFL_TRACE_PLUGINS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-m", "medfl.cli", "plugins"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0
    assert "medfl: hook register_methods" in proc.stderr
