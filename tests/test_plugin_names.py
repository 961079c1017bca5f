"""Qualified plugin names, clashes, ``medfl plugins NAME``, the plugin API version, and
``train_metrics.csv``'s ``step`` column (issue 41, part 5)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import pytest

from medfl import PLUGIN_API_VERSION, hookimpl
from medfl.cli import main
from medfl.config import ConfigError
from medfl.experiment import resume, run_experiment
from medfl.plugins import (PluginError, PluginWarning, api_compatible, describe, get_plugin_manager, lookup,
                           plugin_info, registry)
from medfl.rundir import with_step_column
from medfl_plugins.baselines import FedAvg
from medfl_plugins.fedsdc import FedSDC

ROOT = Path(__file__).resolve().parents[1]


class OutsideSdc(FedAvg):
    """An outside plugin's ``fedsdc``, written before the built-in existed (FedAvg inside)."""

    name = "fedsdc"


class OutsideAvg(FedAvg):
    """A second, fedavg-like method of the outside plugin: its name clashes with nothing."""

    name = "outside_avg"

    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.scale = float(scale)


@contextmanager
def outside_plugin(name: str = "outside-sdc", requires: str | None = None) -> Iterator[None]:
    """Register, for the block, a plugin registering ``fedsdc`` and ``outside_avg``."""

    class Plugin:
        @hookimpl
        def register_methods(self, register: Any) -> None:
            register(OutsideSdc)
            register(OutsideAvg)

    plugin = Plugin()
    if requires is not None:
        plugin.requires_medfl_api = requires
    pm = get_plugin_manager()
    pm.register(plugin, name=name)
    try:
        yield
    finally:
        pm.unregister(name=name)


def test_a_clash_breaks_only_the_clashing_bare_name(tiny_fl, resolve, capsys):
    with outside_plugin():
        assert lookup("method", "fedavg") is FedAvg and lookup("method", "outside_avg") is OutsideAvg
        assert lookup("method", "medfl:fedsdc") is FedSDC and lookup("method", "outside-sdc:fedsdc") is OutsideSdc
        with pytest.raises(PluginError, match=r"method 'fedsdc' is ambiguous: it is registered by 2 plugins, as "
                                              r"medfl:fedsdc and outside-sdc:fedsdc; write the qualified name"):
            lookup("method", "fedsdc")
        with pytest.raises(ConfigError, match=r"'fedsdc' is ambiguous.*medfl:fedsdc and outside-sdc:fedsdc"):
            resolve({**tiny_fl, "methods": [{"name": "fedsdc"}]})
        cfg = resolve({**tiny_fl, "methods": [{"name": "fedavg"}, {"name": "outside_avg", "scale": 2.0}]})
        assert cfg["plugin_names"]["method"] == {"fedavg": "medfl:fedavg", "outside_avg": "outside-sdc:outside_avg"}
        # every other command keeps working: the listing shows both, qualified, and marks the clash
        assert main(["plugins"]) == 0
        out = capsys.readouterr().out
        assert "medfl:fedsdc" in out and "outside-sdc:fedsdc" in out
        assert "[clash: 'fedsdc' is ambiguous, write outside-sdc:fedsdc]" in out
        assert "  fedavg           medfl:fedavg" in out
        assert main(["plugins", "--json"]) == 0
        info = {p["name"]: p for p in json.loads(capsys.readouterr().out)}
        assert info["outside-sdc"]["qualified"]["method"] == ["outside-sdc:fedsdc", "outside-sdc:outside_avg"]
        assert info["outside-sdc"]["clashes"] == ["method:fedsdc"] and info["fedsdc"]["clashes"] == ["method:fedsdc"]
        with pytest.raises(SystemExit) as exc:
            main(["plugins", "--help"])
        assert exc.value.code == 0
    assert lookup("method", "fedsdc") is FedSDC   # the plugin gone, the bare name works again


