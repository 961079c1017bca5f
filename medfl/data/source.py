"""Federated data sources: a manifest table plus a way to load the samples it names.

A dataset plugin returns a :class:`FederatedSource`. Its ``table`` has one row per sample
and at least a ``label`` column (int class id); optional columns are ``sample_id``,
``path`` (a cached array, ``.npy``), ``class_name``, ``subject_id``, ``site``, ``sex`` and
``split`` (the dataset's official split: ``train``/``val``/``test``). The engine partitions
rows across clients and asks the source for a :class:`torch.utils.data.Dataset` of a subset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import torch
from torch.utils.data import Dataset

__all__ = ["DataError", "FederatedSource", "ArrayDataset", "read_manifest"]


class DataError(ValueError):
    """A dataset or manifest is unusable; the message names the file or field."""


class ArrayDataset(Dataset):
    """Samples stored as cached ``.npy`` arrays named by a manifest's ``path`` column.

    Args:
        paths: array files, one per sample (absolute, or relative to ``root``).
        labels: integer labels, shape ``(N,)``.
        root: directory that relative paths are resolved against.
        transform: optional callable applied to the ``(C, H, W[, D])`` float tensor.

    Items are ``(image, label)`` with ``image`` a float32 tensor ``(C, H, W[, D])``.
    """

    def __init__(
        self,
        paths: list[str],
        labels: np.ndarray,
        root: str | Path = ".",
        transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.paths = [Path(root) / p for p in paths]
        self.labels = np.asarray(labels, dtype=np.int64)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        path = self.paths[i]
        try:
            arr = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise DataError(f"{path}: cannot read cached array ({exc}); expected a .npy file") from exc
        x = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
        if self.transform is not None:
            x = self.transform(x)
        return x, int(self.labels[i])


@dataclass
class FederatedSource:
    """A dataset as medfl sees it: the manifest table and a dataset builder.

    Attributes:
        table: one row per sample, with at least ``label``.
        num_classes: number of classes.
        class_names: name of each class id.
        sample_shape: shape of one sample ``(C, H, W[, D])``.
        make_dataset: ``make_dataset(rows, train)`` builds a Dataset of ``rows`` (a subset of
            ``table``); ``train`` selects training-time transforms.
        description: free text for reports.
    """

    table: pd.DataFrame
    num_classes: int
    class_names: list[str]
    sample_shape: tuple[int, ...]
    make_dataset: Callable[[pd.DataFrame, bool], Dataset]
    description: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def in_channels(self) -> int:
        """Number of input channels."""
        return int(self.sample_shape[0])

    @property
    def spatial_dims(self) -> int:
        """2 for images, 3 for volumes."""
        return len(self.sample_shape) - 1


def read_manifest(path: str | Path, required: tuple[str, ...] = ("path", "label")) -> pd.DataFrame:
    """Read a manifest CSV and check its required columns.

    Raises:
        DataError: the file is missing, empty, or lacks a required column.
    """
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: manifest not found")
    try:
        table = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not a readable CSV manifest ({exc})") from exc
    missing = [c for c in required if c not in table.columns]
    if missing:
        raise DataError(
            f"{path}: missing column(s) {', '.join(missing)}; found {', '.join(map(str, table.columns))}"
        )
    if table.empty:
        raise DataError(f"{path}: manifest has no rows")
    if not pd.api.types.is_integer_dtype(table["label"]):
        raise DataError(f"{path}: column 'label' must hold integer class ids")
    table.attrs["prep_notes"] = _prep_notes(path)
    return table


def _prep_notes(manifest: Path) -> tuple[str, ...]:
    """The notes of the data_prep ``report.json`` beside a manifest (what the script chose or
    left empty, e.g. HAM10000's site from the Kaggle mirror's metadata), so that a refusal
    naming a column can give their cause; empty where there is no such report."""
    try:
        notes = json.loads((manifest.parent / "report.json").read_text(encoding="utf-8")).get("notes", [])
    except (OSError, ValueError, AttributeError):
        return ()
    return tuple(str(n) for n in notes) if isinstance(notes, list) else ()
