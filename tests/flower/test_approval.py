"""A site runs only the plugins its operator approved (name, version, code hash).

The sites run in this process behind the loop-back transport of ``test_coordinator.py``: a
refusal travels to the coordinator as Flower does it (the ClientApp's exception becomes an
error reply) and fails the run with a :class:`SiteFailure` naming the site and the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.approval import APPROVALS_ENV, Approvals, ApprovalError, check_control  # noqa: E402
from medfl.code_identity import code_identity  # noqa: E402
from medfl.cli import main  # noqa: E402
from medfl.config import resolve_config  # noqa: E402
from medfl.engine.remote import SiteFailure  # noqa: E402
from medfl.flower.server import run_flower_experiment  # noqa: E402
from medfl.site import Site, SiteError  # noqa: E402
from medfl.plugins import get_plugin_manager  # noqa: E402

from contract_methods import methods_registered  # noqa: E402
from flower_cases import FEDAVG, fl_config  # noqa: E402
from test_coordinator import FAST, LoopTransport, _sites  # noqa: E402

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
    """Approve the methods ``names`` and what every site runs besides a method (models,
    metrics, its dataset and partitioner), as a site's operator would."""
    for kind in ("model", "metric", "dataset", "partitioner"):
        assert main(["approve", "--all", "--kind", kind, "--file", str(path)]) == 0
    if names:
        assert main(["approve", *names, "--file", str(path)]) == 0


def _run(tmp_path: Path, method: str, name: str) -> dict[str, Any]:
    fl = fl_config(tmp_path, name, {**FEDAVG, "rounds": 1, "eval_every": 0, "methods": [{"name": method}]})
    return run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl)), FAST)


def test_an_approved_method_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    out = _run(tmp_path, "fedavg", "ok")
    assert out["summaries"]["fedavg"]["rounds"] == 1
    data = json.loads(approvals.read_text())
    entry = next(e for e in data["approved"] if e["kind"] == "method")
    assert (entry["kind"], entry["name"], entry["distribution"]) == ("method", "fedavg", "medfl")
    assert len(entry["sha256"]) == 64
    assert {"plugins/baselines.py", "medfl/hub.py"} <= set(data["code"][entry["sha256"]])
    assert len(data["code"]) == 1   # the built-ins share one listing of medfl's files
    # medfl's own files only: what its extras bring (MLflow, which the tracker plugin imports;
    # Ray) is the site's environment, like torch (before, 3,000 files of MLflow and its imports)
    tops = {f.split("/")[0] for f in data["code"][entry["sha256"]]}
    assert tops == {"medfl", "plugins"}, sorted(tops)


def test_medfl_s_extras_are_environment_not_pinned() -> None:
    """The distributions of medfl's extras (``.[tracking]``, ``.[simulation]`` through
    ``flwr[simulation]``) are environment where installed, like its requirements."""
    import importlib.util

    from medfl.code_identity import _environment

    base = _environment()[2]
    assert {"torch", "monai", "flwr"} <= base
    for dist, module in (("mlflow", "mlflow"), ("tensorboard", "tensorboard"), ("ray", "ray")):
        if importlib.util.find_spec(module) is not None:
            assert dist in base, dist


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
    with pytest.raises(SiteFailure, match=rf"site 0 .*refused method '{name}' .*its code changed since it was "
                                          rf"approved \(changed: {source.name}\): sha256 \w+\.\.\., approved \w+\.\.\."):
        _run(tmp_path, name, "after")


