"""data_prep/abide.py on fixture downloads in both layouts, every bad input of the issue,
the real phenotypic file and atlases (when ../shared is present), and the ABIDE bundle
end to end through MONAI's bundle CLI."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import nibabel as nib
import numpy as np
import pandas as pd
import pytest

from medfl.fixtures import abide as abide_fixture
from medfl.fixtures import generate
from medfl.prep.abide import (
    CLASS_NAMES, GRID_AFFINE, GRID_SHAPE, NILEARN_QC, PHENOTYPIC_FILE, REGION_ORDER, REGIONS, SITES,
    assign_folds, atlas_for_manifest, crop_cc_atlas, label_atlas, load_volume, main, parse_subject,
    read_coordinates, read_phenotypic, resample_to_grid, resize_volume, rois_3mm_atlas, select_rows,
    sphere_atlas,
)
from medfl.prep.errors import PrepError

REPO = Path(__file__).resolve().parents[2]
BUNDLE = REPO / "bundles" / "abide"
DERIVS = ("reho", "degree_weighted", "lfcd", "vmhc")

#: FedSKD Table I: site -> (ASD, TC) after quality control, and region totals.
TABLE_I = {
    "LEUVEN": (26, 30), "MAX_MUN": (19, 27), "TRINITY": (19, 25), "SBL": (12, 14),
    "UCLA": (48, 37), "USM": (43, 24), "SDSU": (8, 19), "STANFORD": (12, 13), "OHSU": (12, 13),
    "CALTECH": (5, 10), "UM": (47, 73), "PITT": (24, 26), "CMU": (6, 5),
    "NYU": (74, 98), "YALE": (22, 19), "KKI": (12, 21), "OLIN": (14, 14),
}
TABLE_I_REGIONS = {"EUROPE": (172, 76, 96), "WEST_USA": (244, 128, 116),
                   "MIDDLE_USA": (181, 77, 104), "EAST_USA": (274, 122, 152)}


@pytest.fixture(scope="module", autouse=True)
def _quiet():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MEDFL_NO_PROGRESS", "1")
        yield


def _hashes(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def _prep(raw: Path, out: Path, *extra: str) -> pd.DataFrame:
    assert main(["--raw", str(raw), "--out", str(out), *extra]) == 0
    return pd.read_csv(out / "manifest.csv", dtype={"subject_id": str, "sex": str}, keep_default_na=False)


def _error(raw: Path, out: Path, *extra: str) -> PrepError:
    with pytest.raises(PrepError) as info:
        main(["--raw", str(raw), "--out", str(out), *extra])
    return info.value


def _edit_csv(path: Path, file_id: str, column: str, value: str | None) -> None:
    """Set ``column`` of the row of ``file_id`` (``value=None``: drop the column everywhere),
    keeping the file's format (quoting, first header cell empty)."""
    with path.open(newline="") as f:
        rows = list(csv.reader(f))
    col = rows[0].index(column)
    if value is None:
        rows = [r[:col] + r[col + 1:] for r in rows]
    else:
        fid = rows[0].index("FILE_ID")
        hit = [r for r in rows[1:] if r[fid] == file_id]
        assert hit, file_id
        hit[0][col] = value
    with path.open("w", newline="") as f:
        csv.writer(f, lineterminator="\n").writerows(rows)


# ----------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def raw16(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """16 subjects (4 per region), synthetic rows, PCP layout."""
    root = tmp_path_factory.mktemp("abide16") / "ABIDE_Initiative"
    return root, generate("abide", root, cases=16, seed=0, reference=False)


@pytest.fixture(scope="module")
def prepared(raw16, tmp_path_factory) -> dict[str, Any]:
    raw, info = raw16
    before = _hashes(raw)
    out = tmp_path_factory.mktemp("abide16_out") / "prepared"
    df = _prep(raw, out, "--atlas", "file", "--atlas-file", info["signal_atlas"])
    return {"raw": raw, "info": info, "out": out, "df": df, "before": before, "after": _hashes(raw)}


