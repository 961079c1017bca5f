"""A run that no site can join ends at once, and one waiting for sites says which are missing.

Real processes (a SuperLink, ``medfl flower site``, ``flwr run``) on 127.0.0.1, as in
``test_flower.py``; each test has its own federation, ended in teardown.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterator

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.flower.deploy import FlowerDeployError  # noqa: E402

from local_federation import LocalFederation  # noqa: E402

from flower_cases import FEDAVG, fl_config, write_config  # noqa: E402


@pytest.fixture
def federation(tmp_path: Path) -> Iterator[LocalFederation]:
    """A SuperLink and no site yet; every process ended in teardown."""
    fed = LocalFederation(tmp_path / "fed")
    try:
        fed.start_superlink()
        yield fed
    finally:
        fed.close()
        assert fed.stray_processes() == [], "processes of the federation left running"


def test_run_stops_at_once_when_every_site_has_exited(federation: LocalFederation, tmp_path: Path) -> None:
    """Sites whose config fails exit at once; the run fails with their exit codes and errors
    instead of waiting out its connect timeout (an hour here: the run must end long before,
    however loaded the machine is)."""
    cfg = write_config(tmp_path / "train.json", fl_config(tmp_path, "gone", FEDAVG))
    for cid in ("0", "1", "2"):
        federation.start_site(cid, cfg, overrides={"fl#roundz": 2}, wait=False)
    t0 = time.monotonic()
    with pytest.raises(FlowerDeployError) as err:
        federation.run(cfg, connect_timeout=3600.0, timeout=3600.0, name="gone")
    took = time.monotonic() - t0
    msg = str(err.value)
    assert "every site of this federation has exited" in msg, msg
    for cid in ("0", "1", "2"):
        assert f"site {cid} exited with code 2" in msg, msg
    assert "medfl: error: fl: unknown key(s) 'roundz'; valid keys:" in msg
    assert took < 1800, f"took {took:.0f} s: it waited for the connect timeout"
    # the sites are gone for good: a further run is refused before it starts
    with pytest.raises(FlowerDeployError, match="not started: every site of this federation has exited"):
        federation.run(cfg, name="again")


def test_waiting_coordinator_names_the_missing_sites(federation: LocalFederation, tmp_path: Path) -> None:
    """No site started (as when the sites run on other machines): ``flwr run``'s output says
    which clients have no site yet while the coordinator waits, then why the run failed."""
    cfg = write_config(tmp_path / "train.json", fl_config(tmp_path, "alone", FEDAVG))
    res = federation.run(cfg, connect_timeout=6.0, progress_interval=2.0, timeout=900.0, name="alone")
    assert not res["ok"] and "no SuperNode serves client(s) ['0', '1', '2']" in res["error"], res
    log = Path(res["log"]).read_text(errors="replace")
    assert "medfl: waiting for sites" in log, log[-3000:]
    assert "no site serves client(s) 0, 1, 2 yet; connected: none (0 SuperNode(s) registered)" in log, log[-3000:]
