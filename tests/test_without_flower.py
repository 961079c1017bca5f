"""An in-process run needs no Flower: ``medfl run`` of a tiny experiment, in a process where
importing ``flwr`` fails, finishes and writes its metrics and traffic (:mod:`medfl.wire`
measures every message without Flower)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd

#: a ``sitecustomize`` that makes every import of ``flwr`` fail, and notes the attempt
BLOCK = """
import importlib.abc, os, sys

class _NoFlower(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "flwr" or name.startswith("flwr."):
            with open(os.environ["MEDFL_TEST_FLWR_ATTEMPTS"], "a") as fh:
                fh.write(name + "\\n")
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: as if Flower were not installed)", name=name)

sys.meta_path.insert(0, _NoFlower())
"""

FL = {"name": "demo", "output_dir": "runs", "seed": 0, "rounds": 1, "num_clients": 2, "progress": False,
      "plots": False, "dataset": {"name": "synthetic2d", "root": "data", "num_samples": 32, "num_classes": 2,
                                  "image_size": 8, "noise": 0.5},
      "partition": {"name": "iid"}, "model": {"name": "small_cnn", "width": 2},
      "train": {"batch_size": 8, "lr": 0.05}, "methods": [{"name": "fedavg"}]}


def test_an_in_process_run_imports_no_flower(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK)
    (tmp_path / "train.json").write_text(json.dumps({"fl": FL}))
    attempts = tmp_path / "attempts.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *filter(None, [
        os.environ.get("PYTHONPATH")])]), "MEDFL_TEST_FLWR_ATTEMPTS": str(attempts), "MEDFL_NO_PLOTS": "1"}
    proc = subprocess.run([sys.executable, "-m", "medfl.cli", "run", "train.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not attempts.exists(), f"imported Flower: {attempts.read_text()}"
    run = tmp_path / "runs" / "demo" / "fedavg"
    metrics = pd.read_csv(run / "metrics.csv", dtype={"client_id": str})
    assert set(metrics["client_id"]) == {"0", "1"} and metrics["accuracy"].between(0, 1).all()
    comm = pd.read_csv(run / "communication.csv")
    assert (comm.loc[comm["phase"] == "train", ["bytes_to_client", "bytes_from_client"]] > 0).all().all()


def test_a_command_that_needs_flower_says_how_to_install_it(tmp_path: Path) -> None:
    """Flower is the extra ``medfl[flower]``: without it, a run on Flower's simulation runtime
    ends with one line naming the extra (exit code 2), not a traceback."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK)
    (tmp_path / "train.json").write_text(json.dumps({"fl": {**FL, "backend": "ray"}}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *filter(None, [
        os.environ.get("PYTHONPATH")])]), "MEDFL_TEST_FLWR_ATTEMPTS": str(tmp_path / "attempts.txt")}
    proc = subprocess.run([sys.executable, "-m", "medfl.cli", "run", "train.json"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "medfl: error: this needs Flower, which is not installed here: pip install 'medfl[flower]'" in proc.stderr
    assert "Traceback" not in proc.stderr
