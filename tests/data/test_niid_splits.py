"""FedSDC's two non-IID splits: NIID-1 (``global_test_per_class`` rows of every class held
out, the rest Dirichlet) and NIID-2 (``class_sample``: a few classes and a few rows of each
per client, the rest is the global test set), on lesions of one to three images each."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from medfl.config import ConfigError, resolve_config
from medfl.data.partition import Partition, PartitionError, check_partition, class_sample, per_class_holdout
from medfl.data.source import DataError, FederatedSource
from medfl.engine.data import split_data

__all__: list[str] = []


def lesions(counts=(150, 125, 200, 100, 150, 750, 100), seed: int = 0) -> pd.DataFrame:
    """Rows of lesions with one to three images each; a lesion's images share its label."""
    rng = np.random.default_rng(seed)
    glab = rng.permutation(np.repeat(np.arange(len(counts)), counts))
    sizes = rng.choice([1, 1, 1, 2, 3], size=len(glab))
    return pd.DataFrame({"label": np.repeat(glab, sizes).astype(np.int64),
                         "subject_id": np.repeat([f"HAM_{i:07d}" for i in range(len(glab))], sizes)})


TABLE = lesions()


def _owner(parts: Partition, n: int) -> np.ndarray:
    owner = np.full(n, -1)
    for cid, pos in parts.items():
        owner[pos] = int(cid)
    return owner


def test_class_sample_draws_few_classes_and_few_rows_in_whole_lesions() -> None:
    parts = class_sample(TABLE, 5, 0)
    assert parts.rest == "global_test" and list(parts) == ["0", "1", "2", "3", "4"]
    check_partition(parts, TABLE, complete=False)
    labels = TABLE["label"].to_numpy()
    for pos in parts.values():
        counts = np.bincount(labels[pos], minlength=7)
        assert 5 <= (counts > 0).sum() <= 6
        # 20..60 rows per class, rounded up to the lesion that crosses the draw (<= 2 more)
        assert ((counts == 0) | ((counts >= 20) & (counts <= 62))).all(), counts
    owner = _owner(parts, len(TABLE))
    per_lesion = pd.Series(owner).groupby(TABLE["subject_id"]).nunique()
    assert (per_lesion == 1).all()  # no lesion straddles two clients or a client and the test set
    assert (owner == -1).sum() > len(TABLE) / 2  # the rest (the test set) is most of the data


def test_class_sample_is_seeded_and_takes_parameters() -> None:
    a, b, c = class_sample(TABLE, 4, 7), class_sample(TABLE, 4, 7), class_sample(TABLE, 4, 8)
    assert all(np.array_equal(a[k], b[k]) for k in a) and any(not np.array_equal(a[k], c[k]) for k in a)
    one = class_sample(TABLE, 3, 0, classes=2, per_class=[10, 10], group_column=None, rest=None)
    labels = TABLE["label"].to_numpy()
    assert one.rest is None
    for pos in one.values():
        counts = np.bincount(labels[pos], minlength=7)
        assert sorted(counts[counts > 0].tolist()) == [10, 10]


@pytest.mark.parametrize("params, message", [
    ({"classes": [6, 5]}, "classes must be \\[lo, hi\\] integers with 1 <= lo <= hi and hi <= 7"),
    ({"classes": 8}, "hi <= 7"),
    ({"per_class": [0, 3]}, "per_class must be"),
    ({"rest": "train"}, "rest must be 'global_test' or null"),
    ({"group_column": "patient"}, "group_column 'patient' is not a column"),
    ({"per_class": [400, 500]}, "impossible: 5 clients of 5-6 classes with at least 400 rows"),
])
def test_class_sample_refuses_bad_or_infeasible_requests(params, message) -> None:
    with pytest.raises(PartitionError, match=message):
        class_sample(TABLE, 5, 0, **params)


def test_per_class_holdout_takes_k_rows_of_every_class_in_whole_lesions() -> None:
    labels, groups = TABLE["label"].to_numpy(), TABLE["subject_id"].to_numpy()
    test = per_class_holdout(labels, groups, 30, 0)
    counts = np.bincount(labels[test], minlength=7)
    assert (counts >= 30).all() and (counts <= 32).all(), counts
    held = np.zeros(len(TABLE), bool)
    held[test] = True
    assert (pd.Series(held).groupby(groups).nunique() == 1).all()
    assert np.array_equal(test, per_class_holdout(labels, groups, 30, 0))
    assert not np.array_equal(test, per_class_holdout(labels, groups, 30, 1))
    exact = per_class_holdout(labels, None, 30, 0)  # single rows: exactly k
    assert np.bincount(labels[exact]).tolist() == [30] * 7


def test_per_class_holdout_refuses_a_class_it_would_empty() -> None:
    labels = np.array([0] * 40 + [1] * 10)
    with pytest.raises(PartitionError, match=r"leave no training rows for class\(es\) \{1: 10\}"):
        per_class_holdout(labels, None, 10, 0)


class _Source(FederatedSource):
    """The lesion table as a dataset (the split only reads the table)."""

    def __init__(self, table: pd.DataFrame) -> None:
        self.table = table.assign(sample_id=[f"s{i}" for i in range(len(table))])


def _cfg(**extra):
    base = {"num_clients": 5, "dataset": {"name": "synthetic2d"}, "client_split": {"train": 0.8, "test": 0.2}}
    return resolve_config({**base, **extra})


def test_split_data_niid1_holds_out_k_per_class_then_partitions_the_rest() -> None:
    cfg = _cfg(global_test_per_class=30, partition={"name": "dirichlet", "alpha": 5.0, "min_size": 10})
    data = split_data(_Source(TABLE), cfg)
    a = data.assignments
    test = a[a["role"] == "global_test"]
    assert (np.bincount(test["label"], minlength=7) >= 30).all()
    assert len(a) == len(TABLE) and a["row"].is_unique
    assert set(a.loc[a["role"] != "global_test", "client_id"]) == {"0", "1", "2", "3", "4"}


def test_split_data_niid2_sends_the_untaken_rows_to_the_global_test() -> None:
    cfg = _cfg(global_test_fraction=0.0, partition={"name": "class_sample"})
    a = split_data(_Source(TABLE), cfg).assignments
    assert len(a) == len(TABLE) and a["row"].is_unique  # every row is somewhere
    test_rows = set(a.loc[a["role"] == "global_test", "row"])
    assert len(test_rows) > len(TABLE) / 2  # the clients hold 5-6 classes x 20-60 rows each
    per_client = a[a["role"] != "global_test"].groupby("client_id")["label"].nunique()
    assert per_client.between(5, 6).all()
    subjects = TABLE["subject_id"].to_numpy()
    where = pd.Series(a.set_index("row")["client_id"].reindex(range(len(TABLE))).to_numpy())
    assert (where.groupby(subjects).nunique() == 1).all()


def test_global_test_per_class_is_checked() -> None:
    with pytest.raises(ConfigError, match="fl.global_test_per_class: expected null or a positive integer"):
        _cfg(global_test_per_class=0)
    official = TABLE.assign(split=np.where(np.arange(len(TABLE)) % 5 == 0, "test", "train"))
    with pytest.raises(DataError, match="has an official split.*use_official_split false"):
        split_data(_Source(official), _cfg(global_test_per_class=5))
    assert len(split_data(_Source(official), _cfg(global_test_per_class=5, use_official_split=False,
                                                  partition={"name": "iid"})).assignments) == len(TABLE)
