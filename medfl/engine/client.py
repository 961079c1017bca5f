"""The client side: a client's view of its data and its persistent state on disk.

:class:`ClientContext` is all a method's client code may touch. It is built by the
transport (the in-process engine or a Flower SuperNode) and knows nothing of the
coordinator. :func:`run_client_update` and :func:`run_client_evaluate` are the
transport-independent client steps: both engines call them, so the same checks apply.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from medfl.engine.data import client_order
from medfl.messages import Guard, Instruction, Reply, validate_payload
from medfl.method import Method, derive_seed

__all__ = ["ClientStore", "ClientContext", "run_client_update", "run_client_validate", "run_client_evaluate",
           "build_eval_model", "build_peer_model", "evaluate_model", "score_dataset", "cross_test_mean"]

_STATE_RE = re.compile(r"state_r(\d+)\.pt$")

#: Model objects reused by :meth:`ClientContext.load_model` (spec and device -> the module
#: and its :func:`_signature` as built), least recently used first; a process runs one
#: client at a time, so one per spec suffices.
_SHELLS: "OrderedDict[str, tuple[nn.Module, dict[str, Any]]]" = OrderedDict()
_MAX_SHELLS = 8

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _signature(model: nn.Module) -> dict[str, Any]:
    """State-dict keys with shape and dtype, and the module tree (names and types)."""
    sig: dict[str, Any] = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    sig[" modules"] = tuple((n, type(m)) for n, m in model.named_modules())
    return sig


def _pristine(model: nn.Module, sig: dict[str, Any]) -> bool:
    """Whether ``model`` is still as built: same :func:`_signature`, no hooks on any module,
    no attributes added to a parameter (Opacus's ``grad_sample``...)."""
    if any(getattr(m, d, None) for m in model.modules() for d in _HOOK_DICTS):
        return False
    if any(vars(p) for p in model.parameters()):
        return False
    return _signature(model) == sig


class ClientStore:
    """Per-client persistent state as versioned files ``<root>/<client_id>/state_rNNNN.pt``.

    A client's state after round ``r`` is written to ``state_r{r}``; loading for round ``r``
    takes the newest file from an earlier round. Because old versions are kept until the
    coordinator's checkpoint has moved past them, a run killed mid-round resumes from a
    consistent state. Only one client's state is in memory at a time.
    """

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)

    def _files(self, client_id: str) -> list[tuple[int, Path]]:
        d = self.root / client_id
        if not d.is_dir():
            return []
        out = []
        for p in d.iterdir():
            m = _STATE_RE.search(p.name)
            if m:
                out.append((int(m.group(1)), p))
        return sorted(out)

    def has(self, client_id: str) -> bool:
        """Whether any state of ``client_id`` was saved."""
        return bool(self._files(client_id))

    def load(self, client_id: str, before_round: int) -> dict[str, Any]:
        """The newest saved state of ``client_id`` from a round earlier than ``before_round``."""
        files = [p for r, p in self._files(client_id) if r < before_round]
        if not files:
            return {}
        return torch.load(files[-1], map_location="cpu", weights_only=True)

    def save(self, client_id: str, round: int, state: dict[str, Any]) -> None:
        """Write ``state`` as the client's state after ``round`` (atomically)."""
        d = self.root / client_id
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".state_r{round:04d}.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(d / f"state_r{round:04d}.pt")

    def prune(self, upto_round: int) -> None:
        """Drop versions no longer needed once the checkpoint of ``upto_round`` exists."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            files = self._files(d.name)
            keep = [p for r, p in files if r <= upto_round][-1:]
            for r, p in files:
                if r <= upto_round and p not in keep:
                    p.unlink()

    def rollback(self, after_round: int) -> None:
        """Delete versions written after ``after_round`` (a resumed run redoes them)."""
        if not self.root.is_dir():
            return
        for d in self.root.iterdir():
            for r, p in self._files(d.name):
                if r > after_round:
                    p.unlink()


@dataclass
class ClientContext:
    """One client's view during one round: its data, persistent state and settings.

    Attributes:
        client_id: the client's id.
        round: the current round (1-based).
        seed: a seed derived from (run seed, round, client id); the engine seeds torch with it
            before the client code runs.
        datasets: the client's datasets by split name (``train``, ``val``, ``test``,
            ``global_test``), built lazily.
        model_spec: the spec of this client's model (name and keyword arguments).
        train: local-training settings (``epochs``, ``batch_size``, ``lr``, ``optimizer``...).
        device: torch device string.
        state: persistent state (tensors and scalars) loaded from the client's store;
            whatever the method leaves here after ``client_update`` is saved for the next round.
        sample_shape: shape of one input sample.
    """

    client_id: str
    round: int
    seed: int
    datasets: dict[str, Callable[[], Dataset] | Dataset]
    model_spec: dict[str, Any]
    train: dict[str, Any]
    device: str = "cpu"
    state: dict[str, Any] = field(default_factory=dict)
    sample_shape: tuple[int, ...] = ()
    split_sizes: dict[str, int] = field(default_factory=dict)
    _shells_taken: set[str] = field(default_factory=set, repr=False)
    _built: dict[tuple[str, bool], Dataset] = field(default_factory=dict, repr=False)

    def dataset(self, split: str = "train", *, augment: bool | None = None) -> Dataset:
        """The client's dataset of ``split``.

        Args:
            split: ``train``, ``val``, ``test`` or ``global_test``.
            augment: apply the dataset's random training transforms. Default: only for
                ``train``. ``dataset("train", augment=False)`` is the training split as the
                evaluation sees images (e.g. to measure accuracy on the training data).
        """
        if split not in self.datasets:
            raise KeyError(f"client {self.client_id} has no split {split!r}; has {sorted(self.datasets)}")
        default = split == "train"
        aug = default if augment is None else bool(augment)
        if (split, aug) not in self._built:
            src = self.datasets[split]
            if isinstance(src, Dataset) or not callable(src):
                ds = src  # given ready-made: the one variant there is
            else:
                ds = src() if aug == default else _call_with_augment(src, aug)
            self._built[(split, aug)] = ds
        return self._built[(split, aug)]

    def num_examples(self, split: str = "train") -> int:
        """Number of samples in ``split``."""
        if split in self.split_sizes:
            return self.split_sizes[split]
        return len(self.dataset(split))

    def loader(self, split: str = "train", *, shuffle: bool | None = None,
               batch_size: int | None = None, augment: bool | None = None) -> DataLoader:
        """A DataLoader over ``split`` (``augment`` as in :meth:`dataset`).

        ``shuffle`` defaults to ``split == "train"`` (seeded by :attr:`seed`, so the same
        round draws the same batches); ``batch_size`` defaults to ``train["batch_size"]``
        (16) for ``train`` and ``train["eval_batch_size"]`` (64) for the other splits."""
        shuffle = (split == "train") if shuffle is None else shuffle
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "loader", split))
        bs = int(batch_size or (self.train.get("batch_size", 16) if split == "train"
                                else self.train.get("eval_batch_size", 64)))
        return DataLoader(self.dataset(split, augment=augment), batch_size=bs, shuffle=shuffle, generator=gen,
                          num_workers=int(self.train.get("num_workers", 0)))

    def build_model(self, **overrides: Any) -> nn.Module:
        """A fresh model of this client's spec, initialised from a seed of (seed, client)."""
        from medfl.models.registry import build_model

        spec = {**self.model_spec, **overrides}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed(self.seed, "build", self.client_id))
            return build_model(spec).to(self.device)

    def load_model(self, state: dict[str, torch.Tensor], *, fresh: bool = False) -> nn.Module:
        """A model of this client's spec holding exactly ``state`` (in training mode, every
        parameter trainable, no gradients).

        Building and initialising a model for every client every round is costly (ResNet-18:
        about 150 ms against 5 ms to load weights), so when ``state`` covers the whole state
        dict, the model object of the same spec that an earlier client context in this
        process used may be handed out again. That object is reused only if it is exactly as
        built: same module tree, parameter shapes and dtypes, no hooks on any module (Opacus's
        ``GradSampleModule`` and ``make_private`` add them), no attributes added to its
        parameters (``grad_sample``). Anything else gets a fresh model, so wrapping, hooking
        or changing the module you get is safe. A context never gets the same object twice,
        so two models loaded in one client step are independent.

        Pass ``fresh=True`` (or use :meth:`build_model` and ``load_state_dict``) when the
        model must outlive this client step, e.g. kept in a module-level cache: a reused
        object will be handed to the next client in this process.
        """
        key = json.dumps([self.model_spec, str(self.device)], sort_keys=True, default=str)
        entry = _SHELLS.get(key) if key not in self._shells_taken and not fresh else None
        self._shells_taken.add(key)
        keys = [k for k in entry[1] if k != " modules"] if entry is not None else []
        if entry is not None and set(keys) <= set(state) and _pristine(*entry):
            model = entry[0]
            _SHELLS.move_to_end(key)
            model.load_state_dict({k: state[k] for k in keys})
            for p in model.parameters():
                p.grad = None
                p.requires_grad_(True)
            return model.train()
        model = self.build_model()
        full = model.state_dict()
        full.update({k: v for k, v in state.items() if k in full})
        model.load_state_dict(full)
        _SHELLS[key] = (model, _signature(model))
        _SHELLS.move_to_end(key)
        while len(_SHELLS) > _MAX_SHELLS:
            _SHELLS.popitem(last=False)
        return model

    def label_histogram(self, num_classes: int, split: str = "train") -> np.ndarray:
        """Counts of each class in ``split`` (computed locally; a method may share it)."""
        ds = self.dataset(split, augment=False)
        labels = getattr(ds, "labels", None)
        if labels is None:
            labels = np.array([int(ds[i][1]) for i in range(len(ds))])
        return np.bincount(np.asarray(labels, dtype=np.int64), minlength=num_classes)

    @property
    def guard(self) -> Guard:
        """The check of what leaves this client against its own labels and images
        (:class:`medfl.guard.ContentGuard`; its reference is built at the first check and
        cached per dataset for the process). One guard per context."""
        from medfl.guard import ContentGuard

        guard = self.__dict__.get("_content_guard")
        if guard is None:
            guard = self.__dict__["_content_guard"] = ContentGuard.for_client(self)
        return guard


