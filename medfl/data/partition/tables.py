"""A partition as a table: :func:`partition_table` (the saved ``partition.csv``),
:func:`partition_from_table` (read back) and :func:`class_counts` (labels per client).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pandas as pd

from medfl.data.partition.base import Partition, _check_table, _labels, check_partition

__all__ = ["class_counts", "partition_from_table", "partition_table"]


def partition_table(table: pd.DataFrame, parts: Mapping[str, np.ndarray]) -> pd.DataFrame:
    """The saved form of a partition: one line per assigned row.

    Args:
        table: the partitioned manifest (``label`` column required).
        parts: the partition (a :class:`Partition` or plain ``dict``; names default to
            ``"client_<id>"``).

    Returns:
        A frame with columns ``row`` (position in ``table``), ``client_id``,
        ``client_name``, ``label`` and, when ``table`` has one, ``sample_id``; sorted by
        client (in ``parts`` order) then row.

    Raises:
        PartitionError: if ``table`` lacks ``label`` or a position is out of range or
            assigned twice.
    """
    _check_table("partition_table", table)
    checked = check_partition(parts, len(table), complete=False)
    ids = list(checked.keys())
    lengths = [len(pos) for pos in checked.values()]
    rows = (np.concatenate(list(checked.values())) if checked
            else np.empty(0, dtype=np.int64))
    out = pd.DataFrame({
        "row": rows.astype(np.int64),
        "client_id": pd.Series(np.repeat(np.asarray(ids, dtype=object), lengths),
                               dtype=object),
        "client_name": pd.Series(
            np.repeat(np.asarray([checked.names[c] for c in ids], dtype=object), lengths),
            dtype=object),
    })
    out["label"] = table["label"].to_numpy()[rows]
    if "sample_id" in table.columns:
        out["sample_id"] = table["sample_id"].to_numpy()[rows]
    return out.reset_index(drop=True)


def partition_from_table(saved: pd.DataFrame) -> Partition:
    """Rebuild a :class:`Partition` from the output of :func:`partition_table`.

    Args:
        saved: frame with columns ``row`` and ``client_id`` (``client_name`` optional).

    Returns:
        The partition, clients in order of first appearance.

    Raises:
        PartitionError: if the columns are missing.
    """
    _check_table("partition_from_table", saved, ("row", "client_id"))
    ids = saved["client_id"].astype(str)
    order = list(dict.fromkeys(ids.tolist()))
    data = {cid: np.sort(saved.loc[ids == cid, "row"].to_numpy(dtype=np.int64))
            for cid in order}
    names = None
    if "client_name" in saved.columns:
        names = dict(zip(ids, saved["client_name"].astype(str)))
    return Partition(data, names=names)


def class_counts(table: pd.DataFrame, parts: Mapping[str, np.ndarray]) -> pd.DataFrame:
    """Label counts per client.

    Args:
        table: the partitioned manifest (``label`` column required).
        parts: the partition.

    Returns:
        An ``int64`` frame indexed by client id (index name ``client_id``, in ``parts``
        order) with one column per label present in ``table`` (sorted; columns name
        ``label``), zeros included.
    """
    _check_table("class_counts", table)
    labels = _labels("class_counts", table)
    classes = np.unique(labels)
    checked = check_partition(parts, len(table), complete=False)
    counts = np.zeros((len(checked), len(classes)), dtype=np.int64)
    for i, pos in enumerate(checked.values()):
        if len(pos):
            idx = np.searchsorted(classes, labels[pos])
            np.add.at(counts[i], idx, 1)
    return pd.DataFrame(
        counts,
        index=pd.Index(list(checked.keys()), name="client_id"),
        columns=pd.Index(classes.tolist(), name="label"),
    )
