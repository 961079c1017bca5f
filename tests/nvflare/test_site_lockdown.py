"""An NVFlare site locked down by ``medfl nvflare site``: its class allow-list is medfl's classes
alone and enforced (NVFlare's own authorizer refuses any other class, and in its simulator a job
naming one fails), its authorization policy lets no role deploy a job with custom code (for which
NVFlare skips the allow-list), its environment file sets the site's approvals and absolute paths;
bad inputs are refused in one line; and the server ends as soon as no site is left to wait for,
with each site's reason, however long its connect timeout."""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("nvflare", reason="NVIDIA FLARE is medfl's optional extra: pip install -e '.[nvflare]'")

from nvflare.apis.fl_constant import FLContextKey, ReservedKey  # noqa: E402
from nvflare.apis.fl_context import FLContext  # noqa: E402
from nvflare.apis.fl_exception import UnsafeComponentError  # noqa: E402
from nvflare.apis.signal import Signal  # noqa: E402
from nvflare.app_common.widgets.component_path_authorizer import ComponentPathAuthorizer  # noqa: E402
from nvflare.fuel.sec.authz import AuthzContext, Person  # noqa: E402
from nvflare.lighter.constants import DEFINED_ROLES  # noqa: E402
from nvflare.security.security import FLAuthorizer  # noqa: E402
from test_nvflare import NAMES, _Engine, _fl, _LoopController  # noqa: E402

from medfl.cli import main  # noqa: E402
from medfl.nvflare.executor import SITE_ENV, MedflExecutor  # noqa: E402
from medfl.nvflare.job import COMPONENTS, SITE_ENV_FILE  # noqa: E402

#: a class NVFlare's default allow-list has: an executor that is not medfl's
OTHER = "nvflare.app_common.executors.model_learner_executor.ModelLearnerExecutor"
#: a provisioned kit's local/authorization.json.default (NVFlare 2.9's `nvflare poc prepare`)
KIT_POLICY = {"format_version": "1.0", "permissions": {
    "project_admin": "any",
    "org_admin": {"submit_job": "none", "clone_job": "none", "manage_job": "o:submitter", "download_job": "o:submitter",
                  "view": "any", "operate": "o:site", "shell_commands": "o:site", "byoc": "none",
                  "server-predeployed-flwr": "none"},
    "lead": {"submit_job": "any", "clone_job": "n:submitter", "manage_job": "n:submitter",
             "download_job": "n:submitter", "view": "any", "operate": "o:site", "shell_commands": "o:site",
             "byoc": "any", "server-predeployed-flwr": "none"},
    "member": {"view": "any"}}}
#: what an existing resources file holds besides the allow-list (kept)
KIT_RESOURCES = {"format_version": 2, "class_list_enforcement_mode": "warn", "class_allow_list": [OTHER, "nvflare."],
                 "allow_log_streaming": True,
                 "client": {"retry_timeout": 30}, "components": [{"id": "resource_manager", "path": "x.Y", "args": {}}]}
#: the longest a loop-back job may take here before the test stops it (it takes seconds)
LIMIT = 120.0


def _approvals(tmp_path: Path) -> Path:
    path = tmp_path / "approvals.json"
    path.write_text(json.dumps({"medfl_approvals": 2, "approved": []}))
    return path


def _allowed(policy: dict[str, Any], role: str, right: str) -> bool:
    """Whether NVFlare's site authorizer, with ``policy``, grants ``right`` to a user of ``role``."""
    user = Person("user@org", "org", role)
    return FLAuthorizer("org", policy).authorize(AuthzContext(right=right, user=user, submitter=user))[0]


