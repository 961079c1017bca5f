"""The example third-party plugin installs, shows up in `medfl plugins` and runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import torch

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "medfl-plugin-example"


def test_median_aggregation_hand_computed():
    sys.path.insert(0, str(EXAMPLE))
    try:
        from medfl_median import FedMedian
    finally:
        sys.path.remove(str(EXAMPLE))
    states = [{"w": torch.tensor([1.0, 9.0])}, {"w": torch.tensor([2.0, -5.0])},
              {"w": torch.tensor([100.0, 0.0])}]
    out = FedMedian().aggregate(states, [1, 1, 1])
    assert out["w"].tolist() == [2.0, 0.0]
    out = FedMedian().aggregate(states[:2], [1, 1])
    assert out["w"].tolist() == [1.5, 2.0]


def _example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        import medfl_median
    finally:
        sys.path.remove(str(EXAMPLE))
    return medfl_median


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


def test_mean_probability_ensemble_returns_probabilities():
    ex = _example()
    torch.manual_seed(0)
    ens = ex.MeanProbability([torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)])
    p = ens(torch.randn(5, 3))
    assert ens.returns_probabilities and torch.allclose(p.sum(1), torch.ones(5))


def test_installed_example_plugin_is_listed_and_runs(tmp_path, tiny_fl):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--no-index", "--target", str(target), str(EXAMPLE)], check=True, capture_output=True)
    env = dict(os.environ, PYTHONPATH=str(target))
    listed = subprocess.run([sys.executable, "-m", "medfl.cli", "plugins", "--json"], env=env,
                            capture_output=True, text=True, check=True)
    info = {p["name"]: p for p in json.loads(listed.stdout)}
    plugin = info["medfl-plugin-example:median"]
    assert plugin["distribution"] == "medfl-plugin-example" and plugin["version"] == "0.1.0"
    assert plugin["registered"] == {"method": ["dp_fedavg_opacus", "dp_shared_images", "median", "median_snapshots"],
                                    "filter": ["half"]}
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
    import pytest

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
