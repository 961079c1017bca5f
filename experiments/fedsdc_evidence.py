#!/usr/bin/env python
"""FedSDC and FedSDC+ against FedAvgM with early stopping, over seeds (issue 37's evidence).

Issue 37 asks: "FedSDC with early stopping, over enough rounds to converge, against FedAvgM:
report whatever the result is, with the seeds' spread". This script runs, on the HAM10000
fixture under FedSDC's NIID-1 split (``experiments/fedsdc_compare.py``'s ``ham10000_niid1``:
30 images of every class held out as the global test set, the rest Dirichlet(5.0) over 5
clients, each keeping 15 % as ``val``), for every local-SGD momentum of ``--momenta`` and
every seed of ``--seeds``, the arms

``fedavgm``      FedAvgM, beta 0.5 (the body's aggregation in FedSDC, so the reference);
``fedsdc``       ``{"name": "fedsdc", "preset": "paper"}``: five shuffled heads of widths
                 rho x 2048 (rho ~ U[0.4, 1]), dropout 0.2, majority vote, ties by mean
                 probability;
``fedsdc_plus``  ``{"name": "fedsdc", "preset": "paper_plus"}``: the same, the ensemble the
                 top ceil(0.3 x 5) = 2 heads by the clients' validation micro-F1;
Named with ``--arms`` only: ``fedsdc_default`` (``{"name": "fedsdc"}``: medfl's defaults,
dropout 0.5), ``sdc_noshuffle`` (``paper`` with Shuffle off: each client keeps its head) and
``sdc_nodiversity`` (``paper`` with Diversity off: every head 2048 units wide) and
``sdc_literal_widths`` (``paper`` with ``min_hidden`` null: heads rho x the body's 16-d
embedding, 6-16 units, the paper's rule read literally).

Every arm trains alike: the presets' method values, but the training settings of this
experiment (``--lr``, ``--batch-size``, ``--momentum``; the paper's lr 1e-3 and batch 64 do not
move a randomly initialised small CNN in a few hundred rounds). Every run evaluates ``val``
and ``global_test`` every round and stops by ``fl.early_stopping`` on ``val/micro_f1`` (the
mean over clients of the vote's micro-F1 on the clients' val splits) with ``--patience``
evaluated rounds and ``--min-delta``, at most ``--max-rounds`` rounds (the paper: up to 1500).

Reported (``medfl.arm_report``): each arm at its early-stopping best round (no test score
chooses it), global-test and val micro-F1 and AUC, mean ± population std over seeds, and as a
second table the mean of the last ``--last`` rounds run; the per-round curves beside them.
From each run's ``summary.json`` and ``mechanisms.csv``: the best and stop rounds (or the cap),
and for the FedSDC arms at the best round the vote's tie and disagreement rates on the
pooled val splits, the vote's accuracy there, each head's accuracy (mean, best, worst), the
vote's gain over the mean and the best head, FedSDC+'s kept heads against the rest and how
often its choice changed; mean ± std over seeds.

Writes to ``--out`` (default ``experiments/results/fedsdc/evidence/``): per momentum
``mom<m>/arms_table.md|csv`` (best round), ``mom<m>/last/arms_table.md|csv`` (last rounds),
``mom<m>/arms_curves.csv|png``, ``mom<m>/mechanism_curves.png`` (per round: vote and head
accuracy on val, tie rate; mean over seeds); at the top ``evidence.md`` (every table, printed
too), ``mechanisms.csv`` (mean ± std), ``mechanisms_per_run.csv`` and ``runs/`` (one
experiment per momentum and seed: ``runs/mom<m>_seed<s>/<arm>/``). Finished runs are reused
(``--rerun`` runs them again; ``--report-only`` only re-reads them).

The figures in experiments/README.md came from (about 20 min on 2 shared cores, then about
6 and 10 min for the ablations and the stronger skew):

    python experiments/fedsdc_evidence.py --seeds 0 1 2 3 4 --momenta 0 0.9 --max-rounds 120 --patience 10
    python experiments/fedsdc_evidence.py --seeds 0 1 2 3 4 --momenta 0 --max-rounds 120 --patience 10 \\
        --arms fedavgm fedsdc fedsdc_plus sdc_noshuffle sdc_nodiversity
    python experiments/fedsdc_evidence.py --seeds 0 1 2 3 4 --momenta 0 --max-rounds 120 --patience 10 --alpha 0.3 \\
        --out experiments/results/fedsdc/evidence_alpha0.3
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fedsdc_compare import prepare, setting_config  # noqa: E402

from medfl.arm_report import write_arm_report  # noqa: E402
from medfl.config import resolve_config  # noqa: E402
from medfl.experiment import run_experiment  # noqa: E402

#: the arms, by label (each a method entry; ``train`` is filled in per run)
ARMS: dict[str, dict[str, Any]] = {
    "fedavgm": {"name": "fedavgm", "beta": 0.5},
    "fedsdc": {"name": "fedsdc", "label": "fedsdc", "preset": "paper"},
    "fedsdc_plus": {"name": "fedsdc", "label": "fedsdc_plus", "preset": "paper_plus"},
    "fedsdc_default": {"name": "fedsdc", "label": "fedsdc_default"},
    "sdc_noshuffle": {"name": "fedsdc", "label": "sdc_noshuffle", "preset": "paper", "shuffle": False},
    "sdc_nodiversity": {"name": "fedsdc", "label": "sdc_nodiversity", "preset": "paper", "diversity": False},
    "sdc_literal_widths": {"name": "fedsdc", "label": "sdc_literal_widths", "preset": "paper", "min_hidden": None},
}
DEFAULT_ARMS = ("fedavgm", "fedsdc", "fedsdc_plus")
#: convergence speed: the first round whose val micro-F1 (mean over clients) reaches these
THRESHOLDS = (0.9, 0.95)
SETTING = "ham10000_niid1"


def mom_tag(m: float) -> str:
    """A momentum's folder name (``mom0``, ``mom0.9``)."""
    return f"mom{m:g}"


