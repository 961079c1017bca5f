"""The example third-party plugin installs, shows up in `medfl plugins` and runs."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tomllib
import types
from contextlib import contextmanager
from pathlib import Path

import pandas as pd
import pytest
import torch

from medfl.config import resolve_config
from medfl.experiment import resume, run_experiment

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "medfl-plugin-example"


@pytest.fixture(scope="module")
def example_env(tmp_path_factory) -> dict[str, str]:
    """The environment of a process that sees the example plugin installed (once per module,
    with pip, into a target folder on ``PYTHONPATH``)."""
    target = tmp_path_factory.mktemp("example") / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(EXAMPLE)], check=True, capture_output=True)
    return dict(os.environ, PYTHONPATH=str(target))


def _example_module(name: str) -> types.ModuleType:
    """The example's module ``name``, imported from its folder."""
    sys.path.insert(0, str(EXAMPLE))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(EXAMPLE))


def _example():
    return _example_module("medfl_median")


def test_median_aggregation_hand_computed():
    FedMedian = _example().FedMedian
    states = [{"w": torch.tensor([1.0, 9.0])}, {"w": torch.tensor([2.0, -5.0])},
              {"w": torch.tensor([100.0, 0.0])}]
    out = FedMedian().aggregate(states, [1, 1, 1])
    assert out["w"].tolist() == [2.0, 0.0]
    out = FedMedian().aggregate(states[:2], [1, 1])
    assert out["w"].tolist() == [1.5, 2.0]


def test_snapshots_are_ranked_by_mean_validation_accuracy():
    from medfl.method import Federation

    ex = _example()
    m = ex.MedianSnapshots(keep=3, top=2)
    m.setup(Federation(client_ids=["0", "1"], eval_client_ids=["0", "1"], num_examples={"0": 4, "1": 4},
                       num_classes=2, rounds=3, seed=0, model={"name": "small_cnn", "width": 2}))
    for r in (1, 2, 3):
        m.snapshots = (m.snapshots + [{"w": torch.tensor(float(r))}])[-3:]
    nan = float("nan")
    m.server_validate(3, {"0": {"acc_0": 0.9, "acc_1": 0.2, "acc_2": 0.5},
                          "1": {"acc_0": 0.7, "acc_1": 0.4, "acc_2": nan}})   # client 1: no score for 2
    assert m.chosen == [0, 2]   # means 0.8, 0.3, 0.5
    assert [p["w"].item() for p in m.configure_evaluate(3)["0"].payload["models"]] == [1.0, 3.0]
    restored = ex.MedianSnapshots(keep=3, top=2)
    restored.load_state_dict(m.state_dict())
    assert restored.chosen == [0, 2] and len(restored.snapshots) == 3


def test_snapshots_refuse_a_run_too_short_for_top_where_they_see_its_rounds():
    """The example's ``setup`` refuses with ``MethodConfigError`` (docs/plugins.md, *Refusing a
    setting*): the hyperparameter against the run, which ``__init__`` cannot see."""
    from medfl import MethodConfigError
    from medfl.method import Federation

    m = _example().MedianSnapshots(keep=3, top=2)
    with pytest.raises(MethodConfigError, match=r"median_snapshots: top=2 needs at least 2 global models, the run "
                                                r"has 1 round\(s\); lower top or raise fl.rounds"):
        m.setup(Federation(client_ids=["0"], eval_client_ids=["0"], num_examples={"0": 4}, num_classes=2, rounds=1,
                           seed=0, model={"name": "small_cnn", "width": 2}))


def test_mean_probability_ensemble_returns_probabilities():
    ex = _example()
    torch.manual_seed(0)
    ens = ex.MeanProbability([torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)])
    p = ens(torch.randn(5, 3))
    assert ens.returns_probabilities and torch.allclose(p.sum(1), torch.ones(5))


