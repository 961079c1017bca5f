"""FedSKD, FedCross and FedCross-dagger through the engine (tiny synthetic federations)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import torch

import medfl_plugins.fedskd as fedskd_mod
from medfl.engine.data import split_data
from medfl.engine.runner import Run, build_source
from medfl.experiment import resume, run_experiment
from medfl.method import MethodConfigError
from medfl_plugins.fedskd import FedSKD, permutation


def _het(tiny_fl: dict[str, Any], **method: Any) -> dict[str, Any]:
    fl = dict(tiny_fl)
    fl.update(model={"name": "resnet10", "width": 6}, client_models=[{"width": 6}, {"width": 5}, {"width": 4}],
              train={"batch_size": 8, "lr": 0.001, "optimizer": "adam"},
              eval_splits=["test", "cross_test"], methods=[{"name": "fedskd", "iterations": 2, **method}])
    fl["dataset"] = {**fl["dataset"], "image_size": 16}
    return fl


def test_permutation_is_one_to_one_and_seeded() -> None:
    ids = [str(i) for i in range(7)]
    seen_self = 0
    for r in range(1, 60):
        order = permutation(ids, 3, r)
        assert sorted(order) == ids and sorted(order.values()) == ids   # a bijection
        seen_self += sum(k == v for k, v in order.items())
        assert order == permutation(ids, 3, r)                          # same seed, same order
    assert seen_self > 0                                                # self-consolidation happens
    assert any(permutation(ids, 3, r) != permutation(ids, 4, r) for r in range(1, 5))


class _Recorder(Run):
    """A Run that keeps every instruction and reply it routes (for the payload audit)."""

    log: list[tuple[int, str, Any, Any]]

    def update_clients(self, r, instructions):  # type: ignore[no-untyped-def]
        replies = super().update_clients(r, instructions)
        for cid, ins in instructions.items():
            self.log.append((r, cid, ins, replies.get(cid)))
        return replies


def _recorded_run(fl: dict[str, Any], resolve, tmp_path: Path) -> _Recorder:
    cfg = resolve(fl)
    data = split_data(build_source(cfg["dataset"]), cfg)
    run = _Recorder(cfg, cfg["methods"][0], tmp_path / "rec", data)
    run.log = []
    run.prepare()
    run.execute()
    return run


def test_only_model_weights_cross_between_clients(tiny_fl, resolve, tmp_path: Path) -> None:
    run = _recorded_run(_het(tiny_fl), resolve, tmp_path)
    specs = {cid: run.federation.model_spec(cid) for cid in run.federation.eval_client_ids}
    keys = {cid: set(run.federation.build_model(cid).state_dict()) for cid in specs}
    shapes = {cid: {k: tuple(v.shape) for k, v in run.federation.build_model(cid).state_dict().items()}
              for cid in specs}
    assert len(run.log) == 2 * 3
    for r, cid, ins, reply in run.log:
        sender = ins.config["sender"]
        assert set(ins.payload) <= {"ktm"}
        assert ("ktm" in ins.payload) == (r > 1 and sender != cid)
        if "ktm" in ins.payload:   # the sender's DAM, nothing else
            assert set(ins.payload["ktm"]) == keys[sender]
            assert {k: tuple(v.shape) for k, v in ins.payload["ktm"].items()} == shapes[sender]
        for k, v in ins.config.items():
            assert isinstance(v, (bool, int, float, str)), k
        if not ins.config["self"]:
            assert json.loads(ins.config["ktm_spec"]) == specs[sender]
        assert set(reply.payload) == {"dam"} and set(reply.payload["dam"]) == keys[cid]
        assert all(isinstance(v, torch.Tensor) for v in reply.payload["dam"].values())
        assert all(isinstance(v, float) for v in reply.metrics.values())
    # heterogeneous: the three DAMs have different widths
    dams = run.coordinator.dams
    assert len({dams[c]["conv1.weight"].shape[0] for c in dams}) == 3


def test_ktm_head_is_frozen_while_its_body_trains(tiny_fl, resolve, tmp_path: Path, monkeypatch) -> None:
    built: list[tuple[torch.nn.Module, dict[str, torch.Tensor]]] = []
    real_load = fedskd_mod._load

    def spy(spec, seed, state, device):  # type: ignore[no-untyped-def]
        model = real_load(spec, seed, state, device)
        built.append((model, {k: v.clone() for k, v in model.state_dict().items()}))
        return model

    monkeypatch.setattr(fedskd_mod, "_load", spy)
    fl = _het(tiny_fl)
    fl["rounds"] = 1
    run = _recorded_run(fl, resolve, tmp_path)
    ktms = [(m, before) for m, before in built if any(not p.requires_grad for p in m.parameters())]
    non_self = [cid for _, cid, ins, _ in run.log if not ins.config["self"]]
    assert len(ktms) == len(non_self) > 0
    for model, before in ktms:
        after = model.state_dict()
        head = set(model.head_keys())
        assert head and all(torch.equal(after[k], before[k]) for k in head)
        body = [k for k in model.body_keys() if k.endswith("weight")]
        assert any(not torch.equal(after[k], before[k]) for k in body)


def test_round_one_ktm_is_the_senders_initial_model(tiny_fl, resolve, tmp_path: Path, monkeypatch) -> None:
    built: list[tuple[dict[str, Any], dict[str, torch.Tensor]]] = []
    real_build = fedskd_mod.build_seeded

    def spy(spec, seed, device):  # type: ignore[no-untyped-def]
        model = real_build(spec, seed, device)
        built.append((dict(spec), {k: v.clone() for k, v in model.state_dict().items()}))
        return model

    monkeypatch.setattr(fedskd_mod, "build_seeded", spy)
    fl = _het(tiny_fl)
    fl["rounds"] = 1
    run = _recorded_run(fl, resolve, tmp_path)
    inits = {}
    for cid in run.federation.eval_client_ids:   # what each client builds as its own DAM
        inits[cid] = real_build(run.federation.model_spec(cid), fedskd_mod.derive_seed(0, "init", cid), "cpu").state_dict()
    for _, cid, ins, _ in run.log:
        if ins.config["self"]:
            continue
        sender = ins.config["sender"]
        matches = [s for spec, s in built if spec == json.loads(ins.config["ktm_spec"])
                   and torch.equal(s["conv1.weight"], inits[sender]["conv1.weight"])]
        assert matches, f"client {cid} did not receive client {sender}'s initial model"


def test_skd_start_and_switches(tiny_fl, resolve, tmp_path: Path) -> None:
    fl = _het(tiny_fl, skd_start=0.5, terms=["batch"], stages=[3, 4], gamma=2.0)
    out = run_experiment(resolve(fl))
    tm = pd.read_csv(Path(out["dir"]) / "fedskd" / "train_metrics.csv")
    assert set(tm.loc[tm["round"] == 1, "skd_active"]) == {0.0}
    assert set(tm.loc[tm["round"] == 2, "skd_active"]) == {1.0}
    assert "skd_pixel" not in tm.columns
    r2 = tm[(tm["round"] == 2) & (tm["self_round"] == 0)]
    assert (r2["skd_batch"] > 0).all()
    with pytest.raises(MethodConfigError, match="terms"):
        FedSKD(terms=["voxel"])
    with pytest.raises(MethodConfigError, match="skd_start"):
        FedSKD(skd_start=1.0)
    with pytest.raises(MethodConfigError, match="stages"):
        FedSKD(stages=[0])


def test_region_term_with_an_atlas_file(tiny_fl, resolve, tmp_path: Path) -> None:
    import numpy as np

    atlas = np.zeros((16, 16), dtype=np.int32)
    atlas[:8, :8], atlas[:8, 8:], atlas[8:, :] = 1, 2, 3
    atlas[15, 15] = 4
    np.save(tmp_path / "atlas.npy", atlas)
    fl = _het(tiny_fl, atlas=str(tmp_path / "atlas.npy"))
    fl["rounds"] = 1
    out = run_experiment(resolve(fl))
    tm = pd.read_csv(Path(out["dir"]) / "fedskd" / "train_metrics.csv")
    assert (tm.loc[tm["self_round"] == 0, "skd_region"] > 0).all()
    fl["methods"] = [{"name": "fedskd", "atlas": str(tmp_path / "missing.nii.gz")}]
    with pytest.raises(Exception, match="missing.nii.gz"):
        run_experiment(resolve(fl))


def test_fedskd_resumes_exactly(tiny_fl, resolve, tmp_path: Path) -> None:
    fl = _het(tiny_fl)
    full = run_experiment(resolve({**fl, "name": "full"}))
    part = run_experiment(resolve({**fl, "name": "part", "stop_after_round": 1}))
    resume(Path(part["dir"]) / "fedskd")
    a = pd.read_csv(Path(full["dir"]) / "fedskd" / "metrics.csv")
    b = pd.read_csv(Path(part["dir"]) / "fedskd" / "metrics.csv")
    pd.testing.assert_frame_equal(a, b)


def test_cross_test_averages_every_clients_test_split_equally(tiny_fl, resolve, tmp_path: Path) -> None:
    out = run_experiment(resolve(_het(tiny_fl)))
    d = Path(out["dir"]) / "fedskd"
    metrics = pd.read_csv(d / "metrics.csv", dtype={"client_id": str})
    pairs = pd.read_csv(d / "cross_test.csv", dtype={"client_id": str, "data_client_id": str})
    assert len(pairs) == 2 * 3 * 3
    for (r, cid), grp in pairs.groupby(["round", "client_id"]):
        row = metrics[(metrics["round"] == r) & (metrics["client_id"] == cid) & (metrics["split"] == "cross_test")]
        assert row["accuracy"].item() == pytest.approx(grp["accuracy"].mean())
        assert row["n"].item() == grp["n"].sum()
        own = pairs[(pairs["round"] == r) & (pairs["client_id"] == cid) & (pairs["data_client_id"] == cid)]
        local = metrics[(metrics["round"] == r) & (metrics["client_id"] == cid) & (metrics["split"] == "local_test")]
        assert own["accuracy"].item() == pytest.approx(local["accuracy"].item())


def test_fedcross_visits_every_client_in_sequence(tiny_fl, resolve, tmp_path: Path) -> None:
    fl = dict(tiny_fl)
    fl["methods"] = [{"name": "fedcross", "iterations": 2}]
    run = _recorded_run(fl, resolve, tmp_path)
    ids = run.federation.client_ids
    for r in (1, 2):
        hops = [(cid, ins, rep) for rr, cid, ins, rep in run.log if rr == r]
        assert sorted(c for c, _, _ in hops) == ids                      # each client once
        assert [ins.config["hop"] for _, ins, _ in hops] == list(range(len(ids)))
        for (_, _, rep), (_, ins, _) in zip(hops, hops[1:]):            # chained: output -> next input
            assert all(torch.equal(rep.payload["model"][k], ins.payload["model"][k]) for k in rep.payload["model"])
    tm = pd.read_csv(run.run_dir / "train_metrics.csv")
    assert len(tm) == 2 * len(ids)
    fl["client_models"] = [{"width": 4}, {"width": 3}, {"width": 2}]
    with pytest.raises(MethodConfigError, match="fedcross_het"):
        _recorded_run(fl, resolve, tmp_path / "x")


def test_fedcross_het_models_change_hands_with_their_architecture(tiny_fl, resolve, tmp_path: Path) -> None:
    fl = _het(tiny_fl)
    fl["methods"] = [{"name": "fedcross_het", "iterations": 2}]
    run = _recorded_run(fl, resolve, tmp_path)
    widths = {"0": 6, "1": 5, "2": 4}
    holder = dict(widths)                     # architecture each client holds
    for r in (1, 2):
        order = permutation(run.federation.client_ids, 0, r)
        new = {cid: holder[sender] for cid, sender in order.items()}
        for rr, cid, ins, rep in run.log:
            if rr == r:
                assert json.loads(ins.config["spec"])["width"] == new[cid]
                assert rep.payload["model"]["conv1.weight"].shape[0] == new[cid]
        holder = new
    assert sorted(holder.values()) == sorted(widths.values())   # the same models, moved around
    assert (run.run_dir / "cross_test.csv").is_file()


#: FedSKD's presets as docs/plugins.md documents them: (gamma, terms, iterations, rounds, clients)
SKD_PRESETS = {"paper_asd": (1.0, ["batch", "pixel", "region"], 20, 40, 4),
               "paper_skin": (100.0, ["batch", "pixel"], 15, 45, 3)}


def test_presets_resolve_to_their_documented_values(tiny_fl, resolve) -> None:
    """config.json's preset block of a run (one round, ``iterations`` overridden to stay quick:
    recorded as the config's), and every preset's documented values through the function that
    writes that block."""
    from medfl.config import build_method, preset_record

    fl = _het(tiny_fl)
    fl["rounds"] = 1
    fl["methods"] = [{"name": "fedskd", "preset": "paper_skin", "iterations": 1}]
    out = run_experiment(resolve(fl))
    saved = json.loads((Path(out["dir"]) / "fedskd" / "config.json").read_text())["preset"]
    assert saved["name"] == "paper_skin" and saved["values"]["iterations"] == {"value": 1, "from": "config"}
    assert saved["values"]["gamma"] == {"value": 100.0, "from": "paper",
                                        "source": "sec. III-B3 ('... and 100 for the skin lesion classification task')"}
    for name, (gamma, terms, iterations, rounds, clients) in SKD_PRESETS.items():
        spec = {"name": "fedskd", "preset": name}
        block = preset_record(spec, build_method(spec))
        values = {k: v["value"] for k, v in block["values"].items()}
        assert values == {"gamma": gamma, "terms": terms, "stages": [1, 2, 3, 4], "skd_start": 0.0,
                          "iterations": iterations, "freeze_ktm_head": True}
        # "5 training iterations" a round is a reading (steps or passes); the rest is stated
        assert {k for k, v in block["values"].items() if v["from"] != "paper"} == {"iterations"}
        assert block["values"]["iterations"]["from"] == "reading"
        assert {k: v["value"] for k, v in block["train"].items()} == {"optimizer": "adam", "lr": 1e-4, "batch_size": 8,
                                                                     "weight_decay": 0.0}
        assert {k: v["from"] for k, v in block["train"].items()} == {"optimizer": "paper", "lr": "paper",
                                                                    "batch_size": "paper", "weight_decay": "open"}
        assert block["experiment"]["rounds"] == rounds and block["experiment"]["num_clients"] == clients
