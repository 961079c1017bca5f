"""A site's ClientApps start from a warm fork server, messages travel packed, and nobody
waits a whole second for content that is on its way (issue 50, item 4).

The fork server is started for real (in a child process: it forks, and it puts its
``flwr-clientapp`` first on ``PATH``) and asked to run Flower's own ``flwr-clientapp``; the
Flower deployments of the other tests run every message through it. Nothing is timed here:
``benchmarks/flower_overhead.py`` measures what it saves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from contextlib import nullcontext

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict  # noqa: E402

from medfl import wire  # noqa: E402
from medfl.flower import flwr_forks, flwr_launcher  # noqa: E402
from medfl.flower import protocol as P  # noqa: E402
from medfl.flower.proxy import (PACKED, decode_records, encode_records, pack_records, packed,  # noqa: E402
                                packed_bytes, unpack_records)

#: Generous: a loaded 2-core machine imports Flower in seconds, not minutes.
WAIT_S = 300


def _driver(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a fresh Python after the fork server started there (``folder``: its folder)."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, signal, subprocess, sys, time
        sys.path.insert(0, {str(Path(flwr_forks.__file__).parent)!r})
        import flwr_forks
        folder = flwr_forks.start()
        assert folder is not None, "the fork server did not start"
        print("FOLDER", folder, flush=True)
    """) + textwrap.dedent(body))
    env = {**os.environ, "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
    env.pop(flwr_forks.REAL_ENV, None)
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=WAIT_S,
                          env=env, cwd=tmp_path)


def test_the_stub_runs_flowers_clientapp_from_the_fork_server(tmp_path: Path) -> None:
    """What the SuperExec starts is Flower's own ``flwr-clientapp`` with its arguments, its
    working folder, environment and standard streams, and its exit code comes back; the fork
    server's folder is gone once the process that started it has ended."""
    res = _driver(tmp_path, """
        import shutil
        stub = shutil.which("flwr-clientapp")
        print("STUB", stub, flush=True)
        ok = subprocess.run(["flwr-clientapp", "--help"], capture_output=True, text=True, timeout=300)
        print("HELP", ok.returncode, json.dumps(ok.stdout), flush=True)
        bad = subprocess.run(["flwr-clientapp", "--no-such-option"], capture_output=True, text=True, timeout=300)
        print("BAD", bad.returncode, json.dumps(bad.stderr), flush=True)
        # the child runs in the stub's working folder: Flower's --token-file (relative) is read from there
        os.mkdir("elsewhere")
        open("elsewhere/token.txt", "w").write("")
        empty = subprocess.run(["flwr-clientapp", "--token-file", "token.txt", "--runtime-api-address",
                                "127.0.0.1:1"], capture_output=True, text=True, timeout=300, cwd="elsewhere")
        print("EMPTY", empty.returncode, json.dumps(empty.stderr[-2000:]), flush=True)
    """)
    assert res.returncode == 0, res.stderr
    out = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in res.stdout.splitlines() if " " in line}
    folder = out["FOLDER"]
    assert out["STUB"] == os.path.join(folder, "flwr-clientapp")
    code, text = out["HELP"].split(" ", 1)
    assert code == "0" and "usage: flwr-clientapp" in json.loads(text)   # the stub's stdout was the child's
    code, text = out["BAD"].split(" ", 1)
    assert code == "2" and "flwr-clientapp: error:" in json.loads(text)   # argparse, on the stub's stderr
    code, text = out["EMPTY"].split(" ", 1)
    assert code == "1" and "does not contain a token" in json.loads(text)   # found there (else "does not point to a file")
    assert not Path(folder).exists()


def test_the_stub_runs_flowers_own_clientapp_when_the_fork_server_is_gone(tmp_path: Path) -> None:
    res = _driver(tmp_path, """
        import socket
        pid = None
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    stat = open(f"/proc/{name}/stat").read()
                except OSError:
                    continue
                if int(stat[stat.rindex(")") + 2:].split()[1]) == os.getpid():
                    pid = int(name)
        for _ in range(600):                  # `ps -C medfl-forks` finds it (a condition, not a timing)
            if open(f"/proc/{pid}/comm").read().strip() == "medfl-forks":
                break
            time.sleep(0.1)
        print("NAME", open(f"/proc/{pid}/comm").read().strip(), flush=True)
        os.kill(pid, signal.SIGKILL)          # the fork server, killed: its socket is left with no one behind it
        os.waitpid(pid, 0)
        ok = subprocess.run(["flwr-clientapp", "--help"], capture_output=True, text=True, timeout=300)
        print("HELP", ok.returncode, json.dumps(ok.stdout), flush=True)
    """)
    assert res.returncode == 0, res.stderr
    assert "NAME medfl-forks" in res.stdout.splitlines()
    line = next(ln for ln in res.stdout.splitlines() if ln.startswith("HELP "))
    code, text = line.split(" ", 2)[1:]
    assert code == "0" and "usage: flwr-clientapp" in json.loads(text)