def test_installed_example_plugin_is_listed_and_runs(tmp_path, tiny_fl, example_env):
    env = dict(example_env)
    listed = subprocess.run([sys.executable, "-m", "medfl.cli", "plugins", "--json"], env=env,
                            capture_output=True, text=True, check=True)
    info = {p["name"]: p for p in json.loads(listed.stdout)}
    plugin = info["medfl-plugin-example:median"]
    assert plugin["distribution"] == "medfl-plugin-example" and plugin["version"] == "0.1.0"
    assert plugin["registered"] == {"method": ["dp_fedavg_opacus", "dp_shared_images", "median", "median_snapshots"],
                                    "filter": ["half"]}
    assert info["medfl-plugin-example:stem_cnn"]["registered"] == {"model": ["stem_cnn"]}   # its model plugin
    assert info["medfl-plugin-example:fedrep"]["registered"] == {"method": ["fedrep"]}
    # medfl plugins NAME --json carries each preset value's source (issue 48)
    described = subprocess.run([sys.executable, "-m", "medfl.cli", "plugins", "median_snapshots", "--json"], env=env,
                               capture_output=True, text=True, check=True)
    (snapshots,) = json.loads(described.stdout)
    assert {k: v["from"] for k, v in snapshots["presets"]["wide"]["sources"].items()} == {"keep": "open", "top": "open"}
    cfg = tmp_path / "train.json"
    # dp_shared_images makes a DP release: cross_test (which sends every client's model in the
    # clear) runs beside it only with the opt-in, and its privacy record then says so
    tiny_fl.update(rounds=3, eval_splits=["test", "cross_test"], cross_test={"under_dp": "send_models"},
                   methods=[{"name": "median", "filters": [{"name": "half"}]},
                            {"name": "median_snapshots", "preset": "wide", "keep": 2, "top": 1},
                            {"name": "dp_shared_images", "epsilon": 4.0}])
    cfg.write_text(json.dumps({"fl": tiny_fl}))
    proc = subprocess.run([sys.executable, "-m", "medfl.cli", "run", str(cfg)], env=env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((Path(tiny_fl["output_dir"]) / "t" / "median" / "summary.json").read_text())
    assert summary["method"] == "median"
    snap = Path(tiny_fl["output_dir"]) / "t" / "median_snapshots"
    assert json.loads((snap / "summary.json").read_text())["final"]["cross_test"]["accuracy"]["mean"] >= 0
    val = (snap / "validation_metrics.csv").read_text().splitlines()
    assert val[0] == "round,client_id,acc_0,acc_1" and len(val) == 1 + 2 * 3   # rounds 2 and 3
    # the profile exchange, groups, report and final model of the contract
    assert (snap / "profile.csv").read_text().splitlines()[0] == "client_id,val_samples"
    assert (snap / "groups.csv").read_text().splitlines()[0] == "client_id,client_name,group"
    s_snap = json.loads((snap / "summary.json").read_text())
    assert s_snap["method_report"]["kept_snapshots"] == 2 and len(s_snap["method_report"]["validation_sizes"]) == 3
    # the preset's values under the entry's own keys, and where each came from
    preset = json.loads((snap / "config.json").read_text())["preset"]
    assert preset["values"] == {"keep": {"value": 2, "from": "config"}, "top": {"value": 1, "from": "config"}}
    # what the ranking did: round 1 has one snapshot (nothing ranked), rounds 2 and 3 two
    mech = pd.read_csv(snap / "mechanisms.csv", dtype={"id": str})
    assert mech.groupby("round").size().tolist() == [2, 4, 4]
    chosen = mech[(mech["name"] == "chosen") & (mech["value"] == 1.0)]
    assert chosen["round"].tolist() == [1, 2, 3]
    ranked = mech[(mech["name"] == "val_accuracy") & (mech["round"] == 3)]["value"].tolist()
    best = max(range(len(ranked)), key=lambda i: (ranked[i], i))   # ties: the newer snapshot
    assert len(ranked) == 2 and chosen[chosen["round"] == 3]["id"].item() == str(best)
    # the table the method wrote after the run (final_tables): the last round's ranking again
    table = pd.read_csv(snap / "snapshots.csv")
    assert table["snapshot"].tolist() == [0, 1] and table["val_accuracy"].tolist() == ranked
    assert table["chosen"].tolist() == [int(i == best) for i in range(2)]
    # eval_splits test and cross_test: the final model is scored on each client's own test split
    assert set(s_snap["final_models"]["best_snapshot"]) == {"round", "local_test"}
    final = (snap / "final_metrics.csv").read_text().splitlines()
    assert final[0].startswith("model,round,client_id,client_name,split,reported_by,n,") and len(final) == 1 + 3
    # a per-sample DP release declared through the contract: one per client, in round 1
    shared = Path(tiny_fl["output_dir"]) / "t" / "dp_shared_images"
    privacy = (shared / "privacy.csv").read_text().splitlines()
    assert len(privacy) == 1 + 3 and all(row.startswith("1,") and ",shared_images,sample," in row
                                         for row in privacy[1:])
    record = json.loads((shared / "summary.json").read_text())["privacy"]
    assert 0 < record["mechanisms"]["shared_images"]["epsilon"] <= 4.0
    assert record["private"] is False and record["sent_in_clear"] == [
        "cross_test: every site's personalised model, sent in the clear"]
    # scored from the first round trained with the shared set (round 1's second step), declared
    # through scored_from; the other methods keep the default and write no selection row
    selection = json.loads((shared / "summary.json").read_text())["selection"]
    assert selection["scored_from"] == 1 and selection["declared"] is True
    rows = pd.read_csv(shared / "mechanisms.csv")
    assert rows[rows["mechanism"] == "selection"]["value"].tolist() == [1.0, 1.0, 1.0]
    assert s_snap["selection"] == {"scored_from": 1, "declared": False, "reported_round": 3, "chosen_by": "last round"}
    # MEDFL_LOAD_PLUGINS restricts third-party plugins
    env["MEDFL_LOAD_PLUGINS"] = ""
    listed = subprocess.run([sys.executable, "-m", "medfl.cli", "plugins", "--json"], env=env,
                            capture_output=True, text=True, check=True)
    assert "medfl-plugin-example:median" not in {p["name"] for p in json.loads(listed.stdout)}


def test_half_filter_round_trip_and_refusals():
    from medfl.filters import FilterContext
    from medfl.messages import PayloadError

    ex = _example()
    ref = {"w": torch.randn(4, 3), "n": torch.tensor(5)}
    new = {"w": ref["w"] + 0.01, "n": torch.tensor(7)}
    ctx = FilterContext(client_id="0", round=1, step=0, seed=1, key="model", reference=ref,
                        model_spec={}, where="reply")
    sent = ex.Half().apply(new, ctx)
    assert sent["w"].dtype == torch.float16 and sent["n"].dtype == torch.int64
    back = ex.Half().undo(sent, ctx)
    assert back["w"].dtype == torch.float32 and torch.allclose(back["w"], new["w"], rtol=2**-10)
    with pytest.raises(PayloadError, match="float16"):
        ex.Half().undo({"w": new["w"]}, ctx)
    with pytest.raises(ValueError, match="range"):
        ex.Half().apply({"w": torch.full((2,), 1e6)}, ctx)


# ------------------------------------------------------------------ the model plugin (issue 51)

MODEL_SOURCE = EXAMPLE / "medfl_stem_cnn.py"


def _models_section() -> str:
    """docs/plugins.md's ``### Models`` section, up to the next ``###`` heading."""
    text = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    start = text.index("\n### Models\n")
    return text[start:text.index("\n### ", start + 1)]


def _blocks(section: str, lang: str) -> list[str]:
    """The fenced ``lang`` code blocks of ``section``, as written."""
    return re.findall(rf"^```{lang}\n(.*?)^```$", section, flags=re.S | re.M)


def test_models_docs_show_the_example_model_plugin_verbatim():
    """The docs' model plugin is the example's module, character for character, and its
    entry point is the example's: the docs cannot drift from the code the tests run."""
    section = _models_section()
    assert MODEL_SOURCE.read_text(encoding="utf-8") in _blocks(section, "python")
    (toml_block,) = _blocks(section, "toml")
    documented = tomllib.loads(toml_block)
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text(encoding="utf-8"))
    assert documented["project"]["entry-points"]["medfl"] == project["project"]["entry-points"]["medfl"]
    assert documented["tool"]["setuptools"] == project["tool"]["setuptools"]


