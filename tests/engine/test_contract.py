"""The method contract: sampling, separate roles, client state on disk, method parameters."""

from __future__ import annotations

import pytest
import torch

from medfl.engine.store import ClientStore
from medfl.experiment import run_experiment
from medfl.method import Federation, Method, MethodConfigError
from medfl_plugins.baselines import FedAvg, FedProx


def _fed(fraction: float, n: int = 10, seed: int = 0) -> Federation:
    ids = [str(i) for i in range(n)]
    return Federation(client_ids=ids, eval_client_ids=ids, num_examples={i: 1 for i in ids},
                      num_classes=2, rounds=5, seed=seed, fraction=fraction)


def test_sampling_is_seeded_by_seed_and_round_only():
    a, b = _fed(0.3), _fed(0.3)
    assert [a.sample(r) for r in range(1, 6)] == [b.sample(r) for r in range(1, 6)]
    assert all(len(a.sample(r)) == 3 for r in range(1, 6))
    assert len({tuple(a.sample(r)) for r in range(1, 6)}) > 1  # changes across rounds
    assert _fed(0.3, seed=1).sample(1) != a.sample(1) or _fed(0.3, seed=1).sample(2) != a.sample(2)
    assert _fed(0.01).sample(1) and len(_fed(0.01).sample(1)) == 1  # at least one client
    assert _fed(1.0).sample(3) == [str(i) for i in range(10)]


def test_method_parameters_are_checked():
    assert FedProx.parameters() == {"mu": 0.01}
    with pytest.raises(MethodConfigError, match="valid parameters: mu"):
        FedProx.from_config({"mu": 0.1, "lr": 1})
    with pytest.raises(ValueError, match="mu must be >= 0"):
        FedProx.from_config({"mu": -1})


def test_client_store_versions_prune_and_rollback(tmp_path):
    store = ClientStore(tmp_path)
    assert store.load("0", 1) == {} and not store.has("0")
    for r in (1, 2, 3):
        store.save("0", r, {"w": torch.tensor([float(r)])})
    assert store.load("0", 3)["w"].item() == 2.0  # state *before* round 3
    assert store.load("0", 99)["w"].item() == 3.0
    store.prune(2)  # checkpoint of round 2 exists: round 1's version is no longer needed
    assert sorted(p.name for p in (tmp_path / "0").glob("state_r*.pt")) == ["state_r0002.pt", "state_r0003.pt"]
    # each state has its checksum beside it; the pruned one's went with it
    assert sorted(p.name for p in (tmp_path / "0").glob("*.sha256")) == ["state_r0002.pt.sha256",
                                                                         "state_r0003.pt.sha256"]
    store.rollback(2)  # resuming after round 2 redoes round 3
    assert store.load("0", 99)["w"].item() == 2.0


class _Peek(FedAvg):
    """Fails if client code can see coordinator state (it must run on a separate instance)."""

    name = "peek"

    def client_update(self, client, instruction):
        assert not hasattr(self, "global_state"), "client role sees coordinator state"
        assert not hasattr(self, "federation"), "client role was set up"
        return super().client_update(client, instruction)


def test_client_role_is_a_separate_instance(tiny_fl, resolve):
    from medfl import hookimpl
    from medfl.plugins import get_plugin_manager

    class Plugin:
        @hookimpl
        def register_methods(self, register):
            register(_Peek)

    pm = get_plugin_manager()
    pm.register(Plugin(), name="peek-test")
    try:
        tiny_fl.update(rounds=1, methods=[{"name": "peek"}])
        out = run_experiment(resolve(tiny_fl))
        assert out["summaries"]["peek"]["rounds"] == 1
    finally:
        pm.unregister(name="peek-test")


def test_natural_split_with_mapping_and_sampling(tiny_fl, resolve):
    mapping = {"site_0": "A", "site_1": "A", "site_2": "B", "site_3": "B"}
    tiny_fl.update(rounds=2, num_clients=2, fraction=0.5,
                   partition={"name": "natural", "column": "site", "mapping": mapping},
                   methods=[{"name": "fedavg"}, {"name": "fedprox"}])
    out = run_experiment(resolve(tiny_fl))
    import pandas as pd
    from pathlib import Path

    exp = Path(out["dir"])
    part = pd.read_csv(exp / "partition.csv", keep_default_na=False)
    assert set(part.loc[part["client_id"] != "", "client_name"]) == {"A", "B"}
    t1 = pd.read_csv(exp / "fedavg" / "train_metrics.csv")
    t2 = pd.read_csv(exp / "fedprox" / "train_metrics.csv")
    assert (t1.groupby("round").size() == 1).all()  # half of two clients each round
    assert t1["client_id"].tolist() == t2["client_id"].tolist()  # same sampled clients
    m = pd.read_csv(exp / "fedavg" / "metrics.csv", dtype={"client_name": str})
    assert set(m["client_name"]) == {"A", "B"}  # every client evaluated every round


def test_method_base_requires_client_update():
    with pytest.raises(NotImplementedError):
        Method().client_update(None, None)
