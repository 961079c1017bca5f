"""Built-in reporting: PNG plots of a run when it ends."""

from __future__ import annotations

from typing import Any

from medfl import hookimpl
from medfl.plotting import plots_wanted
from medfl.report_plots import write_plots

__all__ = ["on_run_end"]


@hookimpl
def on_run_end(run: Any, summary: dict[str, Any]) -> None:
    """Write the metric curves, per-client heatmaps, forgetting, communication and (for a
    differentially private run) epsilon plots to ``run_dir/plots``, unless the run's config
    says ``"plots": false`` or ``MEDFL_NO_PLOTS`` is set (:func:`medfl.plotting.plots_wanted`)."""
    if plots_wanted(run.config):
        write_plots(run.run_dir)