def test_model_plugin_from_the_docs_alone_follows_the_feature_model_contract():
    """The module as docs/plugins.md prints it, registered at runtime, builds through the
    registry and gives what the methods read (forward, stages, embedding, head split)."""
    from medfl.models import FeatureModel
    from medfl.models.registry import ModelConfigError, build_model, build_seeded
    from medfl.plugins import get_plugin_manager

    (source,) = [b for b in _blocks(_models_section(), "python") if "def register_models" in b]
    module = types.ModuleType("docs_stem_cnn")
    sys.modules[module.__name__] = module
    pm = get_plugin_manager()
    try:
        exec(compile(source, "docs/plugins.md", "exec"), module.__dict__)
        pm.register(module, name="docs-stem-cnn")
        spec = {"name": "docs-stem-cnn:stem_cnn", "spatial_dims": 2, "in_channels": 1, "num_classes": 3,
                "stem_channels": 3, "inner": {"name": "small_cnn", "width": 4}}
        model = build_seeded(spec, seed=0).eval()
        x = torch.randn(5, 1, 12, 12, generator=torch.Generator().manual_seed(0))
        logits, stages = model.forward_features(x)
        assert isinstance(model, FeatureModel) and model.embed_dim == 8
        assert logits.shape == (5, 3) and torch.allclose(logits, model(x))
        assert [tuple(f.shape) for f in stages] == [(5, 3, 12, 12), (5, 4, 6, 6), (5, 8, 3, 3)]
        assert model.embed(x).shape == (5, 8) and torch.allclose(model.head(model.embed(x)), logits)
        keys = list(model.state_dict())
        assert model.head_keys() == ["inner.head.weight", "inner.head.bias"]
        assert sorted(model.body_keys() + model.head_keys()) == sorted(keys) and len(set(keys)) == len(keys)
        assert keys[0].startswith("stem.")
        # seeded by the engine: the same spec and seed give the same weights, inner model included
        again = build_seeded(spec, seed=0)
        assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
        # keys do not depend on stem_channels (clients may differ in it); DP builds it fixed
        assert list(build_model({**spec, "stem_channels": 2}).state_dict()) == keys
        dp = build_model({**spec, "dp_compatible": True})
        assert not any(isinstance(m, torch.nn.BatchNorm2d) for m in dp.modules()) and dp(x).shape == (5, 3)
        for bad, match in [({"stem_channels": 0}, "stem_channels must be an integer >= 1, got 0"),
                           ({"inner": {"name": "small_cnn", "in_channels": 2}}, "without spatial_dims"),
                           ({"inner": {"name": "weighted_ensemble", "members": [{"name": "small_cnn"}]}},
                            "inner model WeightedEnsemble is not a FeatureModel"),
                           ({"spatial_dims": 1}, "spatial_dims must be 2 or 3")]:
            with pytest.raises(ModelConfigError, match=match):
                build_model({**spec, **bad})
    finally:
        pm.unregister(name="docs-stem-cnn")
        sys.modules.pop(module.__name__, None)


