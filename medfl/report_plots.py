"""A run's figures, drawn from the files it saved (``plots/``: metric curves, per-client
heatmaps, forgetting, communication, privacy, client groups, the method's mechanisms, a
post-hoc student), and an experiment's figures drawn again (:func:`write_experiment_plots`).
``medfl report RUN_DIR`` and the reporting plugin call :func:`write_plots`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from medfl.arm_report import run_json
from medfl.plotting import pyplot, round_axis, save_plot
from medfl.report import TABLE_METRICS, clients_text, final_round, load_metrics, shared_model_split, write_comparison
from medfl.report_repeats import write_cv_report, write_seeds_report

__all__ = ["PLOT_METRICS", "write_plots", "write_forgetting_plot", "write_communication_plot", "write_privacy_plot",
           "write_group_plot", "MECHANISM_PANELS", "MECHANISM_LINES", "constant_mechanisms", "write_mechanism_plot",
           "STUDENT_METRICS", "write_student_plot", "write_experiment_plots"]

#: The metrics of ``plots/curves.png``, one panel each (those the run has).
PLOT_METRICS = ("accuracy", "auc", "f1")


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
    block, per = forgetting_report(df, _run_csv(run_dir, "train_metrics.csv"))
    if per.empty:
        return None
    fig, axes = pyplot().subplots(1, 3, figsize=(14, 3.6))
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
    for a in axes:
        round_axis(a, legend=8)
    fig.suptitle(f"{run_dir.name}: forgetting")
    return save_plot(fig, run_dir / "plots" / "forgetting.png")


def _run_csv(run_dir: Path, name: str) -> pd.DataFrame | None:
    """A run's per-round CSV ``name`` (``None`` when it is missing or empty)."""
    path = run_dir / name
    if not path.is_file():
        return None
    df = pd.read_csv(path, dtype={"client_id": str})
    return None if df.empty else df


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
    rounds = sorted(df["round"].unique())
    phases = [p for p in PHASES if (df["phase"] == p).any()]
    fig, axes = pyplot().subplots(1, 2, figsize=(10, 3.6), sharey=True)
    for ax, col, title in ((axes[0], "bytes_to_client", "to clients"), (axes[1], "bytes_from_client", "from clients")):
        bottom = np.zeros(len(rounds))
        for k, phase in enumerate(phases):
            mb = (df[df["phase"] == phase].groupby("round")[col].sum().reindex(rounds, fill_value=0) / 1e6).to_numpy()
            ax.bar(rounds, mb, bottom=bottom, color=f"C{k}", label=phase)
            bottom += mb
        ax.set_title(f"{title}: {bottom.sum() / len(rounds):.3g} MB per round")
        round_axis(ax, grid="y")
    axes[0].set_ylabel("MB (all clients)")
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{run_dir.name}: communication per round")
    return save_plot(fig, run_dir / "plots" / "communication.png")


