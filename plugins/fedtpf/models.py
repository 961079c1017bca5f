"""FedTPF's models and what they read: the distillation model (VAE generator q, WGAN-GP
critic, residual classifier w; the networks are :mod:`medfl.models.feature_distill`'s) as
one state, its residuals ``x - x_hat``, the shared set ``D^s`` and the stage-2 batches, and
the per-channel scale (``standardize``) the distillation model works on."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from medfl.context import ClientContext
from medfl.models.feature_distill import Critic, DistillVAE
from medfl.training import get_state

__all__ = ["State", "NetSizes", "Scale", "sub", "pack", "distill_nets", "load_nets", "client_nets", "residuals",
           "SharedSet", "IntLabels", "MixedBatches", "fixed_scale", "own_statistics", "client_scale", "input_scale",
           "standardized"]

State = dict[str, torch.Tensor]
#: the VAE's width and grid and the critic's width (``vae_width``, ``vae_grid``, ``critic_width``)
NetSizes = tuple[int, int, int]
#: a per-channel ``(mean, std)``, each shaped ``(1, C, 1, ...)`` to broadcast over a batch
Scale = tuple[torch.Tensor, torch.Tensor]


def sub(state: State, prefix: str) -> State:
    """The entries of ``state`` under ``prefix``, the prefix taken off."""
    return {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}


def pack(vae: nn.Module, critic: nn.Module, cls: nn.Module) -> State:
    """The distillation model's one state: ``vae.``, ``critic.`` and ``cls.`` keys."""
    return {f"{name}.{k}": v for name, net in (("vae", vae), ("critic", critic), ("cls", cls))
            for k, v in get_state(net).items()}


def distill_nets(in_channels: int, dims: int, latent: int, sizes: NetSizes) -> tuple[DistillVAE, Critic]:
    """A fresh VAE generator and critic (drawn from torch's global generator)."""
    vae_width, vae_grid, critic_width = sizes
    return (DistillVAE(in_channels, latent, dims, width=vae_width, grid=vae_grid),
            Critic(in_channels, dims, width=critic_width))


def load_nets(distill: State, sample_shape: tuple[int, ...], sizes: NetSizes) -> tuple[DistillVAE, Critic]:
    """The VAE and critic of ``distill`` for samples of ``sample_shape`` ``(C, *spatial)``."""
    latent = int(sub(distill, "vae.")["mu.weight"].shape[0])   # the task model's embed_dim (eq. 6)
    vae, critic = distill_nets(int(sample_shape[0]), len(sample_shape) - 1, latent, sizes)
    vae.load_state_dict(sub(distill, "vae."))
    critic.load_state_dict(sub(distill, "critic."))
    return vae, critic


def client_nets(client: ClientContext, distill: State, sizes: NetSizes) -> tuple[DistillVAE, Critic, nn.Module]:
    """The distillation model ``distill`` on ``client``'s device: VAE, critic, classifier."""
    cls = client.load_model(sub(distill, "cls."), fresh=True)
    vae, critic = load_nets(distill, tuple(client.sample_shape), sizes)
    return vae.to(client.device), critic.to(client.device), cls.to(client.device)


def residuals(client: ClientContext, vae: DistillVAE, split: str, scale: Scale | None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x, x_hat, labels)`` of ``split`` without augmentation, on the distillation model's
    ``scale`` (:func:`client_scale`), ``x_hat`` decoded from ``mu`` (no sampling)."""
    vae.eval()
    xs, hats, ys = [], [], []
    with torch.no_grad():
        for x, y in client.loader(split, augment=False, shuffle=False):
            x = standardized(x.to(client.device), scale)
            mu, _ = vae.encode(x)
            hats.append(vae.decode(mu, tuple(x.shape[2:])).cpu())
            xs.append(x.cpu())
            ys.append(torch.as_tensor(y).long())
    return torch.cat(xs), torch.cat(hats), torch.cat(ys)


class SharedSet(Dataset):
    """The shared set ``D^s`` at a client: ``(x_p, label)`` items like a client dataset's."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x.float(), y.long()

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.x[i], int(self.y[i])


