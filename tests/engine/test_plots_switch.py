"""Runs without PNG plots (``"plots": false`` or ``MEDFL_NO_PLOTS``), and ``medfl report``
drawing them afterwards from what the run saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from medfl.cli import main
from medfl.config import ConfigError
from medfl.experiment import run_experiment
from medfl.plotting import plots_wanted

__all__: list[str] = []


@pytest.mark.parametrize("value, wanted", [(None, True), ("", True), ("0", True), ("false", True), ("No", True),
                                           ("1", False), ("yes", False), ("true", False), (" 1 ", False)])
def test_the_environment_variable_turns_plots_off(monkeypatch, value: str | None, wanted: bool) -> None:
    if value is None:
        monkeypatch.delenv("MEDFL_NO_PLOTS", raising=False)
    else:
        monkeypatch.setenv("MEDFL_NO_PLOTS", value)
    assert plots_wanted({}) is wanted and plots_wanted(None) is wanted
    assert plots_wanted({"plots": True}) is wanted          # the variable wins over a config
    assert plots_wanted({"plots": False}) is False


def test_a_plots_value_that_is_not_a_boolean_is_refused(tiny_fl: dict[str, Any], resolve: Any) -> None:
    with pytest.raises(ConfigError, match=r"fl\.plots: expected true or false \(or yes/no, 1/0\), got 'perhaps'"):
        resolve({**tiny_fl, "plots": "perhaps"})
    with pytest.raises(ConfigError, match=r"fl\.plots: expected true or false \(or yes/no, 1/0\), got 2"):
        resolve({**tiny_fl, "plots": 2})
    # read as every boolean is (issue 39, item 9: medfl.config.read_bool)
    assert resolve({**tiny_fl, "plots": "no"})["plots"] is False and resolve({**tiny_fl, "plots": 0})["plots"] is False
    assert resolve({**tiny_fl, "plots": False})["plots"] is False
    assert resolve({**tiny_fl, "plots": "False"})["plots"] is False     # MONAI's CLI passes the word
    assert resolve({**tiny_fl, "plots": "true"})["plots"] is True
    assert "plots" not in resolve(tiny_fl)           # absent unless set: saved configs stay as they were


def test_a_run_without_plots_writes_its_results_and_report_draws_the_figures(
        tiny_fl: dict[str, Any], resolve: Any, monkeypatch, capsys) -> None:
    monkeypatch.delenv("MEDFL_NO_PLOTS", raising=False)
    fl = {**tiny_fl, "rounds": 1, "plots": False, "methods": [{"name": "fedavg"}, {"name": "local"}]}
    exp = Path(run_experiment(resolve(fl))["dir"])
    for label in ("fedavg", "local"):
        run = exp / label
        assert (run / "metrics.csv").is_file() and (run / "summary.json").is_file()
        assert '"finished"' in (run / "status.json").read_text()
        assert not (run / "plots").exists()
    assert (exp / "comparison.csv").is_file() and not (exp / "comparison.png").exists()
    before = (exp / "comparison.csv").read_bytes()

    assert main(["report", str(exp)]) == 0
    out = capsys.readouterr().out
    for label in ("fedavg", "local"):
        assert (exp / label / "plots" / "curves.png").read_bytes()[:4] == b"\x89PNG"
        assert f"wrote {exp / label / 'plots' / 'curves.png'}" in out
    assert (exp / "comparison.png").read_bytes()[:4] == b"\x89PNG" and f"wrote {exp / 'comparison.png'}" in out
    assert (exp / "comparison.csv").read_bytes() == before       # the same results, drawn


def test_report_of_an_experiment_with_one_method_draws_no_comparison(tiny_fl: dict[str, Any], resolve: Any,
                                                                     capsys) -> None:
    exp = Path(run_experiment(resolve({**tiny_fl, "rounds": 1}))["dir"])
    assert main(["report", str(exp)]) == 0
    assert (exp / "fedavg" / "plots" / "curves.png").is_file() and not (exp / "comparison.png").exists()
    assert "comparison.png" not in capsys.readouterr().out


def test_a_laid_out_figure_is_drawn_once_when_saved_to_the_same_pixels(tmp_path: Path, monkeypatch) -> None:
    """``tight_layout`` leaves a placeholder engine behind, and ``savefig`` then lays the
    figure out again without rendering; :func:`medfl.plotting.tight_layout` removes it."""
    from matplotlib.figure import Figure

    from medfl.plotting import tight_layout

    def figure() -> Figure:
        fig = Figure(figsize=(4, 3))
        ax = fig.subplots()
        ax.plot([1, 2, 3], [0.25, 0.5, 0.125], marker="o", label="a curve")
        ax.set_xlabel("round")
        ax.set_ylabel("a long y label to lay out")
        ax.legend()
        fig.suptitle("title")
        return fig

    draws = []
    original = Figure.draw
    monkeypatch.setattr(Figure, "draw", lambda self, renderer: (draws.append(1), original(self, renderer))[1])
    plain = figure()
    plain.tight_layout()
    plain.savefig(tmp_path / "plain.png", dpi=100)
    draws.clear()                     # matplotlib 3.11 draws it twice: a layout pass, then the render
    ours = figure()
    tight_layout(ours)
    assert ours.get_layout_engine() is None
    ours.savefig(tmp_path / "ours.png", dpi=100)
    assert len(draws) == 1
    assert (tmp_path / "ours.png").read_bytes() == (tmp_path / "plain.png").read_bytes()
