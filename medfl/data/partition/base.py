"""What every partitioner returns and the checks they share: :class:`Partition` (client id ->
row positions, with names), :class:`PartitionError`, :func:`check_partition` (validates a
partition, e.g. a plugin's plain ``dict``) and the private parameter checks that give every
partitioner the same error messages (``"<partitioner>: <parameter> must be ..."``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from numbers import Integral, Real
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["REST_ROLES", "Partition", "PartitionError", "check_partition"]


class PartitionError(ValueError):
    """A partition was requested with bad parameters, or cannot be produced."""


#: What may become of rows a partition leaves unassigned (:attr:`Partition.rest`).
REST_ROLES = (None, "global_test")


class Partition(dict[str, np.ndarray]):
    """Client id -> sorted ``int64`` row positions, plus human-readable client names.

    A plain ``dict`` in every respect (``parts["0"]``, ``len(parts)``, iteration in client
    order), with one extra attribute.

    Args:
        data: mapping or iterable of ``(client_id, positions)`` pairs. Default: empty.
        names: client id -> display name. Default: ``None``, meaning ``"client_<id>"`` for
            every client; ids missing from a given mapping also get ``"client_<id>"``.

        rest: what becomes of rows no client holds: ``None`` (dropped, as
            :func:`label_skew` with ``allow_unassigned``) or ``"global_test"`` (the engine
            adds them to the held-out global test set, as :func:`class_sample` asks).

    Attributes:
        names: client id -> display name (e.g. ``"EUROPE"`` for :func:`natural`,
            ``"client_0"`` for the other partitioners).
        rest: as the argument.
    """

    names: dict[str, str]
    rest: str | None

    def __init__(
        self,
        data: Mapping[str, np.ndarray] | Iterable[tuple[str, np.ndarray]] = (),
        names: Mapping[str, str] | None = None,
        rest: str | None = None,
    ) -> None:
        super().__init__(data)
        given = dict(names or {})
        self.names = {cid: str(given.get(cid, f"client_{cid}")) for cid in self}
        if rest not in REST_ROLES:
            raise PartitionError(f"Partition: rest must be one of {REST_ROLES}, got {rest!r}")
        self.rest = rest

    def sizes(self) -> dict[str, int]:
        """Number of rows held by each client, in client order."""
        return {cid: int(len(pos)) for cid, pos in self.items()}

    def __repr__(self) -> str:
        inner = ", ".join(f"{cid!r} ({self.names.get(cid, cid)}): {len(pos)} rows"
                          for cid, pos in self.items())
        return f"Partition({{{inner}}})"


# --------------------------------------------------------------------------- validation


def _fail(func: str, message: str) -> PartitionError:
    return PartitionError(f"{func}: {message}")


def _check_table(func: str, table: Any, columns: Iterable[str] = ("label",)) -> None:
    if not isinstance(table, pd.DataFrame):
        raise _fail(func, f"table must be a pandas.DataFrame, got {type(table).__name__}")
    missing = [c for c in columns if c not in table.columns]
    if missing:
        raise _fail(
            func,
            f"table is missing column(s) {missing}; it has {list(map(str, table.columns))}",
        )


def _labels(func: str, table: pd.DataFrame) -> np.ndarray:
    col = table["label"]
    if col.isna().any():
        raise _fail(func, f"column 'label' has {int(col.isna().sum())} missing value(s)")
    return col.to_numpy()


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _check_int(func: str, name: str, value: Any, low: int, high: int | None = None,
               why: str = "") -> int:
    ok = _is_int(value) and value >= low and (high is None or value <= high)
    if not ok:
        rng_txt = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise _fail(func, f"{name} must be an integer {rng_txt}{why}, got {value!r}")
    return int(value)


def _check_positive(func: str, name: str, value: Any) -> float:
    if (not isinstance(value, Real) or isinstance(value, bool) or not math.isfinite(value)
            or value <= 0):
        raise _fail(func, f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


def _check_clients(func: str, num_clients: Any, n: int) -> int:
    num_clients = _check_int(func, "num_clients", num_clients, 1)
    if num_clients > n:
        raise _fail(
            func, f"num_clients={num_clients} is more than the number of rows ({n}); "
            "expected num_clients <= len(table)",
        )
    return num_clients


def _rng(func: str, seed: Any) -> np.random.Generator:
    if not _is_int(seed) or seed < 0:
        raise _fail(func, f"seed must be a non-negative integer, got {seed!r}")
    return np.random.default_rng(int(seed))


def _finish(buckets: list[np.ndarray], names: list[str] | None = None, rest: str | None = None) -> Partition:
    """The :class:`Partition` giving client ``i`` the rows ``buckets[i]``, named ``names[i]``."""
    data = {str(i): np.sort(np.asarray(bucket, dtype=np.int64)) for i, bucket in enumerate(buckets)}
    named = None if names is None else {str(i): nm for i, nm in enumerate(names)}
    return Partition(data, names=named, rest=rest)


def check_partition(parts: Mapping[str, Any], num_rows: int | pd.DataFrame, *,
                    complete: bool = True) -> Partition:
    """Validate a partitioner's result and return it as a :class:`Partition`.

    Useful for partitioners from plugins, which may return a plain ``dict``.

    Args:
        parts: client id -> row positions.
        num_rows: number of rows in the table, or the table itself.
        complete: require every row to be assigned. Default: ``True``.

    Returns:
        A :class:`Partition` with sorted ``int64`` arrays (the names of ``parts`` are kept
        when it is a :class:`Partition` already).

    Raises:
        PartitionError: if a position is out of range, not an integer, assigned twice or
            (when ``complete``) a row is assigned to no client.
    """
    n = len(num_rows) if isinstance(num_rows, pd.DataFrame) else int(num_rows)
    data: dict[str, np.ndarray] = {}
    seen = np.zeros(n, dtype=np.int64)
    for cid, pos in parts.items():
        arr = np.asarray(pos)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise PartitionError(f"client {cid!r}: positions must be integers, got {arr.dtype}")
        arr = np.sort(arr.astype(np.int64).ravel())
        if arr.size and (arr[0] < 0 or arr[-1] >= n):
            raise PartitionError(
                f"client {cid!r}: positions must lie in [0, {n - 1}], got "
                f"min {arr[0]} and max {arr[-1]}"
            )
        np.add.at(seen, arr, 1)
        data[str(cid)] = arr
    if (seen > 1).any():
        dup = np.flatnonzero(seen > 1)
        raise PartitionError(
            f"{dup.size} row(s) assigned to more than one client, e.g. positions {dup[:5].tolist()}"
        )
    if complete and (seen == 0).any():
        gap = np.flatnonzero(seen == 0)
        raise PartitionError(
            f"{gap.size} row(s) assigned to no client, e.g. positions {gap[:5].tolist()}"
        )
    names = getattr(parts, "names", None)
    return Partition(data, names=names, rest=getattr(parts, "rest", None))
