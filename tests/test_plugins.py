"""The plugin manager: entry points, duplicates, import failures, hook coverage, CLI."""

from __future__ import annotations

import importlib.metadata as md
import json
import re
from pathlib import Path

import pytest

from medfl import hookimpl, hookspecs
from medfl.filters import Filter
from medfl import plugins as plugins_mod
from medfl.cli import main
from medfl.plugins import PluginError, get_plugin_manager, lookup, registry
from medfl_plugins.baselines import FedAvg


def test_builtins_come_from_the_entry_point_group():
    reg = registry()
    assert reg["method"]["fedavg"].distribution == "medfl"
    names = {ep.name for ep in md.entry_points(group="medfl") if ep.dist and ep.dist.name == "medfl"}
    assert {"baselines", "models", "partitioners", "datasets", "metrics", "reporting"} <= names
    for kind in ("method", "model", "partitioner", "dataset", "metric"):
        assert reg[kind], kind


def test_a_name_two_plugins_register_is_refused_where_used_naming_both():
    class Dup(FedAvg):
        name = "fedavg"

    class Plugin:
        @hookimpl
        def register_methods(self, register):
            register(Dup)

    pm = get_plugin_manager()
    pm.register(Plugin(), name="dup-plugin")
    try:
        assert lookup("method", "fedprox")   # unrelated names still work
        with pytest.raises(PluginError, match=r"method 'fedavg' is ambiguous.*medfl:fedavg and dup-plugin:fedavg; "
                                              r"write the qualified name"):
            lookup("method", "fedavg")
        assert lookup("method", "medfl:fedavg") is FedAvg and lookup("method", "dup-plugin:fedavg") is Dup
    finally:
        pm.unregister(name="dup-plugin")
    assert lookup("method", "fedavg") is FedAvg


def test_a_plugin_that_cannot_import_is_one_warning_and_stops_only_what_names_it(monkeypatch, capsys):
    class FakeDist:
        name, version = "broken-dist", "9.9"

    broken = md.EntryPoint(name="broken", value="medfl_no_such_module", group="medfl")
    broken = broken._for(FakeDist()) if hasattr(broken, "_for") else broken
    builtins = [ep for ep in md.entry_points(group="medfl")]
    monkeypatch.setattr(md, "entry_points", lambda group: [broken, *builtins])
    plugins_mod._reset_for_tests()
    line = r"plugin 'broken' from distribution 'broken-dist' \(medfl_no_such_module\) failed to import: " \
           r"ModuleNotFoundError: No module named 'medfl_no_such_module'"
    try:
        with pytest.warns(plugins_mod.PluginWarning, match="medfl: skipping " + line) as caught:
            get_plugin_manager()
        assert len(caught) == 1
        assert lookup("method", "fedavg") is FedAvg                   # everything else loads and runs
        with pytest.raises(PluginError, match=f"method 'broken-dist:fedrep' cannot be used: {line}$"):
            lookup("method", "broken-dist:fedrep")
        with pytest.raises(PluginError, match=f"unknown method 'fedrep'; valid methods: .*; not loaded: {line}$"):
            lookup("method", "fedrep")
        assert main(["plugins"]) == 0
        assert re.search("skipped: " + line, capsys.readouterr().out)
    finally:
        monkeypatch.undo()
        plugins_mod._reset_for_tests()


def test_unknown_name_lists_valid():
    with pytest.raises(PluginError, match="unknown metric 'aucc'; valid metrics: accuracy, auc"):
        lookup("metric", "aucc")