def arm_entry(label: str, a: argparse.Namespace, momentum: float) -> dict[str, Any]:
    """The method entry of an arm; FedSDC's presets get this experiment's training settings."""
    entry = dict(ARMS[label])
    if "preset" in entry or entry["name"] == "fedsdc":
        entry["train"] = {"lr": a.lr, "batch_size": a.batch_size, "momentum": momentum, "weight_decay": 0.0,
                          "epochs": 1, "optimizer": "sgd"}
    return entry


def run_dir(a: argparse.Namespace, momentum: float, seed: int, label: str) -> Path:
    """Where one run lives."""
    return a.out / "runs" / f"{mom_tag(momentum)}_seed{seed}" / label


def finished(path: Path) -> bool:
    """Whether a run wrote its summary (it finished)."""
    return (path / "summary.json").is_file()


def run_one(a: argparse.Namespace, data: Path, momentum: float, seed: int, labels: list[str]) -> None:
    """One experiment: every arm of ``labels`` on one momentum and seed (shared split and init)."""
    ns = argparse.Namespace(**{**vars(a), "momentum": momentum, "rounds": a.max_rounds, "eval_every": 1,
                               "seeds": [seed], "out": a.out})
    fl = setting_config(SETTING, data, ns, [arm_entry(x, a, momentum) for x in labels])
    fl.update(name=f"{mom_tag(momentum)}_seed{seed}", output_dir=str(a.out / "runs"), seeds=None, seed=seed,
              eval_splits=["val", "global_test"], overwrite=True,
              early_stopping={"metric": "val/micro_f1", "patience": a.patience, "min_delta": a.min_delta})
    fl["partition"]["alpha"] = a.alpha
    t0 = time.time()
    run_experiment(resolve_config(fl))
    print(f"{mom_tag(momentum)} seed {seed} {' '.join(labels)}: {time.time() - t0:.0f} s", flush=True)


