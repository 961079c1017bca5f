"""Readable results: summary tables, metric curves and per-client heatmaps (PNG)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

__all__ = ["write_plots", "write_comparison", "summary_table", "format_table", "load_metrics"]

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


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write ``plots/curves.png`` (metric per round, mean and client range per split) and
    ``plots/clients_<split>.png`` (final metrics per client as a heatmap). Returns the paths."""
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


def write_comparison(exp_dir: str | Path, summaries: dict[str, dict[str, Any]]) -> Path:
    """Write ``comparison.csv`` (one row per method and split, mean/std/worst of each metric),
    ``summaries.json`` and, when there are two or more methods, ``comparison.png`` (accuracy
    and AUC per round for every method; a single method's curves are its ``curves.png``)."""
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
