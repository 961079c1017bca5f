"""Readable results of a run and of an experiment: a run's metrics and the round it is
reported at, its summary table, the comparison of an experiment's methods
(``comparison.csv``, ``comparison.png``) and what ``medfl run`` prints at the end
(:func:`print_result`). A run's figures are :mod:`medfl.report_plots`; the reports over folds
and seeds :mod:`medfl.report_repeats`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from medfl.arm_report import final_separation, load_metrics, run_json
from medfl.plotting import pyplot, round_axis, save_plot

__all__ = ["load_metrics", "final_round", "TABLE_METRICS", "shared_model_split", "clients_text", "summary_table",
           "format_table", "forgetting_table", "write_comparison", "print_result"]


def final_round(run_dir: str | Path, metrics: pd.DataFrame) -> int:
    """The round of ``metrics`` (the run's ``metrics.csv``) whose rows are the run's final
    metrics: the round of ``summary.json``'s ``final`` block (under early stopping, the best
    round, ``fl.early_stopping``) when the run has a summary, else the last round."""
    last = int(metrics["round"].max())
    final = run_json(run_dir, "summary.json").get("final")
    chosen = final.get("round") if isinstance(final, dict) else None
    return int(chosen) if isinstance(chosen, int) and chosen in set(metrics["round"].astype(int)) else last


#: The metrics of a run's summary table and per-client heatmaps, in column order (those it has).
TABLE_METRICS = ("accuracy", "precision", "recall", "specificity", "f1", "micro_f1", "auc")


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
    cols = [c for c in TABLE_METRICS if c in df.columns]
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
    fig, axes = pyplot().subplots(1, 2, figsize=(10, 3.6))
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
        round_axis(ax, ylabel=f"mean {m} over clients")
    axes[0].legend(fontsize=7)
    save_plot(fig, exp_dir / "comparison.png")
    return path


def print_result(result: dict[str, Any]) -> None:
    """Print each method's summary table (or, cross-validated, the CV table), which methods cannot
    be told apart (:func:`medfl.arm_report.final_separation`: a method whose curves equal another's
    in every round, every method at the metric's ceiling) and where the results are; a stopped run
    gets the command that continues it where its clients are (:func:`medfl.rundir.resume_command`)."""
    from medfl.rundir import resume_command

    base = Path(result["dir"])
    if "seed_list" in result:  # repeated over seeds: the table of mean ± std over seeds
        if result.get("seeds"):
            print(f"\n== {len(result['seed_list'])} seed(s) {result['seed_list']} ({base / 'seeds_table.md'})")
            print((base / "seeds_table.md").read_text())
        else:
            print(f"\n== stopped before every seed finished; continue with `{resume_command(base)}`")
    elif "folds" in result:  # cross-validation: the table of mean ± std over folds
        if result.get("cv"):
            print(f"\n== {result['folds']}-fold cross-validation ({base / 'cv_table.md'})")
            print((base / "cv_table.md").read_text())
        else:
            print(f"\n== cross-validation stopped before every fold finished; continue with "
                  f"`{resume_command(base)}`")
    else:
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
    separation = final_separation(base, result.get("summaries") or {})
    if separation:
        print("\n== methods that cannot be told apart", *separation, sep="\n")
    print(f"\nresults: {base}")


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
            acc, auc = (v.get("mean") if isinstance(v, dict) else v for v in (metrics.get("accuracy"), metrics.get("auc")))
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
