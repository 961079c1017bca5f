"""medfl over NVIDIA FLARE: the job ``medfl nvflare job`` writes runs in NVFlare's simulator
(through its ``SimEnv``: ``medfl nvflare simulate``, not the deprecated ``nvflare simulator``)
with the in-process numbers, and names no folder of the machine that wrote it, so that it runs
moved elsewhere; over a loop-back controller (the job's controller and executors
in this process, each task handed to its site's executor at once: NVFlare's delivery without
its processes) every built-in method gives its in-process numbers or is refused by name, a
stopped run resumes through the job ``medfl nvflare job --resume`` writes, and a site's refusal
reaches the coordinator with the site's name; the ``nvflare`` backend outside a job says how
to write one."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pandas as pd
import pytest

pytest.importorskip("nvflare", reason="NVIDIA FLARE is medfl's optional extra: pip install -e '.[nvflare]'")

TESTS = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(TESTS / "engine"), str(TESTS / "flower")]   # the shared jobs and the virtual clock

import test_coordinator  # noqa: E402
from flower_cases import numeric_equal  # noqa: E402
from nvflare.apis.event_type import EventType  # noqa: E402
from nvflare.apis.fl_constant import FLContextKey, ReservedKey  # noqa: E402
from nvflare.apis.fl_context import FLContext  # noqa: E402
from nvflare.apis.signal import Signal  # noqa: E402
from test_builtin_numbers import BYTES_ATOL, JOBS, _DATA, assert_recorded  # noqa: E402

from medfl.config import resolve_config  # noqa: E402
from medfl.engine.runner import RunError  # noqa: E402
from medfl.experiment import run_experiment  # noqa: E402
from medfl.nvflare.executor import MedflExecutor  # noqa: E402
from medfl.site import REPRODUCIBLE_NOISE_ENV  # noqa: E402
from medfl.nvflare.controller import MedflController  # noqa: E402
from medfl.nvflare import RESUME_JOB  # noqa: E402
from medfl.nvflare.job import COMPONENTS, write_job, write_site  # noqa: E402

SIM_TIMEOUT = 900   # one simulator run, at most (generous: 120-220 s alone, more beside other tests)
#: what NVFlare 2.9 prints when ``nvflare simulator`` runs a job
DEPRECATED = "WARNING: 'nvflare simulator' is deprecated. Use 'python job.py' with SimEnv instead."


def run_bounded(args: list[str], timeout: float = SIM_TIMEOUT, **popen: Any) -> tuple[int, str]:
    """Run ``args`` for at most ``timeout`` s: its exit status and what it printed. Past that, it
    and every process under it are killed (NVFlare's simulator starts in a session of its own,
    which killing its parent alone would leave running) and the test fails."""
    import psutil

    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for child in psutil.Process(proc.pid).children(recursive=True):
            child.kill()
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"{shlex.join(args)} ran past {timeout} s:\n{out[-3000:]}")
    return proc.returncode, out


def simulate(job: Path, root: Path, *, cwd: Path, env: dict[str, str] | None = None) -> str:
    """``medfl nvflare simulate JOB --workspace-root ROOT`` (NVFlare's ``SimEnv``) in a process of
    its own, at most :data:`SIM_TIMEOUT` s: what it printed, without NVFlare's deprecation warning.
    ``ROOT/medfl`` must be locked down first (``medfl nvflare site``)."""
    _, said = run_bounded([sys.executable, "-m", "medfl", "nvflare", "simulate", str(job), "--workspace-root",
                           str(root)], cwd=cwd, env=env)
    assert DEPRECATED.split(".")[0] not in said, said[-3000:]
    return said

FL: dict[str, Any] = {
    "seed": 0, "num_clients": 2, "progress": False, "rounds": 2,
    "dataset": {"name": "synthetic2d", "num_samples": 64, "num_classes": 2, "image_size": 16, "noise": 0.5},
    "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8},
    "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8, "lr": 0.05},
    "methods": [{"name": "fedavg"}, {"name": "fedprox", "mu": 0.1}],
}


def _fl(work: Path, name: str) -> dict[str, Any]:
    fl = json.loads(json.dumps(FL))
    fl["dataset"]["root"] = str(work / "data")
    fl.update(name=name, output_dir=str(work / "runs"))
    return fl


#: the methods of the simulator run: their jobs in tests/engine/test_builtin_numbers.py share one
#: config (small_cnn, 3 clients; PFedCDP's public set, which the others ignore), and between them
#: they send every kind of message: plain and personalised updates (FedProx, FedKPer, FedSDC),
#: distilled releases (FedTPF), privacy noise drawn at the sites and a public set at the
#: coordinator (PFedCDP)
SIMULATED = ("fedprox", "fedkper", "fedsdc", "fedtpf", "pfedcdp")


def test_job_in_nvflare_simulator_gives_the_in_process_numbers(tmp_path: Path) -> None:
    """One job, 3 sites x 2 rounds, in NVFlare's own simulator (its server, clients and task
    exchange), run through NVFlare's SimEnv (``medfl nvflare simulate``; nothing deprecated
    said): each method's metrics are the numbers recorded for its in-process run (which
    tests/engine/test_builtin_numbers.py checks the in-process run still gives); no client state
    at the coordinator; each site kept its state in its own workspace."""
    fl = _method_fl(tmp_path, "pfedcdp", clients=len(NAMES3))
    fl.update(name="nv", methods=[JOBS[m][0] for m in SIMULATED])
    config = tmp_path / "fl.json"
    config.write_text(json.dumps({"fl": fl}))
    result = tmp_path / "result.json"
    job = write_job(tmp_path / "jobs", config, result_file=str(result), round_timeout=120, connect_timeout=120)
    assert {p.name for p in job.iterdir()} == {"meta.json", "app"} and not (job / "app" / "custom").exists()
    write_site(tmp_path / "ws" / "medfl", "none")   # medfl's classes only (the server reads this local/ too)
    env = {**os.environ, REPRODUCIBLE_NOISE_ENV: "1"}   # the sites draw their noise from the run seed
    said = simulate(job, tmp_path / "ws", cwd=tmp_path, env=env)
    assert result.is_file(), said[-3000:]
    outcome = json.loads(result.read_text())
    assert outcome["ok"], outcome
    assert json.loads((Path(outcome["dir"]) / "config.json").read_text())["engine"] == "nvflare"
    for method in SIMULATED:
        nv = Path(outcome["dir"]) / method
        assert_recorded(method, {f: (nv / f).read_text() for f in ("metrics.csv", "train_metrics.csv")})
        assert not list((nv / "clients").rglob("state_r*.pt")), "client state at the coordinator"
    for site, cid in NAMES3.items():
        assert list((tmp_path / "ws" / "medfl" / site / "medfl_state").rglob(f"site_{cid}/session.json")), site


def test_a_written_job_names_no_folder_of_the_writer_and_runs_moved_elsewhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`medfl nvflare job`, run in a folder of this machine on a config whose paths are relative,
    writes no path of it (that folder, the temporary folder, the repository, the virtualenv, the
    home folder) in any file of the job; moved to another folder and run from a third one in
    NVFlare's simulator (SimEnv), the job reads its data in each site's workspace, writes the
    run in the server's, and gives the in-process numbers."""
    from medfl.cli import main
    from medfl.nvflare.job import JOB_NAME

    writer = tmp_path / "writer"
    writer.mkdir()
    fl = {**json.loads(json.dumps(FL)), "name": "moved", "rounds": 1, "methods": [{"name": "fedavg"}]}
    fl["dataset"]["root"], fl["output_dir"] = "data", "runs"
    (writer / "train.json").write_text(json.dumps({"fl": fl}))
    monkeypatch.chdir(writer)
    assert main(["nvflare", "job", "--config", "train.json", "--out", "jobs", "--result-file", "result.json",
                 "--round-timeout", "120", "--connect-timeout", "120"]) == 0
    mine = {str(p) for p in (writer, tmp_path, TESTS.parent, Path(sys.prefix), Path.home())}
    files = [p for p in (writer / "jobs").rglob("*") if p.is_file()]
    assert {p.relative_to(writer / "jobs" / JOB_NAME).as_posix() for p in files} == {
        "meta.json", "app/config/config_fed_server.json", "app/config/config_fed_client.json"}
    for path in files:
        text = path.read_text()
        assert not [m for m in mine if m in text], (path, [m for m in mine if m in text])

    moved = tmp_path / "elsewhere" / "job"
    moved.parent.mkdir()
    (writer / "jobs" / JOB_NAME).rename(moved)
    (writer / "train.json").unlink()   # nothing of the writer's folder is read
    root, third = tmp_path / "simulation", tmp_path / "third"
    third.mkdir()
    write_site(root / JOB_NAME, "none")
    said = simulate(moved, root, cwd=third)
    server = root / JOB_NAME / "server"
    assert (server / "result.json").is_file(), said[-3000:]
    outcome = json.loads((server / "result.json").read_text())
    assert outcome == {"ok": True, "dir": str(server / "runs" / "moved")}, outcome
    for site in NAMES:
        assert (root / JOB_NAME / site / "data").is_dir(), site   # the relative data root, in the site's workspace
    left = [p for p in (*writer.rglob("*"), *third.rglob("*")) if p.is_file()]
    assert not left, f"written in the writer's or the caller's folder: {left}"

    monkeypatch.chdir(tmp_path)
    ref = Path(run_experiment(resolve_config({**fl, "output_dir": str(tmp_path / "ref")}))["dir"]) / "fedavg"
    for f in ("metrics.csv", "train_metrics.csv"):
        x, y = pd.read_csv(ref / f), pd.read_csv(server / "runs" / "moved" / "fedavg" / f)
        exact = [c for c in x.columns if not c.startswith("bytes_")]
        numeric_equal(x[exact], y[exact], f, atol=0.0)
        numeric_equal(x, y, f, atol=BYTES_ATOL)