# ---------------------------------------------------------------------------- mechanisms
def _mech_frame(path: Path) -> pd.DataFrame:
    f = path / "mechanisms.csv"
    return pd.read_csv(f, dtype={"id": str}, keep_default_na=False, na_values=["", "nan", "NaN"]) if f.is_file() \
        else pd.DataFrame(columns=["round", "mechanism", "scope", "id", "name", "value", "text"])


def _value(m: pd.DataFrame, r: int, mechanism: str, name: str, ident: str | None = None) -> pd.Series:
    sel = (m["round"] == r) & (m["mechanism"] == mechanism) & (m["name"] == name)
    if ident is not None:
        sel &= m["id"].astype(str) == ident
    return m.loc[sel]


def run_mechanisms(path: Path) -> dict[str, Any]:
    """What one run's mechanisms did: early stopping from ``summary.json``; for FedSDC at the
    best round the vote and the heads from ``mechanisms.csv``."""
    s = json.loads((path / "summary.json").read_text())
    es = s.get("early_stopping") or {}
    best = es.get("best_round")
    out: dict[str, Any] = {"best_round": best, "stopped_at": es.get("stopped_at_round"),
                           "rounds_run": es.get("rounds_run"), "rounds_planned": es.get("rounds_planned"),
                           "stopped_early": float(es.get("stopped_at_round") is not None),
                           "best_val_micro_f1": es.get("best_value"),
                           "warnings": " | ".join(sorted({str(w.get("warning", w)) if isinstance(w, dict) else str(w)
                                                          for w in s.get("warnings", [])}))}
    met = pd.read_csv(path / "metrics.csv")
    val = met[met["split"] == "local_val"].groupby("round")["micro_f1"].mean()
    for th in THRESHOLDS:
        hit = val[val >= th]
        out[f"val_first_{round(100 * th)}"] = float(hit.index[0]) if len(hit) else float("nan")
    glob = met[met["split"] == "global_test"].groupby("round")["micro_f1"].mean()
    out["gt_max_any_round"] = float(glob.max())
    m = _mech_frame(path)
    if m.empty or best is None:
        return out
    best = int(best)
    heads = m[(m["round"] == best) & (m["mechanism"] == "head")]
    acc = heads[heads["name"] == "accuracy"].set_index("id")["value"].astype(float)
    width = heads[heads["name"] == "width"].set_index("id")["value"].astype(float)
    kept = heads[heads["name"] == "kept"].set_index("id")["value"].astype(float)
    vote = {n: float(_value(m, best, "vote", n)["value"].iloc[0]) for n in
            ("tie_rate", "disagreement_rate", "accuracy", "heads") if len(_value(m, best, "vote", n))}
    wa = pd.concat([width.rename("w"), acc.rename("a")], axis=1).dropna()
    corr = float(wa["w"].rank().corr(wa["a"].rank())) if len(wa) > 2 and wa["w"].nunique() > 1 else None
    out.update({"width_acc_spearman": corr if corr is None or np.isfinite(corr) else None,
                "vote_accuracy": vote.get("accuracy"), "tie_rate": vote.get("tie_rate"),
                "disagreement_rate": vote.get("disagreement_rate"), "voting_heads": vote.get("heads"),
                "head_acc_mean": float(acc.mean()), "head_acc_best": float(acc.max()),
                "head_acc_worst": float(acc.min()),
                "widths": " ".join(str(int(width[i])) for i in sorted(width.index, key=int))})
    if vote.get("accuracy") is not None:
        out["vote_gain_over_mean_head"] = vote["accuracy"] - out["head_acc_mean"]
        out["vote_gain_over_best_head"] = vote["accuracy"] - out["head_acc_best"]
    ties = m[(m["mechanism"] == "vote") & (m["name"] == "tie_rate") & (m["round"] <= best)]["value"].astype(float)
    out["tie_rate_mean_to_best"] = float(ties.mean()) if len(ties) else None
    sparse = m[(m["mechanism"] == "sparse_heads") & (m["name"] == "head_ids")].sort_values("round")
    if len(sparse):
        # the ensemble evaluated in round r is the one kept after round r's validation
        on = kept[kept > 0].index
        off = kept[kept == 0].index
        out["kept_heads_at_best"] = " ".join(sorted(on, key=int))
        out["kept_acc_mean"] = float(acc[on].mean())
        out["rest_acc_mean"] = float(acc[off].mean()) if len(off) else None
        ids = sparse[sparse["round"] <= best]["text"].astype(str).tolist()
        out["kept_changes_to_best"] = float(sum(x != y for x, y in zip(ids, ids[1:])))
        out["kept_is_top_by_val"] = float(set(on) == set(acc.sort_values(ascending=False).index[:len(on)]))
    return out


