"""Every bundle's ``docs/README.md`` opens with "Try it on fixture data": the three commands
(fixture, data prep, run) that ``python -m medfl.fixtures --bundle NAME`` prints, run here as
written from a folder laid out like the repository root (``bundles/<name>/configs``,
``data_prep``), at the tiny size of the bundle's ``configs/try.json``. The fixture is large
enough for the split of the bundle's defaults (checked on the prepared data), and a split too
small to train stops in one line, with nothing written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bundle_readme import REPO, readme_commands, run_readme

from medfl.fixtures.bundles import BUNDLE_FIXTURES, bundle_commands

BUNDLES = sorted(p.name for p in (REPO / "bundles").iterdir() if (p / "configs" / "train.json").is_file())
#: bundles whose end-to-end test runs their README's commands (and checks more of what they
#: wrote): each bundle trains once in the suite
RUN_BY = {"demo": "tests/test_demo_bundle.py", "derm7pt_fedkper": "tests/methods/test_fedkper_bundle.py",
          "abide_fedskd": "tests/methods/test_fedskd_bundles.py", "derm7pt_fedskd": "tests/methods/test_fedskd_bundles.py",
          "cbis_ddsm_pfedcdp": "tests/methods/test_pfedcdp_bundle.py",
          "ham10000": "tests/methods/test_ham10000_bundles.py", "ham10000_fedsdc": "tests/methods/test_ham10000_bundles.py"}


@pytest.mark.parametrize("bundle", BUNDLES)
def test_readme_opens_with_the_fixture_commands(bundle: str) -> None:
    """The README's block is what ``python -m medfl.fixtures --bundle`` prints, and every
    bundle has a fixture entry and a ``configs/try.json``."""
    assert bundle in BUNDLE_FIXTURES
    assert readme_commands(bundle) == bundle_commands(bundle)
    assert len(readme_commands(bundle)) == (3 if BUNDLE_FIXTURES[bundle].parts else 1)
    assert json.loads((REPO / "bundles" / bundle / "configs" / "try.json").read_text())


@pytest.mark.parametrize("bundle", [b for b in BUNDLES if b not in RUN_BY])
def test_readme_commands_run_as_written(bundle: str, tmp_path: Path) -> None:
    """Fixture, prep and run as the README writes them; the fixture fits the defaults' split;
    the run's ``results:`` folder (a path from where it ran) has every method's metrics."""
    _, results = run_readme(bundle, tmp_path)
    assert list(results.rglob("metrics.csv")) and list(results.rglob("summary.json"))


def test_the_suite_runs_as_a_clone_without_shared_does() -> None:
    """The READMEs' fixtures (and every fixture the suite writes) are built from synthesised
    rows, in this process and in those it starts, as on a user's clone with no
    ``../shared``: a fixture too small for its bundle's defaults fails here, not for users."""
    import os

    from medfl.fixtures import reference_data_dir

    assert os.environ.get("MEDFL_REFERENCE_DATA") == "none"
    assert reference_data_dir() is None
    proc = subprocess.run([sys.executable, "-c", "from medfl.fixtures import reference_data_dir as r; print(r())"],
                          capture_output=True, text=True, timeout=120, check=True)
    assert proc.stdout.strip() == "None"


def test_every_other_readme_is_run_by_its_bundle_test() -> None:
    for bundle, test in RUN_BY.items():
        assert f'run_readme("{bundle}"' in (REPO / test).read_text(), f"{test} does not run {bundle}'s README"


def test_a_split_too_small_to_train_is_one_line_and_no_run(tmp_path: Path, run_bundle) -> None:
    """FedSKD needs two training samples a client: a split that leaves one is refused in one
    line naming the client and what to change, before the run directory exists."""
    proc = run_bundle(REPO / "bundles" / "demo" / "configs" / "train.json", "--bundle_root", tmp_path,
                      "--fl#dataset#num_samples", "40", "--fl#partition#min_size", "2",
                      "--fl#methods", "[{'name': 'fedskd'}]", check=False, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("medfl: error: client 1 (client_1) has 1 training sample(s) but fedskd needs at "
                                "least 2"), proc.stderr[-3000:]
    assert "more cases" in lines[-1] and "fewer clients (fl.num_clients)" in lines[-1]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_a_fold_too_small_to_train_stops_before_the_first_fold(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """With cross-validation every fold's split is checked before anything is written: the
    line names the fold, and no experiment directory is left (not even fold_0's)."""
    from medfl.cli import main

    fl = {"name": "cv", "output_dir": str(tmp_path / "runs"), "seed": 0, "rounds": 1, "num_clients": 3, "progress": False,
          "dataset": {"name": "synthetic2d", "root": str(tmp_path / "data"), "num_samples": 24, "num_classes": 2,
                      "image_size": 12, "noise": 0.5},
          "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 2}, "global_test_fraction": 0.0,
          "cv": {"folds": 2}, "client_split": {"train": 0.85, "val": 0.0, "test": 0.15},
          "model": {"name": "resnet10", "width": 4}, "train": {"batch_size": 4}, "methods": [{"name": "fedskd"}]}
    config = tmp_path / "train.json"
    config.write_text(json.dumps({"fl": fl}))
    assert main(["run", str(config)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1].startswith("medfl: error: fold_0: client 1 (client_1) has 1 training sample(s) but fedskd needs "
                              "at least 2"), err
    assert "fewer folds (fl.cv.folds)" in err[-1]
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
