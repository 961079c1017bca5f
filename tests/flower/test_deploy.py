"""The commands and files of a Flower deployment (no process started here)."""

from __future__ import annotations

import ast
import json
import tempfile
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.flower.deploy import (  # noqa: E402
    FlowerDeployError, node_config, run_config_toml, site_command, started_run_id, superlink_command, write_app,
)
from medfl.flower.server import RUN_CONFIG  # noqa: E402


def test_run_config_travels_as_toml_whatever_its_quotes() -> None:
    """`medfl flower run ... --fl#name "it's"`: the overrides' JSON holds both quote characters,
    which Flower's inline key=value form cannot carry."""
    rc = {"config": "/data/my bundle/train.json", "overrides": json.dumps({"fl#name": "it's", "fl#rounds": 2}),
          "round-timeout": 600.0, "rounds": 0, "resume": "", "flag": True}
    assert tomllib.loads(run_config_toml(rc)) == rc
    with pytest.raises(FlowerDeployError, match="'bad': expected a string, number or bool, got list"):
        run_config_toml({"bad": [1]})


def test_flower_app_names_medfls_components_and_run_config(tmp_path: Path) -> None:
    app = write_app(tmp_path / "app")
    meta = tomllib.loads((app / "pyproject.toml").read_text())
    assert meta["tool"]["flwr"]["app"]["components"] == {"serverapp": "medfl.flower.server:app",
                                                         "clientapp": "medfl_flower_proxy:app"}
    assert meta["tool"]["flwr"]["app"]["config"] == RUN_CONFIG
    # Flower starts the ClientApp once per message: at import it must load neither torch nor medfl
    tree = ast.parse((app / "medfl_flower_proxy.py").read_text())
    top = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    top += [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]
    assert top and not [m for m in top if m.split(".")[0] in ("torch", "medfl", "monai")], top


def test_commands(tmp_path: Path) -> None:
    sl = superlink_command("0.0.0.0", 9100)
    # the launcher's supervisor: Flower's SuperLink command and a SuperExec started again when it exits
    assert sl[1].endswith("flwr_launcher.py") and sl[2:4] == ["supervise", "--superexec"]
    superexec = json.loads(sl[4])
    assert Path(superexec[0]).name == "flower-superexec"
    assert superexec[1:] == ["--runtime-api-address", "127.0.0.1:9100", "--insecure"]   # bind-all: the loop-back
    assert sl[5] == "--" and Path(sl[6]).name == "flower-superlink" and sl[7:] == ["--host", "0.0.0.0", "--port", "9100",
                      "--disable-runtime-dependency-installation", "--isolation", "process", "--insecure"]
    tls = superlink_command("hub.example", 9100, insecure=False, root_certificates=tmp_path / "ca.pem",
                            extra=["--ssl-ca-certfile", str(tmp_path / "ca.pem")])
    assert json.loads(tls[4])[1:] == ["--runtime-api-address", "hub.example:9100", "--root-certificates",
                                      str((tmp_path / "ca.pem").resolve())]
    with pytest.raises(FlowerDeployError, match="needs the CA"):
        superlink_command("hub.example", 9100, insecure=False)
    cmd = site_command("2", tmp_path / "train.json", tmp_path / "state", "hub:9100", port=9200,
                       overrides={"fl#dataset#root": "/data"})
    nc = cmd[cmd.index("--node-config") + 1]
    assert f"config='{tmp_path / 'train.json'}'" in nc and "client-id='2'" in nc
    assert """overrides='{"fl#dataset#root": "/data"}'""" in nc
    assert "superlink='hub:9100'" in nc     # what a method measures the coordinator's latency against
    with pytest.raises(FlowerDeployError, match="contains a single quote"):
        node_config("0", tmp_path / "it's.json", tmp_path)
    assert started_run_id("Loading project...\nSuccessfully started run 7469108812\nStarting logstream") == 7469108812
    assert started_run_id("flwr: cannot connect") is None


