"""Tests for medfl.models.resnet: shapes, width knob, key stability, head split, validation."""

from __future__ import annotations

import pytest
import torch
from monai.networks.nets import ResNet
from torch import nn

from medfl.models import (
    FeatureModel,
    FeatureResNet,
    SmallCNN,
    resnet10,
    resnet18,
    resnet34,
    resnet50,
    small_cnn,
    split_state_dict,
)

FACTORIES = {10: resnet10, 18: resnet18, 34: resnet34, 50: resnet50}
DEPTHS = [10, 18, 34, 50]
# (spatial_dims, input shape); 3D uses a single 2-channel volume
INPUTS = {2: (2, 1, 32, 32), 3: (1, 2, 16, 16, 16)}
W = 8


def _make(depth: int, spatial_dims: int, width: int = W, **kw) -> FeatureResNet:
    torch.manual_seed(0)
    in_channels = INPUTS[spatial_dims][1]
    return FACTORIES[depth](
        spatial_dims=spatial_dims, in_channels=in_channels, num_classes=3, width=width, **kw
    ).eval()


def _n_params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


@pytest.mark.parametrize("spatial_dims", [2, 3])
@pytest.mark.parametrize("depth", DEPTHS)
def test_resnet_shapes(depth: int, spatial_dims: int) -> None:
    model = _make(depth, spatial_dims)
    x = torch.randn(*INPUTS[spatial_dims], generator=torch.Generator().manual_seed(1))
    expansion = 4 if depth == 50 else 1
    expected_channels = [W * expansion, 2 * W * expansion, 4 * W * expansion, 8 * W * expansion]
    with torch.no_grad():
        logits = model(x)
        logits_ff, feats = model.forward_features(x)
        emb = model.embed(x)
    b = x.shape[0]
    assert logits.shape == (b, 3)
    torch.testing.assert_close(logits, logits_ff)
    torch.testing.assert_close(model.head(emb), logits)
    assert len(feats) == 4
    assert [f.shape[1] for f in feats] == expected_channels == model.feature_channels
    for f in feats:
        assert f.shape[0] == b and f.ndim == 2 + spatial_dims
    # each later stage halves the spatial size (down to 1)
    sizes = [f.shape[2] for f in feats]
    assert sizes == sorted(sizes, reverse=True)
    assert emb.shape == (b, model.embed_dim) and model.embed_dim == expected_channels[-1]
    assert isinstance(model.head, nn.Linear)
    assert isinstance(model, FeatureModel)


@pytest.mark.parametrize("depth", DEPTHS)
def test_matches_monai_forward(depth: int) -> None:
    """Our re-assembled forward equals MONAI's ResNet forward with the same weights."""
    model = _make(depth, 2, conv1_stride=2)
    block = "bottleneck" if depth == 50 else "basic"
    layers = {10: [1, 1, 1, 1], 18: [2, 2, 2, 2], 34: [3, 4, 6, 3], 50: [3, 4, 6, 3]}[depth]
    ref = ResNet(
        block, layers, [W, 2 * W, 4 * W, 8 * W], spatial_dims=2, n_input_channels=1,
        conv1_t_size=7, conv1_t_stride=2, num_classes=3,
    ).eval()
    state = {k.replace("head.", "fc.", 1): v for k, v in model.state_dict().items()}
    ref.load_state_dict(state, strict=True)
    x = torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


@pytest.mark.parametrize("depth", DEPTHS)
def test_width_knob(depth: int) -> None:
    a, b = _make(depth, 2, width=8), _make(depth, 2, width=6)
    assert _n_params(a) > _n_params(b)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)  # same keys, same order
    differing = [k for k in sa if sa[k].shape != sb[k].shape]
    assert "conv1.weight" in differing and "head.weight" in differing
    # a heterogeneous client's model still runs
    with torch.no_grad():
        assert b(torch.randn(2, 1, 32, 32)).shape == (2, 3)


@pytest.mark.parametrize("depth", DEPTHS)
def test_key_stability(depth: int) -> None:
    a, b = _make(depth, 2), _make(depth, 2)
    assert list(a.state_dict()) == list(b.state_dict())


