"""What may travel between coordinator and clients: tensors and scalars only.

Every instruction (coordinator -> client) and reply (client -> coordinator) is checked by
:func:`validate_payload` before it is delivered, in-process and over Flower alike. Allowed
values are :class:`torch.Tensor`, ``int``, ``float``, ``bool``, ``None`` and (in
instructions only) ``str`` config values, nested in ``dict`` (string keys), ``list`` or
``tuple``. Anything else (arrays of objects, bytes, images as PIL/numpy, paths) is refused.

What leaves a client is also compared with the client's own data, where the data is: a
:class:`~medfl.guard.ContentGuard` (``ClientContext.guard``) refuses a reply payload,
reply metrics or evaluation model that holds the client's labels or images, whatever their
dtype, shape or container (see :mod:`medfl.guard`). That check catches mistakes; it cannot
stop a plugin written to leak, which runs at the site: approving what runs at a site
(:mod:`medfl.approval`) and differential privacy on what leaves it are the protections.

The coordinator has no data; it checks types and, with a :class:`SampleGuard`, refuses a
tensor shaped like a batch of the client's images (its trailing dimensions equal the sample
shape and its leading dimension counts samples). It has no rule on the length of integer
vectors: that rule refused legitimate quantised weights whose length equalled a split size.

A method that must share per-sample values by design (FedTPF's distilled features) declares
the release (``Method.release_plan``: a :class:`~medfl.privacy.feature_release.SampleRelease`
naming the reply keys) and returns the features *unnoised* in its reply to an instruction
whose config carries ``RELEASE_FLAG`` (``"dp_release": True``). medfl clips and noises them
at the client after the method's code returned, and the content guard checks the reply as it
leaves, released features included; the release's keys skip only the coordinator's shape
check (the noised features are shaped like images). The flag excuses nothing else: a release
key in a reply to any other instruction is refused, and every other key is checked in full.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from medfl.wire_format import PayloadError

__all__ = ["RELEASE_FLAG", "RELEASE_CLIP", "SECURE_AGGREGATE", "state_mismatch", "PayloadError", "Instruction", "Reply",
           "Guard", "SampleGuard", "validate_payload"]

Scalar = int | float | bool | str | None

#: The instruction-config key that asks a client for its method's declared per-sample release:
#: medfl performs the release (``SampleRelease``) on the reply to such an instruction; a reply
#: to any other instruction may not carry the release's keys.
RELEASE_FLAG = "dp_release"
#: The instruction-config key carrying the clip of a release whose clip the coordinator sets
#: during the run (``SampleRelease.clip`` NaN in the plan, e.g. measured on public data).
RELEASE_CLIP = "release_clip"

#: The client id of the one reply a method with ``Method.secure_aggregation`` receives under
#: ``fl.secure_aggregation``: the clients' weighted mean, never a client's own reply.
SECURE_AGGREGATE = "secure-aggregate"


@dataclass
class Instruction:
    """What the coordinator sends one client for one round.

    Attributes:
        payload: tensors (state dicts, prototypes, logits) and scalars, nested in dicts/lists.
        config: scalar settings for this round (e.g. ``{"mode": "self", "epochs": 1}``).
    """

    payload: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Scalar] = field(default_factory=dict)


@dataclass
class Reply:
    """What one client sends back after its update.

    Attributes:
        payload: tensors and numeric scalars (no strings: they could carry paths).
        metrics: numeric training metrics (loss, accuracy, ...) for logging, under names the
            method declares (``Method.train_metrics``, ``Method.reported_names``).
        num_examples: number of local training examples used (FedAvg weight): the size of
            the client's training split unless the method declares otherwise
            (``Method.expected_num_examples``).
    """

    payload: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    num_examples: int = 0


class Guard(Protocol):
    """A check of an outgoing message beyond its types (:class:`SampleGuard` at the
    coordinator, :class:`medfl.guard.ContentGuard` at a client)."""

    def check(self, value: Any, where: str, exempt: frozenset[str] = frozenset()) -> None:
        """Raise :class:`PayloadError` if ``value`` (top-level keys ``exempt`` aside) holds client data."""


@dataclass(frozen=True)
class SampleGuard:
    """The shape of a client's samples, to recognise a batch of images in a reply where
    the data is not at hand (the coordinator).

    It has no rule on the length of a tensor (a length says nothing of the content), so it
    needs nothing of the client but the shape of one sample, the same for every client.

    Attributes:
        sample_shape: shape of one input sample, e.g. ``(1, 64, 64)``.
    """

    sample_shape: tuple[int, ...]

    def check(self, value: Any, where: str, exempt: frozenset[str] = frozenset()) -> None:
        """Refuse a tensor in ``value`` shaped like a batch of the client's images.

        Raises:
            PayloadError: naming the key path and the shape.
        """
        if isinstance(value, torch.Tensor):
            _check_tensor(value, where, self)
        elif isinstance(value, dict):
            for key, item in value.items():
                if key not in exempt:   # exemptions name top-level keys
                    self.check(item, f"{where}[{key!r}]")
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                self.check(item, f"{where}[{i}]")


def _check_tensor(t: torch.Tensor, where: str, guard: SampleGuard) -> None:
    shape = tuple(t.shape)
    k = len(guard.sample_shape)
    if k and len(shape) == k + 1 and shape[1:] == guard.sample_shape and shape[0] > 1:
        raise PayloadError(f"{where}: tensor of shape {shape} looks like a batch of the client's images "
                           f"(sample shape {guard.sample_shape}); images never leave a client")


def validate_payload(value: Any, where: str = "payload", *, allow_str: bool = True, guard: Guard | None = None,
                     exempt: frozenset[str] = frozenset()) -> None:
    """Check that ``value`` holds only tensors and scalars, then apply ``guard``.

    Args:
        value: the payload (usually a dict) to check, recursively.
        where: a readable location used in error messages, e.g. ``"reply from client 3"``.
        allow_str: whether string scalars are allowed (instructions: yes; replies: no).
        guard: when given, also refuse client data: a :class:`~medfl.guard.ContentGuard`
            (at the client: the client's labels and images) or a :class:`SampleGuard` (at the
            coordinator: image-shaped batches).
        exempt: top-level keys excused from the ``guard`` check (never from the type check).

    Raises:
        PayloadError: naming the offending key path and its type (or what the guard found).
    """
    _check_types(value, where, allow_str)
    if guard is not None:
        guard.check(value, where, exempt)


def _check_types(value: Any, where: str, allow_str: bool) -> None:
    if value is None or isinstance(value, (torch.Tensor, bool, int, float)):
        return
    if isinstance(value, str):
        if not allow_str:
            raise PayloadError(f"{where}: strings may not leave a client (they can carry file paths); got {value!r}")
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise PayloadError(f"{where}: dict keys must be str, got {type(key).__name__}")
            _check_types(item, f"{where}[{key!r}]", allow_str)
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_types(item, f"{where}[{i}]", allow_str)
        return
    raise PayloadError(f"{where}: only tensors and scalars may travel between coordinator and clients; "
                       f"got {type(value).__module__}.{type(value).__qualname__}")


def state_mismatch(got: Any, ref: dict[str, Any], where: str = "state") -> str:
    """Why ``got`` is not a state dict like ``ref`` (same keys in the same order, tensors of
    the same shapes and dtypes), or "" when it is: what a coordinator checks a returned model
    against the model it sent (a site may send anything)."""
    if not isinstance(got, dict) or list(got) != list(ref):
        if not isinstance(got, dict):
            return f"{where} is {type(got).__name__}, not a state dict"
        extra, missing = sorted(set(got) - set(ref)), sorted(set(ref) - set(got))
        return (f"{where} is not the state it was sent: " + (f"missing {missing[:3]} " if missing else "")
                + (f"extra {extra[:3]}" if extra else "") or f"{where}: keys in another order")
    for k, v in got.items():
        want = ref[k]
        if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(want.shape) or v.dtype != want.dtype:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            return f"{where}[{k!r}] is {shape} {getattr(v, 'dtype', '')}; expected {tuple(want.shape)} {want.dtype}"
    return ""
