"""A site's SuperExec is woken by its SuperNode when a message comes in, instead of asking it
for a task every 0.1 s (issue 50, item 4): the pipe between them, the SuperExec's waits, how the
SuperNode starts it, and what is left to Flower's own polling. Nothing here is timed (a wait
that should end at a byte is given a floor of minutes: a missed byte fails by the suite's
timeout, not by a clock); ``benchmarks/flower_overhead.py`` measures the CPU it saves, and the
deployment tests (``tests/flower/test_flower.py``...) run every SuperExec this way."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from flwr.app import Message, Metadata, RecordDict  # noqa: E402

from medfl.flower import flwr_launcher  # noqa: E402
from medfl.flower.flwr_launcher import (  # noqa: E402
    WAKE_FD_ENV, WAKER_FD_ENV, WOKEN_POLL, WokenTime, wait_for_wakes, wake_on_runs, wake_superexec,
)

LOOP = "flwr.supernode.start_client_internal"
EXEC_LOOP = "flwr.supercore.superexec.run_superexec"
LONG = 600.0   # a wait that must end at a byte, never at its timeout


class _Clock:
    """A stand-in ``time`` module that records the plain sleeps."""

    def __init__(self) -> None:
        self.slept: list[float] = []

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)

    def monotonic(self) -> float:
        return 7.0


def test_a_byte_ends_the_wait_and_each_byte_is_one_ask() -> None:
    read, write = os.pipe()
    clock = _Clock()
    woken = WokenTime(clock, read, floor=LONG)
    os.write(write, b"\0")
    woken.sleep(0.1)                         # ends at the byte (else: 10 minutes)
    assert woken.pending == 0 and clock.slept == []
    os.write(write, b"\0\0\0")               # three messages stored during one ask
    woken.sleep(0.1)
    assert woken.pending == 2
    woken.sleep(0.1), woken.sleep(0.1)       # two more asks at once, no wait
    assert woken.pending == 0 and clock.slept == []
    assert woken.monotonic() == 7.0          # the rest is the module
    os.close(write)


def test_without_a_byte_it_waits_at_least_the_floor_and_the_interval() -> None:
    read, write = os.pipe()
    woken = WokenTime(_Clock(), read, floor=0.01)
    start = time.monotonic()
    woken.sleep(0.05)                        # no byte: the longer of interval and floor
    assert time.monotonic() - start >= 0.05 * 0.9
    assert woken.pending == 0 and woken.fd == read
    assert WokenTime(_Clock(), os.pipe()[0]).floor == WOKEN_POLL == 1.0
    os.close(write)


def test_a_gone_supernode_gives_flowers_own_waits_back() -> None:
    read, write = os.pipe()
    clock = _Clock()
    woken = WokenTime(clock, read, floor=LONG)
    os.close(write)                          # no writer left: the pipe's end
    woken.sleep(0.1)
    assert woken.fd is None and clock.slept == [0.1]
    woken.sleep(0.1)
    assert clock.slept == [0.1, 0.1]         # the plain sleep from now on
    with pytest.raises(OSError):
        os.fstat(read)                       # closed, not leaked


def _stub_subprocess(calls: list[tuple]) -> SimpleNamespace:
    def popen(args, *more, **options):  # noqa: ANN001, ANN202
        calls.append((args, more, options))
        return SimpleNamespace(pid=1)
    return SimpleNamespace(Popen=popen, PIPE=subprocess.PIPE)


def test_the_supernode_starts_its_superexec_through_the_launcher_with_the_pipe() -> None:
    calls: list[tuple] = []
    read, write = os.pipe()
    starter = flwr_launcher._SuperExecStarter(_stub_subprocess(calls), read)
    starter.Popen(["flower-superexec", "--insecure", "--parent-pid", "9"])
    args, more, options = calls[-1]
    assert args == [sys.executable, os.path.abspath(flwr_launcher.__file__), "flower-superexec", "--insecure",
                    "--parent-pid", "9"]
    assert more == () and options["pass_fds"] == (read,) and options["env"][WAKE_FD_ENV] == str(read)
    assert options["env"]["PATH"] == os.environ["PATH"]      # the fork server's flwr-clientapp stays first
    with pytest.raises(OSError):
        os.fstat(read)                       # the SuperExec holds the read end; the SuperNode does not
    starter.Popen(["flower-superexec", "--insecure"])        # a second one: Flower's own command
    assert calls[-1] == (["flower-superexec", "--insecure"], (), {})
    starter.Popen(["other"], stdout=subprocess.PIPE)
    assert calls[-1] == (["other"], (), {"stdout": subprocess.PIPE})
    assert starter.PIPE == subprocess.PIPE
    os.close(write)


def test_this_flowers_supernode_wakes_on_each_message_for_a_clientapp(monkeypatch: pytest.MonkeyPatch) -> None:
    """The hooks fit this Flower (1.42): its SuperNode starts ``flower-superexec`` with
    ``subprocess.Popen(command)`` and stores each message with ``store_message``. A Flower
    release that does otherwise fails here instead of silently polling again."""
    from flwr.supernode.nodestate.in_memory_nodestate import InMemoryNodeState
    from flwr.supercore.object_store import ObjectStoreFactory

    loop = importlib.import_module(LOOP)
    monkeypatch.setattr(loop, "subprocess", subprocess)                              # restored after the test
    monkeypatch.setattr(InMemoryNodeState, "store_message", InMemoryNodeState.store_message)
    assert wake_superexec() is True
    starter = loop.subprocess
    assert isinstance(starter, flwr_launcher._SuperExecStarter)
    assert wake_superexec() is True and loop.subprocess is starter                  # once
    read = starter.fd
    os.set_blocking(read, False)
    state = InMemoryNodeState(ObjectStoreFactory().store())
    message = Message(RecordDict(), metadata=Metadata(
        run_id=3, message_id="", src_node_id=1, dst_node_id=5, reply_to_message_id="", group_id="1",
        created_at=time.time(), ttl=60.0, message_type="train"))                # as the SuperNode pulls it
    message.metadata.__dict__["_message_id"] = message.object_id
    assert state.store_message(message) == message.object_id
    assert os.read(read, 16) == b"\0"                                               # one message, one byte
    reply = Message(RecordDict(), reply_to=message)
    reply.metadata.__dict__["_message_id"] = reply.object_id
    state.store_message(reply)                                                        # a ClientApp's reply: none
    with pytest.raises(BlockingIOError):
        os.read(read, 16)
    os.close(read)


def test_another_flower_supernode_keeps_its_polling(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    loop = importlib.import_module(LOOP)
    other = SimpleNamespace(Popen=lambda *a, **k: None)
    monkeypatch.setattr(loop, "subprocess", other)
    assert wake_superexec() is False and loop.subprocess is other
    assert "instead of being woken" in capsys.readouterr().err


def test_the_superexec_waits_for_wakes_on_the_descriptor_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = importlib.import_module(EXEC_LOOP)
    monkeypatch.setattr(loop, "time", time)
    assert wait_for_wakes({}) is False and loop.time is time                      # not started by a SuperNode
    read, write = os.pipe()
    os.close(read)
    assert wait_for_wakes({WAKE_FD_ENV: str(read)}) is False and loop.time is time  # no such descriptor
    read, _ = os.pipe()
    monkeypatch.setenv(WAKE_FD_ENV, str(read))
    assert wait_for_wakes() is True
    assert isinstance(loop.time, WokenTime) and loop.time.fd == read
    assert WAKE_FD_ENV not in os.environ                                            # not for its ClientApps
    os.close(write)


def test_another_flower_superexec_keeps_its_polling(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    loop = importlib.import_module(EXEC_LOOP)
    other = SimpleNamespace(sleep=lambda s: None)
    monkeypatch.setattr(loop, "time", other)
    read, write = os.pipe()
    assert wait_for_wakes({WAKE_FD_ENV: str(read)}) is False and loop.time is other
    assert "instead of being woken" in capsys.readouterr().err
    with pytest.raises(OSError):
        os.fstat(read)
    os.close(write)


def test_the_superlink_wakes_its_superexec_when_it_creates_a_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both of this Flower's SuperLink states (in memory, ``--database``) create a run with
    ``create_run``: each new run (its ServerApp's task) writes a byte; a failed one (run id 0)
    does not."""
    from flwr.server.superlink.linkstate.in_memory_linkstate import InMemoryLinkState
    from flwr.server.superlink.linkstate.sql_linkstate import SqlLinkState

    made = iter([17, 0, 18])
    for cls in (InMemoryLinkState, SqlLinkState):
        monkeypatch.setattr(cls, "create_run", lambda self, *a, **k: next(made))   # restored after the test
    read, write = os.pipe()
    os.set_blocking(read, False)
    assert wake_on_runs({}) is False                                               # not under the supervisor
    monkeypatch.setenv(WAKER_FD_ENV, str(write))
    assert wake_on_runs() is True and WAKER_FD_ENV not in os.environ
    assert InMemoryLinkState.create_run(None, "fab", "1.0") == 17
    assert os.read(read, 16) == b"\0"
    assert SqlLinkState.create_run(None) == 0
    with pytest.raises(BlockingIOError):
        os.read(read, 16)
    assert SqlLinkState.create_run(None) == 18 and os.read(read, 16) == b"\0"
    wrapped = InMemoryLinkState.create_run
    assert wake_on_runs({WAKER_FD_ENV: str(write)}) is True and InMemoryLinkState.create_run is wrapped   # once
    os.close(read), os.close(write)


