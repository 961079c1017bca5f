"""A real deployment whose SuperLink database is locked (issue 49, item 5; the audit of
2026-11-27 held a real SuperLink's SQLite database for 6 s: the run failed at once with
``ObjectPushError``, the SuperLink's SuperExec died on an HTTP 500 so that no later run
started, and every SuperNode left the federation while its process lived on, so no site was
restarted: recovery took a manual restart of the SuperLink and every site).

A SuperLink on a database file (``medfl flower superlink --database``, under its supervisor)
and three sites (``medfl flower site``), as separate processes on 127.0.0.1. The database is
held locked (``BEGIN EXCLUSIVE``) for 6 s once round 1 has finished: the run finishes, or,
where the lock made the SuperLink's SuperExec exit (Flower's ServerApp ends with it), stops
with round 1 saved and finishes when resumed, with the numbers of the same job in process
(``fl.min_sites`` 3: a site whose SuperNode left is waited for and sent its round again). Then it is held for 12 s while the federation is
idle, longer than SQLite's 5-s busy wait of every call, so that every SuperNode's poll and the
SuperExec's fail: each SuperNode is ended and started again by its site, the SuperExec by
the supervisor, and a second run starts and finishes without anyone restarting anything.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.config import resolve_config  # noqa: E402
from medfl.engine.runner import build_source  # noqa: E402
from medfl.experiment import run_experiment  # noqa: E402
from medfl.flower.deploy import FlowerDeployError  # noqa: E402

from local_federation import LocalFederation  # noqa: E402
from soak import last_round  # noqa: E402

from flower_cases import FEDAVG, fl_config, numeric_equal, write_config  # noqa: E402

RUN_TIMEOUT = 1200.0     # generous limits for a loaded machine: conditions, never clocks
#: a resumed run waits this long for its sites: a message of the stopped run that a site holds
#: lapses at the SuperLink within twice Flower's 30 s heartbeat interval
STALE_RUN_EXPIRY = 180.0


def _hold(database: Path, seconds: float) -> None:
    """Hold ``database`` locked against every other connection for ``seconds``."""
    con = sqlite3.connect(str(database), timeout=60.0, isolation_level=None)
    try:
        con.execute("BEGIN EXCLUSIVE")
        time.sleep(seconds)
        con.execute("ROLLBACK")
    finally:
        con.close()


def _wait_for(what: str, probe: Any, limit: float = 600.0) -> None:
    deadline = time.monotonic() + limit
    while not probe():
        assert time.monotonic() < deadline, f"not within {limit:.0f} s: {what}"
        time.sleep(0.2)


def test_a_locked_superlink_database_does_not_wedge_the_deployment(tmp_path: Path) -> None:
    site_cfg = write_config(tmp_path / "site.json", fl_config(tmp_path, "site", FEDAVG))
    build_source(resolve_config(fl_config(tmp_path, "site", FEDAVG))["dataset"])
    job = {**FEDAVG, "rounds": 2, "min_sites": 3}
    cfg_file = write_config(tmp_path / "job.json", fl_config(tmp_path, "job", job))
    database = tmp_path / "superlink.db"
    fed = LocalFederation(tmp_path / "fed", sites=3)
    try:
        fed.start_superlink(database=str(database))
        for cid in ("0", "1", "2"):
            fed.start_site(cid, site_cfg, wait=False)
        fed.wait_for_nodes(3, timeout=RUN_TIMEOUT)

        # idle: every SuperNode and the SuperExec poll into a database locked past their busy wait
        _hold(database, 12.0)
        for cid in ("0", "1", "2"):
            _wait_for(f"site {cid} ends its SuperNode that left and starts it again",
                      lambda: "left the federation while its process lived on: medfl ended it"
                      in fed.tail(f"site{cid}", 10**6) and fed.tail(f"site{cid}", 10**6).count("SuperNode pid") >= 2)
        _wait_for("the SuperExec started again", lambda: "medfl: SuperExec pid" in fed.tail("superlink", 10**7))
        fed.wait_for_nodes(6, timeout=RUN_TIMEOUT)                    # each site's new SuperNode joined

        # a run on the restarted SuperExec and SuperNodes, the database locked for 6 s after round 1
        result: dict[str, Any] = {}

        def run() -> None:
            try:
                result.update(fed.run(cfg_file, round_timeout=120.0, timeout=RUN_TIMEOUT, name="locked"))
            except FlowerDeployError as exc:
                result["deploy_error"] = str(exc)

        runner = threading.Thread(target=run, daemon=True)
        runner.start()
        run_dir = tmp_path / "runs" / "job" / "fedavg"
        _wait_for("round 1", lambda: last_round(run_dir) >= 1 or not runner.is_alive(), RUN_TIMEOUT)
        assert runner.is_alive() and last_round(run_dir) == 1, result
        _hold(database, 6.0)
        runner.join(RUN_TIMEOUT)
        if result.get("interrupted"):
            # the lock made the SuperExec exit, and Flower's ServerApp ends with the process that
            # started it: the run stopped with its finished rounds saved, and continues
            resumed = fed.run(resume=run_dir.parent, round_timeout=120.0, connect_timeout=STALE_RUN_EXPIRY,
                              timeout=RUN_TIMEOUT, name="resumed")
            assert resumed.get("ok"), f"{resumed}\n{fed.tail('superlink')}"
        else:
            assert result.get("ok"), f"{result}\n{fed.tail('superlink')}"
    finally:
        fed.close()
        assert fed.stray_processes() == [], "processes of the federation left running"
    reference = Path(run_experiment(resolve_config(fl_config(tmp_path, "ref", job)))["dir"]) / "fedavg"
    numeric_equal(pd.read_csv(reference / "metrics.csv"), pd.read_csv(run_dir / "metrics.csv"), "metrics.csv")
    ours, theirs = pd.read_csv(reference / "train_metrics.csv"), pd.read_csv(run_dir / "train_metrics.csv")
    # a round sent again to a site whose SuperNode left is counted as sent each time: Flower's
    # bytes to a client are at least the in-process ones; every other number is the same
    keys = ["round", "client_id"]
    sent = ours.sort_values(keys)["bytes_to_client"].to_numpy(), theirs.sort_values(keys)["bytes_to_client"].to_numpy()
    assert (sent[1] >= sent[0]).all(), sent
    numeric_equal(ours.drop(columns="bytes_to_client"), theirs.drop(columns="bytes_to_client"), "train_metrics.csv")
