"""Derm7pt: the fixture generator, data_prep/derm7pt.py, the real metadata, and the bundle."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from medfl.fixtures import generate
from medfl.prep.errors import PRESENT_ONLY_HINT, PrepError
from medfl.prep.derm7pt import (
    CLASS_NAMES, DIAGNOSIS_CLASSES, META_COLUMNS, build_parser, crop_border, diagnosis_class,
    main, read_meta, sex_code,
)

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "bundles" / "derm7pt"
CASES = 20
SIZE = 32
SPLIT_FILES = {"train": "train_indexes.csv", "val": "valid_indexes.csv", "test": "test_indexes.csv"}


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")


def tree_hash(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root``."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def prep(raw: Path, out: Path, *extra: str) -> int:
    return main(["--raw", str(raw), "--out", str(out), "--size", str(SIZE), *extra])


def meta_of(raw: Path) -> pd.DataFrame:
    return pd.read_csv(raw / "release_v0" / "meta" / "meta.csv", dtype=str, keep_default_na=False)


def official_split(raw: Path) -> dict[int, str]:
    """meta.csv row -> manifest split, from the index files."""
    out = {}
    for split, name in SPLIT_FILES.items():
        for row in pd.read_csv(raw / "release_v0" / "meta" / name)["indexes"]:
            out[int(row)] = split
    return out


@pytest.fixture(scope="module")
def raw_syn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A synthetic-row fixture (no reference data needed)."""
    root = tmp_path_factory.mktemp("derm7pt_raw")
    generate("derm7pt", root, cases=CASES, seed=0, reference=False)
    return root


