"""Experiment arms reported at a chosen round, never at a single final round.

A metric of one federated round swings by tens of points between rounds on small data (a
FedAvgM arm on the fixtures: micro-F1 60.0, 17.6 and 35.2 in rounds 13-15), so a table of
final rounds mostly reports noise. This module reports each arm (a method entry, over seeds)

* at its **best validation round** (``select="best_val"``): the round an early-stopped run
  chose (``summary.json``'s ``early_stopping.best_round``), otherwise the evaluated round
  whose mean over clients of ``metric`` on ``selection_split`` (``local_val``) is highest
  (ties: the earliest); every split is then read at that round, so no test score chooses it;
* or as the **mean of its last rounds** (``select="last_mean"``): each split's per-round mean
  over clients, averaged over the last ``last`` evaluated rounds;

with the mean and population std over seeds and the per-round curves beside the table
(:func:`write_arm_report`: ``arms_table.md``/``.csv``, ``arms_curves.csv``, ``arms_curves.png``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

__all__ = ["SELECTIONS", "round_curves", "arm_scores", "arm_table", "write_arm_report"]

#: How an arm's rounds are chosen: its best validation round, or the mean of its last rounds.
SELECTIONS = ("best_val", "last_mean")

_KEYS = ("round", "client_id", "client_name", "split", "reported_by", "n")


def round_curves(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per evaluated round and split, the mean over clients of every metric of a run's
    ``metrics.csv`` (NaN-aware), with ``clients`` the number of client rows.

    Returns:
        Columns ``round, split, clients`` and one per metric, sorted by split and round.
    """
    cols = [c for c in metrics.columns if c not in _KEYS and pd.api.types.is_numeric_dtype(metrics[c])]
    grouped = metrics.groupby(["split", "round"], sort=True)
    out = grouped[cols].mean().reset_index()
    out.insert(2, "clients", grouped.size().to_numpy())
    return out[["round", "split", "clients", *cols]]


def _read_metrics(run_dir: Path) -> pd.DataFrame:
    path = run_dir / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.csv; is {run_dir} a medfl run directory with an evaluated round?")
    return pd.read_csv(path, dtype={"client_id": str, "client_name": str}, keep_default_na=False,
                       na_values=["", "nan", "NaN"])


def _engine_best_round(run_dir: Path) -> int | None:
    """The best round an early-stopped run recorded in its ``summary.json`` (``None``: none)."""
    path = run_dir / "summary.json"
    try:
        block = json.loads(path.read_text()).get("early_stopping") if path.is_file() else None
    except (OSError, ValueError):
        return None
    best = block.get("best_round") if isinstance(block, dict) else None
    return int(best) if best is not None else None


def arm_scores(run_dir: str | Path, *, select: str = "best_val", metric: str = "micro_f1",
               selection_split: str = "local_val", last: int = 5) -> dict[str, Any]:
    """One run's scores at the rounds ``select`` chooses (see the module docstring).

    Args:
        run_dir: a run directory (``metrics.csv``, and ``summary.json`` when finished).
        select: ``"best_val"`` or ``"last_mean"``.
        metric: the metric that chooses the best round (a column of ``metrics.csv``).
        selection_split: the split (as named in ``metrics.csv``) it is read on.
        last: how many of the last evaluated rounds ``"last_mean"`` averages.

    Returns:
        ``{"select", "rounds": the rounds used, "selected_by": "early_stopping" |
        "<split>/<metric>" | "last <k> rounds", "value": the selection metric there (best_val),
        "scores": {split: {metric: value}}}``.

    Raises:
        ValueError: an unknown ``select``, ``last`` below 1, or no ``selection_split`` rows
            with ``metric`` to choose a round from (the message names what the run has).
    """
    if select not in SELECTIONS:
        raise ValueError(f"select must be one of {', '.join(SELECTIONS)}, got {select!r}")
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise ValueError(f"last must be a positive integer, got {last!r}")
    run_dir = Path(run_dir)
    curves = round_curves(_read_metrics(run_dir))
    metrics = [c for c in curves.columns if c not in ("round", "split", "clients")]
    rounds = sorted(curves["round"].unique().tolist())
    if select == "last_mean":
        used = rounds[-last:]
        part = curves[curves["round"].isin(used)]
        scores = {str(sp): {m: float(np.nanmean(g[m])) if g[m].notna().any() else float("nan") for m in metrics}
                  for sp, g in part.groupby("split", sort=False)}
        return {"select": select, "rounds": used, "selected_by": f"last {len(used)} rounds", "value": None,
                "scores": scores}
    best = _engine_best_round(run_dir)
    val = curves[curves["split"] == selection_split]
    by = "early_stopping"
    if best is None:
        if metric not in curves.columns or val.empty or not val[metric].notna().any():
            splits = sorted(curves["split"].unique().tolist())
            raise ValueError(f"{run_dir}: no {selection_split!r} rows with {metric!r} to choose the best round from "
                             f"(splits: {', '.join(splits)}; metrics: {', '.join(metrics)}); evaluate a validation "
                             "split (fl.eval_splits with 'val') or report select='last_mean'")
        finite = val[val[metric].notna()]
        best = int(finite.loc[finite[metric].idxmax(), "round"])   # idxmax: the first (earliest) maximum
        by = f"{selection_split}/{metric}"
    at = curves[curves["round"] == best]
    value = val.loc[val["round"] == best, metric] if metric in val.columns else pd.Series(dtype=float)
    scores = {str(r["split"]): {m: float(r[m]) for m in metrics} for _, r in at.iterrows()}
    return {"select": select, "rounds": [best], "selected_by": by,
            "value": float(value.iloc[0]) if len(value) else None, "scores": scores}


