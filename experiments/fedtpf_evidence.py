#!/usr/bin/env python
"""FedTPF's mechanisms at the paper's settings, over seeds (issue 37): does the stop condition
fire, does eq. 8's weight move below 1, does FedTPF differ from FedFed, do FedTPF/FedFed beat
FedAvg where shared features should help.

Arms (method entries; every arm of one setting and seed shares the split and the task model's
initialisation):

``fedavg``          no shared set;
``fedfed``          FedFed at the paper's noise (variance ``--noise-variance`` on unclipped
                    ``x_s``, not private), stage 1 of exactly ``--distill-rounds`` rounds;
``fedtpf_paper``    FedTPF's ``"paper"`` preset (noise variance 0.15, stop condition 90 % +- 2 %,
                    cosine < 0.15, window 3, change <= 5 %, eq. 8 as printed, lambda 1), stage 1
                    capped at ``--distill-rounds`` (T_d is not in the paper);
``fedtpf_fixture``  the same preset with a stop criterion this fixture can reach (``--criterion``,
                    stated in every table): the mechanisms shown acting, NOT the paper's criterion;
``fedtpf_dp``       medfl's default FedTPF (the DP release at epsilon 8, clip 5; the paper's stop
                    criterion): to show its warnings and that its shared features carry no signal.

Settings (``--settings``): ``label_skew_2`` (#C=2: every client holds two classes, where shared
features should help most) and ``dirichlet_0.3`` (also ``dirichlet_0.1``, ``dirichlet_1.0``,
``subset``), each with ``--seeds`` seeds (the seed draws the split, the validation split, the
initialisations and the training order; the fixture is fixed). Data: the PathMNIST fixture
(``medfl.fixtures``, ``--cases`` tiles, 70/10/20 official split; the official test split is the
global test set), ``--clients`` clients all sampled every round (``--fraction``), each client's
data split train/val ``1 - --val`` / ``--val`` so that every client has enough validation tiles
for the stop condition (its accuracy is read on them). Model ``small_cnn`` width 8 at 28 x 28, SGD
lr 0.05, batch 32, one epoch a round, ``--rounds`` rounds, every round evaluated.

Writes to ``--out`` (default ``experiments/results/fedtpf_evidence/``), per setting
``<setting>/``: ``arms_table.md/.csv`` and ``arms_curves.csv/.png`` (:mod:`medfl.arm_report`:
each arm at its best validation round, ``local_val`` accuracy, mean +- population std over
seeds, the per-round curves beside it), ``last_mean/arms_table.md`` (the mean of the last
``--last`` rounds); and over all settings: ``paired.md/.csv`` (per-seed differences of
global-test accuracy at each arm's best validation round: FedTPF/FedFed - FedAvg, FedTPF -
FedFed, FedTPF/FedFed - ``fedtpf_dp`` (whose shared features are mostly noise: what the features
add beyond the shared labels), and the largest per-round difference of the two curves),
``mechanisms.md/.csv`` (what each mechanism did, from every run's ``mechanisms.csv`` and
``summary.json``, mean +- std over seeds; ``mechanisms_runs.csv`` per run),
``mechanisms_curves.csv`` and ``mechanisms.png`` (per stage-1 round: the residual classifier's
accuracy on ``x_p``, the cosine, the clients stopped, eq. 8's smallest weight), and with
``--ceiling`` ``ceiling.md/.csv``: what accuracy on ``x_p`` is reachable at all (a fresh
classifier of the task model's architecture trained centrally on the pooled client tiles, tested
on the global test set, on ``x``, ``x + n``, the final distillation model's ``x_s`` and
``x_s + n``, beside the federated residual classifier itself on ``x_s + n``). ``--report-only``
rewrites the tables from the runs already there. Runs already finished are not run again.

The figures in experiments/README.md were made with (on 2 shared CPU cores: about 50 minutes;
the stage-1 cap of 20 rounds about 35 and 10 minutes; the ceiling probe about 10)::

    python experiments/fedtpf_evidence.py --settings label_skew_2
    python experiments/fedtpf_evidence.py --settings dirichlet_0.3 --arms fedavg fedfed fedtpf_paper fedtpf_fixture
    python experiments/fedtpf_evidence.py --report-only
    python experiments/fedtpf_evidence.py --settings dirichlet_1.0 --arms fedavg fedtpf_paper fedfed \\
        --distill-rounds 20 --rounds 26 --out experiments/results/fedtpf_evidence_long
    python experiments/fedtpf_evidence.py --settings dirichlet_1.0 --arms fedtpf_fixture \\
        --distill-rounds 20 --rounds 26 --out experiments/results/fedtpf_evidence_long_fixture
    python experiments/fedtpf_evidence.py --seeds 100 --rounds 7 --arms fedtpf_paper fedtpf_fixture \\
        --criterion '{"target_accuracy": 0.5, "tolerance": 0.0, "window": 2, "max_change": 0.2, "max_cosine": 0.6}' \\
        --ceiling --out experiments/results/fedtpf_calib
    python experiments/fedtpf_evidence.py --texture 50 --settings dirichlet_1.0 \\
        --arms fedavg fedfed fedtpf_paper --distill-rounds 14 --rounds 20 \\
        --out experiments/results/fedtpf_texture_dirichlet_1.0
    (and the same with dirichlet_0.3 and label_skew_2, each with its own --out)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from fedtpf_compare import ROOT, SPLITS, _fixture
from medfl.arm_report import arm_scores, write_arm_report
from medfl.config import resolve_config
from medfl.experiment import run_experiment

ARMS = ("fedavg", "fedfed", "fedtpf_paper", "fedtpf_fixture", "fedtpf_dp")
#: the arms with a distillation model (a mechanisms.csv and a method_report)
VAE_ARMS = ("fedfed", "fedtpf_paper", "fedtpf_fixture", "fedtpf_dp")
#: the comparisons of paired.md: (arm, reference)
PAIRS = (("fedfed", "fedavg"), ("fedtpf_paper", "fedavg"), ("fedtpf_fixture", "fedavg"), ("fedtpf_dp", "fedavg"),
         ("fedtpf_paper", "fedfed"), ("fedtpf_fixture", "fedfed"), ("fedtpf_fixture", "fedtpf_paper"),
         ("fedtpf_paper", "fedtpf_dp"), ("fedfed", "fedtpf_dp"))
#: short names of medfl.losses.feature_distill.STOP_CRITERIA in mechanisms.md
UNMET = {"too few evaluations": "too few", "residual accuracy below target - tolerance": "acc<target",
         "cosine(x_r, x_s) not below max_cosine": "cos>=max",
         "residual accuracy moved more than max_change": "acc moved", "cosine moved more than max_change": "cos moved"}
#: the steps after which ceiling.md also reads the x_s + n classifier (a federated client makes 60 a round)
CEILING_AT = (60, 180)
#: the arms whose final distillation model ceiling.md measures (the first also fits x and x + n)
CEILING_ARMS = ("fedtpf_paper", "fedfed")
#: the stop criterion of ``fedtpf_fixture`` unless ``--criterion`` says otherwise
FIXTURE_CRITERION = {"target_accuracy": 0.5, "tolerance": 0.0, "window": 2, "max_change": 0.2, "max_cosine": 0.5}


# ---------------------------------------------------------------------------------------------- runs
def arms(a: argparse.Namespace) -> list[dict[str, Any]]:
    """The method entries (labels are the arm names), those of ``--arms`` only."""
    d = {"distill_rounds": a.distill_rounds, "distill_steps": a.distill_steps}
    noise = {"noise": {"variance": a.noise_variance}, "epsilon": None}
    entries = {
        "fedavg": {"name": "fedavg", "label": "fedavg"},
        "fedfed": {"name": "fedfed", "label": "fedfed", **d, **noise},
        "fedtpf_paper": {"name": "fedtpf", "label": "fedtpf_paper", "preset": "paper", **d, **noise},
        "fedtpf_fixture": {"name": "fedtpf", "label": "fedtpf_fixture", "preset": "paper", **d, **noise,
                           **a.criterion},
        "fedtpf_dp": {"name": "fedtpf", "label": "fedtpf_dp", **d},
    }
    return [entries[k] for k in ARMS if k in a.arms]


def fixture_words(a: argparse.Namespace) -> str:
    """The fixture in words, for the tables' titles."""
    grating = (f" with a class-oriented grating of {a.texture:g} grey levels, period {a.texture_period:g} px"
               if a.texture else "")
    return f"PathMNIST fixture of {a.cases} tiles{grating}"


