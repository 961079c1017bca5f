"""CBIS-DDSM: the fixture in all three layouts, data_prep's labels, splits and errors, the
real CSVs, and the bundle end to end."""

from __future__ import annotations

import hashlib
import json
import re
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pydicom
import pytest

from medfl.fixtures.cbis_ddsm import generate, write_mg_dicom
from medfl.prep.cbis_ddsm import main, read_case_csvs
from medfl.prep.common import MAX_IMAGE_PIXELS
from medfl.prep.dicom import read_dicom
from medfl.prep.errors import PrepError

BUNDLE = Path(__file__).resolve().parents[2] / "bundles" / "cbis_ddsm"
SIZE = ["48", "32"]


def _hashes(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def prep(raw: Path, out: Path, *extra: str) -> pd.DataFrame:
    os.environ["MEDFL_NO_PROGRESS"] = "1"
    assert main(["--raw", str(raw), "--out", str(out), "--size", *SIZE, *extra]) == 0
    return pd.read_csv(out / "manifest.csv", keep_default_na=False)


@pytest.fixture(scope="module")
def raws(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("cbis")
    return {layout: Path(generate(base / layout, cases=16, seed=3, reference=None, layout=layout)["root"])
            for layout in ("tcia", "uid5", "classic")}


def test_three_layouts_give_the_same_dataset(raws, tmp_path):
    before = {k: _hashes(v) for k, v in raws.items()}
    m = {k: prep(v, tmp_path / k) for k, v in raws.items()}
    ref = m["tcia"]
    for layout in ("uid5", "classic"):
        assert m[layout][["sample_id", "label", "split", "subject_id"]].equals(ref[["sample_id", "label", "split", "subject_id"]])
        for sid, rel in zip(ref["sample_id"], ref["path"]):
            row = m[layout][m[layout]["sample_id"] == sid].iloc[0]
            assert np.array_equal(np.load(tmp_path / "tcia" / rel), np.load(tmp_path / layout / row["path"]))
    assert {k: _hashes(v) for k, v in raws.items()} == before  # the raw trees are untouched
    rep = json.loads((tmp_path / "uid5" / "report.json").read_text())
    assert rep["counts"]["layout"] == "uid5" and rep["counts"]["samples_written"] == len(ref) == 16
    assert json.loads((tmp_path / "tcia" / "report.json").read_text())["counts"]["layout"] == "tcia (metadata.csv)"
    x = np.load(tmp_path / "tcia" / ref["path"].iloc[0])
    assert x.dtype == np.float32 and x.shape == (1, 48, 32) and 0 <= x.min() and x.max() <= 1
    # image-level label: malignant iff any abnormality is; BENIGN_WITHOUT_CALLBACK is benign
    abn = read_case_csvs(raws["tcia"])
    for _, r in ref.iterrows():
        paths = abn[abn["image file path"].str.split("/").str[0] == r["sample_id"]]["pathology"]
        assert r["label"] == int((paths == "MALIGNANT").any())
        assert r["class_name"] == ["benign", "malignant"][r["label"]]
    assert "BENIGN_WITHOUT_CALLBACK" in set(abn["pathology"])
    # no patient in both splits
    assert not set(ref.loc[ref["split"] == "train", "subject_id"]) & set(ref.loc[ref["split"] == "test", "subject_id"])


def test_older_tcia_folder_names_and_one_abnormality_type(raws, tmp_path):
    """The older download: ``1-full mammogram images-<5>/000000.dcm``, no metadata.csv."""
    import shutil

    raw = tmp_path / "old"
    shutil.copytree(raws["uid5"], raw)
    for d in sorted((raw / "CBIS-DDSM").glob("*/*/*.000000-*"), reverse=True):
        desc_uid = d.name.split(".000000-", 1)[1]
        new = d.with_name("1-" + desc_uid)
        d.rename(new)
        for i, f in enumerate(sorted(new.glob("1-*.dcm"))):
            f.rename(new / f"00000{i}.dcm")
    assert not list(raw.rglob("1-1.dcm"))
    ref = prep(raws["tcia"], tmp_path / "ref")
    old = prep(raw, tmp_path / "o")
    assert old[["sample_id", "label", "split"]].equals(ref[["sample_id", "label", "split"]])
    assert old["image_path"].str.contains("/1-full mammogram images-").all()
    calc = prep(raw, tmp_path / "c", "--abnormality", "calc")
    assert len(calc) and set(calc["abnormality_type"]) == {"calc"}
    assert calc["sample_id"].str.startswith("Calc-").all()
    assert set(calc["sample_id"]) == set(ref.loc[ref["abnormality_type"] == "calc", "sample_id"])


def test_csv_quirks_are_read(raws):
    abn = read_case_csvs(raws["tcia"])
    assert "breast_density" in abn.columns and "breast density" not in abn.columns
    assert (abn["breast_density"] != "").all()
    assert not abn["ROI mask file path"].str.contains("\n").any()  # newline inside quotes stripped
    raw_text = (raws["tcia"] / "mass_case_description_train_set.csv").read_text()
    assert '.dcm\n"' in raw_text  # the fixture keeps the quirk
    assert ((abn["kind"] == "mass") & (abn["mass margins"] == "")).any()  # N/A -> missing
    assert set(read_case_csvs(raws["tcia"], "mass")["kind"]) == {"mass"}


def test_patient_overlap_rules(raws, tmp_path):
    moved = prep(raws["classic"], tmp_path / "m")
    dropped = prep(raws["classic"], tmp_path / "d", "--patient-overlap", "drop-train")
    assert len(dropped) == len(moved) - 1  # the fixture's shared patient has one train image
    with pytest.raises(PrepError, match="patient.s. in both the train and the test CSVs, e.g. P_00001"):
        prep(raws["classic"], tmp_path / "e", "--patient-overlap", "error")


def test_roi_crops_tell_mask_from_crop_by_content(raws, tmp_path):
    m = prep(raws["tcia"], tmp_path / "roi", "--roi-crops", "--roi-size", "24", "24")
    abn = read_case_csvs(raws["tcia"])
    assert len(m) == len(abn)  # one sample per abnormality, including masks off by a few pixels
    for _, r in m.iterrows():
        x = np.load(tmp_path / "roi" / r["path"])
        assert x.shape == (1, 24, 24) and x.max() > 0
    # the fixture numbers crop and mask files 1-1/1-2 in both orders; content decides
    d = next(p for p in (raws["tcia"] / "CBIS-DDSM").rglob("*ROI mask images*") if p.is_dir())
    bits = sorted(int(pydicom.dcmread(f).BitsStored) for f in d.glob("*.dcm"))
    assert bits == [8, 16]


def test_fixture_dicom_tags(raws):
    f = next((raws["tcia"] / "CBIS-DDSM").rglob("*full mammogram images*/1-1.dcm"))
    ds = pydicom.dcmread(f)
    assert ds.file_meta.TransferSyntaxUID == "1.2.840.10008.1.2"  # Implicit VR Little Endian
    assert ds.SOPClassUID == "1.2.840.10008.5.1.4.1.1.7" and ds.Modality == "MG"
    assert ds.PhotometricInterpretation == "MONOCHROME2" and ds.BitsStored == 16 and ds.PixelRepresentation == 0
    assert ds.PatientID == f.parts[-4] and ds.Laterality in ("L", "R") and "PixelSpacing" not in ds


def test_monochrome1_is_inverted(tmp_path):
    px = np.array([[0, 1000], [65535, 30000]], dtype=np.uint16)
    write_mg_dicom(tmp_path / "m2.dcm", px, "P", "1.2.3", "1.2.4", "full mammogram images", "L", "CC")
    write_mg_dicom(tmp_path / "m1.dcm", px, "P", "1.2.3", "1.2.4", "full mammogram images", "L", "CC",
                   photometric="MONOCHROME1")
    a, _ = read_dicom(tmp_path / "m2.dcm")
    b, _ = read_dicom(tmp_path / "m1.dcm")
    assert np.allclose(a, px / 65535) and np.allclose(b, 1 - px / 65535)


def test_compressed_without_decoder_names_the_decoder(tmp_path, monkeypatch):
    from pydicom.encaps import encapsulate
    from pydicom.uid import JPEG2000Lossless

    write_mg_dicom(tmp_path / "c.dcm", np.zeros((8, 8), np.uint16), "P", "1.2.3", "1.2.4", "x", "L", "CC")
    ds = pydicom.dcmread(tmp_path / "c.dcm")
    ds.file_meta.TransferSyntaxUID = JPEG2000Lossless
    ds.PixelData = encapsulate([b"\xff\x4f\xff\x51" + b"\x00" * 40])
    ds["PixelData"].VR = "OB"
    ds.save_as(tmp_path / "c.dcm", enforce_file_format=True)
    import medfl.prep.dicom as dicom

    # issue 19: with a decoder installed, a bogus stream must not ask to install one
    monkeypatch.setattr(dicom, "_decoder_available", lambda ts: True)
    with pytest.raises(PrepError, match=r"(?s)JPEG 2000.*the installed decoder could not decode it") as e:
        read_dicom(tmp_path / "c.dcm")
    assert "Install" not in str(e.value)
    monkeypatch.setattr(dicom, "_decoder_available", lambda ts: False)
    with pytest.raises(PrepError, match=r"(?s)c.dcm: compressed transfer syntax .*JPEG 2000.*pylibjpeg"):
        read_dicom(tmp_path / "c.dcm")


def _jpeg12(levels: list[list[int]]) -> bytes:
    """A 12-bit JPEG Extended stream (SOF1, Huffman) of constant 8 x 8 blocks, ``levels``
    (0..4095) one per block: only DC coefficients (quantiser 1), so any decoder gives the
    levels back exactly. Pillow cannot decode 12-bit JPEG; libjpeg (pylibjpeg-libjpeg) can."""
    import struct

    lv = np.asarray(levels, dtype=np.int64)

    def seg(marker: int, body: bytes) -> bytes:
        return struct.pack(">BBH", 0xFF, marker, len(body) + 2) + body

    head = (seg(0xDB, bytes([0]) + bytes([1] * 64))                                       # quantiser 1
            + seg(0xC1, struct.pack(">BHHB", 12, lv.shape[0] * 8, lv.shape[1] * 8, 1) + bytes([1, 0x11, 0]))
            + seg(0xC4, bytes([0x00, 0, 0, 0, 0, 16] + [0] * 11) + bytes(range(16)))   # DC: 16 codes of 5 bits
            + seg(0xC4, bytes([0x10, 1] + [0] * 15 + [0]))                              # AC: EOB only, "0"
            + seg(0xDA, bytes([1, 1, 0x00, 0, 63, 0])))
    bits, prev = "", 0
    for v in lv.reshape(-1):
        coef = 8 * (int(v) - 2048)                      # DC of a constant block, level shift 2048
        diff, prev = coef - prev, coef
        cat = abs(diff).bit_length()
        bits += format(cat, "05b") + (format(diff if diff > 0 else diff + (1 << cat) - 1, f"0{cat}b") if cat else "")
        bits += "0"                                     # end of block
    bits += "1" * (-len(bits) % 8)
    scan = bytes(int(bits[i:i + 8], 2) for i in range(0, len(bits), 8)).replace(b"\xff", b"\xff\x00")
    return b"\xff\xd8" + head + scan + b"\xff\xd9"


def test_a_12bit_jpeg_dicom_decodes_with_the_dicom_extra_and_names_it_without(tmp_path, monkeypatch):
    """Issue 51, item 8: a 12-bit JPEG Extended DICOM (other mammography sources than
    CBIS-DDSM use it) was "damaged or its header disagrees" when Pillow was pydicom's only
    decoder. With the ``dicom`` extra (pylibjpeg, its JPEG and JPEG 2000 plugins) it decodes
    exactly, as does a JPEG 2000 one; with Pillow alone the error names the syntax and the extra."""
    from pydicom.encaps import encapsulate
    from pydicom.pixels import get_decoder
    from pydicom.uid import JPEG2000Lossless, JPEGExtended12Bit

    levels = [[100, 4095], [2048, 1234], [0, 3000]]
    path = tmp_path / "j12.dcm"
    write_mg_dicom(path, np.zeros((24, 16), np.uint16), "P", "1.2.3", "1.2.4", "x", "L", "CC")
    ds = pydicom.dcmread(path)
    ds.file_meta.TransferSyntaxUID = JPEGExtended12Bit
    ds.BitsStored, ds.HighBit = 12, 11
    ds.PixelData = encapsulate([_jpeg12(levels)])
    ds["PixelData"].VR = "OB"
    ds.save_as(path, enforce_file_format=True)
    decoder = get_decoder(JPEGExtended12Bit)
    if "pylibjpeg" in decoder.available_plugins:    # medfl[dicom] (the test extra brings it)
        x, facts = read_dicom(path)
        assert facts["bits"] == 12 and facts["transfer_syntax"] == JPEGExtended12Bit and x.shape == (24, 16)
        assert np.array_equal(np.round(x * 4095).astype(int), np.kron(levels, np.ones((8, 8), int)))
        px = (np.arange(32 * 32).reshape(32, 32) * 173 % 65536).astype(np.uint16)
        write_mg_dicom(tmp_path / "j2k.dcm", px, "P", "1.2.3", "1.2.4", "x", "L", "CC")
        j2k = pydicom.dcmread(tmp_path / "j2k.dcm")
        j2k.compress(JPEG2000Lossless)
        j2k.save_as(tmp_path / "j2k.dcm", enforce_file_format=True)
        y, facts = read_dicom(tmp_path / "j2k.dcm")
        assert facts["transfer_syntax"] == JPEG2000Lossless and np.array_equal(np.round(y * 65535), px)
        # what a machine without the extra has: Pillow alone
        monkeypatch.setattr(decoder, "_available", {k: v for k, v in decoder._available.items() if k == "pillow"})
    with pytest.raises(PrepError) as e:
        read_dicom(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: compressed transfer syntax JPEG Extended (Process 2 and 4) (1.2.840.10008.1.2.4.51)")
    assert 'pip install "medfl[dicom]"' in msg and "damaged or its header" not in msg


def test_an_empty_case_csv_says_it_is_empty(raws, tmp_path):
    """Issue 64, item 6: an empty case CSV said "missing column(s) ...; found" with nothing
    after it; a CSV of a header alone was the same (the header was taken from the first row)."""
    raw = _copy(raws["classic"], tmp_path / "raw")
    name = raw / "calc_case_description_test_set.csv"
    header = name.read_text(encoding="utf-8-sig").splitlines()[0]
    for text, message in [("", r"an empty file \(0 bytes\); expected a CBIS-DDSM case-description CSV"),
                          ("\ufeff\r\n", r"empty \(no header row, no columns, no rows\); expected a CSV with columns "
                                         r"'patient_id'"),
                          (header + "\n", r"no rows, only the header")]:
        name.write_text(text, encoding="utf-8")
        with pytest.raises(PrepError, match=rf"^{re.escape(str(name))}: {message}") as e:
            prep(raw, tmp_path / "out")
        assert "\n" not in str(e.value) and "found" not in str(e.value)
    assert not (tmp_path / "out").exists()


def test_an_undecodable_dicom_names_its_syntax_and_the_decoders_in_one_line(raws, tmp_path, monkeypatch):
    """Issue 64, item 6: a DICOM that pydicom's installed decoders cannot decode (pydicom's
    own JPEG-lossy.dcm: only GDCM reads it) was "damaged" over three lines without naming
    python-gdcm; one line now names the file, the syntax (name and UID) and the packages of
    pydicom's other decoders for it (pydicom's plugin table). A JPEG Baseline 8-bit DICOM made
    here with Pillow decodes; with no decoder installed the line names what to install."""
    import io

    from PIL import Image
    from pydicom.data import get_testdata_file
    from pydicom.encaps import encapsulate
    from pydicom.pixels import get_decoder
    from pydicom.uid import JPEGBaseline8Bit, JPEGExtended12Bit

    lossy = get_testdata_file("JPEG-lossy.dcm")
    if lossy is not None and "gdcm" not in get_decoder(JPEGExtended12Bit).available_plugins:
        raw = _copy(raws["tcia"], tmp_path / "raw")
        victim = sorted(raw.rglob("*full mammogram images*/1-1.dcm"))[0]
        ds = pydicom.dcmread(lossy)
        ds.Modality = "MG"          # an NM image in pydicom's test data
        ds.save_as(victim, enforce_file_format=True)
        with pytest.raises(PrepError) as e:
            prep(raw, tmp_path / "out")
        msg = str(e.value)
        assert msg.startswith(f"{victim}: compressed transfer syntax JPEG Extended (Process 2 and 4) "
                              "(1.2.840.10008.1.2.4.51): ") and "\n" not in msg
        assert "pip install python-gdcm" in msg and not (tmp_path / "out").exists()
    px = (np.arange(16 * 24).reshape(16, 24) % 256).astype(np.uint8)
    path = tmp_path / "baseline.dcm"
    write_mg_dicom(path, px, "P", "1.2.3", "1.2.4", "x", "L", "CC", bits=8)
    ds = pydicom.dcmread(path)
    jpeg = io.BytesIO()
    Image.fromarray(px).save(jpeg, format="JPEG", quality=95)
    ds.file_meta.TransferSyntaxUID = JPEGBaseline8Bit
    ds.PixelData = encapsulate([jpeg.getvalue()])
    ds["PixelData"].VR = "OB"
    ds.save_as(path, enforce_file_format=True)
    decoder = get_decoder(JPEGBaseline8Bit)
    if decoder.available_plugins:
        x, facts = read_dicom(path)
        assert facts["transfer_syntax"] == JPEGBaseline8Bit and np.abs(x * 255 - px).max() < 8
    monkeypatch.setattr(decoder, "_available", {})       # a machine without any of pydicom's decoders
    with pytest.raises(PrepError) as e:
        read_dicom(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}: compressed transfer syntax JPEG Baseline (Process 1) (1.2.840.10008.1.2.4.50): "
                          "no decoder for it is installed. Install pydicom's decoders: pip install \"medfl[dicom]\"")
    assert "\n" not in msg and ("gdcm" in decoder.available_plugins or "or pip install python-gdcm" in msg)


def test_a_dicom_data_set_without_the_part10_header_is_read(raws, tmp_path):
    """Issue 51, item 8: a DICOM written without the Part-10 header (no preamble, ``DICM`` or
    file meta; pydicom reads it with ``force=True``) was "not a DICOM file". It is read by its
    own encoding, the same pixels, and report.json says which files had no header; bytes that
    are no data set at all are still "not a DICOM file"."""
    from pydicom.filebase import DicomBytesIO
    from pydicom.filewriter import write_dataset

    raw = _copy(raws["classic"], tmp_path / "raw")
    ref = prep(raws["classic"], tmp_path / "ref")
    victim = raw / ref["image_path"].iloc[0]
    fp = DicomBytesIO()
    fp.is_little_endian, fp.is_implicit_VR = True, True
    write_dataset(fp, pydicom.dcmread(victim))
    victim.write_bytes(fp.getvalue())
    assert victim.read_bytes()[128:132] != b"DICM"
    got = prep(raw, tmp_path / "out")
    assert np.array_equal(np.load(tmp_path / "out" / got["path"].iloc[0]), np.load(tmp_path / "ref" / ref["path"].iloc[0]))
    notes = json.loads((tmp_path / "out" / "report.json").read_text())["notes"]
    assert any("1 image(s) without the DICOM Part-10 header" in n and ref["image_path"].iloc[0] in n for n in notes)
    victim.write_bytes(b"\x08\x00\x05\x00CS\x0a\x00ISO_IR 100" + b"not a dicom at all" * 10)
    with pytest.raises(PrepError, match="not a DICOM file"):
        read_dicom(victim)


def _copy(src: Path, dst: Path) -> Path:
    import shutil

    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("case, message", [
    ("corrupt", "not a DICOM file"),
    ("truncated", "pixel data unreadable, probably truncated"),
    ("missing", "no .dcm file in the series folder"),
])
def test_bad_files_stop_or_are_skipped(raws, tmp_path, case, message):
    raw = _copy(raws["classic"], tmp_path / "raw")
    m = prep(raws["classic"], tmp_path / "ok")
    victim_rel = m["image_path"].iloc[0]
    victim = raw / victim_rel
    if case == "corrupt":
        victim.write_bytes(b"not a dicom at all" * 10)
    elif case == "truncated":
        data = victim.read_bytes()
        victim.write_bytes(data[: len(data) - 500])
    else:
        victim.unlink()
    with pytest.raises(PrepError, match=message):
        prep(raw, tmp_path / "stop")
    got = prep(raw, tmp_path / "skip", "--skip-bad")
    assert len(got) == len(m) - 1
    skipped = pd.read_csv(tmp_path / "skip" / "skipped.csv")
    assert len(skipped) == 1 and message in skipped["reason"].iloc[0]


def test_bad_csvs_and_empty_split(raws, tmp_path):
    raw = _copy(raws["classic"], tmp_path / "raw")
    name = raw / "calc_case_description_test_set.csv"
    df = pd.read_csv(name, dtype=str, keep_default_na=False)
    df.drop(columns="pathology").to_csv(name, index=False)
    with pytest.raises(PrepError, match=r"calc_case_description_test_set.csv: missing column\(s\) 'pathology'"):
        prep(raw, tmp_path / "a")
    df.assign(pathology=["MALIGNANT"] + ["MAYBE"] * (len(df) - 1)).to_csv(name, index=False)
    with pytest.raises(PrepError, match=r"line 3: unknown pathology 'MAYBE'"):
        prep(raw, tmp_path / "b")
    df.to_csv(name, index=False)
    (raw / "mass_case_description_train_set.csv").unlink()
    with pytest.raises(PrepError, match="mass_case_description_train_set.csv: case-description CSV not found"):
        prep(raw, tmp_path / "c")
    # every test image unreadable: an empty split is an error even with --skip-bad
    raw2 = _copy(raws["classic"], tmp_path / "raw2")
    m = prep(raws["classic"], tmp_path / "ok")
    for rel in m.loc[m["split"] == "test", "image_path"]:
        (raw2 / rel).unlink()
    with pytest.raises(PrepError, match="the test split is empty"):
        prep(raw2, tmp_path / "d", "--skip-bad")
    assert (tmp_path / "d.failed" / "skipped.csv").is_file() and not (tmp_path / "d").exists()   # no half output


def test_out_rules(raws, tmp_path):
    prep(raws["classic"], tmp_path / "o")
    with pytest.raises(PrepError, match="already holds a manifest.csv"):
        prep(raws["classic"], tmp_path / "o")
    prep(raws["classic"], tmp_path / "o", "--overwrite")
    with pytest.raises(PrepError, match="inside --raw"):
        prep(raws["classic"], raws["classic"] / "prepared")


def test_real_csvs(reference_data, tmp_path):
    root = reference_data / "cbis_ddsm_csv"
    abn = read_case_csvs(tmp_path, csv_dir=root)
    sizes = abn.groupby("csv").size().to_dict()
    assert sizes == {"mass_case_description_train_set.csv": 1318, "mass_case_description_test_set.csv": 378,
                     "calc_case_description_train_set.csv": 1546, "calc_case_description_test_set.csv": 326}
    assert abn["image file path"].str.split("/").str[0].nunique() == 3103
    assert set(abn["pathology"]) == {"MALIGNANT", "BENIGN", "BENIGN_WITHOUT_CALLBACK"}
    calc_test = abn[abn["csv"] == "calc_case_description_test_set.csv"]
    assert (calc_test["breast_density"] == "0").sum() == 2  # the two density-0 rows, kept as read
    assert not abn[["image file path", "cropped image file path", "ROI mask file path"]].apply(
        lambda c: c.str.contains("\n")).any().any()
    from medfl.prep.cbis_ddsm import image_table

    img, both = image_table(abn)
    assert len(img) == 3103 and len(both) == 31
    assert not set(img.loc[img["split"] == "train", "patient_id"]) & set(img.loc[img["split"] == "test", "patient_id"])
    # the fixture takes its rows from the real CSVs when they are there
    info = generate(tmp_path / "fx", cases=8, seed=1, reference=reference_data, layout="classic")
    assert info["rows_from"] == "reference"
    m = prep(tmp_path / "fx", tmp_path / "fxo")
    real_ids = set(abn["patient_id"])
    assert set(m["subject_id"]) <= real_ids and len(m) == info["images"]


def test_bundle_runs_end_to_end(tmp_path, run_bundle):
    raw = Path(generate(tmp_path / "raw", cases=32, seed=5, layout="uid5")["root"])
    data = tmp_path / "data"
    m = prep(raw, data)
    common = ["--bundle_root", str(tmp_path), "--dataset_dir", str(data), "--image_height", SIZE[0],
              "--image_width", SIZE[1]]
    run_bundle(BUNDLE / "configs" / "train.json", *common, "--fl#rounds", "1", "--fl#num_clients", "2",
               "--fl#partition#min_size", "3", "--fl#model", "{'name': 'resnet18', 'width': 4}",
               "--fl#train#batch_size", "4", "--fl#progress", "False")
    exp = tmp_path / "runs" / "cbis_ddsm"
    for label in ("fedavg", "local"):
        s = json.loads((exp / label / "summary.json").read_text())
        assert s["rounds"] == 1 and s["num_clients"] == 2
    part = pd.read_csv(exp / "partition.csv", keep_default_na=False)
    assert set(part.loc[part["role"] == "global_test", "sample_id"]) == set(m.loc[m["split"] == "test", "sample_id"])
    run_bundle(BUNDLE / "configs" / "inference.json", *common, "--run_dir", exp / "fedavg")
    pred = pd.read_csv(exp / "fedavg" / "predictions.csv")
    assert set(pred["sample_id"]) == set(m.loc[m["split"] == "test", "sample_id"])
    assert set(pred["client_id"].astype(str)) == {"0", "1"}
    assert np.allclose(pred[["prob_benign", "prob_malignant"]].sum(axis=1), 1, atol=1e-5)


def test_a_cbis_ddsm_folder_that_is_a_symlink_to_another_disk(raws, tmp_path):
    """Issue 19: TCIA's CBIS-DDSM folder symlinked from another disk crashed in relative_to;
    the manifest now lists image paths under --raw, as for a plain folder."""
    import shutil

    src = raws["tcia"]
    raw = tmp_path / "raw"
    raw.mkdir()
    for p in src.iterdir():
        if p.name != "CBIS-DDSM":
            shutil.copy(p, raw / p.name)
    disk = Path(shutil.copytree(src / "CBIS-DDSM", tmp_path / "other_disk" / "CBIS-DDSM"))
    (raw / "CBIS-DDSM").symlink_to(disk, target_is_directory=True)
    got, ref = prep(raw, tmp_path / "o"), prep(src, tmp_path / "ref")
    assert got.drop(columns=["image_path"]).equals(ref.drop(columns=["image_path"]))
    assert got["image_path"].str.startswith("CBIS-DDSM/").all()
    assert got["image_path"].tolist() == ref["image_path"].tolist()


def test_out_that_is_a_file_stops_with_one_message(raws, tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(PrepError, match="is a file; expected a folder"):
        prep(raws["classic"], tmp_path / "afile")
    with pytest.raises(PrepError, match="afile/out: cannot create it"):         # a file in the way
        prep(raws["classic"], tmp_path / "afile" / "out")


def test_out_in_a_read_only_folder_stops_with_one_message(raws, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            pytest.skip("running as a user who can write anywhere (root): no read-only folder to test")
        with pytest.raises(PrepError, match="not writable|cannot create it"):
            prep(raws["classic"], locked / "out")
    finally:
        locked.chmod(0o700)


def _mg(tmp_path: Path, name: str, **changes) -> Path:
    """A fixture mammogram DICOM with header fields changed (what a real archive also holds)."""
    px = np.array([[0, 1000], [65535, 30000]], dtype=np.uint16)
    path = tmp_path / name
    write_mg_dicom(path, px, "P", "1.2.3", "1.2.4", "full mammogram images", "L", "CC")
    ds = pydicom.dcmread(path)
    for k, v in changes.items():
        if v is None:
            delattr(ds, k)
        else:
            setattr(ds, k, v)
    ds.save_as(path, enforce_file_format=True)
    return path


@pytest.mark.parametrize("changes, message", [
    ({"PhotometricInterpretation": "PALETTE COLOR"}, "photometric interpretation PALETTE COLOR; expected MONOCHROME1"),
    ({"Modality": "RTDOSE"}, "modality RTDOSE; expected MG"),
    ({"BitsAllocated": 1, "BitsStored": 1, "HighBit": 0}, "a 1-bit image .a segmentation.."),
    ({"BitsAllocated": 32, "BitsStored": 32, "HighBit": 31}, "32-bit pixels"),
    ({"BitsAllocated": None}, r"lacks BitsAllocated \(0028,0100\)"),
])
def test_dicoms_that_are_not_mammograms_stop_before_any_pixel_is_cached(tmp_path, changes, message):
    """Issue 19: palette-colour, 1-bit segmentation and 32-bit dose DICOMs were cached as
    mammograms (palette indices as intensities, a dose map as [0, 0.0003])."""
    with pytest.raises(PrepError, match=message):
        read_dicom(_mg(tmp_path, "x.dcm", **changes))


def test_signed_pixel_data_maps_to_0_1(tmp_path):
    """Signed 16-bit pixels gave negative values where [0, 1] is documented."""
    path = tmp_path / "s.dcm"
    px = np.array([[-32768, 0], [32767, -1]], dtype=np.int16)
    write_mg_dicom(path, px.view(np.uint16), "P", "1.2.3", "1.2.4", "full mammogram images", "L", "CC")
    ds = pydicom.dcmread(path)
    ds.PixelRepresentation = 1
    ds.PixelData = px.tobytes()
    ds.save_as(path, enforce_file_format=True)
    x, facts = read_dicom(path)
    assert facts["signed"] and x.min() == 0.0 and x.max() == 1.0
    assert np.allclose(x, (px.astype(np.float64) + 32768) / 65535)


def test_not_a_dicom_says_what_it_is(tmp_path):
    (tmp_path / "empty.dcm").write_bytes(b"")
    with pytest.raises(PrepError, match="an empty file .0 bytes."):
        read_dicom(tmp_path / "empty.dcm")
    (tmp_path / "png.dcm").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 200)
    with pytest.raises(PrepError, match="a PNG image named .dcm") as e:
        read_dicom(tmp_path / "png.dcm")
    assert "force" not in str(e.value)


@pytest.mark.parametrize("preamble", [b"II*\x00", b"MM\x00*"])
def test_a_dicom_whose_preamble_holds_a_tiff_header_is_read(tmp_path, preamble):
    """Issue 39, item 10: a DICOM's 128-byte preamble may hold a TIFF header (a legal
    dual-personality file, as 13 of pydicom's test files); it was refused as "a TIFF image
    named .dcm". With "DICM" at offset 128 it is a DICOM file, read as any other."""
    path = _mg(tmp_path, "dual.dcm")
    plain, _ = read_dicom(path)
    ds = pydicom.dcmread(path)
    ds.preamble = preamble + b"\x08\x00\x00\x00" + b"\x00" * 120
    ds.save_as(path, enforce_file_format=True)
    assert path.read_bytes()[:4] == preamble and path.read_bytes()[128:132] == b"DICM"
    x, _ = read_dicom(path)
    assert np.array_equal(x, plain)
    (tmp_path / "tiff.dcm").write_bytes(preamble + b"\x00" * 300)   # a TIFF without DICM: still refused
    with pytest.raises(PrepError, match="a TIFF image named .dcm"):
        read_dicom(tmp_path / "tiff.dcm")


def test_repeated_csv_rows_are_counted_once_and_conflicting_ones_stop(raws, tmp_path):
    """Issue 19: duplicated CBIS CSV rows doubled the abnormality count silently."""
    raw = _copy(raws["classic"], tmp_path / "raw")
    ref = read_case_csvs(raws["classic"])
    csv_path = raw / "mass_case_description_train_set.csv"
    lines = csv_path.read_text().splitlines(keepends=True)
    csv_path.write_text("".join(lines + [lines[1]]))                 # the first data row pasted again
    again = read_case_csvs(raw)
    assert len(again) == len(ref) and len(again.attrs["repeated_rows"]) == 1
    assert re.fullmatch(r"mass_case_description_train_set.csv line \d+ \(= line 2\)", again.attrs["repeated_rows"][0])
    prep(raw, tmp_path / "o")
    notes = json.loads((tmp_path / "o" / "report.json").read_text())["notes"]
    assert any("repeat an earlier row word for word" in n for n in notes)
    fields = lines[1].split(",")
    fields[fields.index("MALIGNANT") if "MALIGNANT" in fields else fields.index("BENIGN")] = "BENIGN_WITHOUT_CALLBACK"
    csv_path.write_text("".join(lines + [",".join(fields)]))
    with pytest.raises(PrepError, match="appears twice with different pathology"):
        read_case_csvs(raw)


def test_limit_keeps_every_split(raws, tmp_path):
    """Issue 39, item 16: --limit cut the image table, sorted by path (Calc-Test first), so
    --limit 4 left the train split empty with no warning. The limit now keeps the first
    images of each split in proportion, at least one each, and says so; a limit below the
    number of splits is refused by name."""
    m = prep(raws["classic"], tmp_path / "four", "--limit", "4")
    assert len(m) == 4 and set(m["split"]) == {"train", "test"}
    full = prep(raws["classic"], tmp_path / "all")
    for split, rows in m.groupby("split"):          # the first images of each split, in order
        assert list(rows["sample_id"]) == list(full.loc[full["split"] == split, "sample_id"].iloc[:len(rows)])
    notes = json.loads((tmp_path / "four" / "report.json").read_text())["notes"]
    assert any(re.fullmatch(r"--limit 4: kept the first \d test, \d train image\(s\), in proportion to the "
                            r"splits and at least one of each", n) for n in notes), notes
    with pytest.raises(PrepError, match=r"--limit 1: the listed samples fall in 2 splits \(test \d+, train \d+\); "
                                        r"expected --limit 2 or more"):
        prep(raws["classic"], tmp_path / "one", "--limit", "1")
    assert not (tmp_path / "one").exists()
    assert len(prep(raws["classic"], tmp_path / "many", "--limit", "999")) == len(full)


def _sparse(path: Path, head: bytes, size: int) -> Path:
    """``head`` then zeros up to ``size`` bytes, as a sparse file (no disk space, no memory)."""
    path.write_bytes(head)
    os.truncate(path, size)
    return path


def _peak_bytes(fn, *args) -> tuple[int, BaseException | None]:
    """Peak Python memory (tracemalloc: numpy and bytes objects included) that ``fn(*args)``
    allocated, and what it raised."""
    import tracemalloc

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    try:
        fn(*args)
        raised = None
    except BaseException as exc:  # noqa: BLE001 - returned to the test
        raised = exc
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    return peak, raised


def test_a_huge_sparse_file_named_dcm_is_refused_unread(tmp_path):
    """Issue 39, item 17: a 2 GiB sparse file named .dcm was read whole (2.2 GB peak) before it
    was refused. Now the first bytes and the header are judged first: a file of zeros is not
    a DICOM file, a real header followed by gigabytes is far larger than its pixels need, a
    header announcing 10000 x 10000 pixels is above the limit; none costs memory."""
    read_dicom(_mg(tmp_path, "warm.dcm"))                        # imports done before measuring
    zeros = _sparse(tmp_path / "zeros.dcm", b"", 2 << 30)
    header = _mg(tmp_path, "padded.dcm")
    padded = _sparse(header, header.read_bytes(), 2 << 30)
    huge = _mg(tmp_path, "huge.dcm", Rows=10000, Columns=10000)
    cases = [(zeros, r"zeros.dcm: not a DICOM file"),
             (padded, r"padded.dcm: 2147483648 bytes, far more than its header's image \(2 x 2, 16-bit\) needs: "
                      r"8 bytes of pixel data after a \d+-byte header; expected at most \d+ bytes"),
             (huge, rf"huge.dcm: its header announces 10000 x 10000 = 100000000 pixels, above the limit of "
                    rf"{MAX_IMAGE_PIXELS}")]
    for path, message in cases:
        peak, raised = _peak_bytes(read_dicom, path)
        assert isinstance(raised, PrepError) and re.search(message, str(raised)), raised
        assert peak < 4 << 20, f"{path.name}: {peak} bytes allocated to refuse it"
    x, facts = read_dicom(_sparse(tmp_path / "slack.dcm", (tmp_path / "warm.dcm").read_bytes(),
                                  (tmp_path / "warm.dcm").stat().st_size + 1000))   # trailing padding: read
    assert x.shape == (2, 2) and facts["rows"] == 2


def test_file_names_that_are_not_utf8_are_escaped_and_the_dataset_kept(raws, tmp_path):
    """Issue 39, item 15: a DICOM named with a byte that is not UTF-8 (b'\\xff') stopped the
    script with UnicodeEncodeError when the manifest was written, after every image was
    read, and the finished dataset was discarded. The manifest (a UTF-8 CSV) now holds the
    name with a \\xNN escape, the report and stderr say so, and the samples are kept; a bad
    file of such a name is listed in skipped.csv the same way."""
    raw = _copy(raws["uid5"], tmp_path / "raw")
    ref = prep(raws["uid5"], tmp_path / "ref")
    first = raw / ref["image_path"].iloc[0]
    os.rename(bytes(first), bytes(first.parent) + b"/1-1\xff.dcm")
    got = prep(raw, tmp_path / "out")
    escaped = ref["image_path"].iloc[0].replace("1-1.dcm", "1-1\\xff.dcm")
    assert got["image_path"].iloc[0] == escaped and list(got["image_path"].iloc[1:]) == list(ref["image_path"].iloc[1:])
    assert np.array_equal(np.load(tmp_path / "out" / got["path"].iloc[0]), np.load(tmp_path / "ref" / ref["path"].iloc[0]))
    notes = json.loads((tmp_path / "out" / "report.json").read_text())["notes"]
    assert any("not valid UTF-8" in n and f"image_path={escaped}" in n for n in notes), notes
    second = raw / ref["image_path"].iloc[1]
    bad = bytes(second.parent) + b"/1-1\xfe.dcm"
    os.rename(bytes(second), bad)
    Path(os.fsdecode(bad)).write_bytes(b"not a dicom at all" * 10)
    got = prep(raw, tmp_path / "skip", "--skip-bad")
    assert len(got) == len(ref) - 1
    skipped = pd.read_csv(tmp_path / "skip" / "skipped.csv")
    assert skipped["item"].iloc[0].endswith("1-1\\xfe.dcm") and "1-1\\xfe.dcm: not a DICOM file" in skipped["reason"].iloc[0]
