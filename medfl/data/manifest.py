"""The generic ``manifest`` dataset: a manifest CSV written by a data_prep script."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from medfl.data.source import ArrayDataset, DataError, FederatedSource, read_manifest

__all__ = ["manifest_source"]


def manifest_source(path: str, root: str | None = None, num_classes: int | None = None) -> FederatedSource:
    """Dataset plugin ``manifest``: samples listed in a manifest CSV as cached ``.npy`` arrays.

    Args:
        path: the manifest CSV (columns ``path``, ``label``; optional ``class_name``,
            ``split``, ``site``, ``sex``, ``subject_id``, ``sample_id``).
        root: directory that relative ``path`` values are resolved against (default: the
            manifest's directory).
        num_classes: number of classes (default: largest label + 1).

    Raises:
        DataError: unreadable manifest, a missing column, negative labels, or an unreadable
            first array.
    """
    table = read_manifest(path)
    base = Path(root) if root else Path(path).parent
    if (table["label"] < 0).any():
        raise DataError(f"{path}: column 'label' has negative values")
    k = int(num_classes or table["label"].max() + 1)
    if "class_name" in table.columns:
        names = (table.drop_duplicates("label").set_index("label")["class_name"]
                 .reindex(range(k)).fillna("").astype(str).tolist())
    else:
        names = [f"class_{c}" for c in range(k)]
    first = base / str(table["path"].iloc[0])
    try:
        shape = tuple(np.load(first, mmap_mode="r").shape)
    except (OSError, ValueError) as exc:
        raise DataError(f"{first}: cannot read cached array ({exc})") from exc

    def make_dataset(rows: pd.DataFrame, train: bool) -> ArrayDataset:
        return ArrayDataset(rows["path"].astype(str).tolist(), rows["label"].to_numpy(), root=base)

    return FederatedSource(table=table, num_classes=k, class_names=names, sample_shape=shape,
                           make_dataset=make_dataset, description=f"manifest {path}")
