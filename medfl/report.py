"""Readable results: summary tables, metric curves, per-client heatmaps and communication (PNG)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["plots_wanted", "write_plots", "write_experiment_plots", "write_forgetting_plot", "write_communication_plot", "write_privacy_plot", "write_group_plot",
           "write_mechanism_plot", "constant_mechanisms", "write_student_plot", "STUDENT_METRICS",
           "write_comparison",
           "forgetting_table",
           "print_result", "summary_table", "format_table", "shared_model_split", "clients_text",
           "load_metrics", "final_round", "CV_SPLITS", "cv_results", "cv_summary",
           "cv_table", "write_cv_report", "SEED_METRICS", "seeds_results", "seeds_clients_text", "seeds_summary", "write_seeds_report"]

PLOT_METRICS = ("accuracy", "auc", "f1")


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


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _tight_layout(fig: Any) -> None:
    """``fig.tight_layout()``, then no layout engine on the figure. matplotlib leaves a
    placeholder engine behind after ``tight_layout``, and ``savefig`` then lays the figure out
    once more without rendering it (a tenth of a run's plotting time) to the same pixels."""
    fig.tight_layout()
    fig.set_layout_engine(None)


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """Read a run's ``metrics.csv``.

    Raises:
        FileNotFoundError: the directory has no metrics yet.
    """
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics; is {run_dir} a medfl run directory with a finished round?")
    return pd.read_csv(path, dtype={"client_id": str, "client_name": str}, keep_default_na=False,
                       na_values=["", "nan", "NaN"])


def final_round(run_dir: str | Path, metrics: pd.DataFrame) -> int:
    """The round of ``metrics`` (the run's ``metrics.csv``) whose rows are the run's final
    metrics: the round of ``summary.json``'s ``final`` block (under early stopping, the best
    round, ``fl.early_stopping``) when the run has a summary, else the last round."""
    last = int(metrics["round"].max())
    try:
        chosen = json.loads((Path(run_dir) / "summary.json").read_text()).get("final", {}).get("round")
    except (OSError, ValueError, AttributeError):
        return last
    return int(chosen) if isinstance(chosen, int) and chosen in set(metrics["round"].astype(int)) else last


def write_forgetting_plot(run_dir: str | Path) -> Path | None:
    """Write ``plots/forgetting.png``: global and mean local accuracy per round with their
    recovery intervals shaded (the paper's consistency C, in the legend) and the unfinished
    last interval hatched (counted only by medfl's open-interval reading), worst-client
    accuracy, backward transfer on previously sampled clients, and the negative-flip rates.
    Returns the path, or None when the run has no accuracy."""
    from medfl.metrics.forgetting import forgetting_report

    run_dir = Path(run_dir)
    df = load_metrics(run_dir)
    if "accuracy" not in df.columns:
        return None
    tm_path = run_dir / "train_metrics.csv"
    tm = pd.read_csv(tm_path, dtype={"client_id": str}) if tm_path.is_file() else None
    block, per = forgetting_report(df, tm)
    if per.empty:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    ax = axes[0]
    for key, col, color in (("global", "global_acc", "C0"), ("local", "local_acc", "C1")):
        if per[col].notna().any():
            c = block[key]["consistency"]
            ax.plot(per["round"], per[col], marker="o", color=color,
                    label=f"{key} (C={c:.3f})" if c is not None else key)
            for iv in block[key]["intervals"]:
                ax.axvspan(iv["start_round"], iv["end_round"], color=color, alpha=0.12)
            open_iv = block[key].get("open_interval")
            if open_iv:
                ax.axvspan(open_iv["start_round"], open_iv["end_round"], facecolor="none",
                           edgecolor=color, hatch="//", alpha=0.3, lw=0)
    if per["worst_local_acc"].notna().any():
        ax.plot(per["round"], per["worst_local_acc"], ls="--", color="C3", label="worst client (local)")
    ax.set_title("accuracy; shaded: recovery intervals, hatched: peak not regained", fontsize=9)
    ax.set_ylabel("accuracy")
    axes[1].plot(per["round"], per["bwt"], marker="o", color="C2")
    axes[1].axhline(0, color="grey", lw=0.8)
    axes[1].set_title("BwT on previously sampled clients")
    for col, label in (("global_neg_flip_rate", "global test"), ("local_neg_flip_rate", "local test")):
        axes[2].plot(per["round"], per[col], marker="o", label=label)
    axes[2].set_title("negative-flip rate vs previous evaluation")
    from matplotlib.ticker import MaxNLocator

    for a in axes:
        a.set_xlabel("round")
        a.xaxis.set_major_locator(MaxNLocator(integer=True))
        a.grid(alpha=0.3)
        if a.get_legend_handles_labels()[0]:
            a.legend(fontsize=8)
    fig.suptitle(f"{run_dir.name}: forgetting")
    _tight_layout(fig)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / "forgetting.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _run_csv(run_dir: Path, name: str) -> pd.DataFrame | None:
    """A run's per-round CSV ``name`` (``None`` when it is missing or empty)."""
    path = run_dir / name
    if not path.is_file():
        return None
    df = pd.read_csv(path, dtype={"client_id": str})
    return None if df.empty else df


def _save_plot(fig: Any, run_dir: Path, name: str) -> Path:
    """Save ``fig`` as ``run_dir/plots/name`` and close it."""
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / name
    fig.savefig(path, dpi=100)
    _plt().close(fig)
    return path


def write_communication_plot(run_dir: str | Path) -> Path | None:
    """Write ``plots/communication.png``: megabytes (1 MB = 1e6 bytes) sent to and received
    from all clients in each round, stacked by phase (``train``, ``validate``, ``evaluate``,
    ``score``), from the run's ``communication.csv`` (:mod:`medfl.traffic`). Returns
    the path, or None when the run has no such file (or an empty one)."""
    from medfl.traffic import PHASES

    run_dir = Path(run_dir)
    df = _run_csv(run_dir, "communication.csv")
    if df is None:
        return None
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    rounds = sorted(df["round"].unique())
    phases = [p for p in PHASES if (df["phase"] == p).any()]
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, col, title in ((axes[0], "bytes_to_client", "to clients"), (axes[1], "bytes_from_client", "from clients")):
        bottom = np.zeros(len(rounds))
        for k, phase in enumerate(phases):
            mb = (df[df["phase"] == phase].groupby("round")[col].sum().reindex(rounds, fill_value=0) / 1e6).to_numpy()
            ax.bar(rounds, mb, bottom=bottom, color=f"C{k}", label=phase)
            bottom += mb
        ax.set_title(f"{title}: {bottom.sum() / len(rounds):.3g} MB per round")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3, axis="y")
    axes[0].set_ylabel("MB (all clients)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{run_dir.name}: communication per round")
    _tight_layout(fig)
    return _save_plot(fig, run_dir, "communication.png")


