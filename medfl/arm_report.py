"""Experiment arms reported at a chosen round, never at a single final round.

A metric of one federated round swings by tens of points between rounds on small data (a
FedAvgM arm on the fixtures: micro-F1 60.0, 17.6 and 35.2 in rounds 13-15), so a table of
final rounds mostly reports noise. This module reports each arm (a method entry, over seeds)

* at its **best validation round** (``select="best_val"``): the round an early-stopped run
  chose (``summary.json``'s ``early_stopping.best_round``), otherwise the evaluated round
  whose mean over clients of ``metric`` on ``selection_split`` (``local_val``) is highest
  (ties: the earliest); every split is then read at that round, so no test score chooses it.
  Only rounds the method's own mechanism shaped count (:meth:`medfl.method.Method.scored_from`:
  FedFed from its first round trained with the shared set; default every round), as the run
  recorded it (``summary.json``'s ``selection.scored_from``, or, for an unfinished run,
  ``mechanisms.csv``'s last ``selection``/``scored_from`` value); where the best round over
  every round differs, the table names it with a flag ("3 (overall best 2, before the
  mechanism acts)");
* or as the **mean of its last rounds** (``select="last_mean"``): each split's per-round mean
  over clients, averaged over the last ``last`` evaluated rounds;

with the mean and population std over seeds, how many seeds and clients stand behind each mean
(clients that reported the metric, not rows), and the per-round curves beside the table
(:func:`write_arm_report`: ``arms_table.md``/``.csv``, ``arms_curves.csv``, ``arms_curves.png``).
Arms that cannot be told apart are said to be so (:func:`separation_notes`): an arm whose
evaluated curve equals an earlier arm's in every round ("identical to fedavg in every round"),
and a table where every arm is at the metric's ceiling ("every arm at 1.000: this setting cannot
separate the methods").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import pandas as pd

from medfl.plotting import pyplot, round_axis, save_plot

__all__ = ["SELECTIONS", "IDENTICAL_TOL", "round_curves", "reporting_clients", "load_metrics", "run_json",
           "scored_from", "arm_scores", "mean_std", "arm_table", "identical_arms", "ceiling_note", "separation_notes",
           "final_separation", "write_arm_report"]

#: How an arm's rounds are chosen: its best validation round, or the mean of its last rounds.
SELECTIONS = ("best_val", "last_mean")

_KEYS = ("round", "client_id", "client_name", "split", "reported_by", "n")

#: Two curves are "identical" when every per-round mean differs by at most this (absolute):
#: far below one sample's share of a score, far above float noise of the same model evaluated twice.
IDENTICAL_TOL = 1e-6


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


def reporting_clients(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per evaluated round and split, how many clients reported each metric of a run's
    ``metrics.csv`` (a number, not NaN: a client with one test image has no AUC), the support
    of :func:`round_curves`' means.

    Returns:
        Columns ``round, split`` and one count per metric.
    """
    cols = [c for c in metrics.columns if c not in _KEYS and pd.api.types.is_numeric_dtype(metrics[c])]
    return metrics.groupby(["split", "round"], sort=True)[cols].count().reset_index()[["round", "split", *cols]]


def load_metrics(run_dir: str | Path) -> pd.DataFrame:
    """Read a run's ``metrics.csv``.

    Raises:
        FileNotFoundError: the directory has no metrics yet.
    """
    path = Path(run_dir) / "metrics.csv"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no metrics.csv; is {run_dir} a medfl run directory with an evaluated round?")
    return pd.read_csv(path, dtype={"client_id": str, "client_name": str}, keep_default_na=False,
                       na_values=["", "nan", "NaN"])


def run_json(run_dir: str | Path, name: str) -> dict[str, Any]:
    """A run's JSON file ``name`` (``summary.json``, ``status.json``) as a dict: empty while it
    is missing (an unfinished run's summary) or unreadable."""
    path = Path(run_dir) / name
    try:
        out = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        return {}
    return out if isinstance(out, dict) else {}


