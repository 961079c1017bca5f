"""The reports of an experiment repeated over folds (cross-validation: ``cv_*``, the layout of
the FedSKD paper's Tables II/III) or over seeds (``seeds_*``): every run's final metrics, their
mean ± population std over the repeats, the tables (CSV and Markdown) and a bar plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from medfl.arm_report import mean_std
from medfl.plotting import pyplot, save_plot
from medfl.report import final_round

__all__ = ["CV_SPLITS", "cv_results", "cv_summary", "cv_table", "write_cv_report", "SEED_METRICS", "seeds_results",
           "seeds_clients_text", "seeds_summary", "write_seeds_report"]


#: metrics.csv split -> the heading the FedSKD paper's Tables II/III give it.
CV_SPLITS = {"local_test": "Local Test", "cross_test": "Global Test", "global_test": "Held-out Test"}


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


def _write_table(table: pd.DataFrame, stem: Path, header: str) -> None:
    """Write ``table`` as ``<stem>.csv`` and as the Markdown ``<stem>.md`` under ``header``."""
    table.to_csv(stem.with_suffix(".csv"), index=False)
    lines = [header, "", "| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(str(v) for v in r) + " |" for r in table.itertuples(index=False)]
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")


def _bars(ax: Any, labels: list[str], groups: list[tuple[str, list[dict[str, Any] | None]]], ylabel: str,
          **ticks: Any) -> None:
    """Grouped bars on ``ax``: per ``(name, stats)`` of ``groups`` (a split), one bar per label
    of ``labels`` (a method) at its ``stats[i]["mean"]`` with ``"std"`` as the error bar (none
    where ``stats[i]`` is missing); ``ticks``: how the labels are written."""
    width = 0.8 / len(groups)
    for j, (name, stats) in enumerate(groups):
        xs = [i + j * width for i, st in enumerate(stats) if st]
        ax.bar(xs, [st["mean"] for st in stats if st], width, yerr=[st["std"] for st in stats if st],
               capsize=3, label=name)
    ax.set_xticks([i + width * (len(groups) - 1) / 2 for i in range(len(labels))])
    ax.set_xticklabels(labels, **ticks)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)


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
            value = {(str(c), int(k)): float(v) for c, k, v in zip(part["client_id"], part["fold"], part[metric])}
            clients = {cid: {"name": names[cid], **mean_std([value.get((cid, k), float("nan")) for k in range(folds)])}
                       for cid in ids}
            means = [float(np.nanmean(per_fold[k][metric].astype(float)))
                     if per_fold[k][metric].notna().any() else float("nan") for k in range(folds)]
            # what stands behind each fold's mean: the clients with a value of the clients evaluated
            support = {"with_value": [int(per_fold[k][metric].notna().sum()) for k in range(folds)],
                       "evaluated": [int(len(per_fold[k])) for k in range(folds)]}
            block[split] = {"clients": clients, "overall": {**mean_std(means), "clients": support}}
        fair = [fairness_report(res[res["fold"] == k]) for k in range(folds)]
        if any(fair):
            block["fairness"] = {key: mean_std([f.get(key, float("nan")) if f else float("nan") for f in fair])
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
    _write_table(table, exp_dir / "cv_table", f"{metric} over {folds} folds, mean ± std (std over folds, ddof=0)")
    splits = [s for s in CV_SPLITS if any(s in b for b in summary["methods"].values())]
    if plots and splits and summary["methods"]:
        fig, ax = pyplot().subplots(figsize=(1.6 + 1.4 * len(labels), 3.4))
        methods = summary["methods"]
        _bars(ax, list(methods), [(CV_SPLITS[sp], [methods[lb].get(sp, {}).get("overall") for lb in methods])
                                  for sp in splits], f"{metric} (mean over clients)")
        ax.set_title(f"{folds}-fold cross-validation, mean ± std over folds", fontsize=9)
        save_plot(fig, exp_dir / f"cv_{metric}.png")
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
                stats = mean_std([float(per_seed[m].get(sd, float("nan"))) for sd in seeds])
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
    n = len(summary["seeds"])
    _write_table(table, exp_dir / "seeds_table", f"final mean over clients, mean ± std over {n} seed(s) "
                 f"{summary['seeds']} (ddof=0); 'clients': how many clients the means cover")
    shown = [m for m in ("micro_f1", "auc") if m in results.columns]
    splits = [sp for sp in ("global_test", "local_test") if not results.empty and sp in set(results["split"])]
    if plots and shown and splits and summary["methods"]:
        labels = list(summary["methods"])
        fig, axes = pyplot().subplots(1, len(shown), figsize=(1.6 + 1.3 * len(labels) * len(shown), 3.4),
                                      squeeze=False)
        for ax, m in zip(axes[0], shown):
            _bars(ax, labels, [(sp, [summary["methods"][lb].get(sp, {}).get(m) for lb in labels]) for sp in splits],
                  f"{m} (mean over clients)", rotation=30, ha="right", fontsize=7)
        fig.suptitle(f"mean ± std over {n} seed(s)", fontsize=9)
        save_plot(fig, exp_dir / "seeds_metrics.png")
    return summary