def test_a_job_says_which_paths_of_its_config_are_absolute(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An absolute path in the config is read as it is on every machine: writing the job warns,
    naming each such key, and writes it unchanged (the config is the user's)."""
    fl = _fl(tmp_path, "absolute")
    fl["dataset"]["root"] = "data"
    config = tmp_path / "fl.json"
    config.write_text(json.dumps({"fl": fl}))
    with caplog.at_level("WARNING", logger="medfl"):
        job = write_job(tmp_path / "jobs", config)
    warned = [r.getMessage() for r in caplog.records if "absolute path" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"medfl nvflare job: fl.output_dir is an absolute path "
                                                     f"({tmp_path / 'runs'})"), warned
    assert _job_args(job)[0]["bundle"]["fl"]["output_dir"] == str(tmp_path / "runs")


virtual_clock = test_coordinator.virtual_clock   # autouse here too: a wait is a number of polls, not seconds

#: the NVFlare clients of the loop-back jobs (NVFlare's default names) and the client each serves
NAMES = {"site-1": "0", "site-2": "1"}
#: the sites of the jobs of tests/engine/test_builtin_numbers.py (3 clients: their recorded numbers)
NAMES3 = {**NAMES, "site-3": "2"}
#: built-in methods an NVFlare job refuses at its start, and what the refusal says
REFUSED = {"centralized": r"method 'centralized' pools every client's data in one place; it cannot run across "
                          r"sites over NVIDIA FLARE \(run it in process\)"}


class _Engine:
    """What the controller needs of NVFlare's server engine: the job's clients, and the
    events it fires (a system panic's reason is kept)."""

    def __init__(self, names: dict[str, str]) -> None:
        self.names = names
        self.panics: list[str] = []

    def get_clients(self) -> list[Any]:
        return [SimpleNamespace(name=n) for n in self.names]

    def fire_event(self, event_type: str, fl_ctx: FLContext) -> None:
        if event_type == EventType.FATAL_SYSTEM_ERROR:
            self.panics.append(str(fl_ctx.get_prop(FLContextKey.EVENT_DATA)))


class _LoopController(MedflController):
    """The job's controller whose ``send`` hands each task to its target's executor at once
    and the result to the task's callback (NVFlare's delivery, without its processes)."""

    def __init__(self, executors: dict[str, MedflExecutor], workspaces: Path, **args: Any) -> None:
        super().__init__(**args)
        self.executors = executors
        self.workspaces = workspaces

    def send(self, task: Any, fl_ctx: Any, targets: Any = None, **kw: Any) -> None:
        name = targets[0]
        ctx = FLContext()
        ctx.set_prop(ReservedKey.IDENTITY_NAME, name)
        # the client's engine, for its workspace (where the site keeps its state: medfl_state)
        workspace = SimpleNamespace(get_root_dir=lambda: str(self.workspaces / name))
        ctx.put(ReservedKey.ENGINE, SimpleNamespace(get_workspace=lambda: workspace), private=True, sticky=False)
        result = self.executors[name].execute(task.name, task.data, ctx, Signal())
        task.result_received_cb(SimpleNamespace(task=task, result=result, client=SimpleNamespace(name=name)), ctx)


def _job_args(job: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """The controller's and the executor's arguments in the job folder ``job``."""
    config = job / "app" / "config"
    server = json.loads((config / "config_fed_server.json").read_text())["workflows"][0]
    client = json.loads((config / "config_fed_client.json").read_text())["executors"][0]["executor"]
    assert (server["path"], client["path"]) == COMPONENTS
    return server["args"], client["args"]


def _loopback(work: Path, server: dict[str, Any], client: dict[str, Any], tag: str,
              names: dict[str, str] = NAMES) -> tuple[dict[str, Any], _Engine]:
    """Run a job's workflow over the loop-back controller, one site per NVFlare client of
    ``names``, each with its NVFlare workspace in ``work/state/NAME`` and so its state in
    ``work/state/NAME/medfl_state`` (kept across calls, as a site's); the outcome (the result
    file) and the engine (its panics)."""
    executors = {n: MedflExecutor(**client) for n in names}
    result = work / f"result_{tag}.json"
    controller = _LoopController(executors, work / "state", **{**server, "result_file": str(result),
                                                               "round_timeout": 5.0, "connect_timeout": 2.0,
                                                               "hello_timeout": 1.0})
    engine, ctx = _Engine(names), FLContext()
    ctx.put(ReservedKey.ENGINE, engine, private=True, sticky=False)
    controller.control_flow(Signal(), ctx)
    return json.loads(result.read_text()), engine


def _method_fl(work: Path, method: str, clients: int = len(NAMES)) -> dict[str, Any]:
    """``method``'s tiny job of tests/engine/test_builtin_numbers.py on ``clients`` clients, 2 rounds."""
    spec, job = JOBS[method]
    fl = json.loads(json.dumps({**_DATA, **job, "methods": [spec], "num_clients": clients, "rounds": 2}))
    fl["train"] = {**_DATA["train"], **job.get("train", {})}
    fl.update(name=method, output_dir=str(work / "runs"))
    fl["dataset"]["root"] = str(work / "data")
    if "client_models" in fl:
        fl["client_models"] = fl["client_models"][:clients]
    if "public_dataset" in fl:
        fl["public_dataset"]["root"] = str(work / "public")
    return fl


def _built_in() -> list[str]:
    from medfl.plugins import registry

    return sorted(n for n, r in registry()["method"].items() if r.distribution == "medfl")


@pytest.mark.parametrize("method", _built_in())
def test_every_built_in_method_gives_the_in_process_numbers_or_is_refused_by_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """The job's controller and executors, with the 3 clients x 2 rounds of the method's job in
    tests/engine/test_builtin_numbers.py: the numbers recorded there for the in-process run
    (which that test checks the in-process run still gives; the sites draw their noise from the
    run seed, as in process), or a refusal at the start naming the method and the reason (the
    job ends with a panic saying it)."""
    assert method in JOBS, "a built-in method without a job in tests/engine/test_builtin_numbers.py"
    monkeypatch.setenv(REPRODUCIBLE_NOISE_ENV, "1")
    fl = _method_fl(tmp_path, method, clients=len(NAMES3))
    bundle = {"bundle": {"fl": fl}, "overrides": {"fl#backend": "nvflare"}}
    outcome, engine = _loopback(tmp_path, bundle, {**bundle, "client_ids": NAMES3}, method, NAMES3)
    if method in REFUSED:
        assert not outcome["ok"] and re.search(REFUSED[method], outcome["error"]), outcome
        assert engine.panics == [f"medfl: {outcome['error']}"]
        return
    assert outcome["ok"], outcome
    nv = Path(outcome["dir"]) / method
    assert json.loads((nv.parent / "config.json").read_text())["engine"] == "nvflare"
    assert_recorded(method, {f: (nv / f).read_text() for f in ("metrics.csv", "train_metrics.csv")})
    assert not list((nv / "clients").rglob("state_r*.pt")), "client state at the coordinator"


def test_a_stopped_run_resumes_through_the_job_that_medfl_nvflare_job_resume_writes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A FedBN run (its norm layers stay at the sites) stopped after round 1 prints the command
    that writes the job continuing it; that job, run with the same sites, ends with the
    uninterrupted run's numbers, and `medfl resume` outside a job names the same command."""
    from medfl.cli import main

    monkeypatch.chdir(tmp_path)
    fl = {**_method_fl(tmp_path, "fedbn"), "stop_after_round": 1}
    (tmp_path / "fl.json").write_text(json.dumps({"fl": fl}))
    assert main(["nvflare", "job", "--config", "fl.json", "--out", "first"]) == 0
    outcome, _ = _loopback(tmp_path, *_job_args(tmp_path / "first" / "medfl"), "first")
    assert outcome["ok"], outcome
    run_dir = Path(outcome["dir"]) / "fedbn"
    assert not (run_dir / "summary.json").is_file()
    printed = re.findall(r"continue with `([^`]+)`", capsys.readouterr().out)
    assert printed == [f"medfl nvflare job --resume {run_dir} --out {RESUME_JOB}"]
    assert main(["resume", str(run_dir)]) == 2
    assert f"`{printed[0]}`" in capsys.readouterr().err

    assert main(shlex.split(printed[0])[1:]) == 0     # as pasted, in the server's directory
    server, client = _job_args(tmp_path / RESUME_JOB / "medfl")
    assert server["resume"] == str(run_dir)
    outcome, _ = _loopback(tmp_path, server, client, "resumed")   # restarted sites, on their state
    assert outcome == {"ok": True, "dir": str(run_dir)}
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2
    ref = Path(run_experiment(resolve_config({**fl, "name": "ref", "stop_after_round": None}))["dir"]) / "fedbn"
    for f in ("metrics.csv", "train_metrics.csv"):
        x, y = pd.read_csv(ref / f), pd.read_csv(run_dir / f)
        # a message's size may gain or lose a digit of a scalar's text (as the recorded numbers allow)
        exact = [c for c in x.columns if not c.startswith("bytes_")]
        numeric_equal(x[exact], y[exact], f, atol=0.0)
        numeric_equal(x, y, f, atol=BYTES_ATOL)
    sessions = json.loads((run_dir / "flower.json").read_text())["sessions"]
    assert [s["resumed_from"] for s in sessions] == [0, 1]


def test_a_site_that_refuses_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each site refuses its own dataset plugin (an empty approvals file): the job ends naming
    both NVFlare clients, the client each serves, and the reason, in NVFlare's terms."""
    approvals = tmp_path / "approvals.json"
    approvals.write_text(json.dumps({"medfl_approvals": 2, "approved": []}))
    monkeypatch.setenv("MEDFL_APPROVALS", str(approvals))
    fl = _fl(tmp_path, "refused")
    fl["methods"] = [{"name": "fedavg"}]
    bundle = {"bundle": {"fl": fl}, "overrides": {"fl#backend": "nvflare"}}
    outcome, engine = _loopback(tmp_path, bundle, {**bundle, "client_ids": NAMES}, "refused")
    assert not outcome["ok"] and engine.panics == [f"medfl: {outcome['error']}"]
    said = outcome["error"]
    assert re.search(r"no NVFlare client serves client\(s\) \['0', '1'\]", said), said
    for name, cid in NAMES.items():
        assert f"NVFlare client {name}: SiteError: medfl site {cid}: refused dataset 'synthetic2d'" in said, said
    assert "SuperNode" not in said and "Flower" not in said, said


def test_nvflare_backend_outside_a_job_names_the_job_command(tmp_path: Path) -> None:
    fl = _fl(tmp_path, "outside")
    fl["backend"] = "nvflare"
    with pytest.raises(RunError, match=r"medfl nvflare job --config CONFIG --out DIR"):
        run_experiment(resolve_config(fl))


def test_a_job_cannot_choose_where_a_site_keeps_its_ledger(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The state directory (the site's release ledger, what its privacy budget counts, and its
    noise key) is the site's: a job that sets one is refused when the site builds the executor;
    the site's own MEDFL_STATE_DIR, else its workspace, is where the state goes."""
    bundle = {"fl": _fl(tmp_path, "ledger")}
    with pytest.raises(ValueError, match=r"state_dir='/elsewhere'.*set MEDFL_STATE_DIR"):
        MedflExecutor(bundle=bundle, client_ids=NAMES, state_dir="/elsewhere")
    executor = MedflExecutor(bundle=bundle, client_ids=NAMES)
    ctx = FLContext()
    ctx.set_prop(ReservedKey.IDENTITY_NAME, "site-1")
    workspace = SimpleNamespace(get_root_dir=lambda: str(tmp_path / "ws"))
    ctx.put(ReservedKey.ENGINE, SimpleNamespace(get_workspace=lambda: workspace), private=True, sticky=False)
    assert executor.settings(ctx).state_dir == (tmp_path / "ws" / "medfl_state").resolve()
    monkeypatch.setenv("MEDFL_STATE_DIR", str(tmp_path / "own"))
    assert executor.settings(ctx).state_dir == (tmp_path / "own").resolve()
