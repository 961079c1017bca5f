"""``medfl runs [DIR]``: every run under a folder as one table, from real tiny runs (finished,
stopped after a round, with DP) and damaged copies of them."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from medfl.config import resolve_config
from medfl.experiment import run_experiment
from medfl.rundir import RunDir
from medfl.runs import RUN_FIELDS, find_run_dirs, format_runs, key_metric, list_runs, run_row

ROOT = Path(__file__).resolve().parents[1]


def _tiny(out: Path, name: str, **kw: Any) -> dict[str, Any]:
    fl = {"name": name, "output_dir": str(out), "seed": 0, "rounds": 2, "num_clients": 3, "progress": False,
          "dataset": {"name": "synthetic2d", "root": str(out.parent / "data"), "num_samples": 96, "num_classes": 2,
                      "image_size": 12, "noise": 0.5},
          "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8}, "model": {"name": "small_cnn", "width": 4},
          "train": {"batch_size": 8, "lr": 0.05}, "methods": [{"name": "fedavg"}]}
    return resolve_config({**fl, **kw})


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``runs/``: ``fin`` (fedavg and local, finished), ``dp`` (fedavg with client-level DP,
    finished), ``stop`` (3 rounds planned, stopped after 1)."""
    out = tmp_path_factory.mktemp("runs_cmd") / "runs"
    run_experiment(_tiny(out, "fin", methods=[{"name": "fedavg"}, {"name": "local"}]))
    run_experiment(_tiny(out, "dp", filters=[{"name": "dp_gaussian", "epsilon": 4.0, "delta": 1e-3, "clip": 1.0}]))
    run_experiment(_tiny(out, "stop", rounds=3, stop_after_round=1))
    # a fixed order of modification times: fin, dp, stop (oldest first)
    for k, exp in enumerate(("fin", "dp", "stop")):
        for run in (out / exp).iterdir():
            if run.is_dir():
                for f in run.iterdir():
                    os.utime(f, (1_700_000_000 + 1000 * k, 1_700_000_000 + 1000 * k), follow_symlinks=False)
    return out


@pytest.fixture
def copy(runs: Path, tmp_path: Path):
    """A copy of one of the runs' experiments, to damage."""
    def make(exp: str) -> Path:
        dest = tmp_path / "copy" / exp
        shutil.copytree(runs / exp, dest)
        return dest
    return make


def _by_path(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["path"]: r for r in rows}


def test_every_run_is_listed_with_its_status_rounds_headline_and_epsilon(runs: Path) -> None:
    rows = list_runs(runs)
    assert [r["path"] for r in rows] == ["fin/fedavg", "fin/local", "dp/fedavg", "stop/fedavg"]
    by = _by_path(rows)
    fin = json.loads((runs / "fin" / "fedavg" / "summary.json").read_text())
    assert by["fin/fedavg"] == {**by["fin/fedavg"], "status": "finished", "method": "fedavg", "rounds_done": 2,
                                "rounds_planned": 2, "headline": "local_test accuracy", "epsilon": None}
    assert by["fin/fedavg"]["value"] == pytest.approx(fin["final"]["local_test"]["accuracy"]["mean"])
    dp = json.loads((runs / "dp" / "fedavg" / "summary.json").read_text())
    assert dp["privacy"]["epsilon"] is not None
    assert by["dp/fedavg"]["epsilon"] == pytest.approx(dp["privacy"]["epsilon"]) and 0 < by["dp/fedavg"]["epsilon"] <= 4
    stop = by["stop/fedavg"]
    assert (stop["status"], stop["rounds_done"], stop["rounds_planned"]) == ("stopped", 1, 3)
    assert stop["headline"] == "local_test accuracy (round 1)" and 0 <= stop["value"] <= 1