def test_a_superexec_asks_the_fork_server_itself(tmp_path: Path) -> None:
    """What a site's SuperExec does for each message (``flwr_forks.launch``): the same
    request as the stub's, from its own process, no stub started; the ClientApp gets the
    streams it is handed and its exit code comes back; a ``flwr-clientapp`` that is no fork
    server's stub is left to ``subprocess``."""
    res = _driver(tmp_path, """
        def run(argv):
            read, write = os.pipe()
            app = flwr_forks.launch(argv, (0, write, write))
            os.close(write)
            out = b""
            while True:                        # the pipe's end: the ClientApp has ended
                chunk = os.read(read, 65536)
                if not chunk:
                    break
                out += chunk
            for _ in range(3000):              # its exit code, said by the fork server (a condition)
                if app.poll() is not None:
                    break
                time.sleep(0.1)
            return app, out.decode()
        app, out = run(["--help"])
        print("HELP", app.returncode, app.conn is None, json.dumps(out), flush=True)
        app, out = run(["--no-such-option"])
        print("BAD", app.returncode, json.dumps(out), flush=True)
        print("OTHER", flwr_forks.launch(["--help"], command=sys.executable), flush=True)
        print("CHILDREN", sum(1 for n in os.listdir("/proc") if n.isdigit() and os.path.exists(f"/proc/{n}/stat")
              and int(open(f"/proc/{n}/stat").read().rsplit(")", 1)[1].split()[1]) == os.getpid()), flush=True)
    """)
    assert res.returncode == 0, res.stderr
    out = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in res.stdout.splitlines() if " " in line}
    code, closed, text = out["HELP"].split(" ", 2)
    assert code == "0" and closed == "True" and "usage: flwr-clientapp" in json.loads(text)
    code, text = out["BAD"].split(" ", 1)
    assert code == "2" and "flwr-clientapp: error:" in json.loads(text)
    assert out["OTHER"] == "None"
    assert out["CHILDREN"] == "1"          # the fork server only: no stub was started


class _Subprocess(SimpleNamespace):
    """A stand-in ``subprocess`` module that records what it was asked to start."""

    DEVNULL = subprocess.DEVNULL

    def __init__(self) -> None:
        super().__init__(started=[])

    def Popen(self, args, *more, **options):  # noqa: ANN001, ANN201, N802
        self.started.append((args, more, options))
        return "popen"


