"""The ``manifest`` dataset: MONAI transforms, caching, and one clear error per bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from medfl.data.manifest import manifest_source
from medfl.data.source import DataError


def _write(tmp: Path, n: int = 6, shape=(1, 8, 10)) -> Path:
    rng = np.random.default_rng(0)
    (tmp / "arrays").mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(n):
        rel = f"arrays/s{i}.npy"
        np.save(tmp / rel, (rng.normal(size=shape) * 5 + 10).astype(np.float32))
        rows.append({"sample_id": f"s{i}", "path": rel, "label": i % 2, "class_name": ["neg", "pos"][i % 2],
                     "split": "test" if i == 0 else "train"})
    pd.DataFrame(rows).to_csv(tmp / "manifest.csv", index=False)
    return tmp / "manifest.csv"


def test_arrays_normalised_resized_and_labelled(tmp_path):
    m = _write(tmp_path)
    src = manifest_source(str(m), normalize="zscore", spatial_size=[4, 6])
    assert src.sample_shape == (1, 4, 6) and src.class_names == ["neg", "pos"] and src.num_classes == 2
    ds = src.make_dataset(src.table, False)
    x, y = ds[1]
    assert x.dtype == torch.float32 and x.shape == (1, 4, 6) and y == 1
    raw = torch.from_numpy(np.load(tmp_path / "arrays" / "s1.npy"))
    z = (raw - raw.mean()) / raw.std(unbiased=False)
    ref = torch.nn.functional.interpolate(z[None], size=(4, 6), mode="area")[0]
    assert torch.allclose(x, ref, atol=1e-5)
    assert list(ds.labels) == [0, 1, 0, 1, 0, 1]
    mm = manifest_source(str(m), normalize="minmax").make_dataset(src.table, False)[2][0]
    assert float(mm.min()) == pytest.approx(0.0) and float(mm.max()) == pytest.approx(1.0)


def test_augmentation_only_for_training_and_seeded(tmp_path):
    m = _write(tmp_path)
    src = manifest_source(str(m), augment={"flip": [0, 1], "intensity": 0.2, "noise": 0.1})
    plain = src.make_dataset(src.table, False)[3][0]
    assert torch.equal(plain, torch.from_numpy(np.load(tmp_path / "arrays" / "s3.npy")))

    def draw() -> list[torch.Tensor]:
        np.random.seed(7)  # the engine seeds numpy per client and round
        ds = src.make_dataset(src.table, True)
        return [ds[i][0] for i in range(len(ds))]

    a, b = draw(), draw()
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    assert any(not torch.equal(u, src.make_dataset(src.table, False)[i][0]) for i, u in enumerate(a))


def test_memory_cache_is_shared_and_disk_cache_persists(tmp_path):
    m = _write(tmp_path)
    src = manifest_source(str(m), cache="memory", normalize="zscore")
    first = src.make_dataset(src.table.iloc[:3], False)
    x0 = first[0][0]
    (tmp_path / "arrays" / "s0.npy").unlink()  # a second dataset of the source reads the cache
    again = src.make_dataset(src.table.iloc[:1], False)
    assert torch.equal(again[0][0], x0)
    m2 = _write(tmp_path / "d")
    disk = manifest_source(str(m2), cache="disk", cache_dir=str(tmp_path / "cache"), spatial_size=[4, 5])
    ds = disk.make_dataset(disk.table, False)
    xs = [ds[i][0] for i in range(len(ds))]
    assert len(list((tmp_path / "cache").glob("*.pt"))) == len(ds)
    for f in (tmp_path / "d" / "arrays").glob("*.npy"):
        f.unlink()  # the disk cache holds the loaded, resized arrays themselves
    ds2 = disk.make_dataset(disk.table, False)
    assert all(torch.equal(ds2[i][0], xs[i]) for i in range(len(ds)))


def test_image_files_through_monai_loadimage(tmp_path):
    from PIL import Image

    rows = []
    for i in range(3):
        img = (np.arange(12 * 16).reshape(12, 16) * (i + 1) % 256).astype(np.uint8)
        Image.fromarray(img).save(tmp_path / f"im{i}.png")
        rows.append({"image_path": f"im{i}.png", "label": i % 2})
    pd.DataFrame(rows).to_csv(tmp_path / "m.csv", index=False)
    src = manifest_source(str(tmp_path / "m.csv"), column="image_path")
    x, y = src.make_dataset(src.table, False)[1]
    assert x.shape[0] == 1 and x.ndim == 3 and y == 1
    assert sorted(x.shape[1:]) == [12, 16]


@pytest.mark.parametrize("change, options, message", [
    ("drop_label", {}, "missing column(s) label"),
    ("missing_file", {}, "s0.npy: file not found"),
    ("corrupt_file", {}, "s0.npy: cannot read image"),
    ("none", {"augment": {"flipz": [0]}}, "unknown key(s) ['flipz']"),
    ("none", {"cache": "ram"}, "dataset.cache: unknown 'ram'"),
    ("none", {"normalize": "l2"}, "dataset.normalize: unknown 'l2'"),
    ("none", {"spatial_size": [4]}, "dataset.spatial_size: expected 2 positive sizes"),
    ("none", {"augment": {"flip": [2]}}, "axis 2 outside 0..1"),
    ("none", {"num_classes": 1}, "label 1 >= num_classes 1"),
])
def test_bad_input_gives_one_clear_error(tmp_path, change, options, message):
    m = _write(tmp_path)
    if change == "drop_label":
        pd.read_csv(m).drop(columns="label").to_csv(m, index=False)
    elif change == "missing_file":
        (tmp_path / "arrays" / "s0.npy").unlink()
    elif change == "corrupt_file":
        (tmp_path / "arrays" / "s0.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(DataError) as err:
        manifest_source(str(m), **options)
    assert message in str(err.value)
