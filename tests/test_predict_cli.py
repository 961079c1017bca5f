"""``medfl predict``: a finished run's model(s) on new images (a data_prep folder or a manifest
CSV, labelled or not) or on its own, written as a CSV with exactly the columns of an exported
bundle's ``eval/predictions.csv``, the predictions :func:`medfl.predict.predict` makes; every
bad input is one ``medfl: error:`` line; docs/export.md's ``medfl predict`` commands run as written.

Each kind of file medfl reads is covered through the fixtures and the data_prep scripts
(:mod:`medfl.fixtures`): PGM (MIAS) and DICOM (CBIS-DDSM) with one grayscale 2D run, JPEG
(Derm7pt) and PNG (Derm7pt's images saved as PNG) with one RGB run, NIfTI (ABIDE) with one 3D
run, and medfl's ``.npy`` arrays with a ``synthetic2d`` run (FedAvg and FedBN).
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import numpy as np
import pandas as pd
import pytest

from medfl.cli import main
from medfl.config import resolve_config
from medfl.data.source import DataError
from medfl.experiment import run_experiment
from medfl.fixtures import generate
from medfl.predict import data_spec, predict

REPO = Path(__file__).resolve().parents[1]
SIZE2D = [8, 8]

# (fixture dataset, cases, data_prep module, its extra arguments)
PREPARED = [
    ("mias", 8, "medfl.prep.mias", ["--size", "16"]),
    ("cbis_ddsm", 8, "medfl.prep.cbis_ddsm", ["--size", "16", "16"]),
    ("derm7pt", 8, "medfl.prep.derm7pt", ["--size", "16"]),
    ("abide", 6, "medfl.prep.abide", []),
]

# The tiny runs on the original image files (the manifest's image_path column, read by MONAI
# through medfl's dataset): run name -> (prepared dataset it trains on, normalize, spatial_size).
RUNS = {
    "gray": ("mias", "minmax", SIZE2D),
    "rgb": ("derm7pt", "minmax", SIZE2D),
    "volume": ("abide", "zscore", [6, 6, 6]),
}

# Every kind of file: (id, run, prepared dataset whose files it predicts on, how its manifest is
# given: "folder" (the data_prep folder itself), "png" (a manifest CSV of the images saved as
# PNG), "no_class_name" (a manifest CSV without class_name: CBIS-DDSM's classes are not those of
# the MIAS run, which a class_name column would have refused)).
FILE_KINDS = [
    ("pgm", "gray", "mias", "folder"),
    ("dicom", "gray", "cbis_ddsm", "no_class_name"),
    ("jpeg", "rgb", "derm7pt", "folder"),
    ("png", "rgb", "derm7pt", "png"),
    ("nifti", "volume", "abide", "folder"),
]


def _tiny(out: Path, name: str, dataset: dict[str, Any], methods: list[dict[str, Any]], clients: int = 2) -> Path:
    """A one-round experiment of ``methods`` on ``dataset`` (tiny CNN); its directory."""
    fl = {"name": name, "output_dir": str(out), "seed": 0, "rounds": 1, "num_clients": clients, "progress": False,
          "plots": False, "dataset": dataset, "partition": {"name": "iid"}, "model": {"name": "small_cnn", "width": 4},
          "train": {"batch_size": 4, "lr": 0.05}, "methods": methods}
    return Path(run_experiment(resolve_config(fl))["dir"])


@pytest.fixture(scope="module")
def prepared(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Each fixture dataset, raw and prepared by its data_prep script: name -> (raw, out)."""
    import importlib

    root = tmp_path_factory.mktemp("prepared")
    found = {}
    for name, cases, module, extra in PREPARED:
        raw, out = root / name / "raw", root / name / "out"
        info = generate(name, raw, cases=cases, seed=0, reference=False)
        if name == "abide":
            extra = ["--atlas", "file", "--atlas-file", info["signal_atlas"]]
        assert importlib.import_module(module).main(["--raw", str(raw), "--out", str(out), *extra]) == 0
        found[name] = (raw, out)
    return found


