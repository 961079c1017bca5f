#!/usr/bin/env python
"""PFedCDP's DP evidence (issue 37): personal accuracy with and without the update's noise, the
epsilon it spends, and what the noise did, over seeds, each arm at its best validation round.

The claim under test: PFedCDP with the authors' noise (``preset: "authors_formula"``) keeps personal accuracy (each client's
own extractor and classifier on its ``local_test`` split) at or above its no-DP level minus a
stated margin, and reports the epsilon this spends.

Three studies on the CBIS-DDSM / MIAS fixtures of ``experiments/pfedcdp_compare.py`` (lesion
crops, Dirichlet 0.5, capability clusters drawn from the seed). Every arm is ``{"name":
"pfedcdp", "preset": "authors_formula"}`` (the authors' training recipe: 5 classifier epochs of eq. 11
after one extractor epoch, Adam 1e-3, batch 64, KD T 3 and lambda 0.3, fixed teacher weights)
with only the noise changed, so the arms of one seed share the partition, the clusters and the
initialisations:

``main`` (``--clients``, default 10)
    ``nodp`` (no noise, the update quantized to 8 bits), ``authors_formula`` (the preset: sigma
    0.969 added every round, the epsilon it spends recorded), ``authors_v1_7`` (PFedCDP's
    ``authors``: the authors' v1.7 clients as they run, model B's weights noised per tensor at
    sigma 0.606 and 12 bits, A and C in the clear; only A distils, C at Adam 3e-4, each client
    scored with the cluster's aggregated extractor and its own classifier, as v1.7's ``evaluate``),
    ``authors_v1_7_personal`` (the same clients scored on their own extractors, as every other
    arm: the two scorings side by side; ``nodp_global``, ``authors_formula_global`` and
    ``paper_dp_global`` score those arms the authors' way), ``paper_dp`` (the paper's epsilon 5 over the
    planned rounds: sigma from the accountant).
``clients`` (``--client-counts``, default 10 30 50)
    ``nodp`` and ``authors_formula`` at each client count on the same data (the paper's Fig. 2
    design: more clients, less data each): the noise in a cluster's weighted average of n clipped
    updates is ``sigma C2 sqrt(d sum w_k^2)``, about ``sigma C2 sqrt(d / n)``.
``sigma`` (``--sigmas``, at ``--clients``)
    ``noise_multiplier`` swept below the authors' (0.606 is the authors' code's own
    calibration at its epsilon 8, ``differential_privacy.py``'s default and v1.7's client B),
    to find where personal accuracy comes back to its no-DP level.

Each run evaluates ``val`` and ``test`` every round; every arm is reported with
:mod:`medfl.arm_report` at its best validation round (``local_val`` micro-F1, which is accuracy
for one label per image; ties: the earliest), and as the mean of its last ``--last`` rounds, mean
± population std over the seeds, with the per-round curves beside the tables. The gap is the
per-seed difference ``nodp - arm`` at each arm's own best-validation round (the two arms of a
seed share everything but the noise), then mean ± std over seeds.

What the mechanisms did, from each run's files, per run then mean ± std over seeds:
``privacy.csv`` / ``summary.json`` (epsilon over the run and at the best round, sigma),
``mechanisms.csv`` (per cluster: ``noise_to_update_min`` = the noise norm in the averaged
update over C2, the noise per coordinate ``sigma C2 sqrt(sum w^2)``, the clients in the cluster,
quantization's error against the update; per client: the share of its own extractor's weights
above 1 in magnitude, the Fisher-kept weights' drift, the personal share), ``summary.json``'s
warnings.

Writes under ``--out`` (default ``experiments/results/pfedcdp_evidence/``): per study
``<study>/arms_table.md|.csv`` and ``arms_curves.csv|.png`` (best validation round),
``<study>/last_rounds/`` (the same, mean of the last rounds), ``<study>/mechanisms.md|.csv``
(and ``mechanisms_per_run.csv``); ``clients/gap.md|.csv`` and ``sigma/gap.md|.csv`` (accuracy,
gap to no DP, noise ratio, epsilon per client count / sigma); ``gap_vs_noise.png`` (every run's
gap against the noise per coordinate in its clusters' averaged update); ``evidence.md`` (all
tables, the settings, the command). The fixtures are in
``--out/fixture_cbis<cases>_mias<cases>/data``, the runs in
``--out/runs/cbis<cases>_r<rounds>/c<clients>_seed<seed>_<arm>/<arm>`` (a finished run is
reused; ``--rerun`` redoes it; ``--report-only`` only rereads them).

The figures of the report were produced by (the defaults: 20 rounds, seeds 0 1 2, 1,200 cases,
10 clients, client counts 10 30 50, sigmas 0.03 0.1 0.3 0.606; about 45 minutes on 2 shared CPU
cores, one torch thread):

    python experiments/pfedcdp_evidence.py

What the fixtures can and cannot show: the synthetic images carry a planted class signal, so
absolute accuracies say nothing about real mammograms; the relative effect of the noise on
arms that share everything else carries over, and so does the arithmetic of the noise (it
depends on sigma, C2, the extractor's size and the clients per cluster, not on the images).
Local validation and test splits are a handful of images per client: read the spread over
seeds.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import pfedcdp_compare as compare  # noqa: E402  (the fixtures and the base run config are that script's)

DEFAULT_OUT = ROOT / "experiments" / "results" / "pfedcdp_evidence"
#: label -> the method entry's own keys on top of its preset (:data:`ARM_PRESETS`, else
#: ``"authors_formula"``: the authors' training recipe with their sigma formula at the paper's
#: epsilon on every cluster, what this study measured as ``authors`` before issue 48)
MAIN_ARMS: dict[str, dict[str, Any]] = {
    "nodp": {"noise_multiplier": None},
    "authors_formula": {},
    "authors_v1_7": {},
    "authors_v1_7_personal": {"score": "personal"},
    "paper_dp": {"noise_multiplier": None, "epsilon": 5.0},
    "nodp_global": {"noise_multiplier": None, "score": "global"},
    "authors_formula_global": {"score": "global"},
    "paper_dp_global": {"noise_multiplier": None, "epsilon": 5.0, "score": "global"},
}
#: arms on another preset: ``authors_v1_7`` is the authors' v1.7 clients as they run (model B
#: noised per weight tensor at sigma 0.606, A and C in the clear; PFedCDP's ``authors``; scored
#: as their ``evaluate`` scores, the cluster's aggregated extractor with each client's classifier),
#: ``authors_v1_7_personal`` the same clients scored on their own extractors, as the other arms
ARM_PRESETS = {"authors_v1_7": "authors_v1_7", "authors_v1_7_personal": "authors_v1_7"}
BASE_PRESET = "authors_formula"
CLIENT_ARMS = ("nodp", "authors_formula")
SPLITS = ("local_test", "local_val")
METRICS = ("accuracy", "auc")


def log(msg: str) -> None:
    print(msg, flush=True)


def sigma_label(s: float) -> str:
    return f"sigma_{s:g}"


def arm_keys(label: str) -> dict[str, Any]:
    if label in MAIN_ARMS:
        return dict(MAIN_ARMS[label])
    if label.startswith("sigma_"):
        return {"noise_multiplier": float(label[len("sigma_"):]), "epsilon": None}
    raise KeyError(label)


def plan(a: argparse.Namespace) -> list[tuple[int, str]]:
    """(clients, arm) pairs to run for every seed."""
    out: list[tuple[int, str]] = [(a.clients, lab) for lab in MAIN_ARMS]
    out += [(n, lab) for n in a.client_counts for lab in CLIENT_ARMS]
    out += [(a.clients, sigma_label(s)) for s in a.sigmas]
    seen: set[tuple[int, str]] = set()
    return [x for x in out if not (x in seen or seen.add(x))]


def entry(a: argparse.Namespace, label: str) -> dict[str, Any]:
    quick = {"capabilities": "draw", "feature_shap": "off", "supcon_views": 1, "refine": False}
    return {"name": "pfedcdp", "preset": ARM_PRESETS.get(label, BASE_PRESET), "label": label, **quick,
            **arm_keys(label)}


def run_config(a: argparse.Namespace, cbis: Path, mias: Path, clients: int, seed: int, label: str) -> dict[str, Any]:
    c = argparse.Namespace(out=a.out, rounds=a.rounds, epochs=1, batch_size=16, optimizer="sgd", lr=0.01,
                           refine_epochs=0, min_size=a.min_size, arms=None, image_size=a.image_size)
    fl = compare.fl_config(c, cbis, mias, clients, seed)
    fl.update(name=f"c{clients}_seed{seed}_{label}", output_dir=str(runs_root(a)), methods=[entry(a, label)],
              eval_splits=["val", "test"],
              client_split={"train": 0.7, "val": 0.15, "test": 0.15}, overwrite=True, keep_checkpoints=1)
    if a.patience:
        fl["early_stopping"] = {"metric": "val/micro_f1", "patience": a.patience, "min_delta": 0.0}
    return fl


def runs_root(a: argparse.Namespace) -> Path:
    return a.out / "runs" / f"cbis{a.cbis_cases}_r{a.rounds}"


def run_dir(a: argparse.Namespace, clients: int, seed: int, label: str) -> Path:
    return runs_root(a) / f"c{clients}_seed{seed}_{label}" / label


# ------------------------------------------------------------------------------ reading one run
def epsilon_at(run: Path, round_: int) -> float | None:
    """The worst client's epsilon spent up to ``round_`` (privacy.csv; ``None``: no DP)."""
    import pandas as pd

    if not (run / "privacy.csv").is_file():
        return None
    p = pd.read_csv(run / "privacy.csv")
    upto = p[p["round"] <= round_]
    return float(upto["epsilon"].max()) if len(upto) else None