def run_dir(a: argparse.Namespace, setting: str, seed: int) -> Path:
    return a.out / "runs" / f"{setting}_s{seed}"


def fl_config(a: argparse.Namespace, data: Path, setting: str, seed: int) -> dict[str, Any]:
    return {"name": f"{setting}_s{seed}", "output_dir": str(a.out / "runs"), "seed": seed, "rounds": a.rounds,
            "num_clients": a.clients, "fraction": a.fraction, "progress": False, "overwrite": True,
            "eval_every": 1, "plots": False,
            "dataset": {"name": "manifest", "path": str(data / "manifest.csv"), "column": "path",
                        "num_classes": 9, "cache": "memory"},
            "partition": SPLITS[setting], "client_split": {"train": 1.0 - a.val, "val": a.val},
            "eval_splits": ["val", "global_test"], "model": {"name": "small_cnn", "width": 8},
            "train": {"epochs": 1, "batch_size": 32, "eval_batch_size": 256, "lr": a.lr},
            "methods": arms(a)}


#: written in an arm's run directory when the content guard stopped it (the reason inside)
REFUSED = "refused_by_guard.txt"


def finished(run: Path) -> bool:
    return (run / "summary.json").is_file()


def refused(run: Path) -> str | None:
    """Why the content guard stopped the arm's run (at its release round), or None."""
    path = run / REFUSED
    return path.read_text().strip() if path.is_file() else None


def run_all(a: argparse.Namespace, data: Path) -> None:
    """Every (setting, seed) experiment whose arms have not all finished. An arm whose
    release the content guard refuses (x_s + n still a noisy copy of a client's images:
    the run stops at its release round) is recorded as refused (``refused_by_guard.txt``
    with the reason) and the other arms of that seed still run; the tables count the seeds
    that finished and ``refused.md`` lists the refusals."""
    from medfl.messages import PayloadError

    for setting in a.settings:
        for seed in a.seeds:
            exp = run_dir(a, setting, seed)
            if all(finished(exp / k) or refused(exp / k) for k in a.arms):
                print(f"{exp.name}: done already", flush=True)
                continue
            t0 = time.time()
            while True:
                cfg = fl_config(a, data, setting, seed)
                cfg["methods"] = [m for m in cfg["methods"] if not refused(exp / m["label"])]
                try:
                    run_experiment(resolve_config(cfg))
                    break
                except PayloadError as exc:   # the guard stopped one arm: note it, run the others
                    arm = next(k for k in a.arms if (exp / k).is_dir() and not finished(exp / k)
                               and not refused(exp / k))
                    (exp / arm / REFUSED).write_text(f"{exc}\n")
                    print(f"{exp.name}: {arm} stopped by the content guard: {exc}", flush=True)
            print(f"{exp.name}: {time.time() - t0:.0f} s", flush=True)


