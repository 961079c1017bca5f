"""What may travel between coordinator and clients: tensors and scalars only.

Every instruction (coordinator -> client) and reply (client -> coordinator) is checked by
:func:`validate_payload` before it is delivered, in-process and over Flower alike. Allowed
values are :class:`torch.Tensor`, ``int``, ``float``, ``bool``, ``None`` and (in
instructions only) ``str`` config values, nested in ``dict`` (string keys), ``list`` or
``tuple``. Anything else (arrays of objects, bytes, images as PIL/numpy, paths) is refused.

Replies are checked further against the client's data (:class:`SampleGuard`): no tensor may
look like a batch of the client's images (its trailing dimensions equal the sample shape and
its leading dimension counts samples) and no 1-D integer tensor may be as long as one of
the client's splits (per-sample labels). A method that must share per-sample features by
design (FedTPF's DP-noised distilled features) lists those reply keys in
``Method.payload_exemptions`` and documents it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PayloadError", "Instruction", "Reply", "SampleGuard", "validate_payload"]

Scalar = int | float | bool | str | None


class PayloadError(TypeError):
    """A message carried something other than tensors and scalars, or client data."""


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
        metrics: numeric training metrics (loss, accuracy, ...) for logging.
        num_examples: number of local training examples used (FedAvg weight).
    """

    payload: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    num_examples: int = 0


@dataclass(frozen=True)
class SampleGuard:
    """What a client's data looks like, to recognise raw data in a reply.

    Attributes:
        sample_shape: shape of one input sample, e.g. ``(1, 64, 64)``.
        split_sizes: number of samples in each of the client's splits.
    """

    sample_shape: tuple[int, ...]
    split_sizes: tuple[int, ...]

    @classmethod
    def of(cls, sample_shape: Any, split_sizes: dict[str, int]) -> "SampleGuard":
        """The guard of a client with samples of ``sample_shape`` and these split sizes."""
        return cls(tuple(sample_shape), tuple(sorted(set(split_sizes.values()))))


def _check_tensor(t: torch.Tensor, where: str, guard: SampleGuard | None) -> None:
    if guard is None:
        return
    shape = tuple(t.shape)
    k = len(guard.sample_shape)
    if k and len(shape) == k + 1 and shape[1:] == guard.sample_shape and shape[0] > 1:
        raise PayloadError(
            f"{where}: tensor of shape {shape} looks like a batch of the client's images "
            f"(sample shape {guard.sample_shape}); images never leave a client"
        )
    if len(shape) == 1 and not t.is_floating_point() and not t.is_complex() and (
        shape[0] in {n for n in guard.split_sizes if n > 1}
    ):
        raise PayloadError(
            f"{where}: integer tensor of length {shape[0]} matches the size of one of the "
            f"client's data splits {guard.split_sizes}; per-sample labels never leave a client"
        )


def validate_payload(
    value: Any,
    where: str = "payload",
    *,
    allow_str: bool = True,
    guard: SampleGuard | None = None,
    exempt: frozenset[str] = frozenset(),
) -> None:
    """Check that ``value`` holds only tensors and scalars.

    Args:
        value: the payload (usually a dict) to check, recursively.
        where: a readable location used in error messages, e.g. ``"reply from client 3"``.
        allow_str: whether string scalars are allowed (instructions: yes; replies: no).
        guard: when given, also refuse tensors that look like the client's samples or labels.
        exempt: top-level keys excused from the ``guard`` check (never from the type check).

    Raises:
        PayloadError: naming the offending key path and its type.
    """
    if isinstance(value, torch.Tensor):
        _check_tensor(value, where, guard)
        return
    if value is None or isinstance(value, (bool, int, float)):
        return
    if isinstance(value, str):
        if not allow_str:
            raise PayloadError(
                f"{where}: strings may not leave a client (they can carry file paths); got {value!r}"
            )
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise PayloadError(f"{where}: dict keys must be str, got {type(key).__name__}")
            sub_guard = None if key in exempt else guard  # exemptions name top-level keys
            validate_payload(item, f"{where}[{key!r}]", allow_str=allow_str, guard=sub_guard)
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            validate_payload(item, f"{where}[{i}]", allow_str=allow_str, guard=guard)
        return
    raise PayloadError(
        f"{where}: only tensors and scalars may travel between coordinator and clients; "
        f"got {type(value).__module__}.{type(value).__qualname__}"
    )