def read_mechanisms(run: Path, best_round: int) -> dict[str, Any]:
    """What the noise did in one run (mechanisms.csv, privacy.csv, summary.json)."""
    import pandas as pd

    s = json.loads((run / "summary.json").read_text())
    mech = pd.read_csv(run / "mechanisms.csv", dtype={"id": str, "text": str}, keep_default_na=False, na_values=[""])
    last = int(mech["round"].max())

    def values(mechanism: str, name: str) -> pd.DataFrame:
        return mech[(mech["mechanism"] == mechanism) & (mech["name"] == name)][["round", "id", "value"]]

    ratio = values("dp_noise", "noise_to_update_min")
    per_coord = values("dp_noise", "noise_per_coordinate")
    members = values("dp_noise", "clients")
    planned = values("dp_noise", "noise_norm").set_index(["round", "id"])["value"]
    received = values("dp_noise", "received_update_norm").set_index(["round", "id"])["value"]
    seen = (received / planned)[planned > 0]
    qerr = values("quantization", "error_to_update")
    above = values("personalization", "above_one")
    drift = values("personalization", "personal_drift")
    share = values("personalization", "personal_fraction")
    cl_above = values("cluster_model", "above_one")
    rep = s.get("method_report") or {}
    mrep = rep.get("mechanisms") or {}
    priv = s.get("privacy") or {}
    eps_best = epsilon_at(run, best_round) if priv.get("private") else None

    def at(frame: pd.DataFrame, r: int, how: str = "mean") -> float:
        part = frame[frame["round"] == r]["value"]
        return float(getattr(part, how)()) if len(part) else float("nan")

    by_cluster = {c: float(g["value"].mean()) for c, g in ratio.groupby("id")}
    sizes = {c: float(g["value"].mean()) for c, g in members.groupby("id")}
    return {
        "sigma": (mrep.get("dp") or {}).get("sigma_per_round"),
        "epsilon_run": priv.get("epsilon") if priv.get("private") else None,
        "epsilon_at_best": eps_best,
        "cluster_sizes": rep.get("cluster_sizes"),
        "noise_to_update_by_cluster": by_cluster,
        "clients_by_cluster": sizes,
        "noise_to_update_min": min(by_cluster.values()) if by_cluster else float("nan"),
        "noise_to_update_max": max(by_cluster.values()) if by_cluster else float("nan"),
        "noise_per_coordinate_mean": float(per_coord["value"].mean()) if len(per_coord) else float("nan"),
        "quant_error_to_update": float(qerr["value"].mean()) if len(qerr) else float("nan"),
        # the averaged update as received against the noise the plan puts in it: about 1 when the
        # noise added is the planned sigma C2 sqrt(d sum w^2) and the signal is negligible
        "received_to_planned_noise": float(seen.mean()) if len(seen) else float("nan"),
        "above_one_best": at(above, best_round),
        "above_one_last": at(above, last),
        "above_one_last_max": at(above, last, "max"),
        "cluster_above_one_last": at(cl_above, last),
        "drift_mean": float(drift["value"].mean()) if len(drift) else float("nan"),
        "personal_share": float(share[share["round"] > 1]["value"].mean()) if len(share) else float("nan"),
        "warnings": len(s.get("warnings") or []),
        "stopped_round": (s.get("early_stopping") or {}).get("stopped_round"),
        "wall_s": s.get("wall_time_s_last_session"),
    }