def test_installed_model_plugin_trains_with_fedavg_style_and_feature_methods(tmp_path, tiny_fl, example_env):
    """``stem_cnn`` installed from the example package (listed: the test above), trained by
    the example's ``median`` (weights only), FedSDC (embedding and head split) and FedSKD (the
    stages: stage 3 exists only because the stem's output is stage 1)."""
    stem = {"name": "stem_cnn", "stem_channels": 3, "inner": {"name": "small_cnn", "width": 4}}
    tiny_fl.update(rounds=1, plots=False, model=stem,
                   methods=[{"name": "median"}, {"name": "fedsdc", "gamma": 0.5, "min_hidden": 8},
                            {"name": "fedskd", "iterations": 2, "stages": [1, 3]}])
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"fl": tiny_fl}))
    proc = subprocess.run([sys.executable, "-m", "medfl.cli", "run", str(cfg)], env=example_env,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = Path(tiny_fl["output_dir"]) / "t"
    for method in ("median", "fedsdc", "fedskd"):
        recorded = json.loads((out / method / "config.json").read_text())["fl"]
        assert recorded["plugin_names"]["model"] == {"stem_cnn": "medfl-plugin-example:stem_cnn"}
        summary = json.loads((out / method / "summary.json").read_text())
        assert 0 <= summary["final"]["local_test"]["accuracy"]["mean"] <= 1
    # FedSDC's heads take the embedding (embed_dim 8, min_hidden 8: widths around 8)
    widths = json.loads((out / "fedsdc" / "summary.json").read_text())["method_report"]["head_widths"]
    assert len(widths) == 3 and all(1 <= w <= 16 for w in widths)
    # FedSKD distilled the stem's output and the inner model's second stage between peers
    skd = pd.read_csv(out / "fedskd" / "train_metrics.csv")
    peers = skd[skd["self_round"] == 0.0]
    assert len(peers) and (peers["skd_batch"] > 0).all() and (peers["skd_pixel"] > 0).all()
    # a bad option is the model's one-line refusal (ModelConfigError), not a traceback
    proc = subprocess.run([sys.executable, "-m", "medfl.cli", "run", str(cfg), "fl#model#stem_channels=0",
                           "fl#name=bad"], env=example_env, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "medfl: error: stem_cnn: stem_channels must be an integer >= 1, got 0" in proc.stderr


def test_readme_names_only_what_the_example_code_uses():
    """Every code name the example's README puts in backticks (an attribute, hook, class or
    plugin name) is one its modules or ``pyproject.toml`` use, so a contract name that medfl
    dropped (``payload_exemptions``) cannot linger in it; numbered report columns (``acc_0``)
    count as the ``acc_{i}`` the code writes."""
    code = "\n".join(p.read_text(encoding="utf-8") for p in (*sorted(EXAMPLE.glob("*.py")), EXAMPLE / "pyproject.toml"))
    named = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", (EXAMPLE / "README.md").read_text(encoding="utf-8")))
    stale = sorted(n for n in named if not re.search(rf"\b{n}\b", code) and re.sub(r"_\d+$", "_{", n) not in code)
    assert stale == [], f"examples/medfl-plugin-example/README.md names what its code does not use: {stale}"


# ------------------------------------------------------------------ FedRep and the quick start (issue 66)

FEDREP_SOURCE = EXAMPLE / "medfl_fedrep.py"


def _section(heading: str) -> str:
    """docs/plugins.md from the ``heading`` line up to the next heading of its level or above."""
    text = (ROOT / "docs" / "plugins.md").read_text(encoding="utf-8")
    start = text.index(f"\n{heading}\n")
    level = heading.split(" ")[0]
    ends = [m.start() for m in re.finditer(r"^#{1,%d} " % len(level), text[start + 1:], flags=re.M)][1:]
    return text[start:start + 1 + ends[0]] if ends else text[start:]


@contextmanager
def _plugins(*modules: types.ModuleType):
    """``modules`` registered as plugins under their module names for the block."""
    from medfl.plugins import get_plugin_manager

    pm = get_plugin_manager()
    try:
        for module in modules:
            pm.register(module, name=module.__name__)
        yield
    finally:
        for module in modules:
            pm.unregister(name=module.__name__)


def _module(name: str, source: str) -> types.ModuleType:
    """``source`` executed as a fresh module ``name`` (not kept in ``sys.modules``)."""
    module = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module


def test_quick_start_shows_the_example_fedrep_verbatim_and_its_entry_points():
    """The quick start's method is the example's module, character for character, and its
    ``pyproject.toml`` lines name both of its modules."""
    section = _section("## Quick start: a method and a model plugin")
    assert FEDREP_SOURCE.read_text(encoding="utf-8") in _blocks(section, "python")
    (toml_block,) = _blocks(section, "toml")
    documented = tomllib.loads(toml_block)
    assert documented["project"]["entry-points"]["medfl"] == {"fedrep": "medfl_fedrep", "tiny_net": "medfl_tiny_net"}
    assert documented["tool"]["setuptools"]["py-modules"] == ["medfl_fedrep", "medfl_tiny_net"]


def test_quick_start_runs_as_printed_with_relative_paths(tiny_fl, tmp_path, monkeypatch):
    """The quick start's two modules, as the docs print them, train together in process; the
    config's relative data root and output_dir are read in the folder the run starts in
    (docs/running.md, *Relative paths under each backend*)."""
    method, model = [b for b in _blocks(_section("## Quick start: a method and a model plugin"), "python")
                     if "@hookimpl" in b]
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)
    tiny_fl.update(rounds=1, output_dir="runs", plots=False, model={"name": "tiny_net", "width": 4},
                   methods=[{"name": "fedrep", "head_epochs": 1, "body_epochs": 1}])
    tiny_fl["dataset"]["root"] = "data"
    with _plugins(_module("docs_fedrep", method), _module("docs_tiny_net", model)):
        out = run_experiment(resolve_config(tiny_fl))
    assert Path(out["dir"]).resolve() == here / "runs" / "t" and (here / "data").is_dir()
    summary = json.loads((here / "runs" / "t" / "fedrep" / "summary.json").read_text())
    assert 0 <= summary["final"]["local_test"]["accuracy"]["mean"] <= 1
    assert set(pd.read_csv(here / "runs" / "t" / "fedrep" / "train_metrics.csv")) >= {"loss", "head_loss", "steps"}


def _fedrep_run(tiny_fl, monkeypatch, **fedrep) -> tuple[Path, list[dict], dict]:
    """FedRep of the example on the tiny job (small_cnn, 3 clients), in process; what each
    phase of each client step trained (``phases``) and each client's reply (``replies``)."""
    module = _example_module("medfl_fedrep")
    phases, replies = [], {}
    real_train, real_update = module.train_epochs, module.FedRep.client_update

    def train_epochs(model, loader, optimizer, epochs, **kw):
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        stats = real_train(model, loader, optimizer, epochs, **kw)
        phases.append({"trained": {n for n, p in model.named_parameters() if p.requires_grad},
                       "changed": {n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])}})
        return stats

    def client_update(self, client, instruction):
        reply = real_update(self, client, instruction)
        replies[(client.round, client.client_id)] = reply.payload["model"]
        return reply

    monkeypatch.setattr(module, "train_epochs", train_epochs)
    monkeypatch.setattr(module.FedRep, "client_update", client_update)
    tiny_fl.update(plots=False, methods=[{"name": "fedrep", **fedrep}])
    with _plugins(module):
        out = run_experiment(resolve_config(tiny_fl))
    return Path(out["dir"]) / "fedrep", phases, replies


