"""Tables and plots that show their support (issue 48, item 8): every mean says how many
clients it covers, a split whose clients scored one shared model is one score (not identical
per-client rows), round axes have integer ticks, and a mechanism value that stays constant over
the run is written as text instead of drawn as a flat curve."""

from __future__ import annotations

import io
import json
import math
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import matplotlib
import pandas as pd
import pytest

from medfl.config import resolve_config
from medfl.experiment import run_experiment
from medfl.report import format_table, print_result, summary_table, write_comparison
from medfl.report_plots import constant_mechanisms, write_mechanism_plot, write_plots

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def fedavg_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny FedAvg and Local experiment: 3 clients, 3 rounds, ``test`` and ``global_test``."""
    out = tmp_path_factory.mktemp("support") / "runs"
    fl = {"name": "exp", "output_dir": str(out), "seed": 0, "rounds": 3, "num_clients": 3, "progress": False,
          "plots": False,
          "dataset": {"name": "synthetic2d", "root": str(out.parent / "data"), "num_samples": 96, "num_classes": 2,
                      "image_size": 12, "noise": 0.5},
          "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8}, "model": {"name": "small_cnn", "width": 4},
          "train": {"batch_size": 8, "lr": 0.05}, "methods": [{"name": "fedavg"}, {"name": "local"}]}
    return run_experiment(resolve_config(fl))


def _metrics(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path / "metrics.csv", index=False)
    return path


def test_every_mean_says_how_many_clients_it_covers(tmp_path: Path) -> None:
    """An AUC defined at 1 of 4 clients (the others have one class in their test split) is
    printed as covering 1 of 4 clients, not as a plain mean."""
    rows = []
    for c in range(4):
        rows.append({"round": 1, "client_id": str(c), "client_name": f"client_{c}", "split": "local_test",
                     "reported_by": "self", "n": 5.0, "accuracy": 0.2 * (c + 1),
                     "auc": 0.0 if c == 0 else float("nan")})
    run = _metrics(tmp_path / "run", rows)
    table = summary_table(run).set_index("metric")
    assert table.loc["auc", "clients"] == "1 of 4 clients"
    assert table.loc["accuracy", "clients"] == "4 of 4 clients"
    assert "1 of 4 clients" in format_table(summary_table(run))


def test_one_shared_model_is_one_row(fedavg_run: dict[str, Any]) -> None:
    """FedAvg's clients score one global model on the shared global test set: the table says
    it is one score (no spread, no worst client); Local's personal models, and every method's
    local_test, keep their per-client statistics."""
    base = Path(fedavg_run["dir"])
    fedavg = summary_table(base / "fedavg").set_index(["split", "metric"])
    shared = fedavg.loc[("global_test", "accuracy")]
    assert shared["clients"] == "one score, identical at all 3 clients"
    assert math.isnan(shared["std"]) and shared["worst_client"] == ""
    assert fedavg.loc[("local_test", "accuracy"), "clients"].endswith("of 3 clients")
    local = summary_table(base / "local").set_index(["split", "metric"])
    metrics = pd.read_csv(base / "local" / "metrics.csv")
    last = metrics[(metrics["round"] == metrics["round"].max()) & (metrics["split"] == "global_test")]
    if last["accuracy"].nunique() > 1:   # personal models that differ keep their spread
        assert local.loc[("global_test", "accuracy"), "clients"] == "3 of 3 clients"
    out = io.StringIO()
    with redirect_stdout(out):
        print_result(fedavg_run)
    assert "one score, identical at all 3 clients" in out.getvalue()


def _round_axes_figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Record every figure saved from now on (its axes are checked after)."""
    from matplotlib.figure import Figure

    saved: list[Any] = []
    original = Figure.savefig

    def savefig(self: Figure, *args: Any, **kwargs: Any) -> Any:
        saved.append(self)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _round_ticks(fig: Any) -> list[list[float]]:
    """The x tick positions of each axis of ``fig`` labelled ``round``, within its limits."""
    out = []
    for ax in fig.axes:
        if ax.get_xlabel() == "round":
            lo, hi = ax.get_xlim()
            out.append([t for t in ax.get_xticks() if lo - 1e-9 <= t <= hi + 1e-9])
    return out