def _stats(values: list[float]) -> tuple[float, float]:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    return (float(v.mean()), float(v.std(ddof=0))) if len(v) else (float("nan"), float("nan"))


def arm_table(runs: Mapping[str, Sequence[str | Path]], *, select: str = "best_val", metric: str = "micro_f1",
              selection_split: str = "local_val", last: int = 5,
              splits: Sequence[str] = ("global_test", "local_test"),
              metrics: Sequence[str] = ("micro_f1", "accuracy", "auc")) -> pd.DataFrame:
    """One row per arm: for each split and metric its mean and population std over the arm's
    runs (one per seed) at the rounds :func:`arm_scores` chooses, the per-seed values and the
    rounds used (``runs``: ``{arm label: [run dir per seed]}``)."""
    rows = []
    for label, dirs in runs.items():
        scored = [arm_scores(d, select=select, metric=metric, selection_split=selection_split, last=last)
                  for d in dirs]
        row: dict[str, Any] = {"arm": label, "seeds": len(scored),
                               "rounds": ";".join(",".join(str(r) for r in s["rounds"]) for s in scored)}
        for split in splits:
            for m in metrics:
                values = [s["scores"].get(split, {}).get(m, float("nan")) for s in scored]
                mean, std = _stats(values)
                row[f"{split}/{m}"] = mean
                row[f"{split}/{m} std"] = std
                row[f"{split}/{m} values"] = ";".join("nan" if not np.isfinite(v) else f"{v:.4f}" for v in values)
        rows.append(row)
    return pd.DataFrame(rows)


def _markdown(table: pd.DataFrame, splits: Sequence[str], metrics: Sequence[str], header: str) -> str:
    cols = [f"{sp}/{m}" for sp in splits for m in metrics if f"{sp}/{m}" in table.columns]
    lines = [header, "", "| arm | seeds | rounds | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    for _, r in table.iterrows():
        cells = ["n/a" if not np.isfinite(r[c]) else f"{r[c]:.3f} ± {r[c + ' std']:.3f}" for c in cols]
        lines.append(f"| {r['arm']} | {r['seeds']} | {r['rounds']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_arm_report(out_dir: str | Path, runs: Mapping[str, Sequence[str | Path]], *, select: str = "best_val",
                     metric: str = "micro_f1", selection_split: str = "local_val", last: int = 5,
                     splits: Sequence[str] = ("global_test", "local_test"),
                     metrics: Sequence[str] = ("micro_f1", "accuracy", "auc"), title: str = "",
                     plots: bool = True) -> pd.DataFrame:
    """Write an experiment's arms: ``arms_table.csv`` and ``arms_table.md`` (:func:`arm_table`,
    "mean ± std" over seeds, the rounds each seed was read at), ``arms_curves.csv`` (every
    arm's, seed's, round's and split's mean over clients) and, with ``plots``,
    ``arms_curves.png`` (``metric`` per round on each of ``splits`` and ``selection_split``:
    each arm's mean over seeds with a ±std band, its selected rounds marked). Returns the table.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = arm_table(runs, select=select, metric=metric, selection_split=selection_split, last=last,
                      splits=splits, metrics=metrics)
    table.to_csv(out / "arms_table.csv", index=False)
    how = (f"best validation round ({selection_split}/{metric}; an early-stopped run's own best round)"
           if select == "best_val" else f"mean of the last {last} evaluated rounds")
    header = (f"{title + ': ' if title else ''}each arm at its {how}; mean over clients, mean ± population std "
              "over seeds; per-round curves in arms_curves.csv/.png")
    (out / "arms_table.md").write_text(_markdown(table, splits, metrics, header))
    frames = []
    for label, dirs in runs.items():
        for i, d in enumerate(dirs):
            c = round_curves(_read_metrics(Path(d)))
            c.insert(0, "run", str(d))
            c.insert(0, "seed_index", i)
            c.insert(0, "arm", label)
            frames.append(c)
    curves = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    curves.to_csv(out / "arms_curves.csv", index=False)
    if plots and not curves.empty and metric in curves.columns:
        from medfl.report import _plt, _tight_layout

        plt = _plt()
        shown = [sp for sp in (*splits, selection_split) if sp in set(curves["split"])]
        shown = list(dict.fromkeys(shown))
        fig, axes = plt.subplots(1, max(1, len(shown)), figsize=(4.2 * max(1, len(shown)), 3.4), squeeze=False)
        for ax, split in zip(axes[0], shown):
            for label in runs:
                part = curves[(curves["arm"] == label) & (curves["split"] == split)]
                per = part.groupby("round")[metric].agg(["mean", lambda s: float(np.std(s, ddof=0))])
                per.columns = ["mean", "std"]
                line = ax.plot(per.index, per["mean"], label=label, lw=1.2)[0]
                ax.fill_between(per.index, per["mean"] - per["std"], per["mean"] + per["std"], alpha=0.15,
                                color=line.get_color())
                row = table[table["arm"] == label]
                for seed_rounds in (str(row["rounds"].iloc[0]).split(";") if len(row) and select == "best_val" else []):
                    for r in filter(None, seed_rounds.split(",")):
                        if int(r) in per.index:
                            ax.plot([int(r)], [per.loc[int(r), "mean"]], "o", ms=3, color=line.get_color())
            ax.set_title(split, fontsize=9)
            ax.set_xlabel("round")
            ax.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
            ax.set_ylabel(f"{metric} (mean over clients)")
            ax.grid(alpha=0.3)
        axes[0][0].legend(fontsize=7)
        fig.suptitle(title or "per-round curves, mean ± std over seeds", fontsize=9)
        _tight_layout(fig)
        fig.savefig(out / "arms_curves.png", dpi=100)
        plt.close(fig)
    return table