def scored_from(run_dir: str | Path) -> tuple[int | None, str]:
    """The first round a run's method's own mechanism shaped (``None``: none yet) and where
    that was read: ``summary.json``'s ``selection`` block, the last ``selection``/
    ``scored_from`` line of ``mechanisms.csv`` (an unfinished run of a method that declares
    it; an empty value is "not yet"), or ``"default"`` (round 1: the method does not declare
    it, or the run predates it)."""
    run_dir = Path(run_dir)
    block = run_json(run_dir, "summary.json").get("selection")
    if isinstance(block, dict) and "scored_from" in block:
        value = block["scored_from"]
        return (None if value is None else int(value)), "summary.json"
    path = run_dir / "mechanisms.csv"
    if path.is_file():
        mech = pd.read_csv(path, keep_default_na=False, na_values=["", "nan", "NaN"])
        rows = mech[(mech.get("mechanism") == "selection") & (mech.get("name") == "scored_from")] \
            if {"mechanism", "name"} <= set(mech.columns) else mech.iloc[0:0]
        if len(rows):
            value = rows.sort_values("round", kind="stable")["value"].iloc[-1]
            return (None if pd.isna(value) else int(value)), "mechanisms.csv"
    return 1, "default"


def _earliest_max(val: pd.DataFrame, metric: str) -> int | None:
    """The earliest round of ``val`` (rows of one split) with the highest finite ``metric``."""
    finite = val[val[metric].notna()] if metric in val.columns else val.iloc[0:0]
    return int(finite.loc[finite[metric].idxmax(), "round"]) if len(finite) else None   # idxmax: the first maximum


