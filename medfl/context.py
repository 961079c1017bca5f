"""The client's view: :class:`ClientContext`, all a method's client code may touch.

A context is built by the transport (the in-process engine or a Flower site) for one client
and one step, and knows nothing of the coordinator: the client's datasets, its persistent
state, its model spec and training settings, a seed. It lives beside
:class:`medfl.method.Method` because it is half of the method contract (docs/plugins.md).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from medfl.messages import Guard
from medfl.seeding import derive_noise_seed, derive_seed

__all__ = ["ClientContext"]

#: Model objects reused by :meth:`ClientContext.load_model` (spec and device -> the module
#: and its :func:`_signature` as built), least recently used first; a process runs one
#: client at a time, so one per spec suffices.
_SHELLS: "OrderedDict[str, tuple[nn.Module, tuple[Any, ...], list[str]]]" = OrderedDict()   # model, signature, state keys
_MAX_SHELLS = 8

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
               "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks",
               "_load_state_dict_post_hooks")


def _tensors_of(m: nn.Module) -> tuple[Any, ...]:
    """A module's own parameters and persistent buffers: names, shapes and dtypes."""
    skip = getattr(m, "_non_persistent_buffers_set", ())
    return (tuple((k, tuple(p.shape), p.dtype) for k, p in m._parameters.items() if p is not None),
            tuple((k, tuple(b.shape), b.dtype) for k, b in m._buffers.items() if b is not None and k not in skip))


def _signature(model: nn.Module) -> tuple[Any, ...]:
    """The module tree (names and types) with each module's parameters and persistent
    buffers (names, shapes, dtypes): what the model's state dict holds, read in one walk."""
    return tuple((name, type(m), _tensors_of(m)) for name, m in model.named_modules())


def _pristine(model: nn.Module, sig: tuple[Any, ...]) -> bool:
    """Whether ``model`` is still as built: same :func:`_signature`, no hooks on any module,
    no attributes added to a parameter (Opacus's ``grad_sample``...). One walk of the
    modules (a ResNet's state dict built and compared cost several times more)."""
    return _pristine_tensors(model, sig) is not None


def _pristine_tensors(model: nn.Module, sig: tuple[Any, ...]) -> list[tuple[str, torch.Tensor]] | None:
    """:func:`_pristine`, and if so the model's state-dict entries as the walk found them
    (key and the parameter or buffer itself, in state-dict order); ``None`` when the model
    is not as built."""
    seen, tensors = [], []
    for name, m in model.named_modules():
        if any(getattr(m, d, None) for d in _HOOK_DICTS):
            return None
        if any(vars(p) for p in m._parameters.values() if p is not None):
            return None
        seen.append((name, type(m), _tensors_of(m)))
        pre = f"{name}." if name else ""
        skip = getattr(m, "_non_persistent_buffers_set", ())
        tensors += [(pre + k, p) for k, p in m._parameters.items() if p is not None]
        tensors += [(pre + k, b) for k, b in m._buffers.items() if b is not None and k not in skip]
    return tensors if tuple(seen) == sig else None


