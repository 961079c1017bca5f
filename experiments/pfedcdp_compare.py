#!/usr/bin/env python
"""PFedCDP against its ablations, FedAvg and centralized training: CBIS-DDSM private at the
clients, MIAS public at the coordinator, 10 and 50 clients (the paper's Fig. 2 settings).

One experiment per client count and seed (``runs/c<N>_seed<k>/``: one partition, one draw of
the capability clusters, shared by every arm), with the method entries (labels):

``pfedcdp``
    the paper's settings: DP epsilon 5 (``dp_gaussian`` on the extractor's update, clip
    C2 = 2.5), 8-bit quantization, ``extractor_epochs`` 1, the server classifier fitted on
    the public set, Shapley teacher weights;
``pfedcdp_nodp``
    the same without DP (``epsilon`` null; still 8 bits, on the update as eq. 14 says:
    ``quantize`` "update", the default);
``pfedcdp_literal``
    ``extractor_epochs`` 0 (Algorithm 1 as printed: the extractor never trains at a client),
    no DP;
``pfedcdp_init_head``
    ``server_classifier`` "init" (nothing trains the server's classifier), no DP;
``pfedcdp_uniform`` / ``pfedcdp_fixed``
    teacher weights uniform / the authors' fixed [0.4, 0.35, 0.25], no DP (compare with
    ``pfedcdp_nodp``, whose weights are Shapley);
``fedavg`` / ``centralized``
    ``fl.model`` = ``pfedcdp_a`` (the High cluster's CNN) for every client / on the pooled
    training data.

Data: a CBIS-DDSM fixture (``medfl.fixtures``, ``--cbis-cases`` mammograms) prepared by
``medfl.prep.cbis_ddsm --roi-crops`` at ``--image-size`` (one lesion crop per abnormality,
benign/malignant by its pathology), Dirichlet 0.5 over the clients, the official test split as
the global test; a MIAS fixture (``--mias-cases`` images) prepared by ``medfl.prep.mias
--classes benign-malignant --roi`` as ``fl.public_dataset`` (15 % of its women drawn as
``public_test``). ``--whole-images`` uses whole mammograms instead: at 32x32 a lesion is then
a few pixels and nothing below learns it in this budget (see below). The fixture's CSVs put half of the images in the
test split (the real CBIS-DDSM: 772 test against 2,326 training images); the script keeps a
subject-grouped, label-stratified ``--test-ratio`` share of the training count of them (one
third by default, about the real ratio; ``0`` keeps all), because every client scores the
global test each round and every final model again per client, which is most of the run
time. ``--cbis-dir`` / ``--mias-dir`` take prepared real data instead (used as they are).

Deviations from the paper for the time budget (the defaults took 17 minutes on 2 shared CPU
cores, one torch thread; ``--quick`` about 2): 10 rounds
(``--rounds``; paper 20), one local epoch per round (``--epochs``; paper 20), 32x32 images
(paper: not stated for its CNNs), no augmentation, one seed. Each client's rows split 80/20
train/local test (no validation split: nothing here uses one). With 50 clients Dirichlet 0.5
over two classes leaves some clients with a handful of images: ``min_size`` is 10 up to 20
clients and 2 above (``--min-size``), with up to 5,000 redraws.

What the fixture can and cannot show: the synthetic fixture images carry a planted class
signal and a per-scanner shift, so the absolute accuracies and AUCs say nothing about real
mammograms (on which the paper's and everyone's numbers are far lower). The comparisons that
carry over are relative, between arms that share the partition, the clusters and the
initialisations: DP's noise against no DP (at epsilon 5 with 10 or 50 clients the noise on a
cluster's averaged update is many times the update itself), the literal Algorithm 1 against
a trained extractor, a fitted against an untrained server classifier, and the three
teacher-weight modes (with only three teachers and a small public set the Shapley game is
coarse). Per-cluster curves come from the capability draw, not from data: a cluster's size is
chance, and so is how much data its clients hold. The signal is not easy at 32x32 for these
CNNs in this budget on whole mammograms (``--whole-images``): a logistic regression on each
image's sorted z-scored pixels separates the prepared CBIS-DDSM fixture at about 0.85
accuracy, but centralized training of model A reaches only about 0.53-0.70 global accuracy
after 10 epochs (depending on seed and optimizer) and the federated arms stay at chance after
10 rounds of one epoch; on lesion crops (the default) centralized training reaches about
0.8 global accuracy in 5 epochs.

Writes to ``--out`` (default ``experiments/results/pfedcdp/``): ``table.csv``, ``table.json``,
``table.md`` (the markdown table, the settings and the notes; also printed), ``per_seed.csv``,
``cluster_curves.png`` (mean global_test accuracy per round per cluster, the paper's Fig. 2,
for ``pfedcdp`` and, dashed, ``pfedcdp_nodp``), ``teachers_public.png`` (student, teachers and
their ensemble on public_test under the three teacher-weight modes); the prepared data in
``--out/data`` and the runs in ``--out/runs``.

    python experiments/pfedcdp_compare.py [--clients 10 50] [--rounds 10] [--seeds 0] [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "experiments" / "results" / "pfedcdp"
CLUSTERS = ("high", "medium", "low")
WEIGHT_ARMS = {"shapley": "pfedcdp_nodp", "uniform": "pfedcdp_uniform", "fixed": "pfedcdp_fixed"}


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------ arms
def arms(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The method entries of one experiment, in table order."""
    base = {"name": "pfedcdp", "capabilities": "draw", "refine_epochs": a.refine_epochs}
    nodp = {**base, "epsilon": None}
    out = [
        {**base, "label": "pfedcdp", "epsilon": 5.0, "clip": 2.5, "bits": 8, "extractor_epochs": 1,
         "server_classifier": "public", "teacher_weights": "shapley"},
        {**nodp, "label": "pfedcdp_nodp"},
        {**nodp, "label": "pfedcdp_literal", "extractor_epochs": 0},
        {**nodp, "label": "pfedcdp_init_head", "server_classifier": "init"},
        {**nodp, "label": "pfedcdp_uniform", "teacher_weights": "uniform"},
        {**nodp, "label": "pfedcdp_fixed", "teacher_weights": "fixed"},
        {"name": "fedavg", "label": "fedavg"},
        {"name": "centralized", "label": "centralized"},
    ]
    if a.arms:
        unknown = sorted(set(a.arms) - {m["label"] for m in out})
        if unknown:
            raise SystemExit(f"--arms: unknown {unknown}; valid: {[m['label'] for m in out]}")
        out = [m for m in out if m["label"] in a.arms]
    return out


