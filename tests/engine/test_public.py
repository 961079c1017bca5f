"""The coordinator's public dataset (``fl.public_dataset``): config, splits, loaders."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch

from medfl.config import ConfigError, resolve_config
from medfl.data.source import DataError, FederatedSource
from medfl.public import PUBLIC_KEYS, PublicData, build_public_source, check_compatible


def _synthetic(tmp: Path, **extra: Any) -> dict[str, Any]:
    return {"name": "synthetic2d", "root": str(tmp / "data"), "num_samples": 40, "num_classes": 2,
            "image_size": 6, **extra}


def _manifest(tmp: Path, subjects: list[str], labels: list[int], split: list[str] | None = None,
              shape: tuple[int, ...] = (1, 4, 4)) -> Path:
    """A tiny manifest of .npy arrays with ``subject_id`` (and ``split``) columns."""
    (tmp / "arrays").mkdir(parents=True, exist_ok=True)
    rows = []
    for i, (s, y) in enumerate(zip(subjects, labels)):
        rel = f"arrays/s{i}.npy"
        np.save(tmp / rel, np.full(shape, float(i), dtype=np.float32))
        row = {"sample_id": f"s{i}", "path": rel, "label": y, "subject_id": s}
        if split is not None:
            row["split"] = split[i]
        rows.append(row)
    pd.DataFrame(rows).to_csv(tmp / "manifest.csv", index=False)
    return tmp / "manifest.csv"


def _grouped(tmp: Path, split: list[str] | None = None) -> Path:
    """30 subjects of 1-3 images each; a subject's labels are mixed (worst label decides)."""
    subjects, labels = [], []
    for s in range(30):
        for k in range(1 + s % 3):
            subjects.append(f"w{s:02d}")
            labels.append((s + k) % 3 if s % 5 else 0)
    return _manifest(tmp, subjects, labels, split)


def _public(tmp: Path, seed: int = 0, **spec: Any) -> PublicData:
    cfg = resolve_config({"seed": seed, "public_dataset": {"name": "manifest", "path": str(_grouped(tmp)),
                                                           **spec}})
    out = PublicData.from_config(cfg)
    assert out is not None
    return out


def test_null_is_none_and_default_is_null():
    cfg = resolve_config({})
    assert cfg["public_dataset"] is None
    assert PublicData.from_config(cfg) is None
    assert PublicData.from_config({"seed": 0}) is None


def test_resolve_fills_reserved_defaults_and_keeps_plugin_params(tmp_path):
    cfg = resolve_config({"use_official_split": False, "group_column": "patient_id",
                          "public_dataset": _synthetic(tmp_path)})
    spec = cfg["public_dataset"]
    assert spec["test_fraction"] == 0.15 and spec["use_official_split"] is False
    assert spec["group_column"] == "patient_id" and spec["num_samples"] == 40
    assert set(PUBLIC_KEYS) <= set(spec)
    assert resolve_config(cfg)["public_dataset"] == spec  # resolving twice changes nothing
    named = resolve_config({"public_dataset": "synthetic2d"})["public_dataset"]
    assert named == {"name": "synthetic2d", "test_fraction": 0.15, "use_official_split": True,
                     "group_column": "subject_id"}
    own = resolve_config({"public_dataset": {"name": "synthetic2d", "group_column": None,
                                             "use_official_split": False}})["public_dataset"]
    assert own["group_column"] is None and own["use_official_split"] is False