def test_the_superexec_starts_a_clientapp_without_its_stub_and_anything_else_as_before() -> None:
    asked: list[tuple] = []
    apps = iter([SimpleNamespace(poll=lambda: None), SimpleNamespace(poll=lambda: 0), None])

    def launch(argv, fds):  # noqa: ANN001, ANN202
        asked.append((argv, fds, [os.path.exists(f"/proc/self/fd/{fd}") for fd in fds]))
        return next(apps)

    sub = _Subprocess()
    starter = flwr_launcher._ClientAppStarter(sub, SimpleNamespace(launch=launch))
    first = starter.Popen(["flwr-clientapp", "--token", "t", "--insecure"])
    assert asked[-1][:2] == (["--token", "t", "--insecure"], (0, 1, 2)) and sub.started == []
    quiet = starter.Popen(["flwr-clientapp", "--token", "u"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    fds = asked[-1][1]
    assert fds[0] == 0 and fds[1] == fds[2] > 2 and asked[-1][2] == [True, True, True]   # /dev/null, open then
    assert not os.path.exists(f"/proc/self/fd/{fds[1]}")                                  # and closed after
    assert starter.running == [first, quiet]
    assert starter.Popen(["flwr-clientapp", "--token", "v"]) == "popen"       # the fork server could not
    assert sub.started[-1] == (["flwr-clientapp", "--token", "v"], (), {})    # -> the stub, as before
    assert starter.running == [first]                                          # the ended one is let go
    assert starter.Popen(["flwr-serverapp", "--x"]) == "popen"
    assert starter.Popen(["flwr-clientapp"], stdout=subprocess.PIPE) == "popen" and len(asked) == 3
    assert starter.DEVNULL == subprocess.DEVNULL


def test_this_flowers_superexec_starts_clientapps_as_expected(monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """The hook fits this Flower (1.42): its executor starts a task's process with
    ``subprocess.Popen(args)``. A Flower release that does otherwise fails here."""
    import importlib

    executor = importlib.import_module("flwr.supercore.superexec.executor.subprocess_executor")
    monkeypatch.setattr(executor, "subprocess", subprocess)
    assert flwr_launcher.direct_clientapps(flwr_forks) is True
    assert isinstance(executor.subprocess, flwr_launcher._ClientAppStarter)
    assert flwr_launcher.direct_clientapps(flwr_forks) is True
    monkeypatch.setattr(executor, "subprocess", SimpleNamespace())
    assert flwr_launcher.direct_clientapps(flwr_forks) is False
    assert "starts its ClientApps otherwise" in capsys.readouterr().err


def test_how_clientapps_start_is_a_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert flwr_forks.mode({}) == "fork"
    assert flwr_forks.mode({flwr_forks.MODE_ENV: " Flower "}) == "flower"
    with pytest.raises(ValueError, match=flwr_forks.MODE_ENV):
        flwr_forks.mode({flwr_forks.MODE_ENV: "spawn"})
    monkeypatch.setenv(flwr_forks.MODE_ENV, "spawn")
    assert flwr_launcher.main(["flower-supernode", "--help"]) == 2   # refused before anything of Flower runs


def test_a_missing_flwr_clientapp_leaves_flowers_start(monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    assert flwr_forks.start() is None
    assert "flwr-clientapp not found on PATH" in capsys.readouterr().err


def test_content_on_its_way_is_asked_for_again_soon(monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """Flower's first wait for a message's missing content is 1 s; medfl's processes wait
    FIRST_PULL_WAIT, doubling as Flower does; another Flower's pulls are left as they are."""
    from flwr.supercore.inflatable import inflatable_utils as iu

    for fn in (iu.pull_objects, iu.pull_and_inflate_object_from_tree):
        monkeypatch.setitem(fn.__kwdefaults__, "initial_backoff", 1)
    assert flwr_forks.pace_pulls() is True
    assert iu.pull_objects.__kwdefaults__["initial_backoff"] == flwr_forks.FIRST_PULL_WAIT == 0.05
    assert iu.pull_and_inflate_object_from_tree.__kwdefaults__["initial_backoff"] == 0.05
    assert flwr_forks.pace_pulls(2.0) is False        # never longer than Flower's
    assert iu.pull_objects.__kwdefaults__["initial_backoff"] == 0.05

    monkeypatch.setattr(iu, "pull_objects", lambda *a, **k: None)
    assert flwr_forks.pace_pulls() is False
    assert "pulls a message's content otherwise" in capsys.readouterr().err


# ---------------------------------------------------------------- messages travel packed
def _content() -> RecordDict:
    content = wire.answer("0")
    wire.put(content, "reply.payload", {"w": __import__("torch").arange(6.0).reshape(2, 3)}, "test")
    return content


def _objects(content: RecordDict) -> list[str]:
    """The Flower objects a message with ``content`` travels as (a request each on every hop)."""
    from flwr.app import Message
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 0
    try:
        return sorted(type(o).__name__ for o in get_all_nested_objects(Message(content, dst_node_id=1,
                                                                               message_type=P.TRAIN)).values())
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def test_a_packed_content_is_one_record_and_comes_back_the_same() -> None:
    content = _content()
    box = pack_records(content)
    assert list(box) == [PACKED] and len(box[PACKED]) == 1          # one record, one entry
    assert isinstance(box[PACKED], ConfigRecord)                     # small: the bytes of a config record
    assert _objects(box) == ["ConfigRecord", "Message", "RecordDict"]
    assert len(_objects(content)) > 3
    assert packed_bytes(box) == encode_records(content)
    back = unpack_records(box)
    assert encode_records(back) == encode_records(content)
    assert wire.encoded_size(back) == wire.encoded_size(content)     # the traffic medfl records is unchanged
    assert packed_bytes(content) is None and unpack_records(content) is content


def test_a_large_packed_content_is_one_array_in_flowers_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above Flower's chunk size the bytes go as one array, which Flower cuts into chunks:
    no single request carries a whole model."""
    from flwr.common import constant

    from medfl.flower import proxy

    content = _content()
    data = encode_records(content)
    monkeypatch.setattr(constant, "FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE", len(data) - 1)
    assert proxy.inline_max() == len(data) - 1
    box = pack_records(content)
    assert isinstance(box[PACKED], ArrayRecord)
    assert _objects(box).count("ArrayChunk") >= 1 and "ConfigRecord" not in _objects(box)
    assert packed_bytes(box) == data
    assert encode_records(unpack_records(box)) == data


@pytest.mark.parametrize("bad, match", [
    (lambda: RecordDict({PACKED: ArrayRecord({"records": Array(dtype="uint8", shape=(3,), stype="x",
                                                                data=b"abc")})}), "stype 'x'"),
    (lambda: RecordDict({PACKED: ConfigRecord({"records": "abc"})}), "holds bytes; got str"),
    (lambda: RecordDict({PACKED: ConfigRecord({"other": b"abc"})}), "one entry 'records'"),
    (lambda: RecordDict({PACKED: pack_records(_content())[PACKED], "more": ConfigRecord({})}), "one record"),
    (lambda: packed(b"\xff\x00garbage"), "bytes are not a record dict"),
])
def test_a_malformed_packed_content_is_one_clear_error(bad, match: str) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match=match):
        unpack_records(bad())


def test_a_site_answers_a_packed_message_packed(tmp_path: Path) -> None:
    from medfl.flower.site import handle

    site = SimpleNamespace(client_id="0", check=lambda ctl: None, _root=lambda ctl: tmp_path / "run",
                           hello=lambda ctl: {"sizes": {"train": 3}, "digest": 7},
                           models_guarded=lambda ctl: nullcontext())
    content = wire.answer("0")
    wire.put_json(content, P.CONTROL, {"protocol": wire.PROTOCOL, "client": "0"})
    plain = handle(site, P.HELLO, content)   # type: ignore[arg-type]
    boxed = handle(site, P.HELLO, pack_records(content))   # type: ignore[arg-type]
    assert packed_bytes(plain) is None
    assert packed_bytes(boxed) == encode_records(plain)
    assert wire.take_json(decode_records(packed_bytes(boxed)), P.CONTROL, "test")["sizes"] == {"train": 3}


def test_the_proxy_hands_packed_bytes_to_the_worker_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """The per-message ClientApp decodes nothing: the packed bytes go to the site worker and
    its answer's bytes come back packed."""
    from flwr.app import Context, Message
    from flwr.supercore.task_identity import TaskIdentity

    from medfl.flower import proxy

    seen: list[bytes] = []
    monkeypatch.setattr(proxy, "forward_bytes", lambda sock, kind, data, timeout=None: seen.append(data) or b"ANSWER")
    monkeypatch.setattr(proxy, "decode_records", lambda data: pytest.fail("the proxy decoded a packed message"))
    box = pack_records(_content())
    monkeypatch.setattr(TaskIdentity, "_run_id", 1, raising=False)   # Flower stamps messages with the task's run
    monkeypatch.setattr(TaskIdentity, "_node_id", 0, raising=False)
    monkeypatch.setattr(TaskIdentity, "_task_id", 0, raising=False)
    msg = Message(box, dst_node_id=1, message_type=P.TRAIN)
    ctx = Context(run_id=1, node_id=1, node_config={"worker": "/tmp/w.sock"}, state=RecordDict(), run_config={})
    reply = proxy._dispatch(msg, ctx)
    assert seen == [packed_bytes(box)]
    assert packed_bytes(reply.content) == b"ANSWER"


def test_each_forked_clientapp_draws_its_own_randomness() -> None:
    """Forks share their parent's NumPy generator state; each ClientApp is seeded afresh, as a
    new process is (Flower's SecAgg+ quantizes with ``np.random.rand``)."""
    import numpy as np

    np.random.seed(0)
    r, w = os.pipe()
    for _ in range(2):
        pid = os.fork()
        if pid == 0:   # pragma: no cover - the child
            try:
                flwr_forks._fresh_randomness()
                os.write(w, np.random.bytes(8))
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
    os.close(w)
    draws = os.read(r, 16)
    os.close(r)
    assert len(draws) == 16 and draws[:8] != draws[8:]