def _flag(best: int, overall: int | None, first: int | None, eligible: bool) -> str:
    """The words beside a chosen round: why it is not the best round over every round."""
    if not eligible:
        return ("the method's mechanism acted in no evaluated round" if first is None else
                f"the method's mechanism acts from round {first}, after every evaluated round")
    if overall is None or overall == best:
        return ""
    return f"overall best {overall}" + (", before the mechanism acts" if first is not None and overall < first else "")


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
        "scores": {split: {metric: value}}, "clients": {split: {metric: [clients that reported
        it, per round used]}}, "scored_from": the first round the method's mechanism shaped
        (:func:`scored_from`; best_val chooses among the rounds from it on), "overall_best":
        the best round over every round where it differs (else ``None``), "flag": that in
        words ("overall best 2, before the mechanism acts"; "" when there is nothing to say)}``.

    Raises:
        ValueError: an unknown ``select``, ``last`` below 1, or no ``selection_split`` rows
            with ``metric`` to choose a round from (the message names what the run has).
    """
    if select not in SELECTIONS:
        raise ValueError(f"select must be one of {', '.join(SELECTIONS)}, got {select!r}")
    if isinstance(last, bool) or not isinstance(last, int) or last < 1:
        raise ValueError(f"last must be a positive integer, got {last!r}")
    run_dir = Path(run_dir)
    frame = load_metrics(run_dir)
    curves, counts = round_curves(frame), reporting_clients(frame)
    metrics = [c for c in curves.columns if c not in ("round", "split", "clients")]
    rounds = sorted(curves["round"].unique().tolist())
    first, _ = scored_from(run_dir)

    def support(used: list[int]) -> dict[str, dict[str, list[int]]]:
        part = counts[counts["round"].isin(used)].sort_values("round")
        return {str(sp): {m: [int(v) for v in g[m]] for m in metrics} for sp, g in part.groupby("split", sort=False)}

    if select == "last_mean":
        used = rounds[-last:]
        part = curves[curves["round"].isin(used)]
        scores = {str(sp): {m: float(np.nanmean(g[m])) if g[m].notna().any() else float("nan") for m in metrics}
                  for sp, g in part.groupby("split", sort=False)}
        return {"select": select, "rounds": used, "selected_by": f"last {len(used)} rounds", "value": None,
                "scores": scores, "clients": support(used), "scored_from": first, "overall_best": None, "flag": ""}
    # the best round an early-stopped run recorded and, where it differs, its best round over every round
    early = run_json(run_dir, "summary.json").get("early_stopping")
    early = early if isinstance(early, dict) and early.get("best_round") is not None else {}
    best, overall = (None if early.get(k) is None else int(early[k]) for k in ("best_round", "overall_best_round"))
    val = curves[curves["split"] == selection_split]
    by, eligible = "early_stopping", True
    if best is None:
        overall = _earliest_max(val, metric) if metric in curves.columns else None
        if overall is None:
            splits = sorted(curves["split"].unique().tolist())
            raise ValueError(f"{run_dir}: no {selection_split!r} rows with {metric!r} to choose the best round from "
                             f"(splits: {', '.join(splits)}; metrics: {', '.join(metrics)}); evaluate a validation "
                             "split (fl.eval_splits with 'val') or report select='last_mean'")
        best = None if first is None else _earliest_max(val[val["round"] >= first], metric)
        eligible = best is not None
        best = overall if best is None else best
        by = f"{selection_split}/{metric}"
    at = curves[curves["round"] == best]
    value = val.loc[val["round"] == best, metric] if metric in val.columns else pd.Series(dtype=float)
    scores = {str(r["split"]): {m: float(r[m]) for m in metrics} for _, r in at.iterrows()}
    flag = _flag(best, overall, first, eligible)
    return {"select": select, "rounds": [best], "selected_by": by,
            "value": float(value.iloc[0]) if len(value) else None, "scores": scores, "clients": support([best]),
            "scored_from": first, "overall_best": overall if overall not in (None, best) else None, "flag": flag}


def mean_std(values: list[float]) -> dict[str, Any]:
    """Mean and population std (ddof=0) of the finite values, with the values themselves."""
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    return {"mean": float(v.mean()) if len(v) else float("nan"),
            "std": float(v.std(ddof=0)) if len(v) else float("nan"),
            "folds": [None if x is None or not np.isfinite(x) else float(x) for x in values]}


def arm_table(runs: Mapping[str, Sequence[str | Path]], *, select: str = "best_val", metric: str = "micro_f1",
              selection_split: str = "local_val", last: int = 5,
              splits: Sequence[str] = ("global_test", "local_test"),
              metrics: Sequence[str] = ("micro_f1", "accuracy", "auc")) -> pd.DataFrame:
    """One row per arm: for each split and metric its mean and population std over the arm's
    runs (one per seed) at the rounds :func:`arm_scores` chooses, the per-seed values, how many
    seeds have a value (``<split>/<metric> seeds``) and how many clients reported it in each
    seed (``<split>/<metric> clients``: per seed, ``;``-separated; per round used,
    ``,``-separated), the rounds used, each seed's ``scored_from``, ``overall_best`` round and
    ``round_flags`` (:func:`arm_scores`), and ``indistinguishable``: why the arm cannot be told
    apart from the others (:func:`separation_notes`; "" when it can). ``runs``: ``{arm label:
    [run dir per seed]}``."""
    rows = []
    for label, dirs in runs.items():
        scored = [arm_scores(d, select=select, metric=metric, selection_split=selection_split, last=last)
                  for d in dirs]
        row: dict[str, Any] = {"arm": label, "seeds": len(scored),
                               "rounds": ";".join(",".join(str(r) for r in s["rounds"]) for s in scored),
                               "scored_from": ";".join("none" if s["scored_from"] is None else str(s["scored_from"])
                                                       for s in scored),
                               "overall_best": ";".join("" if s["overall_best"] is None else str(s["overall_best"])
                                                        for s in scored),
                               "round_flags": ";".join(s["flag"] for s in scored)}
        for split in splits:
            for m in metrics:
                values = [s["scores"].get(split, {}).get(m, float("nan")) for s in scored]
                stats = mean_std(values)
                row[f"{split}/{m}"], row[f"{split}/{m} std"] = stats["mean"], stats["std"]
                row[f"{split}/{m} values"] = ";".join("nan" if not np.isfinite(v) else f"{v:.4f}" for v in values)
                row[f"{split}/{m} seeds"] = int(sum(np.isfinite(v) for v in values))
                row[f"{split}/{m} clients"] = ";".join(
                    ",".join(str(c) for c in s["clients"].get(split, {}).get(m, [])) for s in scored)
        rows.append(row)
    table = pd.DataFrame(rows)
    if len(table):
        notes = separation_notes(runs, table, metric=metric, selection_split=selection_split, splits=splits,
                                 metrics=metrics)
        table["indistinguishable"] = [notes["arms"].get(label, "") for label in table["arm"]]
        table.attrs["separation"] = notes["lines"]
    return table


def _curves_of(run_dir: str | Path, splits: Sequence[str], metrics: Sequence[str]) -> pd.DataFrame:
    """A run's per-round means over clients (:func:`round_curves`) on ``splits``, indexed by
    split and round, with the ``metrics`` it has."""
    c = round_curves(load_metrics(run_dir))
    c = c[c["split"].isin(list(splits))]
    return c.set_index(["split", "round"])[[m for m in metrics if m in c.columns]].sort_index()


def _same_curve(a: pd.DataFrame, b: pd.DataFrame, tol: float) -> int:
    """How many rounds two runs' curves share when they agree in every shared round, split and
    metric (within ``tol``); 0 when they differ anywhere, or share no round or metric."""
    common, cols = a.index.intersection(b.index), [m for m in a.columns if m in b.columns]
    if not len(common) or not cols or set(a.index.get_level_values(0)) != set(b.index.get_level_values(0)):
        return 0
    x, y = a.loc[common, cols].to_numpy(dtype=float), b.loc[common, cols].to_numpy(dtype=float)
    if not np.array_equal(np.isnan(x), np.isnan(y)) or not np.allclose(x, y, rtol=0.0, atol=tol, equal_nan=True):
        return 0
    return len(set(common.get_level_values(1)))


def identical_arms(runs: Mapping[str, Sequence[str | Path]], *, splits: Sequence[str],
                   metrics: Sequence[str], tol: float = IDENTICAL_TOL) -> dict[str, tuple[str, int]]:
    """Arms whose evaluated curve equals an earlier arm's: for every seed (the ``i``-th run of
    each), every round both evaluated, every split of ``splits`` and metric of ``metrics``,
    the means over clients differ by at most ``tol``. Returns ``{arm: (the earlier arm, the
    fewest rounds compared in a seed)}``; arms with different numbers of seeds never match."""
    curves = {label: [_curves_of(d, splits, metrics) for d in dirs] for label, dirs in runs.items()}
    out: dict[str, tuple[str, int]] = {}
    labels = list(runs)
    for i, label in enumerate(labels):
        for other in labels[:i]:
            if other in out or len(curves[other]) != len(curves[label]) or not curves[label]:
                continue
            shared = [_same_curve(a, b, tol) for a, b in zip(curves[other], curves[label])]
            if min(shared) > 0:
                out[label] = (other, min(shared))
                break
    return out


def ceiling_note(table: pd.DataFrame, splits: Sequence[str], metrics: Sequence[str],
                 tol: float = IDENTICAL_TOL, where: str = "in every seed") -> str:
    """"every arm at 1.000 on global_test/micro_f1 in every seed: this setting cannot separate
    the methods" when two or more arms (rows of ``table``, with ``<split>/<metric> values``
    columns: ``;``-separated values per seed) have every value of a split and metric at the
    metric's ceiling (1 for every classification metric,
    :data:`medfl.metrics.classification.METRICS`); "" otherwise."""
    from medfl.metrics.classification import METRICS

    if len(table) < 2:
        return ""
    full = []
    for split in splits:
        for m in metrics:
            col = f"{split}/{m} values"
            if m not in METRICS or col not in table.columns:
                continue
            values = [float(v) for cell in table[col] for v in str(cell).split(";")]
            if values and all(np.isfinite(v) and v >= 1.0 - tol for v in values):
                full.append(f"{split}/{m}")
    if not full:
        return ""
    return f"every arm at 1.000 on {', '.join(full)} {where}: this setting cannot separate the methods"


def separation_notes(runs: Mapping[str, Sequence[str | Path]], table: pd.DataFrame, *, metric: str,
                     selection_split: str, splits: Sequence[str], metrics: Sequence[str],
                     tol: float = IDENTICAL_TOL, where: str = "in every seed") -> dict[str, Any]:
    """Which arms of a table cannot be told apart, in words: ``{"arms": {arm: note},
    "lines": [note lines for under the table]}``. An arm whose curve (:func:`identical_arms` on
    ``selection_split`` and ``splits``, ``metric`` and ``metrics``) equals an earlier arm's:
    "identical to fedavg in every round (20 evaluated rounds, 2 seeds)"; every arm at the
    metrics' ceiling (:func:`ceiling_note`, ``where``): that note, for every arm."""
    shown = list(dict.fromkeys([selection_split, *splits]))
    names = list(dict.fromkeys([metric, *metrics]))
    arms: dict[str, str] = {}
    lines = []
    for label, (other, n) in identical_arms(runs, splits=shown, metrics=names, tol=tol).items():
        seeds = len(runs[label])
        arms[label] = (f"identical to {other} in every round ({n} evaluated rounds, {seeds} "
                       f"seed{'s' if seeds != 1 else ''}; {', '.join(shown)}; within {tol:g})")
        lines.append(f"{label}: {arms[label]}")
    ceiling = ceiling_note(table, splits, metrics, tol, where)
    if ceiling:
        lines.append(ceiling)
        arms = {label: "; ".join(filter(None, [arms.get(label, ""), ceiling])) for label in table["arm"]}
    return {"arms": arms, "lines": lines}