def min_size(a: argparse.Namespace, clients: int) -> int:
    if a.min_size is not None:
        return a.min_size
    return 10 if clients <= 20 else 2


def fl_config(a: argparse.Namespace, cbis: Path, mias: Path, clients: int, seed: int) -> dict[str, Any]:
    size = [a.image_size, a.image_size]
    common = {"name": "manifest", "column": "path", "num_classes": 2, "normalize": "zscore",
              "spatial_size": size, "cache": "memory"}
    return {
        "name": f"c{clients}_seed{seed}", "output_dir": str(a.out / "runs"), "overwrite": True,
        "seed": seed, "rounds": a.rounds, "num_clients": clients, "progress": False,
        "dataset": {**common, "path": str(cbis)},
        "use_official_split": True,
        "public_dataset": {**common, "path": str(mias), "test_fraction": 0.15, "use_official_split": False,
                           "group_column": "subject_id"},
        "partition": {"name": "dirichlet", "alpha": 0.5, "min_size": min_size(a, clients), "max_retries": 5000},
        "client_split": {"train": 0.8, "val": 0.0, "test": 0.2},
        "model": {"name": "pfedcdp_a"},
        "filters": [],
        "train": {"epochs": a.epochs, "batch_size": a.batch_size, "eval_batch_size": 128, "lr": a.lr,
                  "optimizer": a.optimizer, "momentum": 0.9, "weight_decay": 1e-4},
        "eval_splits": ["test", "global_test"],
        "eval_every": 1,
        "keep_checkpoints": 1,
        "methods": arms(a),
    }