def test_a_data_file_an_approved_package_reads_is_pinned(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 49, item 6: a ``settings.txt`` changed after approval steered approved code. A
    package's data files are pinned with its source: the change is refused, naming the file."""
    import importlib

    name = f"pkgplugin_{tmp_path.name[-6:].replace('-', '_')}"
    pkg = tmp_path / "site_packages" / f"medfl_test_pkg_{name}"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(PLUGIN.format(cls="PkgPlugin", name=name))
    settings = pkg / "settings.txt"
    settings.write_text("lr 0.05\n")
    monkeypatch.syspath_prepend(str(pkg.parent))
    module = importlib.import_module(pkg.name)
    pm = get_plugin_manager()
    pm.register(module, name=pkg.name)
    try:
        approvals = tmp_path / "approvals.json"
        _approve(approvals, name)
        entry = next(e for e in json.loads(approvals.read_text())["approved"] if e["name"] == name)
        assert entry["sha256"]
        check_control({"method": {"name": name}}, "site", path=approvals)
        settings.write_text("lr 50\n")
        with pytest.raises(ApprovalError, match=rf"refused method '{name}' .*its code changed since it was approved "
                                                r"\(changed: .*settings\.txt\)"):
            check_control({"method": {"name": name}}, "site", path=approvals)
    finally:
        pm.unregister(name=pkg.name)


def test_another_version_than_the_approved_one_is_refused(tmp_path: Path) -> None:
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    data = json.loads(approvals.read_text())
    for entry in data["approved"]:
        entry["version"] = "0.0.1"
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
    assert {e for e in Approvals.load(approvals).entries if e[0] == "method"} == {("method", "fedavg")}
    assert main(["approve", "no_such_method", "--file", str(approvals)]) == 2
    assert "no method 'no_such_method' is installed here" in capsys.readouterr().err
    with pytest.raises(ApprovalError, match="not found"):
        Approvals.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"approved": 3}')
    with pytest.raises(ApprovalError, match="not a medfl approvals file"):
        Approvals.load(tmp_path / "bad.json")


def test_approve_checks_every_name_before_writing_or_printing(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """``medfl approve fedavg fedprox small_cnn``: the model among the methods is refused,
    naming the ``--kind`` that approves it, before anything is written or printed (issue 51,
    point 6: two "approved" lines, then a failure, and nothing written); ``--revoke`` too."""
    approvals = tmp_path / "a.json"
    assert main(["approve", "fedavg", "fedprox", "small_cnn", "--file", str(approvals)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and not approvals.exists(), out
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        "medfl: error: 'small_cnn' is not a method but a model plugin: approve it with --kind model "
        f"(`medfl approve small_cnn --kind model`); nothing was written to {approvals}"], err
    assert main(["approve", "fedavg", "fedprox", "--file", str(approvals)]) == 0
    assert main(["approve", "small_cnn", "--kind", "model", "--file", str(approvals)]) == 0
    before = approvals.read_text()
    capsys.readouterr()
    assert main(["approve", "fedavg", "small_cnn", "--revoke", "--file", str(approvals)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and approvals.read_text() == before, out
    assert f"method 'small_cnn' is not in {approvals} (it lists 'small_cnn' as a model: give --kind model)" in err


def test_site_command_checks_its_approvals_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """``medfl flower site --approvals FILE``: a missing file stops the site before it
    starts; a good one is enforced through the environment the site worker reads."""
    from medfl.cli.site import site_approvals

    monkeypatch.setenv(APPROVALS_ENV, "")
    with pytest.raises(SystemExit, match="medfl site 2: approvals file .*nope.json not found"):
        site_approvals(argparse.Namespace(approvals=str(tmp_path / "nope.json"), client_id="2"))
    site_approvals(argparse.Namespace(approvals=None, client_id="2"))
    assert "WARNING: no --approvals file" in capsys.readouterr().err
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    site_approvals(argparse.Namespace(approvals=str(approvals), client_id="2"))
    assert os.environ[APPROVALS_ENV] == str(approvals.resolve())
    assert main(["policy", "--max-epsilon", "3", "--max-epsilon-total", "none", "--file", str(approvals)]) == 0
    capsys.readouterr()
    site_approvals(argparse.Namespace(approvals=str(approvals), client_id="2"))
    assert "medfl site 2: privacy policy: max_epsilon: largest epsilon over a run 3" in capsys.readouterr().out


def test_code_identity_of_a_runtime_plugin(plugin: tuple[str, Path]) -> None:
    name, source = plugin
    ident = code_identity("method", name)
    assert source.name in ident.files and "medfl/hub.py" in ident.files
    assert ident.distribution.startswith("(none")
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
            run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl)), FAST)


def test_site_check_refuses_before_building_the_method(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from medfl.engine import protocol as P

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


# ---------------------------------------------------------------------- what an approval pins (issue 38, item 5)
HELPED = '''
"""A method plugin whose client step lives in a helper module it imports."""
from medfl import hookimpl
from medfl_plugins.baselines import FedAvg
from {helper} import scale


class Helped(FedAvg):
    name = "{name}"
    factor = scale()


@hookimpl
def register_methods(register):
    register(Helped)
'''


@pytest.fixture
def helped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, Path]]:
    """A method plugin (a module under ``tmp_path``) that imports a helper module beside it;
    yields its name and the helper's file."""
    import importlib

    tag = tmp_path.name[-6:].replace("-", "_")
    name, mod, helper = f"helped_{tag}", f"medfl_test_helped_{tag}", f"medfl_test_helper_{tag}"
    folder = tmp_path / "site_packages"
    folder.mkdir()
    (folder / f"{helper}.py").write_text("def scale():\n    return 1.0\n")
    (folder / f"{mod}.py").write_text(HELPED.format(helper=helper, name=name))
    monkeypatch.syspath_prepend(str(folder))
    module = importlib.import_module(mod)
    pm = get_plugin_manager()
    pm.register(module, name=mod)
    try:
        yield name, folder / f"{helper}.py"
    finally:
        pm.unregister(name=mod)