# ------------------------------------------------------------------------------ tables
def _ms(values: list[float], nd: int = 3) -> str:
    import numpy as np

    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    if not len(v):
        return "n/a"
    return f"{v.mean():.{nd}f} ± {v.std(ddof=0):.{nd}f}"


def _stat(values: list[float]) -> tuple[float, float]:
    import numpy as np

    v = np.asarray([x for x in values if x is not None and np.isfinite(x)], dtype=float)
    return (float(v.mean()), float(v.std(ddof=0))) if len(v) else (float("nan"), float("nan"))


def mechanism_rows(runs: dict[str, list[Path]], best: dict[str, list[int]], study: str) -> tuple[list, list]:
    """Per arm the mechanisms' figures, mean ± std over its seeds (and the per-run rows)."""
    per_run, rows = [], []
    for label, dirs in runs.items():
        got = [read_mechanisms(d, r) for d, r in zip(dirs, best[label])]
        for i, (g, d) in enumerate(zip(got, dirs)):
            per_run.append({"study": study, "arm": label, "seed_index": i, "run": str(d), "best_round": best[label][i],
                            **{k: (json.dumps(v) if isinstance(v, dict) else v) for k, v in g.items()}})
        clusters = sorted({c for g in got for c in g["noise_to_update_by_cluster"]})
        row: dict[str, Any] = {"arm": label, "seeds": len(got), "sigma": got[0]["sigma"]}
        for k in ("epsilon_run", "epsilon_at_best", "noise_per_coordinate_mean", "quant_error_to_update",
                  "received_to_planned_noise",
                  "above_one_best", "above_one_last", "above_one_last_max", "cluster_above_one_last", "drift_mean",
                  "personal_share", "warnings", "wall_s"):
            row[k], row[k + " std"] = _stat([g[k] for g in got])
        for c in clusters:
            row[f"noise_to_update_{c}"], row[f"noise_to_update_{c} std"] = _stat(
                [g["noise_to_update_by_cluster"].get(c, float("nan")) for g in got])
            row[f"clients_{c}"], row[f"clients_{c} std"] = _stat(
                [g["clients_by_cluster"].get(c, float("nan")) for g in got])
        rows.append(row)
    return rows, per_run