def _call_with_augment(factory: Callable[..., Dataset], augment: bool) -> Dataset:
    """Build a dataset variant from a factory that takes ``augment`` (the engine's do)."""
    try:
        return factory(augment=augment)
    except TypeError as exc:
        raise TypeError(f"this client's dataset factory cannot build a variant with augment={augment} "
                        f"({exc})") from None


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))


def run_client_update(method: Method, ctx: ClientContext, instruction: Instruction,
                      store: ClientStore | None = None) -> Reply:
    """Check the instruction, run ``method.client_update`` seeded, check the reply.

    With ``store``, the client's persistent state (``ctx.state`` after the update) is saved
    there for this round; a stateless method (empty state, nothing stored before) writes nothing.

    Raises:
        PayloadError: the instruction or reply carries something that may not travel.
    """
    validate_payload(instruction.payload, f"instruction to client {ctx.client_id}")
    validate_payload(instruction.config, f"instruction config to client {ctx.client_id}")
    _seed_all(ctx.seed)
    reply = method.client_update(ctx, instruction)
    if not isinstance(reply, Reply):
        raise TypeError(f"method {method.name!r}: client_update must return a Reply, got {type(reply).__name__}")
    where = f"reply of method {method.name!r} from client {ctx.client_id}"
    validate_payload(reply.payload, where, allow_str=False, guard=ctx.guard,
                     exempt=method.payload_exemptions)
    validate_payload(reply.metrics, where + " (metrics)", allow_str=False, guard=ctx.guard)
    validate_payload(ctx.state, f"persistent state of client {ctx.client_id}", allow_str=True)
    if store is not None and (ctx.state or store.has(ctx.client_id)):
        store.save(ctx.client_id, ctx.round, ctx.state)
    return reply