def test_an_edited_helper_module_of_a_plugin_is_refused_naming_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, helped: tuple[str, Path]) -> None:
    name, helper = helped
    approvals = tmp_path / "approvals.json"
    _approve(approvals, name)
    files = Approvals.load(approvals).entries[("method", name)]["files"]
    assert helper.name in files and "medfl/hub.py" in files
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    helper.write_text("def scale():\n    return 1.0   # and now also copies the labels elsewhere\n")
    with pytest.raises(SiteFailure, match=rf"site 0 .*refused method '{name}' .*its code changed since it was "
                                          rf"approved \(changed: {helper.name}\).*`medfl approve {name} --kind method"):
        _run(tmp_path, name, "helper")


def _plant_pyc(source: Path, planted_source: str) -> Path:
    """Write, where Python looks for ``source``'s bytecode, the bytecode of
    ``planted_source`` with ``source``'s mtime and size in its header (so that Python's
    timestamp check takes it for ``source``'s)."""
    import importlib.util
    import marshal

    st = source.stat()
    pyc = Path(importlib.util.cache_from_source(str(source)))
    pyc.parent.mkdir(parents=True, exist_ok=True)
    code = compile(planted_source, str(source), "exec", dont_inherit=True)
    pyc.write_bytes(importlib.util.MAGIC_NUMBER + (0).to_bytes(4, "little") + int(st.st_mtime).to_bytes(4, "little")
                    + st.st_size.to_bytes(4, "little") + marshal.dumps(code))
    return pyc


def test_planted_bytecode_is_refused(tmp_path: Path, helped: tuple[str, Path]) -> None:
    """A ``__pycache__/*.pyc`` beside an approved plugin's helper, with the source's mtime
    and size, is what Python would run: the site refuses it, naming the file."""
    name, helper = helped
    approvals = tmp_path / "approvals.json"
    _approve(approvals, name)
    check_control({"method": {"name": name}}, "site", path=approvals)
    pyc = _plant_pyc(helper, "def scale():\n    return 2.0\n")
    with pytest.raises(ApprovalError, match=rf"refused method '{name}': .*{helper.name}: its bytecode .*"
                                            rf"{pyc.name} is not compiled from its source"):
        check_control({"method": {"name": name}}, "site", path=approvals)
    # bytecode Python compiled from the source itself is not refused
    import py_compile

    py_compile.compile(str(helper), cfile=str(pyc), doraise=True)
    check_control({"method": {"name": name}}, "site", path=approvals)


