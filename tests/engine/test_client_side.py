"""The client side's shortcuts give exactly what the plain way gives: the row index of
FederatedData and the model objects ClientContext.load_model reuses."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from medfl.data.synthetic import synthetic2d
from medfl.context import ClientContext
from medfl.engine.data import POOLED, FederatedData, split_data
from medfl.plugins import registry


def _filter(a: pd.DataFrame, cid: str, role: str) -> np.ndarray:
    if role == "global_test":
        return a.loc[a["role"] == "global_test", "row"].to_numpy()
    if cid == POOLED:
        return a.loc[a["role"] == role, "row"].to_numpy()
    return a.loc[(a["client_id"] == cid) & (a["role"] == role), "row"].to_numpy()


def test_row_index_equals_filtering(tiny_fl, resolve, tmp_path):
    registry()
    cfg = resolve(tiny_fl)
    source = synthetic2d(root=str(tmp_path / "data"), num_samples=96, num_classes=2, image_size=12)
    data = split_data(source, cfg)
    a = data.assignments
    for cid in data.client_ids + [POOLED, "no-such-client"]:
        for role in ("train", "val", "test", "global_test"):
            assert np.array_equal(data.positions(cid, role), _filter(a, cid, role)), (cid, role)
            pd.testing.assert_frame_equal(data.rows(cid, role), source.table.iloc[_filter(a, cid, role)])
    assert data.num_examples() == {c: len(_filter(a, c, "train")) for c in data.client_ids}
    # a reloaded partition indexes the same way
    data.save(tmp_path / "partition.csv")
    again = split_data(source, cfg, saved=tmp_path / "partition.csv")
    assert isinstance(again, FederatedData)
    for cid in data.client_ids:
        assert np.array_equal(again.positions(cid, "train"), data.positions(cid, "train"))


def _ctx(cid: str, rnd: int, spec: dict) -> ClientContext:
    return ClientContext(client_id=cid, round=rnd, seed=1000 * rnd + int(cid), datasets={},
                         model_spec=spec, train={})


def test_load_model_reuses_objects_across_contexts_only():
    registry()
    spec = {"name": "small_cnn", "width": 4, "in_channels": 1, "num_classes": 3}
    full = {k: torch.randn_like(v.float()).to(v.dtype) if v.is_floating_point() else v
            for k, v in _ctx("0", 1, spec).build_model().state_dict().items()}
    a = _ctx("0", 1, spec)
    m1 = a.load_model(full)
    m1.eval()
    for p in m1.parameters():
        p.grad = torch.ones_like(p)
        p.requires_grad_(False)
    m2 = a.load_model(full)  # same context: an independent object
    assert m2 is not m1
    m3 = _ctx("1", 1, spec).load_model(full)  # a later context reuses the last object
    assert m3 is m2
    assert m3.training and all(p.grad is None and p.requires_grad for p in m3.parameters())
    for k, v in m3.state_dict().items():
        assert torch.equal(v, full[k]), k
    # a partial state goes onto a fresh, seeded initialisation, exactly as build_model gives
    partial = {k: v for k, v in full.items() if not k.startswith("head.")}
    assert 0 < len(partial) < len(full)
    c = _ctx("2", 3, spec)
    m4 = c.load_model(partial)
    ref = _ctx("2", 3, spec).build_model().state_dict()
    for k, v in m4.state_dict().items():
        assert torch.equal(v, partial[k] if k in partial else ref[k]), k
    # another spec never gets this spec's object
    other = {**spec, "num_classes": 2}
    assert _ctx("3", 1, other).load_model({}) is not m3


def test_a_reused_model_takes_the_state_as_load_state_dict_does():
    """The reused object is filled by one fused copy; what it then holds, and what a bad state
    raises, are load_state_dict's."""
    registry()
    spec = {"name": "small_cnn", "width": 4, "in_channels": 1, "num_classes": 3}
    ref = _ctx("0", 1, spec).build_model()
    full = {k: torch.randn(v.shape, dtype=torch.float64) if v.is_floating_point() else v + 5
            for k, v in ref.state_dict().items()}           # float64 values: cast as load_state_dict casts
    first = _ctx("0", 7, spec).load_model(full)              # built, then kept for reuse
    reused = _ctx("1", 7, spec).load_model(full)
    assert reused is first
    expect = _ctx("2", 7, spec).build_model()
    expect.load_state_dict(full)
    for (k, v), (k2, w) in zip(reused.state_dict().items(), expect.state_dict().items()):
        assert k == k2 and v.dtype == w.dtype and torch.equal(v, w), k
    # state values are copied in, never shared: changing them later leaves the model alone
    before = {k: v.clone() for k, v in reused.state_dict().items()}
    for v in full.values():
        v.add_(1)
    assert all(torch.equal(v, before[k]) for k, v in reused.state_dict().items())
    # a state whose shapes differ gets load_state_dict's own error, naming the entry
    bad = dict(full)
    name = next(k for k, v in bad.items() if v.dim() == 4)
    bad[name] = torch.zeros(1, 1, 1, 1)
    with pytest.raises(RuntimeError, match=f"size mismatch for {name}"):
        _ctx("3", 7, spec).load_model(bad)


def test_the_model_load_works_without_torchs_fused_copy(monkeypatch):
    """``torch._foreach_copy_`` is private: without it the same values arrive by a loop."""
    registry()
    spec = {"name": "small_cnn", "width": 4, "in_channels": 1, "num_classes": 3}
    full = {k: torch.randn(v.shape) if v.is_floating_point() else v + 2
            for k, v in _ctx("0", 1, spec).build_model().state_dict().items()}
    first = _ctx("0", 9, spec).load_model(full)
    monkeypatch.delattr(torch, "_foreach_copy_")
    reused = _ctx("1", 9, spec).load_model(full)
    assert reused is first
    assert all(torch.equal(v, full[k]) for k, v in reused.state_dict().items())