def refusals_report(a: argparse.Namespace) -> None:
    """``refused.md``: every arm and seed the content guard stopped, with the reason."""
    lines = []
    for setting in a.settings:
        for seed in a.seeds:
            for arm in a.arms:
                why = refused(run_dir(a, setting, seed) / arm)
                if why:
                    lines.append(f"| {setting} | {seed} | {arm} | {why.splitlines()[0][:400]} |")
    path = a.out / "refused.md"
    if lines:
        path.write_text("Arms the content guard stopped at their release round (x_s + n a noisy copy of a "
                        "client's images); the tables count only the seeds that finished.\n\n"
                        "| setting | seed | arm | reason |\n|---|---|---|---|\n" + "\n".join(lines) + "\n")
    elif path.exists():
        path.unlink()


# ---------------------------------------------------------------------------------------------- mechanisms
def _read_mechanisms(run: Path) -> pd.DataFrame:
    log = pd.read_csv(run / "mechanisms.csv", dtype={"id": str, "text": str}, keep_default_na=False)
    log["value"] = pd.to_numeric(log["value"].replace("", np.nan), errors="coerce")
    return log


def _client_rows(log: pd.DataFrame, mechanism: str) -> pd.DataFrame:
    """``mechanism``'s client rows as a table: ``round, id`` and one column per name."""
    part = log[(log["mechanism"] == mechanism) & (log["scope"] == "client")]
    if part.empty:
        return pd.DataFrame(columns=["round", "id"])
    num = part.pivot_table(index=["round", "id"], columns="name", values="value", aggfunc="first")
    txt = part[part["text"] != ""].pivot_table(index=["round", "id"], columns="name", values="text",
                                               aggfunc="first")
    if txt.empty:
        return num.reset_index()
    return num.reset_index().merge(txt.reset_index(), on=["round", "id"], how="outer", suffixes=("", "_text"))


def _warning_kind(text: str) -> str:
    if "more noise than signal" in text or "mostly noise" in text:
        return "noise"
    if "stayed at chance" in text:
        return "chance(stop)"
    if "at chance" in text:
        return "chance(x_p)"
    if "has not reached" in text:
        return "target"
    if "ended at the cap" in text:
        return "cap"
    return "other"


def _last_or_nan(series: pd.Series) -> float:
    return float(series.iloc[-1]) if len(series) else math.nan


