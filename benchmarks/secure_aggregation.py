#!/usr/bin/env python
"""What does secure aggregation (``fl.secure_aggregation``, Flower's SecAgg+) cost per round?

The same FedAvg job (``small_cnn`` on the generated ``synthetic2d`` set, one local epoch,
evaluation on the last round only) runs on Flower's simulation runtime (``fl.backend: ray``:
medfl's real ServerApp and ClientApp, Flower's ``secaggplus_mod`` at every simulated site,
the SuperNode's ``Context`` kept by Flower) with and without SecAgg+, for 3 and 5 clients.

Measured per configuration, from the run's own files:

- seconds per round: the training exchanges of a round in ``flower_events.csv`` (the
  ``train:all`` rows, plus SecAgg+'s ``secagg.*:all`` stages), median over the rounds after
  the first (which warms caches);
- bytes per round: ``communication.csv``, all clients together, phases ``train`` and
  ``secagg`` (to and from the clients), mean over rounds;
- the largest difference between the two runs' ``metrics.csv`` values (SecAgg+'s quantization).

The simulation runtime passes messages in memory, so the figures are SecAgg+'s own cost
(key agreement, Shamir shares, masks, quantization, three more exchanges and larger answers);
a real deployment adds Flower's message latency to each of its three extra exchanges
(docs/flower.md, ``benchmarks/flower_overhead.py``).

``python benchmarks/secure_aggregation.py --help`` lists the options; writes
``secure_aggregation.csv`` to ``--out`` and prints a table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import pandas as pd


def job(work: Path, name: str, clients: int, rounds: int, width: int, secure: bool, seed: int) -> dict[str, Any]:
    """The ``fl`` config of one run."""
    fl: dict[str, Any] = {
        "name": name, "output_dir": str(work / "runs"), "seed": seed, "rounds": rounds, "num_clients": clients,
        "progress": False, "overwrite": True, "plots": False, "eval_every": 0,
        "dataset": {"name": "synthetic2d", "root": str(work / "data"), "num_samples": 48 * clients,
                    "num_classes": 2, "image_size": 16, "noise": 0.5},
        "partition": {"name": "iid"},
        "model": {"name": "small_cnn", "width": width},
        "train": {"batch_size": 8, "lr": 0.05},
        "eval_splits": ["test"],
        "methods": [{"name": "fedavg"}],
        "backend": {"name": "ray", "client_cpus": 1, "num_cpus": 2},
    }
    if secure:
        fl["secure_aggregation"] = True
    return fl


def measure(run_dir: Path) -> dict[str, float]:
    """Seconds and bytes per round of one finished run (see the module docstring)."""
    events = pd.read_csv(run_dir / "flower_events.csv")
    rows = events[events["phase"].astype(str).str.endswith(":all")
                  & events["phase"].astype(str).str.match(r"^(train|secagg\.)")]
    per_round = rows.groupby("round")["seconds"].sum()
    later = per_round[per_round.index > per_round.index.min()]
    comm = pd.read_csv(run_dir / "communication.csv")
    comm = comm[comm["phase"].isin(["train", "secagg"])]
    by_round = comm.groupby("round")[["bytes_to_client", "bytes_from_client"]].sum()
    return {"seconds_per_round": float(statistics.median(later if len(later) else per_round)),
            "bytes_to_clients_per_round": float(by_round["bytes_to_client"].mean()),
            "bytes_from_clients_per_round": float(by_round["bytes_from_client"].mean())}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print its table."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--clients", type=int, nargs="+", default=[3, 5])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--width", type=int, default=8, help="small_cnn width (default 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="where to write secure_aggregation.csv")
    args = ap.parse_args(argv)

    from medfl.config import resolve_config
    from medfl.experiment import run_experiment

    rows = []
    with tempfile.TemporaryDirectory(prefix="medfl_secagg_") as tmp:
        work = Path(tmp)
        for n in args.clients:
            dirs = {}
            for secure in (False, True):
                name = f"n{n}_{'secagg' if secure else 'plain'}"
                out = run_experiment(resolve_config(job(work, name, n, args.rounds, args.width, secure, args.seed)))
                dirs[secure] = Path(out["dir"]) / "fedavg"
                rows.append({"clients": n, "secure_aggregation": secure, **measure(dirs[secure])})
            a, b = (pd.read_csv(dirs[s] / "metrics.csv") for s in (False, True))
            num = [c for c in a.columns if a[c].dtype.kind == "f"]
            rows[-1]["max_metric_difference"] = float((a[num] - b[num]).abs().max().max())
    table = pd.DataFrame(rows)
    for n in args.clients:
        plain = table[(table["clients"] == n) & ~table["secure_aggregation"]].iloc[0]
        idx = table[(table["clients"] == n) & table["secure_aggregation"]].index[0]
        table.loc[idx, "time_ratio"] = table.loc[idx, "seconds_per_round"] / plain["seconds_per_round"]
        table.loc[idx, "bytes_from_ratio"] = (table.loc[idx, "bytes_from_clients_per_round"]
                                              / plain["bytes_from_clients_per_round"])
    from medfl.models.registry import build_model

    spec = {"name": "small_cnn", "width": args.width, "spatial_dims": 2, "in_channels": 1, "num_classes": 2}
    values = sum(t.numel() for t in build_model(spec).state_dict().values())
    print(f"small_cnn width {args.width}: {values:,} values in its state; {args.rounds} rounds, median seconds of "
          "the rounds after the first, bytes of the train and secagg phases (all clients)")
    pd.set_option("display.width", 200)
    print(table.to_string(index=False, float_format=lambda v: f"{v:,.4g}"))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        table.to_csv(args.out / "secure_aggregation.csv", index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
