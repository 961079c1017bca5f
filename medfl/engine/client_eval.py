"""The client's evaluation steps, at the client: its evaluation model built
(:func:`build_eval_model`) and scored on its splits (:func:`evaluate_model`, with the
evaluation memory's negative flips and ``cross_test`` on peers' test splits), a peer's model
rebuilt for ``cross_test`` (:func:`build_peer_model`) and the coordinator's final models
(:func:`build_final_model`, :func:`evaluate_final_models`). The in-process engine
(:mod:`medfl.engine.evaluation`) and a Flower site both call them, so the same numbers come
out; only metrics (scalars) leave the client.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from medfl.context import ClientContext
from medfl.engine.data import client_order
from medfl.training import compute_settings
from medfl.messages import Instruction, validate_payload
from medfl.method import Method
from medfl.seeding import derive_seed, seed_torch

__all__ = ["run_client_evaluate", "build_eval_model", "build_final_model", "evaluate_final_models",
           "build_peer_model", "evaluate_model", "score_dataset", "cross_test_mean"]


def _seed_all(seed: int) -> None:
    """Seed torch and numpy for one client step (every client step starts here)."""
    seed_torch(seed)
    np.random.seed(seed % (2**32))


def run_client_evaluate(method: Method, ctx: ClientContext, instruction: Instruction, splits: list[str],
                        metric_fn: Callable[[np.ndarray, np.ndarray], dict[str, float]],
                        cache: dict[tuple[str, str], tuple[dict[str, float], np.ndarray]] | None = None,
                        memory: dict[str, Any] | None = None, peers: dict[str, Callable[[], Dataset]] | None = None
                        ) -> dict[str, dict[str, float]]:
    """Build the client's evaluation model and compute metrics on each split, at the client.

    Only the metrics (scalars) leave the client. ``cache`` reuses results of a split that
    every client shares (``global_test``) when two clients hold identical models.

    ``memory`` is the client's own evaluation memory, kept at the client between
    evaluations (the in-process engine stores it per client beside the client state): for
    each split it holds the per-sample correctness (a boolean tensor) of the previous
    evaluation and is updated in place. When given, each split's metrics gain two scalars:
    ``neg_flips`` (samples correct at the previous evaluation and wrong now) and
    ``neg_flip_rate`` (that count over the split size), NaN at the first evaluation. The
    per-sample vector itself never leaves the client.

    When the split's dataset carries subgroup attributes (``sample_attributes``, e.g. each
    sample's sex from the manifest), its metrics also hold the AUC and size of each subgroup
    (``auc_M``, ``n_M``, ``auc_F``, ``n_F``: :func:`medfl.metrics.fairness.subgroup_scores`).

    ``peers`` (client id -> its local test dataset) adds the ``cross_test`` split: the same
    model scored on each peer's test set (``cross_test@<peer>``, one entry per peer) and the
    unweighted mean of those scores over peers (``cross_test``; ``n`` is the total count),
    so every client's test set counts equally whatever its size.
    """
    return evaluate_model(build_eval_model(method, ctx, instruction), ctx, splits, metric_fn, cache,
                          memory=memory, peers=peers)


def build_eval_model(method: Method, ctx: ClientContext, instruction: Instruction) -> nn.Module:
    """Check the evaluation instruction and build the client's evaluation model, seeded
    (the first step of :func:`run_client_evaluate`)."""
    validate_payload(instruction.payload, f"evaluation instruction to client {ctx.client_id}")
    _seed_all(derive_seed(ctx.seed, "eval"))
    with compute_settings(ctx.train, ctx.device):
        return method.client_eval_model(ctx, instruction)


def build_peer_model(method: Method, owner: str, round: int, run_seed: int, model_spec: dict[str, Any],
                     train: dict[str, Any], device: str, instruction: Instruction,
                     state: dict[str, torch.Tensor]) -> nn.Module:
    """Client ``owner``'s evaluation model, rebuilt away from ``owner`` (``cross_test`` at
    another site): the method's :meth:`~medfl.method.Method.eval_model_skeleton` on a
    context of ``owner`` with no data and no state, then ``state`` (the evaluated model's
    state dict, as ``owner`` sent it) loaded strictly.

    Raises:
        ValueError: the skeleton does not take ``state`` (the evaluation model's structure
            depends on something other than the model spec and the instruction).
    """
    validate_payload(instruction.payload, f"evaluation instruction of client {owner}")
    ctx = ClientContext(client_id=owner, round=round, seed=derive_seed(run_seed, round, owner), datasets={},
                        model_spec=dict(model_spec), train=dict(train), device=device)
    _seed_all(derive_seed(ctx.seed, "eval"))
    model = method.eval_model_skeleton(ctx, instruction)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as exc:
        raise ValueError(
            f"cross_test: method {method.name!r}: the evaluation model of client {owner} does not fit the "
            f"skeleton built from its spec and evaluation instruction ({str(exc).splitlines()[0]}); "
            "override Method.eval_model_skeleton when the structure depends on the client's state") from None
    return model


def build_final_model(spec: dict[str, Any], state: dict[str, torch.Tensor], ctx: ClientContext,
                      where: str) -> nn.Module:
    """A final model of the coordinator (:meth:`medfl.method.Method.final_models`) rebuilt
    from its registered spec and loaded strictly with ``state``, in evaluation mode on the
    client's device. ``spatial_dims``, ``in_channels`` and ``num_classes`` default to the
    client's model spec (the dataset's).

    Raises:
        ValueError: the spec cannot be built or the state does not fit it (naming ``where``).
    """
    from medfl.models.registry import build_model

    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise ValueError(f"{where}: a final model's spec must be a dict naming a registered model, got {spec!r:.200}")
    full = {k: ctx.model_spec[k] for k in ("spatial_dims", "in_channels", "num_classes") if k in ctx.model_spec}
    full.update(spec)
    validate_payload(state, where, allow_str=False)
    try:
        with torch.random.fork_rng(devices=[]):
            model = build_model(full)
        model.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError, TypeError, KeyError) as exc:
        raise ValueError(f"{where}: cannot build {spec.get('name')!r} with the state sent "
                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from None
    return model.to(ctx.device).eval()


def evaluate_final_models(ctx: ClientContext, finals: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]],
                          splits: list[str], metric_fn: Callable[[np.ndarray, np.ndarray], dict[str, float]],
                          cache: dict[tuple[str, str], tuple[dict[str, float], np.ndarray]] | None = None
                          ) -> dict[str, dict[str, dict[str, float]]]:
    """Score each final model on the client's ``splits``, at the client: ``{name: {split:
    metrics}}``. No evaluation memory is read or written (the per-round negative-flip
    counts stay about the method's own models). ``cache`` as in :func:`evaluate_model`: the
    shared ``global_test`` split is scored once per model in a process that holds several
    clients."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in finals:
        spec, state = finals[name]
        model = build_final_model(spec, state, ctx, f"final model {name!r} sent to client {ctx.client_id}")
        out[name] = evaluate_model(model, ctx, splits, metric_fn, cache)
    return out


def evaluate_model(model: nn.Module, ctx: ClientContext, splits: list[str],
                   metric_fn: Callable[[np.ndarray, np.ndarray], dict[str, float]],
                   cache: dict[tuple[str, str], tuple[dict[str, float], np.ndarray]] | None = None,
                   memory: dict[str, Any] | None = None, peers: dict[str, Callable[[], Dataset]] | None = None
                   ) -> dict[str, dict[str, float]]:
    """Score the client's evaluation model (:func:`build_eval_model`) on ``splits``: the
    second step of :func:`run_client_evaluate`, whose docstring says what it returns."""
    from medfl.training import predict_proba, state_fingerprint
    from medfl.metrics.fairness import subgroup_scores
    from medfl.metrics.forgetting import negative_flips

    out: dict[str, dict[str, float]] = {}
    fp: str | None = None   # only the shared split's cache needs it: hashed when it is scored
    for split in splits:
        shared = cache is not None and split == "global_test"
        if shared and fp is None:
            fp = state_fingerprint(model)
        key = (split, fp or "")
        if shared and key in cache:
            scores, correct = dict(cache[key][0]), cache[key][1]
        else:
            with compute_settings(ctx.train, ctx.device):
                y, p = predict_proba(model, ctx.loader(split, shuffle=False), ctx.device)
            scores = metric_fn(y, p)
            scores.update(subgroup_scores(y, p, getattr(ctx.dataset(split), "sample_attributes", None)))
            correct = (p.argmax(1) == y) if len(y) else np.zeros(0, dtype=bool)
            if shared:
                cache[key] = (dict(scores), correct)
        if memory is not None:
            prev = memory.get(split)
            if prev is not None and len(prev) == len(correct) and len(correct):
                flips = negative_flips(prev.numpy(), correct)
                scores.update(neg_flips=float(flips), neg_flip_rate=flips / len(correct))
            else:
                scores.update(neg_flips=float("nan"), neg_flip_rate=float("nan"))
            memory[split] = torch.from_numpy(np.asarray(correct, dtype=bool).copy())
        out[split] = scores
    if peers:
        per_peer = []
        for pid in client_order(peers):
            ds = peers[pid]
            ds = ds() if callable(ds) and not isinstance(ds, Dataset) else ds
            scores = score_dataset(model, ds, ctx.train, ctx.device, metric_fn)
            out[f"cross_test@{pid}"] = scores
            per_peer.append(scores)
        out["cross_test"] = cross_test_mean(per_peer)
    return out


def score_dataset(model: nn.Module, dataset: Dataset, train: dict[str, Any], device: str,
                  metric_fn: Callable[[np.ndarray, np.ndarray], dict[str, float]]) -> dict[str, float]:
    """``model``'s metrics on ``dataset`` (a peer's test split, for ``cross_test``), in
    batches of the run's ``eval_batch_size``."""
    from medfl.training import predict_proba

    bs = int(train.get("eval_batch_size", 64))
    with compute_settings(train, device):
        y, p = predict_proba(model, DataLoader(dataset, batch_size=bs, shuffle=False), device)
    return metric_fn(y, p)


def cross_test_mean(per_peer: list[dict[str, float]]) -> dict[str, float]:
    """The ``cross_test`` entry of one model from its scores on each peer's test split:
    the unweighted mean over peers of each metric (NaN-aware: a peer whose metric is
    undefined, e.g. AUC on one class, is skipped) and the total ``n``."""
    keys = [k for k in per_peer[0] if k != "n"]
    mean = {k: float(np.nanmean([s[k] for s in per_peer])) if any(np.isfinite(s[k]) for s in per_peer)
            else float("nan") for k in keys}
    return {"n": float(sum(s["n"] for s in per_peer)), **mean}
