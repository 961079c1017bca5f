"""FedTPF's distillation networks: shapes in 2D and 3D, the ablation switches of eq. 7, and
local distillation learning the residual classifier on a tiny seeded task."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from medfl.losses.feature_distill import class_prototypes
from medfl.models.feature_distill import Critic, DistillVAE, DistillWeights, distill_step, parameters_of

__all__: list[str] = []


@pytest.mark.parametrize("dims, shape", [(2, (3, 28, 20)), (3, (1, 12, 12, 12))])
def test_shapes_in_2d_and_3d(dims: int, shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    vae, critic = DistillVAE(shape[0], 8, dims, width=4), Critic(shape[0], dims, width=4)
    x = torch.rand(5, *shape)
    x_hat, z, mu, logvar = vae(x, torch.Generator().manual_seed(1))
    assert x_hat.shape == x.shape and z.shape == mu.shape == logvar.shape == (5, 8)
    assert critic(x).shape == (5,)
    again = vae(x, torch.Generator().manual_seed(1))[0]
    assert torch.equal(x_hat, again)  # the reparameterisation noise is seeded


def _task(n: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.arange(n) % 2
    x = torch.rand(n, 1, 8, 8, generator=g) * 0.2
    x[y == 1, :, 2:6, 2:6] += 0.6   # class 1: a bright square
    return x, y


def _nets(seed: int = 0):
    torch.manual_seed(seed)
    vae, critic = DistillVAE(1, 4, 2, width=4), Critic(1, 2, width=4)
    clf = nn.Sequential(nn.Flatten(), nn.Linear(64, 4), nn.ReLU(), nn.Linear(4, 2))
    return vae, critic, clf


def test_local_distillation_learns_the_residual_classifier() -> None:
    x, y = _task()
    vae, critic, clf = _nets()
    embed = torch.randn(len(y), 4, generator=torch.Generator().manual_seed(2)) + y[:, None].float()
    protos, present = class_prototypes(embed, y, 2)
    opt = torch.optim.Adam(list(parameters_of(vae, clf)), lr=1e-2)
    opt_c = torch.optim.Adam(critic.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(3)
    first = distill_step(vae, critic, clf, x, y, protos, present, DistillWeights(), opt, opt_c, g)
    for _ in range(100):
        last = distill_step(vae, critic, clf, x, y, protos, present, DistillWeights(), opt, opt_c, g)
    assert last["residual_accuracy"] >= 0.95 and last["ce"] < first["ce"]
    assert last["vae"] < first["vae"] and last["prototype"] < first["prototype"]
    assert set(first) >= {"loss", "vae", "wgan_generator", "critic", "prototype", "ce", "residual_norm_ratio"}


def test_ablation_switches_change_exactly_their_term() -> None:
    x, y = _task(16)
    protos, present = class_prototypes(torch.randn(16, 4), y, 2)
    runs = {}
    for name, w in {"full": DistillWeights(), "no_critic": DistillWeights(wgan=0.0),
                    "no_proto": DistillWeights(proto=0.0)}.items():
        vae, critic, clf = _nets()
        before = [p.detach().clone() for p in critic.parameters()]
        opt = torch.optim.SGD(list(parameters_of(vae, clf)), lr=0.01)
        opt_c = torch.optim.SGD(critic.parameters(), lr=0.01)
        out = distill_step(vae, critic, clf, x, y, protos, present, w, opt, opt_c, torch.Generator().manual_seed(0))
        changed = any(not torch.equal(a, b) for a, b in zip(before, critic.parameters()))
        runs[name] = (out, changed)
    assert runs["full"][1] and not runs["no_critic"][1]            # the critic trains only with l2 > 0
    assert runs["no_critic"][0]["critic"] == 0.0 and runs["no_critic"][0]["wgan_generator"] == 0.0
    assert runs["no_proto"][0]["prototype"] == 0.0 and runs["full"][0]["prototype"] > 0
    assert runs["no_proto"][0]["vae"] == pytest.approx(runs["full"][0]["vae"])  # same nets, same noise


def test_unread_terms_are_the_read_floats() -> None:
    """``read=False`` (what FedTPF logs through ``StepMeans``) gives 0-d tensors holding the
    floats a read step gives, for the same nets, batch and noise."""
    x, y = _task(16)
    protos, present = class_prototypes(torch.randn(16, 4, generator=torch.Generator().manual_seed(4)), y, 2)
    outs = []
    for read in (True, False):
        vae, critic, clf = _nets()
        opt = torch.optim.SGD(list(parameters_of(vae, clf)), lr=0.01)
        opt_c = torch.optim.SGD(critic.parameters(), lr=0.01)
        outs.append(distill_step(vae, critic, clf, x, y, protos, present, DistillWeights(), opt, opt_c,
                                 torch.Generator().manual_seed(0), read=read))
    floats, tensors = outs
    assert list(floats) == list(tensors)
    assert all(isinstance(t, torch.Tensor) and t.dim() == 0 and float(t) == floats[k] for k, t in tensors.items())
