"""Patient-level grouping in every partitioner (issue 37 item 5): grouped partitions never
split a subject; ``group_column=None`` deals rows exactly as before; one row per subject is
the row-level draw; blank subjects are groups of one; ``min_size`` counts rows; and a run on
the HAM10000 fixture (lesions of one to three images) keeps every lesion at one client, in
one of its splits or in the global test, and says so in ``partition_report.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from medfl.config import resolve_config
from medfl.data.partition import PARTITIONERS, Partition, PartitionError, check_partition
from medfl.data.source import FederatedSource
from medfl.engine.data import REPORT_NAME, split_data, warn_straddling

__all__: list[str] = []

SITES = ["berlin", "boston", "lyon", "paris"]


def subjects(num_subjects: int = 240, seed: int = 0) -> pd.DataFrame:
    """Subjects of one to four rows (one label each, but every tenth subject has a second
    label on its last row, as a patient with a benign and a malignant finding), at one site
    each (but every seventh subject has a row at a second site)."""
    rng = np.random.default_rng(seed)
    glab = rng.choice(5, size=num_subjects, p=[0.1, 0.15, 0.2, 0.25, 0.3])
    glab[:5] = np.arange(5)
    sizes = rng.choice([1, 1, 2, 2, 3, 4], size=num_subjects)
    sid = np.repeat(np.arange(num_subjects), sizes)
    labels = glab[sid].copy()
    sites = np.asarray(SITES)[rng.integers(len(SITES), size=num_subjects)][sid]
    last = np.r_[np.flatnonzero(np.diff(sid)), len(sid) - 1]
    for g in range(0, num_subjects, 10):
        if sizes[g] > 1:
            labels[last[g]] = (glab[g] + 1) % 5
    for g in range(3, num_subjects, 7):
        if sizes[g] > 1:
            sites[last[g]] = SITES[(SITES.index(sites[last[g]]) + 1) % len(SITES)]
    # subject ids in a shuffled order, so group numbering cannot follow row order by luck
    names = np.asarray([f"P{v:05d}" for v in rng.permutation(num_subjects)])
    return pd.DataFrame({"sample_id": [f"s{i:04d}" for i in range(len(sid))], "label": labels.astype(np.int64),
                         "site": sites, "subject_id": names[sid]})


TABLE = subjects()

# (partitioner, num_clients, params): every built-in partitioner, seeded
CASES: list[tuple[str, int, dict[str, Any]]] = [
    ("dirichlet", 5, {"alpha": 0.5, "min_size": 10}),
    ("dirichlet", 4, {"alpha": 0.1, "min_size": 1, "balance": False}),
    ("label_skew", 5, {"k": 2}),
    ("label_skew", 2, {"k": 1, "allow_unassigned": True}),
    ("quantity_skew", 6, {"beta": 0.5, "min_size": 5}),
    ("iid", 7, {}),
    ("subset", 5, {"share": 0.8}),
    ("natural", 0, {}),
    ("natural", 0, {"mapping": {"berlin": "EU", "lyon": "EU", "paris": "EU", "boston": "US"}}),
    ("class_sample", 4, {"classes": [2, 3], "per_class": [5, 15]}),
]
SEEDS = [0, 1, 2]


def _ids(case: tuple[str, int, dict[str, Any]]) -> str:
    name, k, params = case
    return f"{name}-{k}-" + ",".join(f"{a}={'map' if isinstance(b, dict) else b}" for a, b in params.items())


def _run(case: tuple[str, int, dict[str, Any]], table: pd.DataFrame, seed: int, **extra: Any) -> Partition:
    name, num_clients, params = case
    return PARTITIONERS[name](table, num_clients, seed, **params, **extra)


def _owner(parts: Partition, n: int) -> np.ndarray:
    """Client of each row (-1: unassigned, e.g. class_sample's global test rows)."""
    owner = np.full(n, -1)
    for cid, pos in parts.items():
        owner[pos] = int(cid)
    return owner


def _split_subjects(owner: np.ndarray, subject: pd.Series) -> int:
    """Number of subjects whose rows have more than one owner (blank subjects left out)."""
    known = subject.notna().to_numpy()
    return int((pd.Series(owner[known]).groupby(subject[known].to_numpy()).nunique() > 1).sum())


def _same(a: Partition, b: Partition) -> bool:
    return list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a) and a.names == b.names


