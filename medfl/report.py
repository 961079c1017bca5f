"""Readable results: summary tables, metric curves and per-client heatmaps (PNG)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["write_plots", "write_forgetting_plot", "write_comparison", "forgetting_table",
           "summary_table", "format_table", "load_metrics"]

PLOT_METRICS = ("accuracy", "auc", "f1")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


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


def write_forgetting_plot(run_dir: str | Path) -> Path | None:
    """Write ``plots/forgetting.png``: global and mean local accuracy per round with their
    recovery intervals shaded (the consistency measure), worst-client accuracy, backward
    transfer on previously sampled clients, and the negative-flip rates. Returns the path,
    or None when the run has no accuracy."""
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
    if per["worst_local_acc"].notna().any():
        ax.plot(per["round"], per["worst_local_acc"], ls="--", color="C3", label="worst client (local)")
    ax.set_title("accuracy; shaded: recovery intervals")
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
    fig.tight_layout()
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    path = out_dir / "forgetting.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write ``plots/curves.png`` (metric per round, mean and client range per split),
    ``plots/clients_<split>.png`` (final metrics per client as a heatmap) and
    ``plots/forgetting.png`` (:func:`write_forgetting_plot`). Returns the paths."""
    plt = _plt()
    run_dir = Path(run_dir)
    df = load_metrics(run_dir)
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    written = []
    metrics = [m for m in PLOT_METRICS if m in df.columns]
    splits = list(dict.fromkeys(df["split"]))
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.6), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for split in splits:
            g = df[df["split"] == split].groupby("round")[m]
            mean, lo, hi = g.mean(), g.min(), g.max()
            ax.plot(mean.index, mean.values, marker="o", label=f"{split} (mean)")
            ax.fill_between(mean.index, lo.values, hi.values, alpha=0.2)
        ax.set_xlabel("round")
        ax.set_ylabel(m)
        ax.set_title(f"{m}: mean and client range")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    path = out_dir / "curves.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    written.append(path)
    last = df[df["round"] == df["round"].max()]
    cols = [c for c in ("accuracy", "precision", "recall", "specificity", "f1", "micro_f1", "auc") if c in df.columns]
    for split in splits:
        t = last[last["split"] == split].set_index("client_id")[cols].astype(float)
        fig, ax = plt.subplots(figsize=(1.1 * len(cols) + 2, 0.45 * len(t) + 1.5))
        im = ax.imshow(t.values, vmin=0, vmax=1, cmap="viridis", aspect="auto")
        ax.set_xticks(range(len(cols)), cols, rotation=45, ha="right")
        ax.set_yticks(range(len(t)), [f"client {c}" for c in t.index])
        for i in range(t.shape[0]):
            for j in range(t.shape[1]):
                v = t.values[i, j]
                ax.text(j, i, "n/a" if np.isnan(v) else f"{v:.2f}", ha="center", va="center",
                        color="black" if (np.isnan(v) or v >= 0.6) else "white", fontsize=8)
        fig.colorbar(im, ax=ax)
        ax.set_title(f"{run_dir.name}: {split}, round {int(last['round'].max())}")
        fig.tight_layout()
        path = out_dir / f"clients_{split}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    forgetting = write_forgetting_plot(run_dir)
    if forgetting is not None:
        written.append(forgetting)
    return written


def summary_table(run_dir: str | Path) -> pd.DataFrame:
    """Per split, mean / std / worst client of each metric in the last round."""
    df = load_metrics(run_dir)
    last = df[df["round"] == df["round"].max()]
    cols = [c for c in ("accuracy", "precision", "recall", "specificity", "f1", "micro_f1", "auc") if c in df.columns]
    rows = []
    for split, g in last.groupby("split", sort=False):
        for m in cols:
            v = g[m].astype(float)
            rows.append({"split": split, "metric": m, "mean": v.mean(), "std": v.std(ddof=0),
                         "worst": v.min(), "worst_client": g.loc[v.idxmin(), "client_id"] if v.notna().any() else "",
                         "best": v.max()})
    return pd.DataFrame(rows)


def format_table(df: pd.DataFrame) -> str:
    """Plain-text table with floats to 4 decimals."""
    return df.to_string(index=False, float_format=lambda x: f"{x:.4f}")


def forgetting_table(summaries: dict[str, dict[str, Any]]) -> pd.DataFrame:
    """One row per method with the scalar measures of its summary's ``forgetting`` block,
    flattened as ``global_<name>``, ``local_<name>``, ``balance_<name>`` (the columns of
    the FedKPer paper's Table 1 are ``global_acc_mean``, ``global_bwt_final``,
    ``global_consistency``, ``local_acc_mean``, ``local_worst_client_acc_mean``,
    ``local_consistency`` and ``balance_mean``)."""
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


def write_comparison(exp_dir: str | Path, summaries: dict[str, dict[str, Any]]) -> Path:
    """Write ``comparison.csv`` (one row per method and split, mean/std/worst of each metric),
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
            rows.append(row)
    path = exp_dir / "comparison.csv"
    pd.DataFrame(rows).to_csv(path, index=False)
    if any(s.get("forgetting") for s in summaries.values()):
        forgetting_table(summaries).to_csv(exp_dir / "comparison_forgetting.csv", index=False)
    (exp_dir / "summaries.json").write_text(json.dumps(summaries, indent=2, default=str))
    if len(summaries) < 2:
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
    for ax, m in zip(axes, ("accuracy", "auc")):
        ax.set_xlabel("round")
        ax.set_ylabel(f"mean {m} over clients")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(exp_dir / "comparison.png", dpi=100)
    plt.close(fig)
    return path