def mechanism_run(run: Path) -> tuple[dict[str, Any], pd.DataFrame]:
    """One VAE run's mechanism observables (a row) and its per-round trajectory."""
    s = json.loads((run / "summary.json").read_text())
    rep = s.get("method_report", {})
    cfg = json.loads((run / "config.json").read_text())["method_hparams"]
    log = _read_mechanisms(run)
    stop = _client_rows(log, "stop_condition")
    decay = _client_rows(log, "decay")
    mix = _client_rows(log, "mix")
    stops = rep.get("stop_rounds", {})
    stopped = sorted(int(v) for v in stops.values() if isinstance(v, int))
    capped = sum(1 for v in stops.values() if v == "cap")
    target = cfg.get("target_accuracy", math.nan) - cfg.get("tolerance", 0.0)   # FedFed has no stop condition
    val = stop.dropna(subset=["residual_accuracy_x_p"]) if "residual_accuracy_x_p" in stop else stop.iloc[0:0]
    nan = pd.Series(dtype=float)
    means = (val.groupby("round")[["residual_accuracy_x_p", "residual_accuracy_x_s", "cosine"]].mean()
             if len(val) else pd.DataFrame({"residual_accuracy_x_p": nan, "residual_accuracy_x_s": nan, "cosine": nan}))
    alpha = decay["alpha"] if "alpha" in decay else nan
    # each client's own classifier on its training batches while it distils (before averaging)
    local = (decay.dropna(subset=["train_accuracy_x_p"]).groupby("round")["train_accuracy_x_p"].mean()
             if "train_accuracy_x_p" in decay else nan)
    frozen = decay[decay["frozen"] == 1] if "frozen" in decay else decay.iloc[0:0]
    last = rep.get("stop_condition", {}).get("last", {})
    unmet_last = Counter(r.get("unmet") for cid, r in last.items() if not isinstance(stops.get(cid), int))
    release = rep.get("release", {})
    kinds = Counter(_warning_kind(w["warning"]) for w in s.get("warnings", []))
    trans = rep.get("transition", {})
    row: dict[str, Any] = {
        "clients": len(stops) or s.get("num_clients"),
        "stopped": len(stopped) if cfg.get("stop_condition") else math.nan,
        "capped": capped if cfg.get("stop_condition") else math.nan,
        "stop_round_mean": float(np.mean(stopped)) if stopped else math.nan,
        "stop_rounds": ",".join(str(v) for v in sorted(stops.values(), key=lambda v: (isinstance(v, str), str(v)))
                                ) if cfg.get("stop_condition") else "-",
        "stage1_rounds": trans.get("after_round"),
        "min_alpha": rep.get("decay", {}).get("min_alpha") if cfg.get("decay") else math.nan,
        "alpha_below_1": int((alpha < 1 - 1e-12).sum()) if cfg.get("decay") else math.nan,
        "alpha_mean_frozen": float(frozen["alpha"].mean()) if len(frozen) and "alpha" in frozen else math.nan,
        "acc_x_p_best_mean": _last_or_nan(means["residual_accuracy_x_p"].sort_values()),
        "acc_x_p_max": float(val["residual_accuracy_x_p"].max()) if len(val) else math.nan,
        "local_acc_x_p_last": _last_or_nan(local),
        "acc_x_p_last": _last_or_nan(means["residual_accuracy_x_p"]),
        "acc_x_s_last": _last_or_nan(means["residual_accuracy_x_s"]),
        "cosine_last": _last_or_nan(means["cosine"]),
        "cosine_min": float(val["cosine"].min()) if len(val) else math.nan,
        "val_reaching_target": float((val["residual_accuracy_x_p"] >= target).mean()) if len(val) else math.nan,
        "val_below_max_cosine": (float((val["cosine"] < cfg.get("max_cosine", math.nan)).mean()) if len(val)
                                 else math.nan),
        "unmet_last": "; ".join(f"{UNMET.get(k, k)} x{n}" for k, n in unmet_last.most_common()) if unmet_last else "-",
        "release_noise_to_signal": release.get("noise_to_signal"),
        "x_s_to_x_norm": release.get("x_s_to_x_norm"),
        "shared_fraction": float(mix["shared_fraction"].mean()) if "shared_fraction" in mix else math.nan,
        "private": s["privacy"].get("private"),
        "epsilon": s["privacy"].get("epsilon") if s["privacy"].get("private") else None,
        "warnings": ", ".join(f"{k} x{n}" if n > 1 else k for k, n in sorted(kinds.items())) or "-",
    }
    # per stage-1 round: accuracy, cosine, clients stopped, eq. 8's weights
    rounds = sorted(set(decay["round"]) if len(decay) else set())
    traj = []
    conv = log[(log["mechanism"] == "stop_condition") & (log["scope"] == "run") & (log["name"] == "converged")]
    used = log[(log["mechanism"] == "decay") & (log["scope"] == "run") & (log["name"] == "delta_perf_used")]
    for r in rounds:
        v = val[val["round"] == r]
        d = decay[decay["round"] == r]
        c = conv[conv["round"] == r]["value"]
        u = used[used["round"] == r]["value"]
        traj.append({"round": r,
                     "acc_x_p_mean": float(v["residual_accuracy_x_p"].mean()) if len(v) else math.nan,
                     "acc_x_p_max": float(v["residual_accuracy_x_p"].max()) if len(v) else math.nan,
                     "local_acc_x_p_mean": float(local.get(r, math.nan)),
                     "acc_x_s_mean": float(v["residual_accuracy_x_s"].mean()) if len(v) else math.nan,
                     "cosine_mean": float(v["cosine"].mean()) if len(v) else math.nan,
                     "stopped": float(c.iloc[0]) if len(c) else math.nan,
                     "frozen": float((d["frozen"] == 1).sum()) if "frozen" in d else math.nan,
                     "alpha_min": float(d["alpha"].min()) if "alpha" in d and len(d) else math.nan,
                     "delta_perf_used": float(u.iloc[0]) if len(u) else math.nan})
    return row, pd.DataFrame(traj)


NUMERIC = ("stopped", "capped", "stop_round_mean", "stage1_rounds", "min_alpha", "alpha_below_1",
           "alpha_mean_frozen", "local_acc_x_p_last", "acc_x_p_best_mean", "acc_x_p_max", "acc_x_p_last",
           "acc_x_s_last", "cosine_last", "cosine_min", "val_reaching_target", "val_below_max_cosine",
           "release_noise_to_signal", "x_s_to_x_norm", "shared_fraction")
TEXT = ("stop_rounds", "unmet_last", "warnings")
#: mechanisms.md's three tables per setting
GROUPS = (("Stop condition and eq. 8's decay", ("stopped", "capped", "stop_rounds", "stop_round_mean", "stage1_rounds",
                                                 "min_alpha", "alpha_below_1", "alpha_mean_frozen", "unmet_last")),
          ("The residual classifier on the clients' validation splits",
           ("local_acc_x_p_last", "acc_x_p_best_mean", "acc_x_p_max", "acc_x_p_last", "acc_x_s_last",
            "cosine_last", "cosine_min", "val_reaching_target", "val_below_max_cosine")),
          ("The release and stage 2", ("release_noise_to_signal", "x_s_to_x_norm", "shared_fraction", "warnings")))


def _pm(values: list[float], digits: int = 3) -> str:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if not len(v):
        return "-"
    return f"{v.mean():.{digits}f} ± {v.std(ddof=0):.{digits}f}"


