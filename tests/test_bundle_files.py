"""Every bundle carries the files a MONAI model-zoo bundle has (bundles/bundle_files.py writes
them from one template): configs/logging.conf, configs/evaluate.json, LICENSE,
docs/data_license.txt, models/."""

from __future__ import annotations

import importlib.util
import io
import logging
import logging.config
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BUNDLES = sorted(p.parent.parent for p in (ROOT / "bundles").glob("*/configs/train.json"))


def _bundle_files():
    """``bundles/bundle_files.py`` imported from its path (it is a script, not a package module)."""
    spec = importlib.util.spec_from_file_location("bundle_files", ROOT / "bundles" / "bundle_files.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_twelve_bundles_are_found() -> None:
    assert len(BUNDLES) == 12, [b.name for b in BUNDLES]


def test_every_bundle_matches_the_template() -> None:
    """No copy drifts from bundles/bundle_files.py; the script's --check says the same."""
    assert _bundle_files().check() == []
    proc = subprocess.run([sys.executable, str(ROOT / "bundles" / "bundle_files.py"),
                           "--check"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_check_names_a_drifted_file(tmp_path, monkeypatch) -> None:
    module = _bundle_files()
    fake = tmp_path / "bundles" / "demo"
    (fake / "configs").mkdir(parents=True)
    (fake / "configs" / "train.json").write_text("{}")
    (tmp_path / "LICENSE").write_text("Apache License\n")
    monkeypatch.setattr(module, "BUNDLES_DIR", tmp_path / "bundles")
    monkeypatch.setattr(module, "_REPO", tmp_path)
    assert sorted(module.check()) == sorted(f"bundles/demo/{f}: missing" for f in
                                            ("configs/logging.conf", "LICENSE", "docs/data_license.txt",
                                             "models/README.md", "configs/evaluate.json"))
    module.write()
    assert module.check() == []
    (fake / "configs" / "logging.conf").write_text("[loggers]\nkeys=root\n")
    assert module.check() == ["bundles/demo/configs/logging.conf: differs from the template in "
                              "bundles/bundle_files.py"]


def test_a_bundle_without_a_data_entry_is_named(tmp_path, monkeypatch) -> None:
    module = _bundle_files()
    (tmp_path / "bundles" / "newone" / "configs").mkdir(parents=True)
    (tmp_path / "bundles" / "newone" / "configs" / "train.json").write_text("{}")
    (tmp_path / "LICENSE").write_text("x")
    monkeypatch.setattr(module, "BUNDLES_DIR", tmp_path / "bundles")
    monkeypatch.setattr(module, "_REPO", tmp_path)
    with pytest.raises(KeyError, match="bundle 'newone' has no entry in BUNDLE_DATA"):
        module.check()


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda p: p.name)
def test_bundle_has_licence_files_and_models_folder(bundle: Path) -> None:
    licence = (bundle / "LICENSE").read_text()
    assert "Apache License" in licence and "Version 2.0, January 2004" in licence
    assert licence == (ROOT / "LICENSE").read_text()
    data = (bundle / "docs" / "data_license.txt").read_text()
    assert re.search(r"^Licence: ", data, re.M), data
    if bundle.name == "demo":
        assert "no licence needed" in data.lower() or "licence: none needed" in data.lower()
    else:
        assert re.search(r"CC BY|licence, for research use|own terms", data), data
        assert "Source:" in data or "http" in data
    assert (bundle / "models" / "README.md").is_file()
    assert "medfl export" in (bundle / "models" / "README.md").read_text()
    readme = (bundle / "docs" / "README.md").read_text()
    assert "## Using this bundle with MONAI's tools" in readme
    assert "docs/bundles.md" in readme and "data_license.txt" in readme and "LICENSE" in readme


@pytest.mark.parametrize(("bundle", "expected"), [
    ("ham10000", "CC BY-NC 4.0"), ("ham10000_fedsdc", "CC BY-NC 4.0"), ("cbis_ddsm", "CC BY 3.0"),
    ("abide", "CC BY-NC-SA 3.0"), ("abide_fedskd", "CC BY-NC-SA 3.0"), ("pathmnist_fedtpf", "CC BY 4.0"),
    ("mias", "mini-MIAS licence"), ("derm7pt", "own terms"), ("cbis_ddsm_pfedcdp", "mini-MIAS licence"),
])
def test_data_licence_is_the_datasets(bundle: str, expected: str) -> None:
    assert expected in (ROOT / "bundles" / bundle / "docs" / "data_license.txt").read_text()


def test_models_folder_is_tracked_and_not_ignored() -> None:
    """git keeps models/ (it holds a file that is not ignored), so a clone has the folder."""
    for bundle in BUNDLES:
        rel = (bundle / "models" / "README.md").relative_to(ROOT)
        proc = subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", str(rel)], timeout=60)
        assert proc.returncode == 1, f"{rel} is ignored by .gitignore"


@pytest.mark.parametrize("bundle", BUNDLES, ids=lambda p: p.name)
def test_logging_conf_parses_into_a_fresh_logging_state(bundle: Path) -> None:
    """The file applies with fileConfig as MONAI applies it (after MONAI's own check of its
    ``class``/``args`` fields), gives the medfl logger INFO on stderr, its messages as they
    are, with no duplicate through the root logger, and leaves the logging state as it was afterwards."""
    from monai.bundle.workflows import _reject_executable_logging_config

    path = bundle / "configs" / "logging.conf"
    content = _reject_executable_logging_config(str(path))
    root, medfl = logging.getLogger(), logging.getLogger("medfl")
    saved = (root.level, list(root.handlers), medfl.level, list(medfl.handlers), medfl.propagate)
    try:
        for h in list(root.handlers):
            root.removeHandler(h)
        logging.config.fileConfig(io.StringIO(content), disable_existing_loggers=False)
        assert medfl.level == logging.INFO and root.level == logging.INFO
        assert not medfl.propagate
        (handler,) = medfl.handlers
        assert isinstance(handler, logging.StreamHandler) and handler.stream is sys.stderr
        stream = io.StringIO()
        handler.setStream(stream)
        logging.getLogger("medfl.engine.runner").info("round %d done", 3)
        logging.getLogger("medfl.engine.runner").debug("hidden")
        # medfl's lines as the medfl command prints them (a user error stays "medfl: error: ...")
        assert stream.getvalue() == "round 3 done\n"
    finally:
        for logger in (root, medfl):
            for h in list(logger.handlers):
                logger.removeHandler(h)
        root.setLevel(saved[0])
        for h in saved[1]:
            root.addHandler(h)
        medfl.setLevel(saved[2])
        for h in saved[3]:
            medfl.addHandler(h)
        medfl.propagate = saved[4]