def test_qualified_names_run_and_are_recorded_and_resume_after_a_clash(tiny_fl, resolve):
    with outside_plugin():
        cfg = resolve({**tiny_fl, "rounds": 2, "stop_after_round": 1,
                       "methods": [{"name": "outside-sdc:fedsdc"}, {"name": "fedavg"},
                                   {"name": "medfl:fedavg", "label": "avg"}]})
        out = run_experiment(cfg)
        run_dir = Path(out["dir"]) / "fedsdc"   # the directory is named after the bare name
        saved = json.loads((run_dir / "config.json").read_text())
        assert saved["fl"]["plugin_names"]["method"]["outside-sdc:fedsdc"] == "outside-sdc:fedsdc"
        assert set(out["summaries"]) == {"fedsdc", "fedavg", "avg"}   # a bare unclashing name runs too
    # a run started with bare names records what they resolved to; installing a clashing
    # plugin afterwards does not change which plugin the resume uses
    first = run_experiment(resolve({**tiny_fl, "name": "bare", "rounds": 2, "stop_after_round": 1,
                                    "methods": [{"name": "fedsdc"}]}))
    saved = json.loads((Path(first["dir"]) / "config.json").read_text())
    assert saved["fl"]["plugin_names"]["method"] == {"fedsdc": "medfl:fedsdc"}
    with outside_plugin():
        again = resume(first["dir"])
        assert again["summaries"]["fedsdc"]["rounds"] == 2
        assert again["summaries"]["fedsdc"]["method"] == "fedsdc"


def test_an_old_run_dir_without_recorded_names_resumes(tiny_fl, resolve):
    out = run_experiment(resolve({**tiny_fl, "rounds": 2, "stop_after_round": 1}))
    exp = Path(out["dir"])
    for cfg_file in (exp / "config.json", exp / "fedavg" / "config.json"):   # as written before issue 41
        saved = json.loads(cfg_file.read_text())
        del saved["fl"]["plugin_names"]
        cfg_file.write_text(json.dumps(saved))
    assert resume(exp)["summaries"]["fedavg"]["rounds"] == 2
    with outside_plugin():   # with a clash now, the bare name of the old run is refused, naming both
        for cfg_file in (exp / "config.json", exp / "fedavg" / "config.json"):
            saved = json.loads(cfg_file.read_text())
            saved["fl"]["methods"] = [{"name": "fedsdc"}]
            saved.get("method", {}).update(name="fedsdc")
            cfg_file.write_text(json.dumps(saved))
        with pytest.raises(PluginError, match=r"'fedsdc' is ambiguous.*medfl:fedsdc and outside-sdc:fedsdc"):
            resume(exp, rounds=3)


def test_a_recorded_name_that_is_gone_is_refused_naming_it(tiny_fl, resolve):
    with outside_plugin():
        cfg = resolve({**tiny_fl, "methods": [{"name": "outside_avg"}]})
    with pytest.raises(ConfigError, match=r"method 'outside_avg' was resolved to 'outside-sdc:outside_avg' when "
                                          r"this run started .*cannot be used now: unknown method"):
        resolve(cfg)
    with pytest.raises(ConfigError, match=r"fl.plugin_names.method: expected \{name: \"dist:name\"\}"):
        resolve({**tiny_fl, "plugin_names": {"method": {"fedavg": "fedavg"}}})