def write_privacy_plot(run_dir: str | Path) -> Path | None:
    """Write ``plots/privacy.png``: each client's epsilon spent over the rounds (one panel
    per mechanism, the target as a dashed line where there is one), from the run's
    ``privacy.csv`` (:mod:`medfl.privacy.ledger`). Returns the path, or None for a run
    without differential privacy."""
    run_dir = Path(run_dir)
    df = _run_csv(run_dir, "privacy.csv")
    if df is None:
        return None
    targets: dict[str, Any] = {}
    cfg = run_dir / "config.json"
    if cfg.is_file():
        plan = json.loads(cfg.read_text()).get("privacy", {})
        targets["dp_sgd"] = (plan.get("dp_sgd") or {}).get("epsilon")
        for f in plan.get("filters", []):
            if f.get("epsilon") is not None:
                targets[str(f["name"])] = f["epsilon"]
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    mechs = list(dict.fromkeys(df["mechanism"]))
    fig, axes = plt.subplots(1, len(mechs), figsize=(5.2 * len(mechs), 3.6), squeeze=False)
    for ax, mech in zip(axes[0], mechs):
        g = df[df["mechanism"] == mech]
        for cid, rows in g.groupby("client_id", sort=False):
            ax.plot(rows["round"], rows["epsilon"], marker="o", label=f"client {cid}")
        if targets.get(mech) is not None:
            ax.axhline(float(targets[mech]), ls="--", color="k", lw=1, label="target")
        ax.set_title(f"{mech} ({g['unit'].iloc[0]}-level, delta={float(g['delta'].iloc[0]):g}, "
                     f"{g['accountant'].iloc[0]})", fontsize=9)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("epsilon spent")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    _tight_layout(fig)
    return _save_plot(fig, run_dir, "privacy.png")


def write_group_plot(run_dir: str | Path) -> Path | None:
    """Write ``plots/groups.png``: per client group (``groups.csv``: PFedCDP's capability
    clusters, the paper's Fig. 2), the mean accuracy of the group's clients per round on each
    evaluated split. Returns the path, or None for a run without groups."""
    run_dir = Path(run_dir)
    groups = _run_csv(run_dir, "groups.csv")
    metrics = _run_csv(run_dir, "metrics.csv")
    if groups is None or metrics is None or "accuracy" not in metrics.columns:
        return None
    of = dict(zip(groups["client_id"].astype(str), groups["group"].astype(str)))
    metrics = metrics.assign(group=metrics["client_id"].astype(str).map(of)).dropna(subset=["group"])
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    splits = list(dict.fromkeys(metrics["split"]))
    fig, axes = plt.subplots(1, len(splits), figsize=(5.0 * len(splits), 3.6), squeeze=False)
    for ax, split in zip(axes[0], splits):
        part = metrics[metrics["split"] == split]
        for g in dict.fromkeys(groups["group"].astype(str)):
            curve = part[part["group"] == g].groupby("round")["accuracy"].mean()
            n = int((groups["group"].astype(str) == g).sum())
            if len(curve):
                ax.plot(curve.index, curve.values, marker="o", label=f"{g} ({n} client{'s' if n != 1 else ''})")
        ax.set_title(f"{split}: mean accuracy per group")
        ax.set_xlabel("round")
        ax.set_ylabel("accuracy")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(run_dir.name)
    _tight_layout(fig)
    return _save_plot(fig, run_dir, "groups.png")


#: At most this many panels in ``plots/mechanisms.png`` and lines in one panel (the rest are
#: summarised: a panel's mean and range over its ids).
MECHANISM_PANELS, MECHANISM_LINES = 16, 10


def _constant(values: pd.Series) -> bool:
    """Whether a series of numbers is one value over the run (to 1e-9 relative)."""
    v = values.dropna().to_numpy(dtype=float)
    return len(v) > 0 and bool(np.allclose(v, v[0], rtol=1e-9, atol=1e-12))


def constant_mechanisms(df: pd.DataFrame) -> dict[tuple[str, str], str]:
    """``mechanisms.csv``'s numeric (mechanism, name) values (``df``, the ``value`` column
    numeric) that stay one value over the run, each as a text line: ``"dp: sigma = 0.969
    (constant)"``; for several ids each constant, their values (or their range, over many).
    A value that moves in any id is not listed."""
    lines: dict[tuple[str, str], str] = {}
    for (mech, name), part in df.groupby(["mechanism", "name"], sort=False):
        per_id = part.groupby(part["id"].fillna(""), sort=False)["value"]
        if not all(_constant(v) for _, v in per_id):
            continue
        firsts = {str(i): float(v.dropna().iloc[0]) for i, v in per_id}
        values = sorted(set(firsts.values()))
        if len(values) == 1:
            text = f"{values[0]:.4g}"
        elif len(firsts) <= 4:
            text = ", ".join(f"{i} {v:.4g}" for i, v in firsts.items())
        else:
            text = f"{values[0]:.4g} to {values[-1]:.4g} over {len(firsts)} ids"
        lines[(str(mech), str(name))] = f"{mech}: {name} = {text} (constant)"
    return lines