MECH_COLS = ["val_first_90", "val_first_95", "gt_max_any_round", "best_round", "rounds_run", "stopped_early", "best_val_micro_f1", "vote_accuracy", "tie_rate",
             "disagreement_rate", "tie_rate_mean_to_best", "head_acc_mean", "head_acc_best", "head_acc_worst",
             "vote_gain_over_mean_head", "vote_gain_over_best_head", "kept_acc_mean", "rest_acc_mean",
             "kept_changes_to_best", "width_acc_spearman"]


def _fmt(mean: float, std: float, digits: int) -> str:
    return "n/a" if not np.isfinite(mean) else f"{mean:.{digits}f} ± {std:.{digits}f}"


def mechanism_table(per_run: pd.DataFrame) -> pd.DataFrame:
    """Mean ± population std over seeds of every mechanism column, per momentum and arm."""
    rows = []
    for (mom, arm), g in per_run.groupby(["momentum", "arm"], sort=False):
        row: dict[str, Any] = {"momentum": mom, "arm": arm, "seeds": len(g),
                               "stop_rounds": ";".join("cap" if pd.isna(x) else str(int(x)) for x in g["stopped_at"]),
                               "best_rounds": ";".join(str(int(x)) for x in g["best_round"])}
        for c in MECH_COLS:
            v = pd.to_numeric(g[c], errors="coerce") if c in g else pd.Series(dtype=float)
            v = v[np.isfinite(v)]
            row[c] = float(v.mean()) if len(v) else float("nan")
            row[c + " std"] = float(v.std(ddof=0)) if len(v) else float("nan")
        rows.append(row)
    return pd.DataFrame(rows)


def speed_markdown(t: pd.DataFrame, per_run: pd.DataFrame) -> str:
    """Rounds to reach the val thresholds (never reached: counted apart), and the global
    test's best round of all (a ceiling chosen on the test set, not a result)."""
    lines = ["| momentum | arm | seeds | first round val >= 0.90 | first round val >= 0.95 | runs that never reached 0.95 "
             "| best round (early stopping) | rounds run | global-test max over all rounds (test-chosen: a ceiling) |",
             "|---" * 9 + "|"]
    for _, r in t.iterrows():
        g = per_run[(per_run["momentum"] == r["momentum"]) & (per_run["arm"] == r["arm"])]
        miss = int(g["val_first_95"].isna().sum())
        lines.append(f"| {r['momentum']:g} | {r['arm']} | {r['seeds']} | {_fmt(r['val_first_90'], r['val_first_90 std'], 1)}"
                     f" | {_fmt(r['val_first_95'], r['val_first_95 std'], 1)} | {miss} | "
                     f"{_fmt(r['best_round'], r['best_round std'], 1)} | {_fmt(r['rounds_run'], r['rounds_run std'], 1)} | "
                     f"{_fmt(100 * r['gt_max_any_round'], 100 * r['gt_max_any_round std'], 1)} |")
    return "\n".join(lines) + "\n"