def test_flower_run_command_sends_the_run_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`medfl flower run`: what the ServerApp is told (no process is started: flwr_run is caught)."""
    import medfl.flower.deploy as deploy
    from medfl.cli import main

    sent: list[dict] = []
    monkeypatch.setattr(deploy, "flwr_run", lambda app, superlink, rc, **kw: sent.append(
        {"app": app, "superlink": superlink, **rc, "app_there": (Path(app) / "medfl_flower_proxy.py").is_file()}) or 0)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)   # TMPDIR is read again
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.json").write_text("{}")
    assert main(["flower", "run", "train.json", "--insecure", "--superlink", "hub:9100", "--round-timeout", "30",
                 "--fl#rounds", "3", "--fl#name", "it's"]) == 0
    rc = sent[-1]
    assert rc["superlink"] == "hub:9100" and rc.pop("app_there")
    assert not list((tmp_path / "tmp").iterdir())   # the app and Flower's home are gone once the run has ended
    assert rc["config"] == str(tmp_path.resolve() / "train.json") and rc["workdir"] == str(tmp_path.resolve())
    assert json.loads(rc["overrides"]) == {"fl#rounds": 3, "fl#name": "it's"}
    assert (rc["round-timeout"], rc["connect-timeout"], rc["hello-timeout"]) == (30.0, 300.0, 60.0)
    assert rc["progress-interval"] == 15.0
    assert "resume" not in rc and rc["result-file"].endswith(".json")
    assert set(rc) - {"app", "superlink"} <= set(RUN_CONFIG)

    assert main(["flower", "run", "--resume", "runs/demo", "--rounds", "4", "--insecure"]) == 0
    rc = sent[-1]
    rc.pop("app_there")
    assert rc["resume"] == str(tmp_path.resolve() / "runs" / "demo") and rc["rounds"] == 4
    assert "config" not in rc and "overrides" not in rc and "threads" not in rc
    assert rc["launch"] == "--superlink 127.0.0.1:9092 --insecure"   # what the run's resume hints repeat

    # --threads with --resume, as `medfl resume --threads 1` takes it (issue 51: it was refused)
    assert main(["flower", "run", "--resume", "runs/demo", "--threads", "1", "--root-certificates", "ca.pem"]) == 0
    rc = sent[-1]
    assert rc["threads"] == "1" and rc["launch"] == f"--superlink 127.0.0.1:9092 --root-certificates {tmp_path.resolve() / 'ca.pem'}"

    with pytest.raises(SystemExit, match="give a bundle config"):
        main(["flower", "run", "--insecure"])
    assert main(["flower", "run", "missing.json", "--insecure"]) != 0
    assert "missing.json: config file not found" in capsys.readouterr().err


def test_flower_site_command_takes_the_same_overrides_as_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`medfl flower site` takes any '#' path of the bundle config (``bundle_root=...`` too, as
    `medfl run` and `medfl flower run` do), and options that follow the overrides stay options
    (no process is started: run_site is caught)."""
    import medfl.flower.worker as worker
    from medfl.cli import main

    started: list[tuple] = []
    monkeypatch.setattr(worker, "run_site", lambda settings, cmd, env=None, restart=True: started.append((settings, cmd, restart)) or 0)
    monkeypatch.setattr(worker, "socket_for", lambda: str(tmp_path / "worker.sock"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.json").write_text('{"bundle_root": ".", "fl": {}}')
    base = ["flower", "site", "--client-id", "1", "--config", "train.json", "--state-dir", "state", "--insecure"]
    assert main([*base, "bundle_root=/x", "fl#dataset#root=/data", "--port", "9123", "--fl#rounds", "3"]) == 0
    settings, cmd, restart = started[-1]
    want = {"bundle_root": "/x", "fl#dataset#root": "/data", "fl#rounds": 3}
    assert settings.overrides == want and settings.client_id == "1" and restart is True
    assert cmd[cmd.index("--port") + 1] == "9123"
    nc = cmd[cmd.index("--node-config") + 1]
    assert f"overrides='{json.dumps(want)}'" in nc and f"worker='{tmp_path / 'worker.sock'}'" in nc
    assert main([*base, "--no-restart"]) == 0   # no override: none in the node config
    settings, cmd, restart = started[-1]
    assert restart is False
    assert settings.overrides == {} and "overrides=" not in cmd[cmd.index("--node-config") + 1]
    with pytest.raises(SystemExit, match="cannot read override 'bundle_root'"):
        main([*base, "bundle_root"])


def test_site_applies_any_bundle_override(tmp_path: Path) -> None:
    """A site's ``bundle_root`` override reaches the ``fl`` section through ``@bundle_root``."""
    from medfl.site import Site, SiteSettings

    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"bundle_root": "/nowhere", "data_dir": "$@bundle_root + '/data'",
                               "fl": {"dataset": {"name": "synthetic2d", "root": "@data_dir"}}}))
    site = Site(SiteSettings(client_id="0", config=cfg, state_dir=tmp_path / "state",
                             overrides={"bundle_root": str(tmp_path), "fl#seed": 3}))
    assert site.cfg["dataset"]["root"] == f"{tmp_path}/data" and site.cfg["seed"] == 3


