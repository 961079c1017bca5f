#!/usr/bin/env python
"""Clients in parallel on one machine: medfl's in-process engine (clients one after another,
torch on every core) against the same job on Flower's simulation runtime (``fl.backend``
``ray``: clients in parallel Ray actors, one core each), and the simulation runtime's peak
memory with many clients.

The job is ``engine_overhead.py``'s (``--workload tiny|resnet2d|resnet3d``: FedAvg on the
``random_blocks`` dataset, one client per block, evaluation at the last round only). Three ways,
each run in a fresh process, interleaved over ``--repeats``:

``inprocess``
    :func:`medfl.experiment.run_experiment`, torch on ``--cpus`` threads.
``ray``
    the same config with ``"backend": {"name": "ray", "client_cpus": --client-cpus,
    "num_cpus": --cpus}``: ``--cpus / --client-cpus`` clients train at once.
``ray-serial`` (``--serial``)
    the simulation runtime with one client at a time on every core: what Ray and the
    Flower messages cost without the parallelism.

The wall time is taken around ``run_experiment`` (after imports; Ray's start-up included);
*setup* is the time until the first round starts (Ray's start-up and the sites' hellos for the
simulation runtime), *s/round* the median of rounds 2..R-1. Break-even: the number of rounds
from which the simulation runtime's saving per round has paid for its extra set-up.

Peak memory (``--memory-clients``): the largest sum of the resident set sizes of this process
and every process it started (Ray's GCS, raylet and workers), sampled every 0.2 s.

Run ``python benchmarks/parallel_clients.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import engine_overhead as eo  # noqa: E402


def _children(pid: int) -> dict[int, list[int]]:
    tree: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        tree.setdefault(ppid, []).append(int(d.name))
    return tree


def tree_rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants now, in MiB (Linux /proc)."""
    tree, total, todo = _children(pid), 0.0, [pid]
    while todo:
        p = todo.pop()
        todo.extend(tree.get(p, []))
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += float(line.split()[1]) / 1024
        except OSError:
            pass
    return total


class PeakSampler(threading.Thread):
    """Sample :func:`tree_rss_mb` of this process every ``every`` seconds; keep the peak."""

    def __init__(self, every: float = 0.2) -> None:
        super().__init__(daemon=True)
        self.every, self.peak, self._halt = every, 0.0, threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            self.peak = max(self.peak, tree_rss_mb(os.getpid()))
            self._halt.wait(self.every)

    def stop(self) -> float:
        self._halt.set()
        self.join()
        self.peak = max(self.peak, tree_rss_mb(os.getpid()))
        return self.peak


def child(a: argparse.Namespace) -> None:
    import torch

    from medfl.config import resolve_config
    from medfl.experiment import run_experiment

    torch.set_num_threads(a.cpus)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)   # torch's one-off import, off the clock
    plugin = eo.ensure_plugin()
    work = Path(a.child_dir)
    fl = eo.fl_config(a.clients, a.rounds, a.samples_per_client, a.batch_size, a.seed, str(work / "runs"))
    if a.child != "inprocess":
        client_cpus = a.cpus if a.child == "ray-serial" else a.client_cpus
        fl["backend"] = {"name": "ray", "client_cpus": client_cpus, "num_cpus": a.cpus}
        if a.device.startswith("cuda"):   # a share of the GPU each: 1 / client_gpus clients on it at once
            fl["backend"]["client_gpus"] = 1.0 if a.child == "ray-serial" else a.client_gpus
    cfg = resolve_config(fl)
    sampler = PeakSampler()
    sampler.start()
    t0 = time.perf_counter()
    out = run_experiment(cfg)
    wall = time.perf_counter() - t0
    peak = sampler.stop()
    m = plugin.marks
    rounds = [m[f"round_end_{r}"] for r in range(1, a.rounds + 1)]
    summary = out["summaries"]["fedavg"]
    res = {"wall_s": wall, "setup_s": m["run_start"] - t0, "round_s": eo._durations(m["run_start"], rounds),
           "finish_s": t0 + wall - rounds[-1], "peak_tree_rss_mb": peak,
           "mean_local_test_acc": summary["final"]["local_test"]["accuracy"]["mean"],
           "final_state": str(sorted((Path(out["dir"]) / "fedavg" / "checkpoints").glob("round_*.pt"))[-1])}
    (work / "result.json").write_text(json.dumps(res))