@pytest.fixture(scope="module")
def prepared(raw_syn: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """data_prep run on ``raw_syn`` with --clinic; the raw tree hashed before and after."""
    before = tree_hash(raw_syn)
    out = tmp_path_factory.mktemp("derm7pt_out")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEDFL_NO_PROGRESS", "1")
        assert prep(raw_syn, out, "--clinic") == 0
    return {"out": out, "manifest": pd.read_csv(out / "manifest.csv", keep_default_na=False),
            "before": before, "after": tree_hash(raw_syn)}


# --------------------------------------------------------------------------- fixture


def test_fixture_has_the_raw_layout_and_quirks(raw_syn: Path):
    release = raw_syn / "release_v0"
    meta = meta_of(raw_syn)
    assert tuple(meta.columns) == META_COLUMNS and len(meta) == CASES
    assert meta["case_num"].astype(int).is_unique
    rows = []
    for name in SPLIT_FILES.values():
        idx = pd.read_csv(release / "meta" / name)
        assert list(idx.columns) == ["indexes"] and len(idx)
        rows += idx["indexes"].tolist()
    assert sorted(rows) == list(range(CASES))  # 0-based, disjoint, complete
    folders = {d.split("/")[0] for d in meta["derm"]}
    assert {"FCL", "FCl"} <= folders
    assert (release / "images" / "FCL").is_dir() and (release / "images" / "FCl").is_dir()
    names_fcl = {d.split("/")[1] for d in meta["derm"] if d.startswith("FCL/")}
    assert any(d.split("/")[1] in names_fcl for d in meta["derm"] if d.startswith("FCl/"))
    exts = {d.rsplit(".", 1)[1] for d in meta["derm"]}
    assert exts == {"jpg", "JPG"}
    assert any("," in n for n in meta["notes"])  # a quoted note with a comma
    for rel in list(meta["derm"]) + list(meta["clinic"]):
        path = release / "images" / rel
        assert path.is_file(), rel
        with Image.open(path) as im:
            assert im.format == "JPEG" and im.mode == "RGB"
    with Image.open(release / "images" / meta["derm"].iloc[0]) as im:
        px = np.asarray(im, dtype=np.float32)
    assert px[:5].mean() < 20 and px[:, :5].mean() < 20  # black frame...
    assert px[40:-40, 40:-40].mean() > 60  # ...around a bright image
    assert set(meta["sex"]) <= {"female", "male"}


def test_fixture_is_deterministic_and_seeded(tmp_path: Path):
    a = generate("derm7pt", tmp_path / "a", cases=6, seed=3, reference=False)
    generate("derm7pt", tmp_path / "b", cases=6, seed=3, reference=False)
    generate("derm7pt", tmp_path / "c", cases=6, seed=4, reference=False)
    assert a["cases"] == 6 and a["images"] == 12 and sum(a["splits"].values()) == 6
    assert tree_hash(tmp_path / "a") == tree_hash(tmp_path / "b")
    assert tree_hash(tmp_path / "a") != tree_hash(tmp_path / "c")
    with pytest.raises(ValueError, match="at least 3"):
        generate("derm7pt", tmp_path / "d", cases=2, reference=False)


def test_fixture_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from medfl.fixtures.__main__ import main as fixtures_main

    assert fixtures_main(["derm7pt", "--out", str(tmp_path), "--cases", "5", "--seed", "1",
                          "--synthetic-rows"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["cases"] == 5 and info["reference"] is None
    assert (tmp_path / "release_v0" / "meta" / "meta.csv").is_file()


def test_fixture_class_signal_is_learnable(raw_syn: Path, prepared: dict):
    """Mean lesion colour alone separates the classes well above chance (1/5)."""
    m = prepared["manifest"]
    feats = np.stack([np.load(prepared["out"] / p)[:, 8:24, 8:24].mean(axis=(1, 2)) for p in m["path"]])
    labels = m["label"].to_numpy()
    centroids = np.stack([feats[labels == c].mean(0) for c in range(5)])
    pred = np.argmin(((feats[:, None] - centroids[None]) ** 2).sum(-1), axis=1)
    assert (pred == labels).mean() >= 0.8


# --------------------------------------------------------------------------- data_prep


def test_manifest_rows_match_the_metadata(raw_syn: Path, prepared: dict):
    m, out = prepared["manifest"], prepared["out"]
    meta = meta_of(raw_syn)
    splits = official_split(raw_syn)
    assert len(m) == CASES
    assert list(m.columns[:9]) == ["sample_id", "path", "image_path", "label", "class_name",
                                   "subject_id", "site", "sex", "split"]
    assert m["sample_id"].is_unique
    for _, r in m.iterrows():
        src = meta.iloc[int(r["meta_row"])]
        assert int(src["case_num"]) == r["case_num"]
        assert r["label"] == CLASS_NAMES.index(DIAGNOSIS_CLASSES[src["diagnosis"]])
        assert r["class_name"] == CLASS_NAMES[r["label"]] and r["diagnosis"] == src["diagnosis"]
        assert r["split"] == splits[int(r["meta_row"])]
        assert r["image_path"] == "release_v0/images/" + src["derm"]  # verbatim
        assert r["clinic_image_path"] == "release_v0/images/" + src["clinic"]
        assert r["site"] == src["derm"].split("/")[0]
        assert r["sex"] == {"female": "F", "male": "M"}[src["sex"]]
        assert (raw_syn / r["image_path"]).is_file()
    assert {"FCL", "FCl"} <= set(m["site"])  # case-sensitive folders are distinct sites
    assert set(m["split"]) == {"train", "val", "test"}
    assert m.groupby("subject_id")["split"].nunique().max() == 1
    for col in ("path", "clinic_path"):
        for rel in m[col]:
            arr = np.load(out / rel)
            assert arr.shape == (3, SIZE, SIZE) and arr.dtype == np.float32
            assert 0.0 <= arr.min() and arr.max() <= 1.0


def test_report_and_raw_unchanged(raw_syn: Path, prepared: dict):
    out = prepared["out"]
    rep = json.loads((out / "report.json").read_text())
    counts = rep["counts"]
    assert counts["written"] == CASES and counts["skipped"] == 0 and rep["num_skipped"] == 0
    assert counts["splits"] == {s: len(pd.read_csv(raw_syn / "release_v0" / "meta" / f))
                                for s, f in SPLIT_FILES.items()}
    assert counts["classes"] == prepared["manifest"]["class_name"].value_counts().reindex(
        list(CLASS_NAMES), fill_value=0).to_dict()
    assert rep["options"]["crop_border"] == 25 and rep["options"]["size"] == [SIZE, SIZE]
    assert pd.read_csv(out / "skipped.csv").empty
    assert prepared["before"] == prepared["after"]  # raw directory untouched
    assert not any(p.name in ("manifest.csv", "report.json") for p in raw_syn.rglob("*"))


def test_border_crop_removes_the_black_frame(raw_syn: Path, tmp_path: Path):
    img = np.zeros((60, 90, 3), dtype=np.uint8)
    img[25:-25, 25:-25] = 200
    assert crop_border(img, 25).shape == (10, 40, 3) and crop_border(img, 25).min() == 200
    assert crop_border(img, 0) is img
    with pytest.raises(PrepError, match="expected more than 60"):
        crop_border(img, 30, "x.jpg")
    edges = {}
    for border in ("0", "25"):
        out = tmp_path / border
        prep(raw_syn, out, "--crop-border", border, "--limit", "4")
        arrs = [np.load(out / p) for p in pd.read_csv(out / "manifest.csv")["path"]]
        edges[border] = np.mean([np.r_[a[:, 0].ravel(), a[:, -1].ravel()].mean() for a in arrs])
    assert edges["0"] < 0.1 < 0.4 < edges["25"]


def test_limit_and_aspect(raw_syn: Path, tmp_path: Path):
    assert prep(raw_syn, tmp_path / "o", "--limit", "3", "--aspect", "pad", "--size", "24", "40") == 0
    m = pd.read_csv(tmp_path / "o" / "manifest.csv")
    assert len(m) == 3 and m["meta_row"].tolist() == sorted(m["meta_row"])
    arr = np.load(tmp_path / "o" / m["path"].iloc[0])
    assert arr.shape == (3, 24, 40)
    with pytest.raises(SystemExit):
        prep(raw_syn, tmp_path / "p", "--size", "1", "2", "3")


def test_overwrite_is_refused_then_replaces(raw_syn: Path, tmp_path: Path):
    out = tmp_path / "o"
    prep(raw_syn, out, "--limit", "6")
    with pytest.raises(PrepError, match="already holds a manifest.csv.*--overwrite"):
        prep(raw_syn, out, "--limit", "3")
    assert len(pd.read_csv(out / "manifest.csv")) == 6
    prep(raw_syn, out, "--limit", "3", "--overwrite")
    assert len(pd.read_csv(out / "manifest.csv")) == 3
    assert len(list((out / "arrays" / "derm").glob("*.npy"))) == 3  # stale arrays removed
    with pytest.raises(PrepError, match="inside --raw"):
        prep(raw_syn, raw_syn / "release_v0" / "prepared")
    assert not (raw_syn / "release_v0" / "prepared").exists()


def test_diagnosis_and_sex_strings():
    for text, cls in DIAGNOSIS_CLASSES.items():
        assert CLASS_NAMES[diagnosis_class(text)] == cls
        assert diagnosis_class(f" {text.upper()} ") == diagnosis_class(text)
    assert len(DIAGNOSIS_CLASSES) == 21 and set(DIAGNOSIS_CLASSES.values()) == set(CLASS_NAMES)
    with pytest.raises(PrepError, match=r"meta.csv line 7, column 'diagnosis': unknown diagnosis "
                                        r"'melanoma \(thick\)'; expected one of 'basal cell"):
        diagnosis_class("melanoma (thick)", "meta.csv line 7, column 'diagnosis'")
    assert [sex_code(s) for s in ("female", "Male", "")] == ["F", "M", ""]
    with pytest.raises(PrepError, match="unknown sex 'x'"):
        sex_code("x")


def _row(raw: Path, split: str = "train", k: int = 0) -> tuple[int, pd.Series]:
    """The k-th meta row of a split (sorted), and its record."""
    meta = meta_of(raw)
    rows = sorted(r for r, s in official_split(raw).items() if s == split)
    return rows[k], meta.iloc[rows[k]]


def _edit_meta(raw: Path, fn: Callable[[pd.DataFrame], pd.DataFrame]) -> None:
    path = raw / "release_v0" / "meta" / "meta.csv"
    fn(meta_of(raw)).to_csv(path, index=False)


def _image(raw: Path, rel: str) -> Path:
    return raw / "release_v0" / "images" / rel


def missing_image(raw):
    _, rec = _row(raw)
    _image(raw, rec["derm"]).unlink()
    return rec["derm"].split("/")[1]


def case_differs(raw):
    _, rec = _row(raw, "test")
    path = _image(raw, rec["derm"])
    stem, ext = path.name.rsplit(".", 1)
    path.rename(path.with_name(f"{stem}.{ext.swapcase()}"))
    return "differs in case"


def corrupt_jpeg(raw):
    _, rec = _row(raw)
    _image(raw, rec["derm"]).write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    return rec["derm"].split("/")[1]


def truncated_jpeg(raw):
    _, rec = _row(raw, "val")
    path = _image(raw, rec["derm"])
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
    return rec["derm"].split("/")[1]


def too_small(raw):
    _, rec = _row(raw)
    Image.new("RGB", (40, 40), (120, 80, 50)).save(_image(raw, rec["derm"]), format="JPEG")
    return "expected more than 50"


def unknown_diagnosis(raw):
    row, _ = _row(raw)
    _edit_meta(raw, lambda m: m.assign(diagnosis=m["diagnosis"].where(m.index != row, "melanoma (thick)")))
    return r"column 'diagnosis': unknown diagnosis 'melanoma \(thick\)'; expected one of"


def unknown_sex(raw):
    row, _ = _row(raw)
    _edit_meta(raw, lambda m: m.assign(sex=m["sex"].where(m.index != row, "unknown")))
    return "column 'sex': unknown sex 'unknown'"


def empty_derm_cell(raw):
    row, _ = _row(raw)
    _edit_meta(raw, lambda m: m.assign(derm=m["derm"].where(m.index != row, "")))
    return "column 'derm': empty"


def missing_clinic(raw):
    _, rec = _row(raw)
    _image(raw, rec["clinic"]).unlink()
    return rec["clinic"].split("/")[1]


def missing_column(raw):
    _edit_meta(raw, lambda m: m.drop(columns=["diagnosis"]))
    return "meta.csv: missing column.*'diagnosis'"


def missing_indexes_column(raw):
    path = raw / "release_v0" / "meta" / "valid_indexes.csv"
    path.write_text(path.read_text().replace("indexes", "index", 1))
    return "valid_indexes.csv: missing column.*'indexes'"


def empty_split_file(raw):
    (raw / "release_v0" / "meta" / "test_indexes.csv").write_text("indexes\n")
    return "test_indexes.csv: no rows; the test split would be empty"


def index_out_of_range(raw):
    with open(raw / "release_v0" / "meta" / "train_indexes.csv", "a") as f:
        f.write(f"{CASES}\n")
    return f"train_indexes.csv line .*'{CASES}'; expected a 0-based row of meta.csv \\(0..{CASES - 1}\\)"


def index_in_two_files(raw):
    row, _ = _row(raw, "train")
    with open(raw / "release_v0" / "meta" / "test_indexes.csv", "a") as f:
        f.write(f"{row}\n")
    return f"test_indexes.csv line .*row {row} is listed in train_indexes.csv too"


def bad_case_num(raw):
    _edit_meta(raw, lambda m: m.assign(case_num=m["case_num"].where(m.index != 2, "x3")))
    return "meta.csv line 4, column 'case_num': 'x3'; expected a positive integer"


def missing_meta(raw):
    (raw / "release_v0" / "meta" / "meta.csv").unlink()
    return "expected Derm7pt's release_v0 folder"


# (mutation, per-file problem that --skip-bad skips, extra options)
BAD_INPUTS = [
    (missing_image, True, ()),
    (case_differs, True, ()),
    (corrupt_jpeg, True, ()),
    (truncated_jpeg, True, ()),
    (too_small, True, ()),
    (unknown_diagnosis, True, ()),
    (unknown_sex, True, ()),
    (empty_derm_cell, True, ()),
    (missing_clinic, True, ("--clinic",)),
    (missing_column, False, ()),
    (missing_indexes_column, False, ()),
    (empty_split_file, False, ()),
    (index_out_of_range, False, ()),
    (index_in_two_files, False, ()),
    (bad_case_num, False, ()),
    (missing_meta, False, ()),
]


@pytest.mark.parametrize("mutate,per_file,extra", BAD_INPUTS, ids=[b[0].__name__ for b in BAD_INPUTS])
def test_bad_input(raw_syn: Path, tmp_path: Path, mutate, per_file: bool, extra: tuple[str, ...]):
    raw = tmp_path / "raw"
    shutil.copytree(raw_syn, raw)
    expected = mutate(raw)
    before = tree_hash(raw)
    with pytest.raises(PrepError) as err:
        prep(raw, tmp_path / "stop", *extra)
    assert len(str(err.value).splitlines()) == 1
    assert re.search(expected, str(err.value)), str(err.value)
    assert not (tmp_path / "stop" / "manifest.csv").exists()
    if per_file:
        assert prep(raw, tmp_path / "skip", "--skip-bad", *extra) == 0
        skipped = pd.read_csv(tmp_path / "skip" / "skipped.csv")
        assert len(skipped) == 1, skipped
        # the stop says the same, plus the --present-only hint when the file is absent
        assert str(err.value).replace(PRESENT_ONLY_HINT, "") == skipped["reason"].iloc[0]
        assert (PRESENT_ONLY_HINT in str(err.value)) == (mutate in (missing_image, missing_clinic))
        m = pd.read_csv(tmp_path / "skip" / "manifest.csv")
        assert len(m) == CASES - 1
        assert json.loads((tmp_path / "skip" / "report.json").read_text())["num_skipped"] == 1
    else:
        with pytest.raises(PrepError):
            prep(raw, tmp_path / "skip", "--skip-bad", *extra)
    assert tree_hash(raw) == before
    if mutate is missing_clinic:  # clinic images are optional: without --clinic all is well
        assert prep(raw, tmp_path / "noclinic") == 0


def test_split_emptied_by_skipping(raw_syn: Path, tmp_path: Path):
    raw = tmp_path / "raw"
    shutil.copytree(raw_syn, raw)
    meta, splits = meta_of(raw), official_split(raw)
    val_rows = [r for r, s in splits.items() if s == "val"]
    for r in val_rows:
        _image(raw, meta["derm"].iloc[r]).unlink()
    with pytest.raises(PrepError, match="image not found"):
        prep(raw, tmp_path / "a")
    with pytest.raises(PrepError, match=rf"split 'val' \(.*valid_indexes.csv\) is empty: all its "
                                        rf"{len(val_rows)} case\(s\) were skipped"):
        prep(raw, tmp_path / "b", "--skip-bad")
    # a stopped run leaves no half dataset at --out; its report is kept beside it
    assert len(pd.read_csv(tmp_path / "b.failed" / "skipped.csv")) == len(val_rows)
    assert not (tmp_path / "b").exists() and not (tmp_path / "b.failed" / "manifest.csv").exists()


def test_script_reports_errors_and_help(tmp_path: Path):
    proc = subprocess.run([sys.executable, str(REPO / "data_prep" / "derm7pt.py"), "--raw",
                           str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --raw ")
    assert "Traceback" not in proc.stderr
    text = build_parser().format_help()
    for opt in ("--raw", "--out", "--skip-bad", "--overwrite", "--limit", "--size", "--crop-border",
                "--aspect", "--clinic", "release_v0"):
        assert opt in text


# --------------------------------------------------------------------------- real metadata


def test_real_metadata_every_diagnosis_maps(reference_data: Path):
    path = reference_data / "derm7pt" / "meta_reduced_Consistent-Derm7pt.csv"
    meta = read_meta(path, required=("diagnosis", "derm"))
    assert len(meta) == 1011
    labels = [diagnosis_class(d, f"{path} line {i + 2}") for i, d in enumerate(meta["diagnosis"])]
    counts = dict(zip(*np.unique(labels, return_counts=True)))
    assert {CLASS_NAMES[k]: int(v) for k, v in counts.items()} == {
        "BCC": 42, "NEV": 575, "MEL": 252, "MISC": 97, "SK": 45}
    folders = set(meta["derm"].str.split("/").str[0])
    assert {"FCL", "FCl"} <= folders
    assert {p.rsplit(".", 1)[1] for p in meta["derm"]} == {"jpg", "JPG"}
    # the reduced file lacks columns a full meta.csv has: one clear message naming them
    with pytest.raises(PrepError, match=r"missing column\(s\) 'case_num', 'sex'; found diagnosis"):
        read_meta(path)


def test_reference_fixture_uses_real_rows(reference_data: Path, tmp_path: Path):
    real = pd.read_csv(reference_data / "derm7pt" / "meta_reduced_Consistent-Derm7pt.csv",
                       dtype=str, keep_default_na=False)
    info = generate("derm7pt", tmp_path / "raw", cases=12, seed=0, reference=reference_data)
    assert info["reference"] and info["cases"] == 12
    meta = meta_of(tmp_path / "raw")
    for _, r in meta.iterrows():
        src = real.iloc[int(r["case_num"]) - 1]
        assert (r["diagnosis"], r["derm"], r["pigment_network"]) == (
            src["diagnosis"], src["derm"], src["pigment_network"])
    assert {"FCL", "FCl"} <= {d.split("/")[0] for d in meta["derm"]}
    assert any(d.endswith(".JPG") for d in meta["derm"])
    assert prep(tmp_path / "raw", tmp_path / "out") == 0
    m = pd.read_csv(tmp_path / "out" / "manifest.csv")
    assert len(m) == 12 and set(m["class_name"]) == set(CLASS_NAMES)


# --------------------------------------------------------------------------- bundle


def test_bundle_configs_override_method_and_alpha():
    from medfl.bundle import load_bundle_config
    from medfl.config import resolve_config

    fl = load_bundle_config(BUNDLE / "configs" / "train.json",
                            {"fl#methods": [{"name": "fedprox"}], "fl#partition#alpha": 0.5,
                             "dataset_dir": "/data/derm7pt_224"})
    cfg = resolve_config(fl)
    assert [m["name"] for m in cfg["methods"]] == ["fedprox"]
    assert cfg["partition"] == {"name": "dirichlet", "alpha": 0.5, "min_size": 20}
    assert cfg["dataset"]["path"] == "/data/derm7pt_224/manifest.csv"
    assert cfg["dataset"]["num_classes"] == 5 and cfg["dataset"]["cache"] == "memory"
    assert cfg["model"]["name"].startswith("resnet") and cfg["dataset"]["spatial_size"] == [224, 224]
    default = resolve_config(load_bundle_config(BUNDLE / "configs" / "train.json"))
    assert [m["name"] for m in default["methods"]] == ["fedavg", "local"]
    assert default["partition"]["alpha"] == 1.0


def test_bundle_runs_with_monai_bundle_cli(prepared: dict, tmp_path: Path, run_bundle):
    data = prepared["out"]
    common = ["--bundle_root", str(tmp_path), "--dataset_dir", str(data), "--image_size", str(SIZE)]
    run_bundle(BUNDLE / "configs" / "train.json", *common, "--fl#rounds", "1",
               "--fl#num_clients", "2", "--fl#partition#min_size", "4", "--fl#progress", "False",
               "--fl#model", "{'name': 'resnet10', 'width': 4}", "--fl#train#batch_size", "8", cwd=tmp_path)
    exp = tmp_path / "runs" / "derm7pt"
    for label in ("fedavg", "local"):
        summary = json.loads((exp / label / "summary.json").read_text())
        assert summary["rounds"] == 1 and summary["num_clients"] == 2
        assert 0 <= summary["final"]["global_test"]["accuracy"]["mean"] <= 1
    saved = json.loads((exp / "fedavg" / "config.json").read_text())["fl"]
    assert saved["dataset"]["path"] == f"{data}/manifest.csv"
    assert saved["partition"]["alpha"] == 1.0 and saved["model"]["width"] == 4

    run_bundle(BUNDLE / "configs" / "inference.json", *common, "--run_dir", exp / "fedavg", cwd=tmp_path)
    pred = pd.read_csv(exp / "fedavg" / "predictions.csv")
    m = prepared["manifest"]
    test = m[m["split"] == "test"].set_index("sample_id")
    assert len(pred) == 2 * len(test) and set(pred["sample_id"]) == set(test.index)
    assert (pred["label"].to_numpy() == test.loc[pred["sample_id"], "label"].to_numpy()).all()
    probs = pred[[f"prob_{c}" for c in CLASS_NAMES]].to_numpy()
    assert np.allclose(probs.sum(1), 1, atol=1e-4) and set(pred["prediction"]) <= set(range(5))


def test_16_bit_and_exif_rotated_images_are_read_as_they_are_seen(tmp_path):
    """Issue 19: a 16-bit PNG was cached as a constant 1.0 (PIL's RGB conversion clips it),
    and an EXIF-rotated photo was cached sideways."""
    from PIL import Image

    from medfl.prep.derm7pt import load_rgb

    ramp = np.tile(np.linspace(0, 65535, 40).astype(np.uint16), (20, 1))
    Image.fromarray(ramp).save(tmp_path / "deep.png")                  # a 16-bit grayscale PNG
    rgb, fmt = load_rgb(tmp_path / "deep.png")
    assert fmt == "PNG" and rgb.shape == (20, 40, 3) and rgb.min() == 0 and rgb.max() == 255
    assert np.array_equal(rgb[0, :, 0], np.round(ramp[0] / 257).astype(np.uint8))

    photo = np.zeros((20, 40, 3), np.uint8)
    photo[:, :10] = 255                                    # a white band on the left as stored
    exif = Image.Exif()
    exif[0x0112] = 6                                       # Orientation: rotate 90 degrees clockwise to view
    Image.fromarray(photo).save(tmp_path / "side.jpg", exif=exif, quality=95)
    upright, _ = load_rgb(tmp_path / "side.jpg")
    assert upright.shape == (40, 20, 3)                    # turned as a viewer shows it
    assert upright[:10].mean() > 200 and upright[-10:].mean() < 50   # the band is now on top