def test_the_table_has_what_the_tests_need() -> None:
    per = TABLE.groupby("subject_id")
    assert (per.size() > 1).sum() > 100 and (per["label"].nunique() > 1).sum() >= 5
    assert (per["site"].nunique() > 1).sum() >= 5


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_grouped_partitions_never_split_a_subject(case: tuple[str, int, dict[str, Any]], seed: int) -> None:
    parts = _run(case, TABLE, seed)
    complete = case[0] != "class_sample" and not case[2].get("allow_unassigned")
    check_partition(parts, TABLE, complete=complete)
    assert all(len(pos) for pos in parts.values())
    assert _split_subjects(_owner(parts, len(TABLE)), TABLE["subject_id"]) == 0
    # the same call, dealing rows (group_column=None), does split subjects: grouping is real
    rows = _run(case, TABLE, seed, group_column=None)
    assert _split_subjects(_owner(rows, len(TABLE)), TABLE["subject_id"]) > 0


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_opt_out_is_the_row_level_partition(case: tuple[str, int, dict[str, Any]]) -> None:
    """group_column=None on a table with subjects is what the partitioner does on the table
    without the column (today's draw, pinned by tests/data/test_partition.py)."""
    for seed in SEEDS:
        assert _same(_run(case, TABLE, seed, group_column=None),
                     _run(case, TABLE.drop(columns="subject_id"), seed))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_one_row_per_subject_is_the_row_level_draw(case: tuple[str, int, dict[str, Any]]) -> None:
    """ABIDE, Derm7pt, MedMNIST: one row per subject_id; the ids sort in another order than
    the rows, and still the grouped draw is the row-level one."""
    single = TABLE.assign(subject_id=[f"S{(i * 7919) % len(TABLE):05d}" for i in range(len(TABLE))])
    for seed in SEEDS:
        assert _same(_run(case, single, seed), _run(case, single, seed, group_column=None))


def test_a_custom_group_column_and_the_default_one_missing() -> None:
    renamed = TABLE.rename(columns={"subject_id": "lesion_id"})
    parts = PARTITIONERS["iid"](renamed, 4, 0, group_column="lesion_id")
    assert _split_subjects(_owner(parts, len(TABLE)), renamed["lesion_id"]) == 0
    # the default column absent: rows, as before grouping existed
    assert _same(PARTITIONERS["iid"](renamed, 4, 0), PARTITIONERS["iid"](renamed, 4, 0, group_column=None))


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_blank_subjects_are_groups_of_one_row(case: tuple[str, int, dict[str, Any]]) -> None:
    """A NaN or empty subject id never merges its rows into one giant group: each such row
    is dealt on its own (30% of the rows here), the named subjects stay whole."""
    blank = np.random.default_rng(5).random(len(TABLE)) < 0.3
    sid = TABLE["subject_id"].to_numpy(dtype=object).copy()
    sid[blank] = np.nan
    sid[np.flatnonzero(blank)[::2]] = ""
    parts = _run(case, TABLE.assign(subject_id=sid), 0)
    owner = _owner(parts, len(TABLE))
    assert _split_subjects(owner, pd.Series(sid).replace("", np.nan)) == 0
    if case[0] in ("iid", "quantity_skew", "natural"):   # blank rows land at several clients
        assert len(set(owner[blank].tolist()) - {-1}) > 1


@pytest.mark.parametrize("name,params", [("dirichlet", {"alpha": 0.3}), ("quantity_skew", {"beta": 0.3})])
def test_min_size_counts_rows(name: str, params: dict[str, Any]) -> None:
    """A client's rows, not its subjects, must reach min_size; one subject of 60 rows makes
    the client that draws it large, not a single-subject client too small."""
    big = pd.DataFrame({"label": [0] * 60, "site": "berlin", "subject_id": "BIG",
                        "sample_id": [f"b{i}" for i in range(60)]})
    table = pd.concat([TABLE, big], ignore_index=True)
    for seed in SEEDS:
        parts = PARTITIONERS[name](table, 4, seed, min_size=40, **params)
        assert min(parts.sizes().values()) >= 40
        assert _split_subjects(_owner(parts, len(table)), table["subject_id"]) == 0
    with pytest.raises(PartitionError, match=rf"min_size=200 .* needs 800 rows but the table has {len(table)}"):
        PARTITIONERS[name](table, 4, 0, min_size=200, **params)


def test_iid_sizes_stay_within_a_subject_of_even() -> None:
    for seed in SEEDS:
        sizes = np.asarray(list(PARTITIONERS["iid"](TABLE, 7, seed).sizes().values()))
        assert sizes.max() - sizes.min() <= 2 * TABLE.groupby("subject_id").size().max()