def final_separation(exp_dir: str | Path, summaries: Mapping[str, Any],
                     splits: Sequence[str] = ("local_val", "global_test", "local_test"),
                     metrics: Sequence[str] = ("accuracy", "micro_f1", "auc"), tol: float = IDENTICAL_TOL) -> list[str]:
    """The last lines of an experiment of several methods (:func:`medfl.report.print_result`):
    a method whose per-round curves equal an earlier method's (:func:`identical_arms` on
    ``splits`` and ``metrics``, every seed or fold) and every method at the metrics' ceiling in
    its reported results (the summaries' ``final`` blocks: :func:`ceiling_note`).
    ``summaries``: ``{label: summary}``, or ``{"seed_<s>" | "fold_<k>": {label: summary}}``
    with the runs in ``exp_dir/<seed or fold>/<label>``; unfinished runs are left out."""
    exp_dir = Path(exp_dir)
    nested = bool(summaries) and all(isinstance(k, str) and k.split("_")[0] in ("seed", "fold")
                                     and (exp_dir / k).is_dir() for k in summaries)
    blocks = {k: dict(v or {}) for k, v in summaries.items()} if nested else {"": dict(summaries)}
    labels = list(dict.fromkeys(label for block in blocks.values() for label in block))
    runs: dict[str, list[Path]] = {}
    finals: dict[str, list[dict[str, Any]]] = {}
    for label in labels:
        for key, block in blocks.items():
            run_dir = exp_dir / key / label if key else exp_dir / label
            if block.get(label) and (run_dir / "metrics.csv").is_file():
                runs.setdefault(label, []).append(run_dir)
                finals.setdefault(label, []).append(block[label].get("final") or {})
    if len(runs) < 2:
        return []
    rows = []
    for label, blocks_ in finals.items():
        row: dict[str, Any] = {"arm": label}
        for split in splits:
            for m in metrics:
                vals = [((b.get(split) or {}).get(m) or {}).get("mean") if isinstance(b.get(split), dict) else None
                        for b in blocks_]
                row[f"{split}/{m} values"] = ";".join("nan" if v is None else f"{float(v)!r}" for v in vals)
        rows.append(row)
    where = f"in the reported round of every {'seed or fold' if nested else 'run'}"
    return separation_notes(runs, pd.DataFrame(rows), metric=metrics[0], selection_split=splits[0], splits=splits,
                            metrics=metrics, tol=tol, where=where)["lines"]