BAD_SPECS = [
    ({"name": "nosuchdata"}, "fl.public_dataset: unknown dataset 'nosuchdata'; valid datasets:"),
    ({"name": "synthetic2d", "test_fraction": 0}, "fl.public_dataset.test_fraction: expected a number in (0, 1)"),
    ({"name": "synthetic2d", "test_fraction": 1.0}, "fl.public_dataset.test_fraction"),
    ({"name": "synthetic2d", "test_fraction": "0.2"}, "fl.public_dataset.test_fraction"),
    ({"name": "synthetic2d", "test_fraction": True}, "fl.public_dataset.test_fraction"),
    ({"name": "synthetic2d", "use_official_split": "perhaps"}, "fl.public_dataset.use_official_split: expected true "
                                                               "or false"),
    ({"name": "synthetic2d", "bogus": 1}, "fl.public_dataset: dataset 'synthetic2d' takes no parameter(s) 'bogus'"),
    ({"name": "synthetic2d", "image_size": 0}, "fl.public_dataset.image_size: expected a positive integer"),
    ({"name": "synthetic2d", "group_column": 3}, "fl.public_dataset.group_column"),
    ({"root": "data"}, "fl.public_dataset: expected a name or a dict with a 'name' key"),
    (7, "fl.public_dataset: expected a name"),
]


@pytest.mark.parametrize("spec, message", BAD_SPECS)
def test_resolve_rejects_bad_specs_naming_the_key(spec, message):
    with pytest.raises(ConfigError) as err:
        resolve_config({"public_dataset": spec})
    assert message in str(err.value)


def test_drawn_split_follows_test_fraction_and_is_seeded(tmp_path):
    spec = _synthetic(tmp_path, group_column=None, test_fraction=0.25)
    cfg = resolve_config({"seed": 3, "public_dataset": spec})
    a, b = PublicData.from_config(cfg), PublicData.from_config(cfg)
    assert a is not None and b is not None and not a.official
    assert a.size("test") == 10 and a.size("train") == 30
    assert np.array_equal(a.positions("test"), b.positions("test"))
    assert np.array_equal(np.sort(np.concatenate([a.positions("train"), a.positions("test")])), np.arange(40))
    assert np.bincount(a.labels("test")).tolist() == [5, 5]  # stratified by label
    other = PublicData.from_config(resolve_config({"seed": 4, "public_dataset": spec}))
    assert other is not None and other.size("test") == 10
    assert not np.array_equal(a.positions("test"), other.positions("test"))
    small = PublicData(a.source, {**spec, "test_fraction": 0.1}, seed=3)
    assert small.size("test") == 4


def test_groups_never_straddle_and_are_stratified_by_worst_label(tmp_path):
    pub = _public(tmp_path, use_official_split=True)  # no split column: drawn
    assert not pub.official and pub.group_column == "subject_id"
    train, test = set(pub.rows("train")["subject_id"]), set(pub.rows("test")["subject_id"])
    assert train and test and not train & test
    table = pub.source.table
    worst = table.groupby("subject_id")["label"].max()
    test_worst = worst[sorted(test)].value_counts().to_dict()
    expected = {y: round(0.15 * n) for y, n in worst.value_counts().items()}
    assert sum(test_worst.values()) == round(0.15 * 30)
    assert all(abs(test_worst.get(y, 0) - k) <= 1 for y, k in expected.items())
    # a named column the table lacks is an error (a typo must not silently split images of one
    # patient); only the run's default subject_id may be absent (one group per row)
    with pytest.raises(DataError, match="group_column: the public dataset has no column 'no_such_column'"):
        _public(tmp_path / "b", group_column="no_such_column")


def test_official_split_is_honoured_or_ignored(tmp_path):
    split = ["test" if i % 4 == 0 else ("val" if i % 4 == 1 else "train") for i in range(12)]
    m = _manifest(tmp_path, [f"w{i}" for i in range(12)], [i % 2 for i in range(12)], split)
    spec = {"name": "manifest", "path": str(m)}
    pub = PublicData.from_config(resolve_config({"public_dataset": spec}))
    assert pub is not None and pub.official
    assert pub.positions("test").tolist() == [0, 4, 8]
    assert pub.size("train") == 9  # 'val' rows count as training, as split_data treats them
    assert pub.describe()["split"]["method"] == "official"
    drawn = PublicData.from_config(resolve_config({"public_dataset": {**spec, "use_official_split": False,
                                                                      "test_fraction": 0.5}}))
    assert drawn is not None and not drawn.official and drawn.size("test") == 6
    run_off = resolve_config({"use_official_split": False, "public_dataset": spec})
    assert not PublicData.from_config(run_off).official  # the run's setting is the default