@pytest.mark.parametrize("kit", [True, False], ids=["provisioned kit", "empty workspace"])
def test_the_site_builds_medfl_alone_deploys_no_custom_code_and_has_its_own_environment(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], kit: bool) -> None:
    """From a provisioned kit's ``local/`` (or nothing): NVFlare's authorizer allows medfl's two
    classes and refuses another, except in a job with custom code, which no role may now deploy
    (the kit's other rights are unchanged); the other resources are kept; the environment file,
    sourced by a shell, sets absolute paths and unsets what was not given; a second run writes
    the same files."""
    monkeypatch.chdir(tmp_path)
    ws, approvals = tmp_path / "my site", _approvals(tmp_path)
    (tmp_path / "site.json").write_text(json.dumps({"fl": {}}))
    if kit:
        (ws / "local").mkdir(parents=True)
        (ws / "local" / "resources.json.default").write_text(json.dumps(KIT_RESOURCES))
        (ws / "local" / "authorization.json.default").write_text(json.dumps(KIT_POLICY))
        (ws / "startup").mkdir()
        (ws / "startup" / "start.sh").write_text("")
    argv = ["nvflare", "site", "--workspace", str(ws), "--approvals", "approvals.json", "--config", "site.json",
            "--client-id", "3", "--state-dir", "state", "--workdir", "."]
    assert main(argv) == 0
    out = capsys.readouterr().out
    local = ws / "local"
    resources = json.loads((local / "resources.json").read_text())
    assert resources["class_allow_list"] == list(COMPONENTS) and resources["class_list_enforcement_mode"] == "enforce"
    assert resources["allow_log_streaming"] is False   # else NVFlare adds its JobLogStreamer to every job
    if kit:
        assert {k: resources[k] for k in ("format_version", "client", "components")} == {
            k: KIT_RESOURCES[k] for k in ("format_version", "client", "components")}
    authorizer, workspace = ComponentPathAuthorizer(), SimpleNamespace(get_resources_file_path=lambda: str(
        local / "resources.json"))
    for path in COMPONENTS:
        authorizer.authorize_component_config({"path": path}, workspace=workspace)
    with pytest.raises(UnsafeComponentError, match=f"'{re.escape(OTHER)}' .* is not in allow_list"):
        authorizer.authorize_component_config({"path": OTHER}, workspace=workspace)
    byoc = FLContext()   # a job with custom code: NVFlare checks none of its classes
    byoc.set_prop(FLContextKey.JOB_META, {"byoc": True}, private=True, sticky=False)
    authorizer.authorize_component_config({"path": OTHER}, fl_ctx=byoc, workspace=workspace)

    policy = json.loads((local / "authorization.json").read_text())
    assert not any(_allowed(policy, role, "byoc") for role in DEFINED_ROLES)
    before = KIT_POLICY if kit else {"format_version": "1.0", "permissions": {r: "any" for r in DEFINED_ROLES}}
    for role in DEFINED_ROLES:
        for right in ("submit_job", "view", "ls", "abort_job", "server-predeployed-flwr", "check_resources"):
            assert _allowed(policy, role, right) == _allowed(before, role, right), (role, right)

    env_file = local / SITE_ENV_FILE
    shown = subprocess.run(["bash", "-c", f'. "{env_file}" && env'], capture_output=True, text=True, check=True,
                           env={**os.environ, "MEDFL_DEVICE": "cuda:9"}).stdout
    env = {k: v for k, v in (line.split("=", 1) for line in shown.splitlines() if "=" in line)
           if k in ("MEDFL_APPROVALS", *SITE_ENV.values())}
    assert env == {"MEDFL_APPROVALS": str(approvals), "MEDFL_SITE_CONFIG": str(tmp_path / "site.json"),
                   "MEDFL_CLIENT_ID": "3", "MEDFL_STATE_DIR": str(tmp_path / "state"), "MEDFL_WORKDIR": str(tmp_path)}
    assert all(Path(env[k]).is_absolute() for k in env if k != "MEDFL_CLIENT_ID")
    for name in ("resources.json", "authorization.json", SITE_ENV_FILE):
        assert str(local / name) in out, out
    assert ("start the site: " if kit else "simulate: ") in out, out

    written = {p.name: p.read_text() for p in local.iterdir()}
    assert main(argv) == 0
    assert {p.name: p.read_text() for p in local.iterdir()} == written


#: bad inputs: the arguments (beside --workspace ws), a file to put at ws/local first, and the error line
REFUSED = [
    (["--approvals", "missing.json"], None, r"--approvals: approvals file \S*missing.json not found"),
    (["--approvals", "site.json"], None, r"approvals file \S*site.json is not a medfl approvals file"),
    (["--approvals", "none", "--config", "nowhere.json", "--client-id", "0"], None,
     r"--config nowhere.json: no such file"),
    (["--approvals", "none", "--config", "site.json"], None, r"--config site.json: .* give --client-id too"),
    (["--approvals", "none"], ("resources.json", "{not json"), r"resources.json: not JSON \(.*line 1\)"),
    (["--approvals", "none"], ("authorization.json.default", "[]"),
     r"authorization.json.default: NVFlare's authorization policy must be a JSON object, not a JSON list"),
    (["--approvals", "none"], ("authorization.json", json.dumps({"format_version": "1.0", "permissions": []})),
     r"authorization.json: 'permissions' must map each role to its rights"),
    (["--approvals", "none"], ("authorization.json", json.dumps({"format_version": "2", "permissions": {"a": "any"}})),
     r"authorization.json: not an authorization policy NVFlare accepts: .*format_version"),
]