# ------------------------------------------------------------------------------ data
def prepare_data(a: argparse.Namespace) -> tuple[Path, Path, dict[str, Any]]:
    """The private (CBIS-DDSM) and public (MIAS) manifests: given, or fixtures prepared here."""
    import pandas as pd

    from medfl.fixtures import generate

    info: dict[str, Any] = {}
    if a.cbis_dir is not None:
        cbis = a.cbis_dir / "manifest.csv"
        info["cbis"] = f"prepared data {a.cbis_dir}"
    else:
        tag = "roi_" if a.roi else ""
        raw, prep_dir = a.out / "data" / "cbis_ddsm_raw", a.out / "data" / f"cbis_ddsm_{tag}{a.image_size}"
        full = prep_dir / "manifest.csv"
        if not full.is_file():
            from medfl.prep.cbis_ddsm import main as prep

            t0 = time.perf_counter()
            generate("cbis_ddsm", raw, cases=a.cbis_cases, seed=a.fixture_seed, reference=False)
            roi = ["--roi-crops", "--roi-size", str(a.image_size), str(a.image_size)] if a.roi else []
            rc = prep(["--raw", str(raw), "--out", str(prep_dir), "--size", str(a.image_size), str(a.image_size),
                       "--overwrite", *roi])
            if rc:
                raise SystemExit(f"medfl.prep.cbis_ddsm failed ({rc})")
            log(f"CBIS-DDSM fixture: {a.cbis_cases} cases, prepared in {time.perf_counter() - t0:.0f} s")
        cbis = full
        if a.test_ratio > 0:
            cbis = subset_test(full, a.test_ratio, a.fixture_seed)
        info["cbis"] = f"fixture ({a.cbis_cases} cases, fixture seed {a.fixture_seed})"
    if a.mias_dir is not None:
        mias = a.mias_dir / "manifest.csv"
        info["mias"] = f"prepared data {a.mias_dir}"
    else:
        raw, prep_dir = a.out / "data" / "mias_raw", a.out / "data" / f"mias_bm_{'roi_' if a.roi else ''}{a.image_size}"
        mias = prep_dir / "manifest.csv"
        if not mias.is_file():
            from medfl.prep.mias import main as prep

            generate("mias", raw, cases=a.mias_cases, seed=a.fixture_seed, reference=False)
            rc = prep(["--raw", str(raw), "--out", str(prep_dir), "--size", str(a.image_size),
                       "--classes", "benign-malignant", "--overwrite", *(["--roi"] if a.roi else [])])
            if rc:
                raise SystemExit(f"medfl.prep.mias failed ({rc})")
        info["mias"] = f"fixture ({a.mias_cases} images, benign/malignant only)"
    m = pd.read_csv(cbis)
    split = m["split"] if "split" in m.columns else pd.Series(["train"] * len(m))
    info["cbis_counts"] = {s: {str(k): int(v) for k, v in g["label"].value_counts().sort_index().items()}
                           for s, g in m.groupby(split)}
    m = pd.read_csv(mias)  # its own split is ignored: the run draws public_test (use_official_split false)
    info["mias_counts"] = {str(k): int(v) for k, v in m["label"].value_counts().sort_index().items()}
    return cbis, mias, info


def subset_test(full: Path, ratio: float, seed: int) -> Path:
    """``manifest_test<ratio>.csv`` beside ``full``: its training rows and a subject-grouped,
    label-stratified draw of ``ratio`` x (training rows) of its test rows."""
    import numpy as np
    import pandas as pd

    out = full.with_name(f"manifest_test{ratio:.2f}.csv")
    if out.is_file():
        return out
    m = pd.read_csv(full, keep_default_na=False)
    train, test = m[m["split"] != "test"], m[m["split"] == "test"]
    want = min(len(test), int(round(ratio * len(train))))
    rng = np.random.default_rng(seed)
    keep: list[int] = []
    for _, g in test.groupby("label"):
        subjects = np.array(sorted(g["subject_id"].astype(str).unique()))
        rng.shuffle(subjects)
        target = int(round(want * len(g) / len(test)))
        n = 0
        for s in subjects:
            if n >= target:
                break
            rows = g.index[g["subject_id"].astype(str) == s]
            keep.extend(rows)
            n += len(rows)
    sub = pd.concat([train, m.loc[sorted(set(keep))]]).sort_index()
    sub.to_csv(out, index=False)
    return out