def test_table_json_and_csv(runs: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from medfl.cli import main

    # the command as a user runs it, once; its other forms in this process
    env = {**os.environ, "MEDFL_NO_PROGRESS": "1"}
    table = subprocess.run([sys.executable, "-m", "medfl.cli", "runs", str(runs)], capture_output=True, text=True,
                           timeout=300, env=env)
    assert table.returncode == 0, table.stderr
    lines = table.stdout.splitlines()
    assert lines[0].split() == ["path", "status", "method", "rounds", "headline", "accuracy", "epsilon", "modified"]
    assert "not searched" not in table.stderr
    assert lines[1].startswith("fin/fedavg") and " 2/2 " in lines[1] and lines[-1].startswith("stop/fedavg")
    assert " 1/3 " in lines[-1] and "stopped" in lines[-1]
    dp_line = next(line for line in lines if line.startswith("dp/fedavg"))
    assert "-" not in dp_line.split()[6]
    capsys.readouterr()
    assert main(["runs", str(runs), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert [r["path"] for r in as_json] == ["fin/fedavg", "fin/local", "dp/fedavg", "stop/fedavg"]
    assert as_json[0]["modified"].endswith("Z") and as_json[0]["epsilon"] is None
    assert main(["runs", str(runs), "--csv"]) == 0
    as_csv = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    assert tuple(as_csv[0]) == RUN_FIELDS and as_csv[-1]["rounds_planned"] == "3" and as_csv[0]["epsilon"] == ""
    # the current directory by default, and the experiment folder alone
    monkeypatch.chdir(runs / "dp")
    assert main(["runs", "--csv"]) == 0
    assert [r["path"] for r in csv.DictReader(io.StringIO(capsys.readouterr().out))] == ["fedavg"]


def test_a_run_marked_running_is_running_only_while_locked(copy) -> None:
    run_dir = copy("stop") / "fedavg"
    RunDir(run_dir).status("running", 1, 3)
    assert run_row(run_dir)["status"].startswith("crashed (status running")
    holder = RunDir(run_dir)
    holder.lock()
    try:
        assert run_row(run_dir)["status"] == "running (locked)"
    finally:
        holder.unlock()
    assert run_row(run_dir)["status"].startswith("crashed")


@pytest.mark.parametrize(("damage", "expected"), [
    (lambda d: (d / "summary.json").write_text('{"method": "fedavg", "final": {'), "corrupt: summary.json is not valid JSON"),
    (lambda d: (d / "summary.json").unlink(), "corrupt: no summary.json"),
    (lambda d: (d / "status.json").write_text('{"status": "fini'), "corrupt: status.json is not valid JSON"),
    (lambda d: (d / "status.json").write_text('[1, 2]'), "corrupt: status.json has no status"),
    (lambda d: (d / "status.json").unlink(), "crashed (no status.json"),
    (lambda d: (d / "metrics.csv").write_bytes(b"\x00\xff\x00garbage\n\"unclosed"), "finished"),
])
def test_a_damaged_run_is_a_row_not_a_traceback(copy, damage, expected: str) -> None:
    run_dir = copy("fin") / "fedavg"
    damage(run_dir)
    row = run_row(run_dir)
    assert row["status"].startswith(expected), row
    assert format_runs([row])   # the table prints it


def test_a_half_written_stopped_run_with_a_broken_metrics_file(copy) -> None:
    run_dir = copy("stop") / "fedavg"
    (run_dir / "metrics.csv").write_bytes(b"round,split\n1,\"local_test\n\x00")
    row = run_row(run_dir)
    assert row["status"].startswith("corrupt: ") and row["path"]


def test_empty_and_missing_folders(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from medfl.cli import main

    (tmp_path / "empty" / "deeper").mkdir(parents=True)
    assert main(["runs", str(tmp_path / "empty")]) == 0
    assert capsys.readouterr().out.startswith(f"medfl runs: no runs under {tmp_path / 'empty'}")
    assert list_runs(tmp_path / "empty") == []
    assert main(["runs", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip() == f"medfl: error: {tmp_path / 'nope'}: no such folder"
    (tmp_path / "f.txt").write_text("x")
    assert main(["runs", str(tmp_path / "f.txt")]) == 2
    err = capsys.readouterr().err
    assert "not a folder" in err and "Traceback" not in err


def test_depth_limits_the_search(runs: Path) -> None:
    assert find_run_dirs(runs, depth=1) == []
    assert len(find_run_dirs(runs, depth=2)) == 4
    assert find_run_dirs(runs / "fin" / "fedavg", depth=0) == [runs / "fin" / "fedavg"]


def test_folders_below_the_depth_are_named_not_skipped_silently(runs: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """A run deeper than ``--depth``: stderr says how many folders were not searched and the
    two commands that reach it; the first of them, run as printed, lists it (issue 51)."""
    import shlex

    from medfl.cli import main

    deep = tmp_path / "deep"
    shutil.copytree(runs / "fin" / "fedavg", deep / "a" / "b" / "c" / "d" / "e" / "fedavg")
    (deep / "x" / "y" / "z" / "w" / "v" / ".hidden").mkdir(parents=True)   # nothing searchable below v
    assert main(["runs", str(deep)]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(f"medfl runs: no runs under {deep}")
    edge = deep / "a" / "b" / "c" / "d" / "e"
    assert err.strip() == (f"medfl runs: 1 folder(s) 5 level(s) below {deep} have subfolders that were not searched "
                           f"(e.g. {edge}); to list runs there: medfl runs {deep} --depth 10, or medfl runs {edge}")
    for command in err.strip().split("to list runs there: ")[1].split(", or "):
        argv = shlex.split(command)
        assert argv[:2] == ["medfl", "runs"]
        assert main([*argv[1:], "--csv"]) == 0
        listed, err = capsys.readouterr()
        assert [r["path"] for r in csv.DictReader(io.StringIO(listed))] in (["a/b/c/d/e/fedavg"], ["fedavg"])
        assert err == ""
    unsearched: list[Path] = []
    assert find_run_dirs(runs, depth=1, unsearched=unsearched) == []
    assert unsearched == [runs / "dp", runs / "fin", runs / "stop"]
    unsearched.clear()
    assert len(find_run_dirs(runs, depth=2, unsearched=unsearched)) == 4 and unsearched == []


def test_the_headline_is_the_run_s_own_metric(copy, capsys: pytest.CaptureFixture[str]) -> None:
    """A cross-validated run (abide_fedskd: fl.cv.metric AUC) heads with AUC, an early-stopped
    one with its selection metric; the table's value column is named by the metric."""
    from medfl.config import resolve_config
    from medfl.config_file import load_bundle_config

    root = copy("fin")
    run_dir = root / "fedavg"
    summary = json.loads((run_dir / "summary.json").read_text())
    config = json.loads((run_dir / "config.json").read_text())
    assert key_metric(config) == (None, None) and run_row(run_dir)["headline"] == "local_test accuracy"
    bundle = resolve_config(load_bundle_config(ROOT / "bundles" / "abide_fedskd" / "configs" / "train.json", {}))
    assert key_metric({"fl": bundle}) == (None, "auc")
    (run_dir / "config.json").write_text(json.dumps({**config, "fl": {**config["fl"], "cv": bundle["cv"]}}))
    row = run_row(run_dir)
    assert row["headline"] == "local_test auc"
    assert row["value"] == pytest.approx(summary["final"]["local_test"]["auc"]["mean"])
    header = format_runs([row, run_row(root / "local")]).splitlines()[0].split()
    assert header[4:6] == ["headline", "value"]   # two metrics: each row names its own
    assert format_runs([row]).splitlines()[0].split()[4:6] == ["headline", "auc"]
    # before the summary: the last round of metrics.csv, on the selection metric's split
    early = {"metric": "global_test/f1", "patience": 5, "min_delta": 0.0, "mode": None, "min_rounds": 0}
    (run_dir / "config.json").write_text(json.dumps({**config, "fl": {**config["fl"], "early_stopping": early}}))
    assert key_metric(json.loads((run_dir / "config.json").read_text())) == ("global_test", "f1")
    (run_dir / "summary.json").unlink()
    RunDir(run_dir).status("stopped", 2, 2)
    row = run_row(run_dir)
    assert row["headline"] == "global_test f1 (round 2)" and 0 <= row["value"] <= 1
