"""Issue 19: a partial download (a metadata file listing more samples than were downloaded) is
normal. Every file-by-file data_prep script stops at the first absent file and says how to go
on; ``--present-only`` prepares the samples that are present, lists the absent ones in
skipped.csv as 'not downloaded', counts them in report.json, and ``--limit`` counts present
samples."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Callable

import pandas as pd
import pytest

from medfl.fixtures import generate
from medfl.prep import abide, cbis_ddsm, derm7pt, ham10000, mias
from medfl.prep.errors import PrepError


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")


def _remove_file(raw: Path, image_path: str) -> None:
    (raw / image_path).unlink()


def _remove_every_copy(raw: Path, image_path: str) -> None:
    for copy in raw.rglob(Path(image_path).name):   # HAM10000 downloads hold some images twice
        copy.unlink()


def _remove_series(raw: Path, image_path: str) -> None:
    shutil.rmtree((raw / image_path).parent)   # a CBIS series folder not downloaded


# dataset -> (main, fixture options, prep options, how to take one sample's file away)
CASES: dict[str, tuple[Callable[[list[str] | None], int], dict, list[str], Callable[[Path, str], None]]] = {
    "mias": (mias.main, {"cases": 20}, ["--size", "32"], _remove_file),
    "ham10000": (ham10000.main, {"cases": 30}, ["--size", "16"], _remove_every_copy),
    "derm7pt": (derm7pt.main, {"cases": 30}, ["--size", "16"], _remove_file),
    "cbis_ddsm": (cbis_ddsm.main, {"cases": 16, "layout": "tcia"}, ["--size", "32", "32"], _remove_series),
    "abide": (abide.main, {"cases": 12}, ["--atlas", "none"], _remove_file),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_present_only_prepares_a_partial_download(name: str, tmp_path: Path) -> None:
    main, fx_options, options, remove = CASES[name]
    info = generate(name, tmp_path / "fx", seed=2, reference=False, **fx_options)
    raw = Path(info.get("root", tmp_path / "fx"))

    def prep(out: str, *extra: str) -> pd.DataFrame:
        assert main(["--raw", str(raw), "--out", str(tmp_path / out), *options, *extra]) == 0
        return pd.read_csv(tmp_path / out / "manifest.csv", keep_default_na=False)

    full = prep("full")
    pool = full[full["split"] == "train"] if (full["split"] == "train").any() else full
    gone = pool.sort_values("sample_id").iloc[:2]
    assert len(gone) == 2
    for path in gone["image_path"]:
        remove(raw, path)
    # by default the first absent file stops the run, with the way to go on
    with pytest.raises(PrepError, match="not found|missing") as err:
        prep("stopped")
    assert "--present-only" in str(err.value) and not (tmp_path / "stopped").exists()

    part = prep("part", "--present-only")
    assert sorted(part["sample_id"]) == sorted(set(full["sample_id"]) - set(gone["sample_id"]))
    report = json.loads((tmp_path / "part" / "report.json").read_text())
    assert report["present_only"] is True and report["num_not_downloaded"] == 2
    skipped = pd.read_csv(tmp_path / "part" / "skipped.csv")
    assert (skipped["stage"] == "not downloaded").sum() == 2

    # --limit counts samples that can be prepared
    few = prep("few", "--present-only", "--limit", "3")
    assert len(few) == 3 and not set(few["sample_id"]) & set(gone["sample_id"])


def test_present_only_with_nothing_downloaded_names_raw(tmp_path: Path) -> None:
    raw = tmp_path / "fx"
    generate("ham10000", raw, cases=7, seed=0, reference=False)
    for jpg in raw.rglob("*.jpg"):
        jpg.unlink()
    with pytest.raises(PrepError, match=r"--present-only: none of the 7 listed sample\(s\) has its file under --raw"):
        ham10000.main(["--raw", str(raw), "--out", str(tmp_path / "o"), "--present-only"])
    assert not (tmp_path / "o").exists()


def test_present_only_that_empties_a_derm7pt_split_stops(tmp_path: Path) -> None:
    raw = Path(generate("derm7pt", tmp_path / "fx", cases=12, seed=0, reference=False).get("root", tmp_path / "fx"))
    full_out = tmp_path / "full"
    assert derm7pt.main(["--raw", str(raw), "--out", str(full_out), "--size", "16"]) == 0
    full = pd.read_csv(full_out / "manifest.csv", keep_default_na=False)
    for path in full.loc[full["split"] == "val", "image_path"]:
        (raw / path).unlink()
    with pytest.raises(PrepError, match=r"split 'val' .*none of its \d+ case\(s\) has its images under --raw"):
        derm7pt.main(["--raw", str(raw), "--out", str(tmp_path / "o"), "--size", "16", "--present-only"])


def test_medmnist_has_no_present_only() -> None:
    from medfl.prep.medmnist import build_parser

    assert "--present-only" not in build_parser().format_help()
    assert "--present-only" in mias.build_parser().format_help()