@pytest.mark.parametrize("args, existing, said", REFUSED)
def test_bad_inputs_are_refused_in_one_line_and_nothing_is_written(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], args: list[str],
        existing: tuple[str, str] | None, said: str) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "site.json").write_text(json.dumps({"fl": {}}))
    if existing:
        (tmp_path / "ws" / "local").mkdir(parents=True)
        (tmp_path / "ws" / "local" / existing[0]).write_text(existing[1])
    assert main(["nvflare", "site", "--workspace", "ws", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and re.search(said, err), err
    assert sorted(p.name for p in (tmp_path / "ws").rglob("*") if p.is_file()) == ([existing[0]] if existing else [])


@pytest.mark.parametrize("case", ["unapproved dataset", "no approvals file", "one site serves no client"])
def test_the_server_ends_as_soon_as_no_site_is_left_to_wait_for(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    """Every NVFlare client of the job refuses (or one joins and the other serves a client the
    run does not have): with a connect timeout of a million seconds the job still ends at once,
    naming each site and its reason."""
    ids = dict(NAMES)
    if case == "unapproved dataset":
        monkeypatch.setenv("MEDFL_APPROVALS", str(_approvals(tmp_path)))
    elif case == "no approvals file":
        monkeypatch.delenv("MEDFL_APPROVALS", raising=False)
    else:
        monkeypatch.setenv("MEDFL_APPROVALS", "none")
        ids["site-2"] = "7"
    fl = _fl(tmp_path, "early")
    fl["methods"] = [{"name": "fedavg"}]
    job = {"bundle": {"fl": fl}, "overrides": {"fl#backend": "nvflare"}}
    result = tmp_path / "result.json"
    controller = _LoopController({n: MedflExecutor(**job, client_ids=ids) for n in NAMES}, tmp_path / "state", **job,
                                 result_file=str(result), round_timeout=1e6, connect_timeout=1e6, hello_timeout=1e6)
    engine, ctx, abort = _Engine(NAMES), FLContext(), Signal()
    ctx.put(ReservedKey.ENGINE, engine, private=True, sticky=False)
    limit = threading.Timer(LIMIT, abort.trigger, args=("the test's limit",))
    limit.start()
    try:
        controller.control_flow(abort, ctx)
    finally:
        limit.cancel()
    assert not abort.triggered, f"the job waited for its sites more than {LIMIT} s"
    outcome = json.loads(result.read_text())
    said = outcome["error"]
    assert not outcome["ok"] and engine.panics == [f"medfl: {said}"]
    if case == "one site serves no client":
        assert re.search(r"no NVFlare client serves client\(s\) \['1'\] .*\(connected: \['0'\]\); refused .*site-2",
                         said), said
        return
    assert re.search(r"no NVFlare client serves client\(s\) \['0', '1'\] .*\(connected: \[\]\)", said), said
    reason = "refused dataset 'synthetic2d'" if case == "unapproved dataset" else "MEDFL_APPROVALS"
    for name in NAMES:
        assert re.search(f"NVFlare client {name}: SiteError: .*{reason}", said), said


def test_a_job_naming_another_class_fails_at_a_locked_site_in_nvflare_simulator(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """NVFlare's simulator (its SimEnv, given the job through NVFlare's own job API) enforces the
    site's class allow-list (its authorization policy it does not: the simulator authorizes
    everything): medfl's job with its executor swapped for one of NVFlare's default list fails
    at each site, naming the class; `medfl nvflare simulate` refuses such a job folder itself."""
    from nvflare.app_common.executors.model_learner_executor import ModelLearnerExecutor
    from nvflare.job_config.api import FedJob
    from nvflare.recipe import SimEnv

    from medfl.nvflare.controller import MedflController
    from medfl.nvflare.transport import TASKS

    fl = _fl(tmp_path, "other")
    fl.update(num_clients=1, methods=[{"name": "fedavg"}], rounds=1, backend="nvflare")
    result = tmp_path / "result.json"
    job = FedJob(name="medfl", min_clients=1)
    job.set_app_packages(["medfl", "medfl_plugins"])
    job.to_server(MedflController(bundle={"fl": fl}, result_file=str(result), round_timeout=60, connect_timeout=60))
    job.to_clients(ModelLearnerExecutor(learner_id="learner"), tasks=list(TASKS))
    job.export_job(str(tmp_path / "jobs"))
    assert main(["nvflare", "simulate", str(tmp_path / "jobs" / "medfl"), "--workspace-root", str(tmp_path)]) == 2
    assert "not a job folder `medfl nvflare job` writes" in capfd.readouterr().err
    assert main(["nvflare", "site", "--workspace", str(tmp_path / "ws" / "medfl"), "--approvals", "none"]) == 0
    try:   # the simulator's own processes, bounded by the controller's connect timeout
        SimEnv(num_clients=1, workspace_root=str(tmp_path / "ws")).deploy(job)
    except RuntimeError:
        pass   # a failed simulation (SimEnv names its logs)
    said = "".join(capfd.readouterr())
    assert f"Component '{OTHER}' at config path 'executors.#1.executor' is not in allow_list" in said, said[-3000:]
    assert not json.loads(result.read_text())["ok"]