def test_plugins_cli_json(capsys):
    assert main(["plugins", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    base = next(p for p in info if p["name"] == "baselines")
    assert base["distribution"] == "medfl" and "register_methods" in base["hooks"]
    assert "fedavg" in base["registered"]["method"]


def test_event_hooks_fire_in_order(tiny_fl, resolve):
    from medfl.experiment import run_experiment

    calls = []

    class Recorder:
        @hookimpl
        def on_run_start(self, run):
            calls.append(("start", run.label))

        @hookimpl
        def on_client_end(self, run, round, client_id, metrics):
            calls.append(("client", round, client_id))

        @hookimpl
        def on_round_end(self, run, round, metrics):
            calls.append(("round", round, len(metrics)))

        @hookimpl
        def on_run_end(self, run, summary):
            calls.append(("end", summary["rounds"]))

    pm = get_plugin_manager()
    pm.register(Recorder(), name="recorder")
    try:
        run_experiment(resolve(tiny_fl))
    finally:
        pm.unregister(name="recorder")
    assert calls[0] == ("start", "fedavg") and calls[-1] == ("end", 2)
    assert ("client", 1, "0") in calls and ("round", 2, 6) in calls


def test_cli_run_report_and_errors(tiny_fl, tmp_path, capsys):
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"fl": tiny_fl}))
    assert main(["run", str(cfg), "--fl#rounds", "1", "fl#methods=[{'name': 'local'}]"]) == 0
    run_dir = Path(tiny_fl["output_dir"]) / "t" / "local"
    assert json.loads((run_dir / "status.json").read_text())["last_round"] == 1
    assert not (run_dir / "plots").exists()        # MEDFL_NO_PLOTS; `medfl report` draws them all the same
    assert main(["report", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "local_test" in out and "curves.png" in out and (run_dir / "plots" / "curves.png").is_file()
    assert main(["run", str(cfg), "--fl#methods#0#name", "nope"]) == 2
    assert "valid methods" in capsys.readouterr().err


def test_registration_hooks_take_third_party_things(tiny_fl, resolve):
    """A throwaway plugin registers a model, partitioner, dataset and metric; a run uses them."""
    import numpy as np

    from medfl.data.partition import iid
    from medfl.data.synthetic import synthetic2d
    from medfl.experiment import run_experiment
    from medfl.models.resnet import small_cnn

    class Extra:
        @hookimpl
        def register_models(self, register):
            register(lambda **kw: small_cnn(**kw), name="tiny_cnn")

        @hookimpl
        def register_partitioners(self, register):
            register(iid, name="iid_again")

        @hookimpl
        def register_datasets(self, register):
            register(synthetic2d, name="synthetic_again")

        @hookimpl
        def register_metrics(self, register):
            register(lambda y, p: float(np.mean(p.max(axis=1))), name="mean_confidence")

        @hookimpl
        def register_filters(self, register):
            register(Negate)

    calls: list[str] = []

    class Negate(Filter):
        name = "negate"

        def apply(self, state, ctx):
            calls.append("apply")
            return {k: -v if v.is_floating_point() else v for k, v in state.items()}

        def undo(self, value, ctx):
            calls.append("undo")
            return {k: -v if v.is_floating_point() else v for k, v in value.items()}

    pm = get_plugin_manager()
    pm.register(Extra(), name="extra")
    try:
        tiny_fl.update(model={"name": "tiny_cnn", "width": 4}, partition={"name": "iid_again"},
                       rounds=1, filters=["negate"])
        tiny_fl["dataset"] = dict(tiny_fl["dataset"], name="synthetic_again")
        out = run_experiment(resolve(tiny_fl))
        final = out["summaries"]["fedavg"]["final"]["local_test"]
        assert 0 < final["mean_confidence"]["mean"] <= 1
        n = tiny_fl["num_clients"]   # every client applied it, the coordinator undid each
        assert calls == ["apply"] * n + ["undo"] * n
    finally:
        pm.unregister(name="extra")
    assert "tiny_cnn" not in registry()["model"] and "negate" not in registry()["filter"]


def test_a_third_party_backend_is_chosen_by_name_and_runs(tiny_fl, resolve):
    """A plugin's backend (``register_backends``) is chosen by ``fl.backend``: the experiment
    runs in its runs (here the in-process ones, saying so in config.json) and resumes there; an
    unknown name is refused by name, listing the registered ones."""
    from contextlib import contextmanager

    from medfl.backend import Backend
    from medfl.config import ConfigError
    from medfl.engine.runner import Run
    from medfl.experiment import resume, run_experiment

    used: list[str] = []

    class Logged(Backend):
        name = "logged"

        @contextmanager
        def runs(self, cfg, path=None):
            used.append("run" if path is None else "resume")
            yield Run, {"engine": "logged"}
            used.append("done")

    class Plugin:
        @hookimpl
        def register_backends(self, register):
            register(Logged)

    pm = get_plugin_manager()
    pm.register(Plugin(), name="backend-plugin")
    try:
        assert list(registry()["backend"])[:3] == ["inprocess", "ray", "flower"]
        out = run_experiment(resolve({**tiny_fl, "rounds": 1, "backend": "logged"}))
        assert used == ["run", "done"] and out["summaries"]["fedavg"]["rounds"] == 1
        saved = json.loads((Path(out["dir"]) / "config.json").read_text())
        assert saved["engine"] == "logged" and saved["fl"]["backend"]["name"] == "logged"
        again = resume(out["dir"], rounds=2)
        assert used == ["run", "done", "resume", "done"] and again["summaries"]["fedavg"]["rounds"] == 2
        with pytest.raises(ConfigError, match=r"fl.backend: expected one of 'inprocess', 'ray', 'flower', "
                                              r"'nvflare', 'logged' or .*got 'nowhere'"):
            resolve({**tiny_fl, "backend": "nowhere"})
    finally:
        pm.unregister(name="backend-plugin")
    assert "logged" not in registry()["backend"]
    with pytest.raises(ConfigError, match="got 'logged'"):
        resolve({**tiny_fl, "backend": "logged"})


def test_every_hookspec_has_a_test():
    """Each hook specification is named in at least one test file (datasette's habit)."""
    specs = [n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), "medfl_spec")]
    text = "".join(p.read_text() for p in Path(__file__).parent.rglob("test_*.py") if p.name != Path(__file__).name)
    text += Path(__file__).read_text().split("def test_every_hookspec_has_a_test")[0]
    missing = [s for s in specs if not re.search(rf"\b{s}\b", text)]
    assert specs and not missing, f"hook specs without a test: {missing}"