def test_round_axes_have_integer_ticks(fedavg_run: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """curves.png, comparison.png (and every other round-axis plot a run draws) tick whole
    rounds only: 3 rounds must not show ticks at 1.5 and 2.5."""
    saved = _round_axes_figures(monkeypatch)
    base = Path(fedavg_run["dir"])
    write_plots(base / "fedavg")
    write_comparison(base, {label: json.loads((base / label / "summary.json").read_text())
                            for label in ("fedavg", "local")})
    ticks = [t for fig in saved for t in _round_ticks(fig)]
    assert len(ticks) >= 4   # curves.png's panels and comparison.png's two
    for axis in ticks:
        assert axis and all(float(t).is_integer() for t in axis), axis


def _mechanisms(path: Path) -> Path:
    """A PFedCDP-like mechanisms.csv: sigma constant, the noise ratio moving, a quantization
    error constant per cluster at two values, over 4 rounds."""
    rows = []
    for r in range(1, 5):
        rows.append({"round": r, "mechanism": "dp", "name": "sigma", "scope": "run", "id": "", "value": 0.969,
                     "text": ""})
        for k, base in (("0", 70.0), ("1", 120.0)):
            rows.append({"round": r, "mechanism": "dp_noise", "name": "noise_to_update_min", "scope": "cluster",
                         "id": k, "value": base * r, "text": ""})
            rows.append({"round": r, "mechanism": "quantization", "name": "bits", "scope": "cluster", "id": k,
                         "value": 8.0 if k == "0" else 4.0, "text": ""})
    path.mkdir(parents=True, exist_ok=True)
    pd.DataFrame(rows).to_csv(path / "mechanisms.csv", index=False)
    return path


def test_constant_mechanism_values_are_text(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A value constant over the run is a line of text ("dp: sigma = 0.969 (constant)"), not a
    panel with a flat curve; a value that moves keeps its panel."""
    run = _mechanisms(tmp_path / "run")
    df = pd.read_csv(run / "mechanisms.csv", dtype={"id": str}, keep_default_na=False, na_values=[""])
    constants = constant_mechanisms(df)
    assert constants == {("dp", "sigma"): "dp: sigma = 0.969 (constant)",
                         ("quantization", "bits"): "quantization: bits = 0 8, 1 4 (constant)"}
    saved = _round_axes_figures(monkeypatch)
    assert write_mechanism_plot(run) is not None
    fig = saved[-1]
    drawn = [ax for ax in fig.axes if ax.axison]
    assert [ax.get_title() for ax in drawn] == ["dp_noise: noise_to_update_min"]
    texts = [t.get_text() for ax in fig.axes for t in ax.texts]
    assert any("dp: sigma = 0.969 (constant)" in t and "quantization: bits" in t for t in texts)
    for axis in _round_ticks(fig):
        assert all(float(t).is_integer() for t in axis), axis


def test_mechanism_values_past_the_last_panel_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """More moving values than ``MECHANISM_PANELS``: the first ones get panels, the rest are
    named in the text panel (with their count), none is silently dropped."""
    from medfl.report_plots import MECHANISM_PANELS

    n = MECHANISM_PANELS + 3
    rows = [{"round": r, "mechanism": "m", "name": f"v{k:02d}", "scope": "run", "id": "", "value": float(r * (k + 1)),
             "text": ""} for r in (1, 2, 3) for k in range(n)]
    run = tmp_path / "run"
    run.mkdir()
    pd.DataFrame(rows).to_csv(run / "mechanisms.csv", index=False)
    saved = _round_axes_figures(monkeypatch)
    assert write_mechanism_plot(run) is not None
    fig = saved[-1]
    drawn = [ax.get_title() for ax in fig.axes if ax.axison]
    assert drawn == [f"m: v{k:02d}" for k in range(MECHANISM_PANELS)]
    text = "\n".join(t.get_text() for ax in fig.axes for t in ax.texts)
    assert "not drawn (3 more moving values" in text
    assert all(f"m: v{k:02d}" in text for k in range(MECHANISM_PANELS, n))


def test_summaries_and_comparison_say_what_each_mean_covers(fedavg_run: dict[str, Any]) -> None:
    """summary.json's final block gives each metric's clients with a value and clients
    evaluated; comparison.csv carries them beside the means."""
    base = Path(fedavg_run["dir"])
    final = json.loads((base / "fedavg" / "summary.json").read_text())["final"]
    assert final["local_test"]["accuracy"]["clients"] == 3 and final["local_test"]["accuracy"]["of"] == 3
    comparison = pd.read_csv(base / "comparison.csv")
    assert set(comparison["accuracy_clients"]) == {"3 of 3"}


def _stats(mean: float, clients: int, of: int) -> dict[str, Any]:
    return {"mean": mean, "std": 0.0, "worst": mean, "best": mean, "worst_client": "0", "clients": clients, "of": of}


def test_seeds_table_says_what_each_mean_covers(tmp_path: Path) -> None:
    """Over seeds, a mean that covers fewer than every client says so: the AUC of one client
    of four in one seed and two in the other is ``auc 1-2 of 4``."""
    from medfl.report_repeats import write_seeds_report

    summaries = {s: {"fedavg": {"final": {"round": 2, "local_test": {"accuracy": _stats(0.7 + s / 10, 4, 4),
                                                                     "auc": _stats(0.5, 1 + s, 4)}}}}
                 for s in (0, 1)}
    write_seeds_report(tmp_path, summaries, plots=False)
    table = pd.read_csv(tmp_path / "seeds_table.csv")
    assert table.loc[0, "local_test: clients"] == "4 of 4; auc 1-2 of 4"
    summary = json.loads((tmp_path / "seeds_summary.json").read_text())
    assert set(summary["methods"]["fedavg"]["local_test"]) == {"accuracy", "auc"}   # counts are no metric
    assert "how many clients the means cover" in (tmp_path / "seeds_table.md").read_text()


def test_final_models_lines_say_what_each_mean_covers() -> None:
    """The run's printed lines on its final models (PFedCDP's student) say how many clients
    each mean covers, and the AUC's own count where it covers fewer."""
    from medfl.report import _final_lines

    summary = {"final_models": {"student": {"round": 3, "local_test": {
        "accuracy": {"mean": 0.8, "std": 0.1, "clients": 4, "of": 4},
        "auc": {"mean": 0.0, "std": 0.0, "clients": 1, "of": 4}}}}}
    assert _final_lines(summary) == ["final models (final_metrics.csv; mean over clients):",
                                     "  student: local_test accuracy 0.800 AUC 0.000 (4 of 4 clients; AUC 1 of 4)"]
