"""Tests for medfl.models.cnn: PFedCDP's two-block CNNs and the weighted ensemble."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from medfl.models import (
    FeatureModel,
    TwoBlockCNN,
    WeightedEnsemble,
    pfedcdp_a,
    pfedcdp_b,
    pfedcdp_c,
    pfedcdp_student,
    two_block_cnn,
    weighted_ensemble,
)
from medfl.models.registry import ModelConfigError, build_model

PAPER = {"pfedcdp_a": pfedcdp_a, "pfedcdp_b": pfedcdp_b, "pfedcdp_c": pfedcdp_c,
         "pfedcdp_student": pfedcdp_student}
# name -> (filters, dense, has dropout)
PAPER_ARCH = {"pfedcdp_a": ((32, 64), 128, False), "pfedcdp_b": ((16, 32), 64, True),
              "pfedcdp_c": ((8, 16), 32, False), "pfedcdp_student": ((16, 32), 64, True)}
# (spatial_dims, input shape (B, C, *spatial))
SHAPES = [(2, (2, 1, 32, 32)), (2, (2, 1, 64, 48)), (3, (2, 1, 16, 16, 16)), (2, (1, 3, 20, 20))]
KEYS = ["layer1.0.weight", "layer1.0.bias", "layer2.0.weight", "layer2.0.bias",
        "fc.weight", "fc.bias", "head.weight", "head.bias"]
BAD_ARGS = [
    ({"spatial_dims": 1}, "spatial_dims"),
    ({"in_channels": 0}, "in_channels"),
    ({"num_classes": 1.5}, "num_classes"),
    ({"filters": (32,)}, "filters"),
    ({"filters": "ab"}, "filters"),
    ({"filters": (32, 0)}, r"filters\[1\]"),
    ({"dense": 0}, "dense"),
    ({"dropout": 1.0}, "dropout"),
    ({"dropout": -0.1}, "dropout"),
    ({"dropout": True}, "dropout"),
    ({"pool": 0}, "pool"),
]


def _x(shape: tuple[int, ...], seed: int = 1) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("name", list(PAPER))
@pytest.mark.parametrize("spatial_dims,shape", SHAPES)
def test_shapes(name: str, spatial_dims: int, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    m = PAPER[name](spatial_dims=spatial_dims, in_channels=shape[1], num_classes=3).eval()
    (f1c, f2c), dense, _ = PAPER_ARCH[name]
    x = _x(shape)
    with torch.no_grad():
        logits = m(x)
        logits_ff, feats = m.forward_features(x)
        emb = m.embed(x)
    b, spatial = shape[0], shape[2:]
    assert isinstance(m, FeatureModel) and isinstance(m, TwoBlockCNN)
    assert logits.shape == (b, 3)
    torch.testing.assert_close(logits_ff, logits)
    torch.testing.assert_close(m.head(emb), logits)
    assert m.embed_dim == dense and emb.shape == (b, dense)
    assert (emb >= 0).all()  # post-ReLU
    assert m.feature_channels == [f1c, f2c]
    assert feats[0].shape == (b, f1c, *(s // 2 for s in spatial))
    assert feats[1].shape == (b, f2c, *(s // 4 for s in spatial))
    assert isinstance(m.head, nn.Linear) and m.head.in_features == dense


def test_dense_layer_does_not_depend_on_input_size() -> None:
    m = pfedcdp_c().eval()
    assert m.fc.in_features == 16 * 4 * 4
    with torch.no_grad():
        for shape in [(1, 1, 8, 8), (1, 1, 16, 16), (1, 1, 100, 70)]:
            assert m(_x(shape)).shape == (1, 2)
    assert pfedcdp_c(spatial_dims=3, pool=2).fc.in_features == 16 * 2 * 2 * 2


def test_pool_is_identity_at_4x_pool_side() -> None:
    """On 16x16 inputs the 4x4 adaptive pool keeps the second block's output as is."""
    m = pfedcdp_a().eval()
    x = _x((2, 1, 16, 16))
    with torch.no_grad():
        f2 = m.forward_features(x)[1][1]
        expected = m.head(m.act(m.fc(torch.flatten(f2, 1))))
        torch.testing.assert_close(m(x), expected)


@pytest.mark.parametrize("name", list(PAPER))
def test_keys_partition_and_do_not_depend_on_widths(name: str) -> None:
    m = PAPER[name]()
    keys = list(m.state_dict())
    assert keys == KEYS
    assert m.head_prefix == "head."
    assert m.head_keys() == ["head.weight", "head.bias"]
    assert sorted(m.body_keys() + m.head_keys()) == sorted(keys)
    assert not set(m.body_keys()) & set(m.head_keys())
    wide = two_block_cnn(filters=(5, 7), dense=9, dropout=0.3, pool=2, spatial_dims=3)
    assert list(wide.state_dict()) == KEYS


def test_paper_sizes_and_dropout() -> None:
    a, b, c, s = pfedcdp_a(), pfedcdp_b(), pfedcdp_c(), pfedcdp_student()
    assert _n_params(a) > _n_params(b) > _n_params(c)
    assert _n_params(b) == _n_params(s)

    def dropouts(m: nn.Module) -> list[float]:
        return [mod.p for mod in m.modules() if isinstance(mod, nn.Dropout)]

    assert dropouts(a) == [] and dropouts(c) == []
    assert dropouts(b) == [0.5] and dropouts(s) == [0.5]
    assert two_block_cnn(dropout=0.0).dropout == 0.0
    assert dropouts(two_block_cnn(dropout=0.2)) == [0.2]


