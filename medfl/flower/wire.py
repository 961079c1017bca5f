"""medfl messages as Flower records: tensors in an ``ArrayRecord``, scalars in a ``ConfigRecord``.

An :class:`~medfl.messages.Instruction` or :class:`~medfl.messages.Reply` holds nested
dicts, lists and tuples of tensors and scalars. :func:`pack` turns such a value into two
Flower records that travel in a :class:`flwr.app.RecordDict`:

``<name>.arrays`` (``ArrayRecord``)
    every tensor, as a NumPy array (``np.save`` bytes: dtype and shape kept exactly), keyed
    by its position in the tree (``"0"``, ``"1"``, ...);
``<name>.tree`` (``ConfigRecord``)
    one entry ``tree``: the structure as JSON, with the scalars in place and each tensor
    replaced by its key. JSON keeps ``int``/``float``/``bool``/``None``/``str`` apart and
    Python's float repr round-trips exactly (``NaN`` and ``inf`` included).

:func:`unpack` reverses it exactly (tuples stay tuples, dict order is kept), so a value
sent over Flower equals the in-process one bit for bit. Both sides check what they send
and what they receive with :func:`medfl.messages.validate_payload`: only tensors and
scalars ever reach the wire, and a decoded value is checked again before anyone uses it.

Flat ``{name: number}`` results (evaluation metrics) travel as ``MetricRecord``
(:func:`metrics_record`, :func:`read_metrics`).
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from medfl.messages import PayloadError, validate_payload

__all__ = ["pack", "unpack", "put", "take", "metrics_record", "read_metrics", "put_json", "take_json",
           "WireError"]


class WireError(PayloadError):
    """A Flower message does not hold what a medfl message must (missing or malformed records)."""


def _tensor_to_array(t: torch.Tensor) -> tuple[Array, str | None]:
    """A tensor as a Flower ``Array``; bfloat16 (no NumPy dtype) travels as its int16 bits."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return Array(t.contiguous().view(torch.int16).numpy()), "bfloat16"
    return Array(t.contiguous().numpy()), None


def _array_to_tensor(a: Array, special: str | None) -> torch.Tensor:
    arr = a.numpy()
    t = torch.from_numpy(np.array(arr, copy=True))  # writable, owns its memory
    if special == "bfloat16":
        return t.view(torch.bfloat16)
    if special is not None:
        raise WireError(f"unknown tensor encoding {special!r}")
    return t


