"""A hostile coordinator's NVFlare job: a site runs none of its text and lets it choose none of
the site's data, paths, state or client id. The job's bundle and overrides are read as plain
data (MONAI syntax anywhere in them is refused naming the key, before anything runs); at a site
with its own config (``MEDFL_SITE_CONFIG``) a job that sets the data set, its root, the work
folder or another client id is refused naming the key; a site without an approvals file answers
nothing unless it opts out by name."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("nvflare", reason="NVIDIA FLARE is medfl's optional extra: pip install -e '.[nvflare]'")

from nvflare.apis.fl_context import FLContext  # noqa: E402
from nvflare.apis.fl_constant import ReservedKey  # noqa: E402

from medfl.site import SiteError  # noqa: E402
from medfl.nvflare.executor import MedflExecutor  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "flower"))
from test_coordinator_text import FL, expression  # noqa: E402

NAMES = {"site-1": "0", "site-2": "1"}


def _ctx(tmp_path: Path, name: str = "site-1") -> FLContext:
    ctx = FLContext()
    ctx.set_prop(ReservedKey.IDENTITY_NAME, name)
    workspace = SimpleNamespace(get_root_dir=lambda: str(tmp_path / "ws"))
    ctx.put(ReservedKey.ENGINE, SimpleNamespace(get_workspace=lambda: workspace), private=True, sticky=False)
    return ctx


@pytest.fixture
def own_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A site with its own bundle config, serving client 0."""
    config = tmp_path / "site.json"
    config.write_text(json.dumps({"fl": {**FL, "dataset": {**FL["dataset"], "root": str(tmp_path / "data")}}}))
    monkeypatch.setenv("MEDFL_SITE_CONFIG", str(config))
    monkeypatch.setenv("MEDFL_CLIENT_ID", "0")
    return config


@pytest.mark.parametrize("where, change", [
    ("overrides: key 'fl#progress' holds", lambda job, m: job["overrides"].update({"fl#progress": expression(m)})),
    ("bundle: key 'fl#train#lr' holds", lambda job, m: job["bundle"]["fl"].update(train={"lr": expression(m)})),
    ("bundle: key 'imports#0' holds", lambda job, m: job["bundle"].update(imports=["$import os"])),
    ("bundle: key 'fl#model#_target_'", lambda job, m: job["bundle"]["fl"].update(model={"_target_": "os.getcwd"})),
    ("key 'workdir' holds", lambda job, m: job.update(workdir=expression(m))),
])
def test_monai_syntax_in_a_job_is_refused_before_anything_runs(tmp_path: Path, where: str, change: Any) -> None:
    marker = tmp_path / "MARKER"
    job: dict[str, Any] = {"bundle": {"fl": json.loads(json.dumps(FL))}, "overrides": {"fl#backend": "nvflare"},
                           "client_ids": NAMES}
    change(job, marker)
    executor = MedflExecutor(**job)
    with pytest.raises(SiteError, match=rf"^medfl site 'site-1': the job: {where}") as info:
        executor.site(_ctx(tmp_path))
    assert "\n" not in str(info.value) and not marker.exists() and not (tmp_path / "ws").exists()


@pytest.mark.parametrize("job, said", [
    ({"overrides": {"fl#dataset#root": "/elsewhere"}}, r"overrides: key 'fl#dataset#root': the site's own setting"),
    ({"overrides": {"fl::dataset": {"name": "synthetic2d"}}}, r"overrides: key 'fl::dataset': the site's own setting"),
    ({"overrides": {"fl#plugin_names": {}}}, r"overrides: key 'fl#plugin_names': the site's own setting"),
    ({"overrides": {"site": "x"}}, r"overrides: key 'site': the site's own setting"),
    ({"workdir": "/elsewhere"}, r"key 'workdir' \('/elsewhere'\): where this site reads its files is its own"),
    ({"client_ids": {"site-1": "1"}}, r"key 'client_ids': names client '1' for this site, which serves client '0'"),
])
def test_a_site_with_its_own_config_lets_a_job_choose_none_of_its_settings(
        tmp_path: Path, own_config: Path, job: dict[str, Any], said: str) -> None:
    executor = MedflExecutor(bundle={"fl": FL}, **{"client_ids": NAMES, **job})
    with pytest.raises(SiteError, match=rf"^medfl site 'site-1': the job: {said}.*\(refused\)$"):
        executor.site(_ctx(tmp_path))


def test_a_site_with_its_own_config_reads_its_own_data_and_takes_run_settings(
        tmp_path: Path, own_config: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The job's run settings reach the site (its data, client id and state stay the site's);
    without MEDFL_CLIENT_ID the site names no client and is refused."""
    executor = MedflExecutor(bundle={"fl": {**FL, "dataset": {"name": "synthetic2d", "root": "/job"}}},
                             overrides={"fl#rounds": 3, "fl#partition": {"name": "dirichlet", "alpha": 1.0}},
                             client_ids=NAMES)
    site = executor.site(_ctx(tmp_path))
    assert site.client_id == "0" and site.cfg["rounds"] == 3 and site.cfg["partition"]["name"] == "dirichlet"
    assert site.cfg["dataset"]["root"] == str(tmp_path / "data")
    assert site.settings.state_dir == (tmp_path / "ws" / "medfl_state").resolve()
    monkeypatch.delenv("MEDFL_CLIENT_ID")
    with pytest.raises(SiteError, match=r"names the client it serves itself: set MEDFL_CLIENT_ID \(refused\)"):
        MedflExecutor(bundle={"fl": FL}, client_ids=NAMES).site(_ctx(tmp_path))


def test_a_site_without_approvals_answers_nothing_unless_it_opts_out_by_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MEDFL_APPROVALS")
    executor = MedflExecutor(bundle={"fl": FL}, client_ids=NAMES)
    with pytest.raises(SiteError, match=r"refused: no approvals file \(MEDFL_APPROVALS is not set.*"
                                        r"MEDFL_APPROVALS=none to run any installed method"):
        executor.site(_ctx(tmp_path))
    monkeypatch.setenv("MEDFL_APPROVALS", "none")
    assert executor.site(_ctx(tmp_path)).client_id == "0"
    assert os.environ["MEDFL_APPROVALS"] == "none"


def _choices() -> dict[str, list[str]]:
    """docs/privacy.md's *What the coordinator chooses, and what the site chooses*: the
    backticked names of each row's first cell, by who chooses them."""
    import re

    doc = (Path(__file__).resolve().parents[2] / "docs" / "privacy.md").read_text()
    section = doc.split("## What the coordinator chooses, and what the site chooses")[1].split("\n## ")[0]
    out: dict[str, list[str]] = {"site": [], "coordinator": []}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("|") and len(cells) == 4 and cells[1] in out:
            out[cells[1]] += re.findall(r"`([^`]+)`", cells[0])
    return out