def test_dirichlet_keeps_its_label_skew_when_grouped() -> None:
    """Grouping moves a client's share of a class by at most half a subject per cut: the
    label-distribution skew of a small alpha survives (most clients dominated by few labels)."""
    grouped = PARTITIONERS["dirichlet"](TABLE, 4, 0, alpha=0.1, min_size=1, balance=False)
    labels = TABLE["label"].to_numpy()
    top = [np.bincount(labels[pos], minlength=5).max() / len(pos) for pos in grouped.values()]
    assert np.mean(top) > 0.5


BAD: list[tuple[str, dict[str, Any], str]] = [
    ("iid", {"group_column": 3}, "iid: group_column must be a column name .str. or null"),
    ("dirichlet", {"group_column": "patient"}, "dirichlet: group_column 'patient' is not a column of the table"),
    ("label_skew", {"group_column": ["subject_id"]}, "label_skew: group_column must be a column name"),
    ("natural", {"group_column": "patient"}, "natural: group_column 'patient' is not a column"),
]


@pytest.mark.parametrize("name,params,message", BAD, ids=[b[0] + "-" + str(b[1]) for b in BAD])
def test_a_bad_group_column_is_one_clear_error(name: str, params: dict[str, Any], message: str) -> None:
    with pytest.raises(PartitionError, match=message):
        PARTITIONERS[name](TABLE, 0 if name == "natural" else 3, 0, **params)


def test_more_clients_than_subjects_is_an_error_naming_the_groups() -> None:
    table = pd.DataFrame({"label": [0, 1] * 6, "subject_id": [f"p{i // 4}" for i in range(12)]})
    with pytest.raises(PartitionError, match=r"num_clients=4 is more than the number of subject_id groups \(3, in 12"
                                             r" rows\).*group_column null"):
        PARTITIONERS["iid"](table, 4, 0)
    assert len(PARTITIONERS["iid"](table, 4, 0, group_column=None)) == 4


# --------------------------------------------------------------------------- split_data and a run


def _source(table: pd.DataFrame) -> FederatedSource:
    return FederatedSource(table=table, num_classes=5, class_names=list("abcde"), sample_shape=(1, 4, 4),
                           make_dataset=lambda rows, train: None)


def _where(table: pd.DataFrame, a: pd.DataFrame) -> pd.DataFrame:
    """The assignments with each row's subject; ``side`` is the client (or "global test")."""
    a = a.assign(subject=table["subject_id"].to_numpy()[a["row"].to_numpy()])
    return a.assign(side=np.where(a["role"] == "global_test", "global test", a["client_id"].astype(str)))


SPLIT_CASES = [{"name": "dirichlet", "alpha": 0.5, "min_size": 10}, {"name": "iid"}, {"name": "label_skew", "k": 2},
               {"name": "quantity_skew", "min_size": 5}, {"name": "subset", "share": 0.8}, {"name": "natural"},
               {"name": "class_sample", "classes": [2, 3], "per_class": [5, 15]}]
#: clients of the runs of SPLIT_CASES (natural: one per site; subset: one per class), else 3
CLIENTS = {"natural": len(SITES), "subset": 5}


@pytest.mark.parametrize("partition", SPLIT_CASES, ids=[p["name"] for p in SPLIT_CASES])
def test_split_data_keeps_a_subject_on_one_side_everywhere(partition: dict[str, Any]) -> None:
    """No subject is at two clients, at a client and in the global test, or in two of a
    client's splits; the report says so. With group_column null the report counts them."""
    cfg = resolve_config({"num_clients": CLIENTS.get(partition["name"], 3), "partition": partition,
                          "eval_splits": ["test", "cross_test"]})
    data = split_data(_source(TABLE), cfg)
    a = _where(TABLE, data.assignments)
    assert (a.groupby("subject")["side"].nunique() == 1).all()
    assert (a.groupby("subject")["role"].nunique() == 1).all()
    report = data.report
    assert report is not None and report["grouped"] and report["grouped_by"] == "subject_id"
    assert report["straddling"] == {"clients": 0, "client_and_global_test": 0, "client_splits": 0}
    assert f"{partition['name']}: grouped by subject_id" in report["summary"]
    at = a[a["role"] != "global_test"]
    assert {c: v["groups"] for c, v in report["clients"].items()} == at.groupby("client_id")["subject"].nunique().to_dict()

    opted = split_data(_source(TABLE), {**cfg, "group_column": None})
    assert opted.report is not None and not opted.report["grouped"] and opted.report["checked_column"] == "subject_id"
    b = _where(TABLE, opted.assignments)
    assert opted.report["straddling"]["clients"] == int((b[b["role"] != "global_test"].groupby("subject")["client_id"]
                                                         .nunique() > 1).sum()) > 0
    assert "rows dealt one by one (group_column null)" in opted.report["summary"]


