#!/usr/bin/env python
"""FedSKD vs FedCross-dagger vs Local with heterogeneous ResNet-10s, on the ABIDE and Derm7pt
fixtures (or prepared real data), in the columns of the FedSKD paper's Tables II/III.

Runs bundles/abide_fedskd (4 regional clients, 3D, CC200-style region masks) and
bundles/derm7pt_fedskd (3 clients, Dirichlet 1.0, 2D, no region term) once per seed, every
method on the same split, and prints, per dataset and method, the mean +- std over seeds of
the Local Test AUC (each client's model on its own test split, mean over clients) and the
Global Test AUC (each client's model on every client's test split, clients weighted equally,
mean over clients), plus the seconds per round of each method and FedSKD's cost relative to
FedCross-dagger. Writes ``table.csv``, ``table.json``, ``per_seed.csv`` and every run under --out.

The widths are the paper's 64, 62, 60, 58 scaled down (default 8, 7, 6, 5) so the fixtures
run on a laptop CPU; ``--folds K`` runs K-fold cross-validation instead of one split.

    python experiments/fedskd_compare.py --out runs/fedskd_compare [--seeds 0 1 2] [--rounds 10]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BUNDLES = {"abide": ROOT / "bundles" / "abide_fedskd" / "configs" / "train.json",
           "derm7pt": ROOT / "bundles" / "derm7pt_fedskd" / "configs" / "train.json"}
METHODS = ["fedskd", "fedcross_het", "local"]


def _prepare(name: str, out: Path, cases: int, size: int) -> Path:
    """Generate the fixture download and run its data_prep script (once)."""
    from medfl.fixtures import generate

    raw, data = out / f"{name}_raw", out / f"{name}_data"
    if (data / "manifest.csv").is_file():
        return data
    if name == "abide":
        from medfl.prep.abide import main as prep

        info = generate("abide", raw, cases=cases, seed=0, reference=False)
        prep(["--raw", str(raw), "--out", str(data), "--size", str(size), "--test-fold", "none",
              "--atlas", "file", "--atlas-file", str(info["signal_atlas"])])
    else:
        from medfl.prep.derm7pt import main as prep

        generate("derm7pt", raw, cases=cases, seed=0, reference=False)
        prep(["--raw", str(raw), "--out", str(data), "--size", str(size), "--crop-border", "2"])
    return data


def _config(name: str, data: Path, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    from medfl.bundle import load_bundle_config

    size = a.abide_size if name == "abide" else a.derm_size
    overrides: dict[str, Any] = {"dataset_dir": str(data), "output_dir": str(a.out / "runs")}
    if a.iterations is not None:
        overrides["iterations"] = a.iterations
    overrides["spatial_size" if name == "abide" else "image_size"] = [size] * 3 if name == "abide" else size
    fl = load_bundle_config(BUNDLES[name], overrides)
    n = int(fl["num_clients"])
    fl.update(name=f"{name}_seed{seed}", seed=seed, rounds=a.rounds, progress=False, overwrite=True,
              client_models=[{"width": w} for w in a.widths[:n]])
    if a.folds:
        fl["cv"] = {**fl.get("cv", {}), "folds": a.folds}
    else:
        fl.pop("cv", None)
    fl["model"] = {"name": "resnet10", "width": a.widths[0]}
    if a.lr is not None:
        fl["train"]["lr"] = a.lr
    if a.local_epochs is not None:
        fl["train"]["epochs"] = a.local_epochs
    fl["methods"] = [m for m in fl["methods"] if m.get("label", m["name"]) in a.methods]
    if name == "derm7pt":
        fl["partition"]["min_size"] = 10
    return fl


def _collect(exp_dir: Path, label: str, folds: int) -> dict[str, float]:
    """One seed's figures of one method: local/global AUC (mean over clients; with folds, the
    cross-validated overall mean), seconds per round and the eq. 16 fairness gap."""
    dirs = [exp_dir / f"fold_{k}" / label for k in range(folds)] if folds else [exp_dir / label]
    summaries = [json.loads((d / "summary.json").read_text()) for d in dirs]
    s_round = sum(s["wall_time_s_last_session"] / s["rounds"] for s in summaries) / len(summaries)
    if folds:
        block = json.loads((exp_dir / "cv_summary.json").read_text())["methods"][label]
        fair = block.get("fairness", {}).get("delta_auc", {}).get("mean")
        return {"local_auc": block["local_test"]["overall"]["mean"],
                "global_auc": block["cross_test"]["overall"]["mean"], "s_per_round": s_round,
                "delta_auc": float("nan") if fair is None else fair}
    final = summaries[0]["final"]
    return {"local_auc": final["local_test"]["auc"]["mean"], "global_auc": final["cross_test"]["auc"]["mean"],
            "s_per_round": s_round, "delta_auc": summaries[0].get("fairness", {}).get("delta_auc", float("nan"))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where fixtures, prepared data and runs go")
    p.add_argument("--datasets", nargs="+", choices=sorted(BUNDLES), default=sorted(BUNDLES))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
    p.add_argument("--iterations", type=int, default=None,
                   help="optimizer steps per round per client (default: the bundle's 5 x N)")
    p.add_argument("--widths", type=int, nargs="+", default=[8, 7, 6, 5],
                   help="first-stage widths of the clients' ResNet-10s (default 8 7 6 5)")
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the bundles' Adam 1e-4)")
    p.add_argument("--folds", type=int, default=0, help="cross-validation folds (default 0: one split)")
    p.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS,
                   help=f"methods to run (default {' '.join(METHODS)})")
    p.add_argument("--local-epochs", type=int, default=None,
                   help="train.epochs, used by Local only (FedSKD and FedCross-dagger take --iterations "
                        "steps); default 1. About iterations / steps-per-epoch matches their compute")
    p.add_argument("--abide-cases", type=int, default=80, help="ABIDE fixture subjects (default 80)")
    p.add_argument("--abide-size", type=int, default=16, help="ABIDE volume side (default 16)")
    p.add_argument("--derm-cases", type=int, default=300, help="Derm7pt fixture cases (default 300)")
    p.add_argument("--derm-size", type=int, default=32, help="Derm7pt image side (default 32)")
    p.add_argument("--smoke", action="store_true",
                   help="the test suite's run (tests/test_experiments.py): FedSKD on Derm7pt only, 300 cases at 16 "
                   "px, seed 0, 2 rounds of 2 iterations, widths 4; it checks that the script runs, its "
                   "numbers are no evidence")
    a = p.parse_args(argv)
    if a.smoke:
        a.datasets, a.derm_cases, a.derm_size, a.seeds, a.rounds, a.iterations = ["derm7pt"], 300, 16, [0], 2, 2
        a.widths, a.methods = [4, 4, 4, 4], ["fedskd"]

    import pandas as pd

    from medfl.config import resolve_config
    from medfl.experiment import run_experiment
    from medfl.plugins import registry

    registry()
    os.environ.setdefault("MEDFL_NO_PROGRESS", "1")
    rows = []
    for name in a.datasets:
        cases, size = (a.abide_cases, a.abide_size) if name == "abide" else (a.derm_cases, a.derm_size)
        data = _prepare(name, a.out, cases, size)
        for seed in a.seeds:
            fl = _config(name, data, a, seed)
            t0 = time.perf_counter()
            out = run_experiment(resolve_config(fl))
            print(f"{name} seed {seed}: {out['dir']} ({time.perf_counter() - t0:.0f} s)", flush=True)
            for label in a.methods:
                rows.append({"dataset": name, "seed": seed, "method": label, **_collect(Path(out["dir"]), label, a.folds)})
    per_seed = pd.DataFrame(rows)
    a.out.mkdir(parents=True, exist_ok=True)
    per_seed.to_csv(a.out / "per_seed.csv", index=False)
    table = []
    for (name, label), g in per_seed.groupby(["dataset", "method"], sort=False):
        skd = per_seed[(per_seed.dataset == name) & (per_seed.method == "fedskd")]["s_per_round"].mean()
        cross = per_seed[(per_seed.dataset == name) & (per_seed.method == "fedcross_het")]["s_per_round"].mean()
        table.append({"dataset": name, "method": label,
                      "local_test_auc": f"{g.local_auc.mean():.3f} +- {g.local_auc.std(ddof=0):.3f}",
                      "global_test_auc": f"{g.global_auc.mean():.3f} +- {g.global_auc.std(ddof=0):.3f}",
                      "delta_auc": f"{g.delta_auc.mean():.3f} +- {g.delta_auc.std(ddof=0):.3f}",
                      "s_per_round": round(float(g.s_per_round.mean()), 2),
                      "fedskd_cost_vs_fedcross_het": round(float(skd / cross), 2) if label == "fedskd" else None})
    t = pd.DataFrame(table)
    t.to_csv(a.out / "table.csv", index=False)
    (a.out / "table.json").write_text(json.dumps(table, indent=2))
    print(f"\nseeds {a.seeds}, {a.rounds} rounds, widths {a.widths}, lr {a.lr or 1e-4}; mean +- std over seeds "
          "(AUC: mean over clients of the last round):\n")
    print(t.to_string(index=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