def write_mechanism_plot(run_dir: str | Path) -> Path | None:
    """Write ``plots/mechanisms.png``: every numeric value of the run's ``mechanisms.csv``
    (:meth:`medfl.method.Method.mechanisms`: stop rounds, decay weights, noise-to-signal
    ratios...) that moves over the rounds, one panel per (mechanism, value), one line per id
    (their mean and range when there are more than ``MECHANISM_LINES``), the rounds of the
    summary's ``warnings`` marked; the values that stay one value over the run
    (:func:`constant_mechanisms`) are listed as text in one last panel, not drawn as flat
    curves; moving values past ``MECHANISM_PANELS`` panels are named in that text panel, not
    dropped. Returns the path, or None for a run without such values."""
    run_dir = Path(run_dir)
    path = run_dir / "mechanisms.csv"
    if not path.is_file():
        return None
    df = pd.read_csv(path, dtype={"id": str, "scope": str, "text": str}, keep_default_na=False,
                     na_values=["", "nan", "NaN"])
    df = df[pd.to_numeric(df["value"], errors="coerce").notna()].astype({"value": float})
    if df.empty:
        return None
    warned: list[int] = []
    summary = run_dir / "summary.json"
    if summary.is_file():
        warned = sorted({int(w["round"]) for w in json.loads(summary.read_text()).get("warnings", [])})
    constants = constant_mechanisms(df)
    moving = [k for k in dict.fromkeys(zip(df["mechanism"].astype(str), df["name"].astype(str)))
              if k not in constants]
    panels, undrawn = moving[:MECHANISM_PANELS], moving[MECHANISM_PANELS:]
    notes = list(constants.values())
    if undrawn:   # said, not dropped: the values past the last panel are named in the text panel
        notes.append(f"not drawn ({len(undrawn)} more moving values than the {MECHANISM_PANELS} "
                     f"panels; see mechanisms.csv):")
        notes.extend(f"  {mech}: {name}" for mech, name in undrawn)
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    cols = min(4, max(1, len(panels)))
    rows = -(-len(panels) // cols)
    text_height = 0.5 + 0.15 * len(notes) if notes else 0.0
    fig = plt.figure(figsize=(3.8 * cols, 2.9 * rows + text_height))
    grid = fig.add_gridspec(rows + (1 if notes else 0), cols,
                            height_ratios=[2.9] * rows + ([text_height] if notes else []))
    axes = [fig.add_subplot(grid[k // cols, k % cols]) for k in range(len(panels))]
    for ax, (mech, name) in zip(axes, panels):
        part = df[(df["mechanism"] == mech) & (df["name"] == name)]
        ids = list(dict.fromkeys(part["id"].fillna("")))
        if len(ids) <= MECHANISM_LINES:
            for i in ids:
                line = part[part["id"].fillna("") == i]
                scope = str(line["scope"].iloc[0])
                ax.plot(line["round"], line["value"], marker="o", ms=3, label=f"{scope} {i}".strip())
        else:
            g = part.groupby("round")["value"]
            ax.plot(g.mean().index, g.mean().values, marker="o", ms=3, label=f"mean of {len(ids)}")
            ax.fill_between(g.mean().index, g.min().values, g.max().values, alpha=0.2)
        for r in warned:
            ax.axvline(r, ls=":", color="red", lw=0.8)
        ax.set_title(f"{mech}: {name}", fontsize=9)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    if notes:   # one panel across the figure's width: the values that did not move, as text
        ax = fig.add_subplot(grid[rows, :])
        ax.axis("off")
        rounds = sorted(df["round"].astype(int).unique())
        ax.set_title(f"constant over rounds {rounds[0]}-{rounds[-1]}" if len(rounds) > 1
                     else f"round {rounds[0]} (one round: nothing to draw)", fontsize=9, loc="left")
        ax.text(0.0, 1.0, "\n".join(notes), transform=ax.transAxes, va="top", ha="left",
                fontsize=8, family="monospace")
    fig.suptitle(f"{run_dir.name}: what the method's mechanisms did" + (" (red: a warning)" if warned else ""))
    _tight_layout(fig)
    return _save_plot(fig, run_dir, "mechanisms.png")


#: ``student_metrics.csv``'s metrics drawn per epoch (:func:`write_student_plot`).
STUDENT_METRICS = ("accuracy", "f1", "micro_f1", "auc")


def write_student_plot(run_dir: str | Path) -> Path | None:
    """Write ``plots/student_metrics.png``: a post-hoc student's metrics after every epoch of
    its training (PFedCDP's ``student_metrics.csv``, the paper's Fig. 3): accuracy, macro and
    micro F1 and AUC on each evaluated split (epoch 0: before training) and the training loss
    terms per epoch. Returns the path, or None for a run without that file."""
    run_dir = Path(run_dir)
    df = _run_csv(run_dir, "student_metrics.csv")
    if df is None or "epoch" not in df.columns or "split" not in df.columns:
        return None
    plt = _plt()
    from matplotlib.ticker import MaxNLocator

    metrics = [m for m in STUDENT_METRICS if m in df.columns and df[m].notna().any()]
    losses = [c for c in ("loss", "supcon", "kd") if c in df.columns and df[c].notna().any()]
    panels = metrics + (["losses"] if losses else [])
    if not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "losses":
            part = df[df[losses].notna().any(axis=1)].sort_values("epoch")
            for c in losses:
                ax.plot(part["epoch"], part[c], marker="o", label=f"{c} ({', '.join(part['split'].unique())})")
            ax.set_title("training loss terms per epoch")
            ax.set_ylabel("loss")
        else:
            for split, part in df[df[panel].notna()].groupby("split", sort=False):
                part = part.sort_values("epoch")
                ax.plot(part["epoch"], part[panel], marker="o", label=str(split))
            ax.set_title(f"student {panel}")
            ax.set_ylabel(panel)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{run_dir.name}: the post-hoc student per epoch (student_metrics.csv)")
    _tight_layout(fig)
    return _save_plot(fig, run_dir, "student_metrics.png")


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write ``plots/curves.png`` (metric per round, mean and client range per split),
    ``plots/clients_<split>.png`` (final metrics per client as a heatmap; one row for a split
    whose clients' rows are one score, :func:`shared_model_split`),
    ``plots/forgetting.png`` (:func:`write_forgetting_plot`) and, when the run has a
    ``communication.csv``, ``plots/communication.png`` (:func:`write_communication_plot`),
    a ``privacy.csv``, ``plots/privacy.png`` (:func:`write_privacy_plot`), a ``groups.csv``,
    ``plots/groups.png`` (:func:`write_group_plot`), a ``mechanisms.csv``,
    ``plots/mechanisms.png`` (:func:`write_mechanism_plot`), and a ``student_metrics.csv``,
    ``plots/student_metrics.png`` (:func:`write_student_plot`). Returns the paths."""
    plt = _plt()
    run_dir = Path(run_dir)
    df = load_metrics(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    metrics = [m for m in PLOT_METRICS if m in df.columns]
    splits = list(dict.fromkeys(df["split"]))
    chosen = final_round(run_dir, df)
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.6), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for split in splits:
            g = df[df["split"] == split].groupby("round")[m]
            mean, lo, hi = g.mean(), g.min(), g.max()
            ax.plot(mean.index, mean.values, marker="o", label=f"{split} (mean)")
            ax.fill_between(mean.index, lo.values, hi.values, alpha=0.2)
        if chosen != int(df["round"].max()):   # early stopping's best round
            ax.axvline(chosen, ls=":", color="k", lw=1, label=f"best round {chosen}")
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(m)
        ax.set_title(f"{m}: mean and client range")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(run_dir.name)
    _tight_layout(fig)
    path = out_dir / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    last = df[df["round"] == chosen]
    cols = [c for c in ("accuracy", "precision", "recall", "specificity", "f1", "micro_f1", "auc") if c in df.columns]
    for split in splits:
        part = last[last["split"] == split]
        t = part.set_index("client_id")[cols].astype(float)
        names = [f"client {c}" for c in t.index]
        if shared_model_split(part, cols):   # one score: one row, not identical rows per client
            t, names = t.iloc[:1], [clients_text(len(part), len(part), shared=True)]
        fig, ax = plt.subplots(figsize=(1.1 * len(cols) + 2, 0.45 * len(t) + 1.5))
        im = ax.imshow(t.values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right")
        ax.set_yticks(range(len(t)), names)
        for i in range(t.shape[0]):
            for j in range(t.shape[1]):
                v = t.values[i, j]
                ax.text(j, i, "n/a" if np.isnan(v) else f"{v:.2f}", ha="center", va="center",
                        color="black" if (np.isnan(v) or v >= 0.6) else "white", fontsize=8)
        fig.colorbar(im, ax=ax)
        ax.set_title(f"{run_dir.name}: {split}, round {int(last['round'].max())}")
        _tight_layout(fig)
        path = out_dir / f"clients_{split}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    for extra in (write_forgetting_plot, write_communication_plot, write_privacy_plot, write_group_plot,
                  write_mechanism_plot, write_student_plot):
        path = extra(run_dir)
        if path is not None:
            written.append(path)
    return written


def shared_model_split(part: pd.DataFrame, cols: list[str]) -> bool:
    """Whether the rows of one split and round (``part``, one per client) are one score: a
    split on data every client shares (not a ``local_*`` split, whose rows are each client's
    own data) where every client's row has the same numbers for every metric of ``cols``
    (missing where missing), as when the clients score one shared model (a FedAvg-like
    method's ``global_test``); they are one result, not ``len(part)`` clients agreeing. One
    client's row is not called shared."""
    if len(part) < 2 or str(part["split"].iloc[0]).startswith("local_"):
        return False
    values = part[cols].astype(float).to_numpy()
    same = (values == values[0]) | (np.isnan(values) & np.isnan(values[0]))
    return bool(same.all())


def clients_text(valid: int, total: int, shared: bool = False) -> str:
    """What a mean covers: ``"3 of 4 clients"`` (those with a value of the metric among the
    split's clients), or, for a split whose clients scored one shared model
    (:func:`shared_model_split`), ``"one score, identical at all 4 clients"``."""
    if shared:
        return f"one score, identical at all {total} clients"
    return f"{valid} of {total} client{'s' if total != 1 else ''}"


def summary_table(run_dir: str | Path) -> pd.DataFrame:
    """Per split, mean / std / worst client of each metric in the run's final round (the
    last, or early stopping's best round: :func:`final_round`), and in ``clients`` how many of
    the split's clients the mean covers (a client without a value, e.g. an AUC on a test split
    of one class, is left out). A split whose clients all scored one shared model on the same
    data (identical rows, :func:`shared_model_split`) is one score, in ``mean``: ``clients``
    says so, and it has no spread, no worst and no best client."""
    df = load_metrics(run_dir)
    last = df[df["round"] == final_round(run_dir, df)]
    cols = [c for c in ("accuracy", "precision", "recall", "specificity", "f1", "micro_f1", "auc") if c in df.columns]
    rows = []
    for split, g in last.groupby("split", sort=False):
        shared = shared_model_split(g, cols)
        for m in cols:
            v = g[m].astype(float)
            valid = int(v.notna().sum())
            rows.append({"split": split, "metric": m,
                         "reported_by": str(g["reported_by"].iloc[0]) if "reported_by" in g.columns else "",
                         "clients": clients_text(valid, len(g), shared),
                         "mean": v.mean(), "std": float("nan") if shared else v.std(ddof=0),
                         "worst": float("nan") if shared else v.min(),
                         "worst_client": g.loc[v.idxmin(), "client_id"] if v.notna().any() and not shared else "",
                         "best": float("nan") if shared else v.max()})
    return pd.DataFrame(rows)


def format_table(df: pd.DataFrame) -> str:
    """Plain-text table with floats to 4 decimals (a missing number, e.g. the spread of one
    shared model's score, as ``-``)."""
    return df.to_string(index=False, float_format=lambda x: f"{x:.4f}", na_rep="-")


def forgetting_table(summaries: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per method with the scalar measures of its summary's ``forgetting`` block,
    flattened as ``global_<name>``, ``local_<name>``, ``balance_<name>`` (the columns of
    the FedKPer paper's Table 1 are ``global_acc_mean``, ``global_bwt_final``,
    ``global_consistency``, ``local_acc_mean``, ``local_worst_client_acc_mean``,
    ``local_consistency`` and ``balance_mean``; the ``*_consistency`` and ``*_aipfr``
    columns are the paper's, ``*_open_intervals`` medfl's open-interval reading, see
    :mod:`medfl.metrics.forgetting`)."""
    rows = []
    for label, summary in summaries.items():
        block = summary.get("forgetting") or {}
        row: dict[str, Any] = {"method": label}
        for part in ("global", "local", "balance"):
            for k, v in (block.get(part) or {}).items():
                if v is None or isinstance(v, (int, float)) and not isinstance(v, bool):
                    row[f"{part}_{k}"] = v
        rows.append(row)
    return pd.DataFrame(rows)


def _mb_per_round(summary: dict[str, Any]) -> dict[str, float]:
    """A summary's mean megabytes (1e6 bytes) per round to and from all clients (NaN when
    its ``communication`` block is missing)."""
    per_round = (summary.get("communication") or {}).get("per_round") or {}

    def mb(key: str) -> float:
        v = per_round.get(key)
        return float(v) / 1e6 if isinstance(v, (int, float)) else float("nan")

    return {"mb_to_clients_per_round": mb("bytes_to_clients"), "mb_from_clients_per_round": mb("bytes_from_clients")}


def _epsilon(summary: dict[str, Any]) -> dict[str, Any]:
    """A summary's worst client's final epsilon (``inf`` for a run without differential
    privacy, which guarantees nothing) and the mechanisms it comes from."""
    privacy = summary.get("privacy") or {}
    eps = privacy.get("epsilon")
    return {"epsilon": float("inf") if eps is None else float(eps),
            "dp_mechanisms": "+".join(privacy.get("mechanisms") or {}) or "none"}


def write_comparison(exp_dir: str | Path, summaries: dict[str, dict[str, Any]], plots: bool = True) -> Path:
    """Write ``comparison.csv`` (one row per method and split, mean/std/worst of each metric,
    and the method's communication cost: ``mb_to_clients_per_round`` and
    ``mb_from_clients_per_round``, the mean megabytes (1 MB = 1e6 bytes) sent to and
    received from all clients per round, from the summary's ``communication`` block, and its
    privacy: ``epsilon``, the worst client's final epsilon, ``inf`` without DP, and
    ``dp_mechanisms``),
    ``comparison_forgetting.csv`` (:func:`forgetting_table`), ``summaries.json`` and, when
    there are two or more methods, ``comparison.png`` (accuracy and AUC per round for every
    method; a single method's curves are its ``curves.png``)."""
    exp_dir = Path(exp_dir)
    rows = []
    for label, summary in summaries.items():
        for split, block in summary.get("final", {}).items():
            if not isinstance(block, dict):
                continue
            row: dict[str, Any] = {"method": label, "split": split}
            for m, stats in block.items():
                row[f"{m}_mean"], row[f"{m}_std"], row[f"{m}_worst"] = stats["mean"], stats["std"], stats["worst"]
                if "clients" in stats:   # summaries before issue 48 do not say
                    row[f"{m}_clients"] = f"{stats['clients']} of {stats['of']}"
            row.update(_mb_per_round(summary))
            row.update(_epsilon(summary))
            rows.append(row)
    path = exp_dir / "comparison.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    if any(s.get("forgetting") for s in summaries.values()):
        forgetting_table(summaries).to_csv(exp_dir / "comparison_forgetting.csv", index=False)
    (exp_dir / "summaries.json").write_text(json.dumps(summaries, indent=2, default=str))
    if len(summaries) < 2 or not plots:
        return path
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for label in summaries:
        try:
            df = load_metrics(exp_dir / label)
        except FileNotFoundError:
            continue
        for ax, m in zip(axes, ("accuracy", "auc")):
            for split, style in (("local_test", "-"), ("global_test", "--")):
                g = df[df["split"] == split].groupby("round")[m].mean()
                if len(g):
                    ax.plot(g.index, g.values, style, marker="o", label=f"{label} {split}")
    from matplotlib.ticker import MaxNLocator

    for ax, m in zip(axes, ("accuracy", "auc")):
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel(f"mean {m} over clients")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    _tight_layout(fig)
    fig.savefig(exp_dir / "comparison.png", dpi=100)
    plt.close(fig)
    return path


def write_experiment_plots(exp_dir: str | Path) -> list[Path]:
    """Draw an experiment's own figures again from what it saved, as its end would have with
    plots on: ``comparison.png`` of every directory under ``exp_dir`` whose ``summaries.json``
    holds two or more methods, ``cv_<metric>.png`` of a finished cross-validated experiment
    and ``seeds_metrics.png`` of a finished experiment over seeds (their CSV, JSON and
    Markdown tables are rewritten from the same saved results). Returns the PNGs written."""
    from medfl.config import method_label

    exp_dir = Path(exp_dir)
    written = []
    for file in sorted(exp_dir.rglob("summaries.json")):
        summaries = json.loads(file.read_text())
        if isinstance(summaries, dict) and len(summaries) >= 2:
            write_comparison(file.parent, summaries)
            written.append(file.parent / "comparison.png")
    cfg_file = exp_dir / "config.json"
    fl = json.loads(cfg_file.read_text()).get("fl", {}) if cfg_file.is_file() else {}
    if (exp_dir / "cv_summary.json").is_file() and isinstance(fl.get("cv"), dict):
        metric = str(fl["cv"].get("metric", "auc"))
        write_cv_report(exp_dir, [method_label(m) for m in fl["methods"]], int(fl["cv"]["folds"]), metric)
        written.append(exp_dir / f"cv_{metric}.png")
    if (exp_dir / "seeds_summary.json").is_file() and fl.get("seeds"):
        summaries = {int(s): json.loads((exp_dir / f"seed_{int(s)}" / "summaries.json").read_text())
                     for s in fl["seeds"]}
        write_seeds_report(exp_dir, summaries)
        written.append(exp_dir / "seeds_metrics.png")
    return [p for p in written if p.is_file()]


#: metrics.csv split -> the heading the FedSKD paper's Tables II/III give it.
CV_SPLITS = {"local_test": "Local Test", "cross_test": "Global Test", "global_test": "Held-out Test"}


def _mean_std(values: list[float]) -> dict[str, Any]:
    """Mean and population std (ddof=0) of the finite values, with the values themselves."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    return {"mean": float(v.mean()) if len(v) else float("nan"),
            "std": float(v.std(ddof=0)) if len(v) else float("nan"),
            "folds": [None if x is None or not np.isfinite(x) else float(x) for x in values]}


def _finite(obj: Any) -> Any:
    """``obj`` with every NaN/inf float replaced by ``None`` (strict JSON)."""
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    if isinstance(obj, float) and not np.isfinite(obj):
        return None
    return obj


def _pm(stats: dict[str, Any], digits: int = 3) -> str:
    if not np.isfinite(stats["mean"]):
        return "n/a"
    return f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"


def cv_results(exp_dir: str | Path, labels: list[str], folds: int) -> pd.DataFrame:
    """Final-round metrics of every (fold, method, client, split) of a cross-validated
    experiment directory (``fold_<k>/<label>/metrics.csv``; under early stopping the best
    round's, :func:`final_round`), with a ``fold`` and ``method`` column."""
    frames = []
    for k in range(folds):
        for label in labels:
            path = Path(exp_dir) / f"fold_{k}" / label / "metrics.csv"
            if not path.is_file():
                continue
            df = pd.read_csv(path, dtype={"client_id": str, "client_name": str})
            if df.empty:
                continue
            df = df[df["round"] == final_round(path.parent, df)]
            frames.append(df.assign(fold=k, method=label))
    if not frames:
        return pd.DataFrame()
    out = pd.concat(frames, ignore_index=True)
    first = ["fold", "method", "round", "client_id", "client_name", "split"]
    return out[first + [c for c in out.columns if c not in first]]


def cv_summary(results: pd.DataFrame, labels: list[str], folds: int, metric: str = "auc") -> dict[str, Any]:
    """Mean ± std over folds of ``metric`` per method, split and client, and overall.

    "Overall" (a table's Mean column) is, in each fold, the mean over clients (each client
    counts once, NaN skipped), then mean ± std of those fold means. Where the per-sample
    sex is known, the eq. 16 fairness figures (:func:`medfl.metrics.fairness.fairness_report`
    on the local test of each fold) get the same treatment.
    """
    from medfl.metrics.fairness import fairness_report

    out: dict[str, Any] = {"metric": metric, "folds": folds, "std": "population (ddof=0) over folds",
                           "methods": {}}
    if results.empty:
        return out
    names = dict(zip(results["client_id"].astype(str), results["client_name"].astype(str)))
    ids = sorted(names, key=lambda s: (len(s), s))
    for label in labels:
        res = results[results["method"] == label]
        block: dict[str, Any] = {}
        for split in CV_SPLITS:
            part = res[res["split"] == split]
            if part.empty or metric not in part.columns:
                continue
            per_fold = {k: part[part["fold"] == k] for k in range(folds)}
            clients = {}
            for cid in ids:
                vals = []
                for k in range(folds):
                    row = per_fold[k][per_fold[k]["client_id"].astype(str) == cid]
                    vals.append(float(row[metric].iloc[0]) if len(row) else float("nan"))
                clients[cid] = {"name": names[cid], **_mean_std(vals)}
            means = [float(np.nanmean(per_fold[k][metric].astype(float)))
                     if per_fold[k][metric].notna().any() else float("nan") for k in range(folds)]
            # what stands behind each fold's mean: the clients with a value of the clients evaluated
            support = {"with_value": [int(per_fold[k][metric].notna().sum()) for k in range(folds)],
                       "evaluated": [int(len(per_fold[k])) for k in range(folds)]}
            block[split] = {"clients": clients, "overall": {**_mean_std(means), "clients": support}}
        fair = [fairness_report(res[res["fold"] == k]) for k in range(folds)]
        if any(fair):
            block["fairness"] = {key: _mean_std([f.get(key, float("nan")) if f else float("nan") for f in fair])
                                 for key in ("auc_M", "auc_F", "avg", "delta_auc")}
        out["methods"][label] = block
    return out


def _cv_support(overall: dict[str, Any], folds: int) -> str:
    """What stands behind a cross-validated Mean: "4 of 4 clients, 5 folds", or, where folds
    differ, "1-4 of 4 clients (by fold: 4, 1, ...), 5 folds" (folds without a value named)."""
    support = overall.get("clients")
    if not support:
        return ""
    have, evaluated = support["with_value"], support["evaluated"]
    scored = sum(1 for v in overall.get("folds", []) if v is not None)
    n_eval = max(evaluated) if evaluated else 0
    if len(set(have)) <= 1:
        clients = f"{have[0] if have else 0} of {n_eval} clients"
    else:
        clients = f"{min(have)}-{max(have)} of {n_eval} clients (by fold: {', '.join(map(str, have))})"
    return f"{clients}, {scored} of {folds} folds" if scored < folds else f"{clients}, {folds} folds"


def cv_table(summary: dict[str, Any]) -> pd.DataFrame:
    """The layout of the FedSKD paper's Tables II/III: one row per method; for Local Test
    and Global Test a column per client and their Mean, each cell "mean ± std" over folds
    (a client's cell says over how many folds where it lacks a value in some), and a column
    of what stands behind the Mean (clients with a value per fold, folds); then the fairness
    columns of Table VII (Male, Female, Avg, Delta AUC) where known."""
    rows = []
    folds = int(summary.get("folds", 0))
    for label, block in summary.get("methods", {}).items():
        row: dict[str, Any] = {"method": label}
        for split, heading in CV_SPLITS.items():
            if split not in block:
                continue
            for cid, stats in block[split]["clients"].items():
                n = sum(1 for v in stats.get("folds", []) if v is not None)
                row[f"{heading}: {stats['name']}"] = _pm(stats) + (f" ({n} of {folds} folds)"
                                                                   if 0 < n < folds else "")
            row[f"{heading}: Mean"] = _pm(block[split]["overall"])
            row[f"{heading}: support"] = _cv_support(block[split]["overall"], folds)
        if "fairness" in block:
            f = block["fairness"]
            row.update({"Fairness: Male": _pm(f["auc_M"]), "Fairness: Female": _pm(f["auc_F"]),
                        "Fairness: Avg": _pm(f["avg"]), "Fairness: ΔAUC": _pm(f["delta_auc"])})
        rows.append(row)
    return pd.DataFrame(rows)


def write_cv_report(exp_dir: str | Path, labels: list[str], folds: int, metric: str = "auc",
                    plots: bool = True) -> dict[str, Any]:
    """Write a cross-validated experiment's ``cv_results.csv`` (every final per-client metric
    of every fold), ``cv_summary.json`` (:func:`cv_summary`), ``cv_table.csv`` and
    ``cv_table.md`` (:func:`cv_table`) and, with ``plots``, ``cv_<metric>.png`` (overall
    mean ± std per method and split); return the summary."""
    exp_dir = Path(exp_dir)
    results = cv_results(exp_dir, labels, folds)
    results.to_csv(exp_dir / "cv_results.csv", index=False)
    summary = cv_summary(results, labels, folds, metric)
    (exp_dir / "cv_summary.json").write_text(json.dumps(_finite(summary), indent=2))
    table = cv_table(summary)
    table.to_csv(exp_dir / "cv_table.csv", index=False)
    lines = [f"{metric} over {folds} folds, mean ± std (std over folds, ddof=0)", "",
             "| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in table.itertuples(index=False)]
    (exp_dir / "cv_table.md").write_text("\n".join(lines) + "\n")
    splits = [s for s in CV_SPLITS if any(s in b for b in summary["methods"].values())]
    if plots and splits and summary["methods"]:
        plt = _plt()
        fig, ax = plt.subplots(figsize=(1.6 + 1.4 * len(labels), 3.4))
        width = 0.8 / len(splits)
        for j, split in enumerate(splits):
            xs, ms, ss = [], [], []
            for i, label in enumerate(summary["methods"]):
                st = summary["methods"][label].get(split, {}).get("overall")
                if st:
                    xs.append(i + j * width)
                    ms.append(st["mean"])
                    ss.append(st["std"])
            ax.bar(xs, ms, width, yerr=ss, capsize=3, label=CV_SPLITS[split])
        ax.set_xticks([i + width * (len(splits) - 1) / 2 for i in range(len(summary["methods"]))])
        ax.set_xticklabels(list(summary["methods"]))
        ax.set_ylabel(f"{metric} (mean over clients)")
        ax.set_title(f"{folds}-fold cross-validation, mean ± std over folds", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
        _tight_layout(fig)
        fig.savefig(exp_dir / f"cv_{metric}.png", dpi=100)
        plt.close(fig)
    return summary


#: Metrics of the over-seeds table, in column order (those a run has): micro-F1 first, the
#: primary metric of FedSDC's tables.
SEED_METRICS = ("micro_f1", "accuracy", "f1", "auc")


def seeds_results(summaries: dict[int, dict[str, dict[str, Any]]]) -> pd.DataFrame:
    """One row per (seed, method, split): each metric's final mean over clients, from the
    runs' summaries (``{seed: {label: summary}}``), and what each mean covers: ``clients:<metric>``
    the clients with a value, ``of`` the clients evaluated (summaries since issue 48)."""
    rows = []
    for seed, by_label in summaries.items():
        for label, summary in by_label.items():
            for split, block in (summary or {}).get("final", {}).items():
                if isinstance(block, dict):
                    rows.append({"seed": int(seed), "method": label, "split": split,
                                 **{m: stats["mean"] for m, stats in block.items()},
                                 **{f"clients:{m}": stats["clients"] for m, stats in block.items() if "clients" in stats},
                                 **{"of": stats["of"] for stats in block.values() if "of" in stats}})
    return pd.DataFrame(rows)


def seeds_clients_text(part: pd.DataFrame, metrics: list[str]) -> str:
    """What the means of one method and split (``part``: its :func:`seeds_results` rows, one
    a seed) cover: ``"4 of 4"`` when every seed's mean of every metric covers every client,
    else the exceptions (``"4 of 4; auc 1 of 4"``, or a range over seeds, ``"auc 1-2 of 4"``);
    ``"?"`` for summaries that do not say."""
    if "of" not in part.columns or part["of"].isna().all():
        return "?"
    of = int(part["of"].max())

    def span(values: pd.Series) -> str:
        lo, hi = int(values.min()), int(values.max())
        return f"{lo}" if lo == hi else f"{lo}-{hi}"

    exceptions = [f"{m} {span(part[f'clients:{m}'])} of {of}" for m in metrics
                  if f"clients:{m}" in part.columns and part[f"clients:{m}"].notna().any()
                  and int(part[f"clients:{m}"].min()) < of]
    return "; ".join([f"{of} of {of}" if len(exceptions) < len(metrics) else "", *exceptions]).strip("; ")


def seeds_summary(results: pd.DataFrame) -> dict[str, Any]:
    """Mean ± population std (ddof=0) over seeds of every metric, per method and split, with
    the per-seed values (in seed order)."""
    seeds = sorted(results["seed"].unique().tolist()) if not results.empty else []
    out: dict[str, Any] = {"seeds": seeds, "std": "population (ddof=0) over seeds", "methods": {}}
    metrics = [c for c in results.columns if c not in ("seed", "method", "split", "n", "of")
               and not str(c).startswith("clients:")]
    for label in dict.fromkeys(results.get("method", pd.Series(dtype=str))):
        block: dict[str, Any] = {}
        for split, part in results[results["method"] == label].groupby("split", sort=False):
            per_seed = part.set_index("seed")
            block[str(split)] = {}
            for m in metrics:
                stats = _mean_std([float(per_seed[m].get(sd, float("nan"))) for sd in seeds])
                block[str(split)][m] = {"mean": stats["mean"], "std": stats["std"], "values": stats["folds"]}
        out["methods"][label] = block
    return out


def write_seeds_report(exp_dir: str | Path, summaries: dict[int, dict[str, dict[str, Any]]],
                       plots: bool = True) -> dict[str, Any]:
    """Write an experiment repeated over seeds: ``seeds_results.csv`` (:func:`seeds_results`),
    ``seeds_summary.json`` (:func:`seeds_summary`), ``seeds_table.csv`` and ``seeds_table.md``
    (one row per method; for each split a "mean ± std" column per metric of
    :data:`SEED_METRICS`) and, with ``plots``, ``seeds_metrics.png`` (micro-F1 and AUC per
    method and split, bars of the mean with the std as error bars); return the summary."""
    exp_dir = Path(exp_dir)
    results = seeds_results(summaries)
    results.to_csv(exp_dir / "seeds_results.csv", index=False)
    summary = seeds_summary(results)
    (exp_dir / "seeds_summary.json").write_text(json.dumps(_finite(summary), indent=2))
    rows = []
    for label, block in summary["methods"].items():
        row: dict[str, Any] = {"method": label}
        for split in ("global_test", "local_test"):
            shown = [m for m in SEED_METRICS if m in block.get(split, {})]
            for m in shown:
                row[f"{split}: {m}"] = _pm(block[split][m])
            if shown:
                part = results[(results["method"] == label) & (results["split"] == split)]
                row[f"{split}: clients"] = seeds_clients_text(part, shown)
        rows.append(row)
    table = pd.DataFrame(rows)
    table.to_csv(exp_dir / "seeds_table.csv", index=False)
    n = len(summary["seeds"])
    lines = [f"final mean over clients, mean ± std over {n} seed(s) {summary['seeds']} (ddof=0); "
             "'clients': how many clients the means cover", "",
             "| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in table.itertuples(index=False)]
    (exp_dir / "seeds_table.md").write_text("\n".join(lines) + "\n")
    shown = [m for m in ("micro_f1", "auc") if m in results.columns]
    splits = [sp for sp in ("global_test", "local_test") if not results.empty and sp in set(results["split"])]
    if plots and shown and splits and summary["methods"]:
        plt = _plt()
        labels = list(summary["methods"])
        fig, axes = plt.subplots(1, len(shown), figsize=(1.6 + 1.3 * len(labels) * len(shown), 3.4), squeeze=False)
        width = 0.8 / len(splits)
        for ax, m in zip(axes[0], shown):
            for j, split in enumerate(splits):
                stats = [summary["methods"][lb].get(split, {}).get(m) for lb in labels]
                xs = [i + j * width for i, st in enumerate(stats) if st]
                ax.bar(xs, [st["mean"] for st in stats if st], width, yerr=[st["std"] for st in stats if st],
                       capsize=3, label=split)
            ax.set_xticks([i + width * (len(splits) - 1) / 2 for i in range(len(labels))])
            ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=7)
            ax.set_ylabel(f"{m} (mean over clients)")
            ax.grid(alpha=0.3, axis="y")
            ax.legend(fontsize=7)
        fig.suptitle(f"mean ± std over {n} seed(s)", fontsize=9)
        _tight_layout(fig)
        fig.savefig(exp_dir / "seeds_metrics.png", dpi=100)
        plt.close(fig)
    return summary


def print_result(result: dict[str, Any]) -> None:
    """Print each method's summary table (or, cross-validated, the CV table) and where the
    results are; a stopped run gets the command that continues it where its clients are
    (:func:`medfl.rundir.resume_command`)."""
    from medfl.rundir import resume_command

    base = Path(result["dir"])
    if "seed_list" in result:  # repeated over seeds: the table of mean ± std over seeds
        if result.get("seeds"):
            print(f"\n== {len(result['seed_list'])} seed(s) {result['seed_list']} ({base / 'seeds_table.md'})")
            print((base / "seeds_table.md").read_text())
        else:
            print(f"\n== stopped before every seed finished; continue with `{resume_command(base)}`")
        _print_separation(result)
        print(f"\nresults: {base}")
        return
    if "folds" in result:  # cross-validation: the table of mean ± std over folds
        if result.get("cv"):
            print(f"\n== {result['folds']}-fold cross-validation ({base / 'cv_table.md'})")
            print((base / "cv_table.md").read_text())
        else:
            print(f"\n== cross-validation stopped before every fold finished; continue with "
                  f"`{resume_command(base)}`")
        _print_separation(result)
        print(f"\nresults: {base}")
        return
    for label, summary in result["summaries"].items():
        run_dir = base if (base / "metrics.csv").is_file() else base / label
        if summary:
            print(f"\n== {label} ({run_dir})")
            print(format_table(summary_table(run_dir)))
            print(_privacy_line(summary))
            for line in _final_lines(summary):
                print(line)
        else:
            print(f"\n== {label}: stopped early; continue with `{resume_command(run_dir)}`")
    _print_separation(result)
    print(f"\nresults: {base}")


def _print_separation(result: dict[str, Any]) -> None:
    """The lines saying which methods of a finished experiment cannot be told apart
    (:func:`medfl.arm_report.final_separation`: a method whose curves equal another's in every
    round, every method at the metric's ceiling), under ``== methods that cannot be told apart``."""
    from medfl.arm_report import final_separation

    lines = final_separation(Path(result["dir"]), result.get("summaries") or {})
    if lines:
        print("\n== methods that cannot be told apart")
        for line in lines:
            print(line)


def _final_lines(summary: dict[str, Any]) -> list[str]:
    """Lines on the round a method is reported at when its best round over every round differs
    (the summary's ``selection`` note: :meth:`medfl.engine.runner.Run.selection`), its final
    models (``final_metrics.csv``: e.g. PFedCDP's refined student) and client groups
    (``groups.csv``): mean accuracy and AUC per split."""
    def scores(block: dict[str, Any]) -> str:
        parts = []
        for split, metrics in block.items():
            if not isinstance(metrics, dict):
                continue
            acc = (metrics.get("accuracy") or {}).get("mean") if isinstance(metrics.get("accuracy"), dict) \
                else metrics.get("accuracy")
            auc = (metrics.get("auc") or {}).get("mean") if isinstance(metrics.get("auc"), dict) else metrics.get("auc")
            if acc is not None:
                parts.append(f"{split} accuracy {float(acc):.3f}" + ("" if auc is None else f" AUC {float(auc):.3f}")
                             + _covers(metrics))
        return "; ".join(parts)

    lines = []
    note = (summary.get("selection") or {}).get("note")
    if note:   # the reported round is not the best over every round, or the mechanism never acted
        lines.append(f"selection (scored from round {summary['selection'].get('scored_from')}): {note}")
    finals = summary.get("final_models") or {}
    if finals:
        lines.append("final models (final_metrics.csv; mean over clients):")
        lines += [f"  {name}: {scores(block)}" for name, block in finals.items()]
    groups = summary.get("groups") or {}
    if groups:
        lines.append("groups (groups.csv; last round, mean over the group's clients):")
        lines += [f"  {g} ({len(b.get('clients', []))} clients): {scores(b.get('final', {}))}"
                  for g, b in groups.items()]
    return lines


def _covers(metrics: dict[str, Any]) -> str:
    """`` (3 of 4 clients)`` for a split's summary block whose accuracy (and AUC, where it
    covers fewer clients) says what it covers (summaries since issue 48), else ``""``."""
    acc, auc = metrics.get("accuracy"), metrics.get("auc")
    if not isinstance(acc, dict) or "clients" not in acc:
        return ""
    text = f" ({acc['clients']} of {acc['of']} clients"
    if isinstance(auc, dict) and "clients" in auc and auc["clients"] != acc["clients"]:
        text += f"; AUC {auc['clients']} of {auc['of']}"
    return text + ")"


def _epsilon_text(epsilon: Any) -> str:
    """An epsilon for the run's last line: none or infinite is no privacy, said in words."""
    if epsilon is None or (isinstance(epsilon, float) and math.isinf(epsilon)):
        return "none (not private: no noise bounds a sample's or client's contribution)"
    return f"{float(epsilon):.3g}"


def _privacy_line(summary: dict[str, Any]) -> str:
    """One line on what the run released: its epsilon (per DP mechanism, the worst client),
    whether its DP noise drowned the signal (:mod:`medfl.privacy.signal`'s warning) and its
    bytes per round."""
    privacy = summary.get("privacy") or {}
    mechs = privacy.get("mechanisms") or {}
    if mechs:
        eps = "; ".join(f"{name} epsilon {_epsilon_text(b.get('epsilon'))} (worst client {b['worst_client']}, "
                        f"{b['unit']}-level, delta {b['delta']:g}, {b['accountant']})" for name, b in mechs.items())
    else:
        eps = "no differential privacy"
    if privacy.get("sent_in_clear"):
        eps += "; NOT private: " + "; ".join(map(str, privacy["sent_in_clear"]))
    from medfl.privacy.signal import DROWNED

    for w in summary.get("warnings") or []:   # the run's own verdict on its noise, repeated at the end
        text = str(w.get("warning", ""))
        if text.startswith(DROWNED):
            eps += (f"; {text.split(':', 1)[0]} from round {w.get('round')}: what it learned is mostly noise "
                    "(more clients per round, a larger epsilon or fewer rounds: the warning in summary.json)")
    per_round = (summary.get("communication") or {}).get("per_round") or {}
    mb = ""
    if per_round:
        mb = (f"; {per_round.get('bytes_to_clients', 0) / 1e6:.3g} MB to and "
              f"{per_round.get('bytes_from_clients', 0) / 1e6:.3g} MB from the clients per round")
    return f"privacy: {eps}{mb}"