def test_the_supervisor_hands_the_pipe_to_the_superlink_and_its_superexec(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """``supervise`` starts Flower's ``flower-superexec`` through the launcher with the read end
    and the SuperLink with the write end (a SuperExec started again reads on the same pipe);
    another SuperExec command is started as it is."""
    started: list[tuple[list[str], dict, tuple]] = []

    class Child:
        returncode = 0

        def __init__(self, cmd, env=None, pass_fds=(), **_):  # noqa: ANN001
            started.append((cmd, env or {}, tuple(pass_fds)))
            self.pid = 99999999

        def poll(self):  # noqa: ANN202
            return 0                          # ends at once: the supervisor stops

        def wait(self, timeout=None):  # noqa: ANN001, ANN202
            return 0

        send_signal = kill = lambda self, *a: None

    monkeypatch.setattr(flwr_launcher.subprocess, "Popen", Child)
    monkeypatch.setattr(flwr_launcher.signal, "signal", lambda *a: None)
    monkeypatch.setattr(flwr_launcher, "_adopt_orphans", lambda: None)
    monkeypatch.setattr(flwr_launcher, "_children", lambda pid: [])   # no real child of this process is touched
    assert flwr_launcher.supervise(["link"], ["/venv/bin/flower-superexec", "--insecure"], grace=0.01) == 0
    (link, link_env, link_fds), (exe, exe_env, exe_fds) = started
    assert exe[:3] == [sys.executable, os.path.abspath(flwr_launcher.__file__), "flower-superexec"]
    assert exe[3:5] == ["--insecure", "--parent-pid"]
    assert exe_fds == (int(exe_env[WAKE_FD_ENV]),) and link_fds == (int(link_env[WAKER_FD_ENV]),)
    started.clear()
    flwr_launcher.supervise(["link"], ["my-superexec"], grace=0.01)
    assert started[1][0][0] == "my-superexec" and started[1][2] == () and WAKE_FD_ENV not in started[1][1]
