"""A site's SuperNode asks the SuperLink for work every ``MEDFL_FLOWER_NODE_POLL`` seconds
(default 0.2) instead of Flower's fixed 3 s (issue 50, item 4): the setting, how it reaches a
SuperNode's process, and what it changes in Flower's loop. No process is started and nothing
is timed: ``benchmarks/flower_overhead.py --node-poll 3 --node-poll 0.2`` measures it."""

from __future__ import annotations

import importlib
import json
import time
from pathlib import Path
from contextlib import nullcontext
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.flower import flwr_launcher  # noqa: E402
from medfl.flower.deploy import FlowerDeployError, LocalFederation, site_env  # noqa: E402
from medfl.flower.flwr_launcher import (  # noqa: E402
    DEFAULT_NODE_POLL, LOCAL_WAIT, NODE_POLL_ENV, PacedTime, node_poll, pace_supernode,
)

LOOP = "flwr.supernode.start_client_internal"


def test_the_setting_is_read_from_the_environment() -> None:
    assert node_poll({}) == DEFAULT_NODE_POLL == 0.2
    assert node_poll({NODE_POLL_ENV: " 0.5 "}) == 0.5
    assert node_poll({NODE_POLL_ENV: "3"}) == 3.0          # Flower's own wait
    assert node_poll({NODE_POLL_ENV: ""}) == DEFAULT_NODE_POLL
    for bad in ("0", "0.001", "-1", "nan", "inf", "5000", "fast"):
        with pytest.raises(ValueError, match=NODE_POLL_ENV):
            node_poll({NODE_POLL_ENV: bad})


def test_paced_time_caps_each_wait_and_is_time_otherwise() -> None:
    waits: list[float] = []
    fake = SimpleNamespace(sleep=waits.append, monotonic=lambda: 42.0)
    paced = PacedTime(fake, 0.2)
    paced.sleep(3)       # the SuperNode's idle wait
    paced.sleep(0.5)     # its look at its own memory for the ClientApp's reply
    paced.sleep(0.01)
    assert waits == [0.2, LOCAL_WAIT, 0.01]
    assert paced.monotonic() == 42.0
    slow = PacedTime(fake, 0.01)
    slow.sleep(3), slow.sleep(0.5)
    assert waits[-2:] == [0.01, 0.01]                # never longer than the interval


def test_flowers_supernode_loop_waits_the_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    """This Flower's loop is the one the setting was written for (its idle wait is a literal
    ``time.sleep(3)``): the launcher gives it a paced ``time`` and nothing else. A Flower
    release that waits elsewhere fails here instead of silently keeping its 3 s."""
    loop = importlib.import_module(LOOP)
    monkeypatch.setattr(loop, "time", time)          # restored after the test
    assert pace_supernode(3.0) is False and loop.time is time     # 3 s or more: Flower's own waits
    assert pace_supernode(0.2) is True
    assert isinstance(loop.time, PacedTime) and loop.time.cap == 0.2
    assert loop.time.monotonic is time.monotonic
    assert pace_supernode(0.5) is True and loop.time.cap == 0.5   # set again: one wrapper, new interval
    assert pace_supernode(7.0) is True and loop.time.cap == 3.0   # never longer than Flower's own


def test_another_flower_loop_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = importlib.import_module(LOOP)
    other = SimpleNamespace(sleep=lambda s: None)
    monkeypatch.setattr(loop, "time", other)
    assert pace_supernode(0.2) is False and loop.time is other


def test_the_launcher_refuses_a_bad_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(NODE_POLL_ENV, "0")
    assert flwr_launcher.main(["flower-supernode", "--help"]) == 2   # before anything of Flower runs
    from medfl.flower.deploy import flower_command

    with pytest.raises(FlowerDeployError, match=NODE_POLL_ENV):
        flower_command("flower-supernode")