def _load_into(model: nn.Module, tensors: list[tuple[str, torch.Tensor]], keys: list[str],
               state: dict[str, Any]) -> None:
    """``model.load_state_dict({k: state[k] for k in keys})`` for a model as built (no hooks:
    :func:`_pristine_tensors` gave ``tensors``), in one fused copy: torch's ``load_state_dict``
    spends about 3 ms of Python on a ResNet's 77 entries, this about 0.6 ms. Anything unusual
    (other keys, a shape that differs, a value that is not a tensor or lies on another
    device) goes through ``load_state_dict``, which raises its usual errors; values of
    another dtype are cast, as ``load_state_dict`` casts them."""
    src = [state[k] for k in keys]
    if [k for k, _ in tensors] != keys or any(
            not isinstance(v, torch.Tensor) or v.shape != t.shape or v.device != t.device
            for v, (_, t) in zip(src, tensors)):
        model.load_state_dict({k: state[k] for k in keys})
        return
    fused = getattr(torch, "_foreach_copy_", None)   # torch >= 2.1; a plain loop otherwise
    with torch.no_grad():
        if fused is not None:
            fused([t for _, t in tensors], src)
        else:
            for (_, t), v in zip(tensors, src):
                t.copy_(v)


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
        noise_key: a secret of the site mixed into the seeds of privacy noise (DP-SGD's
            sampling and noise, ``dp_gaussian``'s noise, a method's own release): draw them
            from :meth:`noise_seed`. Empty in process: the noise is then reproducible from
            the run seed, a simulation (whoever knows the seed could subtract it). A Flower
            site sets a secret of its own for every run (:meth:`medfl.site.Site.run_noise_key`:
            fresh random bytes the first time it sees the run), so the coordinator, which
            knows the run seed, cannot.
        step: the training step within the round (``Method.round_steps``; 0 for one step),
            set by the engine before ``client_update``; part of :meth:`noise_seed`.
        deployed: the client runs on its own machine (a Flower site): what it measures of
            the machine (:meth:`medfl.method.Method.client_profile`) is real. False in
            process (a simulation: every client shares this machine).
        coordinator: the coordinator's address (``host:port`` of the Flower SuperLink) where
            the site knows it, else empty.
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
    noise_key: str = field(default="", repr=False)
    step: int = 0
    deployed: bool = False
    coordinator: str = ""
    _shells_taken: set[str] = field(default_factory=set, repr=False)
    _built: dict[tuple[str, bool], Dataset] = field(default_factory=dict, repr=False)

    def noise_seed(self, mechanism: str, **parameters: Any) -> int:
        """The seed of one differential-privacy draw at this client: a 63-bit seed of (this
        context's seed, :attr:`step`, ``mechanism``, the release's ``parameters`` such as its
        noise multiplier and clip, :attr:`noise_key`). Seed every DP draw from it, naming
        every parameter that scales the noise: a release asked again with another noise
        multiplier then draws other noise, never the same draw at another scale (from which
        the coordinator could solve the clipped value)."""
        return derive_noise_seed(self.seed, "noise", self.step, mechanism,
                                 json.dumps(parameters, sort_keys=True, default=str), self.noise_key)

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
        (16) for ``train`` and ``train["eval_batch_size"]`` (64) for the other splits.
        ``train["num_workers"]`` processes read and transform the batches (0: this process),
        into page-locked memory when ``train["pin_memory"]`` says so (default: on a CUDA
        device), so that copies to the GPU can overlap compute."""
        shuffle = (split == "train") if shuffle is None else shuffle
        gen = torch.Generator().manual_seed(derive_seed(self.seed, "loader", split))
        bs = int(batch_size or (self.train.get("batch_size", 16) if split == "train"
                                else self.train.get("eval_batch_size", 64)))
        workers = int(self.train.get("num_workers", 0))
        pin = self.train.get("pin_memory")
        pin = torch.device(str(self.device)).type == "cuda" if pin is None else bool(pin)
        # each worker reseeds the dataset's random transforms from its torch seed, which the
        # loader draws from ``gen``: the same batches for the same seed and num_workers (the
        # order and the images without augmentation are those of num_workers 0; augmented
        # images differ from num_workers 0, whose transforms draw from the process's state)
        init = None
        if workers:
            from monai.data.utils import worker_init_fn as init
        return DataLoader(self.dataset(split, augment=augment), batch_size=bs, shuffle=shuffle, generator=gen,
                          num_workers=workers, pin_memory=pin, worker_init_fn=init)

    def build_model(self, **overrides: Any) -> nn.Module:
        """A fresh model of this client's spec, initialised from a seed of (seed, client)."""
        from medfl.models.registry import build_seeded

        return build_seeded({**self.model_spec, **overrides}, derive_seed(self.seed, "build", self.client_id),
                            self.device)

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
        if torch.device(str(self.device)).type != "cpu" and any(
                isinstance(v, torch.Tensor) and v.device.type == "cpu" for v in state.values()):
            from medfl.training import move_state

            state = move_state(state, self.device)   # one transfer per dtype, not one per tensor
        key = json.dumps([self.model_spec, str(self.device)], sort_keys=True, default=str)
        entry = _SHELLS.get(key) if key not in self._shells_taken and not fresh else None
        self._shells_taken.add(key)
        keys = entry[2] if entry is not None else []
        tensors = _pristine_tensors(entry[0], entry[1]) if entry is not None and set(keys) <= set(state) else None
        if entry is not None and tensors is not None:
            model = entry[0]
            _SHELLS.move_to_end(key)
            _load_into(model, tensors, keys, state)
            for p in model.parameters():
                p.grad = None
                p.requires_grad_(True)
            return model.train()
        model = self.build_model()
        full = model.state_dict()
        full.update({k: v for k, v in state.items() if k in full})
        model.load_state_dict(full)
        _SHELLS[key] = (model, _signature(model), list(full))
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