def mechanism_markdown(t: pd.DataFrame) -> str:
    """The mechanism table as Markdown (rates and accuracies in %)."""
    pct = [("best_val_micro_f1", "val micro-F1 at best"),
           ("vote_accuracy", "vote acc. (val; FedSDC+: the heads kept the round before)"),
           ("head_acc_mean", "head acc. mean"), ("head_acc_best", "best head"), ("head_acc_worst", "worst head"),
           ("vote_gain_over_mean_head", "vote - mean head"), ("vote_gain_over_best_head", "vote - best head"),
           ("tie_rate", "tie rate"), ("tie_rate_mean_to_best", "tie rate, rounds 1..best"),
           ("disagreement_rate", "disagreement"), ("kept_acc_mean", "kept heads' acc."),
           ("rest_acc_mean", "other heads' acc.")]
    lines = ["| momentum | arm | seeds | best rounds | stopped at (cap: ran every round) | best round | stopped early | "
             + " | ".join(x for _, x in pct) + " | kept set changes, rounds 1..best | Spearman(width, head acc.) |",
             "|---" * (7 + len(pct) + 2) + "|"]
    for _, r in t.iterrows():
        cells = [_fmt(100 * r[c], 100 * r[c + " std"], 1) for c, _ in pct]
        lines.append(f"| {r['momentum']:g} | {r['arm']} | {r['seeds']} | {r['best_rounds']} | {r['stop_rounds']} | "
                     f"{_fmt(r['best_round'], r['best_round std'], 1)} | {100 * r['stopped_early']:.0f} % | "
                     + " | ".join(cells) + f" | {_fmt(r['kept_changes_to_best'], r['kept_changes_to_best std'], 1)} | "
                     f"{_fmt(r['width_acc_spearman'], r['width_acc_spearman std'], 2)} |")
    return "\n".join(lines) + "\n"