def test_the_privacy_docs_table_of_who_chooses_what_is_what_a_site_enforces(
        tmp_path: Path, own_config: Path) -> None:
    """Every ``fl`` setting the table gives the site is refused as a job override at a site with
    its own config; every one it gives the coordinator is taken."""
    from medfl.config import DEFAULTS, FL_OPTIONAL

    choices = _choices()
    site_keys = [k.removeprefix("fl.") for k in choices["site"] if k.startswith("fl.")]
    assert site_keys == ["dataset", "plugin_names"] and "delta" not in site_keys
    for key in [*site_keys, "device", "threads"]:
        with pytest.raises(SiteError, match=rf"key 'fl#{key}': the site's own setting"):
            MedflExecutor(bundle={"fl": FL}, overrides={f"fl#{key}": None}).site(_ctx(tmp_path))
    taken = [k for k in choices["coordinator"] if k in {**DEFAULTS, **FL_OPTIONAL}]
    assert {"train", "filters", "rounds", "partition", "num_clients"} <= set(taken), taken
    overrides = {f"fl#{k}": FL[k] for k in taken if k in FL}
    assert MedflExecutor(bundle={"fl": FL}, overrides=overrides).site(_ctx(tmp_path)).client_id == "0"


#: the hostile jobs of the simulator test: (what the site's environment adds, the change to the
#: job's client app, what each site's refusal says)
HOSTILE = {
    "expression": (False, lambda args, m: args.setdefault("overrides", {}).update({"fl#progress": expression(m)}),
                   r"the job: overrides: key 'fl#progress' holds .*MONAI config syntax"),
    "data root": (True, lambda args, m: args.setdefault("overrides", {}).update({"fl#dataset#root": str(m.parent)}),
                  r"the job: overrides: key 'fl#dataset#root': the site's own setting"),
    "work folder": (True, lambda args, m: args.update(workdir=str(m.parent)),
                    r"the job: key 'workdir' \(.*\): where this site reads its files is its own"),
}


@pytest.mark.parametrize("case", HOSTILE)
def test_a_hostile_job_is_refused_by_every_site_in_nvflare_simulator(tmp_path: Path, case: str) -> None:
    """NVFlare's own simulator (its SimEnv: `medfl nvflare simulate`), each site with an
    approvals file whose policy caps epsilon at 3 (and, for the data root and work folder, a
    config of its own, as `medfl nvflare site` writes): the job with one hostile change is
    refused by both sites with their reason, the server ends without waiting out its connect
    timeout, and the expression never ran."""
    import re

    from test_nvflare import run_bounded

    from medfl.cli import main
    from medfl.nvflare.job import SITE_ENV_FILE, write_job

    own_config, change, said = HOSTILE[case]
    marker = tmp_path / "elsewhere" / "MARKER"
    marker.parent.mkdir()
    fl = {**FL, "dataset": {**FL["dataset"], "root": str(tmp_path / "data")}, "output_dir": str(tmp_path / "runs")}
    config = tmp_path / "fl.json"
    config.write_text(json.dumps({"fl": fl}))
    approvals = tmp_path / "approvals.json"
    approvals.write_text(json.dumps({"medfl_approvals": 2, "approved": [],
                                     "policy": {"max_epsilon": 3, "max_epsilon_total": 3}}))
    result = tmp_path / "result.json"
    job = write_job(tmp_path / "jobs", config, result_file=str(result), round_timeout=600, connect_timeout=600)
    client = job / "app" / "config" / "config_fed_client.json"
    app = json.loads(client.read_text())
    change(app["executors"][0]["executor"]["args"], marker)
    client.write_text(json.dumps(app))
    site = ["--config", str(config), "--client-id", "0"] if own_config else []
    ws = tmp_path / "ws" / "medfl"   # where SimEnv runs the job medfl
    assert main(["nvflare", "site", "--workspace", str(ws), "--approvals", str(approvals), *site]) == 0
    env_file = ws / "local" / SITE_ENV_FILE
    cmd = f". {env_file} && exec {sys.executable} -m medfl nvflare simulate {job} --workspace-root {ws.parent}"
    _, printed = run_bounded(["bash", "-c", cmd], cwd=tmp_path)
    assert result.is_file(), printed[-3000:]
    outcome = json.loads(result.read_text())
    assert not outcome["ok"], outcome
    for name in NAMES:
        assert re.search(rf"NVFlare client {name}: SiteError: medfl site '{name}': {said}", outcome["error"]), outcome
    assert not marker.exists() and not list(tmp_path.rglob("site_0")), "nothing ran at a site"