def test_a_plugin_registered_after_another_is_gone_is_the_one_looked_up():
    """The registry is rebuilt whenever the registered plugins change, even when a new plugin
    object lands at the address of one just unregistered (CPython reuses a freed object's id
    for the next of its size): on 7524dea the registry was keyed by ids, and kept answering
    with the method of a plugin already gone, so a test's outcome depended on which tests its
    xdist worker had run before it (CI: an own_dp declaration from a parametrized case)."""

    class Plugin:
        def __init__(self, cls: type) -> None:
            self.cls = cls

        @hookimpl
        def register_methods(self, register):
            register(self.cls)

    pm = get_plugin_manager()
    for i in range(10):
        cls = type(f"Reused{i}", (FedAvg,), {"name": "reused_method", "marker": i})
        pm.register(Plugin(cls), name="reused-plugin")   # the only reference: freed on unregister
        try:
            assert lookup("method", "reused_method").marker == i
        finally:
            pm.unregister(name="reused-plugin")
    with pytest.raises(PluginError):
        lookup("method", "reused_method")


def test_source_tree_fallback_loads_every_built_in(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without installed entry points (a source tree on PYTHONPATH) medfl loads
    DEFAULT_PLUGINS instead: the same modules as pyproject.toml's entry-point group, so every
    built-in method, model and tracker is there either way."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    assert plugins_mod.DEFAULT_PLUGINS == tuple(pyproject["project"]["entry-points"]["medfl"].values())
    installed = {kind: set(table) for kind, table in plugins_mod.registry().items()}
    monkeypatch.setattr(plugins_mod, "_pm", None)
    monkeypatch.setattr(plugins_mod, "_dists", {})
    monkeypatch.setattr(plugins_mod, "_registry_cache", None)
    monkeypatch.setattr(plugins_mod.md, "entry_points", lambda **kw: [])
    try:
        fallback = {kind: set(table) for kind, table in plugins_mod.registry().items()}
        assert set(plugins_mod._dists.values()) == {("medfl", "source")}   # the fallback it was
    finally:
        monkeypatch.undo()
    assert fallback == installed and {"fedkper", "fedskd", "fedsdc", "fedtpf", "pfedcdp"} <= fallback["method"]
