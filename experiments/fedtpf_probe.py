#!/usr/bin/env python
"""Quick probes of FedTPF's mechanisms on the PathMNIST fixture: run any method entries on one
split and print, per arm, what its mechanisms did (stop rounds or ``cap``, the smallest eq. 8
weight, Delta_perf, the residual classifier's accuracy on ``x_s`` and ``x_p`` round by round,
the release's clip and noise-to-signal), its warnings and its final global-test accuracy.

Tiny by design (a few rounds, a few clients, one seed): for seeing a mechanism act, not for
comparing methods (``fedtpf_compare.py`` runs the comparison). The data are
``fedtpf_compare.py``'s fixture (``--cases`` tiles; ``--public N`` more tiles of another seed
as ``fl.public_dataset`` for ``clip: "public_quantile"``).

    python experiments/fedtpf_probe.py --rounds 7 --entries '[{"name": "fedtpf", "distill_rounds": 5},
        {"name": "fedtpf", "label": "paper_noise", "distill_rounds": 5, "noise": {"variance": 0.15}, "epsilon": null}]'

``--decay-lambdas L ...`` runs every FedTPF entry with decay on once per eq. 8 lambda (labels
``<label>_lambda<L>``) and prints, per lambda, the range of alpha over stage 1 (every client
and round aggregated) and whether it stayed within 1 % of 1 (the decay cannot change the
aggregate: FedTPF warns). ``--curves`` prints every arm's global-test accuracy round by round
(the mean over the evaluating clients of ``metrics.csv``) and the round each is scored from
(FedTPF/FedFed: the release round, the first trained with the shared set).

    python experiments/fedtpf_probe.py --split label_skew_2 --rounds 8 --decay-lambdas 1 10 100 \
        --entries '[{"name": "fedtpf", "preset": "paper", "distill_rounds": 5, "target_accuracy": 0.5}]'
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from fedtpf_compare import ROOT, SPLITS, prepare, prepare_public
from medfl.arm_report import round_curves
from medfl.config import resolve_config
from medfl.experiment import run_experiment

__all__ = ["describe", "with_lambdas", "alpha_table", "curves", "main"]


def describe(run: Path) -> list[str]:
    """What one run's mechanisms did, as lines."""
    s = json.loads((run / "summary.json").read_text())
    rep: dict[str, Any] = s.get("method_report", {})
    lines = [f"== {run.name}: global_test accuracy {s['final']['global_test']['accuracy']['mean']:.4f}; "
             f"epsilon {s['privacy'].get('epsilon')}, private {s['privacy'].get('private')}"]
    if rep:
        rel, decay = rep.get("release", {}), rep.get("decay", {})
        lines.append(f"   stop rounds {rep.get('stop_rounds')}; stage 1 ended after round "
                     f"{rep.get('transition', {}).get('after_round')} ({rep.get('transition', {}).get('reason')})")
        lines.append(f"   decay {decay.get('reading')}: min alpha {decay.get('min_alpha')}; Delta_perf used "
                     f"{ {int(k): round(v, 3) for k, v in (decay.get('delta_perf') or {}).items()} }")
        shown = ("noise", "clip", "clip_source", "noise_per_coordinate", "x_s_norm_mean", "clipped_fraction",
                 "noise_to_signal")
        lines.append("   release: " + ", ".join(f"{k} {round(v, 4) if isinstance(v, float) else v}"
                                                for k, v in rel.items() if k in shown))
    if (run / "mechanisms.csv").is_file():
        log = pd.read_csv(run / "mechanisms.csv", dtype={"id": str, "text": str}, keep_default_na=False)
        acc = log[(log["mechanism"] == "stop_condition") & (log["scope"] == "client") & (log["value"] != "")
                  & log["name"].isin(["residual_accuracy_x_s", "residual_accuracy_x_p"])]
        if len(acc):
            table = acc.assign(value=acc["value"].astype(float)).groupby(["round", "name"])["value"].agg(
                ["mean", "max"]).unstack()
            lines += ["   residual accuracy (mean and max over clients):",
                      *("   " + line for line in table.round(3).to_string().splitlines())]
    lines += [f"   warning (round {w['round']}): {w['warning']}" for w in s.get("warnings", [])]
    return lines


def with_lambdas(entries: list[dict[str, Any]], lambdas: list[float]) -> list[dict[str, Any]]:
    """``entries`` with every FedTPF entry whose decay is on replaced by one copy per eq. 8
    lambda, labelled ``<label>_lambda<L>``; the other entries unchanged."""
    out: list[dict[str, Any]] = []
    for entry in entries:
        if entry.get("name") != "fedtpf" or entry.get("decay") is False or not lambdas:
            out.append(entry)
            continue
        label = str(entry.get("label", entry["name"]))
        out += [{**entry, "label": f"{label}_lambda{lam:g}", "decay_lambda": float(lam)} for lam in lambdas]
    return out


