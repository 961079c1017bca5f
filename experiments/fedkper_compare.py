#!/usr/bin/env python
"""FedKPer vs FedAvg vs FedProx and FedKPer's two ablations, in the columns of the FedKPer
paper's Table 1, on the Derm7pt fixture (or a prepared real Derm7pt with --dataset-dir).

Runs bundles/derm7pt_fedkper (20 clients, Dirichlet 0.1, 10 % sampling per round) once per
seed with five methods on the same partition and the same sampled clients:
``fedkper``, ``fedavg``, ``fedprox`` (mu 0.01), ``kd_only`` (eq. 3 with FedAvg weights) and
``agg_only`` (eq. 6 aggregation, plain cross-entropy). Prints mean +- std over seeds of:
Avg Global Acc, Avg Global BwT, Avg Global Consistency, Avg Local Acc, Avg Worst Client Acc,
Avg Local Consistency, Balance ("Avg" = mean over rounds, as in the paper), and writes
``table.csv`` / ``table.json`` and every run directory under --out.

    python experiments/fedkper_compare.py --out runs/fedkper_compare [--seeds 0 1 2] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "bundles" / "derm7pt_fedkper" / "configs" / "train.json"
METHODS = [
    {"name": "fedkper", "label": "fedkper"},
    {"name": "fedavg", "label": "fedavg"},
    {"name": "fedprox", "mu": 0.01, "label": "fedprox"},
    {"name": "fedkper", "aggregation": "fedavg", "label": "kd_only"},
    {"name": "fedkper", "distill": False, "label": "agg_only"},
]
COLUMNS = {  # Table 1 column -> comparison_forgetting.csv column
    "Avg Global Acc": "global_acc_mean",
    "Avg Global BwT": "global_bwt_mean",
    "Avg Global Consistency": "global_consistency",
    "Avg Local Acc": "local_acc_mean",
    "Avg Worst Client Acc": "local_worst_client_acc_mean",
    "Avg Local Consistency": "local_consistency",
    "Balance": "balance_mean",
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where the fixture, the prepared data and the runs go")
    p.add_argument("--dataset-dir", type=Path, default=None,
                   help="a prepared Derm7pt (data_prep/derm7pt.py output); default: a generated fixture")
    p.add_argument("--cases", type=int, default=600, help="fixture cases (default 600)")
    p.add_argument("--image-size", type=int, default=32, help="image side (default 32)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--rounds", type=int, default=15, help="rounds (default 15)")
    p.add_argument("--width", type=int, default=8, help="ResNet-10 width (default 8)")
    p.add_argument("--rerun", action="store_true", help="rerun seeds whose results are already in --out")
    p.add_argument("--smoke", action="store_true",
                   help="the test suite's run (tests/test_experiments.py): 150 cases at 16 px, 5 clients, seed 0, 2 "
                   "rounds of 1 epoch, width 4, fedkper and fedavg only; it checks that the script runs, its "
                   "numbers are no evidence")
    a = p.parse_args(argv)
    methods = METHODS
    if a.smoke:
        a.cases, a.image_size, a.seeds, a.rounds, a.width = 150, 16, [0], 2, 4
        methods = METHODS[:2]

    import pandas as pd

    from medfl.bundle import load_bundle_config
    from medfl.config import resolve_config
    from medfl.experiment import run_experiment
    from medfl.fixtures import generate
    from medfl.plugins import registry

    registry()
    os.environ.setdefault("MEDFL_NO_PROGRESS", "1")
    data = a.dataset_dir
    if data is None:
        raw = a.out / "raw"
        data = a.out / "data"
        if not (data / "manifest.csv").is_file():
            from medfl.prep.derm7pt import main as prep

            generate("derm7pt", raw, cases=a.cases, seed=0)
            prep(["--raw", str(raw), "--out", str(data), "--size", str(a.image_size), "--crop-border", "2"])
    from medfl.data.partition import PartitionError

    tables, skipped = [], []
    for seed in a.seeds:
        done = a.out / "runs" / f"seed{seed}" / "comparison_forgetting.csv"
        if done.is_file() and not a.rerun:
            t = pd.read_csv(done)
            t["seed"] = seed
            tables.append(t)
            print(f"seed {seed}: reusing {done.parent}", flush=True)
            continue
        fl = load_bundle_config(BUNDLE, {"dataset_dir": str(data), "image_size": a.image_size,
                                         "output_dir": str(a.out / "runs")})
        fl.update(name=f"seed{seed}", seed=seed, rounds=a.rounds, methods=methods, progress=False, overwrite=True,
                  model={"name": "resnet10", "width": a.width})
        fl["train"]["batch_size"] = 8
        if a.smoke:   # 5 of the bundle's 20 clients, 1 local epoch of its 5: the same code path, cheaper
            fl["num_clients"], fl["train"]["epochs"] = 5, 1
        try:
            out = run_experiment(resolve_config(fl))
        except PartitionError as exc:  # Dirichlet(0.1) over 20 clients is not feasible for every seed
            print(f"seed {seed}: skipped, {exc}", flush=True)
            skipped.append(seed)
            continue
        t = pd.read_csv(Path(out["dir"]) / "comparison_forgetting.csv")
        t["seed"] = seed
        tables.append(t)
        print(f"seed {seed}: {out['dir']}", flush=True)
    if not tables:
        print(f"no seed could be partitioned (skipped: {skipped}); try other --seeds or more --cases", flush=True)
        return 1
    allt = pd.concat(tables, ignore_index=True)
    key = "method" if "method" in allt.columns else allt.columns[0]
    rows = []
    for label in [m["label"] for m in methods]:
        g = allt[allt[key] == label]
        row = {"method": label}
        for col, src in COLUMNS.items():
            v = g[src].astype(float) if src in g else pd.Series(dtype=float)
            row[col] = f"{v.mean():.3f} +- {v.std(ddof=0):.3f}" if len(v) else "n/a"
        rows.append(row)
    table = pd.DataFrame(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    table.to_csv(a.out / "table.csv", index=False)
    allt.to_csv(a.out / "per_seed.csv", index=False)
    (a.out / "table.json").write_text(json.dumps(rows, indent=2))
    used = sorted(set(allt["seed"]))
    print(f"\nseeds {used} ({'skipped: ' + str(skipped) if skipped else 'none skipped'}), {a.rounds} rounds, "
          f"{5 if a.smoke else 20} clients, Dirichlet 0.1, 10% sampling; mean +- std over seeds:\n")
    print(table.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
