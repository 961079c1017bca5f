"""The parts of PFedCDP's cluster models: the extractor/classifier split, the Fisher
information and masks of the personalisation (eqs. 3-6), frozen teachers, BatchNorm statistics."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from medfl.method import MethodConfigError
from medfl_plugins.pfedcdp.settings import State

__all__ = ["fisher_information", "fisher_masks", "freeze_body", "frozen", "mix_extractor", "recalibrate_norms",
           "split_keys"]


def fisher_information(model: nn.Module, batches: Any, keys: list[str], device: str = "cpu",
                       max_batches: int | None = None) -> tuple[State, int]:
    """Empirical Fisher information of the parameters ``keys`` (eq. 3) on ``batches``.

    For each mini-batch, the squared gradient of the batch's mean log-likelihood (the
    negative cross-entropy) with respect to each parameter; averaged over the batches
    (``max_batches`` of them, all when ``None``). The model is in evaluation mode (no
    dropout, BatchNorm's running statistics), so the importance does not depend on random
    dropout masks. Returns the Fisher tensors (same shapes as the parameters) and the
    number of batches used."""
    model = model.to(device).eval()
    params = dict(model.named_parameters())
    missing = [k for k in keys if k not in params]
    if missing:
        raise KeyError(f"fisher_information: not parameters of the model: {missing[:5]}")
    fisher = {k: torch.zeros_like(params[k]) for k in keys}
    used = 0
    for x, y in batches:
        if max_batches is not None and used >= max_batches:
            break
        if x.shape[0] == 0:
            continue
        model.zero_grad(set_to_none=True)
        loglik = -nn.functional.cross_entropy(model(x.to(device)), y.to(device))
        grads = torch.autograd.grad(loglik, [params[k] for k in keys], allow_unused=True)
        for k, g in zip(keys, grads):
            if g is not None:
                fisher[k] += g.detach() ** 2
        used += 1
    if used:
        fisher = {k: v / used for k, v in fisher.items()}
    return fisher, used


def fisher_masks(fisher: State, *, keep: float | None = None, threshold: float | None = None) -> State:
    """The personal masks of eq. 4 (1: keep the client's own value); the global mask of
    eq. 5 is ``1 - personal``.

    ``threshold`` is the paper's T_Fisher: ``F >= T`` is personal. ``keep`` is the quantile
    form: T is the ``keep`` quantile from the top over every entry of every tensor together
    (``keep=0.2``: the 20 % most important entries; ties at T are kept). Entries with zero
    Fisher information are never personal: the local data says nothing about them."""
    if (keep is None) == (threshold is None):
        raise ValueError("fisher_masks: give exactly one of keep (a fraction) or threshold (T_Fisher)")
    if threshold is None:
        flat = torch.cat([v.reshape(-1).double() for v in fisher.values()]) if fisher else torch.zeros(0)
        k = int(math.ceil(float(keep) * flat.numel()))
        if k <= 0 or flat.numel() == 0:
            return {name: torch.zeros_like(v, dtype=torch.bool) for name, v in fisher.items()}
        threshold_t = torch.topk(flat, k).values[-1]
        return {name: (v.double() >= threshold_t) & (v > 0) for name, v in fisher.items()}
    return {name: (v >= float(threshold)) & (v > 0) for name, v in fisher.items()}


def mix_extractor(own: State, global_: State, personal: State) -> State:
    """Eq. 6: ``M_personal * W_own + M_global * W_global`` with ``M_global = 1 - M_personal``,
    per entry of the extractor's state. Entries without a mask (buffers: BatchNorm running
    statistics) take the global value. The result lies where the global state does (the
    masks come from the client's device, the states from the wire and the state store)."""
    out = {}
    for k, g in global_.items():
        if k in personal and k in own:
            out[k] = torch.where(personal[k].to(g.device), own[k].to(g.device), g)
        else:
            out[k] = g.clone()
    return out


def split_keys(model: nn.Module) -> tuple[list[str], list[str], list[str]]:
    """The extractor's parameters, its buffers (BatchNorm statistics) and the classifier's keys."""
    if not hasattr(model, "head_keys") or not hasattr(model, "body_keys") or not hasattr(model, "embed"):
        raise MethodConfigError(f"pfedcdp: {type(model).__name__} has no extractor/classifier split (head_keys, "
                                "body_keys, embed): use a registered medfl model (pfedcdp_a/b/c, small_cnn, resnet*)")
    params = {n for n, _ in model.named_parameters()}
    body = list(model.body_keys())
    return [k for k in body if k in params], [k for k in body if k not in params], list(model.head_keys())


def recalibrate_norms(model: nn.Module, loader: Any, device: str = "cpu") -> int:
    """Re-estimate every BatchNorm's running statistics of ``model`` on ``loader`` (a
    cumulative average over its batches, no gradient, other modules in evaluation mode);
    returns the number of batches used (0 and nothing changed for a model without BatchNorm)."""
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms:
        return 0
    model.to(device).eval()
    saved = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None
        m.train()
    used = 0
    with torch.no_grad():
        for x, _ in loader:
            if x.shape[0] > 1:
                model(x.to(device))
                used += 1
    for m, mom in zip(norms, saved):
        m.momentum = mom
    model.eval()
    return used


def freeze_body(model: nn.Module) -> None:
    """Evaluation mode for every module but the head (no dropout, no BatchNorm update)."""
    for name, mod in model.named_modules():
        if name and not name.startswith("head"):
            mod.eval()


def frozen(model: nn.Module) -> nn.Module:
    """``model`` as a teacher: no gradient to any parameter, evaluation mode."""
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()