# ------------------------------------------------------------------------------ progress
def install_progress(verbose: bool) -> None:
    """A throwaway medfl plugin printing a line per method run (and per round with -v)."""
    from medfl import hookimpl
    from medfl.plugins import get_plugin_manager

    t0 = {"t": 0.0}

    class _Hooks:
        @hookimpl
        def on_run_start(self, run):  # noqa: ANN001
            t0["t"] = time.perf_counter()

        @hookimpl
        def on_round_end(self, run, round, metrics):  # noqa: ANN001, A002
            if verbose:
                log(f"    {Path(run.run_dir).name}: round {round} ({time.perf_counter() - t0['t']:.0f} s)")

        @hookimpl
        def on_run_end(self, run, summary):  # noqa: ANN001
            final = summary.get("final") or {}
            acc = {s: ((final.get(s) or {}).get("accuracy") or {}).get("mean") for s in ("local_test", "global_test")}
            log(f"  {Path(run.run_dir).parent.name}/{Path(run.run_dir).name}: {time.perf_counter() - t0['t']:.0f} s, "
                f"personalized accuracy local {_f(acc['local_test'])} global {_f(acc['global_test'])}")

    pm = get_plugin_manager()
    if pm.get_plugin("pfedcdp_compare_progress") is None:
        pm.register(_Hooks(), name="pfedcdp_compare_progress")


# ------------------------------------------------------------------------------ results
def _f(x: Any, nd: int = 3) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _mean(block: dict[str, Any] | None, split: str, metric: str) -> float | None:
    v = (((block or {}).get(split) or {}).get(metric) or {}).get("mean")
    return None if v is None or (isinstance(v, float) and math.isnan(v)) else float(v)


def read_run(run: Path, clients: int, seed: int) -> dict[str, Any]:
    s = json.loads((run / "summary.json").read_text())
    final, models = s.get("final") or {}, s.get("final_models") or {}
    rep = s.get("method_report") or {}
    comm = s.get("communication") or {}
    train = (comm.get("by_phase") or {}).get("train") or {}
    rounds = max(1, int(s["rounds"]))
    priv = s.get("privacy") or {}
    row: dict[str, Any] = {"clients": clients, "seed": seed, "arm": s.get("label") or run.name}
    for split in ("local_test", "global_test"):
        for metric in ("accuracy", "auc"):
            row[f"pers_{split}_{metric}"] = _mean(final, split, metric)
    student = models.get("student")
    for split in ("public_test", "global_test"):
        for metric in ("accuracy", "auc"):
            row[f"student_{split}_{metric}"] = _mean(student, split, metric)
    row["ensemble_public_test_accuracy"] = _mean(models.get("teacher_ensemble"), "public_test", "accuracy")
    for c in CLUSTERS:
        row[f"teacher_{c}_public_test_accuracy"] = _mean(models.get(f"teacher_{c}"), "public_test", "accuracy")
    row["epsilon"] = priv.get("epsilon") if priv.get("private") else None
    row["teacher_weights"] = rep.get("teacher_weights")
    row["teacher_weights_mode"] = rep.get("teacher_weights_mode")
    sh = rep.get("shapley") or {}
    row["shapley_values"] = sh.get("values")
    row["cluster_sizes"] = rep.get("cluster_sizes")
    row["mb_up_per_round"] = train.get("bytes_from_clients", 0) / rounds / 1e6 if train else None
    row["mb_down_per_round"] = train.get("bytes_to_clients", 0) / rounds / 1e6 if train else None
    row["wall_s"] = s.get("wall_time_s_last_session")
    row["public_label_counts"] = (s.get("public_dataset") or {}).get("label_counts")
    counts = (row["public_label_counts"] or {}).get("test")
    row["public_test_majority"] = max(counts) / sum(counts) if counts else None
    return row


def curves(run: Path) -> dict[str, dict[int, float]]:
    """Mean global_test accuracy per round of each cluster's clients (groups.csv)."""
    import pandas as pd

    g = pd.read_csv(run / "groups.csv", dtype={"client_id": str})
    m = pd.read_csv(run / "metrics.csv", dtype={"client_id": str})
    m = m[m["split"] == "global_test"].assign(group=lambda d: d["client_id"].map(dict(zip(g["client_id"], g["group"]))))
    return {str(c): {int(r): float(v) for r, v in part.groupby("round")["accuracy"].mean().items()}
            for c, part in m.groupby("group")}


def public_counts(rows: list[dict[str, Any]]) -> str:
    c = next((r["public_label_counts"] for r in rows if r.get("public_label_counts")), None)
    return "n/a" if not c else ", ".join(f"{k} {v}" for k, v in c.items())