def mechanisms_md(rows: list[dict[str, Any]]) -> str:
    def cell(r: dict[str, Any], k: str, nd: int = 3) -> str:
        m, s = r.get(k, float("nan")), r.get(k + " std", float("nan"))
        return "n/a" if m is None or not math.isfinite(m) else f"{m:.{nd}f} ± {s:.{nd}f}"

    clusters = [c for c in ("high", "medium", "low") if any(f"noise_to_update_{c}" in r for r in rows)]
    head = ["arm", "sigma", "ε over the run", "ε at best round", *[f"noise/update {c} (clients)" for c in clusters],
            "noise per coord.", "received/planned noise", "quant. err/update", "own |w|>1 at best",
            "own |w|>1 last (max client)",
            "Fisher-kept drift", "warnings"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        sig = r["sigma"]
        cells = [r["arm"], "0" if not sig else f"{sig:.3g}", cell(r, "epsilon_run", 2), cell(r, "epsilon_at_best", 2)]
        for c in clusters:
            cells.append(f"{cell(r, f'noise_to_update_{c}', 1)} ({cell(r, f'clients_{c}', 1)})")
        cells += [cell(r, "noise_per_coordinate_mean", 4), cell(r, "received_to_planned_noise", 4),
                  cell(r, "quant_error_to_update", 3),
                  cell(r, "above_one_best", 3),
                  f"{cell(r, 'above_one_last', 3)} ({r.get('above_one_last_max', float('nan')):.3f})",
                  cell(r, "drift_mean", 3), cell(r, "warnings", 1)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def report_study(a: argparse.Namespace, study: str, runs: dict[str, list[Path]], title: str) -> dict[str, Any]:
    """arm_report tables (best validation round and last-rounds mean), mechanisms, per study."""
    import pandas as pd

    from medfl.arm_report import arm_scores, write_arm_report

    out = a.out / study
    table = write_arm_report(out, runs, select="best_val", splits=SPLITS, metrics=METRICS, title=title)
    last = write_arm_report(out / "last_rounds", runs, select="last_mean", last=a.last, splits=SPLITS,
                            metrics=METRICS, title=title, plots=False)
    best = {lab: [int(s) for s in str(table[table["arm"] == lab]["rounds"].iloc[0]).split(";")] for lab in runs}
    mrows, per_run = mechanism_rows(runs, best, study)
    pd.DataFrame(mrows).to_csv(out / "mechanisms.csv", index=False)
    pd.DataFrame(per_run).to_csv(out / "mechanisms_per_run.csv", index=False)
    (out / "mechanisms.md").write_text(mechanisms_md(mrows))
    plot_mechanisms(runs, out / "mechanisms_curves.png", title)
    # per-seed scores at the best validation round, for the gaps
    scores = {lab: [arm_scores(d, select="best_val")["scores"].get("local_test", {}).get("accuracy", float("nan"))
                    for d in dirs] for lab, dirs in runs.items()}
    late = {lab: [best_from(d, a.first_noisy_round) for d in dirs] for lab, dirs in runs.items()}
    for lab, dirs in runs.items():
        for x, d in zip(late[lab], dirs):
            x["epsilon"] = epsilon_at(d, x["round"])
    majority = [majority_rate(d) for d in next(iter(runs.values()))]
    note = (f"\nA constant predictor of each client's training majority class scores {_ms(majority)} on "
            "local_test (mean over clients, over seeds).\n")
    (out / "from_round.md").write_text(late_md(late, a.first_noisy_round, title) + note)
    with open(out / "arms_table.md", "a") as fh:
        fh.write(note)
    return {"table": table, "last": last, "mech": mrows, "per_run": per_run, "best": best, "scores": scores,
            "late": late, "late_scores": {lab: [x["local_test/accuracy"] for x in v] for lab, v in late.items()}}


def majority_rate(run: Path) -> float:
    """The mean over clients of a constant predictor's local_test accuracy: each client
    predicts the majority class of its own training split (partition.csv)."""
    import pandas as pd

    p = pd.read_csv(run / "partition.csv", dtype={"client_id": str})
    rates = []
    for _, g in p.groupby("client_id"):
        train, test = g[g["role"] == "train"]["label"], g[g["role"] == "test"]["label"]
        if len(train) and len(test):
            rates.append(float((test == train.value_counts().idxmax()).mean()))
    return sum(rates) / len(rates) if rates else float("nan")


def best_from(run: Path, first: int) -> dict[str, float]:
    """The best ``local_val`` micro-F1 round from round ``first`` on, and the scores there.

    Round 1's personal models are trained before any aggregated (noised) model reached a client,
    so in round 1 every arm of a seed holds the same models: a best round of 1 says that the
    federation added nothing, not that the noise is harmless. This reads each run from the first
    round whose personal models carry the noise."""
    import pandas as pd

    from medfl.arm_report import round_curves

    m = pd.read_csv(run / "metrics.csv", dtype={"client_id": str, "client_name": str}, keep_default_na=False,
                    na_values=["", "nan", "NaN"])
    c = round_curves(m)
    val = c[(c["split"] == "local_val") & (c["round"] >= first)]
    val = val[val["micro_f1"].notna()]
    r = int(val.loc[val["micro_f1"].idxmax(), "round"])
    at = c[c["round"] == r].set_index("split")
    return {"round": r, **{f"{sp}/{k}": float(at.loc[sp, k]) for sp in SPLITS for k in METRICS if sp in at.index}}


def late_md(late: dict[str, list[dict[str, float]]], first: int, title: str) -> str:
    cols = [f"{sp}/{k}" for sp in SPLITS for k in METRICS]
    lines = [f"{title}: each arm at its best validation round from round {first} on (local_val micro-F1); mean "
             "± population std over seeds", "", "| arm | seeds | rounds | " + " | ".join(cols) + " |",
             "|---|---|---|" + "---|" * len(cols)]
    for lab, v in late.items():
        lines.append(f"| {lab} | {len(v)} | {';'.join(str(x['round']) for x in v)} | "
                     + " | ".join(_ms([x.get(col, float("nan")) for x in v]) for col in cols) + " |")
    return "\n".join(lines) + "\n"


def gap_rows(res: dict[str, Any], arms: list[str], key: str, values: list[Any], base: str = "nodp") -> list[dict]:
    """Per arm: personal accuracy, the per-seed gap to ``base`` (mean ± std), the noise."""
    rows = []
    mech = {r["arm"]: r for r in res["mech"]}
    for lab, val in zip(arms, values):
        acc = res["scores"][lab]
        ref = res["scores"][base]
        gaps = [b - x for b, x in zip(ref, acc)]
        lacc, lref = res["late_scores"][lab], res["late_scores"][base]
        lgaps = [b - x for b, x in zip(lref, lacc)]
        m = mech[lab]
        ratios = [m.get(f"noise_to_update_{c}", float("nan")) for c in ("high", "medium", "low")]
        rows.append({key: val, "arm": lab, "local_test_acc": _stat(acc)[0], "local_test_acc std": _stat(acc)[1],
                     "nodp_acc": _stat(ref)[0], "gap": _stat(gaps)[0], "gap std": _stat(gaps)[1],
                     "gap_max": max(gaps) if gaps else float("nan"),
                     "late_acc": _stat(lacc)[0], "late_acc std": _stat(lacc)[1], "late_gap": _stat(lgaps)[0],
                     "late_gap std": _stat(lgaps)[1], "late_gap_max": max(lgaps) if lgaps else float("nan"),
                     "late_rounds": ";".join(str(x["round"]) for x in res["late"][lab]),
                     "noise_to_update_min": min((r for r in ratios if math.isfinite(r)), default=float("nan")),
                     "noise_to_update_max": max((r for r in ratios if math.isfinite(r)), default=float("nan")),
                     "noise_per_coordinate": m["noise_per_coordinate_mean"],
                     "epsilon_run": m["epsilon_run"], "epsilon_at_best": m["epsilon_at_best"],
                     "epsilon_at_late": _stat([x["epsilon"] for x in res["late"][lab]])[0],
                     "above_one_last": m["above_one_last"], "best_rounds": ";".join(map(str, res["best"][lab]))})
    return rows


def gap_md(rows: list[dict[str, Any]], key: str) -> str:
    def f(x: Any, nd: int = 3) -> str:
        return "n/a" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{nd}f}"

    head = [key, "arm", "personal acc (local_test)", "no-DP acc", "gap nodp - arm", "worst seed gap",
            "from round 2: acc", "gap", "worst seed gap",
            "noise/update (min-max over clusters)", "noise per coord.", "ε over the run",
            "ε at best round (all / from round 2)",
            "own |w|>1 last", "best rounds (all / from round 2)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join([
            str(r[key]), r["arm"], f"{f(r['local_test_acc'])} ± {f(r['local_test_acc std'])}", f(r["nodp_acc"]),
            f"{f(r['gap'])} ± {f(r['gap std'])}", f(r["gap_max"]),
            f"{f(r['late_acc'])} ± {f(r['late_acc std'])}", f"{f(r['late_gap'])} ± {f(r['late_gap std'])}",
            f(r["late_gap_max"]),
            f"{f(r['noise_to_update_min'], 1)}-{f(r['noise_to_update_max'], 1)}", f(r["noise_per_coordinate"], 4),
            f(r["epsilon_run"], 2), f"{f(r['epsilon_at_best'], 2)} / {f(r['epsilon_at_late'], 2)}",
            f(r["above_one_last"]),
            f"{r['best_rounds']} / {r['late_rounds']}"]) + " |")
    return "\n".join(lines) + "\n"