def test_a_sites_supernode_gets_its_interval(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`medfl flower site --poll-interval S`: the SuperNode's environment carries it; without
    the option, what the environment says (else the launcher's default)."""
    import medfl.flower.worker as worker
    from medfl.cli import main

    started: list[dict[str, str]] = []
    monkeypatch.setattr(worker, "run_site", lambda settings, cmd, env=None, restart=True: started.append(env) or 0)
    monkeypatch.setattr(worker, "socket_for", lambda: str(tmp_path / "worker.sock"))
    monkeypatch.delenv(NODE_POLL_ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.json").write_text('{"fl": {}}')
    base = ["flower", "site", "--client-id", "0", "--config", "train.json", "--state-dir", "state", "--insecure"]
    assert main([*base, "--poll-interval", "0.5"]) == 0
    assert started[-1][NODE_POLL_ENV] == "0.5"
    assert main(base) == 0
    assert NODE_POLL_ENV not in started[-1]      # the launcher's default
    monkeypatch.setenv(NODE_POLL_ENV, "1")
    assert main(base) == 0
    assert started[-1][NODE_POLL_ENV] == "1"
    with pytest.raises(SystemExit):
        main([*base, "--poll-interval", "0"])
    assert site_env(3)[NODE_POLL_ENV] == "3"
    with pytest.raises(FlowerDeployError, match=NODE_POLL_ENV):
        site_env(float("nan"))


def test_a_local_federation_passes_it_to_every_process(tmp_path: Path) -> None:
    assert LocalFederation(tmp_path / "a", node_poll=0.05).env[NODE_POLL_ENV] == "0.05"
    assert LocalFederation(tmp_path / "b", env={NODE_POLL_ENV: "3"}).env[NODE_POLL_ENV] == "3"


def test_flowers_telemetry_is_off_unless_the_user_turned_it_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every process medfl starts gets FLWR_TELEMETRY_ENABLED=0 (each ClientApp would send two
    HTTPS events: about 0.1 s of CPU a message), unless the environment says otherwise."""
    from medfl.flower.deploy import TELEMETRY_ENV, flower_env

    monkeypatch.delenv(TELEMETRY_ENV, raising=False)
    assert flower_env()[TELEMETRY_ENV] == "0" and site_env()[TELEMETRY_ENV] == "0"
    assert flower_env({TELEMETRY_ENV: "1"})[TELEMETRY_ENV] == "1"
    monkeypatch.setenv(TELEMETRY_ENV, "1")
    assert site_env()[TELEMETRY_ENV] == "1"


def test_the_site_logs_its_own_time_and_the_clientapps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the benchmark's breakdown reads: the ClientApp process says how long it had run
    (its request header), and the site logs that with the time it took to answer."""
    import threading

    import medfl.flower.worker as worker
    from flwr.app import ConfigRecord, RecordDict
    from medfl.flower import proxy

    assert proxy.process_age() is not None and proxy.process_age() > 0   # Linux /proc
    seen: list[tuple[str, float | None]] = []
    monkeypatch.setattr(worker, "handle", lambda site, kind, content, clientapp_age=None:
                        seen.append((kind, clientapp_age)) or content)
    sock = str(tmp_path / "w.sock")
    w = worker.SiteWorker(SimpleNamespace(client_id="0"), sock)
    monkeypatch.setattr(w, "_site", lambda: None)
    t = threading.Thread(target=lambda: w.handle_connection(w.server.accept()[0]), daemon=True)
    t.start()
    content = RecordDict({"medfl": ConfigRecord({"x": json.dumps(1)})})
    assert proxy.forward(sock, "train", content, timeout=30)["medfl"]["x"] == "1"
    t.join(30)
    w.stop()
    assert seen and seen[0][0] == "train" and seen[0][1] is not None and seen[0][1] > 0


def test_the_site_logs_how_long_it_took(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from medfl import wire
    from medfl.flower import protocol as P
    from medfl.flower.site import handle

    caplog.set_level(logging.DEBUG, logger="medfl")   # as `medfl flower site` sets it (log.txt gets DEBUG)
    site = SimpleNamespace(client_id="0", check=lambda ctl: None, _root=lambda ctl: tmp_path / "run",
                           hello=lambda ctl: {"sizes": {}, "digest": "d"}, models_guarded=lambda ctl: nullcontext())
    content = wire.answer("0")
    wire.put_json(content, P.CONTROL, {"protocol": wire.PROTOCOL, "client": "0", "run": "r1", "round": 3})
    handle(site, P.HELLO, content, clientapp_age=1.25)   # type: ignore[arg-type]
    handle(site, P.HELLO, content)                        # type: ignore[arg-type]
    lines = [ln for ln in (tmp_path / "run" / "log.txt").read_text().splitlines() if "answered in" in ln]
    assert len(lines) == 2
    assert " DEBUG medfl.flower.site: site 0: query.hello message, round 3: answered in " in lines[0]
    assert lines[0].endswith("; its ClientApp process had run 1.250 s when it forwarded the message")
    assert "ClientApp" not in lines[1]