def mechanisms_report(a: argparse.Namespace) -> None:
    rows, trajs = [], []
    for setting in a.settings:
        for seed in a.seeds:
            for arm in (k for k in VAE_ARMS if k in a.arms):
                run = run_dir(a, setting, seed) / arm
                if not finished(run):
                    continue
                row, traj = mechanism_run(run)
                rows.append({"setting": setting, "arm": arm, "seed": seed, **row})
                trajs.append(traj.assign(setting=setting, arm=arm, seed=seed))
    if not rows:
        return
    runs = pd.DataFrame(rows)
    runs.to_csv(a.out / "mechanisms_runs.csv", index=False)
    curves = pd.concat(trajs, ignore_index=True)
    curves.to_csv(a.out / "mechanisms_curves.csv", index=False)
    agg = []
    for (setting, arm), g in runs.groupby(["setting", "arm"], sort=False):
        out: dict[str, Any] = {"setting": setting, "arm": arm, "seeds": len(g)}
        for k in NUMERIC:
            vals = pd.to_numeric(g[k], errors="coerce").tolist()
            out[k] = _pm(vals, 2 if k in ("stopped", "capped", "stop_round_mean", "stage1_rounds", "alpha_below_1")
                         else 3)
        for k in TEXT:
            out[k] = " / ".join(str(x) for x in g[k])
        agg.append(out)
    table = pd.DataFrame(agg)
    table.to_csv(a.out / "mechanisms.csv", index=False)
    crit = ", ".join(f"{k} {v}" for k, v in a.criterion.items())
    legend = [
        f"# What FedTPF's and FedFed's mechanisms did ({len(a.seeds)} seeds: mean ± population std; "
        "text columns: one entry per seed, ` / ` between seeds)", "",
        f"fedtpf_fixture's stop criterion (NOT the paper's): {crit}. fedtpf_paper: target 0.9 - 0.02, cosine < 0.15, "
        f"window 3, change <= 0.05. Stage 1 capped at {a.distill_rounds} rounds; {a.clients} clients, all sampled. "
        f"Data: {fixture_words(a)}.",
        "",
        "stopped/capped: clients that met the stop condition before the cap / that reached it; stop_rounds: each "
        "client's stop round (the validation after that round met it) or 'cap'; stage1_rounds: the round stage 1 "
        "ended; min_alpha: eq. 8's smallest weight; alpha_below_1: client-rounds aggregated with a weight < 1; "
        "alpha_mean_frozen: the mean weight of stopped clients' models; local_acc_x_p_last: each distilling client's "
        "own residual classifier on its training batches during its last stage-1 round (mean over clients), before "
        "averaging; acc_x_p_*: the global residual classifier's "
        "accuracy on x_p on the clients' val splits (best and last round of the mean over clients, max over clients "
        "and rounds); val_reaching_target / val_below_max_cosine: share of (client, validation) pairs meeting the "
        "accuracy / cosine criterion; unmet_last: first unmet criterion at the last validation of the clients that "
        "never stopped (acc<target: accuracy below target - tolerance; cos>=max: cosine not below max_cosine; "
        "acc/cos moved: more than max_change over the window); release_noise_to_signal: noise norm / signal norm of "
        "the released x_p; x_s_to_x_norm: |x_s| / |x|; shared_fraction: shared samples' share of a stage-2 epoch; "
        "warnings: kinds said.", ""]
    parts = []
    for setting, g in table.groupby("setting", sort=False):
        parts += [f"## {setting}", ""]
        for title, cols in GROUPS:
            parts += [f"{title}:", "", _md(g[["arm", "seeds", *cols]]), ""]
        parts += ["Per stage-1 round (the validation after the round; alpha_min and delta_perf_used: the weights that "
                  "round aggregated with):", "", _md(_per_round(curves[curves["setting"] == setting])), ""]
    (a.out / "mechanisms.md").write_text("\n".join(legend + parts))
    plot_mechanisms(a, curves)


def _per_round(curves: pd.DataFrame) -> pd.DataFrame:
    """Per arm with a stop condition and stage-1 round: mean ± std over seeds of the trajectory."""
    cols = ("local_acc_x_p_mean", "acc_x_p_mean", "cosine_mean", "stopped", "frozen", "alpha_min", "delta_perf_used")
    rows = []
    for (arm, r), g in curves[curves["arm"] != "fedfed"].groupby(["arm", "round"], sort=False):
        rows.append({"arm": arm, "round": int(r), **{c: _pm(g[c].tolist(), 2 if c in ("stopped", "frozen") else 3)
                                                     for c in cols}})
    return pd.DataFrame(rows, columns=["arm", "round", *cols])


def _md(df: pd.DataFrame) -> str:
    cols = list(df.columns)
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for _, r in df.iterrows():
        lines.append("| " + " | ".join(str(r[c]) for c in cols) + " |")
    return "\n".join(lines)