def spawn(a: argparse.Namespace, way: str, clients: int, rounds: int, work: Path, label: str) -> dict[str, Any]:
    d = work / label
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", way, "--child-dir", str(d),
           "--workload", a.workload, "--clients", str(clients), "--rounds", str(rounds),
           "--samples-per-client", str(a.samples_per_client), "--batch-size", str(a.batch_size),
           "--seed", str(a.seed), "--cpus", str(a.cpus), "--client-cpus", str(a.client_cpus),
           "--device", a.device, "--client-gpus", str(a.client_gpus)]
    if a.amp:
        cmd += ["--amp", a.amp]
    print(f"  {label:<30s} ...", end="", flush=True)
    with open(d / "log.txt", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(HERE.parent), timeout=a.timeout)
    if proc.returncode != 0 or not (d / "result.json").is_file():
        tail = "\n".join((d / "log.txt").read_text(errors="replace").splitlines()[-30:])
        raise RuntimeError(f"{label} failed (exit {proc.returncode}); last lines of {d / 'log.txt'}:\n{tail}")
    res = json.loads((d / "result.json").read_text())
    print(f" {res['wall_s']:7.2f} s (setup {res['setup_s']:5.2f} s), peak memory {res['peak_tree_rss_mb']:7.1f} MiB",
          flush=True)
    return res


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def report(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Print the table (median, min-max over repeats) and the break-even; return the figures."""
    out: dict[str, Any] = {}
    print(f"\n  {'way':<34s} {'wall s':>7s} {'min-max':>13s} {'setup s':>8s} {'s/round':>8s} {'min-max':>13s}"
          f"  {'peak MiB':>8s}  final acc")
    base = None
    for way, rs in runs.items():
        walls = [r["wall_s"] for r in rs]
        per_round = [eo.steady_round_s(r["round_s"]) for r in rs]
        row = {"median_wall_s": _med(walls), "wall_s": walls, "median_setup_s": _med([r["setup_s"] for r in rs]),
               "median_round_s": _med(per_round), "round_s": per_round,
               "median_peak_mb": _med([r["peak_tree_rss_mb"] for r in rs]), "acc": rs[0]["mean_local_test_acc"]}
        out[way] = row
        base = base or row
        print(f"  {way:<34s} {row['median_wall_s']:7.2f} {min(walls):6.2f}-{max(walls):6.2f} "
              f"{row['median_setup_s']:8.2f} {row['median_round_s']:8.3f} {min(per_round):6.3f}-{max(per_round):6.3f}"
              f"  {row['median_peak_mb']:8.1f}  {row['acc']:.4f}")
    if "inprocess" in out and "ray" in out:
        seq, par = out["inprocess"], out["ray"]
        saving = seq["median_round_s"] - par["median_round_s"]
        setup_extra = par["median_setup_s"] - seq["median_setup_s"]
        out["speedup_per_round"] = seq["median_round_s"] / par["median_round_s"]
        out["speedup_wall"] = seq["median_wall_s"] / par["median_wall_s"]
        out["extra_setup_s"] = setup_extra
        out["wall_difference_s"] = par["median_wall_s"] - seq["median_wall_s"]
        out["break_even_rounds"] = setup_extra / saving if saving > 0 else None
        print(f"\n  per round: in-process / ray = {out['speedup_per_round']:.2f}x; whole run: "
              f"{out['speedup_wall']:.2f}x; the simulation runtime's extra set-up {setup_extra:.2f} s")
        if saving > 0:
            print(f"  break-even: the simulation runtime is faster from about {out['break_even_rounds']:.1f} rounds "
                  f"of this job on (it saves {saving:.2f} s a round)")
        else:
            print("  no break-even: the simulation runtime's rounds are not faster on this job and machine")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="In-process engine (sequential clients) against Flower's simulation "
                                            "runtime (parallel clients) on the same FedAvg job; peak memory.")
    p.add_argument("--workload", choices=sorted(eo.WORKLOADS), default="tiny",
                   help="the job of engine_overhead.py (default tiny)")
    p.add_argument("--clients", type=int, default=None, help="number of clients (default: the workload's)")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default: the workload's)")
    p.add_argument("--samples-per-client", type=int, default=None, help="samples per client (default: the workload's)")
    p.add_argument("--batch-size", type=int, default=None, help="local batch size (default: the workload's)")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                   help="torch threads in process; cores Ray may use (default: all)")
    p.add_argument("--client-cpus", type=int, default=1, help="cores (torch threads) of each simulated client "
                                                              "(default 1: --cpus clients at once)")
    p.add_argument("--device", default="cpu", help="where clients train: cpu (the default), cuda, cuda:N")
    p.add_argument("--client-gpus", type=float, default=0.25,
                   help="with --device cuda: the share of a GPU each simulated client holds (default 0.25: four "
                        "clients per GPU at once); the in-process engine trains one client at a time on the GPU")
    p.add_argument("--amp", choices=["bf16", "fp16"], default=None, help="mixed precision (train.amp) in every way")
    p.add_argument("--repeats", type=int, default=3, help="interleaved timed runs of each way (default 3)")
    p.add_argument("--serial", action="store_true", help="also run the simulation runtime one client at a time")
    p.add_argument("--skip-timing", action="store_true", help="only the memory measurement")
    p.add_argument("--memory-clients", default="", help="client counts for peak memory on the simulation runtime "
                                                         "(e.g. 10,100; default: none)")
    p.add_argument("--memory-rounds", type=int, default=2, help="rounds of the memory runs (default 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="also write the figures to this JSON file")
    p.add_argument("--timeout", type=float, default=1800, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=["inprocess", "ray", "ray-serial"], help=argparse.SUPPRESS)
    p.add_argument("--child-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    w = eo.set_workload(a.workload)
    eo.set_compute(a.device, a.amp, False)
    for opt, key in (("clients", "clients"), ("rounds", "rounds"), ("samples_per_client", "samples"),
                     ("batch_size", "batch_size")):
        if getattr(a, opt) is None:
            setattr(a, opt, int(w[key]))
    if a.child:
        child(a)
        return 0
    from medfl.flower.simulation import ray_missing

    if ray_missing():
        print(ray_missing(), file=sys.stderr)
        return 2
    gpu = f" and {a.client_gpus:g} GPU" if a.device.startswith("cuda") else ""
    print(f"FedAvg, {a.clients} clients x {a.rounds} rounds, {eo.describe_model()}, {a.samples_per_client} samples "
          f"per client, batch {a.batch_size}; on {eo.describe_compute()}; {a.cpus} core(s); simulated clients hold "
          f"{a.client_cpus} core(s){gpu} each.")
    work = Path(tempfile.mkdtemp(prefix="medfl-parallel-"))
    figures: dict[str, Any] = {"settings": {k: v for k, v in vars(a).items() if not k.startswith("child")}}
    try:
        if not a.skip_timing:
            ways = ["inprocess", "ray"] + (["ray-serial"] if a.serial else [])
            runs: dict[str, list[dict[str, Any]]] = {x: [] for x in ways}
            print(f"\nWall time ({a.repeats} interleaved repeat(s), each in a fresh process):")
            for i in range(a.repeats):
                for way in (ways if i % 2 == 0 else ways[::-1]):
                    runs[way].append(spawn(a, way, a.clients, a.rounds, work, f"{way}-{i + 1}"))
            figures["timing"] = report(runs)
        counts = [int(c) for c in a.memory_clients.split(",") if c.strip()]
        if counts:
            print(f"\nPeak memory on the simulation runtime ({a.memory_rounds} rounds; this process and all it "
                  "started):")
            mem = {c: spawn(a, "ray", c, a.memory_rounds, work, f"memory-ray-{c}") for c in counts}
            figures["memory_mb"] = {c: m["peak_tree_rss_mb"] for c, m in mem.items()}
            print("  clients  peak MiB")
            for c, m in mem.items():
                print(f"  {c:7d}  {m['peak_tree_rss_mb']:8.1f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if a.json:
        Path(a.json).write_text(json.dumps(figures, indent=2, default=str))
        print(f"\nFigures written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