def majority_rates(rows: list[dict[str, Any]], data_info: dict[str, Any]) -> dict[str, float]:
    """Accuracy of always predicting the larger class on public_test and global_test."""
    out = {}
    pub = [r["public_test_majority"] for r in rows if r.get("public_test_majority")]
    if pub:
        out["public_test"] = pub[0]
    test = (data_info.get("cbis_counts") or {}).get("test")
    if test:
        out["global_test"] = max(test.values()) / sum(test.values())
    return out


def pm(values: list[Any], nd: int = 3) -> str:
    vals = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not vals:
        return "n/a"
    if len(vals) == 1:
        return f"{vals[0]:.{nd}f}"
    return f"{statistics.fmean(vals):.{nd}f} ± {statistics.pstdev(vals):.{nd}f}"


def short_dict(d: dict[str, Any] | None, nd: int = 2) -> str:
    if not d:
        return "–"
    return " / ".join(f"{k[0].upper()} {v:.{nd}f}" if isinstance(v, float) else f"{k[0].upper()} {v}"
                      for k, v in d.items())


def table(rows: list[dict[str, Any]], labels: list[str], client_counts: list[int]) -> list[dict[str, str]]:
    out = []
    for n in client_counts:
        for lab in labels:
            g = [r for r in rows if r["clients"] == n and r["arm"] == lab]
            if not g:
                continue
            eps = [r["epsilon"] for r in g]
            is_cdp = g[0]["teacher_weights"] is not None
            out.append({
                "clients": str(n), "arm": lab,
                "pers local acc": pm([r["pers_local_test_accuracy"] for r in g]),
                "pers local AUC": pm([r["pers_local_test_auc"] for r in g]),
                "pers global acc": pm([r["pers_global_test_accuracy"] for r in g]),
                "pers global AUC": pm([r["pers_global_test_auc"] for r in g]),
                "student public acc": pm([r["student_public_test_accuracy"] for r in g]),
                "student public AUC": pm([r["student_public_test_auc"] for r in g]),
                "student global acc": pm([r["student_global_test_accuracy"] for r in g]),
                "student global AUC": pm([r["student_global_test_auc"] for r in g]),
                "ensemble public acc": pm([r["ensemble_public_test_accuracy"] for r in g]),
                "ε": "∞" if all(e is None for e in eps) else pm(eps, 2),
                "teacher weights (H/M/L)": " ; ".join(short_dict(r["teacher_weights"]) for r in g) if is_cdp else "–",
                "Shapley (H/M/L)": " ; ".join(short_dict(r["shapley_values"], 3) for r in g) if is_cdp else "–",
                "clusters (H/M/L)": " ; ".join(short_dict(r["cluster_sizes"]) for r in g) if is_cdp else "–",
                "MB/round up": pm([r["mb_up_per_round"] for r in g], 2),
                "MB/round down": pm([r["mb_down_per_round"] for r in g], 2),
                "wall s": pm([r["wall_s"] for r in g], 0),
            })
    return out


def markdown(tab: list[dict[str, str]]) -> str:
    cols = list(tab[0])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(r[c] for c in cols) + " |" for r in tab]
    return "\n".join(lines)