def plot_mechanisms(a: argparse.Namespace, curves: pd.DataFrame) -> None:
    if a.no_plots or curves.empty:
        return
    from medfl.plotting import pyplot, tight_layout

    plt = pyplot()
    panels = [("acc_x_p_mean", "residual acc. on x_p (val, mean over clients)"),
              ("cosine_mean", "cos(x_hat, x_s) (val, mean)"), ("stopped", "clients stopped (cumulative)"),
              ("alpha_min", "eq. 8: smallest alpha_k(t)")]
    settings = list(dict.fromkeys(curves["setting"]))
    fig, axes = plt.subplots(len(settings), len(panels), figsize=(4.0 * len(panels), 3.0 * len(settings)),
                             squeeze=False)
    for i, setting in enumerate(settings):
        for j, (col, title) in enumerate(panels):
            ax = axes[i][j]
            for arm in (k for k in VAE_ARMS if k in a.arms and k != "fedfed"):   # FedFed: no validation, no decay
                part = curves[(curves["setting"] == setting) & (curves["arm"] == arm)]
                per = part.groupby("round")[col].agg(["mean", lambda s: float(np.std(s.dropna(), ddof=0))
                                                      if s.notna().any() else math.nan])
                per.columns = ["mean", "std"]
                per = per.dropna(subset=["mean"])
                if per.empty:
                    continue
                color = f"C{ARMS.index(arm)}"   # the colours of arms_curves.png
                ax.plot(per.index, per["mean"], marker="o", ms=3, lw=1.2, label=arm, color=color)
                ax.fill_between(per.index, per["mean"] - per["std"], per["mean"] + per["std"], alpha=0.15,
                                color=color)
            if col == "acc_x_p_mean":
                ax.axhline(0.88, ls="--", c="k", lw=0.8, label="paper target 0.88")
                t = a.criterion.get("target_accuracy", 0.9) - a.criterion.get("tolerance", 0.02)
                ax.axhline(t, ls=":", c="k", lw=0.8, label=f"fixture target {t:g}")
            if col == "cosine_mean":
                ax.axhline(0.15, ls="--", c="k", lw=0.8)
                ax.axhline(a.criterion.get("max_cosine", 0.15), ls=":", c="k", lw=0.8)
            ax.set_title(f"{setting}: {title}", fontsize=8)
            ax.set_xlabel("stage-1 round")
            ax.grid(alpha=0.3)
        axes[i][0].legend(fontsize=6)
    tight_layout(fig)
    fig.savefig(a.out / "mechanisms.png", dpi=100)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- accuracy
def arm_reports(a: argparse.Namespace) -> None:
    for setting in a.settings:
        runs = {arm: [run_dir(a, setting, s) / arm for s in a.seeds if finished(run_dir(a, setting, s) / arm)]
                for arm in a.arms}
        runs = {k: v for k, v in runs.items() if v}
        if not runs:
            continue
        kw = {"metric": "accuracy", "splits": ("global_test",), "metrics": ("accuracy", "f1", "auc"),
              "plots": not a.no_plots}
        write_arm_report(a.out / setting, runs, select="best_val",
                         title=f"{setting}, {a.clients} clients, {fixture_words(a)}", **kw)
        write_arm_report(a.out / setting / "last_mean", runs, select="last_mean", last=a.last,
                         title=f"{setting}, {a.clients} clients, {fixture_words(a)}", **kw)


def paired_report(a: argparse.Namespace) -> None:
    rows = []
    for setting in a.settings:
        score: dict[tuple[str, int], float] = {}
        last: dict[tuple[str, int], float] = {}
        curve: dict[tuple[str, int], pd.Series] = {}
        for seed in a.seeds:
            for arm in a.arms:
                run = run_dir(a, setting, seed) / arm
                if not finished(run):
                    continue
                score[arm, seed] = arm_scores(run, metric="accuracy")["scores"]["global_test"]["accuracy"]
                last[arm, seed] = arm_scores(run, select="last_mean", last=a.last)["scores"]["global_test"]["accuracy"]
                m = pd.read_csv(run / "metrics.csv")
                curve[arm, seed] = m[m["split"] == "global_test"].groupby("round")["accuracy"].mean()
        for arm, ref in PAIRS:
            seeds = [s for s in a.seeds if (arm, s) in score and (ref, s) in score]
            if not seeds:
                continue
            diff = [score[arm, s] - score[ref, s] for s in seeds]
            ldiff = [last[arm, s] - last[ref, s] for s in seeds]
            gap = [float((curve[arm, s] - curve[ref, s]).abs().max()) for s in seeds]
            rows.append({"setting": setting, "arm": arm, "reference": ref, "seeds": len(seeds),
                         "best_val_diff": _pm(diff), "wins": f"{sum(d > 0 for d in diff)}/{len(seeds)}",
                         "best_val_diff_values": ";".join(f"{d:+.3f}" for d in diff),
                         f"last{a.last}_diff": _pm(ldiff),
                         "max_round_gap": _pm(gap)})
    table = pd.DataFrame(rows)
    table.to_csv(a.out / "paired.csv", index=False)
    text = ["# Paired differences of global-test accuracy (arm - reference, per seed; mean ± population std)", "",
            "best_val_diff: each arm read at its own best validation round (local_val accuracy); wins: seeds where "
            f"the arm is higher; last{a.last}_diff: the means of the last {a.last} rounds; max_round_gap: the largest "
            "per-round difference of the two global-test curves (0: identical runs). fedtpf_dp's shared features are "
            "mostly noise (noise-to-signal about 30 at epsilon 8), so its shared set carries little more than its "
            "labels: arm - fedtpf_dp is what the features add beyond them.", "", _md(table)]
    (a.out / "paired.md").write_text("\n".join(text) + "\n")