def _file_spec(prepared: dict[str, tuple[Path, Path]], data: str, normalize: str, size: list[int]) -> dict[str, Any]:
    """A manifest dataset spec reading the original files (``image_path``) of a prepared dataset."""
    raw, out = prepared[data]
    return {"name": "manifest", "path": str(out / "manifest.csv"), "root": str(raw), "column": "image_path",
            "normalize": normalize, "spatial_size": size}


@pytest.fixture(scope="module")
def runs(prepared: dict[str, tuple[Path, Path]], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The FedAvg run of each of :data:`RUNS`, plus ``fedavg`` and ``fedbn`` on synthetic2d."""
    out = tmp_path_factory.mktemp("runs")
    found = {name: _tiny(out, name, _file_spec(prepared, data, norm, size), [{"name": "fedavg"}]) / "fedavg"
             for name, (data, norm, size) in RUNS.items()}
    syn = {"name": "synthetic2d", "root": str(out / "data"), "num_samples": 40, "num_classes": 2, "image_size": 12,
           "noise": 0.5}
    exp = _tiny(out, "syn", syn, [{"name": "fedavg"}, {"name": "fedbn"}])
    found.update(fedavg=exp / "fedavg", fedbn=exp / "fedbn", syn_exp=exp)
    return found


def _syn_dir(runs: dict[str, Path]) -> Path:
    """The synthetic2d run's data folder (its manifest.csv names .npy arrays in ``path``)."""
    spec = json.loads((runs["fedavg"] / "config.json").read_text())["fl"]["dataset"]
    (folder,) = Path(spec["root"]).glob("synthetic2d-*")
    return folder


def _read(csv: Path) -> pd.DataFrame:
    return pd.read_csv(csv, dtype={"sample_id": str})


def _library(run_dir: Path, spec: dict[str, Any] | None, client: str, tmp: Path) -> pd.DataFrame:
    """:func:`medfl.predict.predict`'s rows for one client, without its ``client_id``."""
    return _read(predict(run_dir, spec, tmp / f"lib_{client}.csv", [client])).drop(columns="client_id")


def _export_header(run_dir: Path, tmp: Path) -> list[str]:
    """The columns of ``eval/predictions.csv`` that ``medfl export``'s bundle of the run writes
    (its inference.json's ``header``, parsed as MONAI's runner does)."""
    from monai.bundle import ConfigParser

    from medfl.export import export_run

    summary = export_run(run_dir, tmp / "exported")
    bundle = tmp / "exported" / summary["bundles"][0]["folder"]
    return list(ConfigParser(json.loads((bundle / "configs" / "inference.json").read_text()))
                .get_parsed_content("header"))


@pytest.fixture(scope="module")
def headers(runs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], list[str]]:
    """Run name -> :func:`_export_header` of its run (exported once)."""
    done: dict[str, list[str]] = {}

    def header(name: str) -> list[str]:
        if name not in done:
            done[name] = _export_header(runs[name], tmp_path_factory.mktemp(f"export_{name}"))
        return done[name]
    return header


def _check(csv: Path, rows: int, header: list[str]) -> pd.DataFrame:
    """The CSV has export's columns, ``rows`` rows, probabilities summing to 1 and their argmax
    as prediction."""
    df = _read(csv)
    assert list(df.columns) == header
    assert len(df) == rows
    probs = df[[c for c in header if c.startswith("prob_")]].to_numpy()
    np.testing.assert_allclose(probs.sum(1), 1, atol=1e-5)
    assert (df["prediction"] == probs.argmax(1)).all()
    return df