def test_fedrep_keeps_each_head_at_its_client_and_averages_the_bodies(tiny_fl, monkeypatch):
    """After a round, the coordinator holds only the body, the uniform mean of the replies'
    bodies; each client's state holds its own head, and the heads differ; each client step
    trained the head alone (the body's parameters unchanged), then the body alone."""
    run, phases, replies = _fedrep_run(tiny_fl, monkeypatch, head_epochs=2, body_epochs=1)
    body = torch.load(run / "checkpoints" / "round_0002.pt", weights_only=True)["method"]["global"]
    assert body and not any(k.startswith("head.") for k in body)
    sent = [replies[(2, cid)] for cid in ("0", "1", "2")]
    for k, v in body.items():
        assert all(list(s) == list(body) for s in sent)
        mean = torch.stack([s[k].double() for s in sent]).mean(0)
        assert torch.allclose(v.double(), mean.round() if not v.is_floating_point() else mean, atol=1e-6), k
    heads = [torch.load(run / "clients" / cid / "state_r0002.pt", weights_only=True)["local"] for cid in ("0", "1", "2")]
    assert all(sorted(h) == ["head.bias", "head.weight"] for h in heads)
    assert not torch.equal(heads[0]["head.weight"], heads[1]["head.weight"])
    assert not torch.equal(heads[1]["head.weight"], heads[2]["head.weight"])
    params = phases[0]["trained"] | phases[1]["trained"]
    assert len(phases) == 2 * 3 * 2   # two phases, three clients, two rounds
    for head, body_phase in zip(phases[::2], phases[1::2]):
        assert head["trained"] == {"head.weight", "head.bias"} and head["changed"] <= head["trained"]
        assert body_phase["trained"] == params - head["trained"] and body_phase["changed"] <= body_phase["trained"]
        assert head["changed"] and body_phase["changed"]


