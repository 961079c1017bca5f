"""A site keeps serving when its SuperNode exits (issue 19: after a SuperLink restart the
sites got 401 and exited with code 0, and the run never resumed until someone restarted
them). The site's supervisor starts the SuperNode again with a growing wait and a log line,
and ends only when told to (SIGTERM). A stand-in SuperNode that exits at once shows it
without a SuperLink."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is a dependency of medfl")

from flower_cases import FEDAVG, fl_config, write_config  # noqa: E402

SUPERVISE = """
import sys
from pathlib import Path
from medfl.site import SiteSettings
from medfl.flower.worker import run_site, socket_for
config, state, starts, restart, code = sys.argv[1:6]
sock = socket_for()
# the stand-in SuperNode: note the start, exit with code 0 as Flower's did on a 401 (or `code`)
cmd = [sys.executable, "-c", f"open({starts!r}, 'a').write('x'); raise SystemExit({int(code)})",
       "--node-config", f"worker='{sock}'"]
settings = SiteSettings(client_id="0", config=Path(config), state_dir=Path(state))
sys.exit(run_site(settings, cmd, restart=restart == "1", backoff=0.2, max_backoff=0.8))
"""


def _start(tmp_path: Path, restart: bool, code: int = 0) -> tuple[subprocess.Popen, Path]:
    fl = fl_config(tmp_path, "restart", FEDAVG)
    config = write_config(tmp_path / "site.json", fl)
    starts = tmp_path / "starts.txt"
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISE, str(config), str(tmp_path / "state"), str(starts),
                             "1" if restart else "0", str(code)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "MEDFL_NO_PROGRESS": "1"})
    return proc, starts


def test_the_supernode_is_started_again_until_the_site_is_told_to_stop(tmp_path: Path) -> None:
    proc, starts = _start(tmp_path, restart=True)
    deadline = time.monotonic() + 600   # a condition, with a generous limit (loaded machine)
    while time.monotonic() < deadline and (not starts.is_file() or len(starts.read_text()) < 4):
        time.sleep(0.2)
    assert proc.poll() is None, proc.communicate()[0]            # still serving
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert len(starts.read_text()) >= 4
    assert "the SuperNode exited with code 0" in out and "starting it again in 0.2 s" in out
    assert "starting it again in 0.8 s" in out                    # the wait doubles up to max_backoff


def test_a_supernode_the_superlink_refused_gets_a_hint(tmp_path: Path) -> None:
    """Flower exits with 1 on any error (its own code 305 for this one): no connection, or (with SuperNode authentication) a key the
    SuperLink does not know; the site keeps trying (the key may be registered later) and
    its log says what to check."""
    proc, starts = _start(tmp_path, restart=True, code=1)
    deadline = time.monotonic() + 600   # a condition, with a generous limit (loaded machine)
    while time.monotonic() < deadline and (not starts.is_file() or len(starts.read_text()) < 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=300)
    assert "exited with code 1 (no connection to the SuperLink, or it refused this node" in out
    assert "`medfl flower register-site`" in out and "--auth-key" in out


def test_no_restart_ends_the_site_with_the_supernode(tmp_path: Path) -> None:
    proc, starts = _start(tmp_path, restart=False)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and len(starts.read_text()) == 1 and "starting it again" not in out


@pytest.mark.parametrize("run", ["../../etc", ".hidden", "a/b", "..", "", "x" * 200, "run\x00id"])
def test_a_coordinator_cannot_point_a_site_outside_its_state_dir(tmp_path: Path, run: str) -> None:
    from medfl.site import Site, SiteError, SiteSettings

    fl = fl_config(tmp_path, "paths", FEDAVG)
    site = Site(SiteSettings(client_id="0", config=write_config(tmp_path / "site.json", fl), state_dir=tmp_path / "s"))
    with pytest.raises(SiteError, match="bad run id"):
        site._root({"run": run})
    assert site._root({"run": "3f2a-run_7"}) == tmp_path / "s" / "3f2a-run_7" / "site_0"


@pytest.mark.parametrize("problem", ["bad config", "no SuperNode program"])
def test_a_site_that_cannot_start_leaves_no_socket_folder(tmp_path: Path, problem: str) -> None:
    """A site whose config cannot be read, or whose SuperNode cannot be started, raises and
    removes the temporary folder of its worker's socket."""
    from medfl.site import SiteSettings
    from medfl.flower.worker import run_site, socket_for

    sock = socket_for()
    assert Path(sock).parent.is_dir()
    if problem == "bad config":
        config = tmp_path / "missing.json"
    else:
        config = write_config(tmp_path / "site.json", fl_config(tmp_path, "nosn", FEDAVG))
    cmd = [str(tmp_path / "no-such-supernode"), "--node-config", f"worker='{sock}'"]
    with pytest.raises(Exception, match="missing.json" if problem == "bad config" else "no-such-supernode"):
        run_site(SiteSettings(client_id="0", config=config, state_dir=tmp_path / "state"), cmd, restart=False)
    assert not Path(sock).parent.exists()