def test_empty_split_is_a_clear_error(tmp_path):
    m = _manifest(tmp_path, ["w0"] * 4, [0, 1, 0, 1])  # one woman: no test draw possible
    with pytest.raises(DataError) as err:
        PublicData.from_config(resolve_config({"public_dataset": {"name": "manifest", "path": str(m)}}))
    msg = str(err.value)
    assert "fl.public_dataset (manifest)" in msg and "test split is empty" in msg and "train 4 rows, test 0" in msg
    m2 = _manifest(tmp_path / "b", ["a", "b"], [0, 1], ["test", "test"])
    with pytest.raises(DataError) as err:
        PublicData.from_config(resolve_config({"public_dataset": {"name": "manifest", "path": str(m2)}}))
    assert "train split is empty" in str(err.value) and "use_official_split false" in str(err.value)


def test_loader_yields_samples_and_labels(tmp_path):
    cfg = resolve_config({"public_dataset": _synthetic(tmp_path)})
    pub = PublicData.from_config(cfg)
    assert pub is not None
    assert pub.num_classes == 2 and pub.class_names == ["class_0", "class_1"] and pub.sample_shape == (1, 6, 6)
    batches = list(pub.loader("test", batch_size=4))
    assert sum(len(y) for _, y in batches) == pub.size("test")
    x, y = batches[0]
    assert x.dtype == torch.float32 and tuple(x.shape[1:]) == pub.sample_shape
    assert y.tolist() == pub.labels("test")[:4].tolist()  # test: not shuffled
    order = [torch.cat([y for _, y in pub.loader("train", batch_size=8, seed=s)]) for s in (1, 1, 2)]
    assert torch.equal(order[0], order[1]) and sorted(order[0].tolist()) == sorted(pub.labels("train").tolist())
    assert len(pub.dataset("train")) == pub.size("train")
    with pytest.raises(KeyError, match="no split 'val'"):
        pub.rows("val")


def test_describe_is_json_ready(tmp_path):
    pub = _public(tmp_path, seed=5, test_fraction=0.2)
    d = json.loads(json.dumps(pub.describe()))
    assert d["name"] == "manifest" and d["sizes"] == {"train": pub.size("train"), "test": pub.size("test")}
    assert [sum(c) for c in (d["label_counts"]["train"], d["label_counts"]["test"])] == [pub.size("train"),
                                                                                          pub.size("test")]
    assert d["split"]["method"] == "drawn" and d["split"]["test_fraction"] == 0.2 and d["split"]["seed"] == 5
    assert d["split"]["group_column"] == "subject_id" and "test_fraction" not in d["params"]


def test_build_public_source_drops_reserved_keys(tmp_path):
    src = build_public_source({**_synthetic(tmp_path), "test_fraction": 0.3, "use_official_split": False,
                               "group_column": None})
    assert isinstance(src, FederatedSource) and len(src.table) == 40


def test_check_compatible_names_both(tmp_path):
    pub = PublicData.from_config(resolve_config({"public_dataset": _synthetic(tmp_path)}))
    assert pub is not None
    check_compatible(pub, 2, (1, 6, 6))
    with pytest.raises(ConfigError) as err:
        check_compatible(pub, 2, (1, 8, 8), where="fl.public_dataset")
    msg = str(err.value)
    assert "(1, 6, 6)" in msg and "(1, 8, 8)" in msg and "spatial_size" in msg and "fl.public_dataset" in msg
    with pytest.raises(ConfigError, match="channel"):
        check_compatible(pub, 2, (3, 6, 6))
    with pytest.raises(ConfigError) as err:
        check_compatible(pub, 3, (1, 6, 6))
    assert "2 classes" in str(err.value) and "3" in str(err.value)
