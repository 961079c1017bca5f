"""HAM10000: the fixture generator in every layout the download comes in, data_prep/ham10000.py,
and one clear error for each kind of bad input."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pytest

from medfl.fixtures import generate
from medfl.prep.common import MAX_IMAGE_PIXELS
from medfl.prep.errors import PRESENT_ONLY_HINT, PrepError
from medfl.prep.ham10000 import CLASS_NAMES, build_parser, main

REPO = Path(__file__).resolve().parents[2]
CASES = 60
SIZE = 16


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")


def tree_hash(root: Path) -> dict[str, str]:
    """Relative path -> sha256 of every file under ``root``."""
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def prep(raw: Path, out: Path, *extra: str) -> int:
    return main(["--raw", str(raw), "--out", str(out), "--size", str(SIZE), *extra])


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Dataverse-layout fixture (shared, never modified: tests copy it)."""
    root = tmp_path_factory.mktemp("ham") / "raw"
    generate("ham10000", root, cases=CASES, seed=0)
    return root


@pytest.fixture(scope="module")
def prepared(raw: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("ham_out") / "data"
    assert prep(raw, out) == 0
    return {"out": out, "manifest": pd.read_csv(out / "manifest.csv", keep_default_na=False)}


def meta_of(raw: Path) -> pd.DataFrame:
    return pd.read_csv(raw / "HAM10000_metadata.csv", dtype=str, keep_default_na=False)


def test_fixture_layout_lesions_and_classes(raw: Path):
    meta = meta_of(raw)
    assert list(meta.columns) == ["lesion_id", "image_id", "dx", "dx_type", "age", "sex", "localization", "dataset"]
    assert set(meta["dx"]) == set(CLASS_NAMES) and meta["image_id"].is_unique
    assert meta.groupby("lesion_id").size().max() >= 2  # lesions with several images
    assert (meta.groupby("lesion_id")["dx"].nunique() == 1).all()
    numbers = meta["image_id"].str[5:].astype(int)
    for _, rec in meta.iterrows():
        part = 1 if int(rec["image_id"][5:]) < 29306 else 2
        assert (raw / f"HAM10000_images_part_{part}" / f"{rec['image_id']}.jpg").is_file()
    assert numbers.min() >= 24306 and numbers.max() <= 34320
    counts = generate("ham10000", raw.parent / "big", cases=700, seed=1)["classes"]
    assert min(counts.values()) >= 50 and max(counts, key=counts.get) == "nv"


def test_fixture_is_deterministic(tmp_path: Path):
    a, b = tmp_path / "a", tmp_path / "b"
    generate("ham10000", a, cases=12, seed=3)
    generate("ham10000", b, cases=12, seed=3)
    assert tree_hash(a) == tree_hash(b)


def test_manifest_rows_match_the_metadata(raw: Path, prepared: dict):
    m, meta = prepared["manifest"], meta_of(raw)
    assert len(m) == CASES and list(m["image_id"]) == list(meta["image_id"])
    assert list(m["class_name"]) == list(meta["dx"])
    assert (m["label"] == [CLASS_NAMES.index(d) for d in meta["dx"]]).all()
    assert (m["subject_id"] == meta["lesion_id"]).all() and (m["site"] == meta["dataset"]).all()
    assert set(m["sex"]) <= {"F", "M", ""} and (m["sex"] == meta["sex"].map({"male": "M", "female": "F",
                                                                            "unknown": ""})).all()
    assert (m["split"] == "").all()  # no official split: the run draws the global test set
    arr = np.load(prepared["out"] / m["path"].iloc[0])
    assert arr.shape == (3, SIZE, SIZE) and arr.dtype == np.float32 and 0 <= arr.min() and arr.max() <= 1
    report = json.loads((prepared["out"] / "report.json").read_text())
    assert report["counts"]["written"] == CASES and report["counts"]["max_images_per_lesion"] >= 2


def test_fixture_class_signal_is_learnable(prepared: dict):
    """Mean lesion colour alone separates the seven classes well above chance."""
    m = prepared["manifest"]
    feats = np.stack([np.load(prepared["out"] / p)[:, 5:11, 5:11].mean(axis=(1, 2)) for p in m["path"]])
    labels = m["label"].to_numpy()
    centroids = np.stack([feats[labels == c].mean(0) for c in range(7)])
    pred = np.argmin(((feats[:, None] - centroids[None]) ** 2).sum(-1), axis=1)
    assert (pred == labels).mean() >= 0.6


@pytest.mark.parametrize("layout, extra", [("kaggle", ()), ("tab", ()), ("single", ("--images", "images"))])
def test_every_download_layout_gives_the_same_manifest(layout: str, extra: tuple[str, ...], prepared: dict,
                                                       tmp_path: Path):
    raw = tmp_path / layout
    info = generate("ham10000", raw, cases=CASES, seed=0, layout=layout)
    assert info["rows_from"] == "synthetic"
    assert prep(raw, tmp_path / "out", *extra) == 0
    m = pd.read_csv(tmp_path / "out" / "manifest.csv", keep_default_na=False)
    ref = prepared["manifest"]
    for col in ("sample_id", "label", "subject_id", "site", "sex", "age", "dx_type"):
        assert list(m[col].astype(str)) == list(ref[col].astype(str)), col
    first = m["path"].iloc[0]
    assert np.array_equal(np.load(tmp_path / "out" / first), np.load(prepared["out"] / first))


def test_the_kaggle_mirrors_metadata_without_a_dataset_column_is_prepared(raw: Path, prepared: dict, tmp_path: Path):
    """Issue 39, item 11: the Kaggle mirror's metadata has 7 columns, no ``dataset``; it was
    refused. It is prepared with an empty site (the report says why), the rest identical; a
    run with the natural partitioner is refused naming the empty column and (issue 51, item 8)
    its cause, the note of the report beside the manifest; any other partitioner runs."""
    import json

    from medfl.config import ConfigError, resolve_config
    from medfl.data.partition import PartitionError
    from medfl.experiment import run_experiment

    kaggle = tmp_path / "raw"
    shutil.copytree(raw, kaggle)
    meta_of(raw).drop(columns="dataset").to_csv(kaggle / "HAM10000_metadata.csv", index=False)
    out = tmp_path / "data"
    assert prep(kaggle, out) == 0
    manifest = pd.read_csv(out / "manifest.csv", keep_default_na=False)
    assert (manifest["site"] == "").all()
    want = prepared["manifest"].drop(columns=["site", "dataset"])
    pd.testing.assert_frame_equal(manifest.drop(columns=["site", "dataset"]), want)
    report = json.loads((out / "report.json").read_text())
    assert any("no 'dataset' column" in n for n in report["notes"])
    fl = {"name": "k", "output_dir": str(tmp_path / "runs"), "seed": 0, "rounds": 1, "num_clients": 2,
          "progress": False, "dataset": {"name": "manifest", "path": str(out / "manifest.csv")},
          "partition": {"name": "natural"}, "model": {"name": "small_cnn", "width": 4},
          "train": {"batch_size": 8}, "methods": [{"name": "fedavg"}]}
    with pytest.raises((ConfigError, PartitionError),
                       match=r"'site' is empty in every row.*report.json says: HAM10000_metadata.csv has no "
                             r"'dataset' column \(the Kaggle mirror's 7 columns\)"):
        run_experiment(resolve_config(fl))
    done = run_experiment(resolve_config({**fl, "name": "k2", "partition": {"name": "dirichlet", "alpha": 1.0}}))
    assert (Path(done["dir"]) / "fedavg" / "summary.json").is_file()


ODD_FOLDER_RUN = """
import json, os, sys
from pathlib import Path
from medfl.config import resolve_config
from medfl.experiment import run_experiment
from medfl.prep.ham10000 import main
raw, tmp, size = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
out = tmp / os.fsdecode(b"data_\\xff")
assert main(["--raw", str(raw), "--out", str(out), "--size", size]) == 0
assert os.path.isfile(os.path.join(os.fsencode(tmp), b"data_\\xff", b"manifest.csv"))
fl = {"name": "odd", "output_dir": str(out / "runs"), "seed": 0, "rounds": 1, "num_clients": 2,
      "progress": False, "dataset": {"name": "manifest", "path": str(out / "manifest.csv")},
      "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 4},
      "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8}, "methods": [{"name": "fedavg"}]}
run = Path(run_experiment(resolve_config(fl))["dir"]) / "fedavg"
assert json.loads((run / "summary.json").read_text())["rounds"] == 1
assert "data_\\\\udcff" in (run / "log.txt").read_text(encoding="utf-8")
assert json.loads((run / "config.json").read_text())["fl"]["dataset"]["path"] == str(out / "manifest.csv")
sys.stdout.buffer.write(os.fsencode(run))
"""


def test_a_dataset_prepared_into_a_folder_whose_name_is_not_utf8_trains(raw: Path, tmp_path: Path):
    """Issue 51, item 8: prep accepts an ``--out`` named with the byte ``\\xff`` (held as
    ``'\\udcff'``); training on it stopped in round 1 (``surrogates not allowed`` hashing the
    file list in medfl/guard/reference.py) and every log line naming the run folder was a
    ``--- Logging error ---`` traceback. It trains; log.txt names the folder escaped; the run's
    config.json gives back the very path, so a resume opens the same data.

    Everything that names the folder runs in a process of its own, its output read as bytes:
    pytest-xdist sends a test's captured output and log records to the controller as UTF-8,
    which a surrogate in them would stop (the worker's crash ends the whole session)."""
    done = subprocess.run([sys.executable, "-c", ODD_FOLDER_RUN, str(raw), str(tmp_path), str(SIZE)],
                          capture_output=True, cwd=REPO)
    assert done.returncode == 0, done.stderr.decode(errors="backslashreplace")[-3000:]
    assert b"Logging error" not in done.stderr and b"Traceback" not in done.stderr
    run = done.stdout.rsplit(b"\n", 1)[-1]   # after prep's summary
    assert run.endswith(b"fedavg") and b"data_\xff" in run
    # a stdout opened strict (any UTF-8 locale but C) printed the folder with a traceback
    env = {**os.environ, "PYTHONIOENCODING": "utf-8:strict"}
    shown = subprocess.run([sys.executable, "-c", "import sys; from medfl.cli import main; sys.exit(main())",
                            "report", os.fsdecode(run)], capture_output=True, env=env, cwd=REPO)
    assert shown.returncode == 0, shown.stderr.decode(errors="backslashreplace")
    assert b"data_\\udcff" in shown.stdout and b"Traceback" not in shown.stderr


def _zip_folder(folder: Path, archive: Path, flat: bool) -> None:
    """Zip ``folder``'s images as the Dataverse does (bare ``ISIC_*.jpg``, ``flat``) or as a
    zip holding the folder itself; remove the folder."""
    import zipfile

    with zipfile.ZipFile(archive, "w") as z:
        for f in sorted(folder.iterdir()):
            z.write(f, f.name if flat else f"{folder.name}/{f.name}")
    shutil.rmtree(folder)


def test_zipped_image_parts_beside_the_metadata_are_named_with_the_unzip_command(raw: Path, tmp_path: Path):
    """Issue 51, item 8: with HAM10000_images_part_1.zip and _2.zip beside the metadata, still
    zipped, the script said only that the image folders were missing. It names each archive
    with the command that unzips it where the script looks; done as said, it prepares."""
    import zipfile

    zipped = shutil.copytree(raw, tmp_path / "raw")
    _zip_folder(zipped / "HAM10000_images_part_1", zipped / "HAM10000_images_part_1.zip", flat=True)
    _zip_folder(zipped / "HAM10000_images_part_2", zipped / "HAM10000_images_part_2.zip", flat=False)
    with pytest.raises(PrepError) as e:
        prep(zipped, tmp_path / "out")
    msg = str(e.value)
    one = f"unzip -q {zipped / 'HAM10000_images_part_1.zip'} -d {zipped / 'HAM10000_images_part_1'}"
    two = f"unzip -q {zipped / 'HAM10000_images_part_2.zip'} -d {zipped}"
    assert "still zipped" in msg and one in msg and two in msg, msg
    with zipfile.ZipFile(zipped / "HAM10000_images_part_1.zip") as z:     # as the first command does
        z.extractall(zipped / "HAM10000_images_part_1")
    with pytest.raises(PrepError) as e:                # part 2 still zipped: its images are not found
        prep(zipped, tmp_path / "out")
    assert "not found" in str(e.value) and two in str(e.value) and one not in str(e.value)
    with zipfile.ZipFile(zipped / "HAM10000_images_part_2.zip") as z:
        z.extractall(zipped)
    assert prep(zipped, tmp_path / "out") == 0


def test_overwrite_is_refused_then_removes_stale_arrays(raw: Path, tmp_path: Path):
    out = tmp_path / "o"
    assert prep(raw, out, "--limit", "10") == 0
    with pytest.raises(PrepError, match="manifest"):
        prep(raw, out)
    stale = out / "arrays" / "ham10000_ISIC_9999999.npy"
    np.save(stale, np.zeros(1, np.float32))
    assert prep(raw, out, "--overwrite", "--limit", "5") == 0
    assert not stale.exists() and len(list((out / "arrays").glob("*.npy"))) == 5


# --------------------------------------------------------------------------- bad input


def _edit(raw: Path, line: int, column: str, value: str) -> None:
    meta = meta_of(raw)
    meta.loc[line - 2, column] = value
    meta.to_csv(raw / "HAM10000_metadata.csv", index=False)


def _image_of(raw: Path, line: int) -> Path:
    image = meta_of(raw)["image_id"].iloc[line - 2]
    return next(raw.glob(f"HAM10000_images_part_*/{image}.jpg"))


def unknown_dx(raw: Path) -> str:
    _edit(raw, 5, "dx", "melanoma")
    return r"HAM10000_metadata.csv line 5 \(ISIC_\d+\), column 'dx': 'melanoma'; expected one of akiec, bcc"


def unknown_dx_type(raw: Path) -> str:
    _edit(raw, 6, "dx_type", "biopsy")
    return r"line 6 \(ISIC_\d+\), column 'dx_type': 'biopsy'; expected one of histo, follow_up"


def bad_age(raw: Path) -> str:
    _edit(raw, 7, "age", "eighty")
    return r"line 7 \(ISIC_\d+\), column 'age': 'eighty'; expected years"


def bad_sex(raw: Path) -> str:
    _edit(raw, 8, "sex", "x")
    return r"line 8 \(ISIC_\d+\), column 'sex': 'x'; expected male, female, unknown or empty"


def missing_image(raw: Path) -> str:
    path = _image_of(raw, 9)
    path.unlink()
    return rf"line 9 \({path.stem}\): image {path.stem}.jpg not found in .*HAM10000_images_part_1"


def truncated_jpeg(raw: Path) -> str:
    path = _image_of(raw, 10)
    path.write_bytes(path.read_bytes()[:300])
    return rf"{path.name}: corrupt or truncated image"


def differing_copies(raw: Path) -> str:
    path = _image_of(raw, 11)
    copy = raw / "ham10000_images_part_1" / path.name
    copy.parent.mkdir(exist_ok=True)
    copy.write_bytes(_image_of(raw, 12).read_bytes())  # another image under this name
    return rf"{path.name} and .*ham10000_images_part_1/{path.name}: two different files for image"


def duplicate_image_id(raw: Path) -> str:
    meta = meta_of(raw)
    meta.loc[3, "image_id"] = meta.loc[2, "image_id"]
    meta.to_csv(raw / "HAM10000_metadata.csv", index=False)
    return r"lines 4 and 5, column 'image_id': ISIC_\d+ appears twice"


def lesion_with_two_dx(raw: Path) -> str:
    meta = meta_of(raw)
    multi = meta.groupby("lesion_id").filter(lambda g: len(g) > 1)
    lesion = multi["lesion_id"].iloc[0]
    rows = meta.index[meta["lesion_id"] == lesion]
    meta.loc[rows[1], "dx"] = "vasc" if meta.loc[rows[0], "dx"] != "vasc" else "nv"
    meta.to_csv(raw / "HAM10000_metadata.csv", index=False)
    return rf"lines {rows[0] + 2} and {rows[1] + 2}: lesion {lesion} has dx"


def bad_image_id(raw: Path) -> str:
    _edit(raw, 3, "image_id", "IMG_1")
    return r"line 3, column 'image_id': 'IMG_1'; expected ISIC_<digits>"


def missing_column(raw: Path) -> str:
    meta_of(raw).drop(columns="dx_type").to_csv(raw / "HAM10000_metadata.csv", index=False)
    return r"HAM10000_metadata.csv.*dx_type"


def missing_metadata(raw: Path) -> str:
    (raw / "HAM10000_metadata.csv").unlink()
    return r"no HAM10000_metadata.csv, HAM10000_metadata.tab, HAM10000_metadata; expected the HAM10000 download"


def no_image_folders(raw: Path) -> str:
    for d in raw.glob("HAM10000_images_part_*"):
        shutil.rmtree(d)
    return r"none of HAM10000_images_part_1, HAM10000_images_part_2 exists"


def png_header(width: int, height: int) -> bytes:
    """The start of a PNG announcing ``width`` x ``height`` 8-bit grey pixels (signature,
    IHDR, IEND; no pixel data): what a decompression bomb shows before it is decoded."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IEND", b""))


def decompression_bomb(raw: Path) -> str:
    """Issue 39, item 12: a PNG header announcing 20000 x 20000 pixels named .jpg stopped the
    script with PIL's DecompressionBombError, even with --skip-bad."""
    path = _image_of(raw, 13)
    path.write_bytes(png_header(20000, 20000))
    return (rf"{path.name}: its header announces 400000000 pixels, above the limit of {MAX_IMAGE_PIXELS} "
            r"\(medfl.prep.common.MAX_IMAGE_PIXELS\)")


def empty_metadata(raw: Path) -> str:
    (raw / "HAM10000_metadata.csv").write_text("")
    return r"HAM10000_metadata.csv: empty file; expected a header lesion_id,image_id,dx"


BAD_INPUTS: list[tuple[Callable[[Path], str], bool]] = [
    (unknown_dx, True), (unknown_dx_type, True), (bad_age, True), (bad_sex, True), (missing_image, True),
    (truncated_jpeg, True), (decompression_bomb, True), (differing_copies, True), (duplicate_image_id, False), (lesion_with_two_dx, False),
    (bad_image_id, False), (missing_column, False), (missing_metadata, False), (no_image_folders, False),
    (empty_metadata, False),
]


@pytest.mark.parametrize("mutate,per_file", BAD_INPUTS, ids=[b[0].__name__ for b in BAD_INPUTS])
def test_bad_input(raw: Path, tmp_path: Path, mutate, per_file: bool):
    work = tmp_path / "raw"
    shutil.copytree(raw, work)
    expected = mutate(work)
    before = tree_hash(work)
    with pytest.raises(PrepError) as err:
        prep(work, tmp_path / "stop")
    assert len(str(err.value).splitlines()) == 1
    assert re.search(expected, str(err.value)), str(err.value)
    assert not (tmp_path / "stop" / "manifest.csv").exists()
    if per_file:
        assert prep(work, tmp_path / "skip", "--skip-bad") == 0
        skipped = pd.read_csv(tmp_path / "skip" / "skipped.csv")
        assert len(skipped) == 1 and skipped["reason"].iloc[0] == str(err.value).replace(PRESENT_ONLY_HINT, "")
        assert len(pd.read_csv(tmp_path / "skip" / "manifest.csv")) == CASES - 1
    else:
        with pytest.raises(PrepError):
            prep(work, tmp_path / "skip", "--skip-bad")
    assert tree_hash(work) == before  # the download is never modified


def test_script_reports_errors_and_help(raw: Path, tmp_path: Path):
    script = str(REPO / "data_prep" / "ham10000.py")
    proc = subprocess.run([sys.executable, script, "--raw", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --raw ") and "Traceback" not in proc.stderr
    ok = subprocess.run([sys.executable, script, "--raw", str(raw), "--out", str(tmp_path / "ok"), "--size", "8",
                         "--limit", "5"], capture_output=True, text=True, timeout=120,
                        env={"MEDFL_NO_PROGRESS": "1", "PATH": "/usr/bin:/bin"})
    assert ok.returncode == 0, ok.stderr
    text = build_parser().format_help()
    for opt in ("--raw", "--out", "--skip-bad", "--overwrite", "--limit", "--size", "--aspect", "--metadata",
                "--images", "HAM10000_images_part_1"):
        assert opt in text


def test_a_limit_that_empties_a_class_warns(tmp_path, capsys):
    """Issue 19: --limit or --skip-bad that empties a class must warn (a run can neither learn
    nor score it); the report says which."""
    generate("ham10000", tmp_path / "raw", cases=60, seed=0, reference=False)
    assert main(["--raw", str(tmp_path / "raw"), "--out", str(tmp_path / "out"), "--size", "16",
                 "--limit", "3"]) == 0
    err = capsys.readouterr().err
    assert "warning: class(es)" in err and "have no sample in the manifest (--limit 3)" in err
    notes = json.loads((tmp_path / "out" / "report.json").read_text())["notes"]
    assert any("a run can neither learn nor score them" in n for n in notes)


def _no_partials(parent: Path) -> None:
    assert not [p.name for p in parent.iterdir() if ".partial-" in p.name]


def test_a_stop_never_leaves_half_an_output(raw: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Issue 19: every stop left a partial --out (cached arrays, no manifest). Now the script
    writes into a staging folder beside --out and renames it into place only at the end; a
    stop (a bad file, Ctrl-C) leaves no --out, only its report in <out>.failed/."""
    import medfl.prep.ham10000 as ham

    work = tmp_path / "raw"
    shutil.copytree(raw, work)
    victim = next(work.rglob("*.jpg"))
    victim.write_bytes(b"not a jpeg")
    with pytest.raises(PrepError, match=re.escape(str(victim))):
        prep(work, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    _no_partials(tmp_path)
    # every image skipped: the run fails after writing its report, which is kept beside --out
    for jpg in work.rglob("*.jpg"):
        jpg.write_bytes(b"not a jpeg")
    with pytest.raises(PrepError, match=r"out\.failed/skipped\.csv"):
        prep(work, tmp_path / "out", "--skip-bad")
    assert not (tmp_path / "out").exists() and (tmp_path / "out.failed" / "skipped.csv").is_file()
    assert json.loads((tmp_path / "out.failed" / "report.json").read_text())["num_skipped"] == CASES
    real, calls = ham.preprocess_image, []

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 5:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(ham, "preprocess_image", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prep(raw, tmp_path / "out2")
    assert not (tmp_path / "out2").exists()
    _no_partials(tmp_path)
    # a run killed outright (kill -9) leaves its staging folder; the next run removes it
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / f".out3.partial-{dead.pid}" / "arrays").mkdir(parents=True)
    monkeypatch.setattr(ham, "preprocess_image", real)
    assert prep(raw, tmp_path / "out3") == 0
    _no_partials(tmp_path)


def test_overwrite_keeps_the_earlier_dataset_until_the_new_one_is_whole(raw: Path, tmp_path: Path):
    out = tmp_path / "data"
    assert prep(raw, out) == 0
    (out / "my_notes.txt").write_text("mine")                    # a file of the user's
    before = tree_hash(out)
    work = tmp_path / "raw"
    shutil.copytree(raw, work)
    next(work.rglob("*.jpg")).write_bytes(b"not a jpeg")
    with pytest.raises(PrepError):
        prep(work, out, "--overwrite")
    assert tree_hash(out) == before                              # a failed --overwrite changes nothing
    assert prep(raw, out, "--overwrite", "--limit", "5") == 0
    assert len(list((out / "arrays").glob("*.npy"))) == 5       # no stale arrays of the earlier run
    assert (out / "my_notes.txt").read_text() == "mine"         # the user's file is kept
    assert json.loads((out / "report.json").read_text())["out"] == str(out.resolve())
    assert not (tmp_path / "data.failed").exists()             # the earlier failure's report is gone
    _no_partials(tmp_path)


def test_an_image_announcing_more_pixels_than_the_limit_is_refused_before_decoding(tmp_path: Path):
    """Issue 39, item 12: the size a header announces is judged before decoding, below PIL's
    own limit too (9000 x 9000 is under PIL's 89 Mpx warning: it was decoded, or failed as
    "truncated" here); one at the limit is read as any other image."""
    from PIL import Image

    from medfl.prep.derm7pt import load_rgb

    big = tmp_path / "big.jpg"
    big.write_bytes(png_header(9000, 9000))
    with pytest.raises(PrepError, match=rf"big.jpg: its header announces 9000 x 9000 = 81000000 pixels, above "
                                        rf"the limit of {MAX_IMAGE_PIXELS}"):
        load_rgb(big)
    Image.new("L", (8192, 1), 7).save(tmp_path / "wide.png")      # 8192 pixels: far inside the limit
    rgb, fmt = load_rgb(tmp_path / "wide.png")
    assert rgb.shape == (1, 8192, 3) and fmt == "PNG" and int(rgb.max()) == 7