def plot_mechanisms(runs: dict[str, list[Path]], path: Path, title: str) -> None:
    """Per arm and round (mean ± std over seeds): the clients' share of own-extractor weights
    above 1 in magnitude, and the noise in each cluster's averaged update over C2."""
    import pandas as pd

    from medfl.plotting import pyplot, tight_layout

    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.5))
    for label, dirs in runs.items():
        above, ratio = [], []
        for d in dirs:
            m = pd.read_csv(d / "mechanisms.csv", dtype={"id": str, "text": str}, keep_default_na=False,
                            na_values=[""])
            above.append(m[(m["mechanism"] == "personalization") & (m["name"] == "above_one")]
                         .groupby("round")["value"].mean())
            ratio.append(m[(m["mechanism"] == "dp_noise") & (m["name"] == "noise_to_update_min")]
                         .groupby("round")["value"].mean())
        for ax, series in zip(axes, (above, ratio)):
            frame = pd.concat(series, axis=1)
            mean, std = frame.mean(axis=1), frame.std(axis=1, ddof=0)
            line = ax.plot(mean.index, mean.values, label=label, lw=1.2)[0]
            ax.fill_between(mean.index, mean - std, mean + std, alpha=0.15, color=line.get_color())
    axes[0].set_title("own extractor's share of |w| > 1 (mean over clients)", fontsize=8)
    axes[1].set_title("noise norm in the averaged update / C2 (mean over clusters)", fontsize=8)
    axes[1].set_yscale("symlog", linthresh=1.0)
    for ax in axes:
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{title}: what the noise did, mean ± std over seeds", fontsize=9)
    tight_layout(fig)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_gap(points: list[dict[str, Any]], path: Path) -> None:
    from medfl.plotting import pyplot, tight_layout

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.2, 4.0))
    for study, marker in (("clients", "o"), ("sigma", "s"), ("main", "^")):
        pts = [p for p in points if p["study"] == study and p["noise"] > 0]
        if pts:
            ax.scatter([p["noise"] for p in pts], [p["gap"] for p in pts], marker=marker, alpha=0.7,
                       label={"clients": "authors' sigma, 10/30/50 clients", "sigma": "sigma sweep",
                              "main": "main arms"}[study])
            for p in pts:
                ax.annotate(p["tag"], (p["noise"], p["gap"]), fontsize=6, alpha=0.7)
    ax.axhline(0.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("noise per coordinate in the cluster's averaged update, sigma C2 sqrt(sum w^2) (mean over clusters)")
    ax.set_ylabel("personal accuracy gap, no DP - arm\n(per seed, best validation round from round 2)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("PFedCDP: personal accuracy lost to the update's DP noise", fontsize=9)
    tight_layout(fig)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ------------------------------------------------------------------------------ main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="results, data and runs (default %(default)s)")
    p.add_argument("--rounds", type=int, default=20, help="rounds per run (default %(default)s; paper 20)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="run seeds (default 0 1 2)")
    p.add_argument("--clients", type=int, default=10, help="clients of the main and sigma studies (default 10)")
    p.add_argument("--client-counts", type=int, nargs="*", default=[10, 30, 50],
                   help="client counts of the clients study (default 10 30 50; none: skip it)")
    p.add_argument("--sigmas", type=float, nargs="*", default=[0.03, 0.1, 0.3, 0.606],
                   help="noise multipliers of the sigma study (default 0.03 0.1 0.3 0.606; none: skip it)")
    p.add_argument("--cbis-cases", type=int, default=1200,
                   help="CBIS-DDSM fixture mammograms (default 1200: about 800 training lesion crops)")
    p.add_argument("--mias-cases", type=int, default=300, help="MIAS fixture images (default 300)")
    p.add_argument("--image-size", type=int, default=32, help="image side (default 32)")
    p.add_argument("--min-size", type=int, default=None,
                   help="Dirichlet partition min_size (default: 10 up to 20 clients, else 2)")
    p.add_argument("--first-noisy-round", type=int, default=2,
                   help="the second selection reads each arm at its best validation round from this round on "
                        "(default 2: round 1's personal models predate any noised model)")
    p.add_argument("--last", type=int, default=3, help="rounds averaged by the last-rounds table (default 3)")
    p.add_argument("--patience", type=int, default=0,
                   help="fl.early_stopping patience on val/micro_f1 (default 0: off, every run goes all rounds)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--rerun", action="store_true", help="redo runs that finished before")
    p.add_argument("--report-only", action="store_true", help="only reread the finished runs and write the tables")
    p.add_argument("--only", nargs="*", default=None,
                   help="run only these (clients:arm) pairs, e.g. 10:nodp 30:authors_formula (default all the studies')")
    p.add_argument("--smoke", action="store_true",
                   help="the test suite's run (tests/test_experiments.py): 300 CBIS-DDSM and 120 MIAS fixture "
                   "images at 16 px, 4 clients, seed 0, 2 rounds, arms nodp and authors_formula, no client or sigma "
                   "study, last 1; it checks that the script runs, its numbers are no evidence")
    a = p.parse_args(argv)
    if a.smoke:
        a.cbis_cases, a.mias_cases, a.image_size, a.clients, a.seeds, a.rounds = 300, 120, 16, 4, [0], 2
        a.client_counts, a.sigmas, a.last, a.only = [], [], 1, a.only or ["4:nodp", "4:authors_formula"]
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MEDFL_NO_PROGRESS", "1")
    import torch

    torch.set_num_threads(a.threads)
    from medfl.config import resolve_config
    from medfl.experiment import run_experiment

    t_all = time.perf_counter()
    # the fixtures of each size in their own folder (prepare_data reuses a prepared manifest)
    d = argparse.Namespace(out=a.out / f"fixture_cbis{a.cbis_cases}_mias{a.mias_cases}", cbis_dir=None,
                           mias_dir=None, cbis_cases=a.cbis_cases, mias_cases=a.mias_cases,
                           fixture_seed=0, test_ratio=1 / 3, image_size=a.image_size, roi=True)
    cbis, mias, info = compare.prepare_data(d)
    log(f"data: private {info['cbis_counts']}; public {info['mias_counts']}")
    todo = plan(a)
    if a.only:
        todo = [(n, lab) for n, lab in todo if f"{n}:{lab}" in set(a.only)]
    if not a.report_only:
        for n, lab in todo:
            for seed in a.seeds:
                rd = run_dir(a, n, seed, lab)
                if (rd / "summary.json").is_file() and not a.rerun:
                    continue
                t0 = time.perf_counter()
                run_experiment(resolve_config(run_config(a, cbis, mias, n, seed, lab)))
                log(f"c{n} seed {seed} {lab}: {time.perf_counter() - t0:.0f} s")
    done = {(n, lab): [run_dir(a, n, s, lab) for s in a.seeds] for n, lab in plan(a)}
    done = {k: v for k, v in done.items() if all((d / "summary.json").is_file() for d in v)}
    md = ["# PFedCDP: the update's DP against personal accuracy (experiments/pfedcdp_evidence.py)", "",
          f"`python experiments/pfedcdp_evidence.py {' '.join(argv if argv is not None else sys.argv[1:])}`", "",
          f"Data: CBIS-DDSM fixture ({a.cbis_cases} cases, lesion crops {a.image_size} px) label counts "
          f"{info['cbis_counts']}; MIAS fixture {info['mias_counts']}. Each client's rows 70/15/15 "
          f"train/val/test; {a.rounds} rounds; seeds {a.seeds}; every arm preset 'authors_formula' with only "
          "the noise changed (authors_v1_7: the authors' v1.7 clients); no post-hoc refinement (it does not touch "
          "the personal models).", ""]
    points: list[dict[str, Any]] = []
    results: dict[str, Any] = {}
    main_arms = [lab for lab in MAIN_ARMS if (a.clients, lab) in done]
    if main_arms:
        res = report_study(a, "main", {lab: done[(a.clients, lab)] for lab in main_arms},
                           f"PFedCDP, {a.clients} clients, preset authors_formula")
        results["main"] = res
        md += [f"## Main arms ({a.clients} clients)", "", (a.out / "main" / "arms_table.md").read_text(), "",
               "From round 2 on (round 1's personal models predate any noised model):", "",
               (a.out / "main" / "from_round.md").read_text(), "",
               "Mean of the last rounds:", "", (a.out / "main" / "last_rounds" / "arms_table.md").read_text(), "",
               "What the mechanisms did (mean ± std over seeds):", "", mechanisms_md(res["mech"]), "",
               "Curves: main/arms_curves.png", ""]
        if "nodp" in main_arms:
            sig = {r["arm"]: r["sigma"] or 0.0 for r in res["mech"]}
            rows = gap_rows(res, main_arms, "sigma", [f"{sig[lab]:.3g}" for lab in main_arms])
            md += ["Gap to no DP (per seed, at each arm's best validation round):", "", gap_md(rows, "sigma"), ""]
            points += [{"study": "main", "noise": r["noise_per_coordinate"], "gap": g, "tag": r["arm"]}
                       for r in rows
                       for g in [b - x for b, x in zip(res["late_scores"]["nodp"], res["late_scores"][r["arm"]])]]
    counts = [n for n in a.client_counts if all((n, lab) in done for lab in CLIENT_ARMS)]
    if counts:
        rows_all = []
        for n in counts:
            res = report_study(a, f"clients/c{n}", {lab: done[(n, lab)] for lab in CLIENT_ARMS},
                               f"PFedCDP, {n} clients, nodp vs authors_formula")
            rows = gap_rows(res, ["authors_formula"], "clients", [n])
            rows_all += rows
            points += [{"study": "clients", "noise": rows[0]["noise_per_coordinate"], "gap": b - x, "tag": f"c{n}"}
                       for b, x in zip(res["late_scores"]["nodp"], res["late_scores"]["authors_formula"])]
        import pandas as pd

        (a.out / "clients").mkdir(parents=True, exist_ok=True)
        pd.DataFrame(rows_all).to_csv(a.out / "clients" / "gap.csv", index=False)
        (a.out / "clients" / "gap.md").write_text(gap_md(rows_all, "clients"))
        md += ["## Clients study: the authors' sigma at each client count", "", gap_md(rows_all, "clients"), "",
               "Per client count: clients/c<N>/arms_table.md, mechanisms.md, arms_curves.png", ""]
    sig_arms = [sigma_label(s) for s in a.sigmas if (a.clients, sigma_label(s)) in done]
    if sig_arms and (a.clients, "nodp") in done:
        labs = ["nodp", *sig_arms] + [lab for lab in ("authors_formula", "paper_dp") if (a.clients, lab) in done]
        res = report_study(a, "sigma", {lab: done[(a.clients, lab)] for lab in labs},
                           f"PFedCDP, {a.clients} clients, noise multiplier sweep")
        results["sigma"] = res
        sig = {r["arm"]: r["sigma"] or 0.0 for r in res["mech"]}
        rows = gap_rows(res, labs, "sigma", [f"{sig[lab]:.3g}" for lab in labs])
        import pandas as pd

        pd.DataFrame(rows).to_csv(a.out / "sigma" / "gap.csv", index=False)
        (a.out / "sigma" / "gap.md").write_text(gap_md(rows, "sigma"))
        md += [f"## Sigma study ({a.clients} clients)", "", gap_md(rows, "sigma"), "",
               "What the mechanisms did:", "", mechanisms_md(res["mech"]), "", "Curves: sigma/arms_curves.png", ""]
        points += [{"study": "sigma", "noise": r["noise_per_coordinate"], "gap": b - x, "tag": f"s{r['sigma']}"}
                   for r in rows if r["arm"].startswith("sigma_")
                   for b, x in zip(res["late_scores"]["nodp"], res["late_scores"][r["arm"]])]
    if points:
        plot_gap(points, a.out / "gap_vs_noise.png")
        md += ["Every run's gap against the noise per coordinate: gap_vs_noise.png", ""]
    md += [f"(this invocation {(time.perf_counter() - t_all) / 60:.1f} min)"]
    (a.out / "evidence.md").write_text("\n".join(md))
    log("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