# ------------------------------------------------------------------------------ plots
def plot_curves(curve_data: dict[int, dict[str, list[dict[str, dict[int, float]]]]], sizes: dict[int, Any],
                path: Path, a: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    counts = sorted(curve_data)
    fig, axes = plt.subplots(1, len(counts), figsize=(5.2 * len(counts), 3.9), squeeze=False, sharey=True)
    colors = {"high": "tab:green", "medium": "tab:orange", "low": "tab:red"}
    names = {"high": "A (high)", "medium": "B (medium)", "low": "C (low)"}
    for ax, n in zip(axes[0], counts):
        for arm, style in (("pfedcdp", "-"), ("pfedcdp_nodp", "--")):
            per_seed = curve_data[n].get(arm) or []
            for c in CLUSTERS:
                series = [s[c] for s in per_seed if c in s]
                if not series:
                    continue
                rounds = sorted(set.intersection(*(set(s) for s in series)))
                ys = [statistics.fmean(s[r] for s in series) for r in rounds]
                size = (sizes.get(n) or {}).get(c, "?")
                label = f"{names[c]}, {size} clients" if arm == "pfedcdp" else None
                ax.plot(rounds, ys, style, marker="o" if arm == "pfedcdp" else None, ms=3, color=colors[c],
                        label=label, alpha=1.0 if arm == "pfedcdp" else 0.6)
        if curve_data[n].get("pfedcdp_nodp"):
            ax.plot([], [], "--", color="grey", label="dashed: pfedcdp_nodp")
        ax.axhline(0.5, ls=":", color="grey", alpha=0.7)
        ax.set_title(f"{n} clients: pfedcdp (ε 5), mean global_test accuracy", fontsize=9)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].set_ylabel("accuracy (mean over the cluster's clients)")
    fig.suptitle(f"Per-cluster global accuracy (paper Fig. 2) on the CBIS-DDSM fixture,\n{a.rounds} rounds, "
                 f"seed(s) {a.seeds}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_teachers(rows: list[dict[str, Any]], counts: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bars = ["student", *(f"teacher_{c}" for c in CLUSTERS), "teacher_ensemble"]
    keys = {"student": "student_public_test_accuracy", "teacher_ensemble": "ensemble_public_test_accuracy",
            **{f"teacher_{c}": f"teacher_{c}_public_test_accuracy" for c in CLUSTERS}}
    colors = ["tab:blue", "tab:green", "tab:orange", "tab:red", "tab:purple"]
    fig, axes = plt.subplots(1, len(counts), figsize=(5.5 * len(counts), 3.9), squeeze=False, sharey=True)
    for ax, n in zip(axes[0], counts):
        for i, (mode, arm) in enumerate(WEIGHT_ARMS.items()):
            g = [r for r in rows if r["clients"] == n and r["arm"] == arm]
            for j, b in enumerate(bars):
                vals = [r[keys[b]] for r in g if r[keys[b]] is not None]
                if not vals:
                    continue
                x = i + (j - 2) * 0.16
                ax.bar(x, statistics.fmean(vals), width=0.15, color=colors[j], label=b if i == 0 else None)
            ax.text(i, 0.02, " / ".join(f"{v:.2f}" for v in (g[0]["teacher_weights"] or {}).values()) if g else "",
                    ha="center", fontsize=7, rotation=0)
        ax.set_xticks(range(len(WEIGHT_ARMS)))
        ax.set_xticklabels([f"{m}\n({a})" for m, a in WEIGHT_ARMS.items()], fontsize=8)
        major = [r["public_test_majority"] for r in rows if r["clients"] == n and r["public_test_majority"]]
        if major:
            ax.axhline(major[0], ls=":", color="black", label=f"majority class ({major[0]:.3f})" if n == counts[-1]
                       else None)
        ax.set_ylim(0, 1.05)
        ax.set_title(f"{n} clients: public_test accuracy (weights H/M/L at the bottom)", fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].set_ylabel("accuracy")
    axes[0][-1].legend(fontsize=7, loc="upper right")
    fig.suptitle("Post-hoc refinement without DP: student vs teachers vs weighted ensemble\n"
                 "on the MIAS fixture's public_test, per teacher-weight mode", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results, data and runs (default "
                   "experiments/results/pfedcdp/)")
    p.add_argument("--cbis-dir", type=Path, default=None, help="a prepared CBIS-DDSM (medfl.prep.cbis_ddsm output); "
                   "default: a generated fixture")
    p.add_argument("--mias-dir", type=Path, default=None, help="a prepared benign/malignant MIAS "
                   "(medfl.prep.mias --classes benign-malignant output); default: a generated fixture")
    p.add_argument("--cbis-cases", type=int, default=2000, help="CBIS-DDSM fixture mammograms (default 2000; "
                   "half of them in the official test split)")
    p.add_argument("--mias-cases", type=int, default=800, help="MIAS fixture images (default 800; about 45 %% "
                   "benign or malignant)")
    p.add_argument("--fixture-seed", type=int, default=0, help="seed of the fixtures and the test subset (default 0)")
    p.add_argument("--test-ratio", type=float, default=1 / 3,
                   help="fixture only: keep this many official-test images per training image (default 1/3, about "
                        "the real CBIS-DDSM's 772/2326; 0 keeps all)")
    p.add_argument("--image-size", type=int, default=32, help="image side of both datasets (default 32)")
    p.add_argument("--whole-images", dest="roi", action="store_false",
                   help="whole mammograms instead of lesion crops (CBIS-DDSM --roi-crops, MIAS --roi; the "
                        "default): at 32 px a whole mammogram's lesion is a few pixels")
    p.add_argument("--clients", type=int, nargs="+", default=[10, 50], help="client counts (default 10 50)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 10; paper 20)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="run seeds (default 0)")
    p.add_argument("--epochs", type=int, default=1, help="local epochs per round (default 1; paper 20)")
    p.add_argument("--batch-size", type=int, default=16, help="batch size (default 16)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd", help="local optimizer (default sgd, "
                   "momentum 0.9; the paper does not say)")
    p.add_argument("--lr", type=float, default=0.01, help="local learning rate (default 0.01)")
    p.add_argument("--refine-epochs", type=int, default=5, help="PFedCDP's post-hoc epochs (default 5)")
    p.add_argument("--min-size", type=int, default=None,
                   help="partition min_size for every client count (default 10 up to 20 clients, else 2)")
    p.add_argument("--arms", nargs="+", default=None, help="run only these arms (labels; default all)")
    p.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, 10 clients, arms pfedcdp, "
                   "pfedcdp_nodp, pfedcdp_uniform, pfedcdp_fixed, fedavg")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1; 0: torch's choice)")
    p.add_argument("--rerun", action="store_true", help="rerun experiments whose runs are already in --out/runs")
    p.add_argument("-v", "--verbose", action="store_true", help="a line per round too")
    p.add_argument("--smoke", action="store_true",
                   help="the test suite's run (tests/test_experiments.py): --quick with 300 CBIS-DDSM and 120 MIAS "
                   "fixture images at 16 px, 4 clients, arms pfedcdp and fedavg, no refinement; it checks that "
                   "the script runs, its numbers are no evidence")
    a = p.parse_args(argv)
    if a.smoke:
        a.quick, a.cbis_cases, a.mias_cases, a.image_size, a.clients = True, 300, 120, 16, [4]
        a.arms, a.refine_epochs, a.seeds = a.arms or ["pfedcdp", "fedavg"], 0, [0]
    if a.quick:
        a.rounds = a.rounds or 2
        a.clients = [10] if a.clients == [10, 50] else a.clients
        a.arms = a.arms or ["pfedcdp", "pfedcdp_nodp", "pfedcdp_uniform", "pfedcdp_fixed", "fedavg"]
    a.rounds = a.rounds or 10
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MEDFL_NO_PROGRESS", "1")
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from medfl.config import resolve_config
    from medfl.experiment import run_experiment
    from medfl.plugins import registry

    registry()
    install_progress(a.verbose)
    t_all = time.perf_counter()
    cbis, mias, data_info = prepare_data(a)
    log(f"data: private {cbis} {data_info['cbis_counts']}; public {mias} {data_info['mias_counts']}")
    labels = [m["label"] for m in arms(a)]
    rows: list[dict[str, Any]] = []
    curve_data: dict[int, dict[str, list[dict[str, dict[int, float]]]]] = {}
    sizes: dict[int, Any] = {}
    reused: list[str] = []
    for n in a.clients:
        for seed in a.seeds:
            exp = a.out / "runs" / f"c{n}_seed{seed}"
            if all((exp / lab / "summary.json").is_file() for lab in labels) and not a.rerun:
                log(f"{exp.name}: reusing {exp} (--rerun to redo)")
                reused.append(exp.name)
            else:
                log(f"{exp.name}: {len(labels)} arms, {a.rounds} rounds ...")
                t0 = time.perf_counter()
                exp = Path(run_experiment(resolve_config(fl_config(a, cbis, mias, n, seed)))["dir"])
                log(f"{exp.name}: done in {time.perf_counter() - t0:.0f} s")
            for lab in labels:
                rows.append(read_run(exp / lab, n, seed))
                if lab in ("pfedcdp", "pfedcdp_nodp"):
                    curve_data.setdefault(n, {}).setdefault(lab, []).append(curves(exp / lab))
                if lab == "pfedcdp" and n not in sizes:
                    sizes[n] = rows[-1]["cluster_sizes"]

    import pandas as pd

    flat = [{k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in r.items()} for r in rows]
    pd.DataFrame(flat).to_csv(a.out / "per_seed.csv", index=False)
    tab = table(rows, labels, a.clients)
    pd.DataFrame(tab).to_csv(a.out / "table.csv", index=False)
    plots = []
    if any("pfedcdp" in d for d in curve_data.values()):
        plot_curves(curve_data, sizes, a.out / "cluster_curves.png", a)
        plots.append("cluster_curves.png")
    if any(r["arm"] in WEIGHT_ARMS.values() for r in rows):
        plot_teachers(rows, a.clients, a.out / "teachers_public.png")
        plots.append("teachers_public.png")
    wall = time.perf_counter() - t_all
    cmd = " ".join(["python experiments/pfedcdp_compare.py", *(argv if argv is not None else sys.argv[1:])])
    md = [
        "# PFedCDP: ablations, FedAvg and centralized on the CBIS-DDSM / MIAS fixtures "
        "(experiments/pfedcdp_compare.py)",
        "",
        f"`{cmd}`",
        f"({time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch thread(s), "
        f"{wall / 60:.1f} min this invocation"
        + (f", the runs of {reused} reused from an earlier one" if reused else "")
        + f"; the runs' own wall time {sum(r['wall_s'] or 0 for r in rows) / 60:.1f} min in all)",
        "",
        f"Private: CBIS-DDSM {data_info['cbis']}, {a.image_size}x{a.image_size}, label counts by split "
        f"{data_info['cbis_counts']}; Dirichlet 0.5, min_size {[min_size(a, n) for n in a.clients]} for "
        f"{a.clients} clients, each client's rows 80/20 train/local test; the official test split is "
        f"global_test. Public: MIAS {data_info['mias']}, label counts {data_info['mias_counts']}, 15 % of "
        f"the women drawn as public_test (label counts as drawn: {public_counts(rows)}). {a.rounds} rounds of {a.epochs} local epoch(s), batch "
        f"{a.batch_size}, SGD lr {a.lr} momentum 0.9; PFedCDP capabilities drawn (seeded), refine_epochs "
        f"{a.refine_epochs}; seeds {a.seeds}.",
        "",
        "`pers` = the personalized models of the method (PFedCDP: each client's own extractor and "
        "classifier; FedAvg / centralized: the global model), mean over clients of the final round "
        "(`summary.json` `final`); `student` = the post-hoc student (`final_models`), `ensemble` = the "
        "weighted teacher ensemble; ε = the worst client's spent ε (∞: no DP); MB/round = the `train` "
        "phase of the `communication` block divided by the rounds (up: all clients' replies; down: the "
        "instructions); wall s = the run's own time.",
        "",
        markdown(tab),
        "",
        "Constant predictors: always predicting the majority class scores "
        + ", ".join(f"{k} {v:.3f}" for k, v in majority_rates(rows, data_info).items())
        + " (accuracy at or near these values with an AUC near 0.5 means the model has learnt nothing).",
        "",
        "## What this fixture can show, and what it cannot",
        "",
        "Synthetic fixture images carry a planted class signal: absolute accuracies say nothing "
        "about real mammograms (and at this image size and budget even centralized training learns it "
        "only partly: compare every row with `centralized` and with the majority-class rates). The comparisons that carry over are relative, between arms that share "
        "the partition, the clusters and the initialisations: DP's noise against no DP, the literal "
        "Algorithm 1 (extractor_epochs 0) against a trained extractor, a fitted against an untrained server "
        "classifier, and the teacher-weight modes. Cluster sizes come from the seeded capability draw.",
        "",
        f"Plots: {', '.join(plots) or 'none'}.",
        "",
    ]
    (a.out / "table.md").write_text("\n".join(md))
    (a.out / "table.json").write_text(json.dumps(
        {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}, "data": data_info,
         "table": tab, "rows": rows, "cluster_curves": {str(k): v for k, v in curve_data.items()}, "wall_s": wall},
        indent=2, default=str))
    log("")
    log(markdown(tab))
    log(f"\ntotal {wall / 60:.1f} min; wrote {a.out}/table.csv, table.json, table.md, per_seed.csv, "
        + ", ".join(plots))
    return 0


if __name__ == "__main__":
    sys.exit(main())