# ---------------------------------------------------------------------------------------------- ceiling
def _tiles(data: Path, rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    manifest = pd.read_csv(data / "manifest.csv", keep_default_na=False)
    part = manifest.iloc[rows]
    x = torch.stack([torch.from_numpy(np.load(data / p)).float() for p in part["path"]])
    return x, torch.as_tensor(part["label"].to_numpy().copy(), dtype=torch.long)


def _fit(x: torch.Tensor, y: torch.Tensor, xt: torch.Tensor, yt: torch.Tensor, steps: int, seed: int,
         at: tuple[int, ...] = ()) -> float | list[float]:
    """A fresh small_cnn (width 8) trained with Adam 1e-3, batch 32, for ``steps`` steps on
    ``(x, y)``: its accuracy on ``(xt, yt)`` (with ``at``, a list: after each of those steps too,
    then after ``steps``)."""
    from medfl.models.registry import build_model

    torch.manual_seed(seed)
    net = build_model({"name": "small_cnn", "width": 8, "in_channels": int(x.shape[1]), "num_classes": 9})
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(seed)
    net.train()
    done, seen = 0, []
    while done < steps:
        for idx in torch.randperm(len(y), generator=g).split(32):
            loss = torch.nn.functional.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            done += 1
            if done in at:
                seen.append(_accuracy(net, xt, yt))
                net.train()
            if done >= steps:
                break
    return [*seen, _accuracy(net, xt, yt)] if at else _accuracy(net, xt, yt)


def _accuracy(net: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    net.eval()
    with torch.no_grad():
        pred = torch.cat([net(b).argmax(1) for b in x.split(256)])
    return float((pred == y).float().mean())


def ceiling_run(run: Path, data: Path, variance: float, steps: int, seed: int, clean: bool = True
                ) -> dict[str, float]:
    """What accuracy is reachable on ``x_s`` and ``x_s + n`` (``x_s`` from the run's final global
    distillation model), and with ``clean`` on ``x`` and ``x + n``, by a classifier trained
    centrally on every client's training tiles and tested on the global test set; and the run's
    own federated residual classifier on the global test's ``x_s + n``."""
    from medfl.models.feature_distill import DistillVAE
    from medfl.models.registry import build_model

    ckpt = sorted((run / "checkpoints").glob("round_*.pt"))[-1]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["method"]["distill"]
    sub = {k[4:]: v for k, v in state.items() if k.startswith("vae.")}
    hp = json.loads((run / "config.json").read_text())["method_hparams"]
    vae = DistillVAE(3, int(sub["mu.weight"].shape[0]), 2, width=int(hp["vae_width"]), grid=int(hp["vae_grid"]))
    vae.load_state_dict(sub)
    vae.eval()
    cls = build_model({"name": "small_cnn", "width": 8, "in_channels": 3, "num_classes": 9})
    cls.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("cls.")})
    part = pd.read_csv(run / "partition.csv", keep_default_na=False)
    x, y = _tiles(data, part.loc[part["role"] == "train", "row"].to_numpy())
    xt, yt = _tiles(data, part.loc[part["role"] == "global_test", "row"].to_numpy())
    with torch.no_grad():
        s = x - vae.decode(vae.encode(x)[0], tuple(x.shape[2:]))
        st = xt - vae.decode(vae.encode(xt)[0], tuple(xt.shape[2:]))
    g = torch.Generator().manual_seed(seed + 17)
    std = math.sqrt(variance)

    def noisy(t: torch.Tensor) -> torch.Tensor:
        return t + std * torch.randn(t.shape, generator=g)

    out = {"x": _fit(x, y, xt, yt, steps, seed) if clean else math.nan,
           "x+n": _fit(noisy(x), y, noisy(xt), yt, steps, seed) if clean else math.nan,
           "x_s": _fit(s, y, st, yt, steps, seed)}
    short = tuple(k for k in CEILING_AT if k < steps)
    curve = _fit(noisy(s), y, noisy(st), yt, steps, seed, at=short)
    out.update({f"x_s+n@{k}": v for k, v in zip(short, curve)})
    out.update({"x_s+n": curve[-1], "federated w on x_s+n": _accuracy(cls, noisy(st), yt),
                "|x_s|/|x|": float((s.flatten(1).norm(dim=1) / x.flatten(1).norm(dim=1)).mean()),
                "|n|/|x_s|": float(std * math.sqrt(s[0].numel()) / s.flatten(1).norm(dim=1).mean())})
    return out


def ceiling_report(a: argparse.Namespace, data: Path) -> None:
    path = a.out / "ceiling_runs.csv"
    done = pd.read_csv(path) if path.is_file() else pd.DataFrame(columns=["setting", "arm", "seed"])
    rows = done.to_dict("records")
    have = {(r["setting"], r["arm"], int(r["seed"])) for r in rows}
    for setting in a.settings:
        for seed in a.seeds:
            for arm in CEILING_ARMS:   # x and x + n do not depend on the arm: fitted with the first
                run = run_dir(a, setting, seed) / arm
                if arm not in a.arms or (setting, arm, seed) in have or not finished(run):
                    continue
                t0 = time.time()
                rows.append({"setting": setting, "arm": arm, "seed": seed,
                             **ceiling_run(run, data, a.noise_variance, a.ceiling_steps, seed,
                                           clean=arm == CEILING_ARMS[0])})
                print(f"ceiling {setting} {arm} seed {seed}: {time.time() - t0:.0f} s", flush=True)
    if not rows:
        return
    runs = pd.DataFrame(rows)
    runs.to_csv(path, index=False)
    cols = ["x", "x+n", "x_s", *(f"x_s+n@{k}" for k in CEILING_AT if k < a.ceiling_steps), "x_s+n",
            "federated w on x_s+n", "|x_s|/|x|", "|n|/|x_s|"]
    agg = [{"setting": s, "arm": arm, "seeds": len(g), **{c: _pm(g[c].tolist()) for c in cols}}
           for (s, arm), g in runs.groupby(["setting", "arm"], sort=False)]
    text = [f"# How far can a classifier get on x_p? ({len(a.seeds)} seeds, mean ± population std)", "",
            f"A fresh small_cnn (width 8, Adam 1e-3, batch 32, {a.ceiling_steps} steps) trained centrally on every "
            f"client's training tiles, tested on the global test set: on the clean tiles x, on x + n (n: the paper's "
            f"noise, variance {a.noise_variance:g} per coordinate; both on the first arm's rows only: they do not "
            "depend on the arm), on x_s = x - x_hat from the run's final global distillation model, and on "
            "x_s + n (the released x_p: one noise draw per tile; x_s+n@k: the same classifier after k steps). "
            "'federated w on x_s+n': the run's own aggregated residual classifier (what the stop condition reads) "
            "on the global test's x_s + n. The paper's stop target is 0.88.", "", _md(pd.DataFrame(agg))]
    (a.out / "ceiling.md").write_text("\n".join(text) + "\n")