@pytest.mark.parametrize("depth", DEPTHS)
def test_body_head_partition(depth: int) -> None:
    model = _make(depth, 2)
    keys = list(model.state_dict())
    body, head = model.body_keys(), model.head_keys()
    assert model.head_prefix == FeatureResNet.head_prefix == "head."
    assert set(body) | set(head) == set(keys) and not set(body) & set(head)
    assert len(body) + len(head) == len(keys)
    assert head == ["head.weight", "head.bias"]
    assert all(k.startswith("head.") for k in head)
    assert not any(k.startswith("head.") for k in body)
    sd_body, sd_head = split_state_dict(model)
    assert list(sd_body) == body and list(sd_head) == head
    sd_body2, sd_head2 = split_state_dict(model.state_dict(), head_prefix="head.")
    assert list(sd_body2) == body and list(sd_head2) == head


def test_determinism_under_seed() -> None:
    x = torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(3))
    a, b = _make(18, 2), _make(18, 2)
    for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert ka == kb
        torch.testing.assert_close(va, vb)
    with torch.no_grad():
        torch.testing.assert_close(a(x), b(x), rtol=0, atol=0)
        torch.testing.assert_close(a(x), a(x), rtol=0, atol=0)
    torch.manual_seed(1)
    c = resnet18(spatial_dims=2, in_channels=1, num_classes=3, width=W).eval()
    with torch.no_grad():
        assert not torch.allclose(a(x), c(x))


def test_options() -> None:
    torch.manual_seed(0)
    m = FeatureResNet(
        18, spatial_dims=2, in_channels=1, num_classes=2, width=4,
        conv1_kernel=3, conv1_stride=1, no_max_pool=True,
    ).eval()
    with torch.no_grad():
        _, feats = m.forward_features(torch.randn(2, 1, 16, 16))
    assert feats[0].shape[2:] == (16, 16)  # no downsampling in the stem
    assert m.conv1.kernel_size == (3, 3) and m.conv1.stride == (1, 1)


def test_instance_norm() -> None:
    torch.manual_seed(0)
    m = resnet50(spatial_dims=2, in_channels=1, num_classes=2, width=4, norm="instance")
    assert not any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in m.modules())
    assert any(isinstance(mod, nn.InstanceNorm2d) for mod in m.modules())
    with torch.no_grad():
        assert m(torch.randn(2, 1, 64, 64)).shape == (2, 2)
    keys = set(m.state_dict())
    assert keys <= set(resnet50(spatial_dims=2, width=4).state_dict())
    assert m.head_keys() == ["head.weight", "head.bias"]


def test_train_mode_backward() -> None:
    model = _make(10, 2).train()
    out = model(torch.randn(2, 1, 32, 32))
    out.sum().backward()
    assert model.conv1.weight.grad is not None and model.head.weight.grad is not None


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"depth": 20}, "depth"),
        ({"spatial_dims": 1}, "spatial_dims"),
        ({"in_channels": 0}, "in_channels"),
        ({"num_classes": 0}, "num_classes"),
        ({"width": 0}, "width"),
        ({"width": 8.0}, "width"),
        ({"conv1_kernel": 0}, "conv1_kernel"),
        ({"conv1_stride": 0}, "conv1_stride"),
        ({"no_max_pool": "yes"}, "no_max_pool"),
        ({"norm": "group"}, "norm"),
    ],
)
def test_resnet_bad_args(kwargs: dict, name: str) -> None:
    args = {"depth": 10, "width": 4, **kwargs}
    with pytest.raises(ValueError, match=name):
        FeatureResNet(**args)


def test_factory_bad_args() -> None:
    with pytest.raises(ValueError, match="spatial_dims"):
        resnet18(spatial_dims=4)
    with pytest.raises(TypeError):
        resnet18(2)  # keyword-only


# -------------------------------------------------------------------------------- SmallCNN


@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_small_cnn_shapes(spatial_dims: int) -> None:
    torch.manual_seed(0)
    shape = INPUTS[spatial_dims]
    m = small_cnn(spatial_dims=spatial_dims, in_channels=shape[1], num_classes=4, width=8).eval()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = m(x)
        logits_ff, feats = m.forward_features(x)
        emb = m.embed(x)
    assert logits.shape == (shape[0], 4)
    torch.testing.assert_close(logits, logits_ff)
    torch.testing.assert_close(m.head(emb), logits)
    assert len(feats) >= 2
    assert [f.shape[1] for f in feats] == [8, 16] == m.feature_channels
    assert all(f.ndim == 2 + spatial_dims for f in feats)
    assert emb.shape == (shape[0], 16) == (shape[0], m.embed_dim)
    assert isinstance(m, FeatureModel) and isinstance(m.head, nn.Linear)


