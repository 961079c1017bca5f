"""Issue 64, item 6: a path where an input file should be that is not one (a directory, a
symlink loop, an empty file; a broken symlink or an unreadable file) is named for what it is,
in one line, by every data_prep command, and never with the ``--present-only`` hint (which
would silently drop a sample whose path exists); nothing of the user's changes."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Callable

import pytest

from medfl.fixtures import generate
from medfl.prep import abide, cbis_ddsm, derm7pt, ham10000, medmnist, mias
from medfl.prep.common import run_script
from medfl.prep.errors import PrepError
from medfl.prep.staging import check_dirs


@pytest.fixture(autouse=True)
def _quiet(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEDFL_NO_PROGRESS", "1")


def _abide_map(raw: Path, info: dict) -> Path:
    fid = next(f for f in info["file_ids"] if f != info["qc_fail_file_id"])
    d = info["derivatives"][0]
    return next(Path(info["derivatives_dir"]).rglob(f"{fid}_{d}.nii.gz"))


def _first(pattern: str) -> Callable[[Path, dict], Path]:
    return lambda raw, info: sorted(raw.rglob(pattern))[0]


# dataset -> (main, fixture options, prep options, the image (or data file) to replace)
CASES: dict[str, tuple[Callable, dict, list[str], Callable[[Path, dict], Path]]] = {
    "ham10000": (ham10000.main, {"cases": 7}, ["--size", "16"], _first("ISIC_*.jpg")),
    "mias": (mias.main, {"cases": 6}, ["--size", "32"], _first("mdb*.pgm")),
    "abide": (abide.main, {"cases": 4}, ["--atlas", "none"], _abide_map),
    "cbis_ddsm": (cbis_ddsm.main, {"cases": 4, "layout": "tcia"}, ["--size", "32", "32"],
                  _first("*full mammogram images*/1-1.dcm")),
    "derm7pt": (derm7pt.main, {"cases": 12}, ["--size", "16"], _first("*.jpg")),
    "medmnist": (medmnist.main, {"cases": 27}, ["--flag", "pathmnist"], _first("pathmnist.npz")),
}


def _directory(p: Path) -> None:
    p.unlink()
    p.mkdir()


def _loop(p: Path) -> None:
    p.unlink()
    p.symlink_to(p.name)        # a link to itself


def _empty(p: Path) -> None:
    p.write_bytes(b"")


ODD = [("a directory", _directory), ("a symlink loop", _loop), ("an empty file (0 bytes)", _empty)]


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    base = tmp_path_factory.mktemp("odd")
    out = {}
    for name, (_, fx, _, _) in CASES.items():
        info = generate(name, base / name, seed=1, reference=False, **fx)
        out[name] = (Path(info.get("root", base / name)), info)
    return out


def _snapshot(root: Path) -> dict[str, str]:
    """What each entry under ``root`` is: a file's digest, a link's target, or 'dir'."""
    snap = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            snap[rel] = "-> " + os.readlink(p)
        elif p.is_dir():
            snap[rel] = "dir"
        else:
            snap[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return snap


def _cli(main: Callable, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``main`` as its command line does (``python -m medfl.prep...``): stderr of a stop."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as stop:
        run_script(main, argv)
    assert stop.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("kind,make", ODD, ids=[k.split()[1] for k, _ in ODD])
@pytest.mark.parametrize("name", sorted(CASES))
def test_an_odd_path_is_named_in_one_line_without_present_only(name, kind, make, fixtures, tmp_path, capsys):
    main, _, options, pick = CASES[name]
    src, info = fixtures[name]
    raw = tmp_path / "raw"
    shutil.copytree(src, raw, symlinks=True)
    victim = pick(raw, {k: str(v).replace(str(src), str(raw)) if isinstance(v, str) else v
                        for k, v in info.items()})
    make(victim)
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("the user's")
    before = _snapshot(raw)
    err = _cli(main, ["--raw", str(raw), "--out", str(out), *options], capsys)
    line = err.strip().splitlines()[-1]      # the message is this one line (warnings may come before it)
    assert line.startswith(f"error: {victim}: {kind}") and err.count("error: ") == 1, err
    assert "--present-only" not in err and "Traceback" not in err
    # nothing of the user's was touched: the raw tree, and what --out held
    assert _snapshot(raw) == before
    assert sorted(p.name for p in out.iterdir()) == ["mine.txt"] and (out / "mine.txt").read_text() == "the user's"


@pytest.mark.parametrize("name", sorted(set(CASES) - {"medmnist"}))
def test_present_only_stops_at_a_folder_named_like_an_image(name, fixtures, tmp_path):
    """``--present-only`` skips files that are absent; a folder where an image should be is
    not absent, so the run stops naming it (it was skipped as 'not downloaded')."""
    main, _, options, pick = CASES[name]
    src, info = fixtures[name]
    raw = tmp_path / "raw"
    shutil.copytree(src, raw, symlinks=True)
    victim = pick(raw, {k: str(v).replace(str(src), str(raw)) if isinstance(v, str) else v
                        for k, v in info.items()})
    _directory(victim)
    with pytest.raises(PrepError) as err:
        main(["--raw", str(raw), "--out", str(tmp_path / "out"), *options, "--present-only"])
    assert f"{victim}: a directory" in str(err.value) and "--present-only" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_the_command_itself_prints_one_line(fixtures, tmp_path):
    """The real ``python -m medfl.prep.ham10000``: exit status 2, one line, no traceback."""
    import subprocess
    import sys

    raw = tmp_path / "raw"
    shutil.copytree(fixtures["ham10000"][0], raw)
    victim = sorted(raw.rglob("ISIC_*.jpg"))[0]
    _loop(victim)
    proc = subprocess.run([sys.executable, "-m", "medfl.prep.ham10000", "--raw", str(raw), "--out",
                           str(tmp_path / "out"), "--size", "16"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "MEDFL_NO_PROGRESS": "1"})
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith(f"error: {victim}: a symlink loop (-> {victim.name}")
    assert "--present-only" not in proc.stderr


def test_file_problem_names_each_kind(tmp_path, monkeypatch):
    from medfl.prep.errors import check_file, file_problem

    ok = tmp_path / "ok.txt"
    ok.write_text("x")
    (tmp_path / "broken").symlink_to("nowhere.txt")
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    os.mkfifo(tmp_path / "fifo")
    assert file_problem(ok) == "" and check_file(ok, "x") == ok
    assert file_problem(tmp_path / "absent") == "not found"
    assert file_problem(tmp_path / "broken") == "a broken symlink (-> nowhere.txt, which does not exist)"
    assert file_problem(tmp_path / "a").startswith("a symlink loop (-> b")
    assert file_problem(tmp_path / "fifo") == "a FIFO, socket or device"
    with pytest.raises(PrepError, match=r"^--raw .*/a: a symlink loop \(-> b"):     # resolve() raised RuntimeError
        check_dirs(tmp_path / "a", tmp_path / "out", overwrite=False)
    with pytest.raises(PrepError, match="not found; expected the thing") as absent:
        check_file(tmp_path / "absent", "the thing")
    assert type(absent.value).__name__ == "NotDownloaded"      # a partial download: --present-only skips it
    with pytest.raises(PrepError) as broken:
        check_file(tmp_path / "broken", "the thing")
    assert type(broken.value) is PrepError                      # it exists: never skipped as not downloaded
    # unreadable: the tests run as root, who reads anything, so the permission is faked
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: False)
    assert file_problem(ok) == "unreadable (permission denied)"
    with pytest.raises(PrepError, match=r"ok.txt: unreadable \(permission denied\); expected the thing$"):
        check_file(ok, "the thing")