def mechanism_curves(out: Path, runs: dict[str, list[Path]], title: str, colours: dict[str, str]) -> None:
    """Per round, mean over seeds: the vote's and the heads' accuracy on the val splits and
    the tie rate, for each FedSDC arm (``mechanism_curves.png``, ``mechanism_curves.csv``)."""
    frames = []
    for arm, dirs in runs.items():
        for i, d in enumerate(dirs):
            m = _mech_frame(d)
            if m.empty:
                continue
            heads = m[(m["mechanism"] == "head") & (m["name"] == "accuracy")].groupby("round")["value"]
            vote = m[m["mechanism"] == "vote"].pivot_table(index="round", columns="name", values="value")
            f = pd.DataFrame({"head_acc_mean": heads.mean(), "head_acc_best": heads.max()}).join(
                vote.reindex(columns=["accuracy", "tie_rate", "disagreement_rate"]))
            frames.append(f.reset_index().assign(arm=arm, seed_index=i))
    if not frames:
        return
    c = pd.concat(frames, ignore_index=True)
    c.to_csv(out / "mechanism_curves.csv", index=False)
    from medfl.plotting import pyplot, tight_layout

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for arm, g in c.groupby("arm", sort=False):
        per = g.groupby("round").mean(numeric_only=True)
        line = axes[0].plot(per.index, per["accuracy"], lw=1.4, label=f"{arm}: vote", color=colours.get(arm))[0]
        axes[0].plot(per.index, per["head_acc_mean"], lw=1, ls="--", color=line.get_color(), label=f"{arm}: mean head")
        axes[0].plot(per.index, per["head_acc_best"], lw=0.8, ls=":", color=line.get_color(), label=f"{arm}: best head")
        axes[1].plot(per.index, per["tie_rate"], lw=1.2, color=line.get_color(), label=f"{arm}: tie rate")
        axes[1].plot(per.index, per["disagreement_rate"], lw=0.8, ls="--", color=line.get_color(),
                     label=f"{arm}: disagreement")
    axes[0].set_ylabel("accuracy on the pooled val splits")
    axes[1].set_ylabel("rate on the pooled val splits")
    for ax in axes:
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(title + " (mean over seeds; a seed's curve ends where it stopped)", fontsize=9)
    tight_layout(fig)
    fig.savefig(out / "mechanism_curves.png", dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------- report
def report(a: argparse.Namespace, labels: list[str], settings_line: str) -> str:
    """Read every finished run; write and return the tables."""
    md = ["# FedSDC / FedSDC+ against FedAvgM with early stopping (HAM10000 fixture, NIID-1)", "", settings_line, ""]
    per_run = []
    for mom in a.momenta:
        runs = {x: [run_dir(a, mom, s, x) for s in a.seeds if finished(run_dir(a, mom, s, x))] for x in labels}
        runs = {k: v for k, v in runs.items() if v}
        if not runs:
            continue
        out = a.out / mom_tag(mom)
        title = f"local SGD momentum {mom:g}"
        kw = {"splits": ("global_test", "local_val"), "metrics": ("micro_f1", "auc")}
        write_arm_report(out, runs, select="best_val", title=title, **kw)
        write_arm_report(out / "last", runs, select="last_mean", last=a.last, title=title, plots=False, **kw)
        mechanism_curves(out, {k: v for k, v in runs.items() if k != "fedavgm"}, title,
                         {k: f"C{i}" for i, k in enumerate(runs)})   # the colours of arms_curves.png
        best = pd.read_csv(out / "arms_table.csv")
        seeds_line = ["Per seed (global-test micro-F1 %, seeds in order; best round):", ""]
        for _, r in best.iterrows():
            vals = [f"{100 * float(v):.1f}" for v in str(r["global_test/micro_f1 values"]).split(";")]
            seeds_line.append(f"- {r['arm']}: " + ", ".join(f"{v} (r{x})" for v, x in zip(vals, str(r["rounds"]).split(";"))))
        md += [f"## {title}: each arm at its early-stopping best round", "",
               (out / "arms_table.md").read_text(), *seeds_line, "", f"Curves: `{out.name}/arms_curves.png`, "
               f"mechanisms per round: `{out.name}/mechanism_curves.png` (beside this file)", "",
               f"## {title}: mean of the last {a.last} rounds run", "", (out / "last" / "arms_table.md").read_text()]
        for arm, dirs in runs.items():
            for d in dirs:
                per_run.append({"momentum": mom, "arm": arm, "seed": int(d.parent.name.rsplit("seed", 1)[1]),
                                **run_mechanisms(d)})
    if per_run:
        pr = pd.DataFrame(per_run)
        pr.to_csv(a.out / "mechanisms_per_run.csv", index=False)
        mt = mechanism_table(pr)
        mt.to_csv(a.out / "mechanisms.csv", index=False)
        md += ["## Convergence speed and where the runs stopped (mean ± std over seeds)", "",
               speed_markdown(mt, pr), "",
               "## What the mechanisms did (mean ± std over seeds; FedSDC's at the best round, on the pooled val "
               "splits)", "", mechanism_markdown(mt), "Warnings (distinct, per arm):", ""]
        for (mom, arm), g in pr.groupby(["momentum", "arm"], sort=False):
            w = sorted({x for ws in g["warnings"].fillna("") for x in str(ws).split(" | ") if x})
            md.append(f"- momentum {mom:g}, {arm}: " + ("; ".join(w) if w else "none"))
    text = "\n".join(md) + "\n"
    (a.out / "evidence.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> int:
    """Run the missing runs (or none with ``--report-only``), then report."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2, 3, 4], help="seeds (default 0 1 2 3 4)")
    p.add_argument("--momenta", nargs="+", type=float, default=[0.0, 0.9],
                   help="local SGD momenta, one experiment each (default 0 0.9; the paper: plain SGD)")
    p.add_argument("--arms", nargs="+", default=list(DEFAULT_ARMS), choices=list(ARMS),
                   help=f"arms (default {' '.join(DEFAULT_ARMS)})")
    p.add_argument("--max-rounds", type=int, default=120, help="round cap (default 120; the paper: 1500)")
    p.add_argument("--patience", type=int, default=10,
                   help="early stopping: evaluated rounds (here every round) without improvement of val/micro_f1 "
                        "(default 10)")
    p.add_argument("--min-delta", type=float, default=0.0, help="early stopping's min_delta (default 0)")
    p.add_argument("--last", type=int, default=5, help="rounds the last-rounds table averages (default 5)")
    p.add_argument("--lr", type=float, default=0.05, help="local SGD learning rate (default 0.05; paper 1e-3)")
    p.add_argument("--batch-size", type=int, default=16, help="local batch size (default 16; paper 64)")
    p.add_argument("--image-size", type=int, default=32, help="fixture image size (default 32)")
    p.add_argument("--model", default="small_cnn", help="body (default small_cnn)")
    p.add_argument("--width", type=int, default=8, help="small_cnn width (default 8: a 16-d embedding)")
    p.add_argument("--ham-cases", type=int, default=1400, help="HAM10000 fixture images (default 1400)")
    p.add_argument("--ham-k", type=int, default=30, help="test images per class held out (default 30, the paper's)")
    p.add_argument("--alpha", type=float, default=5.0,
                   help="Dirichlet concentration of the clients' labels (default 5.0, the paper's NIID-1; smaller: "
                        "more skew; use another --out)")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "fedsdc" / "evidence",
                   help="output folder (default experiments/results/fedsdc/evidence)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on 2 cores shared with other jobs, 2 threads made a training "
                        "step 6x slower, 67 against 10 ms)")
    p.add_argument("--rerun", action="store_true", help="run finished runs again")
    p.add_argument("--report-only", action="store_true", help="run nothing; report the finished runs")
    p.add_argument("--smoke", action="store_true",
                   help="the test suite's run (tests/test_experiments.py): 400 images at 16 px, 5 held out a class, "
                   "seed 0, momentum 0, fedavgm and fedsdc, at most 2 rounds, patience 1, last 1; it checks "
                   "that the script runs, its numbers are no evidence")
    a = p.parse_args(argv)
    if a.smoke:
        a.ham_cases, a.ham_k, a.image_size, a.seeds, a.momenta = 400, 5, 16, [0], [0.0]
        a.arms, a.max_rounds, a.patience, a.last = ["fedavgm", "fedsdc"], 2, 1, 1
    # fedsdc_compare's helpers read these
    a.derm_cases, a.derm_k, a.per_class = 800, 10, [10, 30]
    os.environ.setdefault("MEDFL_NO_PROGRESS", "1")
    torch.set_num_threads(a.threads)
    a.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    if not a.report_only:
        data = prepare("ham10000", argparse.Namespace(**{**vars(a), "out": a.out.parent}))
        for mom in a.momenta:
            for seed in a.seeds:
                todo = [x for x in a.arms if a.rerun or not finished(run_dir(a, mom, seed, x))]
                if todo:
                    run_one(a, data, mom, seed, todo)
    line = (f"Seeds {a.seeds}; 5 clients; {a.model} width {a.width} at {a.image_size}x{a.image_size}; SGD lr {a.lr} "
            f"batch {a.batch_size}, 1 local epoch a round, local momentum {', '.join(f'{m:g}' for m in a.momenta)} "
            f"(paper: ResNet-50, lr 1e-3, batch 64); early stopping on val/micro_f1 (mean over clients), patience "
            f"{a.patience} rounds, min_delta {a.min_delta:g}, at most {a.max_rounds} rounds (paper: up to 1500); "
            f"HAM10000 fixture of {a.ham_cases} images, {a.ham_k} per class held out as the global test set "
            f"({7 * a.ham_k} images), Dirichlet({a.alpha:g}) over 5 clients, 15 % of each client's rows as val; "
            f"FedSDC arms: the presets' method values, this experiment's training settings. "
            f"{'Reported' if a.report_only else 'Ran and reported'} in {time.time() - started:.0f} s.")
    print(report(a, a.arms, line))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