@pytest.mark.parametrize("extra", [{"global_test_per_class": 5}, {"cv": {"folds": 3}}], ids=["per_class", "cv"])
def test_held_out_per_class_and_cv_folds_keep_subjects_whole(extra: dict[str, Any]) -> None:
    cfg = resolve_config({"num_clients": 3, "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 10}, **extra})
    for fold in ([None] if "cv" not in extra else [0, 1, 2]):
        data = split_data(_source(TABLE), cfg, fold=fold)
        a = _where(TABLE, data.assignments)
        assert (a.groupby("subject")["side"].nunique() == 1).all() and (a.groupby("subject")["role"].nunique() == 1).all()
        assert data.report is not None and not any(data.report["straddling"].values())


def test_the_opted_out_run_is_warned(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = resolve_config({"num_clients": 3, "partition": {"name": "iid"}, "group_column": None})
    warn_straddling(split_data(_source(TABLE), cfg).report)
    err = capsys.readouterr().err
    assert err.startswith("medfl partition: warning: iid: rows dealt one by one (group_column null)")
    assert "subject_id group(s) straddle two or more clients" in err
    assert "fl.group_column 'subject_id' keeps a subject's rows together" in err
    warn_straddling(split_data(_source(TABLE), {**cfg, "group_column": "subject_id"}).report, "seed_0")
    assert capsys.readouterr().err.startswith("medfl [seed_0] partition: iid: grouped by subject_id:")


def test_opt_out_leaves_split_data_as_it_was() -> None:
    """group_column null on a table with subjects assigns exactly what the same table
    without the column gets (today's split)."""
    for partition in SPLIT_CASES:
        cfg = resolve_config({"num_clients": CLIENTS.get(partition["name"], 3), "partition": partition,
                              "group_column": None})
        a = split_data(_source(TABLE), cfg).assignments
        b = split_data(_source(TABLE.drop(columns="subject_id")), cfg).assignments
        assert a.equals(b), partition["name"]


@pytest.fixture(scope="module")
def ham(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The HAM10000 fixture (lesions of one to three images, lesion_id as subject_id),
    prepared at 16 x 16."""
    from medfl.fixtures import generate
    from medfl.prep.ham10000 import main as prep

    root = tmp_path_factory.mktemp("ham")
    generate("ham10000", root / "raw", cases=140, seed=0, reference=False)
    assert prep(["--raw", str(root / "raw"), "--out", str(root / "data"), "--size", "16"]) == 0
    return root / "data" / "manifest.csv"


def test_a_run_keeps_every_lesion_on_one_side(ham: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from medfl.experiment import run_experiment

    manifest = pd.read_csv(ham)
    assert (manifest.groupby("subject_id").size() > 1).sum() > 20   # lesions with several images
    cfg = resolve_config({
        "name": "grouped", "output_dir": str(tmp_path / "runs"), "seed": 0, "rounds": 1, "num_clients": 3,
        "progress": False, "plots": False,
        "dataset": {"name": "manifest", "path": str(ham), "num_classes": 7, "spatial_size": [16, 16]},
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": 5},
        "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8},
        "eval_splits": ["test", "global_test", "cross_test"], "methods": [{"name": "fedavg"}],
    })
    out = Path(run_experiment(cfg)["dir"])
    assert "medfl partition: dirichlet: grouped by subject_id:" in capsys.readouterr().err
    for folder in (out, out / "fedavg"):
        part = pd.read_csv(folder / "partition.csv", dtype={"client_id": str}, keep_default_na=False)
        a = _where(manifest, part)
        assert (a.groupby("subject")["side"].nunique() == 1).all()   # clients and the global test
        assert (a.groupby("subject")["role"].nunique() == 1).all()   # a client's train/val/test
        report = json.loads((folder / REPORT_NAME).read_text())
        assert report["grouped_by"] == "subject_id" and "grouped by subject_id" in report["summary"]
        assert report["straddling"] == {"clients": 0, "client_and_global_test": 0, "client_splits": 0}
        assert report["groups"] == manifest["subject_id"].nunique()
        assert sum(c["rows"] for c in report["clients"].values()) + report["global_test"]["rows"] == len(manifest)
    # a resume reads the report written with the partition; one saved before reports has none
    from medfl.engine.runner import build_source

    source = build_source(cfg["dataset"])
    assert split_data(source, cfg, saved=out / "partition.csv").report == json.loads((out / REPORT_NAME).read_text())
    (out / REPORT_NAME).unlink()
    assert split_data(source, cfg, saved=out / "partition.csv").report is None
    # the old dealing (rows one by one) splits lesions across clients on this very data
    old = split_data(_source(manifest), {**cfg, "group_column": None})
    assert old.report is not None and old.report["straddling"]["clients"] > 0