class IntLabels(Dataset):
    """A client dataset whose items' labels are plain ints, like :class:`SharedSet`'s, so the
    two can share a batch (``random_blocks`` gives 0-d tensor labels, the file datasets ints)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = self.dataset[i][:2]
        return x, int(y)


class MixedBatches:
    """Stage-2 batches of a fixed composition (``mix``): each batch of the client's local
    loader gets ``shared_per_batch`` samples of the shared set appended, drawn without
    replacement from a seeded permutation that is redrawn when it runs out. One pass is one
    pass over the local data; :attr:`shared_seen` counts the shared samples drawn.

    Args:
        local: the client's training loader (batches ``(x, y)`` of local samples).
        shared: the shared set.
        shared_per_batch: shared samples per batch (0: local batches only).
        generator: seeds the shared samples' order.
    """

    def __init__(self, local: DataLoader, shared: SharedSet, shared_per_batch: int,
                 generator: torch.Generator) -> None:
        self.local, self.shared, self.per_batch, self.generator = local, shared, int(shared_per_batch), generator
        self._order: list[int] = []
        self.shared_seen = self.local_seen = 0

    def __len__(self) -> int:
        return len(self.local)

    def _take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if not self._order:
                self._order = torch.randperm(len(self.shared), generator=self.generator).tolist()
            k = min(n - len(out), len(self._order))
            out += self._order[:k]
            self._order = self._order[k:]
        return out

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in self.local:
            y = torch.as_tensor(y).long()
            self.local_seen += int(y.shape[0])
            if self.per_batch > 0 and len(self.shared) > 0 and y.shape[0] > 0:
                idx = torch.tensor(self._take(self.per_batch), dtype=torch.long)
                x = torch.cat([x.float(), self.shared.x[idx].to(x.device)])
                y = torch.cat([y, self.shared.y[idx].to(y.device)])
                self.shared_seen += int(idx.numel())
            yield x, y


def _channels(values: list[float], ndim: int) -> torch.Tensor:
    """Per-channel ``values`` shaped ``(1, C, 1, ...)`` for ``ndim``-d batches."""
    return torch.tensor(values).view((1, -1) + (1,) * (ndim - 2))


def fixed_scale(standardize: str | dict[str, list[float]], ndim: int) -> Scale | None:
    """``standardize``'s fixed ``(mean, std)``, shaped to broadcast over ``ndim``-d batches;
    ``None`` unless a fixed normalization is configured."""
    if not isinstance(standardize, dict):
        return None
    return _channels(standardize["mean"], ndim), _channels(standardize["std"], ndim)


def own_statistics(client: ClientContext) -> dict[str, list[float]] | None:
    """This client's per-channel ``{"mean": [...], "std": [...]}`` of its training split
    (without augmentation, pooled over samples and positions), measured once and kept in
    its state: statistics of its own data, which never leave it (except as the scale of
    what it releases under ``"client"``); ``None`` without training samples."""
    kept = client.state.get("fedtpf_scale")
    if kept is None:
        total = square = count = None
        for x, _y in client.loader("train", augment=False, shuffle=False):
            x = x.double().transpose(0, 1).flatten(1)   # (C, N * positions)
            total = x.sum(1) if total is None else total + x.sum(1)
            square = (x * x).sum(1) if square is None else square + (x * x).sum(1)
            count = x.shape[1] + (count or 0)
        if not count:
            return None
        mean = total / count
        std = (square / count - mean * mean).clamp_min(0.0).sqrt()
        kept = {"mean": [float(v) for v in mean], "std": [max(float(v), 1e-6) for v in std]}
        client.state["fedtpf_scale"] = kept
    return kept


def client_scale(standardize: str | dict[str, list[float]], client: ClientContext) -> Scale | None:
    """The ``(mean, std)`` per channel this client standardizes with (``standardize``),
    shaped ``(1, C, 1, ...)`` on its device: the fixed ones, or those of its own training
    split (:func:`own_statistics`), ``None`` for ``"none"``."""
    ndim = len(tuple(client.sample_shape)) + 1
    scale = fixed_scale(standardize, ndim)
    if scale is None and standardize != "none":
        kept = own_statistics(client)
        scale = None if kept is None else (_channels(kept["mean"], ndim), _channels(kept["std"], ndim))
    return None if scale is None else (scale[0].to(client.device), scale[1].to(client.device))


def input_scale(standardize: str | dict[str, list[float]], client: ClientContext) -> Scale | None:
    """The per-channel ``(mean, std)`` that takes the shared set into this client's input
    coordinates in stage 2, ``x = x_shared * std + mean`` (the inverse of its own
    standardization): under ``"client"`` and a fixed normalization the ``(mean, std)`` it
    standardizes with (:func:`client_scale`); under ``"none"`` std 1 and the mean of its
    own training split (:func:`own_statistics`: the residual ``x - x_hat`` has lost the
    inputs' mean, which the local tiles keep). ``None`` without training samples."""
    scale = client_scale(standardize, client)
    if scale is not None or standardize != "none":
        return scale
    kept = own_statistics(client)
    if kept is None:
        return None
    mean = _channels(kept["mean"], len(tuple(client.sample_shape)) + 1).to(client.device)
    return mean, torch.ones_like(mean)


def standardized(x: torch.Tensor, scale: Scale | None) -> torch.Tensor:
    """``(x - mean) / std`` per channel (``x`` itself without a scale)."""
    return x if scale is None else (x - scale[0]) / scale[1]
