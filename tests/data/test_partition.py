"""Tests for medfl.data.partition: client partitioners, saved tables and local splits."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import pandas as pd
import pytest

from medfl.data.partition import (
    PARTITIONERS,
    Partition,
    PartitionError,
    check_partition,
    class_counts,
    dirichlet,
    label_skew,
    natural,
    partition_from_table,
    partition_table,
    quantity_skew,
    stratified_split,
)

__all__: list[str] = []

NUM_ROWS = 600
NUM_CLASSES = 6
SITES = ["berlin", "boston", "lyon", "paris", "seattle"]
REGIONS = {"berlin": "EUROPE", "lyon": "EUROPE", "paris": "EUROPE",
           "boston": "AMERICA", "seattle": "AMERICA"}


def make_table(n: int = NUM_ROWS, num_classes: int = NUM_CLASSES, seed: int = 0) -> pd.DataFrame:
    """A manifest with imbalanced labels, a site column and sample ids."""
    rng = np.random.default_rng(seed)
    weights = np.arange(1, num_classes + 1, dtype=float)
    labels = rng.choice(num_classes, size=n, p=weights / weights.sum())
    labels[:num_classes] = np.arange(num_classes)  # every class present
    sites = rng.choice(SITES, size=n)
    return pd.DataFrame({
        "sample_id": [f"s{i:04d}" for i in range(n)],
        "label": labels.astype(np.int64),
        "site": sites,
    })


TABLE = make_table()

# (partitioner name, num_clients, params)
CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("dirichlet", 8, {"alpha": 0.5, "min_size": 5}),
    ("dirichlet", 4, {"alpha": 0.1, "min_size": 1, "balance": False}),
    ("label_skew", 8, {"k": 2}),
    ("label_skew", 9, {"k": 1, "allow_unassigned": False}),
    ("quantity_skew", 8, {"beta": 0.5, "min_size": 5}),
    ("iid", 7, {}),
    ("natural", 0, {"mapping": REGIONS}),
    ("natural", 5, {}),
]
SEEDED_CASES = [c for c in CASES if c[0] != "natural"]
SEEDED_NAMES = sorted({c[0] for c in SEEDED_CASES})


def _ids(case: tuple[str, int, dict[str, Any]]) -> str:
    name, k, params = case
    return f"{name}-{k}-" + ",".join(f"{a}={b if not isinstance(b, dict) else 'map'}"
                                     for a, b in params.items())


def _run(case: tuple[str, int, dict[str, Any]], seed: int = 0,
         table: pd.DataFrame = TABLE) -> Partition:
    name, num_clients, params = case
    return PARTITIONERS[name](table, num_clients, seed, **params)


def _assert_disjoint_complete(parts: dict[str, np.ndarray], n: int) -> None:
    allpos = np.concatenate(list(parts.values()))
    assert len(allpos) == n
    assert np.array_equal(np.sort(allpos), np.arange(n))


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return list(a) == list(b) and all(np.array_equal(a[c], b[c]) for c in a)


def _mean_label_entropy(table: pd.DataFrame, parts: Partition) -> float:
    counts = class_counts(table, parts).to_numpy(dtype=float)
    p = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        ent = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), axis=1)
    return float(ent.mean())


# ------------------------------------------------------------------ common properties


def test_registry_keys() -> None:
    assert set(PARTITIONERS) == {"dirichlet", "label_skew", "quantity_skew", "iid", "natural", "class_sample",
                                 "subset"}


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_disjoint_complete_and_well_formed(case: tuple[str, int, dict[str, Any]]) -> None:
    parts = _run(case)
    assert isinstance(parts, Partition)
    expected = case[1] or len(set(REGIONS.values()))
    assert list(parts) == [str(i) for i in range(expected)]
    for pos in parts.values():
        assert pos.dtype == np.int64
        assert np.all(np.diff(pos) > 0)
    _assert_disjoint_complete(parts, len(TABLE))
    assert set(parts.names) == set(parts)
    check_partition(parts, TABLE)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_deterministic(case: tuple[str, int, dict[str, Any]]) -> None:
    assert _same(_run(case, seed=3), _run(case, seed=3))


@pytest.mark.parametrize("case", SEEDED_CASES, ids=_ids)
def test_seed_changes_result(case: tuple[str, int, dict[str, Any]]) -> None:
    assert not _same(_run(case, seed=1), _run(case, seed=2))


@pytest.mark.parametrize("name", SEEDED_NAMES)
def test_default_names(name: str) -> None:
    parts = PARTITIONERS[name](TABLE, 3, 0)
    assert parts.names == {"0": "client_0", "1": "client_1", "2": "client_2"}


@pytest.mark.parametrize("name", SEEDED_NAMES)
@pytest.mark.parametrize("num_clients", [0, -1, 2.5, True, NUM_ROWS + 1])
def test_bad_num_clients(name: str, num_clients: Any) -> None:
    with pytest.raises(PartitionError, match="num_clients"):
        PARTITIONERS[name](TABLE, num_clients, 0)


@pytest.mark.parametrize("name", sorted(PARTITIONERS))
def test_missing_label_column(name: str) -> None:
    with pytest.raises(PartitionError, match="label"):
        PARTITIONERS[name](TABLE.drop(columns="label"), 2, 0)


@pytest.mark.parametrize("name", SEEDED_NAMES)
def test_bad_seed(name: str) -> None:
    with pytest.raises(PartitionError, match="seed"):
        PARTITIONERS[name](TABLE, 2, -1)


def test_partition_error_is_value_error() -> None:
    assert issubclass(PartitionError, ValueError)


# ------------------------------------------------------------------ dirichlet


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dirichlet_min_size(seed: int) -> None:
    parts = dirichlet(TABLE, 10, seed, alpha=0.3, min_size=20)
    assert min(parts.sizes().values()) >= 20


def test_dirichlet_small_alpha_more_skewed() -> None:
    low = np.mean([_mean_label_entropy(TABLE, dirichlet(TABLE, 6, s, alpha=0.1, min_size=1))
                   for s in range(5)])
    high = np.mean([_mean_label_entropy(TABLE, dirichlet(TABLE, 6, s, alpha=100.0))
                    for s in range(5)])
    assert low < high - 0.3


def test_dirichlet_impossible_raises_quickly() -> None:
    start = time.perf_counter()
    with pytest.raises(PartitionError, match="min_size") as info:
        dirichlet(TABLE, 10, 0, alpha=0.01, min_size=58, balance=False)
    assert time.perf_counter() - start < 2.0
    msg = str(info.value)
    assert "alpha" in msg and "smallest client size" in msg


def test_dirichlet_min_size_too_large_for_table() -> None:
    with pytest.raises(PartitionError, match="min_size"):
        dirichlet(TABLE, 10, 0, min_size=61, max_retries=10**9)


@pytest.mark.parametrize("params", [{"alpha": 0}, {"alpha": -1.0}, {"alpha": float("nan")},
                                    {"min_size": -1}, {"max_retries": 0}])
def test_dirichlet_bad_params(params: dict[str, Any]) -> None:
    with pytest.raises(PartitionError, match=next(iter(params))):
        dirichlet(TABLE, 4, 0, **params)


# ------------------------------------------------------------------ label_skew


@pytest.mark.parametrize(("num_clients", "k"), [(10, 3), (6, 2), (6, 1), (9, 1), (3, 2), (12, 6)])
def test_label_skew_exactly_k_labels(num_clients: int, k: int) -> None:
    parts = label_skew(TABLE, num_clients, 0, k=k)
    counts = class_counts(TABLE, parts)
    assert ((counts > 0).sum(axis=1) == k).all()
    if num_clients * k >= NUM_CLASSES:
        assert (counts.sum(axis=0) > 0).all()  # every label owned
    _assert_disjoint_complete(parts, len(TABLE))


def test_label_skew_even_split_within_label() -> None:
    parts = label_skew(TABLE, 12, 0, k=2)
    counts = class_counts(TABLE, parts).to_numpy()
    for col in counts.T:
        held = col[col > 0]
        assert held.max() - held.min() <= 1


@pytest.mark.parametrize("k", [0, -1, NUM_CLASSES + 1, 1.5])
def test_label_skew_bad_k(k: Any) -> None:
    with pytest.raises(PartitionError, match="k must"):
        label_skew(TABLE, 4, 0, k=k)


def test_label_skew_unassigned_labels() -> None:
    with pytest.raises(PartitionError, match="allow_unassigned"):
        label_skew(TABLE, 2, 0, k=2)
    parts = label_skew(TABLE, 2, 0, k=2, allow_unassigned=True)
    allpos = np.concatenate(list(parts.values()))
    assert len(np.unique(allpos)) == len(allpos)
    kept = np.unique(TABLE["label"].to_numpy()[allpos])
    assert len(kept) == 4
    dropped = ~TABLE["label"].isin(kept)
    assert len(allpos) == len(TABLE) - int(dropped.sum())


def test_label_skew_empty_client_raises() -> None:
    tiny = pd.DataFrame({"label": [0, 0, 0, 1]})
    with pytest.raises(PartitionError, match="no rows"):
        label_skew(tiny, 4, 0, k=1)  # label 1 has one row for two owners
    tiny = pd.DataFrame({"label": [0, 0, 1, 1, 1, 1]})
    parts = label_skew(tiny, 4, 0, k=1)
    _assert_disjoint_complete(parts, 6)


# ------------------------------------------------------------------ quantity_skew


def test_quantity_skew_sizes_vary_and_min_size() -> None:
    parts = quantity_skew(TABLE, 8, 0, beta=0.5, min_size=10)
    sizes = np.array(list(parts.sizes().values()))
    assert sizes.min() >= 10
    assert sizes.max() > 1.5 * sizes.min()
    assert sizes.sum() == len(TABLE)


def test_quantity_skew_impossible() -> None:
    with pytest.raises(PartitionError, match="min_size"):
        quantity_skew(TABLE, 10, 0, beta=0.01, min_size=59, max_retries=20)
    with pytest.raises(PartitionError, match="min_size"):
        quantity_skew(TABLE, 10, 0, min_size=61)
    with pytest.raises(PartitionError, match="beta"):
        quantity_skew(TABLE, 10, 0, beta=0)


def test_iid_equal_sizes() -> None:
    sizes = np.array(list(PARTITIONERS["iid"](TABLE, 7, 0).sizes().values()))
    assert sizes.max() - sizes.min() <= 1


# ------------------------------------------------------------------ natural


def test_natural_with_mapping() -> None:
    parts = natural(TABLE, 0, 0, column="site", mapping=REGIONS)
    assert list(parts) == ["0", "1"]
    assert parts.names == {"0": "AMERICA", "1": "EUROPE"}
    sites = TABLE["site"].to_numpy()
    assert set(sites[parts["0"]]) == {"boston", "seattle"}
    assert set(sites[parts["1"]]) == {"berlin", "lyon", "paris"}
    same = natural(TABLE, 2, 99, mapping=REGIONS)
    assert _same(parts, same) and same.names == parts.names
    assert _same(natural(TABLE, None, 0, mapping=REGIONS), parts)


def test_natural_without_mapping_sorted_by_name() -> None:
    parts = natural(TABLE, 5, 0)
    assert list(parts.names.values()) == sorted(SITES)


def test_natural_unknown_site() -> None:
    mapping = {k: v for k, v in REGIONS.items() if k not in ("lyon", "seattle")}
    with pytest.raises(PartitionError, match="mapping") as info:
        natural(TABLE, 0, 0, mapping=mapping)
    assert "lyon" in str(info.value) and "seattle" in str(info.value)


def test_natural_count_mismatch() -> None:
    with pytest.raises(PartitionError, match="num_clients=3") as info:
        natural(TABLE, 3, 0, mapping=REGIONS)
    msg = str(info.value)
    assert "2 groups" in msg and "EUROPE" in msg


def test_natural_missing_column() -> None:
    with pytest.raises(PartitionError, match="hospital"):
        natural(TABLE, 0, 0, column="hospital")


def test_natural_on_a_column_empty_in_every_row_says_why() -> None:
    """Issue 51, item 8: a site column empty in every row (a manifest prepared from metadata
    without sites) was "has N missing value(s)"; it says there is nothing to split by and what
    to do, or the data_prep note that explains it when the table carries one."""
    table = TABLE.assign(site=np.nan)
    with pytest.raises(PartitionError, match=r"'site' is empty in every row.*choose another partitioner"):
        natural(table, 0, 0)
    table.attrs["prep_notes"] = ("kept 600 rows", "meta.csv has no 'hospital' column: the manifest's site is empty")
    with pytest.raises(PartitionError, match=r"report.json says: meta.csv has no 'hospital' column: the manifest's site"):
        natural(table, 0, 0)


# ------------------------------------------------------------------ tables


@pytest.mark.parametrize("case", [CASES[0], CASES[6]], ids=_ids)
def test_partition_table_and_class_counts(case: tuple[str, int, dict[str, Any]]) -> None:
    parts = _run(case)
    saved = partition_table(TABLE, parts)
    assert list(saved.columns) == ["row", "client_id", "client_name", "label", "sample_id"]
    assert len(saved) == len(TABLE)
    assert sorted(saved["row"]) == list(range(len(TABLE)))
    assert np.array_equal(saved["label"].to_numpy(), TABLE["label"].to_numpy()[saved["row"]])
    assert dict(zip(saved["client_id"], saved["client_name"])) == parts.names
    back = partition_from_table(saved)
    assert _same(back, parts) and back.names == parts.names

    counts = class_counts(TABLE, parts)
    assert list(counts.index) == list(parts)
    assert list(counts.columns) == list(range(NUM_CLASSES))
    assert int(counts.to_numpy().sum()) == len(TABLE)
    assert np.array_equal(counts.sum(axis=0).to_numpy(),
                          TABLE["label"].value_counts().sort_index().to_numpy())
    assert np.array_equal(counts.sum(axis=1).to_numpy(),
                          np.array([len(p) for p in parts.values()]))


def test_partition_table_without_sample_id() -> None:
    table = TABLE[["label"]]
    saved = partition_table(table, PARTITIONERS["iid"](table, 3, 0))
    assert list(saved.columns) == ["row", "client_id", "client_name", "label"]


def test_check_partition_detects_overlap_and_gaps() -> None:
    with pytest.raises(PartitionError, match="more than one"):
        check_partition({"0": np.array([0, 1]), "1": np.array([1, 2])}, 3)
    with pytest.raises(PartitionError, match="no client"):
        check_partition({"0": np.array([0])}, 3)
    with pytest.raises(PartitionError, match="range|lie in"):
        check_partition({"0": np.array([0, 5])}, 3)
    assert check_partition({"0": [2, 0]}, 3, complete=False)["0"].tolist() == [0, 2]


# ------------------------------------------------------------------ stratified_split

FRACTIONS = {"train": 0.7, "val": 0.15, "test": 0.15}


@pytest.mark.parametrize("seed", [0, 1])
def test_stratified_split_proportions(seed: int) -> None:
    labels = TABLE["label"].to_numpy()
    split = stratified_split(labels, FRACTIONS, seed)
    assert list(split) == list(FRACTIONS)
    _assert_disjoint_complete(split, len(labels))
    for name, frac in FRACTIONS.items():
        assert abs(len(split[name]) - frac * len(labels)) <= 1
        for cls in range(NUM_CLASSES):
            n_cls = int((labels == cls).sum())
            got = int((labels[split[name]] == cls).sum())
            assert abs(got - frac * n_cls) < 1
    assert _same(split, stratified_split(labels, FRACTIONS, seed))
    assert not _same(split, stratified_split(labels, FRACTIONS, seed + 10))


def test_stratified_split_small_parts_non_empty() -> None:
    labels = np.array([0, 1, 2, 3])
    split = stratified_split(labels, FRACTIONS, 0)
    assert all(len(p) >= 1 for p in split.values())
    _assert_disjoint_complete(split, 4)
    split = stratified_split(np.zeros(3, dtype=int), FRACTIONS, 0)
    assert [len(p) for p in split.values()] == [1, 1, 1]


def test_stratified_split_totals_track_fractions_over_many_small_classes() -> None:
    labels = np.arange(40)  # 40 singleton classes
    sizes = [len(p) for p in stratified_split(labels, FRACTIONS, 0).values()]
    assert abs(sizes[0] - 28) <= 1 and abs(sizes[1] - 6) <= 1 and abs(sizes[2] - 6) <= 1


def test_stratified_split_zero_fraction_and_errors() -> None:
    labels = TABLE["label"].to_numpy()
    split = stratified_split(labels, {"train": 0.8, "val": 0.0, "test": 0.2}, 0)
    assert len(split["val"]) == 0
    with pytest.raises(PartitionError, match="sum to 1"):
        stratified_split(labels, {"train": 0.7, "test": 0.2}, 0)
    with pytest.raises(PartitionError, match="fractions"):
        stratified_split(labels, {"train": 1.2, "test": -0.2}, 0)
    with pytest.raises(PartitionError, match="fractions"):
        stratified_split(labels, {}, 0)
    empty = stratified_split(np.array([], dtype=int), FRACTIONS, 0)
    assert all(len(p) == 0 for p in empty.values())


def test_grouped_stratified_split_keeps_groups_whole():
    from medfl.data.partition import grouped_stratified_split

    rng = np.random.default_rng(0)
    groups = np.repeat(np.arange(40), rng.integers(1, 4, 40))
    labels = (groups % 3 == 0).astype(int)
    parts = grouped_stratified_split(labels, groups, {"train": 0.6, "val": 0.2, "test": 0.2}, seed=4)
    allpos = np.concatenate(list(parts.values()))
    assert sorted(allpos.tolist()) == list(range(len(labels)))  # disjoint and complete
    owner = {}
    for name, pos in parts.items():
        for g in set(groups[pos].tolist()):
            assert owner.setdefault(g, name) == name  # a group never straddles two parts
    ng = {n: len(set(groups[p].tolist())) for n, p in parts.items()}
    assert ng == {"train": 24, "val": 8, "test": 8}
    # every group a single row: exactly the row-level stratified split
    lab = rng.integers(0, 2, 30)
    one = grouped_stratified_split(lab, np.arange(30), {"a": 0.5, "b": 0.5}, seed=1)
    ref = stratified_split(lab, {"a": 0.5, "b": 0.5}, seed=1)
    assert all(np.array_equal(one[k], ref[k]) for k in ref)
    with pytest.raises(PartitionError, match="one group per row"):
        grouped_stratified_split(lab, np.arange(29), {"a": 1.0}, seed=0)


def test_split_data_keeps_a_subject_in_one_local_split(tiny_fl, resolve, tmp_path):
    import pandas as pd

    from medfl.data.source import FederatedSource
    from medfl.engine.data import split_data

    n = 120
    table = pd.DataFrame({"label": np.arange(n) % 2, "subject_id": [f"p{i // 3}" for i in range(n)],
                          "sample_id": [f"s{i}" for i in range(n)]})
    src = FederatedSource(table=table, num_classes=2, class_names=["a", "b"], sample_shape=(1, 4, 4),
                          make_dataset=lambda rows, train: None)
    cfg = resolve({**tiny_fl, "partition": {"name": "iid"}, "num_clients": 2})
    a = split_data(src, cfg).assignments
    a["subject"] = table["subject_id"].to_numpy()[a["row"].to_numpy()]
    # each client's local split keeps a subject's rows in one role, and the cross-client
    # partitioner (iid here) deals whole subjects, so a subject is at one client in one role
    for (cid, subject), g in a.groupby(["client_id", "subject"]):
        assert g["role"].nunique() == 1, (cid, subject)
    clients = a[a["role"] != "global_test"].groupby("subject")["client_id"].nunique()
    assert (clients == 1).all()
    # the global hold-out takes whole subjects
    held = set(a.loc[a["role"] == "global_test", "subject"])
    assert held and not held & set(a.loc[a["role"] != "global_test", "subject"])