def test_flower_run_command_stops_a_run_that_does_not_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`medfl flower run` leaves no run behind (no process started: flwr_run and flwr_stop are
    caught): a ServerApp that wrote its (failed) result but whose run does not end at the
    SuperLink within --exit-grace is stopped there, with one error line; a SIGTERM stops the
    run too and ends the command as Ctrl-C does (130)."""
    import os
    import signal

    import medfl.flower.deploy as deploy
    from medfl.cli import main

    stopped: list[int] = []
    monkeypatch.setattr(deploy, "flwr_stop", lambda run_id, home, **kw: stopped.append(run_id) or True)

    def never_ends(app, superlink, rc, *, watch, on_output, **kw):  # type: ignore[no-untyped-def]
        on_output("Successfully started run 42\n")
        Path(rc["result-file"]).write_text(json.dumps({"ok": False, "error": "RunError: no site"}))
        for _ in range(10**6):   # flwr run never returns: only the watch can end it
            reason = watch()
            if reason:
                raise deploy.FlowerDeployError(reason)
        raise AssertionError("the watch never gave up")

    monkeypatch.setattr(deploy, "flwr_run", never_ends)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.json").write_text("{}")
    assert main(["flower", "run", "train.json", "--insecure", "--exit-grace", "0"]) == 1
    err = capsys.readouterr().err
    assert [ln for ln in err.splitlines() if ln.startswith("medfl flower run:")] == [
        "medfl flower run: the run failed: RunError: no site"], err
    assert stopped == [42]

    def terminated(app, superlink, rc, *, on_output, **kw):  # type: ignore[no-untyped-def]
        on_output("Successfully started run 43\n")
        os.kill(os.getpid(), signal.SIGTERM)   # whoever ends the command
        raise AssertionError("SIGTERM did not interrupt the run")

    monkeypatch.setattr(deploy, "flwr_run", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert main(["flower", "run", "train.json", "--insecure"]) == 130
    assert stopped == [42, 43] and signal.getsignal(signal.SIGTERM) is before
    assert "medfl flower run: interrupted; run 43 stopped at the SuperLink" in capsys.readouterr().err


def test_local_federation_tells_its_sites_how_many_share_the_machine(tmp_path: Path) -> None:
    from local_federation import LocalFederation
    from medfl.config import LOCAL_SITES_ENV

    assert LocalFederation(tmp_path / "a", sites=3).env[LOCAL_SITES_ENV] == "3"
    assert LOCAL_SITES_ENV not in LocalFederation(tmp_path / "b").env
