"""FedTPF's feature-distillation networks (paper 003, section III-B/C): a VAE generator whose
reconstruction ``x_hat`` keeps the local features, a WGAN-GP critic that tells ``x`` from
``x_hat``, and one local-distillation step that trains them with the residual classifier on
``x_s = x - x_hat`` under eq. 7's four terms.

The networks work for 2D images and 3D volumes of any size: the encoder pools to a fixed
``grid^d`` before its linear layers and the decoder resamples its output to the input's size.
The latent size must equal the task model's embedding size, because eq. 6 pulls each latent
code to the class prototype computed in that embedding space (eq. 5).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from medfl.losses.feature_distill import critic_loss, generator_adversarial_loss, prototype_loss, vae_loss
from medfl.privacy.noise import gaussian

__all__ = ["DistillVAE", "Critic", "DistillWeights", "distill_step", "parameters_of"]


def _conv(dims: int) -> type[nn.Module]:
    return nn.Conv3d if dims == 3 else nn.Conv2d


class DistillVAE(nn.Module):
    """Encoder ``x -> (mu, logvar)`` of size ``latent_dim``, decoder ``z -> x_hat`` of ``x``'s shape.

    Args:
        in_channels: image channels.
        latent_dim: size of ``z`` (the task model's ``embed_dim``).
        spatial_dims: 2 or 3.
        width: channels of the first conv layer (doubled in the second).
        grid: the encoder's pooled grid side (the decoder starts from it).
    """

    def __init__(self, in_channels: int, latent_dim: int, spatial_dims: int = 2, width: int = 16,
                 grid: int = 4) -> None:
        super().__init__()
        conv, d = _conv(spatial_dims), spatial_dims
        self.dims, self.grid, self.width, self.in_channels = d, grid, width, in_channels
        pool = nn.AdaptiveAvgPool3d(grid) if d == 3 else nn.AdaptiveAvgPool2d(grid)
        self.encoder = nn.Sequential(conv(in_channels, width, 3, padding=1), nn.LeakyReLU(0.2),
                                     conv(width, 2 * width, 3, stride=2, padding=1), nn.LeakyReLU(0.2), pool,
                                     nn.Flatten())
        flat = 2 * width * grid ** d
        self.mu = nn.Linear(flat, latent_dim)
        self.logvar = nn.Linear(flat, latent_dim)
        self.expand = nn.Linear(latent_dim, flat)
        self.decoder = nn.Sequential(conv(2 * width, width, 3, padding=1), nn.LeakyReLU(0.2),
                                     conv(width, in_channels, 3, padding=1))

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mu, logvar)`` of ``q(z | x)``."""
        h = self.encoder(x)
        return self.mu(h), self.logvar(h).clamp(-10, 10)

    def decode(self, z: torch.Tensor, size: tuple[int, ...]) -> torch.Tensor:
        """``x_hat`` of spatial ``size`` from latent codes ``z``."""
        h = self.expand(z).view(z.shape[0], 2 * self.width, *([self.grid] * self.dims))
        mode = "trilinear" if self.dims == 3 else "bilinear"
        h = F.interpolate(h, size=size, mode=mode, align_corners=False)
        return self.decoder(h)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(x_hat, z, mu, logvar)``, ``z = mu + sigma * eps`` (reparameterised; ``eps``
        seeded by ``generator``, finite by construction: :func:`medfl.privacy.noise.gaussian`)."""
        mu, logvar = self.encode(x)
        # drawn where the generator lives (a CPU generator seeds CUDA runs too), then moved
        where = generator.device if generator is not None else mu.device
        eps = gaussian(mu.shape, 1.0, generator, dtype=mu.dtype, device=where).to(mu.device)
        z = mu + torch.exp(0.5 * logvar) * eps
        return self.decode(z, tuple(x.shape[2:])), z, mu, logvar


class Critic(nn.Module):
    """WGAN-GP critic: a real score per image; no batch normalisation (the gradient penalty is
    per sample, so the critic must not mix samples)."""

    def __init__(self, in_channels: int, spatial_dims: int = 2, width: int = 16) -> None:
        super().__init__()
        conv = _conv(spatial_dims)
        pool = nn.AdaptiveAvgPool3d(1) if spatial_dims == 3 else nn.AdaptiveAvgPool2d(1)
        self.net = nn.Sequential(conv(in_channels, width, 3, stride=2, padding=1), nn.LeakyReLU(0.2),
                                 conv(width, 2 * width, 3, stride=2, padding=1), nn.LeakyReLU(0.2), pool,
                                 nn.Flatten(), nn.Linear(2 * width, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``(B,)`` scores."""
        return self.net(x).squeeze(1)


@dataclass
class DistillWeights:
    """Eq. 7's coefficients ``l1..l4`` and WGAN-GP's penalty weight; ``l2 = 0`` drops the critic
    (an ablation), ``l3 = 0`` the prototypes."""

    vae: float = 1.0
    wgan: float = 0.1
    proto: float = 0.1
    ce: float = 1.0
    gp: float = 10.0


def distill_step(vae: DistillVAE, critic: Critic, classifier: nn.Module, x: torch.Tensor, y: torch.Tensor,
                 prototypes: torch.Tensor | None, present: torch.Tensor | None, weights: DistillWeights,
                 opt_model: torch.optim.Optimizer, opt_critic: torch.optim.Optimizer | None,
                 generator: torch.Generator | None = None,
                 perturb: Callable[[torch.Tensor], torch.Tensor] | None = None, *,
                 read: bool = True) -> dict[str, Any]:
    """One local-distillation step on a batch (LocalDisTraining of Algorithm 1).

    First the critic (when ``weights.wgan > 0``): WGAN-GP loss on ``x`` against the detached
    ``x_hat``. Then generator and classifier together on eq. 7: ``l1 * VAE + l2 * (-D(x_hat)) +
    l3 * L_po + l4 * CE(f(x - x_hat), y)``; ``opt_model`` holds the VAE's and the classifier's
    parameters. ``perturb`` maps ``x_s`` to what the classifier sees (the paper's ``x_p = x_s +
    n``: :func:`medfl.privacy.feature_release.perturb_features`); default ``x_s`` as it is.
    Returns the terms and the batch's residual accuracy: floats, or with ``read=False`` 0-d
    tensors where they were computed, for a loop that logs them without waiting for the GPU
    each step (:class:`medfl.training.StepMeans`; same values).
    """
    if weights.wgan > 0 and opt_critic is not None:
        with torch.no_grad():
            x_hat, _, _, _ = vae(x, generator)
        opt_critic.zero_grad()
        c_loss = critic_loss(critic, x, x_hat, weights.gp, generator)
        c_loss.backward()
        opt_critic.step()
    else:
        c_loss = torch.zeros(())
    opt_model.zero_grad()
    x_hat, z, mu, logvar = vae(x, generator)
    x_s = x - x_hat
    logits = classifier(perturb(x_s) if perturb is not None else x_s)
    ce = F.cross_entropy(logits, y)
    v = vae_loss(x, x_hat, mu, logvar)
    adv = generator_adversarial_loss(critic, x_hat) if weights.wgan > 0 else torch.zeros((), device=x.device)
    po = (prototype_loss(z, y, prototypes, present) if prototypes is not None and weights.proto > 0
          else torch.zeros((), device=x.device))
    total = weights.vae * v + weights.wgan * adv + weights.proto * po + weights.ce * ce
    total.backward()
    opt_model.step()
    total, v, adv, c_loss, po, ce = (t.detach() for t in (total, v, adv, c_loss, po, ce))
    terms = {"loss": total, "vae": v, "wgan_generator": adv, "critic": c_loss, "prototype": po, "ce": ce,
             "residual_accuracy": (logits.detach().argmax(1) == y).float().mean(),
             "residual_norm_ratio": x_s.detach().flatten(1).norm(dim=1).mean() / x.flatten(1).norm(dim=1).mean()
             .clamp_min(1e-12)}
    return terms if not read else {k: float(t) for k, t in terms.items()}


def parameters_of(*modules: nn.Module) -> Iterable[nn.Parameter]:
    """Every parameter of ``modules`` (for one optimizer over generator and classifier)."""
    for m in modules:
        yield from m.parameters()
