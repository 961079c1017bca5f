"""Paths the user is given or gives: a path that does not exist is named as such, and the
commands of the README, docs/tracking.md and the Makefile write where the paths they print and open say."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from medfl.cli import main

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("command", [["report"], ["resume"], ["export", "--out", "exported"]])
def test_a_missing_run_folder_is_named_as_such(command: list[str], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    code = main([command[0], "runs/demo", *command[1:]])
    err = capsys.readouterr().err
    assert code == 2
    assert f"runs/demo: no such folder (looked for in {tmp_path})" in err, err
    assert "no metrics.csv" not in err and "no config.json" not in err
    assert not (tmp_path / "exported").exists()


def test_make_demo_runs_from_the_repository_root() -> None:
    """``make demo`` does not ``cd``: the ``results:`` path it prints is one from the folder
    ``make`` was run in, and its runs are under ``bundles/demo`` (what ``make clean`` removes)."""
    recipe = re.search(r"^demo:.*\n((?:\t.*\n)+)", (REPO / "Makefile").read_text(), re.M)
    assert recipe
    line = recipe.group(1).strip()
    assert not line.startswith("cd ") and "&&" not in line
    args = shlex.split(line)
    assert args[args.index("--config_file") + 1] == "bundles/demo/configs/train.json"
    assert args[args.index("--bundle_root") + 1] == "bundles/demo"


def _results_dir(command: str) -> Path:
    """Where a ``medfl run`` / ``python -m monai.bundle run`` line of the docs writes its
    experiment, from the folder it runs in (``output_dir/name`` of its resolved config)."""
    from medfl.bundle import load_bundle_config

    args = shlex.split(command.split("#", 1)[0])
    config = args[args.index("--config_file") + 1] if "--config_file" in args else args[2]
    overrides = {}
    for key, value in zip(args, args[1:]):
        if key == "--bundle_root":
            overrides["bundle_root"] = value
    fl = load_bundle_config(REPO / config, overrides)
    return Path(fl["output_dir"]) / fl["name"]


def test_tracking_doc_commands_open_what_the_run_wrote() -> None:
    section = (REPO / "docs" / "tracking.md").read_text(encoding="utf-8")
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1).splitlines()
    runs = [line for line in block if " run " in line and "configs/train.json" in line]
    opened = [Path(m) for line in block for m in re.findall(r"(?:sqlite:///|--logdir )(\S+)", line)]
    assert runs and opened
    for line in runs:
        written = _results_dir(line)
        assert all(path.is_relative_to(written) for path in opened), (line, written, opened)


def test_readme_quick_start_reports_what_it_ran() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = re.search(r"## Quick start.*?```bash\n.*?```.*?```bash\n(.*?)```", text, re.S).group(1)
    lines = [line for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    assert not any(line.startswith("cd ") for line in lines)
    runs = [_results_dir(line) for line in lines if "monai.bundle run" in line]
    reports = [Path(shlex.split(line)[2]) for line in lines if line.startswith("medfl report ")]
    assert runs and reports and all(r == runs[0] for r in reports + runs)
