"""Method presets (``{"name": ..., "preset": "paper"}``), the mechanism log
(``Method.mechanisms`` -> ``mechanisms.csv``, ``Method.mechanism_warnings`` -> stderr and
``summary.json``'s ``warnings``), in process and across a resume, and a method's own tables
after its post-hoc stage (``Method.final_tables`` -> ``<name>.csv``, drawn by the reporting
plugin where it knows them)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pandas as pd
import pytest

from medfl.config import ConfigError, build_method, method_train, resolve_config
from medfl.experiment import resume, run_experiment

from contract_methods import Observed, registered

DATA: dict[str, Any] = {
    "seed": 0, "num_clients": 3, "progress": False, "rounds": 3,
    "dataset": {"name": "synthetic2d", "num_samples": 96, "num_classes": 2, "image_size": 16, "noise": 0.5},
    "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8},
    "model": {"name": "small_cnn", "width": 4}, "train": {"batch_size": 8, "lr": 0.05},
}


@pytest.fixture(autouse=True)
def _register() -> Iterator[None]:
    yield from registered()


def _fl(tmp_path: Path, method: dict[str, Any], **extra: Any) -> dict[str, Any]:
    fl = json.loads(json.dumps({**DATA, **extra}))
    fl["dataset"]["root"] = str(tmp_path / "data")
    fl.update(name="run", output_dir=str(tmp_path / "runs"), methods=[method])
    return fl


def _run(tmp_path: Path, method: dict[str, Any], **extra: Any) -> Path:
    out = run_experiment(resolve_config(_fl(tmp_path, method, **extra)))
    return Path(out["dir"]) / method.get("label", method["name"])


# ------------------------------------------------------------------ presets
def test_preset_values_under_the_entry_own_keys() -> None:
    m = build_method({"name": "test_observed", "preset": "paper"})
    assert (m.scale, m.tag, m.unused) == (2.0, "p", 0)
    m = build_method({"name": "test_observed", "preset": "paper", "scale": 5.0})
    assert (m.scale, m.tag) == (5.0, "p")
    m = build_method({"name": "test_observed", "preset": "bare"})
    assert (m.scale, m.tag) == (1.0, "default")


def test_preset_train_settings_sit_between_fl_train_and_the_entry() -> None:
    cfg = {"train": {"lr": 0.05, "epochs": 1, "dp": None}}
    assert method_train(cfg, {"name": "test_observed", "preset": "paper"})["lr"] == 0.02
    assert method_train(cfg, {"name": "test_observed", "preset": "paper", "train": {"lr": 0.1}})["lr"] == 0.1
    assert method_train(cfg, {"name": "test_observed"})["lr"] == 0.05


def test_unknown_preset_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"no preset 'papers'; its presets: bare, paper"):
        resolve_config(_fl(tmp_path, {"name": "test_observed", "preset": "papers"}))
    with pytest.raises(ConfigError, match=r"method 'fedavg' has no preset 'paper'; its presets: \(none\)"):
        resolve_config(_fl(tmp_path, {"name": "fedavg", "preset": "paper"}))


def test_config_json_says_where_every_value_came_from(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path, {"name": "test_observed", "preset": "paper", "scale": 3.0}, rounds=2)
    saved = json.loads((run / "config.json").read_text())
    preset = saved["preset"]
    assert preset["name"] == "paper" and preset["source"] == "a test paper, Table 1"
    # the kind and the citation of each value
    assert preset["values"] == {"scale": {"value": 3.0, "from": "config"},
                                "tag": {"value": "p", "from": "open", "source": "the paper gives none; ours"}}
    assert preset["train"] == {"lr": {"value": 0.02, "from": "reading",
                                      "source": "'a small step'; other reading: 0.01"}}
    assert preset["medfl_defaults"] == {"unused": 0}
    assert preset["experiment"] == {"rounds": 50, "num_clients": 3}
    assert saved["method_hparams"]["scale"] == 3.0
    # stderr: one short line (the preset, how many values, how many settings differ, where the table is)
    err = [line for line in capsys.readouterr().err.splitlines() if "preset" in line]
    assert err == [f"medfl [test_observed] preset 'paper' (3 values; 1 setting differs from its source's experiment): "
                   f"every value, its source and the source's experiment: \"preset\" in {run / 'config.json'}"]
    # the run's log.txt: the source, the counts by kind and each setting that differs
    detail = next(line for line in (run / "log.txt").read_text().splitlines() if "preset 'paper' (a test" in line)
    assert ("DEBUG medfl.engine.checkpoints: medfl [test_observed] preset 'paper' (a test paper, Table 1): 0 from the "
            "paper, 0 from the authors' code, 1 readings, 1 medfl's choices, 1 from this config; the source's") in detail
    assert "rounds 50 (this run: 2)" in detail and "num_clients" not in detail.split("differs")[-1]


def test_a_seed_method_announces_its_preset_in_a_short_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """FedKPer's paper preset (its source citation, 12 values, six settings of the paper's
    experiment that a tiny run does not share) is one line of the preset's name, counts and
    where the table is, not the 740 characters of all of it (issue 51)."""
    run = _run(tmp_path, {"name": "fedkper", "preset": "paper"}, rounds=1)
    lines = [line for line in capsys.readouterr().err.splitlines() if "preset 'paper'" in line]
    assert len(lines) == 1 and lines[0].startswith("medfl [fedkper] preset 'paper' (12 values; ")
    assert lines[0].endswith(f"experiment: \"preset\" in {run / 'config.json'}")
    assert len(lines[0]) - len(str(run / "config.json")) < 160 and "Fowler" not in lines[0]
    assert "Fowler & AlRegib" in (run / "log.txt").read_text()   # the detail stays in the run's log


def test_a_value_without_a_source_is_recorded_and_warned_as_such(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """An outside plugin's preset that cites no source for a value still runs; config.json
    says "unstated" (never "paper") and the run warns naming the value."""
    from medfl.method import Preset

    monkeypatch.setattr(Observed, "presets", {"old": Preset(source="an older plugin", values={"scale": 4.0},
                                                            train={"lr": 0.02})})
    run = _run(tmp_path, {"name": "test_observed", "preset": "old"}, rounds=1)
    preset = json.loads((run / "config.json").read_text())["preset"]
    assert preset["values"] == {"scale": {"value": 4.0, "from": "unstated",
                                          "source": "the preset cites no source for scale"}}
    assert preset["train"]["lr"]["from"] == "unstated"
    err = capsys.readouterr().err   # the warning names every value without a source, in the short line
    assert ("medfl [test_observed] preset 'old' (2 values; no source for scale, train.lr (the plugin's preset cites "
            "none)): every value, its source") in err
    assert ("preset 'old' (an older plugin): 0 from the paper, 0 from the authors' code, 0 readings, 0 medfl's "
            "choices, 0 from this config, 2 without a source; no source for scale, train.lr") in (run / "log.txt").read_text()


# ------------------------------------------------------------------ mechanisms
def _expected_lines(run: Path) -> pd.DataFrame:
    """mechanisms.csv recomputed from train_metrics.csv (what each client's reply said)."""
    tm = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str})
    rows = []
    for r, part in tm.groupby("round"):
        scaled = {cid: float(n) * 1.0 for cid, n in zip(part["client_id"], part["num_examples"])}
        for cid in sorted(scaled):
            rows.append({"round": r, "mechanism": "count", "scope": "client", "id": cid, "name": "scaled",
                         "value": scaled[cid]})
        rows.append({"round": r, "mechanism": "count", "scope": "run", "id": "", "name": "total",
                     "value": sum(scaled.values())})
    return pd.DataFrame(rows)


