"""The NVIDIA FLARE path needs no Flower: its controller, executor and transport, and the
``nvflare`` backend, import in a process where importing ``flwr`` fails, and the remote
coordinator (:class:`medfl.engine.remote.RemoteRun`) runs a whole experiment there over sites
in that process (:class:`medfl.transport.InProcessTransport`), with the numbers of the run in
one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

pytest.importorskip("nvflare", reason="NVIDIA FLARE is medfl's optional extra: pip install -e '.[nvflare]'")

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS), str(TESTS / "flower")]

from flower_cases import numeric_equal  # noqa: E402
from test_without_flower import BLOCK, FL  # noqa: E402

from medfl.config import resolve_config  # noqa: E402
from medfl.experiment import run_experiment  # noqa: E402

#: the process without Flower: every NVFlare module of medfl, then the ``nvflare`` backend's
#: runs over sites in this process; prints the experiment's folder and any flwr module loaded
SCRIPT = """
import json, sys
from pathlib import Path

import medfl.nvflare.controller, medfl.nvflare.executor, medfl.nvflare.job, medfl.nvflare.transport
from medfl.config import resolve_config
from medfl.engine.remote import RemoteSettings
from medfl.experiment import run_experiment
from medfl.site import Site, SiteSettings
from medfl.site_messages import answer_message
from medfl.plugins import lookup
from medfl.transport import InProcessTransport

fl = json.loads(Path("fl.json").read_text())
Path("site.json").write_text(json.dumps({"fl": fl}))
sites = {101 + i: Site(SiteSettings(client_id=str(i), config=Path("site.json"), state_dir=Path(f"state{i}")))
         for i in range(fl["num_clients"])}
settings = RemoteSettings(round_timeout=60, connect_timeout=60, hello_timeout=5, poll_interval=0.01)
backend = lookup("backend", "nvflare")(InProcessTransport(sites, answer_message), settings)
out = run_experiment(resolve_config(fl), backend=backend)
print(json.dumps({"dir": str(out["dir"]), "flwr": sorted(m for m in sys.modules if m.split(".")[0] == "flwr")}))
"""


def test_the_nvflare_path_imports_no_flower_and_runs_remote_rounds(tmp_path: Path) -> None:
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(BLOCK)
    fl = {**FL, "output_dir": str(tmp_path / "runs"), "dataset": {**FL["dataset"], "root": str(tmp_path / "data")},
          "rounds": 2}
    (tmp_path / "fl.json").write_text(json.dumps(fl))
    attempts = tmp_path / "attempts.txt"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "site"), *filter(None, [
        os.environ.get("PYTHONPATH")])]), "MEDFL_TEST_FLWR_ATTEMPTS": str(attempts), "MEDFL_NO_PLOTS": "1",
           "MEDFL_REPRODUCIBLE_NOISE": "1"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not attempts.exists(), f"imported Flower: {attempts.read_text()}"
    said = json.loads(proc.stdout.strip().splitlines()[-1])
    assert said["flwr"] == []
    remote = Path(said["dir"]) / "fedavg"
    assert json.loads((remote.parent / "config.json").read_text())["engine"] == "nvflare"
    assert not list((remote / "clients").rglob("state_r*.pt")), "client state at the coordinator"
    local = Path(run_experiment(resolve_config({**fl, "name": "local"}))["dir"]) / "fedavg"
    for f in ("metrics.csv", "train_metrics.csv"):
        numeric_equal(pd.read_csv(local / f), pd.read_csv(remote / f), f, atol=0.0)
