"""The coordinator's public dataset (``fl.public_dataset``): data no client ever reads.

Knowledge-distillation methods need unlabeled or labeled data on the coordinator side: a
public (proxy) set to distil models into (PFedCDP distils its cluster models into a student
on it; FedTPF reuses it). Any registered dataset plugin can serve, e.g. the ``manifest`` of
a prepared MIAS set while the clients hold CBIS-DDSM::

    "public_dataset": {"name": "manifest", "path": "data/mias_128/manifest.csv",
                       "spatial_size": [128, 128], "test_fraction": 0.2}

The set is split into ``train`` and ``test``: by its official ``split`` column when it has
one with ``test`` rows and ``use_official_split`` is true (``test`` rows are test, every
other row, ``val`` included, is train: as :func:`medfl.engine.data.split_data` treats a
dataset's official split), otherwise by a seeded draw of ``test_fraction`` of its groups
(``group_column``, one patient's images together), stratified by each group's largest label
(its worst finding, as :func:`medfl.prep.mias.subject_split` does for women).

The engine reaches it as ``federation.public``; a client never gets it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd
import torch
from torch.utils.data import DataLoader, Dataset

from medfl.config import DEFAULTS, PUBLIC_KEYS, ConfigError, check_public_dataset
from medfl.data.partition import stratified_split
from medfl.data.source import DataError, FederatedSource
from medfl.plugins import lookup
from medfl.seeding import derive_seed

__all__ = ["PUBLIC_KEYS", "SPLITS", "PublicData", "build_public_source", "check_compatible"]

#: The run's default grouping column: absent from a table, every row is its own group (as in
#: :func:`medfl.engine.data.split_data`); any other column named must exist.
DEFAULT_GROUP_COLUMN = DEFAULTS["group_column"]

#: The splits of a public dataset.
SPLITS = ("train", "test")


def build_public_source(spec: Mapping[str, Any]) -> FederatedSource:
    """The dataset a ``public_dataset`` spec names, built by its registered plugin from the
    spec's keys other than ``name`` and the reserved :data:`PUBLIC_KEYS`.

    Raises:
        PluginError: no dataset plugin of that name.
    """
    kwargs = {k: v for k, v in spec.items() if k != "name" and k not in PUBLIC_KEYS}
    return lookup("dataset", spec["name"])(**kwargs)


def _groups(table: pd.DataFrame, column: str | None) -> tuple[np.ndarray, str | None]:
    """Group key of each row and the column used (``None``: every row its own group).

    Rows with a blank key are their own group, as in :func:`medfl.engine.data.split_data`."""
    n = len(table)
    if column and column not in table.columns and column != DEFAULT_GROUP_COLUMN:
        raise DataError(f"fl.public_dataset.group_column: the public dataset has no column {column!r} "
                        f"(columns: {', '.join(map(str, table.columns))})")
    if column and column in table.columns:
        keys = table[column].astype(str).to_numpy()
        blank = pd.isna(table[column]).to_numpy() | (keys == "")
        return np.where(blank, np.char.add("row:", np.arange(n).astype(str)), keys), column
    return np.char.add("row:", np.arange(n).astype(str)), None


def _draw_test(labels: np.ndarray, groups: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """Boolean test mask: ``fraction`` of the groups, stratified by each group's largest
    label, whole groups only (groups in order of first appearance, so the draw depends on
    the table's order and ``seed`` alone)."""
    keys, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
    inverse = inverse.reshape(-1)
    order = np.argsort(first, kind="stable")  # group ids in order of first appearance
    worst = np.full(len(keys), np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(worst, inverse, labels.astype(np.int64))
    parts = stratified_split(worst[order], {"train": 1.0 - fraction, "test": fraction}, seed)
    chosen = np.zeros(len(keys), dtype=bool)
    chosen[order[parts["test"]]] = True
    return chosen[inverse]


class PublicData:
    """A dataset only the coordinator reads, split into ``train`` and ``test``.

    Args:
        source: the dataset (built by its plugin, :func:`build_public_source`).
        spec: its ``public_dataset`` spec: ``name``, the plugin parameters and the reserved
            keys (:data:`PUBLIC_KEYS`; missing ones take their defaults: ``test_fraction``
            0.15, ``use_official_split`` true, ``group_column`` ``"subject_id"``).
        seed: the run seed; the test draw is seeded by ``derive_seed(seed, "public")``.

    Attributes:
        source: the dataset.
        spec: the spec with every reserved key filled.
        name: the dataset plugin's name.
        seed: the run seed.
        official: whether the split is the table's own ``split`` column (else drawn).
        group_column: the column that grouped the draw (``None``: one group per row, also
            when the configured column is not in the table).

    Raises:
        ConfigError: a bad reserved value.
        DataError: a split would be empty; the message names the dataset and the counts.
    """

    def __init__(self, source: FederatedSource, spec: Mapping[str, Any] | str, seed: int = 0) -> None:
        checked = check_public_dataset(spec if isinstance(spec, str) else dict(spec))
        if checked is None:
            raise ConfigError("fl.public_dataset: PublicData needs a dataset spec, got None")
        self.source = source
        self.spec: dict[str, Any] = checked
        self.name: str = str(checked["name"])
        self.seed = int(seed)
        table = source.table
        labels = table["label"].to_numpy()
        groups, self.group_column = _groups(table, checked["group_column"])
        has_official = "split" in table.columns and bool((table["split"] == "test").any())
        self.official: bool = bool(checked["use_official_split"]) and has_official
        if self.official:
            is_test = (table["split"] == "test").to_numpy()
            how = "its official 'split' column ('test' rows are test, the rest train)"
        else:
            is_test = _draw_test(labels, groups, checked["test_fraction"], derive_seed(self.seed, "public"))
            how = (f"a draw of test_fraction {checked['test_fraction']} of its {len(np.unique(groups))} "
                   f"group(s) ({self.group_column or 'one per row'})")
        self._positions: dict[str, np.ndarray] = {
            "train": np.flatnonzero(~is_test).astype(np.int64),
            "test": np.flatnonzero(is_test).astype(np.int64),
        }
        empty = [s for s in SPLITS if not len(self._positions[s])]
        if empty:
            hint = ("set public_dataset.use_official_split false to draw the split" if self.official
                    else "use a larger public dataset (at least two groups) or another test_fraction")
            raise DataError(
                f"fl.public_dataset ({self.name}): the {' and '.join(empty)} split is empty "
                f"(train {self.size('train')} rows, test {self.size('test')} rows of {len(table)}; "
                f"split by {how}); {hint}")

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> PublicData | None:
        """The public dataset of a resolved ``fl`` config, or ``None`` when
        ``public_dataset`` is null (or absent).

        Raises:
            ConfigError: a bad ``public_dataset`` spec.
            DataError: what the dataset plugin raises, or an empty split.
        """
        spec = check_public_dataset(cfg.get("public_dataset"), dict(cfg))
        if spec is None:
            return None
        return cls(build_public_source(spec), spec, int(cfg.get("seed", 0)))

    # ------------------------------------------------------------------ the source

    @property
    def num_classes(self) -> int:
        """Number of classes of the dataset."""
        return int(self.source.num_classes)

    @property
    def class_names(self) -> list[str]:
        """Name of each class id."""
        return list(self.source.class_names)

    @property
    def sample_shape(self) -> tuple[int, ...]:
        """Shape of one sample ``(C, H, W[, D])``."""
        return tuple(int(s) for s in self.source.sample_shape)

    # ------------------------------------------------------------------ the splits

    def _check(self, split: str) -> None:
        if split not in self._positions:
            raise KeyError(f"public dataset {self.name!r} has no split {split!r}; has {', '.join(SPLITS)}")

    def positions(self, split: str) -> np.ndarray:
        """Positions in ``source.table`` of the rows of ``split`` (``train`` or ``test``), sorted."""
        self._check(split)
        return self._positions[split]

    def rows(self, split: str) -> pd.DataFrame:
        """The table rows of ``split``."""
        return self.source.table.iloc[self.positions(split)]

    def size(self, split: str) -> int:
        """Number of samples of ``split``."""
        return int(len(self.positions(split)))

    def labels(self, split: str) -> np.ndarray:
        """Labels of ``split``, ``int64`` of shape ``(N,)``, in row order."""
        return self.rows(split)["label"].to_numpy(dtype=np.int64)

    def dataset(self, split: str, augment: bool | None = None) -> Dataset:
        """A new dataset of ``split`` yielding ``(image (C, H, W[, D]), label)``.

        Args:
            split: ``train`` or ``test``.
            augment: apply the dataset's random training transforms; default: only for
                ``train`` (as a client's datasets). The transforms draw from numpy's global
                generator when the dataset is built, so seed it for a reproducible draw.
        """
        aug = split == "train" if augment is None else bool(augment)
        return self.source.make_dataset(self.rows(split), aug)

    def loader(self, split: str, *, batch_size: int, shuffle: bool | None = None, seed: int = 0,
               augment: bool | None = None, num_workers: int = 0) -> DataLoader:
        """A DataLoader over :meth:`dataset` of ``split``.

        Args:
            split: ``train`` or ``test``.
            batch_size: samples per batch.
            shuffle: default ``split == "train"``; the order is drawn from a generator seeded
                by ``derive_seed(seed, "public_loader", split)`` (pass e.g. a seed of the
                run seed and round for a different, reproducible order each round).
            seed: seed of the shuffle.
            augment: as in :meth:`dataset`.
            num_workers: DataLoader workers (default 0).
        """
        shuffle = split == "train" if shuffle is None else bool(shuffle)
        gen = torch.Generator().manual_seed(derive_seed(seed, "public_loader", split))
        return DataLoader(self.dataset(split, augment=augment), batch_size=int(batch_size), shuffle=shuffle,
                          generator=gen, num_workers=int(num_workers))

    def describe(self) -> dict[str, Any]:
        """A JSON-ready summary for ``config.json``/``summary.json``: the dataset, its sizes
        and label counts (one count per class id) per split, and how the split was made."""
        how: dict[str, Any] = {"method": "official", "column": "split"} if self.official else {
            "method": "drawn", "test_fraction": float(self.spec["test_fraction"]), "seed": self.seed,
            "derived_seed": derive_seed(self.seed, "public"), "stratified_by": "largest label of each group"}
        how["group_column"] = self.group_column
        params = {k: v for k, v in self.spec.items() if k != "name" and k not in PUBLIC_KEYS}
        return {
            "name": self.name,
            "params": params,
            "description": self.source.description,
            "num_classes": self.num_classes,
            "class_names": self.class_names,
            "sample_shape": list(self.sample_shape),
            "sizes": {s: self.size(s) for s in SPLITS},
            "label_counts": {s: np.bincount(self.labels(s), minlength=self.num_classes).astype(int).tolist()
                             for s in SPLITS},
            "split": how,
        }

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s} {self.size(s)}" for s in SPLITS)
        return f"PublicData({self.name!r}, {sizes}, {'official' if self.official else 'drawn'} split)"


def check_compatible(public: PublicData | FederatedSource, num_classes: int, sample_shape: Sequence[int],
                     where: str = "fl.public_dataset") -> None:
    """Check that the public dataset fits the federated dataset's models.

    Args:
        public: the public dataset (or any source with ``num_classes`` and ``sample_shape``).
        num_classes: the federated dataset's number of classes.
        sample_shape: the federated dataset's sample shape ``(C, H, W[, D])``.
        where: the key named in the message.

    Raises:
        ConfigError: the number of classes or the sample shape differ; the message names both.
    """
    name = getattr(public, "name", None) or getattr(public, "description", "") or "public dataset"
    pub_shape = tuple(int(s) for s in public.sample_shape)
    fed_shape = tuple(int(s) for s in sample_shape)
    if int(public.num_classes) != int(num_classes):
        raise ConfigError(
            f"{where} ({name}): the public dataset has {int(public.num_classes)} classes, the federated dataset "
            f"{int(num_classes)}; distilling on it needs one label space (prepare both with the same classes, "
            f"e.g. benign/malignant for both)")
    if pub_shape != fed_shape:
        if len(pub_shape) != len(fed_shape):
            hint = "one is 2D, the other 3D"
        elif pub_shape[0] != fed_shape[0]:
            hint = "their channel counts differ: prepare both with the same number of channels"
        else:
            hint = (f"give both the same spatial_size (dataset.spatial_size and public_dataset.spatial_size, "
                    f"e.g. {list(fed_shape[1:])})")
        raise ConfigError(
            f"{where} ({name}): the public dataset's samples have shape {pub_shape}, the federated dataset's "
            f"{fed_shape}; {hint}")
