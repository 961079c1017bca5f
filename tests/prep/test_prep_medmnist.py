"""MedMNIST: the fixture writes the download's exact npz format; data_prep/medmnist.py keeps
the official split, checks every key against the dataset's facts and refuses bad files with
one clear message."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from medfl.fixtures import generate
from medfl.prep.errors import PrepError
from medfl.prep.medmnist import DATASETS, build_parser, main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")


def prep(raw: Path, out: Path, *extra: str) -> pd.DataFrame:
    assert main(["--raw", str(raw), "--out", str(out), *extra]) == 0
    return pd.read_csv(out / "manifest.csv", keep_default_na=False)


@pytest.mark.parametrize("flag, size, shape", [("pathmnist", 28, (3, 28, 28)), ("breastmnist", 28, (1, 28, 28)),
                                               ("organmnist3d", 28, (1, 28, 28, 28)), ("dermamnist", 64, (3, 64, 64))])
def test_round_trip_keeps_the_official_split_and_labels(tmp_path: Path, flag: str, size: int, shape: tuple) -> None:
    info = generate("medmnist", tmp_path / "raw", cases=40, seed=0, flag=flag, size=size)
    m = prep(tmp_path / "raw", tmp_path / "out", "--flag", flag, "--size", str(size))
    with np.load(info["path"]) as npz:
        for split in ("train", "val", "test"):
            rows = m[m["split"] == split].sort_values("index")
            assert list(rows["label"]) == npz[f"{split}_labels"][:, 0].tolist()
            first = np.load(tmp_path / "out" / rows["path"].iloc[0])
            assert first.shape == shape and first.dtype == np.float32
            stored = npz[f"{split}_images"][0].astype(np.float32) / 255
            assert np.allclose(first, np.moveaxis(stored, -1, 0) if shape[0] == 3 else stored[None])
    assert list(m["class_name"]) == [DATASETS[flag].classes[y] for y in m["label"]]
    assert (m["subject_id"] == m["sample_id"]).all()
    # the file itself as --raw: flag and size come from its name
    again = prep(Path(info["path"]), tmp_path / "again")
    assert list(again["label"]) == list(m["label"])


#: MedMNIST's published INFO table (github.com/MedMNIST/MedMNIST, medmnist/info.py, v3.0.2,
#: INFO[flag]["label"] in label order and INFO[flag]["n_channels"]), restated as expected data:
#: medfl's names must be these, spelled as published, for every flag.
PUBLISHED = {
    "pathmnist": (3, ("adipose", "background", "debris", "lymphocytes", "mucus", "smooth muscle",
                      "normal colon mucosa", "cancer-associated stroma", "colorectal adenocarcinoma epithelium")),
    "chestmnist": (1, ("atelectasis", "cardiomegaly", "effusion", "infiltration", "mass", "nodule", "pneumonia",
                       "pneumothorax", "consolidation", "edema", "emphysema", "fibrosis", "pleural", "hernia")),
    "dermamnist": (3, ("actinic keratoses and intraepithelial carcinoma", "basal cell carcinoma",
                       "benign keratosis-like lesions", "dermatofibroma", "melanoma", "melanocytic nevi",
                       "vascular lesions")),
    "octmnist": (1, ("choroidal neovascularization", "diabetic macular edema", "drusen", "normal")),
    "pneumoniamnist": (1, ("normal", "pneumonia")),
    "retinamnist": (3, ("0", "1", "2", "3", "4")),
    "breastmnist": (1, ("malignant", "normal, benign")),
    "bloodmnist": (3, ("basophil", "eosinophil", "erythroblast",
                       "immature granulocytes(myelocytes, metamyelocytes and promyelocytes)", "lymphocyte",
                       "monocyte", "neutrophil", "platelet")),
    "tissuemnist": (1, ("Collecting Duct, Connecting Tubule", "Distal Convoluted Tubule",
                        "Glomerular endothelial cells", "Interstitial endothelial cells", "Leukocytes", "Podocytes",
                        "Proximal Tubule Segments", "Thick Ascending Limb")),
    "organamnist": (1, ("bladder", "femur-left", "femur-right", "heart", "kidney-left", "kidney-right", "liver",
                        "lung-left", "lung-right", "pancreas", "spleen")),
    "organcmnist": (1, ("bladder", "femur-left", "femur-right", "heart", "kidney-left", "kidney-right", "liver",
                        "lung-left", "lung-right", "pancreas", "spleen")),
    "organsmnist": (1, ("bladder", "femur-left", "femur-right", "heart", "kidney-left", "kidney-right", "liver",
                        "lung-left", "lung-right", "pancreas", "spleen")),
    "organmnist3d": (1, ("liver", "kidney-right", "kidney-left", "femur-right", "femur-left", "bladder", "heart",
                         "lung-right", "lung-left", "spleen", "pancreas")),
    "nodulemnist3d": (1, ("benign", "malignant")),
    "adrenalmnist3d": (1, ("normal", "hyperplasia")),
    "fracturemnist3d": (1, ("buckle rib fracture", "nondisplaced rib fracture", "displaced rib fracture")),
    "vesselmnist3d": (1, ("vessel", "aneurysm")),
    "synapsemnist3d": (1, ("inhibitory synapse", "excitatory synapse")),
}


@pytest.mark.parametrize("flag", sorted(PUBLISHED))
def test_class_names_are_medmnists_published_ones(flag: str) -> None:
    assert sorted(DATASETS) == sorted(PUBLISHED)
    channels, names = PUBLISHED[flag]
    assert DATASETS[flag].classes == names
    assert DATASETS[flag].channels == channels


def test_organmnist3d_samples_are_named_in_its_own_order(tmp_path: Path) -> None:
    """OrganMNIST3D numbers its organs otherwise than OrganA/C/SMNIST: label 0 is the liver."""
    info = generate("medmnist", tmp_path / "raw", cases=33, seed=0, flag="organmnist3d")
    m = prep(Path(info["path"]), tmp_path / "out")
    names = dict(zip(m["label"], m["class_name"]))
    assert names[0] == "liver" and names[5] == "bladder" and names[10] == "pancreas"
    assert set(m["class_name"]) == set(PUBLISHED["organmnist3d"][1])


def test_chestmnist_is_refused_unless_reduced_to_one_label(tmp_path: Path) -> None:
    info = generate("medmnist", tmp_path / "raw", cases=30, seed=1, flag="chestmnist")
    with pytest.raises(PrepError, match="chestmnist is multi-label .* pass --chest-label any"):
        main(["--raw", info["path"], "--out", str(tmp_path / "a")])
    with np.load(info["path"]) as npz:
        findings = np.concatenate([npz[f"{s}_labels"] for s in ("train", "val", "test")])
    anyf = prep(Path(info["path"]), tmp_path / "any", "--chest-label", "any")
    assert anyf.sort_values(["split", "index"]).shape[0] == len(findings)
    order = pd.concat([anyf[anyf["split"] == s].sort_values("index") for s in ("train", "val", "test")])
    assert list(order["label"]) == (findings.max(1) > 0).astype(int).tolist()
    third = prep(Path(info["path"]), tmp_path / "three", "--chest-label", "effusion")
    order = pd.concat([third[third["split"] == s].sort_values("index") for s in ("train", "val", "test")])
    assert list(order["label"]) == findings[:, 2].tolist() and set(order["class_name"]) <= {"effusion", "no effusion"}
    with pytest.raises(PrepError, match="--chest-label 'lungs': expected 'any', an index 0-13"):
        main(["--raw", info["path"], "--out", str(tmp_path / "b"), "--chest-label", "lungs"])


def test_retinamnist_grades_are_classes_with_a_note(tmp_path: Path) -> None:
    info = generate("medmnist", tmp_path / "raw", cases=30, seed=0, flag="retinamnist")
    prep(Path(info["path"]), tmp_path / "out")
    assert "ordinal; medfl treats them as 5 classes" in (tmp_path / "out" / "report.json").read_text()


def _rewrite(path: Path, **changes) -> None:
    with np.load(path) as npz:
        arrays = {k: npz[k] for k in npz.files}
    for key, value in changes.items():
        if value is None:
            arrays.pop(key)
        else:
            arrays[key] = value
    np.savez(path, **arrays)


@pytest.mark.parametrize("change, message", [
    (lambda p: _rewrite(p, val_labels=None), r"no key 'val_labels'; a MedMNIST file holds"),
    (lambda p: _rewrite(p, test_images=np.zeros((5, 28, 28), np.uint8)),
     r"key 'test_images': uint8 array of shape \(5, 28, 28\); expected uint8 \(N, H, W, 3\)"),
    (lambda p: _rewrite(p, train_images=np.zeros((42, 28, 28, 3), np.float32)),
     r"key 'train_images': float32 array .* expected uint8"),
    (lambda p: _rewrite(p, test_labels=np.zeros((3, 1), np.uint8)), r"12 test images but 3 labels"),
    (lambda p: _rewrite(p, train_labels=np.full((42, 1), 9, np.uint8)),
     r"key 'train_labels', row 0: \[9\]; expected values in 0\.\.8 \(9 classes\)"),
    (lambda p: _rewrite(p, train_labels=np.zeros((42, 2), np.uint8)), r"key 'train_labels': shape \(42, 2\); expected \(N, 1\)"),
    (lambda p: _rewrite(p, val_labels=np.full((6, 1), 0.5)), r"key 'val_labels': float64 values; expected integer"),
    (lambda p: _rewrite(p, val_images=np.zeros((0, 28, 28, 3), np.uint8), val_labels=np.zeros((0, 1), np.uint8)),
     r"key 'val_images': no images"),
    (lambda p: p.write_bytes(p.read_bytes()[:200]), r"not a readable .npz file"),
])
def test_bad_files_stop_with_one_message(tmp_path: Path, change, message) -> None:
    info = generate("medmnist", tmp_path / "raw", cases=60, seed=0, flag="pathmnist")
    path = Path(info["path"])
    change(path)
    with pytest.raises(PrepError) as err:
        main(["--raw", str(path), "--out", str(tmp_path / "out")])
    assert len(str(err.value).splitlines()) == 1 and str(path) in str(err.value)
    assert re.search(message, str(err.value)), str(err.value)
    assert not (tmp_path / "out" / "manifest.csv").exists()


def _npy_named_npz(path: Path) -> None:
    with open(path, "wb") as f:   # np.save on a file object keeps the name: a .npy under .npz
        np.save(f, np.zeros((4, 28, 28, 3), np.uint8))


@pytest.mark.parametrize("flag, size, write, message", [
    ("pathmnist", 28, _npy_named_npz,
     r"a single NumPy array \(\.npy format\) named \.npz, not MedMNIST's archive of six arrays; expected "
     r"MedMNIST's \.npz \(a zip archive"),
    ("pathmnist", 28, lambda p: p.write_text("<!DOCTYPE html>\n<html><head><title>429 Too Many Requests</title>"
                                             "</head><body>Rate limited</body></html>\n"),
     r"an HTML page, probably a failed download .*; expected MedMNIST's \.npz"),
    ("pathmnist", 28, lambda p: p.write_bytes(b"\n  <html><body>Sign in</body></html>"),
     r"an HTML page, probably a failed download"),
    ("pathmnist", 28, lambda p: p.write_bytes(b""), r"an empty file \(0 bytes\), probably an interrupted download"),
    ("pathmnist", 28, lambda p: p.write_bytes(b"\x80\x04\x95" + bytes(40)), r"a Python pickle, not read"),
    ("pathmnist", 28, lambda p: p.write_bytes(b"GIF89a" + bytes(40)), r"not a \.npz file \(it starts with b'GIF89a"),
    # 2D colour images (a 2D MedMNIST file) saved under a 3D dataset's name
    ("organmnist3d", 28, lambda p: generate("medmnist", p.parent / "2d", cases=40, seed=0, flag="pathmnist")
     and p.write_bytes((p.parent / "2d" / "pathmnist.npz").read_bytes()),
     r"key 'train_images': 2D colour images 28 x 28 x 3 \(shape \(\d+, 28, 28, 3\)\); expected volumes of "
     r"28 x 28 x 28 \(size 28, as the file name organmnist3d\.npz says\): probably a 2D MedMNIST file"),
    # the 28 x 28 file saved as the 64 one
    ("pathmnist", 64, lambda p: generate("medmnist", p.parent / "28", cases=40, seed=0, flag="pathmnist")
     and p.write_bytes((p.parent / "28" / "pathmnist.npz").read_bytes()),
     r"key 'train_images': images of 28 x 28; expected images of 64 x 64 \(size 64, as the file name "
     r"pathmnist_64\.npz says\): probably a file of another size"),
    ("organmnist3d", 64, lambda p: generate("medmnist", p.parent / "28", cases=33, seed=0, flag="organmnist3d")
     and p.write_bytes((p.parent / "28" / "organmnist3d.npz").read_bytes()),
     r"volumes of 28 x 28 x 28; expected volumes of 64 x 64 x 64"),
])
def test_a_file_that_is_not_what_its_name_says_is_named(tmp_path: Path, flag: str, size: int, write,
                                                         message: str) -> None:
    """What a wrong file is (an array, a web page, another dataset or size) is said in one line
    naming the file, before anything is written."""
    raw = tmp_path / "raw"
    raw.mkdir()
    path = raw / (f"{flag}.npz" if size == 28 else f"{flag}_{size}.npz")
    write(path)
    for argv in (["--raw", str(path)], ["--raw", str(raw), "--flag", flag, "--size", str(size)]):
        with pytest.raises(PrepError) as err:
            main([*argv, "--out", str(tmp_path / "out")])
        assert len(str(err.value).splitlines()) == 1 and str(err.value).startswith(str(path)), str(err.value)
        assert re.search(message, str(err.value)), str(err.value)
        assert not (tmp_path / "out").exists()


def test_size_of_a_file_not_named_as_medmnist_is_given_by_size(tmp_path: Path) -> None:
    info = generate("medmnist", tmp_path / "raw", cases=40, seed=0, flag="pathmnist", size=64)
    odd = tmp_path / "mine" / "mine.npz"
    odd.parent.mkdir()
    odd.write_bytes(Path(info["path"]).read_bytes())
    with pytest.raises(PrepError, match=r"images of 64 x 64; expected images of 28 x 28 \(size 28, --size 28\)"):
        main(["--raw", str(odd), "--flag", "pathmnist", "--out", str(tmp_path / "a")])
    m = prep(odd, tmp_path / "b", "--flag", "pathmnist", "--size", "64")
    assert np.load(tmp_path / "b" / m["path"].iloc[0]).shape == (3, 64, 64)


def test_choosing_the_file_is_checked(tmp_path: Path) -> None:
    generate("medmnist", tmp_path / "raw", cases=40, seed=0, flag="pathmnist")
    with pytest.raises(PrepError, match="is a folder: pass --flag"):
        main(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "o")])
    with pytest.raises(PrepError, match=r"pathmnist_128.npz: not found; the folder holds pathmnist.npz"):
        main(["--raw", str(tmp_path / "raw"), "--flag", "pathmnist", "--size", "128", "--out", str(tmp_path / "o")])
    with pytest.raises(PrepError, match="--size 224: organmnist3d comes in sizes 28, 64"):
        main(["--raw", str(tmp_path / "raw"), "--flag", "organmnist3d", "--size", "224", "--out", str(tmp_path / "o")])
    odd = tmp_path / "raw" / "mydata.npz"
    odd.write_bytes((tmp_path / "raw" / "pathmnist.npz").read_bytes())
    with pytest.raises(PrepError, match="not a MedMNIST file name"):
        main(["--raw", str(odd), "--out", str(tmp_path / "o")])
    assert len(prep(odd, tmp_path / "named", "--flag", "pathmnist")) == 40


def test_overwrite_resize_and_the_script(tmp_path: Path) -> None:
    info = generate("medmnist", tmp_path / "raw", cases=40, seed=0, flag="bloodmnist")
    out = tmp_path / "out"
    prep(Path(info["path"]), out, "--limit", "3")
    with pytest.raises(PrepError, match="manifest"):
        main(["--raw", info["path"], "--out", str(out)])
    small = prep(Path(info["path"]), out, "--overwrite", "--resize", "16", "--limit", "2")
    assert len(small) == 6 and np.load(out / small["path"].iloc[0]).shape == (3, 16, 16)
    assert len(list((out / "arrays").rglob("*.npy"))) == 6  # the earlier run's extra arrays are gone
    script = str(REPO / "data_prep" / "medmnist.py")
    ok = subprocess.run([sys.executable, script, "--raw", info["path"], "--out", str(tmp_path / "s")],
                        capture_output=True, text=True, timeout=120, env={"MEDFL_NO_PROGRESS": "1", "PATH": "/usr/bin:/bin"})
    assert ok.returncode == 0, ok.stderr
    bad = subprocess.run([sys.executable, script, "--raw", str(tmp_path / "none"), "--out", str(tmp_path / "t")],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("error: --raw ") and "Traceback" not in bad.stderr
    text = build_parser().format_help()
    for opt in ("--raw", "--out", "--flag", "--size", "--resize", "--chest-label", "--overwrite", "--limit"):
        assert opt in text


def _power_spectra(images: np.ndarray) -> np.ndarray:
    """Each image's 2D power spectrum after removing its 3 x 3 local mean: fine texture only,
    blind to position (so the class's blob) and to brightness."""
    grey = images.astype(np.float64).mean(axis=-1) if images.ndim == 4 else images.astype(np.float64)
    padded = np.pad(grey, ((0, 0), (1, 1), (1, 1)), mode="edge")
    local = sum(padded[:, i:i + grey.shape[1], j:j + grey.shape[2]] for i in range(3) for j in range(3)) / 9
    return np.abs(np.fft.fft2(grey - local)) ** 2


def _nearest_centroid_accuracy(train_x, train_y, test_x, test_y) -> float:
    feats = lambda x: np.log1p(x.reshape(len(x), -1))  # noqa: E731
    centroids = np.stack([feats(train_x[train_y == c]).mean(axis=0) for c in np.unique(train_y)])
    d = ((feats(test_x)[:, None, :] - centroids[None]) ** 2).sum(axis=-1)
    return float((np.unique(train_y)[d.argmin(axis=1)] == test_y).mean())


def test_texture_puts_a_class_signal_in_fine_texture_only(tmp_path: Path) -> None:
    """``texture`` adds a class-oriented grating and nothing else: the same labels, the plain
    images plus the grating; a nearest-centroid reading of the images' fine-texture spectra
    tells the classes apart with it and is near chance (1/9) without it."""
    plain = dict(np.load(generate("medmnist", tmp_path / "plain", cases=270, seed=3, flag="pathmnist")["path"]))
    tex = dict(np.load(generate("medmnist", tmp_path / "tex", cases=270, seed=3, flag="pathmnist",
                                texture=50, texture_period=3)["path"]))
    for split in ("train", "val", "test"):
        assert np.array_equal(plain[f"{split}_labels"], tex[f"{split}_labels"])
        diff = tex[f"{split}_images"].astype(float) - plain[f"{split}_images"].astype(float)
        assert np.abs(diff).max() <= 51 and np.abs(diff).mean() > 20
    accuracy = {}
    for name, arrays in (("plain", plain), ("texture", tex)):
        accuracy[name] = _nearest_centroid_accuracy(
            _power_spectra(arrays["train_images"]), arrays["train_labels"][:, 0],
            _power_spectra(arrays["test_images"]), arrays["test_labels"][:, 0])
    assert accuracy["texture"] >= 0.9, accuracy
    assert accuracy["plain"] <= 0.35, accuracy


@pytest.mark.parametrize("options, message", [
    ({"texture": -1}, "texture=-1"),
    ({"texture": 10, "texture_period": 1.5}, "period of at least 2"),
    ({"texture": 10, "flag": "organmnist3d"}, "texture is for 2D images"),
])
def test_bad_texture_options_are_refused(tmp_path: Path, options: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        generate("medmnist", tmp_path / "raw", cases=60, seed=0, **{"flag": "pathmnist", **options})