def test_describe_a_plugin(capsys):
    (d,) = describe("fedprox")
    assert d["kind"] == "method" and d["qualified"] == "medfl:fedprox" and d["distribution"] == "medfl"
    assert d["parameters"] == [{"name": "mu", "required": False, "default": 0.01, "type": "float"}]
    assert "FedProx (Li et al., MLSys 2020)" in d["doc"] and d["clashes_with"] == []
    assert describe("medfl:fedprox") == [d]
    assert main(["plugins", "medfl:fedprox"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("method medfl:fedprox  (medfl ") and "mu" in out and "default 0.01" in out
    assert main(["plugins", "small_cnn", "--json"]) == 0
    (model,) = json.loads(capsys.readouterr().out)
    assert model["kind"] == "model" and {"name": "width", "required": False, "default": 16,
                                         "type": "int"} in model["parameters"]
    with pytest.raises(PluginError, match=r"nothing is registered as 'fedprx'; did you mean 'fedprox'"):
        describe("fedprx")
    assert main(["plugins", "fedprx"]) == 2
    assert "did you mean 'fedprox'" in capsys.readouterr().err
    with outside_plugin():
        both = describe("fedsdc")
        assert [x["qualified"] for x in both] == ["medfl:fedsdc", "outside-sdc:fedsdc"]
        assert both[0]["clashes_with"] == ["outside-sdc:fedsdc"]
        assert main(["plugins", "fedsdc"]) == 0
        assert "clash: 'fedsdc' is also registered as outside-sdc:fedsdc" in capsys.readouterr().out


API_CASES = [(">=1.0,<2", True), (">=1", True), ("==1.0", True), ("1.0", True), ("<1", False), (">=2", False),
             (">1.0", False), ("!=1.0", False), (" >= 1.0 , < 1.5 ", True)]


@pytest.mark.parametrize("requirement,ok", API_CASES)
def test_api_requirements(requirement, ok):
    assert PLUGIN_API_VERSION == "1.0"
    assert api_compatible(requirement) is ok


@pytest.mark.parametrize("bad", ["", "~=1.0", ">=one", ">=1.0.0"])
def test_unreadable_api_requirement(bad):
    with pytest.raises(ValueError):
        api_compatible(bad)


def test_a_plugin_requiring_another_api_is_skipped_and_refused_where_used(tiny_fl, resolve, capsys):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with outside_plugin(name="future-plugin", requires=">=2,<3"):
            assert lookup("method", "fedsdc") is FedSDC   # its registrations are skipped: no clash
            with pytest.raises(PluginError, match=r"method 'outside_avg' cannot be used: plugin 'future-plugin' "
                                                  r"\(distribution 'future-plugin'\) requires medfl plugin API "
                                                  r">=2,<3; this medfl provides 1.0"):
                lookup("method", "outside_avg")
            with pytest.raises(ConfigError, match="requires medfl plugin API >=2,<3"):
                resolve({**tiny_fl, "methods": [{"name": "future-plugin:outside_avg"}]})
            row = next(p for p in plugin_info() if p["name"] == "future-plugin")
            assert "requires medfl plugin API >=2,<3" in row["refused"]
            assert main(["plugins"]) == 0
            assert "skipped: plugin 'future-plugin'" in capsys.readouterr().out
    assert [w for w in caught if issubclass(w.category, PluginWarning) and "future-plugin" in str(w.message)]
    with outside_plugin(name="current-plugin", requires=">=1.0,<2"):
        assert lookup("method", "outside_avg") is OutsideAvg


def test_the_example_plugin_declares_the_api_it_needs():
    sys.path.insert(0, str(ROOT / "examples" / "medfl-plugin-example"))
    try:
        import medfl_median
    finally:
        sys.path.remove(str(ROOT / "examples" / "medfl-plugin-example"))
    assert api_compatible(medfl_median.requires_medfl_api)


def test_an_entry_point_clash_through_an_installed_distribution(tmp_path):
    """A real distribution (a dist-info with an entry point, on ``sys.path``) registering
    ``fedsdc``: ``medfl plugins`` lists both, the bare name is refused naming both, the
    qualified ones resolve, in a fresh interpreter that loads entry points as users' do."""
    site = tmp_path / "site"
    (site / "old_sdc_plugin-0.3.dist-info").mkdir(parents=True)
    (site / "old_sdc_plugin.py").write_text(textwrap.dedent('''
        """An outside fedsdc from before medfl had one."""
        from medfl import hookimpl
        from medfl_plugins.baselines import FedAvg

        requires_medfl_api = ">=1.0,<2"

        class OldSdc(FedAvg):
            """Someone's own FedSDC: FedAvg under another name."""
            name = "fedsdc"

        @hookimpl
        def register_methods(register):
            register(OldSdc)
        '''))
    info = site / "old_sdc_plugin-0.3.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: old-sdc-plugin\nVersion: 0.3\n")
    (info / "entry_points.txt").write_text("[medfl]\nold_sdc = old_sdc_plugin\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    listed = subprocess.run([sys.executable, "-m", "medfl.cli", "plugins"], env=env, capture_output=True,
                            text=True, timeout=600)
    assert listed.returncode == 0, listed.stderr
    assert "old-sdc-plugin:fedsdc" in listed.stdout and "medfl:fedsdc" in listed.stdout
    assert "[clash: 'fedsdc' is ambiguous" in listed.stdout
    code = ("from medfl.plugins import lookup, PluginError\n"
            "print(lookup('method', 'old-sdc-plugin:fedsdc').__name__, lookup('method', 'medfl:fedsdc').__name__)\n"
            "try:\n    lookup('method', 'fedsdc')\nexcept PluginError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[0] == "OldSdc FedSDC"
    assert "'fedsdc' is ambiguous" in run.stdout and "medfl:fedsdc and old-sdc-plugin:fedsdc" in run.stdout


class TwoSteps(FedAvg):
    """FedAvg whose every round has two training steps (both ask every sampled client)."""

    name = "two_steps"

    def round_steps(self, round: int) -> int:
        return 2


def test_train_metrics_have_a_step_column_and_an_old_file_resumes(tiny_fl, resolve, monkeypatch):
    from medfl.rundir import RunDir
    from tests.contract_methods import methods_registered

    with methods_registered(TwoSteps, name="two-steps-plugin"):
        out = run_experiment(resolve({**tiny_fl, "rounds": 1, "methods": [{"name": "two_steps"}]}))
        tm = pd.read_csv(Path(out["dir"]) / "two_steps" / "train_metrics.csv", dtype={"client_id": str})
        assert list(tm.columns[:3]) == ["round", "client_id", "step"]
        assert sorted(zip(tm["client_id"], tm["step"])) == sorted((c, s) for c in ("0", "1", "2") for s in (0, 1))
        assert not tm.duplicated(["round", "client_id", "step"]).any()
        # a run written before the column existed (the writer as it was: no step), stopped after round 1
        write_rows = RunDir.write_rows

        def old_writer(self, name, df, *args, **kwargs):
            return write_rows(self, name, df.drop(columns="step") if name == "train_metrics.csv" else df,
                              *args, **kwargs)

        monkeypatch.setattr(RunDir, "write_rows", old_writer)
        out = run_experiment(resolve({**tiny_fl, "name": "old", "rounds": 2, "stop_after_round": 1,
                                      "methods": [{"name": "two_steps"}]}))
        monkeypatch.undo()
        run_dir = Path(out["dir"]) / "two_steps"
        assert "step" not in pd.read_csv(run_dir / "train_metrics.csv").columns
        again = resume(out["dir"])
        assert again["summaries"]["two_steps"]["rounds"] == 2
        tm2 = pd.read_csv(run_dir / "train_metrics.csv", dtype={"client_id": str})
    assert list(tm2.columns[:3]) == ["round", "client_id", "step"] and tm2["step"].notna().all()
    assert len(tm2) == 12 and not tm2.duplicated(["round", "client_id", "step"]).any()
    pd.testing.assert_frame_equal(tm2[tm2["round"] == 1].reset_index(drop=True), tm)


def test_with_step_column_numbers_each_clients_rows_in_a_round():
    old = pd.DataFrame({"round": [1, 1, 1, 1, 2], "client_id": ["0", "1", "0", "1", "0"], "loss": [1, 2, 3, 4, 5]})
    new = with_step_column(old)
    assert list(new.columns) == ["round", "client_id", "step", "loss"]
    assert new["step"].tolist() == [0, 0, 1, 1, 0] and "step" not in old
    assert with_step_column(new) is new