# ---------------------------------------------------------------------------------------------- main
def _criterion(text: str) -> dict[str, Any]:
    value = json.loads(text)
    allowed = {"target_accuracy", "tolerance", "window", "max_change", "max_cosine", "decay_lambda"}
    if not isinstance(value, dict) or not set(value) <= allowed:
        raise argparse.ArgumentTypeError(f"a JSON object with keys among {', '.join(sorted(allowed))}")
    return value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", choices=list(SPLITS), default=["label_skew_2", "dirichlet_0.3"],
                   metavar="SPLIT", help=f"the splits, among {', '.join(SPLITS)} (default label_skew_2 dirichlet_0.3)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), metavar="ARM",
                   help=f"arms, among {', '.join(ARMS)} (default all)")
    p.add_argument("--clients", type=int, default=5, help="clients (default 5)")
    p.add_argument("--fraction", type=float, default=1.0, help="clients sampled per round (default all)")
    p.add_argument("--cases", type=int, default=3000, help="fixture tiles over train/val/test (default 3000)")
    p.add_argument("--texture", type=float, default=0.0, metavar="GREY",
                   help="add the fixture's class-oriented grating of this amplitude (grey levels; default 0: "
                        "none): class evidence in fine texture, which the distillation model leaves in x_s")
    p.add_argument("--texture-period", type=float, default=3.0, help="the grating's period in pixels (default 3)")
    p.add_argument("--val", type=float, default=0.3, help="each client's validation share (default 0.3)")
    p.add_argument("--rounds", type=int, default=12, help="rounds, stage 1 included (default 12)")
    p.add_argument("--distill-rounds", type=int, default=6, help="stage 1's cap T_d (default 6)")
    p.add_argument("--distill-steps", type=int, default=60, help="distillation steps per client and round")
    p.add_argument("--noise-variance", type=float, default=0.15, help="the paper's noise (FedFed, FedTPF paper)")
    p.add_argument("--criterion", type=_criterion, default=dict(FIXTURE_CRITERION),
                   help=f"fedtpf_fixture's stop criterion, JSON (default {json.dumps(FIXTURE_CRITERION)})")
    p.add_argument("--lr", type=float, default=0.05, help="the task model's SGD learning rate (default 0.05)")
    p.add_argument("--last", type=int, default=3, help="rounds averaged by the last-rounds table (default 3)")
    p.add_argument("--ceiling", action="store_true", help="also measure the accuracy reachable on x_p (ceiling.md)")
    p.add_argument("--ceiling-steps", type=int, default=600, help="the ceiling classifiers' steps (default 600)")
    p.add_argument("--report-only", action="store_true", help="only rewrite the tables from the runs there")
    p.add_argument("--no-plots", action="store_true", help="write no PNG")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "fedtpf_evidence",
                   help="results folder (default experiments/results/fedtpf_evidence)")
    p.add_argument("--smoke", action="store_true",
                   help="the test suite's run (tests/test_experiments.py): dirichlet_1.0, 450 tiles, 3 clients, "
                   "seed 0, fedavg and fedtpf_dp, 2 rounds with stage 1 capped at 1, 5 distillation steps, "
                   "last 1, no plots; it checks that the script runs, its numbers are no evidence")
    a = p.parse_args(argv)
    if a.smoke:
        a.settings, a.seeds, a.arms, a.clients, a.cases = ["dirichlet_1.0"], [0], ["fedavg", "fedtpf_dp"], 3, 450
        a.last = 1
        a.rounds, a.distill_rounds, a.distill_steps, a.no_plots = 2, 1, 5, True
    os.environ.setdefault("MEDFL_NO_PROGRESS", "1")
    torch.set_num_threads(1)
    a.out.mkdir(parents=True, exist_ok=True)
    data = _fixture(a, "pathmnist", a.cases, 0, a.texture, a.texture_period)
    started = time.time()
    if not a.report_only:
        run_all(a, data)
    arm_reports(a)
    paired_report(a)
    mechanisms_report(a)
    refusals_report(a)
    if a.ceiling:
        ceiling_report(a, data)
    print(f"tables in {a.out} ({time.time() - started:.0f} s)")
    for name in ["paired.md", "mechanisms.md", "ceiling.md", "refused.md"] + [f"{s}/arms_table.md" for s in a.settings]:
        if (a.out / name).is_file():
            print((a.out / name).read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