def pack(value: Any, where: str = "message", *, allow_str: bool = True) -> tuple[ArrayRecord, ConfigRecord]:
    """Encode a tree of tensors and scalars as ``(ArrayRecord, ConfigRecord)``.

    Args:
        value: dicts (string keys), lists and tuples of tensors, ``int``, ``float``,
            ``bool``, ``None`` and (when ``allow_str``) ``str``.
        where: where the value goes, for error messages.
        allow_str: whether strings may be sent (instructions yes, anything from a site no).

    Raises:
        PayloadError: ``value`` holds anything else (checked before encoding).
    """
    validate_payload(value, where, allow_str=allow_str)
    arrays: dict[str, Array] = {}

    def enc(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            key = str(len(arrays))
            arrays[key], special = _tensor_to_array(v)
            return {"t": key} if special is None else {"t": key, "x": special}
        if isinstance(v, dict):
            return {"d": [[k, enc(x)] for k, x in v.items()]}
        if isinstance(v, tuple):
            return {"u": [enc(x) for x in v]}
        if isinstance(v, list):
            return {"l": [enc(x) for x in v]}
        return {"s": v}

    tree = json.dumps(enc(value), allow_nan=True)
    return ArrayRecord(arrays), ConfigRecord({"tree": tree})


def unpack(arrays: ArrayRecord, tree: ConfigRecord, where: str = "message", *,
           allow_str: bool = True) -> Any:
    """Decode what :func:`pack` encoded, and check it again.

    Raises:
        WireError: the records are malformed (a tensor key missing, an unknown node).
        PayloadError: the decoded value holds something that may not travel.
    """
    if "tree" not in tree or not isinstance(tree["tree"], str):
        raise WireError(f"{where}: no 'tree' entry in the config record")
    try:
        root = json.loads(tree["tree"])
    except json.JSONDecodeError as exc:
        raise WireError(f"{where}: the tree is not valid JSON ({exc})") from None

    def dec(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise WireError(f"{where}: malformed tree node {node!r:.80}")
        if "t" in node:
            key = node["t"]
            if key not in arrays:
                raise WireError(f"{where}: tensor {key!r} missing from the array record")
            return _array_to_tensor(arrays[key], node.get("x"))
        if "d" in node:
            return {str(k): dec(x) for k, x in node["d"]}
        if "u" in node:
            return tuple(dec(x) for x in node["u"])
        if "l" in node:
            return [dec(x) for x in node["l"]]
        if "s" in node:
            return node["s"]
        raise WireError(f"{where}: unknown tree node {sorted(node)}")

    value = dec(root)
    validate_payload(value, where, allow_str=allow_str)
    return value


def put(content: RecordDict, name: str, value: Any, where: str, *, allow_str: bool = True) -> None:
    """Pack ``value`` into ``content`` as ``<name>.arrays`` and ``<name>.tree``."""
    arrays, tree = pack(value, where, allow_str=allow_str)
    content[f"{name}.arrays"] = arrays
    content[f"{name}.tree"] = tree


def take(content: RecordDict, name: str, where: str, *, allow_str: bool = True) -> Any:
    """Unpack the value :func:`put` stored under ``name``.

    Raises:
        WireError: the message has no such value.
    """
    a, t = content.get(f"{name}.arrays"), content.get(f"{name}.tree")
    if not isinstance(a, ArrayRecord) or not isinstance(t, ConfigRecord):
        raise WireError(f"{where}: no {name!r} in the message (records {sorted(content)})")
    return unpack(a, t, where, allow_str=allow_str)


def put_json(content: RecordDict, name: str, value: dict[str, Any]) -> None:
    """Store a small dict of JSON scalars (control fields) as a ``ConfigRecord``: every
    entry as its own JSON text, so ``None`` and nested specs travel too."""
    content[name] = ConfigRecord({k: json.dumps(v, allow_nan=True) for k, v in value.items()})


def take_json(content: RecordDict, name: str, where: str) -> dict[str, Any]:
    """Read what :func:`put_json` stored.

    Raises:
        WireError: the record is missing or not JSON.
    """
    rec = content.get(name)
    if not isinstance(rec, ConfigRecord):
        raise WireError(f"{where}: no {name!r} record in the message (records {sorted(content)})")
    try:
        return {k: json.loads(v) for k, v in rec.items()}  # type: ignore[arg-type]
    except (TypeError, json.JSONDecodeError) as exc:
        raise WireError(f"{where}: record {name!r} is not JSON ({exc})") from None


def metrics_record(metrics: dict[str, float], where: str) -> MetricRecord:
    """A flat ``{name: number}`` dict as a ``MetricRecord`` (values as ``float``).

    Raises:
        PayloadError: a value is not a number.
    """
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise PayloadError(f"{where}[{k!r}]: metrics must be numbers, got {type(v).__name__}")
        out[str(k)] = float(v)
    return MetricRecord(out)


def read_metrics(record: Any, where: str) -> dict[str, float]:
    """The ``{name: float}`` dict of a ``MetricRecord``.

    Raises:
        WireError: ``record`` is not a ``MetricRecord`` of scalars.
    """
    if not isinstance(record, MetricRecord):
        raise WireError(f"{where}: expected a MetricRecord, got {type(record).__name__}")
    out = {}
    for k, v in record.items():
        if isinstance(v, list):
            raise WireError(f"{where}[{k!r}]: a list where a scalar metric was expected")
        out[k] = float(v)
    return out
