"""A site runs only the plugins its operator approved (name, version, code hash).

The sites run in this process behind the loop-back grid of ``test_coordinator.py``: a
refusal travels to the coordinator as Flower does it (the ClientApp's exception becomes an
error reply) and fails the run with a :class:`SiteFailure` naming the site and the reason.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.approval import APPROVALS_ENV, Approvals, ApprovalError, check_control, code_identity  # noqa: E402
from medfl.cli import main  # noqa: E402
from medfl.config import resolve_config  # noqa: E402
from medfl.flower.server import SiteFailure, run_flower_experiment  # noqa: E402
from medfl.flower.site import Site, SiteError  # noqa: E402
from medfl.plugins import get_plugin_manager  # noqa: E402

from contract_methods import methods_registered  # noqa: E402
from flower_cases import FEDAVG, fl_config  # noqa: E402
from test_coordinator import FAST, LoopGrid, _sites, task_identity  # noqa: E402,F401  (autouse fixture)

PLUGIN = '''
"""A third-party method plugin, as a site would have it installed."""
from medfl import hookimpl
from medfl_plugins.baselines import FedAvg


class {cls}(FedAvg):
    name = "{name}"


@hookimpl
def register_methods(register):
    register({cls})
'''


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A method plugin written to a module file under ``tmp_path`` and registered."""
    import importlib

    name = f"thirdparty_{tmp_path.name[-6:].replace('-', '_')}"
    mod = f"medfl_test_plugin_{name}"
    path = tmp_path / "site_packages" / f"{mod}.py"
    path.parent.mkdir()
    path.write_text(PLUGIN.format(cls="ThirdParty", name=name))
    monkeypatch.syspath_prepend(str(path.parent))
    module = importlib.import_module(mod)
    pm = get_plugin_manager()
    pm.register(module, name=mod)
    try:
        yield name, path
    finally:
        pm.unregister(name=mod)


def _approve(path: Path, *names: str) -> None:
    assert main(["approve", *names, "--file", str(path)]) == 0


def _run(tmp_path: Path, method: str, name: str) -> dict[str, Any]:
    fl = fl_config(tmp_path, name, {**FEDAVG, "rounds": 1, "eval_every": 0, "methods": [{"name": method}]})
    return run_flower_experiment(resolve_config(fl), LoopGrid(_sites(tmp_path, fl)), FAST)


def test_an_approved_method_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    out = _run(tmp_path, "fedavg", "ok")
    assert out["summaries"]["fedavg"]["rounds"] == 1
    entry = json.loads(approvals.read_text())["approved"][0]
    assert (entry["kind"], entry["name"], entry["distribution"]) == ("method", "fedavg", "medfl")
    assert len(entry["sha256"]) == 64 and any(f.endswith("baselines.py") for f in entry["files"])


def test_an_unapproved_method_is_refused_and_the_coordinator_names_the_site(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedskd")
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    with pytest.raises(SiteFailure, match=r"site 0 failed in train of round 1 .*SiteError: medfl site 0: refused "
                                          r"method 'fedavg' \(medfl .*\): it is not in the approvals file .*"
                                          r"`medfl approve fedavg --kind method --file "):
        _run(tmp_path, "fedavg", "refused")


def test_a_plugin_whose_code_changed_after_approval_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plugin: tuple[str, Path]) -> None:
    name, source = plugin
    approvals = tmp_path / "approvals.json"
    _approve(approvals, name)
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    assert _run(tmp_path, name, "before")["summaries"][name]["rounds"] == 1
    source.write_text(source.read_text() + "\n# one more line, e.g. code that copies the data elsewhere\n")
    with pytest.raises(SiteFailure, match=rf"site 0 .*refused method '{name}' .*its source files changed since it "
                                          r"was approved: sha256 \w+\.\.\., approved \w+\.\.\."):
        _run(tmp_path, name, "after")


def test_another_version_than_the_approved_one_is_refused(tmp_path: Path) -> None:
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    data = json.loads(approvals.read_text())
    data["approved"][0]["version"] = "0.0.1"
    approvals.write_text(json.dumps(data))
    with pytest.raises(ApprovalError, match=r"approved one is medfl 0\.0\.1, the installed one medfl "):
        check_control({"method": {"name": "fedavg"}}, "site", path=approvals)


def test_the_check_runs_before_any_plugin_code_and_covers_every_message(tmp_path: Path) -> None:
    """Filters (a later plugin kind) are checked like methods; hello carries no plugin."""
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    check_control({"protocol": 1}, "site", path=approvals)                      # hello: nothing to run
    check_control({"method": {"name": "fedavg", "mu": 1}}, "site", path=approvals)
    with pytest.raises(ApprovalError, match="refused filter 'dp_noise': unknown plugin kind 'filter'|"
                                            "refused filter 'dp_noise': no filter"):
        check_control({"method": {"name": "fedavg"}, "filters": [{"name": "dp_noise"}]}, "site", path=approvals)