def _support(row: pd.Series, col: str) -> str:
    """"(3 seeds, 4 clients)": how many seeds have the mean's value and how many clients
    reported it (a range where seeds or rounds differ)."""
    seeds, total = int(row[f"{col} seeds"]), int(row["seeds"])
    values = str(row[f"{col} values"]).split(";")
    counts = [int(c) for v, cell in zip(values, str(row[f"{col} clients"]).split(";")) if v != "nan"
              for c in cell.split(",") if c]
    lo, hi = (min(counts), max(counts)) if counts else (0, 0)
    clients = f"{lo}" if lo == hi else f"{lo}-{hi}"
    seed_text = f"{seeds} seed{'s' if seeds != 1 else ''}" if seeds == total else f"{seeds} of {total} seeds"
    return f"({seed_text}, {clients} client{'s' if hi != 1 else ''})"


def _rounds_cell(row: pd.Series) -> str:
    """Each seed's round, with its flag where the overall best round differs."""
    flags = str(row.get("round_flags", "")).split(";")
    return "; ".join(r + (f" ({f})" if f else "") for r, f in zip(str(row["rounds"]).split(";"), flags + [""] * 99))


def _markdown(table: pd.DataFrame, splits: Sequence[str], metrics: Sequence[str], header: str,
              notes: Sequence[str] = ()) -> str:
    cols = [f"{sp}/{m}" for sp in splits for m in metrics if f"{sp}/{m}" in table.columns]
    lines = [header, "", "| arm | seeds | rounds | " + " | ".join(cols) + " |", "|---|---|---|" + "---|" * len(cols)]
    for _, r in table.iterrows():
        cells = ["n/a" if not np.isfinite(r[c]) else f"{r[c]:.3f} ± {r[c + ' std']:.3f} {_support(r, c)}"
                 for c in cols]
        lines.append(f"| {r['arm']} | {r['seeds']} | {_rounds_cell(r)} | " + " | ".join(cells) + " |")
    if notes:
        lines += ["", *[f"- {n}" for n in notes]]
    return "\n".join(lines) + "\n"


