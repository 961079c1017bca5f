"""The wheel ships everything: built from a copy of the source tree (no download: the build
backend is this environment's setuptools), installed into a fresh virtual environment whose
only medfl is the wheel's, it holds every bundle and data_prep file (the repository's own
bytes, none of a checkout's data or runs), and there ``medfl --version``, ``python -m
medfl``, ``medfl bundles``, ``medfl bundles init`` and a run of the copied demo bundle,
every ``python -m medfl.prep.<dataset> --help`` and a real prep run all work.

The fresh environment gets medfl's dependencies from this one through a ``.pth`` line naming
this environment's site-packages (``.pth`` files there, such as the editable install's
finder, are not run from such a line, so this environment's medfl stays invisible: the test
checks where medfl is imported from).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tomllib
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: The source tree a wheel is built from (pyproject.toml's readme and license-files, the
#: package-dir folders).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "medfl", "plugins", "bundles", "data_prep")
#: A demo run at tiny sizes (as tests/tracking/test_tracking.py's TINY_BUNDLE).
TINY = ("--fl#rounds", "1", "--fl#dataset#num_samples", "240", "--fl#partition#min_size", "10",
        "--fl#progress", "False", "--fl#model#width", "4", "--fl#dataset#image_size", "16",
        "--fl#methods", "[{'name': 'fedavg'}]")
#: What a checkout's bundle folder may hold that a wheel must not: written into the copy.
JUNK = ("bundles/demo/data/synthetic.npz", "bundles/demo/runs/demo/fedavg/summary.json",
        "bundles/demo/configs/__pycache__/x.pyc")

#: what the fresh environment imports first (a ``.pth`` line): every import of ``flwr`` fails
NO_FLOWER = """import importlib.abc, sys