def test_mechanisms_csv_and_warnings(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = _run(tmp_path, {"name": "test_observed"})
    log = pd.read_csv(run / "mechanisms.csv", dtype={"id": str, "text": str}, keep_default_na=False)
    assert list(log.columns) == ["round", "mechanism", "scope", "id", "name", "value", "text"]
    numbers = log[log["name"].isin(["scaled", "total"])].reset_index(drop=True)
    expected = _expected_lines(run)
    pd.testing.assert_frame_equal(numbers[expected.columns].astype({"value": float}), expected,
                                  check_dtype=False)
    texts = log[log["name"] == "state"]
    assert texts["text"].tolist() == ["odd", "even", "odd"] and texts["value"].eq("").all()
    assert log[log["name"] == "missing"]["value"].eq("").all()   # None: no number
    summary = json.loads((run / "summary.json").read_text())
    assert summary["warnings"] == [{"round": 2, "warning": "the count cannot act in round 2"}]
    assert capsys.readouterr().err.count("round 2: the count cannot act in round 2") == 1


def test_mechanisms_and_warnings_survive_a_resume(tmp_path: Path) -> None:
    whole = _run(tmp_path / "a", {"name": "test_observed"})
    part = _run(tmp_path / "b", {"name": "test_observed"}, stop_after_round=2)
    assert not (part / "summary.json").exists()
    resume(part)
    assert (part / "mechanisms.csv").read_bytes() == (whole / "mechanisms.csv").read_bytes()
    assert (json.loads((part / "summary.json").read_text())["warnings"]
            == json.loads((whole / "summary.json").read_text())["warnings"])


def test_a_method_without_mechanisms_writes_no_log(tmp_path: Path) -> None:
    run = _run(tmp_path, {"name": "fedavg"}, rounds=1)
    assert not (run / "mechanisms.csv").exists()
    assert "warnings" not in json.loads((run / "summary.json").read_text())


def test_a_mechanism_value_must_be_a_number_or_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from medfl.rundir import RunError

    monkeypatch.setattr(Observed, "mechanisms", lambda self, r: [{"mechanism": "m", "bad": [1, 2]}])
    with pytest.raises(RunError, match=r"mechanisms\(1\)\[0\]\['bad'\] must be a number or a short string, got list"):
        _run(tmp_path, {"name": "test_observed"}, rounds=1)


@pytest.mark.plots
def test_mechanism_plot(tmp_path: Path) -> None:
    from medfl.report_plots import write_mechanism_plot

    run = _run(tmp_path, {"name": "test_observed"})
    path = run / "plots" / "mechanisms.png"
    assert path.is_file() and path.stat().st_size > 0     # drawn at the end of the run
    path.unlink()
    assert write_mechanism_plot(run) == path and path.is_file()   # and again by medfl report
    assert write_mechanism_plot(_run(tmp_path / "b", {"name": "fedavg"}, rounds=1)) is None


# ------------------------------------------------------------------ final tables
def test_final_tables_are_written_after_finalize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"epoch": 0, "split": "public_test", "accuracy": 0.5},
            {"epoch": 1, "split": "public_train", "loss": 0.75, "note": "x"},
            {"epoch": 1, "split": "public_test", "accuracy": 0.625, "auc": None}]
    monkeypatch.setattr(Observed, "final_tables", lambda self: {"student_metrics": rows}, raising=False)
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("MEDFL_NO_PLOTS", raising=False)
        run = _run(tmp_path, {"name": "test_observed"}, rounds=1)
    table = pd.read_csv(run / "student_metrics.csv", keep_default_na=False, na_values=[""])
    assert list(table.columns) == ["epoch", "split", "accuracy", "loss", "note", "auc"]
    assert table["accuracy"].tolist()[::2] == [0.5, 0.625] and table["loss"].tolist()[1] == 0.75
    assert table["auc"].isna().all() and table["note"].fillna("").tolist() == ["", "x", ""]
    assert (run / "plots" / "student_metrics.png").is_file()       # the reporting plugin draws it


@pytest.mark.parametrize("tables, match", [
    ({"metrics": []}, "not one of the engine's own files"),
    ({"Student metrics": []}, "lowercase letters"),
    ({"ok": [{"epoch": [1, 2]}]}, r"\['epoch'\] must be numbers"),
])
def test_a_bad_final_table_stops_the_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tables: dict[str, Any],
                                         match: str) -> None:
    from medfl.rundir import RunError

    monkeypatch.setattr(Observed, "final_tables", lambda self: tables, raising=False)
    with pytest.raises(RunError, match=match):
        _run(tmp_path, {"name": "test_observed"}, rounds=1)