def write_arm_report(out_dir: str | Path, runs: Mapping[str, Sequence[str | Path]], *, select: str = "best_val",
                     metric: str = "micro_f1", selection_split: str = "local_val", last: int = 5,
                     splits: Sequence[str] = ("global_test", "local_test"),
                     metrics: Sequence[str] = ("micro_f1", "accuracy", "auc"), title: str = "",
                     plots: bool = True) -> pd.DataFrame:
    """Write an experiment's arms: ``arms_table.csv`` and ``arms_table.md`` (:func:`arm_table`,
    "mean ± std (seeds, clients)" over seeds, the rounds each seed was read at with their
    flags, and under the table which arms cannot be told apart), ``arms_curves.csv`` (every
    arm's, seed's, round's and split's mean over clients) and, with ``plots``,
    ``arms_curves.png`` (``metric`` per round on each of ``splits`` and ``selection_split``:
    each arm's mean over seeds with a ±std band, its selected rounds marked). Returns the table.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    table = arm_table(runs, select=select, metric=metric, selection_split=selection_split, last=last,
                      splits=splits, metrics=metrics)
    table.to_csv(out / "arms_table.csv", index=False)
    how = (f"best validation round ({selection_split}/{metric}, among the rounds from the method's scored_from on; "
           "an early-stopped run's own best round)" if select == "best_val"
           else f"mean of the last {last} evaluated rounds")
    header = (f"{title + ': ' if title else ''}each arm at its {how}; mean over the clients that reported the "
              "metric, mean ± population std over seeds (how many seeds and clients stand behind it); per-round "
              "curves in arms_curves.csv/.png")
    (out / "arms_table.md").write_text(_markdown(table, splits, metrics, header, table.attrs.get("separation", [])))
    frames = []
    for label, dirs in runs.items():
        for i, d in enumerate(dirs):
            c = round_curves(load_metrics(d))
            frames.append(c.assign(arm=label, seed_index=i, run=str(d))[["arm", "seed_index", "run", *c.columns]])
    curves = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    curves.to_csv(out / "arms_curves.csv", index=False)
    if plots and not curves.empty and metric in curves.columns:
        shown = [sp for sp in (*splits, selection_split) if sp in set(curves["split"])]
        shown = list(dict.fromkeys(shown))
        fig, axes = pyplot().subplots(1, max(1, len(shown)), figsize=(4.2 * max(1, len(shown)), 3.4),
                                      squeeze=False)
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
            round_axis(ax, ylabel=f"{metric} (mean over clients)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(title or "per-round curves, mean ± std over seeds", fontsize=9)
        save_plot(fig, out / "arms_curves.png")
    return table