def test_small_cnn_width_keys_split_determinism() -> None:
    torch.manual_seed(0)
    a = small_cnn(width=8)
    torch.manual_seed(0)
    a2 = small_cnn(width=8)
    b = small_cnn(width=6)
    assert _n_params(a) > _n_params(b)
    assert list(a.state_dict()) == list(b.state_dict()) == list(a2.state_dict())
    assert any(a.state_dict()[k].shape != b.state_dict()[k].shape for k in a.state_dict())
    keys = list(a.state_dict())
    body, head = a.body_keys(), a.head_keys()
    assert a.head_prefix == SmallCNN.head_prefix == "head."
    assert sorted(body + head) == sorted(keys) and not set(body) & set(head)
    assert head == ["head.weight", "head.bias"]
    x = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(3))
    a.eval(), a2.eval()
    with torch.no_grad():
        torch.testing.assert_close(a(x), a2(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"spatial_dims": 1}, "spatial_dims"),
        ({"in_channels": 0}, "in_channels"),
        ({"num_classes": -1}, "num_classes"),
        ({"width": 0}, "width"),
        ({"norm": "layer"}, "norm"),
    ],
)
def test_small_cnn_bad_args(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SmallCNN(**kwargs)


def test_small_cnn_instance_norm() -> None:
    m = SmallCNN(spatial_dims=3, in_channels=1, width=4, norm="instance")
    assert not any(isinstance(mod, nn.modules.batchnorm._BatchNorm) for mod in m.modules())
    with torch.no_grad():
        assert m(torch.randn(2, 1, 8, 8, 8)).shape == (2, 2)


@pytest.mark.parametrize("spatial_dims", [2, 3])
@pytest.mark.parametrize("norm", ["batch", "instance"])
def test_small_cnn_layers_are_those_monai_factories_give(spatial_dims: int, norm: str) -> None:
    """SmallCNN is built from plain torch layers (no MONAI import); they are the layers, with
    the same arguments and the same seeded weights, that MONAI's factories built before."""
    from monai.networks.layers.factories import Conv, Pool
    from monai.networks.layers.utils import get_act_layer, get_norm_layer

    torch.manual_seed(3)
    ours = SmallCNN(spatial_dims=spatial_dims, in_channels=2, num_classes=3, width=4, norm=norm)

    class Reference(SmallCNN):
        def __init__(self) -> None:
            super().__init__(spatial_dims, 2, 3, 4, norm)
            conv, pool = Conv[Conv.CONV, spatial_dims], Pool[Pool.MAX, spatial_dims]

            def block(cin: int, cout: int) -> nn.Sequential:
                return nn.Sequential(conv(cin, cout, kernel_size=3, padding=1, bias=False),
                                     get_norm_layer(name=norm, spatial_dims=spatial_dims, channels=cout),
                                     get_act_layer(name=("relu", {"inplace": True})),
                                     pool(kernel_size=2, stride=2))

            torch.manual_seed(3)
            self.layer1, self.layer2 = block(2, 4), block(4, 8)
            self.avgpool = Pool[Pool.ADAPTIVEAVG, spatial_dims](1)
            self.head = nn.Linear(8, 3)
            from medfl.models.resnet import _init_weights

            _init_weights(self)

    ref = Reference()
    assert repr(ours) == repr(ref).replace("Reference(", "SmallCNN(", 1)
    assert [type(m) for m in list(ours.modules())[1:]] == [type(m) for m in list(ref.modules())[1:]]
    a, b = ours.state_dict(), ref.state_dict()
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_loading_plugins_and_building_small_models_does_not_import_monai() -> None:
    """``import monai`` loads every MONAI subpackage (seconds); the ``medfl`` command, every
    Flower process and every job without a ResNet or a manifest dataset skip it."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from medfl.plugins import get_plugin_manager\n"
            "get_plugin_manager()\n"
            "from medfl.models.registry import build_model\n"
            "for name in ('small_cnn', 'pfedcdp_a', 'pfedcdp_student'):\n"
            "    build_model({'name': name, 'spatial_dims': 2})\n"
            "assert 'monai' not in sys.modules, sorted(m for m in sys.modules if m.startswith('monai'))[:5]\n"
            "build_model({'name': 'resnet10', 'spatial_dims': 2, 'width': 4})\n"
            "assert 'monai' in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