def test_without_approvals_a_site_runs_any_installed_method_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import medfl.approval

    monkeypatch.delenv(APPROVALS_ENV, raising=False)
    monkeypatch.setattr(medfl.approval, "_WARNED", set())   # warned once per process: not by an earlier test
    assert _run(tmp_path, "fedavg", "open")["summaries"]["fedavg"]["rounds"] == 1
    assert "medfl site 0: running method 'fedavg' without approval" in capsys.readouterr().err


def test_approve_list_and_revoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    approvals = tmp_path / "a.json"
    _approve(approvals, "fedavg", "fedprox")
    assert main(["approve", "--list", "--file", str(approvals)]) == 0
    listed = capsys.readouterr().out
    assert "method 'fedavg' (medfl" in listed and "ok: the installed code is the approved code" in listed
    assert main(["approve", "fedprox", "--revoke", "--file", str(approvals)]) == 0
    assert set(Approvals.load(approvals).entries) == {("method", "fedavg")}
    assert main(["approve", "no_such_method", "--file", str(approvals)]) == 2
    assert "no method 'no_such_method' is installed here" in capsys.readouterr().err
    with pytest.raises(ApprovalError, match="not found"):
        Approvals.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"approved": 3}')
    with pytest.raises(ApprovalError, match="not a medfl approvals file"):
        Approvals.load(tmp_path / "bad.json")


def test_site_command_checks_its_approvals_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``medfl flower site --approvals FILE``: a missing file stops the site before it
    starts; a good one is enforced through the environment the site worker reads."""
    from medfl.cli import _site_approvals

    monkeypatch.setenv(APPROVALS_ENV, "")
    with pytest.raises(SystemExit, match="medfl site 2: approvals file .*nope.json not found"):
        _site_approvals(argparse.Namespace(approvals=str(tmp_path / "nope.json"), client_id="2"))
    _site_approvals(argparse.Namespace(approvals=None, client_id="2"))
    assert "WARNING: no --approvals file" in capsys.readouterr().err
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    _site_approvals(argparse.Namespace(approvals=str(approvals), client_id="2"))
    assert os.environ[APPROVALS_ENV] == str(approvals.resolve())


def test_code_identity_of_a_runtime_plugin(plugin: tuple[str, Path]) -> None:
    name, source = plugin
    ident = code_identity("method", name)
    assert ident.files == (source.name,) and ident.distribution.startswith("(none")
    with pytest.raises(ApprovalError, match="unknown plugin kind 'gadget'"):
        code_identity("gadget", name)


# ---------------------------------------------------------------------- the evaluation model
def test_a_leaking_evaluation_model_is_refused_at_the_site(tmp_path: Path) -> None:
    """``cross_test`` over Flower sends each site's evaluation model; the site compares it
    with its own data first (the check of :meth:`Site.evaluate`)."""
    from medfl_plugins.baselines import FedAvg

    class LeakyEval(FedAvg):
        name = "leaky_eval"

        def client_eval_model(self, client: Any, instruction: Any) -> torch.nn.Module:
            model = super().client_eval_model(client, instruction)
            model.register_buffer("stash", torch.tensor(client.dataset("global_test").labels).float())
            return model

    with methods_registered(LeakyEval, name="leaky-eval-test"):
        fl = fl_config(tmp_path, "leaky", {**FEDAVG, "rounds": 1, "eval_splits": ["test", "cross_test"],
                                            "methods": [{"name": "leaky_eval"}]})
        fl["dataset"]["num_samples"] = 240
        with pytest.raises(SiteFailure, match=r"site 0 failed in evaluate .*PayloadError: evaluation model of "
                                              r"site 0\['stash'\]: holds the labels of client 0's global_test"):
            run_flower_experiment(resolve_config(fl), LoopGrid(_sites(tmp_path, fl)), FAST)


def test_site_check_refuses_before_building_the_method(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from medfl.flower import protocol as P

    fl = fl_config(tmp_path, "direct", FEDAVG)
    site: Site = _sites(tmp_path, fl)[101]
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedskd")
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    built = []
    monkeypatch.setattr(Site, "method", lambda self, ctl: built.append(ctl) or None)
    with pytest.raises(SiteError, match="medfl site 0: refused method 'fedavg'"):
        site.check({"protocol": P.PROTOCOL, "client": "0", "method": {"name": "fedavg"}})
    assert built == []
