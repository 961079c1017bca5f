"""A Flower deployment with SuperNode authentication and a SuperLink restart, as separate
processes on 127.0.0.1 (issue 19: any machine that reached the Fleet API could pose as a
site; after a SuperLink restart the sites exited and the run never resumed).

TLS with a CA made for the test, ``--enable-supernode-auth``, three sites whose keys are
registered and pinned to their client ids (``site-nodes``), an intruder with the right config
and data but an unregistered key, and an impostor with a registered key that claims another
site's client id. The
SuperLink keeps its state in a database; it is stopped after round 1 and started again on
the same port: the sites reconnect on their own with the node ids bound to their keys, the
interrupted run resumes with ``--resume`` and ends with the in-process numbers.
"""

from __future__ import annotations

import json
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
from medfl.flower.auth import make_site_key  # noqa: E402
from medfl.flower.deploy import FlowerDeployError  # noqa: E402

from local_federation import LocalFederation  # noqa: E402
from soak import last_round as _last_round, wait_unlocked as _wait_unlocked  # noqa: E402

from flower_cases import FEDAVG, fl_config, numeric_equal, write_config  # noqa: E402

ROUND_TIMEOUT = 600.0   # generous: a site sent a round again under load trains it twice (docs/flower.md)
RUN_TIMEOUT = 1200.0


def test_only_registered_sites_join_and_a_superlink_restart_is_survived(tmp_path: Path) -> None:
    site_cfg = write_config(tmp_path / "site.json", fl_config(tmp_path, "site", FEDAVG))
    build_source(resolve_config(fl_config(tmp_path, "site", FEDAVG))["dataset"])
    job = {**FEDAVG, "rounds": 2}
    cfg_file = write_config(tmp_path / "job.json", fl_config(tmp_path, "job", job))
    fed = LocalFederation(tmp_path / "fed", auth=True)
    try:
        database = str(tmp_path / "superlink.db")
        link = fed.start_superlink(database=database)
        nodes = {cid: fed.register_site(cid) for cid in ("0", "1", "2")}
        for cid in nodes:
            fed.start_site(cid, site_cfg, wait=False)
        # a registered site (client 3's key, say) that claims client 1: site-nodes refuses it
        impostor = fed.register_site("3")
        fed.start_site("1", site_cfg, state_dir=tmp_path / "impostor_state", auth_key=fed.keys["3"], wait=False,
                       name="impostor")
        fed.wait_for_nodes(4)      # (it ends at the first process that exits: the intruder comes after)
        intruder_key, _ = make_site_key(tmp_path / "intruder", "intruder")
        fed.start_site("1", site_cfg, state_dir=tmp_path / "intruder_state", auth_key=intruder_key,
                       restart=False, wait=False, name="intruder")
        intruder = fed.procs["intruder"].popen
        intruder.wait(timeout=600)
        assert intruder.returncode == 1, (intruder.returncode, fed.tail("intruder"))     # Flower's error exit
        assert "Failed to activate SuperNode" in fed.tail("intruder", 20000)

        result: dict[str, Any] = {}

        def first() -> None:
            try:
                result.update(fed.run(cfg_file, round_timeout=ROUND_TIMEOUT, timeout=RUN_TIMEOUT, name="first",
                                      site_nodes=nodes))
            except FlowerDeployError as exc:     # the ServerApp may die before it writes its result
                result["deploy_error"] = str(exc)

        runner = threading.Thread(target=first, daemon=True)
        runner.start()
        run_dir = tmp_path / "runs" / "job" / "fedavg"
        deadline = time.monotonic() + RUN_TIMEOUT
        while _last_round(run_dir) < 1 and runner.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _last_round(run_dir) == 1, result
        fed.stop_superlink()                                  # an outage or an upgrade
        fed.start_superlink(port=int(link.rsplit(":", 1)[1]), database=database)
        # the coordinator goes down with its SuperLink (a SIGTERM: "interrupted", or killed
        # before it can say so); until its process has ended it holds the run directory
        runner.join(RUN_TIMEOUT)
        assert not result.get("ok"), "the first run cannot have finished without its SuperLink"
        if "error" in result:
            assert result.get("interrupted") and "medfl flower run --resume" in result["error"], result
        _wait_unlocked(run_dir, 120.0)
        status = json.loads((run_dir / "status.json").read_text())
        assert status["last_round"] == 1 and status["status"] in ("interrupted", "running"), status
        resumed = fed.run(resume=tmp_path / "runs" / "job", round_timeout=ROUND_TIMEOUT, hello_timeout=120.0,
                          timeout=RUN_TIMEOUT, name="resumed", site_nodes=nodes)
        assert resumed["ok"], f"{resumed.get('error')}\n{resumed.get('traceback')}"
    finally:
        fed.close()
        assert fed.stray_processes() == [], "processes of the federation left running"
    reference = Path(run_experiment(resolve_config(fl_config(tmp_path, "ref", job)))["dir"]) / "fedavg"
    for f in ("metrics.csv", "train_metrics.csv"):
        numeric_equal(pd.read_csv(reference / f), pd.read_csv(run_dir / f), f)
    # every hello, before and after the restart, came from the node bound to the site's key
    events = pd.read_csv(run_dir / "flower_events.csv", dtype={"client_id": str, "node_id": str})
    hellos = events[events["phase"] == "hello"]
    joined = hellos[~hellos["status"].str.startswith("refused")]
    assert len(joined) >= 6 and set(joined["client_id"]) == set(nodes)     # before and after the restart
    assert all(int(n) == nodes[c] for c, n in zip(joined["client_id"], joined["node_id"]))
    refused = hellos[hellos["status"].str.startswith("refused")]
    assert {int(n) for n in refused["node_id"]} == {impostor}     # in both sessions (ids are uint64: no astype)
    assert "which is registered to node" in refused["status"].iloc[0]
