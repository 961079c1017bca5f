"""A slow machine makes a Flower run slower, never wrong or stuck (issue 39, item 6).

Real processes (a SuperLink, ``medfl flower site``, ``flwr run``, ``medfl flower run``) on
127.0.0.1, as in ``test_flower.py``. Load is not simulated by busy loops here (a test must
not depend on how loaded the machine is): the slowness load causes is made exact instead,
by a ``sitecustomize`` that holds a chosen Flower process at its start for a set time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.flower.deploy import LocalFederation  # noqa: E402

from flower_cases import FEDAVG, fl_config, write_config  # noqa: E402

#: A ``sitecustomize`` holding the first process named ``{name}`` for ``{seconds}`` s at its
#: start (before it imports Flower), as a machine at load 30-70 does; the marker file says
#: it happened (``O_EXCL``: only one process sleeps).
SLOW_START = '''
import os, sys, time
if sys.argv and os.path.basename(sys.argv[0]) == {name!r}:
    try:
        fd = os.open({marker!r}, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        pass
    else:
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        time.sleep({seconds!r})
'''


def slow_start_env(folder: Path, name: str, seconds: float) -> tuple[dict[str, str], Path]:
    """The environment that holds the first ``name`` process ``seconds`` at its start, and
    the marker file it writes then."""
    folder.mkdir(parents=True)
    marker = folder / f"{name}.started"
    (folder / "sitecustomize.py").write_text(SLOW_START.format(name=name, marker=str(marker), seconds=seconds))
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path}, marker


def test_a_clientapp_slow_to_start_keeps_its_task_token(tmp_path: Path) -> None:
    """A ClientApp process that needs 40 s before it reports (Flower gives it 30 s; a
    machine at load 30-70 needs that long to import Flower) still answers its message: its
    task token does not expire, no second process is started for the message, and no
    ``401 Runtime task-token authentication failed`` is logged (before: the token expired
    at 30 s and the late process was refused with that 401)."""
    env, marker = slow_start_env(tmp_path / "hook", "flwr-clientapp", 40.0)
    cfg = write_config(tmp_path / "train.json", fl_config(tmp_path, "slow", {**FEDAVG, "rounds": 1}))
    with LocalFederation(tmp_path / "fed", env=env) as fed:
        fed.start_superlink()
        for cid in ("0", "1", "2"):
            fed.start_site(cid, cfg, wait=False)
        fed.wait_for_nodes(3)
        res = fed.run(cfg, connect_timeout=400.0, round_timeout=400.0, hello_timeout=400.0, timeout=900.0,
                      name="slow")
        logs = {cid: fed.tail(f"site{cid}", 10**7) for cid in ("0", "1", "2")}
    assert res["ok"], res
    assert marker.is_file(), "no ClientApp was held at its start"
    for cid, log in logs.items():
        assert "task-token authentication failed" not in log, f"site {cid}:\n{log[-3000:]}"
        assert "401 Unauthorized" not in log, f"site {cid}:\n{log[-3000:]}"
