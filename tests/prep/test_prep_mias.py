"""data_prep/mias.py on fixture data: Info.txt in all its line forms, P5 PGMs, labels,
woman-grouped splits, ROI crops at the bottom-left-origin coordinates, every bad input, the
real Info.txt, and the bundle through MONAI's CLI."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pytest

from medfl.fixtures import mias as fx
from medfl.prep import mias
from medfl.prep.common import run_script
from medfl.prep.errors import PrepError

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "mias"
SIZE = 32  # cached array side in these tests


# ----------------------------------------------------------------------------------- helpers

def tree_hash(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root`` by relative path."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def prep(raw: Path, out: Path, *extra: str) -> pd.DataFrame:
    """Run data_prep's main; return the manifest."""
    assert mias.main(["--raw", str(raw), "--out", str(out), "--size", str(SIZE), *extra]) == 0
    return pd.read_csv(out / "manifest.csv", keep_default_na=False, dtype={"severity": str})


def info_lines(raw: Path) -> list[str]:
    return (raw / "Info.txt").read_bytes().decode("ascii").split("\n")


def set_info_line(raw: Path, refnum: str, new: Callable[[str], str], nth: int = 0) -> str:
    """Rewrite the ``nth`` Info.txt line of ``refnum``; return the line's reference."""
    lines = info_lines(raw)
    idx = [i for i, s in enumerate(lines) if s.startswith(refnum + " ")][nth]
    lines[idx] = new(lines[idx])
    (raw / "Info.txt").write_bytes("\n".join(lines).encode("ascii"))
    return f"Info.txt line {idx + 1}"