def write_privacy_plot(run_dir: str | Path) -> Path | None:
    """Write ``plots/privacy.png``: each client's epsilon spent over the rounds (one panel
    per mechanism, the target as a dashed line where there is one), from the run's
    ``privacy.csv`` (:mod:`medfl.privacy.ledger`). Returns the path, or None for a run
    without differential privacy."""
    run_dir = Path(run_dir)
    df = _run_csv(run_dir, "privacy.csv")
    if df is None:
        return None
    plan = run_json(run_dir, "config.json").get("privacy", {})
    targets: dict[str, Any] = {"dp_sgd": (plan.get("dp_sgd") or {}).get("epsilon")}
    for f in plan.get("filters", []):
        if f.get("epsilon") is not None:
            targets[str(f["name"])] = f["epsilon"]
    mechs = list(dict.fromkeys(df["mechanism"]))
    fig, axes = pyplot().subplots(1, len(mechs), figsize=(5.2 * len(mechs), 3.6), squeeze=False)
    for ax, mech in zip(axes[0], mechs):
        g = df[df["mechanism"] == mech]
        for cid, rows in g.groupby("client_id", sort=False):
            ax.plot(rows["round"], rows["epsilon"], marker="o", label=f"client {cid}")
        if targets.get(mech) is not None:
            ax.axhline(float(targets[mech]), ls="--", color="k", lw=1, label="target")
        ax.set_title(f"{mech} ({g['unit'].iloc[0]}-level, delta={float(g['delta'].iloc[0]):g}, "
                     f"{g['accountant'].iloc[0]})", fontsize=9)
        round_axis(ax, ylabel="epsilon spent", legend=7)
    return save_plot(fig, run_dir / "plots" / "privacy.png")


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
    splits = list(dict.fromkeys(metrics["split"]))
    fig, axes = pyplot().subplots(1, len(splits), figsize=(5.0 * len(splits), 3.6), squeeze=False)
    for ax, split in zip(axes[0], splits):
        part = metrics[metrics["split"] == split]
        for g in dict.fromkeys(groups["group"].astype(str)):
            curve = part[part["group"] == g].groupby("round")["accuracy"].mean()
            n = int((groups["group"].astype(str) == g).sum())
            if len(curve):
                ax.plot(curve.index, curve.values, marker="o", label=f"{g} ({n} client{'s' if n != 1 else ''})")
        ax.set_title(f"{split}: mean accuracy per group")
        round_axis(ax, ylabel="accuracy", legend=8)
    fig.suptitle(run_dir.name)
    return save_plot(fig, run_dir / "plots" / "groups.png")


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
    warned = sorted({int(w["round"]) for w in run_json(run_dir, "summary.json").get("warnings", [])})
    constants = constant_mechanisms(df)
    moving = [k for k in dict.fromkeys(zip(df["mechanism"].astype(str), df["name"].astype(str)))
              if k not in constants]
    panels, undrawn = moving[:MECHANISM_PANELS], moving[MECHANISM_PANELS:]
    notes = list(constants.values())
    if undrawn:   # said, not dropped: the values past the last panel are named in the text panel
        notes.append(f"not drawn ({len(undrawn)} more moving values than the {MECHANISM_PANELS} "
                     f"panels; see mechanisms.csv):")
        notes.extend(f"  {mech}: {name}" for mech, name in undrawn)
    cols = min(4, max(1, len(panels)))
    rows = -(-len(panels) // cols)
    text_height = 0.5 + 0.15 * len(notes) if notes else 0.0
    fig = pyplot().figure(figsize=(3.8 * cols, 2.9 * rows + text_height))
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
        round_axis(ax, legend=6)
    if notes:   # one panel across the figure's width: the values that did not move, as text
        ax = fig.add_subplot(grid[rows, :])
        ax.axis("off")
        rounds = sorted(df["round"].astype(int).unique())
        ax.set_title(f"constant over rounds {rounds[0]}-{rounds[-1]}" if len(rounds) > 1
                     else f"round {rounds[0]} (one round: nothing to draw)", fontsize=9, loc="left")
        ax.text(0.0, 1.0, "\n".join(notes), transform=ax.transAxes, va="top", ha="left",
                fontsize=8, family="monospace")
    fig.suptitle(f"{run_dir.name}: what the method's mechanisms did" + (" (red: a warning)" if warned else ""))
    return save_plot(fig, run_dir / "plots" / "mechanisms.png")


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
    metrics = [m for m in STUDENT_METRICS if m in df.columns and df[m].notna().any()]
    losses = [c for c in ("loss", "supcon", "kd") if c in df.columns and df[c].notna().any()]
    panels = metrics + (["losses"] if losses else [])
    if not panels:
        return None
    fig, axes = pyplot().subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        if panel == "losses":
            part = df[df[losses].notna().any(axis=1)].sort_values("epoch")
            for c in losses:
                ax.plot(part["epoch"], part[c], marker="o", label=f"{c} ({', '.join(part['split'].unique())})")
            ax.set_title("training loss terms per epoch")
        else:
            for split, part in df[df[panel].notna()].groupby("split", sort=False):
                part = part.sort_values("epoch")
                ax.plot(part["epoch"], part[panel], marker="o", label=str(split))
            ax.set_title(f"student {panel}")
        round_axis(ax, "epoch", ylabel="loss" if panel == "losses" else panel, legend=8)
    fig.suptitle(f"{run_dir.name}: the post-hoc student per epoch (student_metrics.csv)")
    return save_plot(fig, run_dir / "plots" / "student_metrics.png")


def write_plots(run_dir: str | Path) -> list[Path]:
    """Write ``plots/curves.png`` (metric per round, mean and client range per split),
    ``plots/clients_<split>.png`` (final metrics per client as a heatmap; one row for a split
    whose clients' rows are one score, :func:`medfl.report.shared_model_split`),
    ``plots/forgetting.png`` (:func:`write_forgetting_plot`) and, when the run has a
    ``communication.csv``, ``plots/communication.png`` (:func:`write_communication_plot`),
    a ``privacy.csv``, ``plots/privacy.png`` (:func:`write_privacy_plot`), a ``groups.csv``,
    ``plots/groups.png`` (:func:`write_group_plot`), a ``mechanisms.csv``,
    ``plots/mechanisms.png`` (:func:`write_mechanism_plot`), and a ``student_metrics.csv``,
    ``plots/student_metrics.png`` (:func:`write_student_plot`). Returns the paths."""
    plt = pyplot()
    run_dir = Path(run_dir)
    df = load_metrics(run_dir)
    written = []
    metrics = [m for m in PLOT_METRICS if m in df.columns]
    splits = list(dict.fromkeys(df["split"]))
    chosen = final_round(run_dir, df)
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.5 * len(metrics), 3.6), squeeze=False)
    for ax, m in zip(axes[0], metrics):
        for split in splits:
            g = df[df["split"] == split].groupby("round")[m]
            mean, lo, hi = g.mean(), g.min(), g.max()
            ax.plot(mean.index, mean.values, marker="o", label=f"{split} (mean)")
            ax.fill_between(mean.index, lo.values, hi.values, alpha=0.2)
        if chosen != int(df["round"].max()):   # early stopping's best round
            ax.axvline(chosen, ls=":", color="k", lw=1, label=f"best round {chosen}")
        round_axis(ax, ylabel=m)
        ax.set_title(f"{m}: mean and client range")
    axes[0][0].legend(fontsize=8)
    fig.suptitle(run_dir.name)
    written.append(save_plot(fig, run_dir / "plots" / "curves.png"))
    last = df[df["round"] == chosen]
    cols = [c for c in TABLE_METRICS if c in df.columns]
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
        written.append(save_plot(fig, run_dir / "plots" / f"clients_{split}.png"))
    for extra in (write_forgetting_plot, write_communication_plot, write_privacy_plot, write_group_plot,
                  write_mechanism_plot, write_student_plot):
        path = extra(run_dir)
        if path is not None:
            written.append(path)
    return written


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
    fl = run_json(exp_dir, "config.json").get("fl", {})
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