def run_client_validate(method: Method, ctx: ClientContext, instruction: Instruction,
                        store: ClientStore | None = None) -> dict[str, float]:
    """Check the instruction, run ``method.client_validate`` seeded, check its scalars.

    The validation exchange (:meth:`medfl.method.Method.configure_validate`): what comes
    back is a flat dict of numbers, checked like a reply's metrics. With ``store``, the
    client's state is saved again for this round when the method has any.

    Raises:
        PayloadError: the instruction or the result carries something that may not travel.
        TypeError: the result is not a dict of numbers.
    """
    validate_payload(instruction.payload, f"validation instruction to client {ctx.client_id}")
    validate_payload(instruction.config, f"validation instruction config to client {ctx.client_id}")
    _seed_all(derive_seed(ctx.seed, "validate"))
    scores = method.client_validate(ctx, instruction)
    where = f"validation of method {method.name!r} at client {ctx.client_id}"
    if not isinstance(scores, dict) or not all(
            isinstance(k, str) and isinstance(v, (int, float)) and not isinstance(v, bool) for k, v in scores.items()):
        raise TypeError(f"{where}: client_validate must return a flat dict of numbers, got {scores!r:.200}")
    validate_payload(scores, where, allow_str=False, guard=ctx.guard)
    validate_payload(ctx.state, f"persistent state of client {ctx.client_id}", allow_str=True)
    if store is not None and (ctx.state or store.has(ctx.client_id)):
        store.save(ctx.client_id, ctx.round, ctx.state)
    return {k: float(v) for k, v in scores.items()}


def run_client_evaluate(
    method: Method, ctx: ClientContext, instruction: Instruction, splits: list[str],
    metric_fn: Callable[[np.ndarray, np.ndarray], dict[str, float]],
    cache: dict[tuple[str, str], tuple[dict[str, float], np.ndarray]] | None = None,
    memory: dict[str, Any] | None = None,
    peers: dict[str, Callable[[], Dataset]] | None = None,
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


def evaluate_model(
    model: nn.Module, ctx: ClientContext, splits: list[str],
    metric_fn: Callable[[np.ndarray, np.ndarray], dict[str, float]],
    cache: dict[tuple[str, str], tuple[dict[str, float], np.ndarray]] | None = None,
    memory: dict[str, Any] | None = None,
    peers: dict[str, Callable[[], Dataset]] | None = None,
) -> dict[str, dict[str, float]]:
    """Score the client's evaluation model (:func:`build_eval_model`) on ``splits``: the
    second step of :func:`run_client_evaluate`, whose docstring says what it returns."""
    from medfl.engine.training import predict_proba, state_fingerprint
    from medfl.metrics.fairness import subgroup_scores
    from medfl.metrics.forgetting import negative_flips

    out: dict[str, dict[str, float]] = {}
    fp = state_fingerprint(model) if cache is not None else ""
    for split in splits:
        key = (split, fp)
        shared = cache is not None and split == "global_test"
        if shared and key in cache:
            scores, correct = dict(cache[key][0]), cache[key][1]
        else:
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
    from medfl.engine.training import predict_proba

    bs = int(train.get("eval_batch_size", 64))
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