def test_help_says_what_it_writes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["predict", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for part in ("--data DIR_OR_MANIFEST", "eval/predictions.csv", "sample_id, label", "prob_<class>",
                 "_client_<id>", "--overwrite", "--client ID", "--out CSV"):
        assert part in text, part


@pytest.mark.parametrize("kind,run,data,given", FILE_KINDS, ids=[k[0] for k in FILE_KINDS])
def test_each_kind_of_file(kind: str, run: str, data: str, given: str, prepared, runs, headers, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    """The command on a data_prep folder or a manifest CSV (the run's image column, read from
    --root) gives export's columns, one row per image, and :func:`medfl.predict.predict`'s
    predictions."""
    raw, folder = prepared[data]
    manifest = pd.read_csv(folder / "manifest.csv", dtype={"sample_id": str})
    data_arg, root = folder, raw
    if given == "png":   # Derm7pt's JPEGs as PNG files, in a manifest CSV of their own
        from PIL import Image

        for name in manifest["image_path"]:
            (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
            Image.open(raw / name).save(tmp_path / Path(name).with_suffix(".png"))
        manifest["image_path"] = [str(Path(n).with_suffix(".png")) for n in manifest["image_path"]]
        data_arg, root = tmp_path / "pngs.csv", tmp_path
    elif given == "no_class_name":
        manifest = manifest.drop(columns="class_name")
        data_arg = tmp_path / "no_class_name.csv"
    if data_arg != folder:
        manifest.to_csv(data_arg, index=False)
    out = tmp_path / "pred.csv"
    assert main(["predict", str(runs[run]), "--data", str(data_arg), "--root", str(root), "--out", str(out)]) == 0
    assert f"predictions: {out} (the global model, round 1, {len(manifest)} samples)" in capsys.readouterr().out
    got = _check(out, len(manifest), headers(run))
    assert got["sample_id"].tolist() == manifest["sample_id"].tolist()
    assert got["label"].tolist() == manifest["label"].tolist()
    _, norm, size = RUNS[run]
    spec = {"name": "manifest", "path": str(data_arg if data_arg != folder else folder / "manifest.csv"),
            "root": str(root), "column": "image_path", "normalize": norm, "spatial_size": size}
    pd.testing.assert_frame_equal(got, _library(runs[run], spec, "0", tmp_path))


def test_global_model_on_its_own_and_on_new_npy_data(runs, headers, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """A synthetic2d run: on its own samples (default --out: RUN/predictions.csv) and on its data
    folder given as --data (a manifest of .npy arrays), the same predictions as the library."""
    run_dir = shutil.copytree(runs["fedavg"], tmp_path / "exp" / "fedavg")   # default --out is written here
    header = headers("fedavg")
    assert main(["predict", str(run_dir)]) == 0
    assert f"predictions: {run_dir / 'predictions.csv'} (the global model, round 1, 40 samples)" in capsys.readouterr().out
    own = _check(run_dir / "predictions.csv", 40, header)
    pd.testing.assert_frame_equal(own, _library(run_dir, None, "1", tmp_path))
    out = tmp_path / "new.csv"
    assert main(["predict", str(run_dir), "--data", str(_syn_dir(runs)), "--out", str(out)]) == 0
    pd.testing.assert_frame_equal(_check(out, 40, header), own)
    # --client: that client's model only (here the global one), and --split on a manifest's split column
    table = pd.read_csv(_syn_dir(runs) / "manifest.csv")
    table["split"] = ["test" if i % 4 == 0 else "train" for i in range(len(table))]
    table.to_csv(tmp_path / "split.csv", index=False)
    assert main(["predict", str(run_dir), "--data", str(tmp_path / "split.csv"), "--root", str(_syn_dir(runs)),
                 "--split", "test", "--client", "1", "--out", str(tmp_path / "test.csv")]) == 0
    assert "(client 1's model, round 1, 10 samples)" in capsys.readouterr().out
    pd.testing.assert_frame_equal(_check(tmp_path / "test.csv", 10, header),
                                  own[table["split"] == "test"].reset_index(drop=True))


def test_personal_models_write_one_csv_per_client(runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = runs["fedbn"]
    out = tmp_path / "p.csv"
    assert main(["predict", str(run_dir), "--data", str(_syn_dir(runs)), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    frames = {}
    for cid in ("0", "1"):
        path = tmp_path / f"p_client_{cid}.csv"
        assert f"predictions: {path} (client {cid}'s model, round 1, 40 samples)" in said
        frames[cid] = _check(path, 40, ["sample_id", "label", "prediction", "prob_class_0", "prob_class_1"])
        pd.testing.assert_frame_equal(frames[cid], _library(run_dir, None, cid, tmp_path))
    assert not out.exists()
    assert not np.allclose(frames["0"]["prob_class_0"], frames["1"]["prob_class_0"])   # two personal models
    assert main(["predict", str(run_dir), "--client", "1", "--out", str(out)]) == 0
    pd.testing.assert_frame_equal(_read(out), frames["1"])


def test_unlabelled_images_get_an_empty_label(runs, tmp_path: Path) -> None:
    run_dir, folder = runs["fedavg"], _syn_dir(runs)
    labelled = tmp_path / "labelled.csv"
    assert main(["predict", str(run_dir), "--data", str(folder), "--out", str(labelled)]) == 0
    want = _read(labelled)
    table = pd.read_csv(folder / "manifest.csv")
    table.drop(columns=["label", "class_name"]).to_csv(tmp_path / "none.csv", index=False)
    table["label"] = table["label"].astype(object)
    table.loc[[1, 5], "label"] = ""
    table.to_csv(tmp_path / "some.csv", index=False)
    for name, empty in (("none", list(range(40))), ("some", [1, 5])):
        out = tmp_path / f"{name}_pred.csv"
        assert main(["predict", str(run_dir), "--data", str(tmp_path / f"{name}.csv"), "--root", str(folder),
                     "--out", str(out)]) == 0
        got = _read(out)
        assert list(got.columns) == list(want.columns) and len(got) == 40
        assert got.index[got["label"].isna()].tolist() == empty
        pd.testing.assert_frame_equal(got.drop(columns="label"), want.drop(columns="label"))
        assert (got["label"].dropna() == want["label"].drop(index=empty)).all()
        assert ",," in (tmp_path / f"{name}_pred.csv").read_text().splitlines()[empty[0] + 1]   # an empty cell


def _manifest(runs: dict[str, Path], tmp: Path, edit: Callable[[pd.DataFrame], pd.DataFrame | None]) -> Path:
    """The synthetic2d manifest, edited, in ``tmp`` (its files read from --root)."""
    table = pd.read_csv(_syn_dir(runs) / "manifest.csv")
    edited = edit(table)
    (table if edited is None else edited).to_csv(tmp / "bad.csv", index=False)
    return tmp / "bad.csv"


def _empty_csv(tmp: Path) -> Path:
    (tmp / "x.csv").write_bytes(b"")
    return tmp / "x.csv"


def _other_size(prepared: dict[str, tuple[Path, Path]], tmp: Path) -> Path:
    """MIAS's prepared 16 x 16 arrays (``path``), unlabelled, for the 12 x 12 synthetic2d run."""
    _, folder = prepared["mias"]
    pd.read_csv(folder / "manifest.csv").drop(columns=["label", "class_name"]).to_csv(tmp / "mias.csv", index=False)
    return tmp / "mias.csv"


def _set(column: str, row: int, value: Any) -> Callable[[pd.DataFrame], pd.DataFrame]:
    def edit(t: pd.DataFrame) -> pd.DataFrame:
        t = t.copy()
        t[column] = t[column].astype(object)
        t.loc[row, column] = value
        return t
    return edit


# (id, the arguments after `medfl predict` given the runs, the prepared data and a folder, what
# the error line says)
ERRORS: list[tuple[str, Callable[[dict[str, Path], Any, Path], list[str]], str]] = [
    ("not-a-run", lambda r, p, t: [str(t)], "no config.json; not a medfl run or experiment directory"),
    ("experiment-dir", lambda r, p, t: [str(r["syn_exp"])],
     "an experiment directory; pass one method's run directory (fedavg, fedbn)"),
    ("unknown-client", lambda r, p, t: [str(r["fedavg"]), "--client", "9"], "unknown client(s) ['9']; the run has"),
    ("no-data", lambda r, p, t: [str(r["fedavg"]), "--data", str(t / "nowhere")],
     "nowhere: no such file or folder (--data: a data_prep folder or a manifest CSV)"),
    ("folder-without-manifest", lambda r, p, t: [str(r["fedavg"]), "--data", str(t)],
     "no manifest.csv; --data takes a folder a data_prep script wrote"),
    ("not-a-csv", lambda r, p, t: [str(r["fedavg"]), "--data", str(_empty_csv(t))], "x.csv: not a readable CSV manifest"),
    ("no-image-column", lambda r, p, t: [str(r["fedavg"]), "--data", str(_manifest(r, t, lambda d: d.drop(columns="path")))],
     "bad.csv: no column 'path'; the run read its images from that column (dataset.column)"),
    ("missing-file", lambda r, p, t: [str(r["fedavg"]), "--data", str(_manifest(r, t, _set("path", 2, "images/gone.npy"))),
                                      "--root", str(_syn_dir(r))],
     "bad.csv: 1 of 40 file(s) of column 'path' not found (e.g. "),
    ("relative-names", lambda r, p, t: [str(r["fedavg"]), "--data", str(_manifest(r, t, lambda d: None))],
     "bad.csv: 40 of 40 file(s) of column 'path' not found"),
    ("label-not-a-class-id", lambda r, p, t: [str(r["fedavg"]), "--data", str(_manifest(r, t, _set("label", 3, "MEL"))),
                                              "--root", str(_syn_dir(r))],
     "bad.csv: column 'label' has 'MEL' on line 5; expected a class id of the run, 0 to 1 (0 = class_0, 1 = class_1), "
     "or an empty cell for an unlabelled image"),
    ("label-out-of-range", lambda r, p, t: [str(r["fedavg"]), "--data", str(_manifest(r, t, _set("label", 0, 2))),
                                            "--root", str(_syn_dir(r))], "column 'label' has '2' on line 2"),
    ("class-name-disagrees", lambda r, p, t: [str(r["fedavg"]), "--data",
                                              str(_manifest(r, t, lambda d: d.assign(class_name="class_9"))),
                                              "--root", str(_syn_dir(r))],
     "in the run but 'class_9' here (column class_name); the labels must use the run's class ids"),
    ("no-split-column", lambda r, p, t: [str(r["fedavg"]), "--data", str(_syn_dir(r)), "--split", "test"],
     "split 'test' asked for, but the dataset has no 'split' column; use 'all'"),
    ("root-without-data", lambda r, p, t: [str(r["fedavg"]), "--root", str(t)], "--root goes with --data"),
    ("other-image-size", lambda r, p, t: [str(r["fedavg"]), "--data", str(_other_size(p, t)), "--root", str(p["mias"][1])],
     "mias.csv: its first image is (1, 16, 16) (channels, spatial size) after the run's preprocessing, but the run's "
     "models take (1, 12, 12)"),
    ("out-is-a-folder", lambda r, p, t: [str(r["fedavg"]), "--out", str(t)], ": a folder; --out takes the CSV file"),
]


@pytest.mark.parametrize("case,args,message", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_is_one_error_line(case: str, args: Callable[[dict[str, Path], Any, Path], list[str]], message: str,
                                     runs, prepared, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = args(runs, prepared, tmp_path)
    capsys.readouterr()
    assert main(["predict", *argv]) == 2
    captured = capsys.readouterr()
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("medfl: error: "), captured.err
    assert message in err[0], err[0]
    assert "Traceback" not in captured.err and "predictions:" not in captured.out


def test_an_existing_csv_is_kept_unless_overwrite(runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "mine.csv"
    out.write_text("keep me\n")
    assert main(["predict", str(runs["fedavg"]), "--out", str(out)]) == 2
    assert f"{out}: exists; medfl predict overwrites nothing unless --overwrite" in capsys.readouterr().err
    assert out.read_text() == "keep me\n"
    # per-client CSVs: refused before any is written when one exists
    (tmp_path / "p_client_1.csv").write_text("keep me too\n")
    assert main(["predict", str(runs["fedbn"]), "--out", str(tmp_path / "p.csv")]) == 2
    assert "p_client_1.csv: exists" in capsys.readouterr().err
    assert not (tmp_path / "p_client_0.csv").exists()
    assert main(["predict", str(runs["fedavg"]), "--out", str(out), "--overwrite"]) == 0
    assert _read(out).columns[0] == "sample_id"


def test_a_stopped_run_predicts_with_its_last_round(runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run_dir = shutil.copytree(runs["fedavg"], tmp_path / "exp" / "fedavg")
    (run_dir / "status.json").write_text(json.dumps({"status": "stopped", "last_round": 1, "rounds": 3}))
    assert main(["predict", str(run_dir), "--out", str(tmp_path / "p.csv")]) == 0
    captured = capsys.readouterr()
    assert "is 'stopped' at round 1 of 3: predicting with round 1's models (medfl resume" in captured.err
    pd.testing.assert_frame_equal(_read(tmp_path / "p.csv"), _library(runs["fedavg"], None, "0", tmp_path))


def test_a_run_whose_own_data_moved_says_so(runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Reopening a run reads its own dataset (its partition, its models' input shape)."""
    run_dir = shutil.copytree(runs["gray"], tmp_path / "exp" / "fedavg")
    config = json.loads((run_dir / "config.json").read_text())
    config["fl"]["dataset"]["path"] = str(tmp_path / "moved" / "manifest.csv")
    (run_dir / "config.json").write_text(json.dumps(config))
    assert main(["predict", str(run_dir), "--out", str(tmp_path / "p.csv")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == (f"medfl: error: {run_dir}: reopening the run reads its own dataset, which "
                                        f"failed: {tmp_path / 'moved' / 'manifest.csv'}: manifest not found"), err


def test_data_spec_refuses_a_dataset_made_by_code(tmp_path: Path) -> None:
    run = SimpleNamespace(config={"dataset": {"name": "random_blocks", "num_blocks": 1}})
    with pytest.raises(DataError, match="the run's dataset 'random_blocks' is made by its code, not read from a "
                                        "manifest's files.*leave --data out"):
        data_spec(run, tmp_path)


def test_export_doc_predict_commands_run_as_written(runs, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``medfl predict`` command docs/export.md gives runs: the demo one as written from a
    folder laid out as after ``make demo`` (the tiny synthetic2d experiment as
    bundles/demo/runs/demo), the one with placeholders with them filled in."""
    text = (REPO / "docs" / "export.md").read_text(encoding="utf-8")
    commands = [c for c in re.findall(r"`(medfl predict [^`]*)`", text) if c != "medfl predict --help"]
    concrete = [c for c in commands if not re.search(r"\b[A-Z][A-Z_]+\b", c)]
    assert concrete and len(commands) > len(concrete), commands
    (tmp_path / "bundles" / "demo" / "runs").mkdir(parents=True)
    shutil.copytree(runs["syn_exp"], tmp_path / "bundles" / "demo" / "runs" / "demo")
    monkeypatch.chdir(tmp_path)
    fill = {"RUN": "bundles/demo/runs/demo/fedavg", "DIR_OR_MANIFEST": str(_syn_dir(runs)), "ID": "1",
            "CSV": "filled.csv"}
    for command in commands:
        argv = [fill.get(a, a) for a in shlex.split(command.replace("[", "").replace("]", ""))]
        assert argv[:2] == ["medfl", "predict"]
        capsys.readouterr()
        assert main(argv[1:]) == 0, command
        written = re.findall(r"^predictions: (\S+)", capsys.readouterr().out, re.M)
        assert written, command
        for path in written:
            assert len(_read(Path(path))) == 40, (command, path)