def test_fedrep_resumed_run_gives_the_same_numbers(tiny_fl, monkeypatch):
    """Stopped after round 2 of 3 and resumed, FedRep (its heads in the clients' saved state)
    writes the uninterrupted run's numbers."""
    from medfl.engine.runner import Run

    tiny_fl.update(rounds=3)
    full, _, _ = _fedrep_run(dict(tiny_fl, name="full"), monkeypatch, head_epochs=1, body_epochs=1)
    real = Run.run_round

    def run_round(self, r, pm):
        if r == 3:
            raise KeyboardInterrupt
        return real(self, r, pm)

    monkeypatch.setattr(Run, "run_round", run_round)
    with pytest.raises(KeyboardInterrupt):
        _fedrep_run(dict(tiny_fl, name="cut"), monkeypatch, head_epochs=1, body_epochs=1)
    monkeypatch.setattr(Run, "run_round", real)
    cut = Path(tiny_fl["output_dir"]) / "cut"
    with _plugins(_example_module("medfl_fedrep")):
        resume(cut)
    for f in ("metrics.csv", "train_metrics.csv"):
        pd.testing.assert_frame_equal(pd.read_csv(full / f), pd.read_csv(cut / "fedrep" / f), check_exact=True, obj=f)


def test_fedrep_refuses_a_schedule_without_epochs_and_a_model_without_a_head():
    from medfl import MethodConfigError

    fedrep = _example_module("medfl_fedrep")
    with pytest.raises(MethodConfigError, match="fedrep: head_epochs and body_epochs must be >= 0 and not both 0"):
        fedrep.FedRep(head_epochs=0, body_epochs=0)
    with pytest.raises(MethodConfigError, match="fedrep: model Linear has no head_keys"):
        fedrep.FedRep().local_keys(torch.nn.Linear(2, 2))


def test_every_line_of_the_names_table_imports():
    """docs/plugins.md's *Names and where to import them*: each line imports as written, and
    the table covers the names plugin authors had to guess."""
    section = _section("## Names and where to import them")
    lines = re.findall(r"^\| `(from [\w.]+ import [\w, ]+)` \|", section, flags=re.M)
    assert lines and len(lines) == section.count("\n| `")
    for line in lines:
        exec(line, {})
    named = {n.strip() for line in lines for n in line.split(" import ")[1].split(",")}
    assert {"Method", "Instruction", "Reply", "Federation", "ClientContext", "Preset", "MethodConfigError", "OwnDp",
            "hookimpl", "Filter", "train_epochs", "HubAndSpoke", "PublicData", "SampleRelease", "Tracker", "Backend",
            "PluginError", "PluginWarning"} <= named
