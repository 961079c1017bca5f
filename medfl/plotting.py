"""What every medfl figure shares: whether to draw at all (:func:`plots_wanted`), matplotlib's
``pyplot`` on its file-only backend, a layout computed once, the round axis, and where a run's
figures go (``plots/``). The report's tables and plots (:mod:`medfl.report`,
:mod:`medfl.report_plots`, :mod:`medfl.report_repeats`, :mod:`medfl.arm_report`) draw through it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["plots_wanted", "pyplot", "tight_layout", "round_axis", "save_plot"]


def plots_wanted(cfg: dict[str, Any] | None = None) -> bool:
    """Whether runs and experiments draw their PNG plots when they end: not when the
    environment variable ``MEDFL_NO_PLOTS`` is set (to anything but ``""``, ``0``, ``false``
    or ``no``: for sweeps and CI, and it reaches a bundle's or a Flower app's processes), nor
    when the config says ``"plots": false``. Their CSV and JSON results are written either way,
    and ``medfl report RUN_DIR`` draws the plots at any time."""
    from medfl.config import FL_OPTIONAL

    if os.environ.get("MEDFL_NO_PLOTS", "").strip().lower() not in ("", "0", "false", "no"):
        return False
    return bool((cfg or {}).get("plots", FL_OPTIONAL["plots"]))


def pyplot() -> Any:
    """matplotlib's ``pyplot`` on the ``Agg`` backend (PNG files, no window), imported on the
    first figure: a run that draws nothing never loads matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def tight_layout(fig: Any) -> None:
    """``fig.tight_layout()``, then no layout engine on the figure. matplotlib leaves a
    placeholder engine behind after ``tight_layout``, and ``savefig`` then lays the figure out
    once more without rendering it (a tenth of a run's plotting time) to the same pixels."""
    fig.tight_layout()
    fig.set_layout_engine(None)


def round_axis(ax: Any, xlabel: str = "round", grid: str = "both", ylabel: str | None = None,
               legend: float | None = None) -> None:
    """Label the x axis of ``ax`` ``xlabel`` (rounds, or a student's epochs), tick it at whole
    numbers only, and draw a light grid on ``grid`` (``"both"`` axes, or ``"y"`` under bars);
    label the y axis ``ylabel``, and with ``legend`` (a font size) draw the legend of what has a label."""
    from matplotlib.ticker import MaxNLocator

    ax.set_xlabel(xlabel)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3, axis=grid)
    if ylabel is not None:
        ax.set_ylabel(ylabel)
    if legend is not None and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=legend)


def save_plot(fig: Any, path: Path) -> Path:
    """Lay ``fig`` out (:func:`tight_layout`), save it as the PNG ``path`` at 100 dpi (its
    folder made when missing: a run's ``plots/``), close it, and return ``path``."""
    tight_layout(fig)
    path.parent.mkdir(exist_ok=True)
    fig.savefig(path, dpi=100)
    pyplot().close(fig)
    return path
