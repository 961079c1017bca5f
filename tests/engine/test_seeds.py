"""``fl.seeds``: the whole experiment once per seed in ``seed_<s>/``, mean ± std over seeds,
resumable like any experiment."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from medfl.report import print_result
from medfl.config import ConfigError
from medfl.experiment import resume, run_experiment

__all__: list[str] = []


def test_seeds_repeat_the_experiment_and_report_mean_and_std(tiny_fl, resolve, capsys) -> None:
    fl = {**tiny_fl, "seeds": [3, 5], "methods": [{"name": "fedavg"}, {"name": "fedavgm"}]}
    result = run_experiment(resolve(fl))
    exp = result["dir"]
    assert result["seed_list"] == [3, 5] and list(result["summaries"]) == ["seed_3", "seed_5"]
    cfgs = {s: json.loads(open(f"{exp}/seed_{s}/config.json").read())["fl"] for s in (3, 5)}
    assert cfgs[3]["seed"] == 3 and cfgs[5]["seed"] == 5 and cfgs[3]["seeds"] is None
    parts = {s: pd.read_csv(f"{exp}/seed_{s}/partition.csv") for s in (3, 5)}
    assert not parts[3].equals(parts[5])  # the seed draws the split too
    rows = pd.read_csv(f"{exp}/seeds_results.csv")
    summary = json.loads(open(f"{exp}/seeds_summary.json").read())
    for label in ("fedavg", "fedavgm"):
        got = rows[(rows["method"] == label) & (rows["split"] == "global_test")].set_index("seed")["micro_f1"]
        finals = [result["summaries"][f"seed_{s}"][label]["final"]["global_test"]["micro_f1"]["mean"] for s in (3, 5)]
        assert got.tolist() == pytest.approx(finals)
        stats = summary["methods"][label]["global_test"]["micro_f1"]
        assert stats["mean"] == pytest.approx(sum(finals) / 2)
        assert stats["std"] == pytest.approx(abs(finals[0] - finals[1]) / 2)
        assert stats["values"] == pytest.approx(finals)
    table = pd.read_csv(f"{exp}/seeds_table.csv")
    assert list(table["method"]) == ["fedavg", "fedavgm"] and "global_test: micro_f1" in table.columns
    assert not os.path.exists(f"{exp}/seeds_metrics.png")       # MEDFL_NO_PLOTS: no figure
    print_result(result)
    assert "2 seed(s) [3, 5]" in capsys.readouterr().out
    from medfl.cli import main as cli

    md = open(f"{exp}/seeds_table.md").read()
    assert cli(["report", exp]) == 0  # the table over seeds, then every seed's runs, and the figures
    out = capsys.readouterr().out
    assert "seeds_table.md" in out and out.count("== ") == 1 + 4
    assert open(f"{exp}/seeds_metrics.png", "rb").read(4) == b"\x89PNG" and f"wrote {exp}/seeds_metrics.png" in out
    for s in (3, 5):
        assert open(f"{exp}/seed_{s}/comparison.png", "rb").read(4) == b"\x89PNG"
        assert os.path.isfile(f"{exp}/seed_{s}/fedavgm/plots/curves.png")
    assert open(f"{exp}/seeds_table.md").read() == md                  # drawn from the same results


def test_a_stopped_seeds_experiment_resumes_to_the_same_numbers(tiny_fl, resolve, tmp_path) -> None:
    fl = {**tiny_fl, "seeds": [0, 1], "methods": [{"name": "fedavg"}]}
    whole = run_experiment(resolve(fl))
    stopped = run_experiment(resolve({**fl, "output_dir": str(tmp_path / "other"), "stop_after_round": 1}))
    assert stopped["seeds"] is None
    again = resume(stopped["dir"])
    assert again["seeds"] is not None
    a = pd.read_csv(f"{whole['dir']}/seeds_results.csv")
    b = pd.read_csv(f"{again['dir']}/seeds_results.csv")
    pd.testing.assert_frame_equal(a, b)


@pytest.mark.parametrize("seeds, message", [
    ([], "fl.seeds: expected null or a non-empty list"),
    ([0, -1], "fl.seeds: expected null or a non-empty list"),
    ("0,1", "fl.seeds: expected null or a non-empty list"),
    ([1, 1], "fl.seeds: a seed is listed twice"),
])
def test_bad_seeds_are_refused(tiny_fl, resolve, seeds, message) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve({**tiny_fl, "seeds": seeds})
    with pytest.raises(ConfigError, match="repeat over seeds or cross-validate, not both"):
        resolve({**tiny_fl, "seeds": [0, 1], "cv": {"folds": 2}})