@pytest.fixture(scope="module")
def raw4(tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """4 subjects (one per region) for the bad-input cases; tests copy it before editing."""
    root = tmp_path_factory.mktemp("abide4") / "raw"
    return root, generate("abide", root, cases=4, seed=1, reference=False)


@pytest.fixture
def raw4_copy(raw4, tmp_path) -> tuple[Path, dict[str, Any]]:
    src, info = raw4
    dst = tmp_path / "raw"
    shutil.copytree(src, dst)
    return dst, info


def _folds(raw: Path) -> dict[str, int]:
    """FILE_ID -> fold, as main assigns them (default QC, 5 folds, seed 0)."""
    pheno = raw / PHENOTYPIC_FILE
    rows, _ = select_rows(read_phenotypic(pheno))
    subjects = [parse_subject(r, pheno) for _, r in rows.iterrows()]
    return {s.file_id: f for s, f in zip(subjects, assign_folds(subjects, 5, 0))}


def _train_subject(raw: Path) -> str:
    return next(fid for fid, fold in _folds(raw).items() if fold != 0)


def _deriv(raw: Path, file_id: str, d: str = "reho") -> Path:
    return raw / "Outputs" / "ccs" / "filt_noglobal" / d / f"{file_id}_{d}.nii.gz"


# ----------------------------------------------------------------------------- manifest

def test_manifest_labels_ids_sites_and_splits(prepared):
    df, info, raw = prepared["df"], prepared["info"], prepared["raw"]
    pheno = read_phenotypic(raw / PHENOTYPIC_FILE).set_index("FILE_ID")
    assert sorted(df["sample_id"]) == sorted(info["file_ids"]) and len(df) == 16
    assert info["qc_fail_file_id"] not in set(df["sample_id"])
    for r in df.itertuples():
        src = pheno.loc[r.sample_id]
        assert r.label == (1 if src["DX_GROUP"] == "1" else 0) and r.class_name == CLASS_NAMES[r.label]
        assert r.subject_id == src["SUB_ID"] and r.site_id == src["SITE_ID"]
        assert r.site == SITES[r.site_id] and r.region == REGIONS[r.site]
        assert r.region_client == REGION_ORDER.index(r.region) + 1
        assert r.sex == {"1": "M", "2": "F"}[src["SEX"]]
        assert r.age == pytest.approx(float(src["AGE_AT_SCAN"]))
        assert r.path == f"arrays/{r.sample_id}.npy"
        for d in DERIVS:
            assert getattr(r, f"image_{d}") == f"Outputs/ccs/filt_noglobal/{d}/{r.sample_id}_{d}.nii.gz"
    assert df["region"].value_counts().to_dict() == {r: 4 for r in REGION_ORDER}
    assert df["label"].value_counts().to_dict() == {0: 8, 1: 8}
    # splits: fold 0 is the test split; folds balanced; no subject in two splits
    assert set(df["split"]) == {"train", "test"}
    assert (df["split"] == "test").tolist() == (df["fold"] == 0).tolist()
    sizes = df["fold"].value_counts()
    assert set(sizes.index) == set(range(5)) and sizes.max() - sizes.min() <= 1
    assert df["subject_id"].is_unique
    assert not set(df.loc[df.split == "test", "subject_id"]) & set(df.loc[df.split == "train", "subject_id"])


def test_arrays_stack_the_four_derivatives_in_order(prepared):
    df, out, raw = prepared["df"], prepared["out"], prepared["raw"]
    for i, r in enumerate(df.itertuples()):
        arr = np.load(out / r.path)
        assert arr.shape == (4, *GRID_SHAPE) and arr.dtype == np.float32
        if i < 2:
            for c, d in enumerate(DERIVS):
                np.testing.assert_array_equal(arr[c], np.asanyarray(nib.load(raw / getattr(r, f"image_{d}")).dataobj))
    assert not df["resampled"].any()


def test_report_excluded_and_skipped(prepared):
    out, info = prepared["out"], prepared["info"]
    rep = json.loads((out / "report.json").read_text())
    c = rep["counts"]
    assert (c["phenotypic_rows"], c["excluded_no_filename"], c["excluded_qc"], c["written"]) == (18, 1, 1, 16)
    assert c["per_region"] == {r: 4 for r in REGION_ORDER} and c["array_shape"] == [4, 61, 73, 61]
    assert rep["num_skipped"] == 0 and pd.read_csv(out / "skipped.csv").empty
    assert c["atlas"] == "atlas/atlas.nii.gz" and c["atlas_regions"] == 24
    ex = pd.read_csv(out / "excluded.csv", dtype=str)
    assert ex.set_index("rule")["sub_id"]["no_filename"] == info["no_filename_sub_id"]
    qc = ex.set_index("rule").loc["qc"]
    assert qc["file_id"] == info["qc_fail_file_id"] and "qc_rater_1 = fail" in qc["reason"]


def test_raw_directory_unchanged(prepared):
    assert prepared["before"] == prepared["after"] and len(prepared["before"]) == 17 * 4 + 2


def test_atlas_from_user_file_is_resampled_onto_the_grid(prepared):
    out, info, df = prepared["out"], prepared["info"], prepared["df"]
    img = nib.load(out / "atlas" / "atlas.nii.gz")
    assert img.shape == GRID_SHAPE and np.allclose(img.affine, GRID_AFFINE)
    padded = np.asanyarray(nib.load(info["signal_atlas"]).dataobj)
    labels, table = atlas_for_manifest(out / "manifest.csv")
    np.testing.assert_array_equal(labels, padded[2:-2, 2:-2, 2:-2])
    assert labels.dtype == np.int32 and (df["atlas"] == "atlas/atlas.nii.gz").all()
    assert table["label"].tolist() == sorted(int(v) for v in np.unique(labels) if v > 0)
    assert table["voxels"].tolist() == [int((labels == v).sum()) for v in table["label"]]


def test_fixture_class_signal_is_learnable_and_sites_differ(prepared):
    df, out, info = prepared["df"], prepared["out"], prepared["info"]
    labels, _ = atlas_for_manifest(out / "manifest.csv")
    feats = []
    for p in df["path"]:
        arr = np.load(out / p)
        brain = arr[0] != 0
        feats.append([arr[c][labels == v].mean() / arr[c][brain].mean()
                      for c in range(4) for v in info["signal_labels"]])
    x, y = np.asarray(feats), df["label"].to_numpy()
    x = (x - x.mean(0)) / x.std(0)
    hits = 0
    for i in range(len(y)):  # leave-one-out nearest centroid on signal-region means
        keep = np.arange(len(y)) != i
        d = [np.linalg.norm(x[i] - x[keep & (y == k)].mean(0)) for k in (0, 1)]
        hits += int(np.argmin(d) == y[i])
    assert hits / len(y) >= 0.9
    site_mean = {s: np.mean([np.load(out / p)[1][np.load(out / p)[0] != 0].mean() for p in g["path"]])
                 for s, g in df.groupby("site_id")}
    assert max(site_mean.values()) / min(site_mean.values()) > 1.15


def test_fixture_is_deterministic(tmp_path):
    a = generate("abide", tmp_path / "a", cases=1, seed=3, reference=False)
    b = generate("abide", tmp_path / "b", cases=1, seed=3, reference=False)
    c = generate("abide", tmp_path / "c", cases=1, seed=4, reference=False)
    assert Path(a["phenotypic"]).read_bytes() == Path(b["phenotypic"]).read_bytes()
    fid = a["file_ids"][0]
    vol = [np.asanyarray(nib.load(_deriv(Path(i["root"]), fid, "lfcd")).dataobj) for i in (a, b)]
    np.testing.assert_array_equal(*vol)
    assert vol[0].dtype == np.float32 and vol[0].shape == GRID_SHAPE
    assert Path(c["phenotypic"]).read_bytes() != Path(a["phenotypic"]).read_bytes()
    header = Path(a["phenotypic"]).read_text().splitlines()[0].split(",")
    assert header[:3] == ["", "Unnamed: 0", "SUB_ID"] and len(header) == 106
    assert '"motion, large ventricles"' in Path(a["phenotypic"]).read_text() or \
        '"frontal lob gone, rest of brain warped"' in Path(a["phenotypic"]).read_text()


def test_overwrite_refused_then_allowed(raw4, tmp_path):
    raw, _ = raw4
    out = tmp_path / "out"
    _prep(raw, out, "--atlas", "none")
    (out / "arrays" / "stale.npy").write_bytes(b"x")
    err = _error(raw, out, "--atlas", "none")
    assert "already holds a manifest.csv" in str(err) and "--overwrite" in str(err)
    proc = subprocess.run([sys.executable, str(REPO / "data_prep" / "abide.py"), "--raw", str(raw),
                           "--out", str(out)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "manifest.csv" in proc.stderr
    df = _prep(raw, out, "--atlas", "none", "--overwrite", "--limit", "2")
    assert len(df) == 2 and sorted(p.name for p in (out / "arrays").iterdir()) == sorted(
        f"{s}.npy" for s in df["sample_id"])
    assert "--out" in str(_error(raw, raw / "inside"))


def test_nilearn_flat_layout_gives_the_same_dataset(raw4, tmp_path):
    raw_pcp, info = raw4
    flat = tmp_path / "nilearn_data"
    finfo = abide_fixture.generate(flat, cases=4, seed=1, reference=None, layout="nilearn")
    assert not (flat / "Outputs").exists() and (flat / "ABIDE_pcp" / PHENOTYPIC_FILE).is_file()
    a = _prep(raw_pcp, tmp_path / "a", "--atlas", "none")
    b = _prep(flat, tmp_path / "b", "--atlas", "none")
    assert b["image_path"].str.fullmatch(r"ABIDE_pcp/ccs/filt_noglobal/[^/]+_reho\.nii\.gz").all()
    cols = ["sample_id", "label", "subject_id", "site", "region", "sex", "split", "fold"]
    pd.testing.assert_frame_equal(a[cols], b[cols])
    assert sorted(b["sample_id"]) == sorted(finfo["file_ids"]) == sorted(info["file_ids"])
    for p in a["path"]:
        np.testing.assert_array_equal(np.load(tmp_path / "a" / p), np.load(tmp_path / "b" / p))
    assert json.loads((tmp_path / "b" / "report.json").read_text())["counts"]["layout"] == "nilearn"


def _gunzip_maps(root: Path) -> int:
    """Replace every ``*.nii.gz`` map under ``root`` by its ``.nii`` (as ``gunzip -r`` does)."""
    import gzip

    maps = [p for p in root.rglob("*.nii.gz") if "rois" not in p.parts]
    for p in maps:
        p.with_name(p.name[:-3]).write_bytes(gzip.decompress(p.read_bytes()))
        p.unlink()
    return len(maps)


def test_maps_saved_as_nii_instead_of_nii_gz_are_read(raw4_copy, tmp_path):
    """Issue 51, item 8: maps stored as ``.nii`` (gunzipped after download) gave "file not
    found ... pass --present-only", and with that "none of the 4 ... check --raw" while the maps
    were there; in the flat (nilearn) layout no maps were found at all. Both layouts read them,
    the same arrays; a map absent in both forms is named as such."""
    raw, _ = raw4_copy
    ref = _prep(raw, tmp_path / "ref", "--atlas", "none")
    assert _gunzip_maps(raw) >= len(ref) * len(DERIVS)
    got = _prep(raw, tmp_path / "nii", "--atlas", "none")
    assert got["image_path"].str.endswith("_reho.nii").all()
    for a, b in zip(ref["path"], got["path"]):
        np.testing.assert_array_equal(np.load(tmp_path / "ref" / a), np.load(tmp_path / "nii" / b))
    flat = tmp_path / "flat"
    abide_fixture.generate(flat, cases=4, seed=1, reference=None, layout="nilearn")
    _gunzip_maps(flat)
    assert sorted(_prep(flat, tmp_path / "flat_out", "--atlas", "none")["sample_id"]) == sorted(ref["sample_id"])
    victim = raw / ref["image_path"].iloc[0].replace(".nii.gz", ".nii")
    victim.unlink()
    msg = str(_error(raw, tmp_path / "gone", "--atlas", "none"))
    assert f"{victim.with_name(victim.name + '.gz')}: file not found (nor {victim.name})" in msg


def test_qc_options_and_mean_fd_threshold(raw4, tmp_path):
    raw, info = raw4
    everyone = _prep(raw, tmp_path / "none", "--qc", "none", "--atlas", "none")
    assert info["qc_fail_file_id"] in set(everyone["sample_id"]) and len(everyone) == 5
    fd = everyone.set_index("sample_id")["mean_fd"].drop(info["qc_fail_file_id"])
    threshold = float(np.median(fd))
    kept = _prep(raw, tmp_path / "fd", "--max-mean-fd", str(threshold), "--atlas", "none", "--test-fold", "none")
    assert set(kept["sample_id"]) == set(fd[fd <= threshold].index) and (kept["split"] == "train").all()
    ex = pd.read_csv(tmp_path / "fd" / "excluded.csv", dtype=str)
    assert set(ex.loc[ex.rule == "mean_fd", "file_id"]) == set(fd[fd > threshold].index)


# ----------------------------------------------------------------------------- bad input

def _truncate(p: Path) -> None:
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])


def _garbage(p: Path) -> None:
    p.write_bytes(b"this is not a NIfTI file" * 10)


def _wrong_grid(p: Path) -> None:
    nib.save(nib.Nifti1Image(np.ones((64, 64, 64), np.float32), np.diag([2.0, 2.0, 2.0, 1.0])), str(p))


BAD_FILES = [
    ("truncated", _truncate, "cannot read"),
    ("corrupt", _garbage, "cannot read"),
    ("missing", lambda p: p.unlink(), "file not found"),
    ("wrong_grid", _wrong_grid, "is not the ABIDE PCP grid; expected 61x73x61"),
]


@pytest.mark.parametrize("case,damage,message", BAD_FILES, ids=[c[0] for c in BAD_FILES])
def test_bad_derivative_file_stops_or_is_skipped(raw4_copy, tmp_path, case, damage, message):
    raw, info = raw4_copy
    victim = _train_subject(raw)
    path = _deriv(raw, victim, "lfcd")
    damage(path)
    err = _error(raw, tmp_path / "stop", "--atlas", "none")
    assert message in str(err) and str(path) in str(err) and err.item == str(path)
    assert not (tmp_path / "stop" / "manifest.csv").exists()
    df = _prep(raw, tmp_path / "skip", "--atlas", "none", "--skip-bad")
    assert victim not in set(df["sample_id"]) and len(df) == 3
    skipped = pd.read_csv(tmp_path / "skip" / "skipped.csv")
    assert skipped["item"].tolist() == [str(path)] and message in skipped["reason"].iloc[0]
    assert json.loads((tmp_path / "skip" / "report.json").read_text())["num_skipped"] == 1


def test_nonfinite_voxels_are_counted_per_subject(raw4_copy, tmp_path, capsys):
    """Issue 64, item 6: NaN and inf voxels were zeroed with no line naming the subject; now
    one stderr line per subject names it, the file and the NaN and inf counts, and report.json
    lists them per subject."""
    raw, _ = raw4_copy
    victim = _train_subject(raw)
    path = _deriv(raw, victim, "reho")
    img = nib.load(str(path))
    data = np.asanyarray(img.dataobj).astype(np.float32)
    live = np.argwhere(data != 0)
    for i, value in enumerate([np.nan] * 5 + [np.inf, np.inf, -np.inf]):
        data[tuple(live[i])] = value
    nib.save(nib.Nifti1Image(data, img.affine, img.header), str(path))
    capsys.readouterr()
    df = _prep(raw, tmp_path / "out", "--atlas", "none")
    rel = path.relative_to(raw).as_posix()
    lines = [line for line in capsys.readouterr().err.splitlines() if "non-finite" in line]
    sub_id = df.set_index("sample_id").loc[victim, "subject_id"]
    assert lines == [f"warning: subject {victim} (SUB_ID {sub_id}): zeroed non-finite voxels in {rel} (5 NaN, 3 inf)"]
    counts = json.loads((tmp_path / "out" / "report.json").read_text())["counts"]
    assert counts["nonfinite_voxels_zeroed"] == 8
    assert counts["nonfinite_voxels_zeroed_per_subject"] == {victim: {rel: {"nan": 5, "inf": 3}}}
    assert np.isfinite(np.load(tmp_path / "out" / df.set_index("sample_id").loc[victim, "path"])).all()


def test_wrong_grid_resampled_explicitly(raw4_copy, tmp_path):
    raw, info = raw4_copy
    victim = info["file_ids"][0]
    path = _deriv(raw, victim, "vmhc")
    data, affine = load_volume(path)
    # stored left-right flipped with a +3 mm x axis and padded by one voxel in y: same image
    flipped = np.zeros((61, 75, 61), np.float32)
    flipped[:, 1:74, :] = data[::-1]
    aff = np.array([[3.0, 0, 0, -90], [0, 3, 0, -129], [0, 0, 3, -72], [0, 0, 0, 1]])
    nib.save(nib.Nifti1Image(flipped, aff), str(path))
    assert "--resample linear" in str(_error(raw, tmp_path / "e", "--atlas", "none"))
    df = _prep(raw, tmp_path / "ok", "--atlas", "none", "--resample", "linear")
    row = df.set_index("sample_id").loc[victim]
    assert bool(row["resampled"]) and df["resampled"].sum() == 1
    np.testing.assert_allclose(np.load(tmp_path / "ok" / row["path"])[3], data, rtol=1e-5, atol=1e-5)


BAD_ROWS = [
    ("DX_GROUP", "ASD", "DX_GROUP = 'ASD' is not a known diagnosis; expected 1 (autism) or 2 (control)"),
    ("SITE_ID", "MARS", "SITE_ID = 'MARS' is not an ABIDE-I site"),
    ("SEX", "X", "SEX = 'X' is not a known sex code"),
    ("FILE_ID", "../escape", "FILE_ID = '../escape' is not a PCP file id"),
    ("SUB_ID", "duplicate", "already appears on line"),
]


@pytest.mark.parametrize("column,value,message", BAD_ROWS, ids=[f"{c[0]}={c[1]}" for c in BAD_ROWS])
def test_bad_phenotypic_row_stops_or_is_skipped(raw4_copy, tmp_path, column, value, message):
    raw, info = raw4_copy
    victim = _train_subject(raw)
    if value == "duplicate":
        value = next(f for f in info["file_ids"] if f != victim).rsplit("_", 1)[1].lstrip("0")
    _edit_csv(raw / PHENOTYPIC_FILE, victim, column, value)
    err = _error(raw, tmp_path / "stop", "--atlas", "none")
    assert message in str(err) and PHENOTYPIC_FILE in str(err) and "line" in err.item
    df = _prep(raw, tmp_path / "skip", "--atlas", "none", "--skip-bad")
    assert len(df) == 3 and (column == "SUB_ID" or victim not in set(df["sample_id"]))
    skipped = pd.read_csv(tmp_path / "skip" / "skipped.csv")
    assert len(skipped) == 1 and message in skipped["reason"].iloc[0]
    assert skipped["item"].iloc[0].startswith(f"{PHENOTYPIC_FILE} line ")


def test_missing_csv_column_is_fatal(raw4_copy, tmp_path):
    raw, _ = raw4_copy
    _edit_csv(raw / PHENOTYPIC_FILE, "", "DX_GROUP", None)
    for extra in ((), ("--skip-bad",)):
        err = str(_error(raw, tmp_path / f"o{len(extra)}", "--atlas", "none", *extra))
        assert "missing column(s) 'DX_GROUP'" in err and str(raw / PHENOTYPIC_FILE) in err


def test_missing_qc_column_names_it(raw4_copy, tmp_path):
    raw, _ = raw4_copy
    _edit_csv(raw / PHENOTYPIC_FILE, "", "qc_func_rater_3", None)
    assert "'qc_func_rater_3'" in str(_error(raw, tmp_path / "o", "--atlas", "none"))
    assert len(_prep(raw, tmp_path / "ok", "--atlas", "none", "--qc", "none")) == 5


def test_empty_split(raw4_copy, tmp_path):
    raw, info = raw4_copy
    err = str(_error(raw, tmp_path / "a", "--atlas", "none", "--test-fold", "4"))
    assert "split 'test' is empty" in err
    # the only test-fold subject unreadable: skipped, and then the split is empty
    test_ids = [fid for fid, fold in _folds(raw).items() if fold == 0]
    assert len(test_ids) == 1
    _deriv(raw, test_ids[0]).unlink()
    err = str(_error(raw, tmp_path / "b", "--atlas", "none", "--skip-bad"))
    assert "split 'test' is empty" in err


def test_missing_phenotypic_and_pipeline(raw4_copy, tmp_path):
    raw, _ = raw4_copy
    err = str(_error(raw, tmp_path / "p", "--atlas", "none", "--pipeline", "cpac"))
    assert "pipeline 'cpac'" in err and "found Outputs/ccs/filt_noglobal" in err
    (raw / PHENOTYPIC_FILE).unlink()
    err = str(_error(raw, tmp_path / "o", "--atlas", "none"))
    assert f"no {PHENOTYPIC_FILE} found" in err and "--phenotypic" in err


def test_bad_atlas_file(raw4, tmp_path):
    raw, _ = raw4
    float_map = tmp_path / "map.nii.gz"
    nib.save(nib.Nifti1Image(np.full(GRID_SHAPE, 0.5, np.float32), GRID_AFFINE), str(float_map))
    err = str(_error(raw, tmp_path / "o", "--atlas", "file", "--atlas-file", str(float_map)))
    assert str(float_map) in err and "not a label volume" in err
    err = str(_error(raw, tmp_path / "o2", "--atlas", "cc200"))
    assert "CC200.nii.gz not found" in err and "--atlas-file" in err


# ----------------------------------------------------------------------------- volumes and atlases

def test_resample_and_resize_geometry():
    rng = np.random.default_rng(0)
    vol = rng.random(GRID_SHAPE).astype(np.float32)
    # whole-voxel shift = exact crop; flipped axis with linear interpolation = exact
    big_aff = GRID_AFFINE.copy()
    big_aff[:3, 3] = GRID_AFFINE[:3, :3] @ [-1, -2, 0] + GRID_AFFINE[:3, 3]
    big = np.zeros((63, 77, 61), np.float32)
    big[1:62, 2:75] = vol
    np.testing.assert_array_equal(resample_to_grid(big, big_aff), vol)
    lr = np.array([[3.0, 0, 0, -90], [0, 3, 0, -126], [0, 0, 3, -72], [0, 0, 0, 1]])
    np.testing.assert_allclose(resample_to_grid(vol[::-1].copy(), lr, order=1), vol, atol=1e-6)
    # resize: stretch fills; pad keeps the aspect; the index map sends voxel centres home
    ones = np.ones(GRID_SHAPE, np.float32)
    s, m = resize_volume(ones, (24, 24, 24), "stretch")
    assert s.shape == (24, 24, 24) and np.allclose(s, 1.0)
    p, mp = resize_volume(ones, (24, 24, 24), "pad")
    extent = [int(np.any(p > 0.5, axis=tuple(a for a in range(3) if a != k)).sum()) for k in range(3)]
    assert extent == [20, 24, 20]
    labels = np.zeros(GRID_SHAPE, np.int32)
    labels[10:20, 30:40, 20:30] = 7
    for aspect in ("stretch", "pad", "crop"):
        small, mat = resize_volume(labels, (24, 24, 24), aspect, order=0)
        assert small.dtype == np.int32 and set(np.unique(small)) == {0, 7}
        centre_new = (mat @ np.r_[np.argwhere(small == 7).mean(0), 1])[:3]
        assert np.allclose(centre_new, [14.5, 34.5, 24.5], atol=1.5), aspect


def test_sphere_atlas_and_coordinates(tmp_path):
    coords = tmp_path / "c.csv"
    coords.write_text("ROI,X,Y,Z\n1,0,0,0\n2,30,-30,20\n3,3,0,0\n")
    labels, table = sphere_atlas(read_coordinates(coords), radius=5.0)
    assert table["overlap_voxels"].tolist()[1] == 0 and table.loc[0, "overlap_voxels"] > 0
    assert table["voxels"].sum() == int((labels > 0).sum())
    i, j, k = (np.linalg.inv(GRID_AFFINE) @ [30, -30, 20, 1])[:3].round().astype(int)
    assert labels[i, j, k] == 2
    coords.write_text("ROI,X,Y\n1,0,0\n")
    with pytest.raises(PrepError, match="expected x, y, z"):
        read_coordinates(coords)
    coords.write_text("ROI,X,Y,Z\n1,500,0,0\n")
    with pytest.raises(PrepError, match="outside"):
        sphere_atlas(read_coordinates(coords))


# ----------------------------------------------------------------------------- real metadata

def test_real_phenotypic_file(reference_data):
    path = reference_data / "abide_pcp" / PHENOTYPIC_FILE
    table = read_phenotypic(path)
    assert table.shape == (1112, 107) and table["SITE_ID"].nunique() == 20
    subjects = [parse_subject(r, path) for _, r in table.iterrows()]   # every row parses
    assert sum(s.sex == "M" for s in subjects) == 948 and sum(s.sex == "F" for s in subjects) == 164
    assert sum(s.label == 1 for s in subjects) == 539 and {s.site for s in subjects} == set(TABLE_I)
    kept, excluded = select_rows(table, "nilearn")
    rules = pd.Series([e["rule"] for e in excluded]).value_counts().to_dict()
    assert rules["no_filename"] == 77 and len(kept) == 871
    cohort = pd.DataFrame([vars(parse_subject(r, path)) for _, r in kept.iterrows()])
    assert (cohort["label"] == 1).sum() == 403 and (cohort["label"] == 0).sum() == 468
    per_site = cohort.groupby("site")["label"].agg(asd="sum", n="size")
    assert {s: (int(r.asd), int(r.n - r.asd)) for s, r in per_site.iterrows()} == TABLE_I
    per_region = cohort.groupby("region")["label"].agg(asd="sum", n="size")
    assert {g: (int(r.n), int(r.asd), int(r.n - r.asd)) for g, r in per_region.iterrows()} == TABLE_I_REGIONS
    # quoted fields with commas survive; -9999 is missing
    assert (table["qc_notes_rater_1"] == "frontal lob gone, rest of brain warped").any()
    assert cohort["mean_fd"].notna().all() and set(NILEARN_QC) <= set(table.columns)
    fd_kept, fd_ex = select_rows(table, "nilearn", max_mean_fd=0.2)
    assert len(fd_kept) == 871 - 91 and sum(e["rule"] == "mean_fd" for e in fd_ex) == 91


def test_real_atlases_on_the_grid(reference_data):
    rois = reference_data / "abide_pcp" / "rois"
    for name, n in (("CC200.nii.gz", 200), ("CC400.nii.gz", 392)):
        data, affine = load_volume(rois / name)
        assert data.shape == (63, 75, 61)
        labels, notes = crop_cc_atlas(data, affine, rois / name)
        assert labels.shape == GRID_SHAPE and notes == []
        assert len(np.unique(labels)) - 1 == n == len(np.unique(data)) - 1
        np.testing.assert_array_equal(labels, resample_to_grid(data.astype(np.int32), affine, order=0))
    data, affine = load_volume(rois / "rois_3mm.nii.gz")
    labels, notes = rois_3mm_atlas(data, affine)
    assert (data == 223).any() and not (labels == 223).any()
    assert sorted(np.unique(labels))[1:] == list(range(1, 161)) and "223" in notes[0]
    ho, notes = label_atlas(rois / "ho_mask_pad.nii.gz")   # 65x77x63, z origin -71: nearest resampling
    assert ho.shape == GRID_SHAPE and "nearest neighbour" in notes[0]
    assert set(np.unique(ho)) <= set(np.unique(load_volume(rois / "ho_mask_pad.nii.gz")[0]).astype(int))


def test_real_power264_spheres(reference_data):
    coords = read_coordinates(reference_data / "nilearn_coords" / "power_2011.csv")
    labels, table = sphere_atlas(coords, radius=5.0)
    assert len(table) == 264 and table["voxels"].between(16, 24).all()
    assert table["overlap_voxels"].sum() == 0 and table["voxels"].sum() == int((labels > 0).sum())


def test_fixture_rows_from_the_real_file(reference_data, tmp_path):
    info = generate("abide", tmp_path / "raw", cases=4, seed=2, reference=reference_data)
    real_lines = (reference_data / "abide_pcp" / PHENOTYPIC_FILE).read_text().splitlines()
    lines = Path(info["phenotypic"]).read_text().splitlines()
    assert lines[0] == real_lines[0] and set(lines[1:]) <= set(real_lines[1:]) and len(lines) == 7
    assert info["reference"] and info["signal_atlas_source"].startswith("CC200")
    cc200 = reference_data / "abide_pcp" / "rois" / "CC200.nii.gz"
    df = _prep(tmp_path / "raw", tmp_path / "out", "--atlas-file", str(cc200))
    real = read_phenotypic(reference_data / "abide_pcp" / PHENOTYPIC_FILE).set_index("FILE_ID")
    assert sorted(df["sample_id"]) == sorted(info["file_ids"])
    for r in df.itertuples():
        assert r.label == {"1": 1, "2": 0}[real.loc[r.sample_id, "DX_GROUP"]]
        assert r.site_id == real.loc[r.sample_id, "SITE_ID"]
    rep = json.loads((tmp_path / "out" / "report.json").read_text())["counts"]
    assert rep["atlas_name"] == "cc200" and rep["atlas_regions"] == 200


# ----------------------------------------------------------------------------- bundle

def test_bundle_runs_end_to_end(raw16, tmp_path, run_bundle):
    raw, info = raw16
    data = tmp_path / "data"
    df = _prep(raw, data, "--size", "24", "--atlas", "file", "--atlas-file", info["signal_atlas"])
    assert np.load(data / df["path"].iloc[0]).shape == (4, 24, 24, 24)
    small = nib.load(data / "atlas" / "atlas_24x24x24.nii.gz")
    grid_labels, table = atlas_for_manifest(data / "manifest.csv")
    assert grid_labels.shape == (24, 24, 24) and (df["atlas"] == "atlas/atlas_24x24x24.nii.gz").all()
    big = table.sort_values("voxels").iloc[-1]
    centre = (small.affine @ np.r_[np.argwhere(grid_labels == big["label"]).mean(0), 1])[:3]
    assert np.allclose(centre, big[["x", "y", "z"]].to_numpy(float), atol=4.0)

    base = ["--bundle_root", tmp_path, "--dataset_dir", data, "--spatial_size", "[24,24,24]"]
    run_bundle(BUNDLE / "configs" / "train.json", *base, "--fl#rounds", "1", "--fl#model#width", "4",
               "--fl#progress", "False")
    exp = tmp_path / "runs" / "abide"
    for label in ("fedavg", "local"):
        summary = json.loads((exp / label / "summary.json").read_text())
        assert summary["rounds"] == 1 and summary["num_clients"] == 4
    part = pd.read_csv(exp / "fedavg" / "partition.csv", dtype=str).merge(df[["sample_id", "region", "split"]])
    clients = part[part.role != "global_test"]
    assert sorted(clients["client_name"].unique()) == ["1_EUROPE", "2_WEST_USA", "3_MIDDLE_USA", "4_EAST_USA"]
    assert (clients["client_name"].str[2:] == clients["region"]).all()
    assert sorted(part.loc[part.role == "global_test", "sample_id"]) == sorted(df.loc[df.split == "test", "sample_id"])

    run_bundle(BUNDLE / "configs" / "inference.json", *base)
    pred = pd.read_csv(exp / "fedavg" / "predictions.csv")
    assert len(pred) == 4 * int((df["split"] == "test").sum())
    assert np.allclose(pred[["prob_control", "prob_autism"]].sum(axis=1), 1.0, atol=1e-5)
    assert set(pred["prediction"]) <= {0, 1}


def test_a_probability_map_stored_as_integers_is_not_an_atlas(tmp_path):
    """Issue 19: a grey-matter probability map (0..255) was accepted as a 255-region atlas."""
    import nibabel as nib

    from medfl.prep.abide import GRID_AFFINE, GRID_SHAPE, check_label_volume, label_atlas

    z, y, x = np.meshgrid(*[np.linspace(-1, 1, n) for n in GRID_SHAPE], indexing="ij")
    gm = np.clip(255 * np.exp(-(x ** 2 + y ** 2 + z ** 2) * 2) * (0.75 + 0.25 * np.sin(9 * x)), 1, 255)
    path = tmp_path / "gm_prob.nii.gz"
    nib.save(nib.Nifti1Image(gm.round().astype(np.uint8), GRID_AFFINE), path)
    with pytest.raises(PrepError, match="neighbouring voxels share a value only"):
        label_atlas(path)
    with pytest.raises(PrepError, match="non-integer values: a probability or intensity map"):
        check_label_volume(gm / 255, "gm.nii.gz")
    i, j, k = np.indices(GRID_SHAPE)
    blocks = ((i // 6) * 100 + (j // 6) * 10 + k // 6 + 1).astype(np.int16)   # 6-voxel cubes: piecewise constant
    assert check_label_volume(blocks, "blocks").max() == blocks.max()


def test_the_real_atlases_pass_the_label_check(reference_data):
    import nibabel as nib

    from medfl.prep.abide import check_label_volume

    for name in ("CC200.nii.gz", "CC400.nii.gz", "rois_3mm.nii.gz", "aal_mask_pad.nii.gz", "ho_mask_pad.nii.gz"):
        data = np.asarray(nib.load(reference_data / "abide_pcp" / "rois" / name).dataobj)
        assert check_label_volume(data, name).max() > 100