def test_dropout_active_only_in_train_mode() -> None:
    m = pfedcdp_student()
    x = _x((4, 1, 16, 16))
    with torch.no_grad():
        m.eval()
        torch.testing.assert_close(m(x), m(x))
        m.train()
        torch.manual_seed(0)
        y1 = m.embed(x)
        torch.manual_seed(1)
        y2 = m.embed(x)
    assert not torch.equal(y1, y2)


@pytest.mark.parametrize("kwargs,match", BAD_ARGS)
def test_bad_arguments_name_the_argument(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        two_block_cnn(**kwargs)


@pytest.mark.parametrize("name", [*PAPER, "two_block_cnn"])
def test_registry_builds_by_name(name: str) -> None:
    m = build_model({"name": name, "spatial_dims": 2, "in_channels": 1, "num_classes": 2})
    assert isinstance(m, TwoBlockCNN)
    assert m(torch.zeros(1, 1, 32, 32)).shape == (1, 2)


def test_registry_rejects_width_knobs_on_paper_models() -> None:
    with pytest.raises(ModelConfigError, match="filters"):
        build_model({"name": "pfedcdp_a", "filters": [4, 8]})
    m = build_model({"name": "two_block_cnn", "filters": [4, 8], "dense": 16, "spatial_dims": 3})
    assert m.feature_channels == [4, 8] and m.embed_dim == 16


def test_dp_compatible_two_block_cnn_keeps_its_keys() -> None:
    pytest.importorskip("opacus")
    m = build_model({"name": "pfedcdp_b", "dp_compatible": True})
    assert list(m.state_dict()) == KEYS


# --------------------------------------------------------------------------------------------
# weighted ensemble
# --------------------------------------------------------------------------------------------

ENSEMBLE_SPEC = {
    "name": "weighted_ensemble",
    "members": [{"name": "pfedcdp_a"}, {"name": "pfedcdp_b"}, {"name": "pfedcdp_c"}],
    "weights": [0.5, 0.3, 0.2],
    "spatial_dims": 2, "in_channels": 1, "num_classes": 3,
}


def test_ensemble_is_weighted_sum_of_loaded_members() -> None:
    torch.manual_seed(0)
    teachers = [pfedcdp_a(num_classes=3), pfedcdp_b(num_classes=3), pfedcdp_c(num_classes=3)]
    ens = build_model(json.loads(json.dumps(ENSEMBLE_SPEC))).eval()  # the spec survives JSON
    assert isinstance(ens, WeightedEnsemble) and len(ens.members) == 3
    for member, teacher in zip(ens.members, teachers):
        member.load_state_dict(teacher.state_dict())
        teacher.eval()
    x = _x((4, 1, 32, 32))
    with torch.no_grad():
        expected = 0.5 * teachers[0](x) + 0.3 * teachers[1](x) + 0.2 * teachers[2](x)
        out = ens(x)
    assert out.dtype == torch.float32 and out.shape == (4, 3)
    torch.testing.assert_close(out, expected)


def test_ensemble_state_round_trips_into_a_second_build() -> None:
    torch.manual_seed(0)
    first = build_model(ENSEMBLE_SPEC).eval()
    torch.manual_seed(1)
    second = build_model(ENSEMBLE_SPEC).eval()
    state = first.state_dict()
    assert all(k.startswith(("members.0.", "members.1.", "members.2.")) for k in state)
    assert list(state) == [f"members.{i}.{k}" for i in range(3) for k in KEYS]
    assert all(v.dtype == torch.float32 for v in state.values())
    second.load_state_dict(state)  # strict
    x = _x((2, 1, 24, 24))
    with torch.no_grad():
        torch.testing.assert_close(second(x), first(x))


def test_ensemble_weights_are_normalised_and_default_uniform() -> None:
    ens = weighted_ensemble(members=[{"name": "pfedcdp_c"}] * 2, weights=[3, 1])
    assert ens.weights == [0.75, 0.25]
    ens = weighted_ensemble(members=[{"name": "pfedcdp_c"}] * 4)
    assert ens.weights == [0.25] * 4
    assert all(type(w) is float for w in ens.weights)


def test_ensemble_fills_member_specs_and_checks_conflicts() -> None:
    ens = weighted_ensemble(members=[{"name": "pfedcdp_c"}, {"name": "small_cnn", "width": 4}],
                            spatial_dims=3, in_channels=2, num_classes=4)
    assert [s["spatial_dims"] for s in ens.member_specs] == [3, 3]
    assert ens(torch.zeros(1, 2, 16, 16, 16)).shape == (1, 4)
    with pytest.raises(ValueError, match=r"members\[1\]\.num_classes"):
        weighted_ensemble(members=[{"name": "pfedcdp_c"}, {"name": "pfedcdp_c", "num_classes": 5}])


@pytest.mark.parametrize("kwargs,match", [
    ({"members": []}, "members"),
    ({"members": {"name": "pfedcdp_c"}}, "members"),
    ({"members": [{"width": 4}]}, r"members\[0\]"),
    ({"members": [{"name": "pfedcdp_c"}], "weights": [1, 2]}, "weights"),
    ({"members": [{"name": "pfedcdp_c"}] * 2, "weights": [1, -1]}, r"weights\[1\]"),
    ({"members": [{"name": "pfedcdp_c"}] * 2, "weights": [1, float("nan")]}, r"weights\[1\]"),
    ({"members": [{"name": "pfedcdp_c"}] * 2, "weights": [0, 0]}, "weights"),
    ({"members": [{"name": "pfedcdp_c"}], "spatial_dims": 4}, "spatial_dims"),
])
def test_ensemble_bad_arguments(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        weighted_ensemble(**kwargs)
