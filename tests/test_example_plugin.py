"""The example third-party plugin installs, shows up in `medfl plugins` and runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "medfl-plugin-example"


def test_median_aggregation_hand_computed():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from medfl_median import FedMedian
    finally:
        sys.path.remove(str(EXAMPLE))
    states = [{"w": torch.tensor([1.0, 9.0])}, {"w": torch.tensor([2.0, -5.0])},
              {"w": torch.tensor([100.0, 0.0])}]
    out = FedMedian().aggregate(states, [1, 1, 1])
    assert out["w"].tolist() == [2.0, 0.0]
    out = FedMedian().aggregate(states[:2], [1, 1])
    assert out["w"].tolist() == [1.5, 2.0]


def test_installed_example_plugin_is_listed_and_runs(tmp_path, tiny_fl):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(EXAMPLE)], check=True, capture_output=True)
    env = dict(os.environ, PYTHONPATH=str(target))
    listed = subprocess.run([sys.executable, "-m", "medfl.cli", "plugins", "--json"], env=env,
                            capture_output=True, text=True, check=True)
    info = {p["name"]: p for p in json.loads(listed.stdout)}
    plugin = info["medfl-plugin-example:median"]
    assert plugin["distribution"] == "medfl-plugin-example" and plugin["version"] == "0.1.0"
    assert plugin["registered"] == {"method": ["median"]}
    cfg = tmp_path / "train.json"
    tiny_fl.update(rounds=1, methods=[{"name": "median"}])
    cfg.write_text(json.dumps({"fl": tiny_fl}))
    proc = subprocess.run([sys.executable, "-m", "medfl.cli", "run", str(cfg)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((Path(tiny_fl["output_dir"]) / "t" / "median" / "summary.json").read_text())
    assert summary["method"] == "median"
    # MEDFL_LOAD_PLUGINS restricts third-party plugins
    env["MEDFL_LOAD_PLUGINS"] = ""
    listed = subprocess.run([sys.executable, "-m", "medfl.cli", "plugins", "--json"], env=env,
                            capture_output=True, text=True, check=True)
    assert "medfl-plugin-example:median" not in {p["name"] for p in json.loads(listed.stdout)}
