"""DP-SGD in local training (medfl.privacy.dp_sgd): Opacus's fixer on the built-in models,
the planned steps against the steps taken (empty Poisson draws included), per-sample clipping
and noise against Opacus's formulas, the regularizer as post-processing, seeding, the model
left pristine, the registry's ``dp_compatible`` key and the hub-and-spoke client update."""

from __future__ import annotations

import copy

import pytest
import torch
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from medfl.context import ClientContext, _pristine, _signature
from medfl.training import train_epochs, with_regularizer
from medfl.messages import Instruction
from medfl.models import resnet10, small_cnn
from medfl.models.registry import ModelConfigError, build_model
from medfl.plugins import registry
from medfl.privacy.accounting import PrivacyConfigError
from medfl.privacy.dp_sgd import dp_problems, make_private_model, planned_steps, train_epochs_dp


def _data(n: int, size: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 1, size, size, generator=g),
                         torch.randint(0, 2, (n,), generator=g))


def _cnn(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return make_private_model(small_cnn(width=4))[0]


def _params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _has(model: nn.Module, kind: type) -> bool:
    return any(isinstance(m, kind) for m in model.modules())


class _CountingSGD(torch.optim.SGD):
    """SGD that counts the steps it takes (DPOptimizer calls it once per noisy step)."""

    taken = 0

    def step(self, closure=None):  # type: ignore[override]
        self.taken += 1
        return super().step(closure)


# ------------------------------------------------------------------ make_private_model
@pytest.mark.parametrize("build, shape", [
    (lambda: resnet10(width=4, spatial_dims=2, in_channels=1), (2, 1, 16, 16)),
    (lambda: resnet10(width=4, spatial_dims=3, in_channels=1), (2, 1, 16, 16, 16)),
    (lambda: small_cnn(width=4, spatial_dims=2, in_channels=1), (2, 1, 16, 16)),
], ids=["resnet10-2d", "resnet10-3d", "small_cnn-2d"])
def test_make_private_model_replaces_batchnorm_and_keeps_the_model(build, shape) -> None:
    torch.manual_seed(0)
    built = build()
    n_bn = sum(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in built.modules())
    fixed, replaced = make_private_model(built, where="model 'x'")
    assert fixed is not built and type(fixed) is type(built)
    assert not _has(fixed, nn.modules.batchnorm._BatchNorm) and _has(fixed, nn.GroupNorm)
    assert _has(built, nn.BatchNorm2d) or _has(built, nn.BatchNorm3d)  # the original is untouched
    assert len(replaced) == n_bn and all(" -> GroupNorm(" in r for r in replaced)
    keys = list(fixed.state_dict())
    assert not [k for k in keys if "running_" in k or "num_batches" in k]
    # the FeatureModel attributes and methods survive Opacus's deep copy
    assert fixed.head_prefix == "head." and fixed.feature_channels == built.feature_channels
    assert sorted(fixed.body_keys() + fixed.head_keys()) == sorted(keys)
    assert fixed.head_keys() == ["head.weight", "head.bias"]
    logits, feats = fixed.forward_features(torch.randn(*shape))
    assert logits.shape == (2, 2) and len(feats) == len(built.feature_channels)
    assert fixed(torch.randn(*shape)).shape == (2, 2)
    assert dp_problems(fixed) == []


def test_make_private_model_names_each_replacement() -> None:
    torch.manual_seed(0)
    _, replaced = make_private_model(small_cnn(width=64))
    # wide enough for Opacus's default: gcd(32, C) groups, exactly what its fix gives alone
    assert replaced == ["layer1.1: BatchNorm2d(64) -> GroupNorm(32, 64)",
                        "layer2.1: BatchNorm2d(128) -> GroupNorm(32, 128)"]
    opacus_alone = ModuleValidator.fix(small_cnn(width=64))
    assert str(opacus_alone) == str(make_private_model(small_cnn(width=64))[0])


def test_narrow_models_get_no_single_channel_groups() -> None:
    torch.manual_seed(0)
    model, replaced = make_private_model(resnet10(width=4))
    # Opacus's default would give GroupNorm(4, 4) ... GroupNorm(32, 32): one channel per group
    assert "layer1.0.bn1: BatchNorm2d(4) -> GroupNorm(2, 4)" in replaced
    assert "layer4.0.downsample.1: BatchNorm2d(32) -> GroupNorm(2, 32)" in replaced
    assert all(m.num_channels // m.num_groups >= 2 for m in model.modules() if isinstance(m, nn.GroupNorm))
    # on 16x16 images layer4's maps are 1x1: single-channel groups would output their bias
    # whatever the input, and PyTorch refuses them for one sample; these still work
    x = torch.randn(4, 1, 16, 16)
    assert model.forward_features(x)[1][-1].shape[2:] == (1, 1)
    assert (model(x).std(dim=0) > 1e-3).all()
    data = _data(1)  # q = 1 and a batch of exactly one sample at every step
    stats = train_epochs_dp(model, data, torch.optim.SGD(model.parameters(), lr=0.1), 2,
                            batch_size=1, noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    assert stats["steps"] == 2.0 and stats["loss"] > 0


def test_a_valid_model_is_returned_as_is() -> None:
    torch.manual_seed(0)
    model = small_cnn(width=4, norm="instance")  # MONAI's instance norm: no parameters, no stats
    assert make_private_model(model) == (model, [])
    fixed = _cnn()
    assert make_private_model(fixed) == (fixed, [])


class _RunningScale(nn.Module):
    """A trainable layer that also records a statistic of its inputs in a buffer."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.register_buffer("running", torch.zeros(channels))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.running.mul_(0.9).add_(0.1 * x.detach().mean(dim=(0, 2, 3)))
        return x * self.weight[None, :, None, None]


@pytest.mark.parametrize("layer, expected", [
    (nn.BatchNorm2d(4, affine=False), "1: BatchNorm2d(4): BatchNorm without trainable parameters"),
    (_RunningScale(4), "1: _RunningScale(): a layer with trainable parameters and buffers (running)"),
], ids=["affine-free-batchnorm", "trainable-layer-with-buffer"])
def test_what_opacus_cannot_fix_is_refused_with_one_clear_message(layer, expected) -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), layer, nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(4, 2))
    # Opacus's own validator passes these after its fix, yet the layer mixes samples or keeps
    # data statistics that DP-SGD does not protect
    assert ModuleValidator.validate(ModuleValidator.fix(model), strict=False) == []
    with pytest.raises(PrivacyConfigError) as err:
        make_private_model(model, where="model 'custom'")
    msg = str(err.value)
    assert msg.startswith("model 'custom': Opacus cannot train this model with per-sample gradients:")
    assert expected in msg and msg.endswith("use a model without these layers")
    # training refuses it too, pointing at the fix
    with pytest.raises(PrivacyConfigError, match="dp_compatible"):
        train_epochs_dp(model, _data(4), torch.optim.SGD(model.parameters(), lr=0.1), 1,
                        batch_size=2, noise_multiplier=1.0, max_grad_norm=1.0, seed=0)


# ------------------------------------------------------------------ planned steps
def test_planned_steps() -> None:
    assert planned_steps(6, 2, 3) == (9, 1 / 3)
    assert planned_steps(7, 2, 1) == (4, 0.25)
    assert planned_steps(93, 1, 2) == (186, 1 / 93)
    assert planned_steps(5, 16, 1) == (1, 1.0)
    assert planned_steps(10, 4, 0) == (0, 1 / 3)
    for args, name in [((0, 2, 1), "num_examples"), ((5, 0, 1), "batch_size"),
                       ((5, 2, -1), "epochs"), ((5, 2.5, 1), "batch_size")]:
        with pytest.raises(ValueError, match=name):
            planned_steps(*args)


def test_steps_taken_equal_the_plan_including_empty_draws() -> None:
    model = _cnn()
    sizes: list[int] = []

    def loss_fn(m: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        sizes.append(int(x.shape[0]))
        return nn.functional.cross_entropy(m(x), y)

    opt = _CountingSGD(model.parameters(), lr=0.05)
    stats = train_epochs_dp(model, _data(6), opt, 3, batch_size=1, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=11, loss_fn=loss_fn)
    steps, q = planned_steps(6, 1, 3)
    assert stats["steps"] == stats["dp_steps"] == steps == 18 == opt.taken
    assert stats["dp_sample_rate"] == q and stats["dp_noise_multiplier"] == 1.0
    assert 0 < len(sizes) < steps  # some draws were empty, and each was still a step
    assert stats["loss"] == stats["loss"] and stats["loss"] > 0  # not NaN


def test_steps_do_not_lose_one_to_float_rounding() -> None:
    # 1 / (1 / 93) < 93 in floating point: Opacus's DPDataLoader would take 92 steps per epoch
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
    data = TensorDataset(torch.randn(93, 4), torch.randint(0, 2, (93,)))
    opt = _CountingSGD(model.parameters(), lr=0.05)
    stats = train_epochs_dp(model, data, opt, 1, batch_size=1, noise_multiplier=1.0,
                            max_grad_norm=1.0, seed=0)
    assert stats["steps"] == planned_steps(93, 1, 1)[0] == 93 == opt.taken


def test_an_update_of_empty_draws_only_is_noise_with_loss_zero() -> None:
    data = TensorDataset(torch.randn(3, 4), torch.randint(0, 2, (3,)))
    for seed in range(200):  # find a seed whose three draws (q = 1/3) are all empty
        calls: list[int] = []

        def loss_fn(m, x, y):
            calls.append(1)
            return nn.functional.cross_entropy(m(x), y)

        model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2))
        before = _params(model)
        stats = train_epochs_dp(model, data, torch.optim.SGD(model.parameters(), lr=0.1), 1,
                                batch_size=1, noise_multiplier=1.0, max_grad_norm=1.0, seed=seed,
                                loss_fn=loss_fn)
        if not calls:
            break
    assert not calls, "no seed drew three empty batches"
    assert stats == {"loss": 0.0, "steps": 3.0, "dp_steps": 3.0, "dp_sample_rate": 1 / 3,
                     "dp_noise_multiplier": 1.0}
    assert all(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # noise moved them


# ------------------------------------------------------------------ clipping and noise
def _one_full_step(model: nn.Module, data: TensorDataset, *, noise: float, clip: float,
                   lr: float = 1.0, seed: int = 0, regularizer=None, epochs: int = 1) -> None:
    """DP-SGD with q = 1 (batch_size >= dataset: every sample in every draw)."""
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.0)
    train_epochs_dp(model, data, opt, epochs, batch_size=len(data), noise_multiplier=noise,
                    max_grad_norm=clip, seed=seed, regularizer=regularizer)


def test_update_is_the_mean_of_clipped_per_sample_gradients() -> None:
    data, clip = _data(5), 0.01
    model = _cnn()
    w0 = _params(model)
    # Opacus's formula: sum_i g_i * min(1, C / (||g_i|| + 1e-6)) / expected batch (q N = 5)
    expected = [torch.zeros_like(w) for w in w0]
    for i in range(5):
        ref = copy.deepcopy(model)
        x, y = data[i:i + 1]
        nn.functional.cross_entropy(ref(x), y).backward()
        grads = [p.grad for p in ref.parameters()]
        norm = torch.sqrt(sum((g ** 2).sum() for g in grads))
        assert norm > clip  # every sample is clipped
        factor = (clip / (norm + 1e-6)).clamp(max=1.0)
        for e, g in zip(expected, grads):
            e += factor * g / 5
    _one_full_step(model, data, noise=0.0, clip=clip)
    update = [w - p.detach() for w, p in zip(w0, model.parameters())]
    for u, e in zip(update, expected):
        torch.testing.assert_close(u, e, atol=1e-7, rtol=1e-4)
    assert torch.sqrt(sum((u ** 2).sum() for u in update)) <= clip * (1 + 1e-5)


def test_noise_has_standard_deviation_sigma_c_over_expected_batch() -> None:
    data, clip, sigma = _data(5), 0.01, 2.0
    quiet, noisy = _cnn(), _cnn()
    _one_full_step(quiet, data, noise=0.0, clip=clip, seed=3)
    _one_full_step(noisy, data, noise=sigma, clip=clip, seed=3)
    diff = torch.cat([(a - b).detach().flatten() for a, b in zip(noisy.parameters(), quiet.parameters())])
    assert diff.numel() > 300
    assert diff.std().item() == pytest.approx(sigma * clip / 5, rel=0.1)
    assert abs(diff.mean().item()) < 0.2 * sigma * clip / 5


# ------------------------------------------------------------------ regularizer
def _prox(model: nn.Module, mu: float, shift: float = 0.1):
    g = torch.Generator().manual_seed(5)
    anchor = [p.detach() + shift * torch.randn(p.shape, generator=g) for p in model.parameters()]

    def proximal(m: nn.Module) -> torch.Tensor:
        return 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(m.parameters(), anchor))

    return anchor, proximal


def test_without_clipping_or_noise_dp_sgd_is_plain_sgd_with_the_regularizer() -> None:
    data = _data(6)
    dp_model = _cnn()
    plain = copy.deepcopy(dp_model)
    _, reg = _prox(dp_model, mu=0.5)
    _one_full_step(dp_model, data, noise=0.0, clip=1e6, lr=0.1, regularizer=reg, epochs=2)
    train_epochs(plain, DataLoader(data, batch_size=6), torch.optim.SGD(plain.parameters(), lr=0.1),
                 2, loss_fn=with_regularizer(None, reg))
    for a, b in zip(dp_model.parameters(), plain.parameters()):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_regularizer_gradient_is_added_after_clipping_never_clipped() -> None:
    model = _cnn()
    w0 = _params(model)
    anchor, reg = _prox(model, mu=1.0)
    # per-sample gradients clipped to ~0: what moves the weights is the regularizer alone
    _one_full_step(model, _data(4), noise=0.0, clip=1e-12, lr=0.1, regularizer=reg)
    for w, a, p in zip(w0, anchor, model.parameters()):
        torch.testing.assert_close(p.detach(), w - 0.1 * (w - a), atol=1e-7, rtol=1e-6)
    moved = sum(((p.detach() - a) ** 2).sum() for p, a in zip(model.parameters(), anchor))
    start = sum(((w - a) ** 2).sum() for w, a in zip(w0, anchor))
    assert moved < start  # towards the anchor


def test_with_regularizer() -> None:
    def ce(m, x, y):
        return nn.functional.cross_entropy(m(x), y)

    assert with_regularizer(None, None) is None and with_regularizer(ce, None) is ce
    model, (x, y) = _cnn(), _data(4)[:]
    _, reg = _prox(model, mu=0.3)
    assert torch.equal(with_regularizer(None, reg)(model, x, y), ce(model, x, y) + reg(model))


# ------------------------------------------------------------------ seeding and clean-up
def _trained_state(seed: int, global_seed: int = 0) -> dict[str, torch.Tensor]:
    model = _cnn()
    torch.manual_seed(global_seed)  # the global RNG plays no part in the sampling or the noise
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    train_epochs_dp(model, _data(8), opt, 2, batch_size=3, noise_multiplier=1.0,
                    max_grad_norm=1.0, seed=seed)
    return model.state_dict()


def test_same_seed_same_weights() -> None:
    a, b, c = _trained_state(7), _trained_state(7, global_seed=99), _trained_state(8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_worker_processes_draw_the_same_batches() -> None:
    def run(workers: int) -> list[torch.Tensor]:
        model = _cnn()
        train_epochs_dp(model, _data(6), torch.optim.SGD(model.parameters(), lr=0.1), 2,
                        batch_size=2, noise_multiplier=1.0, max_grad_norm=1.0, seed=4,
                        num_workers=workers)
        return _params(model)

    assert all(torch.equal(a, b) for a, b in zip(run(0), run(2)))


def test_model_is_left_as_built_after_training_and_after_an_error() -> None:
    model = _cnn()
    sig = _signature(model)
    _, reg = _prox(model, mu=0.1)
    train_epochs_dp(model, _data(6), torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), 2,
                    batch_size=2, noise_multiplier=1.0, max_grad_norm=1.0, seed=0, regularizer=reg)
    assert _pristine(model, sig) and model.training
    assert all(p.grad is None and not vars(p) for p in model.parameters())
    attrs = {n: set(vars(m)) for n, m in model.named_modules()}

    calls: list[int] = []

    def failing(m, x, y):
        calls.append(1)
        if len(calls) == 2:
            raise KeyError("boom")
        return nn.functional.cross_entropy(m(x), y)

    with pytest.raises(KeyError, match="boom"):
        train_epochs_dp(model, _data(12), torch.optim.SGD(model.parameters(), lr=0.1), 3,
                        batch_size=2, noise_multiplier=1.0, max_grad_norm=1.0, seed=0,
                        loss_fn=failing)
    assert _pristine(model, sig) and all(p.grad is None for p in model.parameters())
    assert {n: set(vars(m)) for n, m in model.named_modules()} == attrs


def test_bad_arguments_are_refused() -> None:
    model, data = _cnn(), _data(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    good = dict(batch_size=2, noise_multiplier=1.0, max_grad_norm=1.0, seed=0)
    for bad, name in [({"noise_multiplier": -0.1}, "noise_multiplier"),
                      ({"max_grad_norm": 0.0}, "max_grad_norm"),
                      ({"max_grad_norm": float("inf")}, "max_grad_norm"),
                      ({"batch_size": 0}, "batch_size")]:
        with pytest.raises(ValueError, match=name):
            train_epochs_dp(model, data, opt, 1, **{**good, **bad})
    with pytest.raises(ValueError, match="epochs"):
        train_epochs_dp(model, data, opt, -1, **good)
    captured = list(model.parameters())

    def leaky(m, x, y):  # a data-independent term on parameters captured before the call
        return nn.functional.cross_entropy(m(x), y) + sum((p ** 2).sum() for p in captured)

    with pytest.raises(RuntimeError, match="outside the per-sample path"):
        train_epochs_dp(model, data, opt, 1, **{**good, "loss_fn": leaky})
    bn = small_cnn(width=4)
    with pytest.raises(PrivacyConfigError, match="layer1.1: BatchNorm2d"):
        train_epochs_dp(bn, data, torch.optim.SGD(bn.parameters(), lr=0.1), 1, **good)
    prelu = nn.Sequential(nn.Flatten(), nn.Linear(256, 3), nn.PReLU(), nn.Linear(3, 2))
    with pytest.raises(PrivacyConfigError, match="per-sample gradients.*prelu"):
        train_epochs_dp(prelu, data, torch.optim.SGD(prelu.parameters(), lr=0.1), 1, **good)


def test_any_model_method_gets_per_sample_gradients() -> None:
    model = _cnn()
    w0 = _params(model)

    def features_loss(m, x, y):  # FeatureModel methods other than forward work too
        logits, _ = m.forward_features(x)
        return nn.functional.cross_entropy(logits, y)

    train_epochs_dp(model, _data(6), torch.optim.SGD(model.parameters(), lr=0.1), 1,
                    batch_size=3, noise_multiplier=0.0, max_grad_norm=1.0, seed=1,
                    loss_fn=features_loss)
    assert all(not torch.equal(a, b) for a, b in zip(w0, model.parameters()))


# ------------------------------------------------------------------ registry
def test_registry_builds_dp_compatible_models() -> None:
    registry()
    spec = {"name": "resnet10", "width": 4, "spatial_dims": 2, "in_channels": 1, "num_classes": 2}
    torch.manual_seed(0)
    plain = build_model(spec)
    torch.manual_seed(0)
    dp = build_model({**spec, "dp_compatible": True})
    assert _has(plain, nn.BatchNorm2d) and not _has(dp, nn.modules.batchnorm._BatchNorm)
    assert _has(dp, nn.GroupNorm)
    assert not [k for k in dp.state_dict() if "running_mean" in k]
    assert [k for k in plain.state_dict() if "running_mean" in k]
    torch.manual_seed(0)
    off = build_model({**spec, "dp_compatible": False})
    assert list(off.state_dict()) == list(plain.state_dict())
    assert all(torch.equal(v, off.state_dict()[k]) for k, v in plain.state_dict().items())
    with pytest.raises(ModelConfigError, match="dp_compatible must be true or false"):
        build_model({**spec, "dp_compatible": "yes"})


# ------------------------------------------------------------------ hub and spoke
_DP = {"noise_multiplier": 1.0, "max_grad_norm": 1.0, "delta": 1e-5, "accountant": "rdp"}


def _client(seed: int = 7, dp: dict | None = _DP, n: int = 10) -> ClientContext:
    spec = {"name": "small_cnn", "width": 4, "in_channels": 1, "num_classes": 2,
            "dp_compatible": dp is not None}
    train = {"epochs": 2, "batch_size": 4, "lr": 0.05, "clip_grad_norm": 1e-9}
    if dp is not None:
        train["dp"] = dp
    return ClientContext(client_id="0", round=1, seed=seed, datasets={"train": _data(n)},
                         model_spec=spec, train=train, sample_shape=(1, 16, 16))


def test_hub_and_spoke_methods_declare_dp_sgd() -> None:
    registry()
    from medfl.hub import HubAndSpoke
    from medfl_plugins.baselines import FedAdam, FedAvg, FedAvgM, FedBN, FedProx

    for cls in (HubAndSpoke, FedAvg, FedProx, FedAvgM, FedAdam, FedBN):
        assert cls.supports_dp_sgd is True and cls.reply_state == {"model": "model"}
    assert HubAndSpoke.local_regularizer(FedAvg(), None, None, None) is None


def test_fedavg_client_update_trains_with_dp_sgd() -> None:
    registry()
    from medfl_plugins.baselines import FedAvg

    start = _client().build_model().state_dict()
    ins = Instruction(payload={"model": start})
    reply = FedAvg().client_update(_client(), ins)
    steps, q = planned_steps(10, 4, 2)
    assert reply.metrics["dp_steps"] == reply.metrics["steps"] == steps
    assert reply.metrics["dp_sample_rate"] == q and reply.metrics["dp_noise_multiplier"] == 1.0
    state = reply.payload["model"]
    assert "layer1.1.weight" in state and not [k for k in state if "running" in k]
    assert list(state) == list(start)
    # train.clip_grad_norm (1e-9 here) does not apply under DP: the weights moved
    assert any(not torch.equal(state[k], start[k]) for k in start)
    again = FedAvg().client_update(_client(), ins).payload["model"]
    assert all(torch.equal(state[k], again[k]) for k in state)
    other = FedAvg().client_update(_client(seed=8), ins).payload["model"]
    assert any(not torch.equal(state[k], other[k]) for k in state)


def test_fedprox_under_dp_sgd_pulls_towards_the_global_model() -> None:
    registry()
    from medfl_plugins.baselines import FedAvg, FedProx

    start = _client().build_model().state_dict()
    ins = Instruction(payload={"model": start})

    def dist(state: dict[str, torch.Tensor]) -> float:
        return float(sum(((state[k] - start[k]) ** 2).sum() for k in start))

    avg = FedAvg().client_update(_client(), ins)
    prox = FedProx(mu=5.0).client_update(_client(), ins)
    assert prox.metrics["dp_steps"] == avg.metrics["dp_steps"]
    assert dist(prox.payload["model"]) < dist(avg.payload["model"])


def test_without_dp_the_client_update_is_unchanged() -> None:
    registry()
    from medfl_plugins.baselines import FedProx

    ctx = _client(dp=None)
    ctx.train["clip_grad_norm"] = None
    start = ctx.build_model().state_dict()
    reply = FedProx(mu=0.1).client_update(ctx, Instruction(payload={"model": start}))
    assert "dp_steps" not in reply.metrics and any("running_mean" in k for k in reply.payload["model"])