class _NoFlower(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "flwr" or name.startswith("flwr."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: Flower is an extra of medfl)", name=name)

sys.meta_path.insert(0, _NoFlower())
"""


def _left_out(rel: Path) -> bool:
    """Whether a path of bundles/ or data_prep/ (relative to the repository) is no part of
    a wheel: Python's caches, and a checkout's bundles/<name>/data and runs."""
    return ("__pycache__" in rel.parts or rel.suffix == ".pyc"
            or (rel.parts[0] == "bundles" and len(rel.parts) > 2 and rel.parts[2] in ("data", "runs")))


def _ignore(directory: str, names: list[str]) -> set[str]:
    """:func:`shutil.copytree`'s ``ignore`` for the source copy: what :func:`_left_out` names."""
    here = Path(directory)
    rel = here.relative_to(ROOT) if here.is_relative_to(ROOT) else Path(here.name)
    return {n for n in names if _left_out(rel / n) or n.endswith(".egg-info")}


def _shipped_files() -> dict[str, Path]:
    """Every file of bundles/ and data_prep/ a wheel must hold, by its path in the wheel."""
    return {f"medfl/{path.relative_to(ROOT).as_posix()}": path
            for folder in ("bundles", "data_prep") for path in sorted((ROOT / folder).rglob("*"))
            if path.is_file() and not _left_out(path.relative_to(ROOT))}


def _run(cmd: list[str], env: dict[str, str], cwd: Path, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600)
    if check:
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Build the wheel from a copy of the sources (with a checkout's junk added to the
    copy) and install it, without dependencies or an index, into a fresh venv."""
    try:
        backend = tuple(int(p) for p in metadata.version("setuptools").split(".")[:2])
    except metadata.PackageNotFoundError:
        backend = (0, 0)
    if backend < (77, 0):   # not imported here: setuptools patches distutils on import
        pytest.skip("the build backend is this environment's setuptools, 77 or later (PEP 639 licence "
                    "expression), which the test extra installs")
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=_ignore)
        else:
            src.mkdir(exist_ok=True)
            shutil.copyfile(ROOT / name, src / name)
    for junk in JUNK:
        (src / junk).parent.mkdir(parents=True, exist_ok=True)
        (src / junk).write_text("not part of the bundle")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHONPATH", "PIP_", "VIRTUAL_ENV"))}
    build = _run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "--no-index",
                  "-w", str(tmp / "dist"), str(src)], env, tmp)
    (wheel,) = (tmp / "dist").glob("medfl-*.whl")
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], env, tmp)
    python = venv / "bin" / "python"
    purelib = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                   env, tmp).stdout.strip()
    Path(purelib, "_medfl_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # Flower is an extra: the installed wheel runs in process with every flwr import refused
    Path(purelib, "_medfl_no_flower.py").write_text(NO_FLOWER)
    Path(purelib, "_medfl_no_flower.pth").write_text("import _medfl_no_flower\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
          "--no-compile", str(wheel)], env, tmp)
    work = tmp / "work"   # not the repository: python -m puts the working folder on sys.path
    work.mkdir()
    run_env = {**env, "PATH": os.pathsep.join([str(venv / "bin"), env.get("PATH", "")]), "MEDFL_NO_PROGRESS": "1",
               "MEDFL_NO_PLOTS": "1", "COLUMNS": "100"}
    return {"wheel": wheel, "build": build.stdout + build.stderr, "python": str(python), "purelib": Path(purelib),
            "env": run_env, "work": work, "venv": venv}


def test_the_wheel_holds_every_bundle_and_prep_file_and_builds_without_warnings(installed: dict[str, Any]) -> None:
    log = installed["build"]
    assert not re.findall(r".*(?:Warning|deprecat).*", log), re.findall(r".*(?:Warning|deprecat).*", log)
    with zipfile.ZipFile(installed["wheel"]) as whl:
        names = set(whl.namelist())
        shipped = _shipped_files()
        assert {"medfl/bundles/demo/configs/train.json", "medfl/data_prep/ham10000.py"} <= set(shipped)
        for name, path in shipped.items():
            assert name in names, f"{name} is not in the wheel"
            assert whl.read(name) == path.read_bytes(), f"{name} differs from {path}"
        extra = {n for n in names if n.startswith(("medfl/bundles/", "medfl/data_prep/"))} - set(shipped)
        assert not extra, f"the wheel holds files that are not the repository's: {sorted(extra)}"
        meta = whl.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert f"\nVersion: {version}\n" in meta and "\nLicense-Expression: Apache-2.0\n" in meta
    assert "\nLicense-File: LICENSE\n" in meta and "\nClassifier: Typing :: Typed\n" in meta
    assert not re.search(r"^Classifier: License ::", meta, re.M)   # PEP 639: the expression alone
    flower = re.findall(r"^Requires-Dist: flwr.*$", meta, re.M)
    assert flower and all("extra ==" in line for line in flower), flower   # Flower only with medfl[flower]


def test_the_installed_wheel_lists_copies_and_runs_a_bundle(installed: dict[str, Any]) -> None:
    """Without Flower (:data:`NO_FLOWER`): in process, medfl needs none of its extras."""
    env, work, python = installed["env"], installed["work"], installed["python"]
    where = _run([python, "-c", "import importlib.util as u; print(u.find_spec('medfl').origin); "
                  "print(u.find_spec('medfl_plugins').origin)"], env, work).stdout.split()
    assert all(Path(p).is_relative_to(installed["purelib"]) for p in where), where
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert _run(["medfl", "--version"], env, work).stdout.strip() == f"medfl {version}"
    listed = _run([python, "-m", "medfl", "bundles"], env, work).stdout   # python -m medfl is the CLI
    assert f"in {installed['purelib'] / 'medfl' / 'bundles'}:" in listed
    for bundle in sorted(p.parent.parent.name for p in (ROOT / "bundles").glob("*/configs/train.json")):
        assert re.search(rf"^  {bundle} +\S", listed, re.M), f"{bundle} not listed:\n{listed}"
    copied = _run(["medfl", "bundles", "init", "demo", "mydemo"], env, work).stdout
    assert "medfl run mydemo/configs/train.json --bundle_root mydemo" in copied
    for path in (ROOT / "bundles" / "demo" / "configs").iterdir():
        assert (work / "mydemo" / "configs" / path.name).read_bytes() == path.read_bytes(), path.name
    _run(["medfl", "run", "mydemo/configs/train.json", "--bundle_root", "mydemo", "--threads", "1", *TINY], env, work)
    summary = json.loads((work / "mydemo" / "runs" / "demo" / "fedavg" / "summary.json").read_text())
    assert summary["rounds"] == 1 and 0 <= summary["final"]["local_test"]["accuracy"]["mean"] <= 1


def test_the_installed_prep_scripts_print_their_usage_and_prepare_a_fixture(installed: dict[str, Any]) -> None:
    from medfl.fixtures import generate

    env, work, python = installed["env"], installed["work"], installed["python"]
    names = sorted(p.stem for p in (ROOT / "data_prep").glob("*.py"))
    # every `python -m medfl.prep.<name> --help`, in one process (runpy is what python -m runs)
    code = ("import contextlib, io, json, runpy, sys\n"
            "shown = {}\n"
            f"for name in {names!r}:\n"
            "    sys.argv = ['-m', '--help']\n"
            "    out = io.StringIO()\n"
            "    with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):\n"
            "        runpy.run_module(f'medfl.prep.{name}', run_name='__main__', alter_sys=True)\n"
            "    shown[name] = out.getvalue()\n"
            "print(json.dumps(shown))\n")
    shown = json.loads(_run([python, "-c", code], env, work).stdout.splitlines()[-1])
    assert sorted(shown) == names
    for name, text in shown.items():
        assert text.startswith(f"usage: python -m medfl.prep.{name} [-h] --raw RAW --out OUT"), (name, text[:200])
    generate("mias", work / "raw", cases=12, seed=0, reference=False)   # the input, written by this checkout
    _run([python, "-m", "medfl.prep.mias", "--raw", "raw", "--out", "prepared", "--size", "16"], env, work)
    manifest = (work / "prepared" / "manifest.csv").read_text().splitlines()
    assert len(manifest) == 13 and manifest[0].startswith("sample_id,path,")


# ------------------------------------------------------------------ medfl bundles, in this checkout


def _bundle(root: Path, name: str, metadata: str | None, readme: str | None = None) -> Path:
    """A bundle folder under ``root`` with ``configs/train.json`` and the given files."""
    folder = root / name
    (folder / "configs").mkdir(parents=True)
    (folder / "configs" / "train.json").write_text('{"fl": {}}')
    if metadata is not None:
        (folder / "configs" / "metadata.json").write_text(metadata)
    if readme is not None:
        (folder / "docs").mkdir()
        (folder / "docs" / "README.md").write_text(readme)
    return folder


def test_bundles_are_listed_with_their_titles(tmp_path: Path) -> None:
    from medfl.shipped import BundleError, list_bundles

    _bundle(tmp_path, "b_meta", '{"name": "medfl B: FedAvg vs Local"}', "# ignored title\n")
    _bundle(tmp_path, "a_readme", '{"version": "0.1.0"}', "intro\n# medfl A bundle: a title\n")
    (tmp_path / "not_a_bundle").mkdir()
    assert [(b.name, b.title) for b in list_bundles(tmp_path)] == [("a_readme", "A bundle: a title"),
                                                                  ("b_meta", "B: FedAvg vs Local")]
    _bundle(tmp_path, "c_broken", "{not json")
    with pytest.raises(BundleError, match=r"c_broken/configs/metadata.json: not readable JSON .* MONAI metadata"):
        list_bundles(tmp_path)


def test_the_checkout_lists_every_repository_bundle() -> None:
    from medfl.shipped import bundles_dir, list_bundles

    assert bundles_dir() == ROOT / "bundles"
    shipped = {b.name: b.title for b in list_bundles()}
    assert set(shipped) == {p.parent.parent.name for p in (ROOT / "bundles").glob("*/configs/train.json")}
    assert all(shipped.values()), shipped


def test_bundles_init_copies_the_bundle_alone_and_never_overwrites(tmp_path: Path) -> None:
    from medfl.shipped import BundleError, init_bundle

    source = _bundle(tmp_path / "bundles", "x", '{"name": "medfl X"}', "# X\n")
    for junk in ("data/manifest.csv", "runs/x/summary.json", "configs/__pycache__/a.pyc"):
        (source / junk).parent.mkdir(parents=True, exist_ok=True)
        (source / junk).write_text("junk")
    (source / "configs" / "train.json").chmod(0o444)   # an installed file may be read-only
    out = init_bundle("x", tmp_path / "new" / "copy", folder=tmp_path / "bundles")
    assert sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file()) == \
        ["configs/metadata.json", "configs/train.json", "docs/README.md"]
    assert (out / "configs" / "train.json").read_text() == '{"fl": {}}'
    (out / "configs" / "train.json").write_text("{}")   # a copy to edit
    with pytest.raises(BundleError, match=r"copy: not empty; expected a new or empty folder .* never overwrites"):
        init_bundle("x", out, folder=tmp_path / "bundles")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(BundleError, match=r"a_file: exists and is not a folder"):
        init_bundle("x", tmp_path / "a_file", folder=tmp_path / "bundles")
    with pytest.raises(BundleError, match=r"unknown bundle 'y'; expected one of: x \(medfl bundles lists them\)"):
        init_bundle("y", tmp_path / "other", folder=tmp_path / "bundles")
    assert not (tmp_path / "other").exists()
    (tmp_path / "empty").mkdir()
    assert (init_bundle("x", tmp_path / "empty", folder=tmp_path / "bundles") / "docs" / "README.md").is_file()


def test_cli_version_and_bundles_refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import medfl
    from medfl.cli import main

    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert medfl.__version__ == version
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out == f"medfl {version}\n"
    assert main(["bundles", "init", "no_such_bundle", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