@pytest.fixture(scope="module")
def raw_syn(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Synthetic-row fixture: 20 images (10 women), 128 x 128."""
    out = tmp_path_factory.mktemp("mias") / "raw"
    info = fx.generate(out, cases=20, seed=0, reference=None)
    assert info["images"] == 20 and info["women"] == 10 and info["rows_from"] == "synthetic"
    return out


@pytest.fixture
def raw_copy(raw_syn: Path, tmp_path: Path) -> Path:
    """A private copy of the synthetic fixture, free to damage."""
    return Path(shutil.copytree(raw_syn, tmp_path / "raw"))


# ----------------------------------------------------------------------------------- fixture

def test_fixture_writes_info_txt_like_the_real_one_and_p5_pgms(raw_syn: Path, tmp_path: Path):
    from PIL import Image

    data = (raw_syn / "Info.txt").read_bytes()
    assert data.startswith(b"REFNUM BG CLASS SEVERITY X Y RADIUS \n")
    assert not data.endswith(b"\n") and b"  " not in data and b"\r" not in data
    lines = data.decode("ascii").split("\n")[1:]
    forms = {(len(s.split()), s.endswith(" ")) for s in lines}
    # NORM lines keep a trailing space, 7-token lines have none, 4-token lines both ways
    assert forms == {(3, True), (7, False), (4, False), (4, True)}
    rows = mias.parse_info(raw_syn / "Info.txt")
    assert len(rows) == 20 and sum(map(len, rows.values())) == len(lines)
    assert {r.severity for r in rows["mdb001"]} == {"B", "M"}      # mdb144's quirk
    assert any(len(v) > 1 and len({r.severity for r in v}) == 1 for v in rows.values())
    for ref in rows:
        path = raw_syn / fx.IMAGE_DIR / f"{ref}.pgm"
        assert path.read_bytes().startswith(b"P5\n128 128\n255\n")
        pgm = mias.read_pgm(path)
        assert pgm.pixels.dtype == np.uint8 and pgm.shape == (128, 128) and pgm.maxval == 255
        with Image.open(path) as im:                               # a real PGM: PIL agrees
            assert im.format == "PPM" and np.array_equal(np.asarray(im), pgm.pixels)
    # deterministic for a seed, different for another
    fx.generate(tmp_path / "a", cases=4, seed=0)
    fx.generate(tmp_path / "b", cases=4, seed=1)
    fx.generate(tmp_path / "c", cases=4, seed=0)
    a, b, c, full = (tree_hash(p) for p in (tmp_path / "a", tmp_path / "b", tmp_path / "c",
                                            raw_syn))
    assert a == c and a != b and len(a) == 5
    assert a["all-mias/mdb001.pgm"] == full["all-mias/mdb001.pgm"]  # per-image seeding


def test_fixture_draws_findings_at_bottom_left_origin(raw_syn: Path):
    """Masses are brighter than the ring around them at row = (1024 - Y) * H / 1024; at the
    top-left reading (row = Y) they are not."""
    def contrast(img: np.ndarray, row: float, col: float, r: float) -> float:
        yy, xx = np.mgrid[:img.shape[0], :img.shape[1]] + 0.5
        d = np.hypot(yy - row, xx - col)
        return float(img[d < 0.5 * r].mean() - img[(d > 1.3 * r) & (d < 2 * r)].mean())

    right, wrong = [], []
    for rows in mias.parse_info(raw_syn / "Info.txt").values():
        img = mias.read_pgm(raw_syn / fx.IMAGE_DIR / f"{rows[0].refnum}.pgm").pixels.astype(float)
        for r in rows:
            if r.abnormality in ("CIRC", "SPIC", "MISC") and r.has_coordinates:
                row, col = mias.info_to_pixel(r.x, r.y, img.shape)
                rad = r.radius * img.shape[0] / 1024
                right.append(contrast(img, row, col, rad))
                wrong.append(contrast(img, r.y * img.shape[0] / 1024, col, rad))
    assert len(right) >= 3 and min(right) > 10
    assert np.mean(np.array(right) > np.array(wrong) + 10) >= 0.8


def test_fixture_cli_writes_the_raw_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    from medfl.fixtures.__main__ import main as fixtures_main

    assert fixtures_main(["mias", "--out", str(tmp_path), "--cases", "3", "--seed", "2",
                          "--synthetic-rows"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["images"] == 3 and info["size"] == fx.DEFAULT_SIZE
    assert sorted(p.name for p in (tmp_path / "all-mias").iterdir()) == [
        "mdb001.pgm", "mdb002.pgm", "mdb003.pgm"]


def test_info_to_pixel_and_subject_of():
    assert mias.info_to_pixel(535, 425, (1024, 1024)) == (599.0, 535.0)   # row = 1024 - y
    assert mias.info_to_pixel(535, 425, (128, 128)) == (74.875, 66.875)
    assert [mias.subject_of(n) for n in (1, 2, 3, 144, 322)] == [
        "mias_w001", "mias_w001", "mias_w002", "mias_w072", "mias_w161"]


# -------------------------------------------------------------------------------- data_prep

def test_prep_whole_images(raw_syn: Path, tmp_path: Path):
    before = tree_hash(raw_syn)
    m = prep(raw_syn, tmp_path / "out")
    assert tree_hash(raw_syn) == before
    rows = mias.parse_info(raw_syn / "Info.txt")
    assert list(m.columns[:9]) == ["sample_id", "path", "image_path", "label", "class_name",
                                   "subject_id", "site", "sex", "split"]
    assert m["sample_id"].tolist() == sorted(rows)                          # one row per image
    expected = {ref: mias.image_label(v) for ref, v in rows.items()}
    assert dict(zip(m["sample_id"], m["class_name"])) == expected
    assert expected["mdb001"] == "malignant"                                # B and M: M wins
    names = ["normal", "benign", "malignant"]
    assert (m["label"] == m["class_name"].map(names.index)).all()
    assert set(m["class_name"]) == set(names)
    assert (m["subject_id"] == [mias.subject_of(int(s[3:])) for s in m["sample_id"]]).all()
    assert (m["site"] == "MIAS").all() and (m["sex"] == "F").all()
    assert set(m["split"]) == {"train", "test"}
    assert m.groupby("subject_id")["split"].nunique().max() == 1            # no woman in two splits
    assert m.loc[m["sample_id"] == "mdb005", "abnormality"].item() == "CALC;CALC"
    assert (m["image_path"] == [f"all-mias/{s}.pgm" for s in m["sample_id"]]).all()
    for rel in m["path"]:
        arr = np.load(tmp_path / "out" / rel)
        assert arr.shape == (1, SIZE, SIZE) and arr.dtype == np.float32
        assert 0 <= arr.min() and arr.max() <= 1 and arr.std() > 0.05
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    c = report["counts"]
    assert c["images_in_info"] == 20 and c["samples"] == 20 and c["skipped"] == 0
    assert c["classes"] == m["class_name"].value_counts().reindex(names, fill_value=0).to_dict()
    assert c["splits"]["test"] == (m["split"] == "test").sum() > 0
    assert c["original_sizes"] == {"128x128": 20}
    assert pd.read_csv(tmp_path / "out" / "skipped.csv").empty


def test_prep_benign_malignant_roi(raw_syn: Path, tmp_path: Path):
    """B-vs-M ROI crops: normal images left out, one crop per line with coordinates, centred
    on (row, col) = (1024 - Y, X) scaled; lines without coordinates listed as skipped."""
    m = prep(raw_syn, tmp_path / "out", "--classes", "benign-malignant", "--roi",
             "--roi-size", "200")
    rows = [r for v in mias.parse_info(raw_syn / "Info.txt").values() for r in v if r.severity]
    with_xy = [r for r in rows if r.has_coordinates]
    assert len(m) == len(with_xy) and set(m["class_name"]) == {"benign", "malignant"}
    assert (m["label"] == (m["class_name"] == "malignant").astype(int)).all()
    lines_of = {r.refnum: [q.line for q in rows if q.refnum == r.refnum] for r in rows}
    assert m["sample_id"].tolist() == [f"{r.refnum}_roi{lines_of[r.refnum].index(r.line) + 1}"
                                       for r in with_xy]
    skipped = pd.read_csv(tmp_path / "out" / "skipped.csv")
    assert len(skipped) == len(rows) - len(with_xy) > 0 and (skipped["stage"] == "roi").all()
    assert skipped["reason"].str.contains("no coordinates").all()
    side = np.maximum(200, 2 * m["radius"].astype(float) * 1.2) * 128 / 1024
    assert np.allclose(m["roi_side"], side, atol=0.01)
    assert np.allclose(m["roi_row"], (1024 - m["y"].astype(float)) * 128 / 1024, atol=0.01)
    assert np.allclose(m["roi_col"], m["x"].astype(float) * 128 / 1024, atol=0.01)
    centre, border = [], []
    for rel, cls in zip(m["path"], m["abnormality"]):
        a = np.load(tmp_path / "out" / rel)[0]
        assert a.shape == (SIZE, SIZE) and a.dtype == np.float32
        if cls in ("CIRC", "SPIC", "MISC"):
            centre.append(a[12:20, 12:20].mean())
            border.append(np.r_[a[:3].ravel(), a[-3:].ravel()].mean())
    assert np.all(np.array(centre) > np.array(border))
    assert m.groupby("subject_id")["split"].nunique().max() == 1


def test_prep_three_class_roi_crops_normal_breasts(raw_syn: Path, tmp_path: Path):
    m = prep(raw_syn, tmp_path / "out", "--roi", "--test-fraction", "0")
    normals = m[m["class_name"] == "normal"]
    assert len(normals) == sum(mias.image_label(v) == "normal"
                               for v in mias.parse_info(raw_syn / "Info.txt").values())
    assert normals["sample_id"].str.endswith("_roi").all() and (normals["label"] == 0).all()
    for rel in normals["path"]:   # centred on the breast: tissue, not film background
        assert np.load(tmp_path / "out" / rel)[0].mean() > 0.25
    assert (m["split"] == "train").all()
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert any("--test-fraction 0" in n for n in report["notes"])


def test_subject_split_is_grouped_stratified_and_seeded():
    subjects = [mias.subject_of(n) for n in range(1, 41)]
    labels = [0, 0, 1, 0, 2, 0, 1, 1] * 5
    a = mias.subject_split(subjects, labels, 0.25, seed=0)
    assert a == mias.subject_split(subjects, labels, 0.25, seed=0)
    assert a != mias.subject_split(subjects, labels, 0.25, seed=1)
    worst = {s: max(y for t, y in zip(subjects, labels) if t == s) for s in set(subjects)}
    for stratum in (0, 1, 2):
        members = [s for s in worst if worst[s] == stratum]
        assert sum(a[s] == "test" for s in members) == round(0.25 * len(members))
    assert set(mias.subject_split(subjects, labels, 0.0, 0).values()) == {"train"}
    # a stratum of two women still gives one to test, a lone woman stays in train
    assert sorted(mias.subject_split(["a", "b", "c"], [1, 1, 2], 0.1, 0).values()) == [
        "test", "train", "train"]


def test_prep_accepts_flat_layout_headerless_info_and_pgm_comments(raw_copy: Path, tmp_path: Path):
    for p in (raw_copy / "all-mias").iterdir():
        p.rename(raw_copy / p.name)
    (raw_copy / "all-mias").rmdir()
    lines = info_lines(raw_copy)
    (raw_copy / "Info.txt").rename(raw_copy / "info.TXT")
    (raw_copy / "info.TXT").write_bytes("\r\n".join(lines[1:]).encode("ascii") + b"\r\n")
    data = (raw_copy / "mdb002.pgm").read_bytes()
    (raw_copy / "mdb002.pgm").write_bytes(b"P5\n# CREATOR: scanner\n128 128 # size\n255\n"
                                          + data[15:])
    (raw_copy / "mdb099.pgm").write_bytes(data)                             # not in Info.txt
    m = prep(raw_copy, tmp_path / "out", "--limit", "6")
    assert m["sample_id"].tolist() == [f"mdb00{i}" for i in range(1, 7)]
    assert m["image_path"].tolist()[0] == "mdb001.pgm"
    prep(raw_copy, tmp_path / "out2", "--limit", "2", "--info", "info.TXT", "--test-fraction", "0")
    assert np.array_equal(np.load(tmp_path / "out" / "arrays/mdb002.npy"),
                          np.load(tmp_path / "out2" / "arrays/mdb002.npy"))
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["counts"]["info_header"] is False
    assert any("mdb099" in n for n in report["notes"])


def test_overwrite_refused_then_replaces_and_removes_stale_arrays(raw_syn: Path, tmp_path: Path):
    out = tmp_path / "out"
    prep(raw_syn, out)
    with pytest.raises(PrepError, match="already holds a manifest.csv.*--overwrite"):
        prep(raw_syn, out)
    m = prep(raw_syn, out, "--overwrite", "--limit", "6", "--test-fraction", "0.3")
    assert len(m) == 6 and sorted(p.name for p in (out / "arrays").iterdir()) == sorted(
        f"{s}.npy" for s in m["sample_id"])
    with pytest.raises(PrepError, match="test split is empty"):   # a failed --overwrite run
        prep(raw_syn, out, "--overwrite", "--limit", "2")          # keeps the earlier dataset whole
    assert pd.read_csv(out / "manifest.csv")["sample_id"].tolist() == m["sample_id"].tolist()
    assert sorted(p.name for p in (out / "arrays").iterdir()) == sorted(f"{s}.npy" for s in m["sample_id"])
    with pytest.raises(PrepError, match="inside --raw"):
        prep(raw_syn, raw_syn / "prepared")
    assert not (raw_syn / "prepared").exists()


def test_run_script_prints_one_error_line(raw_copy: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]):
    (raw_copy / "all-mias" / "mdb003.pgm").unlink()
    with pytest.raises(SystemExit) as exc:
        run_script(mias.main, ["--raw", str(raw_copy), "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    # the error is one line (libraries imported on the way may print their own notices)
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: mdb003.pgm: image missing")


# Per-image bad inputs: (id, damage(raw) -> skipped item, message pattern, sample that goes).
def _pgm(raw: Path, new: Callable[[bytes], bytes]) -> str:
    p = raw / "all-mias" / "mdb004.pgm"
    p.write_bytes(new(p.read_bytes()))
    return str(p.resolve())


def _truncate(raw: Path) -> str:
    return _pgm(raw, lambda b: b[:3000])


def _bad_magic(raw: Path) -> str:
    return _pgm(raw, lambda b: b"\x89PNG\r\n\x1a\n" + b"\0" * 64)


def _ascii_pgm(raw: Path) -> str:
    return _pgm(raw, lambda b: b"P2\n2 2\n255\n0 1 2 3\n")


def _bad_header(raw: Path) -> str:
    return _pgm(raw, lambda b: b.replace(b"128 128", b"128 x28", 1))


def _empty(raw: Path) -> str:
    return _pgm(raw, lambda b: b"")


def _token(i: int, value: str) -> Callable[[str], str]:
    """Replace token ``i`` of a line."""
    def edit(line: str) -> str:
        tok = line.split()
        tok[i] = value
        return " ".join(tok)
    return edit


def _missing(raw: Path) -> str:
    (raw / "all-mias" / "mdb004.pgm").unlink()
    return "mdb004.pgm"


def _severity(raw: Path) -> str:
    return set_info_line(raw, "mdb005", _token(3, "X"), nth=1)


def _abnormality(raw: Path) -> str:
    return set_info_line(raw, "mdb005", _token(2, "LUMP"), nth=0)


def _background(raw: Path) -> str:
    return set_info_line(raw, "mdb005", _token(1, "Q"), nth=0)


def _tokens(raw: Path) -> str:
    return set_info_line(raw, "mdb005", lambda s: " ".join(s.split()[:5]), nth=0)


def _off_frame(raw: Path) -> str:
    return set_info_line(raw, "mdb005", lambda s: " ".join(s.split()[:4] + ["1500", "20", "9"]))


def _coordinate_text(raw: Path) -> str:
    return set_info_line(raw, "mdb005", lambda s: " ".join(s.split()[:6] + ["r9"]))


def _norm_with_severity(raw: Path) -> str:
    return set_info_line(raw, "mdb004", lambda s: s.rstrip() + " B")


BAD_INPUTS = [
    ("truncated_pgm", _truncate, r"mdb004\.pgm: truncated P5 PGM: expected 16384 bytes of pixel "
     r"data \(128 x 128, maxval 255.*found 2985", "mdb004"),
    ("png_renamed", _bad_magic,
     r"mdb004\.pgm: not a binary PGM.*a PNG.*expected the magic number 'P5'", "mdb004"),
    ("ascii_pgm", _ascii_pgm, r"mdb004\.pgm: not a binary PGM.*ASCII \(P2\)", "mdb004"),
    ("bad_pgm_header", _bad_header, r"mdb004\.pgm: bad P5 PGM header: expected height", "mdb004"),
    ("empty_pgm", _empty, r"mdb004\.pgm: an empty file \(0 bytes\)", "mdb004"),
    ("missing_image", _missing, r"mdb004\.pgm: image missing \(listed by Info\.txt line \d+\)",
     "mdb004"),
    ("unknown_severity", _severity, r"Info\.txt line \d+, field SEVERITY: unknown code 'X'",
     "mdb005"),
    ("unknown_class", _abnormality, r"Info\.txt line \d+, field CLASS: unknown code 'LUMP'",
     "mdb005"),
    ("unknown_background", _background, r"field BG: unknown code 'Q'", "mdb005"),
    ("five_tokens", _tokens, r"Info\.txt line \d+: 5 tokens.*expected 3 .*4 .*or 7", "mdb005"),
    ("off_frame", _off_frame, r"fields X Y: \(1500, 20\) lies outside the 1024 x 1024", "mdb005"),
    ("coordinate_not_int", _coordinate_text, r"field RADIUS: 'r9'; expected a non-negative integer",
     "mdb005"),
    ("norm_with_severity", _norm_with_severity, r"a NORM line has exactly 3 tokens", "mdb004"),
]


@pytest.mark.parametrize("damage,pattern,gone", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_stops_or_is_skipped(raw_copy: Path, tmp_path: Path, damage, pattern, gone):
    assert len(mias.parse_info(raw_copy / "Info.txt")["mdb005"]) == 2  # two lines, as assumed
    item = damage(raw_copy)
    before = tree_hash(raw_copy)
    with pytest.raises(PrepError, match=pattern):
        prep(raw_copy, tmp_path / "stop")
    assert not (tmp_path / "stop" / "manifest.csv").exists()
    m = prep(raw_copy, tmp_path / "skip", "--skip-bad")
    assert tree_hash(raw_copy) == before
    assert gone not in set(m["sample_id"]) and len(m) == 19
    skipped = pd.read_csv(tmp_path / "skip" / "skipped.csv")
    assert item in set(skipped["item"])
    assert skipped.loc[skipped["item"] == item, "reason"].str.contains(pattern).any()
    report = json.loads((tmp_path / "skip" / "report.json").read_text())
    assert report["num_skipped"] == len(skipped) >= 1
    if gone == "mdb005":  # the image's other line is valid, but the image is dropped
        assert "mdb005" in set(skipped["item"])


def test_missing_info_column_is_fatal_even_with_skip_bad(raw_copy: Path, tmp_path: Path):
    lines = info_lines(raw_copy)
    lines[0] = "REFNUM BG CLASS X Y RADIUS "
    (raw_copy / "Info.txt").write_bytes("\n".join(lines).encode("ascii"))
    with pytest.raises(PrepError,
                       match=r"Info\.txt line 1 \(header\): missing column\(s\) 'SEVERITY'"):
        prep(raw_copy, tmp_path / "out", "--skip-bad")


def test_missing_info_txt_and_empty_info(raw_copy: Path, tmp_path: Path):
    (raw_copy / "Info.txt").write_bytes(b"\n  \n")
    with pytest.raises(PrepError, match=r"Info\.txt: empty; expected a header line"):
        prep(raw_copy, tmp_path / "a")
    (raw_copy / "Info.txt").write_bytes(fx.HEADER.encode("ascii"))
    with pytest.raises(PrepError, match=r"Info\.txt: a header line and no data lines"):
        prep(raw_copy, tmp_path / "a", "--skip-bad")
    (raw_copy / "Info.txt").write_bytes(b"mdb001,G,NORM\n")
    with pytest.raises(PrepError, match=r"Info\.txt line 1: 'mdb001,G,NORM'; expected the header"):
        prep(raw_copy, tmp_path / "a", "--skip-bad")
    (raw_copy / "Info.txt").unlink()
    with pytest.raises(PrepError, match=r"no Info\.txt in it.*--info"):
        prep(raw_copy, tmp_path / "b")


def test_empty_split_is_an_error(raw_copy: Path, tmp_path: Path):
    with pytest.raises(PrepError, match=r"--test-fraction 0.2: the test split is empty \(1 woman"):
        prep(raw_copy, tmp_path / "a", "--limit", "2")
    assert not (tmp_path / "a" / "manifest.csv").exists()
    files = sorted((raw_copy / "all-mias").iterdir())
    for p in files[1:]:                                  # all but mdb001 truncated
        p.write_bytes(b"P5\n128 128\n255\n")
    with pytest.raises(PrepError, match="the test split is empty"):
        prep(raw_copy, tmp_path / "b", "--skip-bad")
    report = json.loads((tmp_path / "b.failed" / "report.json").read_text())
    assert report["num_skipped"] == 19 and report["counts"]["samples"] == 1
    files[0].write_bytes(b"P5\n128 128\n255\n")
    with pytest.raises(PrepError, match="no samples left to write.*skipped.csv"):
        prep(raw_copy, tmp_path / "c", "--skip-bad", "--test-fraction", "0")
    assert len(pd.read_csv(tmp_path / "c.failed" / "skipped.csv")) == 20
    assert not any((tmp_path / d).exists() for d in ("a", "b", "c"))


PGM_CASES = [
    ("comments", b"P5 # a\n#b\n3 2\n255\n" + bytes(range(6)), (2, 3), 255, 0),
    ("sixteen_bit", b"P5\n2 1\n1023\n" + np.array([5, 1023], ">u2").tobytes(), (1, 2), 1023, 0),
    ("trailing", b"P5\n1 1\n255\n\x07\x00\x00", (1, 1), 255, 2),
]


@pytest.mark.parametrize("data,shape,maxval,trailing", [c[1:] for c in PGM_CASES],
                         ids=[c[0] for c in PGM_CASES])
def test_read_pgm_header_forms(tmp_path: Path, data: bytes, shape, maxval, trailing):
    p = tmp_path / "x.pgm"
    p.write_bytes(data)
    img = mias.read_pgm(p)
    assert img.shape == shape and img.maxval == maxval and img.trailing_bytes == trailing
    if maxval == 1023:
        assert img.pixels.tolist() == [[5, 1023]]


def test_read_pgm_rejects_values_above_maxval(tmp_path: Path):
    p = tmp_path / "x.pgm"
    p.write_bytes(b"P5\n2 1\n100\n\x05\xc8")
    with pytest.raises(PrepError, match=r"x\.pgm: pixel value 200 above the header's maxval 100"):
        mias.read_pgm(p)


# ---------------------------------------------------------------------------- real metadata

def test_real_info_txt_parses_with_the_quoted_counts(reference_data: Path):
    path = reference_data / "mias" / "Info.txt"
    data = path.read_bytes()
    assert not data.endswith(b"\n")
    header, lines = mias.read_info_lines(path)
    assert header == "REFNUM BG CLASS SEVERITY X Y RADIUS " and len(lines) == 330
    assert sum(t.endswith(" ") for _, t in lines) == 209
    rows = mias.parse_info(path)
    assert len(rows) == 322 and list(rows)[0] == "mdb001" and list(rows)[-1] == "mdb322"
    labels = pd.Series({ref: mias.image_label(v) for ref, v in rows.items()}).value_counts()
    assert labels.to_dict() == {"normal": 207, "benign": 63, "malignant": 52}
    assert sorted(ref for ref, v in rows.items() if len(v) > 1) == [
        "mdb005", "mdb132", "mdb144", "mdb223", "mdb226", "mdb239", "mdb249"]
    no_xy = [r.refnum for v in rows.values() for r in v if r.severity and not r.has_coordinates]
    assert no_xy == ["mdb059", "mdb216", "mdb233", "mdb245"]
    assert mias.image_label(rows["mdb144"]) == "malignant"
    assert {len(t.split()) for _, t in lines} == {3, 4, 7}
    row, col = mias.info_to_pixel(rows["mdb001"][0].x, rows["mdb001"][0].y, (1024, 1024))
    assert (row, col) == (1024 - 425, 535)
    women = {mias.subject_of(int(ref[3:])) for ref in rows}
    assert len(women) == 161


def test_reference_fixture_uses_real_lines_verbatim(reference_data: Path, tmp_path: Path):
    info = fx.generate(tmp_path / "raw", cases=12, seed=0, reference=reference_data)
    assert info["rows_from"] == "reference" and info["images"] == 12
    real = (reference_data / "mias" / "Info.txt").read_bytes().decode("ascii").split("\n")
    mine = info_lines(tmp_path / "raw")
    assert mine[0] == real[0] and set(mine[1:]) <= set(real[1:])
    assert [real.index(s) for s in mine[1:]] == sorted(real.index(s) for s in mine[1:])
    got = [s.split()[0] for s in mine[1:]]
    assert {"mdb143", "mdb144", "mdb059", "mdb060", "mdb233", "mdb234"} <= set(got)  # the quirks
    m = prep(tmp_path / "raw", tmp_path / "out", "--test-fraction", "0.34")
    real_rows = mias.parse_info(reference_data / "mias" / "Info.txt")
    assert dict(zip(m["sample_id"], m["class_name"])) == {
        ref: mias.image_label(real_rows[ref]) for ref in dict.fromkeys(got)}
    assert m.groupby("subject_id")["sample_id"].count().eq(2).all()        # whole women
    assert m.groupby("subject_id")["split"].nunique().max() == 1


# ----------------------------------------------------------------------------------- bundle

def test_bundle_runs_with_monai_bundle_cli_then_inference(raw_syn: Path, tmp_path: Path, run_bundle):
    from medfl.bundle import load_bundle_config

    data = tmp_path / "data"
    m = prep(raw_syn, data, "--test-fraction", "0.3")
    common = ["--bundle_root", str(tmp_path), "--dataset_dir", str(data), "--image_size", str(SIZE)]
    run_bundle(BUNDLE / "configs" / "train.json", *common, "--fl#rounds", "1",
               "--fl#num_clients", "2", "--fl#partition#min_size", "4", "--fl#train#batch_size", "8",
               "--fl#model", "{'name': 'resnet10', 'width': 4}", "--fl#progress", "False")
    exp = tmp_path / "runs" / "mias"
    for label in ("fedavg", "local"):
        summary = json.loads((exp / label / "summary.json").read_text())
        assert summary["rounds"] == 1 and summary["num_clients"] == 2
        assert 0 <= summary["final"]["global_test"]["accuracy"]["mean"] <= 1
    part = pd.read_csv(exp / "partition.csv", keep_default_na=False)
    test_ids = set(m.loc[m["split"] == "test", "sample_id"])
    assert set(part.loc[part["role"] == "global_test", "sample_id"]) == test_ids
    assert (exp / "comparison.csv").is_file()

    run_bundle(BUNDLE / "configs" / "inference.json", *common)
    pred = pd.read_csv(exp / "fedavg" / "predictions.csv")
    assert list(pred.columns[-3:]) == ["prob_normal", "prob_benign", "prob_malignant"]
    assert len(pred) == 2 * len(test_ids) and set(pred["sample_id"]) == test_ids
    probs = pred[["prob_normal", "prob_benign", "prob_malignant"]]
    assert np.allclose(probs.sum(axis=1), 1, atol=1e-4)

    # the method is overridable from the command line
    fl = load_bundle_config(BUNDLE / "configs" / "train.json", {
        "dataset_dir": str(data), "fl#methods": [{"name": "fedprox", "mu": 0.01}]})
    assert fl["methods"] == [{"name": "fedprox", "mu": 0.01}]
    assert fl["dataset"]["path"] == f"{data}/manifest.csv" and fl["dataset"]["cache"] == "memory"


def test_info_txt_with_a_utf8_bom_is_read(raw_syn: Path, raw_copy: Path, tmp_path: Path):
    """Issue 19: an Info.txt saved by an editor with a UTF-8 BOM failed as 'not a text file'
    (the other scripts accept a BOM)."""
    plain = prep(raw_syn, tmp_path / "plain")
    info = raw_copy / "Info.txt"
    info.write_bytes(b"\xef\xbb\xbf" + info.read_bytes())
    assert prep(raw_copy, tmp_path / "bom").drop(columns=["image_path"]).equals(plain.drop(columns=["image_path"]))


# ------------------------------------------------------------------- issue 39, items 15, 17

def test_a_folder_name_that_is_not_utf8_keeps_the_dataset(raw_syn: Path, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str]):
    """Issue 39, item 15: an image folder named with a byte that is not UTF-8 (b'\\xff') stopped
    the script with UnicodeEncodeError when the manifest was written, after every image was
    read, and the finished dataset was discarded. The manifest (a UTF-8 CSV) now holds the
    name with a \\xNN escape and the report says so; the arrays are those of the plain folder;
    a bad file in it is listed in skipped.csv, escaped too."""
    ref = prep(raw_syn, tmp_path / "ref")
    raw = Path(shutil.copytree(raw_syn, tmp_path / "raw"))
    os.rename(bytes(raw / fx.IMAGE_DIR), bytes(raw) + b"/all-mias\xff")
    got = prep(raw, tmp_path / "out")
    assert list(got["image_path"]) == [p.replace("all-mias/", "all-mias\\xff/") for p in ref["image_path"]]
    for a, b in zip(got["path"], ref["path"]):
        assert np.array_equal(np.load(tmp_path / "out" / a), np.load(tmp_path / "ref" / b))
    notes = json.loads((tmp_path / "out" / "report.json").read_text())["notes"]
    assert any("not valid UTF-8" in n and "image_path=all-mias\\xff/mdb" in n for n in notes), notes
    assert "warning: 20 manifest value(s) name a file whose name is not valid UTF-8" in capsys.readouterr().err
    victim = Path(os.fsdecode(bytes(raw) + b"/all-mias\xff/mdb004.pgm"))
    victim.write_bytes(victim.read_bytes()[:3000])
    got = prep(raw, tmp_path / "skip", "--skip-bad")
    assert len(got) == len(ref) - 1
    skipped = pd.read_csv(tmp_path / "skip" / "skipped.csv")
    assert skipped["item"].iloc[0].endswith("all-mias\\xff/mdb004.pgm")
    assert "all-mias\\xff/mdb004.pgm: truncated P5 PGM" in skipped["reason"].iloc[0]


def test_a_huge_sparse_file_named_pgm_is_refused_unread(raw_copy: Path, tmp_path: Path):
    """Issue 39, item 17: a 2 GiB sparse file named .pgm was read whole (2.2 GB peak) before it
    was refused. Now only the header is read first: zeros are not a P5 PGM, a real header
    followed by gigabytes is far larger than its raster needs, a header announcing 10000 x
    10000 pixels is above the limit; none costs memory, and the script skips such a file
    with --skip-bad."""
    import tracemalloc

    from medfl.prep.common import MAX_IMAGE_PIXELS

    pgm = raw_copy / "all-mias" / "mdb004.pgm"
    mias.read_pgm(pgm)                                      # imports done before measuring
    cases = [(b"", r"not a binary PGM: starts with b'\\x00"),
             (b"P5\n128 128\n255\n", r"2147483648 bytes, far more than its header's image \(128 x 128, maxval 255\) "
                                     r"needs: 16384 bytes of pixel data after a 15-byte header"),
             (b"P5\n10000 10000\n255\n", rf"its header announces 10000 x 10000 = 100000000 pixels, above the "
                                         rf"limit of {MAX_IMAGE_PIXELS}")]
    for head, message in cases:
        pgm.write_bytes(head)
        os.truncate(pgm, 2 << 30)
        tracemalloc.start()
        try:
            with pytest.raises(PrepError, match=r"mdb004.pgm: " + message):
                mias.read_pgm(pgm)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 4 << 20, f"{head!r}: {peak} bytes allocated to refuse it"
    got = prep(raw_copy, tmp_path / "skip", "--skip-bad")
    assert "mdb004" not in set(got["refnum"]) and len(got) == 19
    skipped = pd.read_csv(tmp_path / "skip" / "skipped.csv")
    assert list(skipped["item"]) == [str(pgm.resolve())] and "above the limit" in skipped["reason"].iloc[0]


def test_a_pgm_header_that_does_not_end_in_its_first_bytes_is_refused(tmp_path: Path):
    """Only the first PGM_HEADER_BYTES are read for the header: one longer (a comment of
    megabytes) is refused by name, not misread as a truncated file."""
    p = tmp_path / "x.pgm"
    p.write_bytes(b"P5\n#" + b"c" * mias.PGM_HEADER_BYTES + b"\n1 1\n255\n\x07")
    with pytest.raises(PrepError, match=rf"x.pgm: bad P5 PGM header: it does not end in the first "
                                        rf"{mias.PGM_HEADER_BYTES} bytes"):
        mias.read_pgm(p)