def alpha_table(runs: dict[str, Path]) -> pd.DataFrame:
    """Per FedTPF run: eq. 8's lambda, the smallest and largest alpha of stage 1 (over every
    aggregated client and round), the clients that stopped, and whether alpha stayed within
    1 % of 1 (``inert``: the decay cannot change the aggregate)."""
    rows = []
    for label, run in runs.items():
        rep = json.loads((run / "summary.json").read_text()).get("method_report", {})
        decay = rep.get("decay")
        if not decay or not decay.get("on"):
            continue
        rows.append({"arm": label, "lambda": decay.get("lambda"), "min_alpha": decay.get("min_alpha"),
                     "max_alpha": decay.get("max_alpha"), "stopped": len(rep.get("stopped_at", {})),
                     "clients": rep.get("stop_condition", {}).get("clients"), "inert": decay.get("inert")})
    return pd.DataFrame(rows)


def curves(runs: dict[str, Path], split: str = "global_test", metric: str = "accuracy") -> pd.DataFrame:
    """Per round (rows) and arm (columns): the mean over the evaluating clients of ``metric``
    on ``split`` (from each run's ``metrics.csv``)."""
    cols = {}
    for label, run in runs.items():
        metrics = pd.read_csv(run / "metrics.csv", dtype={"client_id": str}, keep_default_na=False,
                              na_values=["", "nan", "NaN"])
        per = round_curves(metrics)
        per = per[per["split"] == split]
        cols[label] = per.set_index("round")[metric]
    return pd.DataFrame(cols)


def main(argv: list[str] | None = None) -> int:
    """Run the entries and print what their mechanisms did."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--entries", default=None, help="a JSON list of method entries (required but with --smoke)")
    p.add_argument("--split", choices=list(SPLITS), default="dirichlet_1.0")
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--fraction", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cases", type=int, default=900, help="fixture tiles over train/val/test")
    p.add_argument("--public", type=int, default=0, metavar="N", help="N public tiles (clip public_quantile)")
    p.add_argument("--decay-lambdas", nargs="*", type=float, default=[], metavar="L",
                   help="run every FedTPF entry with decay on once per eq. 8 lambda; print alpha's range per lambda")
    p.add_argument("--curves", action="store_true", help="print every arm's global-test accuracy per round")
    p.add_argument("--name", default="probe")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "fedtpf_probe")
    p.add_argument("--smoke", action="store_true",
                   help="the test suite's run (tests/test_experiments.py): 450 tiles, 3 clients, 2 rounds, by "
                   "default the entry FedTPF with stage 1 capped at 1 round of 2 distillation steps; it checks "
                   "that the script runs, its numbers are no evidence")
    a = p.parse_args(argv)
    if a.smoke:
        a.cases, a.clients, a.rounds = 450, 3, 2
        a.entries = a.entries or json.dumps([{"name": "fedtpf", "distill_rounds": 1, "distill_steps": 2}])
    if a.entries is None:
        p.error("the following arguments are required: --entries")
    os.environ.setdefault("MEDFL_NO_PROGRESS", "1")
    torch.set_num_threads(1)
    a.out.mkdir(parents=True, exist_ok=True)
    entries = with_lambdas(json.loads(a.entries), a.decay_lambdas)
    fl: dict[str, Any] = {
        "name": a.name, "output_dir": str(a.out / "runs"), "seed": a.seed, "rounds": a.rounds,
        "num_clients": a.clients, "fraction": a.fraction, "progress": False, "overwrite": True,
        "eval_every": 1 if a.curves else 0,
        "dataset": {"name": "manifest", "path": str(prepare(a) / "manifest.csv"), "column": "path",
                    "num_classes": 9, "cache": "memory"},
        "partition": SPLITS[a.split], "client_split": {"train": 0.85, "val": 0.15},
        "eval_splits": ["val", "global_test"], "model": {"name": "small_cnn", "width": 8},
        "train": {"epochs": 1, "batch_size": 32, "eval_batch_size": 256, "lr": 0.05}, "methods": entries}
    if a.public:
        fl["public_dataset"] = {"name": "manifest", "path": str(prepare_public(a) / "manifest.csv"),
                                "column": "path", "num_classes": 9, "cache": "memory"}
    started = time.time()
    out = run_experiment(resolve_config(fl))
    print(f"# {a.name}: {a.split}, {a.clients} clients, {a.rounds} rounds, seed {a.seed}, "
          f"{time.time() - started:.0f} s")
    runs = {str(e.get("label", e["name"])): Path(out["dir"]) / str(e.get("label", e["name"])) for e in entries}
    for run in runs.values():
        print("\n".join(describe(run)))
    if a.decay_lambdas:
        print(f"\n# eq. 8's alpha over stage 1 per lambda ({a.clients} clients, seed {a.seed}):")
        print(alpha_table(runs).to_string(index=False))
    if a.curves:
        scored = {}
        for label, run in runs.items():
            rel = json.loads((run / "summary.json").read_text()).get("method_report", {}).get("transition", {})
            scored[label] = rel.get("release_round", 1)
        print(f"\n# global_test accuracy per round, mean over the evaluating clients (seed {a.seed}); scored from "
              f"round: {scored}")
        print(curves(runs).round(4).to_string())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