def test_a_site_process_never_reads_planted_bytecode(tmp_path: Path) -> None:
    """A site process (:func:`medfl.flower.worker.run_site`) reads bytecode only from its own
    folder (:func:`medfl.code_identity.private_bytecode`): the planted ``.pyc`` is not run."""
    import subprocess
    import sys

    folder = tmp_path / "pkg"
    folder.mkdir()
    helper = folder / "medfl_test_planted_helper.py"
    helper.write_text("VALUE = 'source'\n")
    _plant_pyc(helper, "VALUE = 'planted'\n")
    script = ("import sys; sys.path.insert(0, {folder!r}); {setup}"
              "import medfl_test_planted_helper as h; print(h.VALUE)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPYCACHEPREFIX"}

    def value(setup: str) -> str:
        out = subprocess.run([sys.executable, "-c", script.format(folder=str(folder), setup=setup)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        return out.stdout.strip()

    assert value("") == "planted"   # the hole: plain Python runs the planted bytecode
    assert value(f"from medfl.code_identity import private_bytecode; private_bytecode({str(tmp_path / 'pyc')!r}); ") \
        == "source"


def test_an_edited_medfl_engine_file_refuses_fedavg(tmp_path: Path) -> None:
    """FedAvg's client step lives in medfl (``medfl/hub.py``): an approval of
    ``fedavg`` pins medfl's own files. Run on a copy of medfl (first on ``sys.path``)."""
    import shutil
    import subprocess
    import sys

    root = Path(__import__("medfl").__file__).parent
    copy = tmp_path / "install"
    shutil.copytree(root, copy / "medfl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(Path(__import__("medfl_plugins").__file__).parent, copy / "medfl_plugins",
                    ignore=shutil.ignore_patterns("__pycache__"))
    approvals = tmp_path / "approvals.json"
    script = f"""
import medfl
assert medfl.__file__.startswith({str(copy)!r}), medfl.__file__
from pathlib import Path
from medfl.approval import ApprovalError, check_control
from medfl.cli import main
assert main(["approve", "fedavg", "--file", {str(approvals)!r}]) == 0
check_control({{"method": {{"name": "fedavg"}}}}, "site", path=Path({str(approvals)!r}), kinds=["method"])
hub = Path({str(copy / "medfl" / "hub.py")!r})
hub.write_text(hub.read_text().replace("def ", "def  ", 1))
try:
    check_control({{"method": {{"name": "fedavg"}}}}, "site", path=Path({str(approvals)!r}), kinds=["method"])
except ApprovalError as exc:
    print("REFUSED", exc)
"""
    env = {**os.environ, "PYTHONPATH": str(copy)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert re.search(r"REFUSED refused method 'fedavg' \(medfl .*\): its code changed since it was approved "
                     r"\(changed: medfl/hub\.py\)", out.stdout), out.stdout


METRIC = '''
"""A metric plugin, as a site would have it installed."""
from medfl import hookimpl


def {name}(y, probs):
    return float(len(y))


@hookimpl
def register_metrics(register):
    register({name}, name="{name}")
'''


def test_an_unapproved_metric_plugin_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every metric runs on the site's data when it evaluates: a metric plugin installed
    after the operator's approvals is refused like a method."""
    import importlib

    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    name = f"metric_{tmp_path.name[-6:].replace('-', '_')}"
    mod = f"medfl_test_metric_{name}"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / f"{mod}.py").write_text(METRIC.format(name=name))
    monkeypatch.syspath_prepend(str(tmp_path / "m"))
    pm = get_plugin_manager()
    pm.register(importlib.import_module(mod), name=mod)
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    try:
        with pytest.raises(SiteFailure, match=rf"site 0 .*refused metric '{name}' .*: it is not in the approvals "
                                              rf"file .*`medfl approve {name} --kind metric"):
            _run(tmp_path, "fedavg", "metric")
    finally:
        pm.unregister(name=mod)


def test_approve_all_and_update(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One command approves the install; ``--update`` approves again what the file lists;
    an entry of the older format (files as a list) is refused until then."""
    approvals = tmp_path / "a.json"
    assert main(["approve", "--all", "--file", str(approvals)]) == 0
    kinds = {k for k, _ in Approvals.load(approvals).entries}
    assert kinds == {"method", "filter", "model", "metric", "dataset", "partitioner"}
    data = json.loads(approvals.read_text())
    data["medfl_approvals"] = 1
    for e in data["approved"]:   # format 1: the plugin's own package's files, listed
        e["files"], e["sha256"] = ["plugins/baselines.py"], "0" * 64
    del data["code"]
    approvals.write_text(json.dumps(data))
    with pytest.raises(ApprovalError, match=r"approved by an older medfl, which pinned only the plugin's own "
                                            r"package .*`medfl approve --update --file "):
        check_control({"method": {"name": "fedavg"}}, "site", path=approvals)
    assert main(["approve", "--update", "--file", str(approvals)]) == 0
    check_control({"method": {"name": "fedavg"}}, "site", path=approvals)
    assert json.loads(approvals.read_text())["medfl_approvals"] == 2


def test_final_models_are_checked_like_the_others(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A method's final models (PFedCDP's student) are named inside the ``final``
    instruction, not in the control record: the site checks their model plugins before
    building them."""
    fl = fl_config(tmp_path, "finals", FEDAVG)
    site: Site = _sites(tmp_path, fl)[101]
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    assert main(["approve", "pfedcdp_student", "--kind", "model", "--revoke", "--file", str(approvals)]) == 0
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    site.check_models({"student": {"name": "small_cnn", "width": 4}})
    with pytest.raises(SiteError, match=r"medfl site 0: refused model 'pfedcdp_student' .*: it is not in the "
                                        r"approvals file .*`medfl approve pfedcdp_student --kind model"):
        site.check_models({"student": {"name": "pfedcdp_student"}})


WRAPPER = '''
"""A model plugin that wraps another registered model, named by its options."""
from medfl import hookimpl
from medfl.models.registry import build_model


def {wrap}(*, spatial_dims, in_channels, num_classes, inner="small_cnn"):
    return build_model({{"name": inner, "width": 4, "spatial_dims": spatial_dims, "in_channels": in_channels,
                        "num_classes": num_classes}})


def {inner}(**kwargs):
    return build_model({{"name": "small_cnn", **kwargs}})


@hookimpl
def register_models(register):
    register({wrap}, name="{wrap}")
    register({inner}, name="{inner}")
'''


def test_a_model_a_wrapper_builds_must_be_approved_too(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A wrapper model builds an inner model named by its options: approving the wrapper does
    not approve the inner model plugin (installed after the operator's approvals), which the
    site refuses before its code runs, naming both; approved too, the run goes through."""
    import importlib

    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    tag = tmp_path.name[-6:].replace("-", "_")
    wrap, inner, mod = f"wrap_{tag}", f"inner_{tag}", f"medfl_test_wrapper_{tag}"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / f"{mod}.py").write_text(WRAPPER.format(wrap=wrap, inner=inner))
    monkeypatch.syspath_prepend(str(tmp_path / "m"))
    pm = get_plugin_manager()
    pm.register(importlib.import_module(mod), name=mod)
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    try:
        assert main(["approve", wrap, "--kind", "model", "--file", str(approvals)]) == 0
        fl = fl_config(tmp_path, "wrapped", {**FEDAVG, "rounds": 1, "eval_every": 0,
                                             "model": {"name": wrap, "inner": inner}})
        with pytest.raises(SiteFailure, match=rf"site 0 .*SiteError: medfl site 0: refused model '{inner}' "
                                              rf"\(.*\), built by model '{wrap}': it is not in the approvals file .*"
                                              rf"`medfl approve {inner} --kind model --file "):
            run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl)), FAST)
        assert main(["approve", inner, "--kind", "model", "--file", str(approvals)]) == 0
        fl["name"] = "wrapped_ok"
        out = run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl, "ok")), FAST)
        assert out["summaries"]["fedavg"]["rounds"] == 1
    finally:
        pm.unregister(name=mod)


def test_a_plugin_outside_an_importable_module_cannot_be_approved() -> None:
    """A plugin defined in ``__main__`` (a script) has no module a site can pin by name."""
    from medfl_plugins.baselines import FedAvg

    class Script(FedAvg):
        name = "script_method"

    Script.__module__ = "__main__"
    with methods_registered(Script, name="script-method-test"):
        with pytest.raises(ApprovalError, match=r"method 'script_method' is defined in .*, which is not a module "
                                                r"importable by its name \(__main__\): it cannot be pinned"):
            code_identity("method", "script_method")


def test_hello_checks_the_sites_own_dataset_and_partitioner(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The site's own config runs plugin code too (its dataset, its partitioner): a hello,
    which names no method, is refused when they are not approved."""
    from medfl.engine import protocol as P

    fl = fl_config(tmp_path, "hello", FEDAVG)
    site: Site = _sites(tmp_path, fl)[101]
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    site.check({"protocol": P.PROTOCOL, "client": "0"})
    assert main(["approve", "dirichlet", "--kind", "partitioner", "--revoke", "--file", str(approvals)]) == 0
    with pytest.raises(SiteError, match=r"medfl site 0: refused partitioner 'dirichlet' .*: it is not in the "
                                        r"approvals file"):
        site.check({"protocol": P.PROTOCOL, "client": "0"})
