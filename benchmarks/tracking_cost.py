"""What experiment tracking costs a round of the demo job (bundles/demo: FedAvg and Local, 4
clients, resnet10 width 8 on 32x32 images).

Each variant runs the same seeded experiment in a fresh process: no tracking; MLflow's embedded
SQLite store (no uri); MLflow against a local ``mlflow server`` (started here on loopback with
a SQLite backend); MLflow against a server that is down (``mlflow-down``: a closed loopback
port, connections refused); TensorBoard. It prints, per variant, the median seconds per round (from one
round's end to the next, over both methods' rounds), the time tracking spends on the run's own
thread per round (turning the round's rows into scalars and queueing them: the critical path;
the trackers themselves log from a background thread), that as a percentage of a round, and
what the end of each run waits for (artifacts, final models, the queue drained).

    python benchmarks/tracking_cost.py                    # 5 rounds, 1 repeat, all variants
    python benchmarks/tracking_cost.py --rounds 10 --repeats 3
    python benchmarks/tracking_cost.py --variants none,mlflow
    python benchmarks/tracking_cost.py --rounds 2 --variants none,mlflow-down   # a server that is down
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("none", "mlflow", "mlflow-server", "mlflow-down", "tensorboard")

CHILD = r"""
import json, sys, time
from medfl import hookimpl
from medfl.bundle import load_bundle_config
from medfl.config import resolve_config
from medfl.experiment import run_experiment
from medfl.plugins import get_plugin_manager
import medfl.tracking_feed as tracking

args = json.loads(sys.argv[1])
ends, critical, finish = [], [0.0], [0.0]

class Clock:
    @hookimpl
    def on_run_start(self, run):
        ends.append(None)
        ends.append(time.perf_counter())
    @hookimpl
    def on_round_end(self, run, round, metrics):
        ends.append(time.perf_counter())

def timed(fn, into):
    def wrapper(self, *a):
        t = time.perf_counter()
        try:
            return fn(self, *a)
        finally:
            into[0] += time.perf_counter() - t
    return wrapper

rows, status = tracking._RunWatch.rows, tracking._RunWatch.status
tracking._RunWatch.rows = timed(rows, critical)
def split_status(self, st, r):
    t = time.perf_counter()
    try:
        return status(self, st, r)
    finally:
        (critical if st == "running" else finish)[0] += time.perf_counter() - t
tracking._RunWatch.status = split_status
tracking.Tracking.finish = timed(tracking.Tracking.finish, finish)

get_plugin_manager().register(Clock(), name="clock")
fl = load_bundle_config(args["config"], {"fl#output_dir": args["out"], "fl#rounds": args["rounds"],
                                         "fl#progress": False, "fl#plots": False, "dataset_dir": args["data"]})
if args["tracking"]:
    fl["tracking"] = args["tracking"]
t0 = time.perf_counter()
run_experiment(resolve_config(fl))
wall = time.perf_counter() - t0
rounds, prev = [], None
for t in ends:
    if t is not None and prev is not None:
        rounds.append(t - prev)
    prev = t
print("RESULT " + json.dumps({"rounds": rounds, "critical": critical[0], "finish": finish[0], "wall": wall}))
"""


def _free_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_server(tmp: Path) -> tuple[subprocess.Popen, str]:
    """A local ``mlflow server`` (SQLite backend, artifacts in ``tmp``), once /health answers."""
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
                             "--workers", "1", "--backend-store-uri", f"sqlite:///{tmp / 'server.db'}",
                             "--artifacts-destination", str(tmp / "server_artifacts")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=5) as resp:
                if resp.status == 200:
                    return proc, uri
        except OSError:
            time.sleep(0.5)
        if proc.poll() is not None:
            break
    proc.kill()
    raise SystemExit("mlflow server did not start within 300 s")


def run_variant(variant: str, rounds: int, tmp: Path, uri: str | None, k: int) -> dict:
    """One experiment of ``variant`` in a fresh process; its timings."""
    tracking = {"none": None, "mlflow": [{"name": "mlflow"}], "tensorboard": [{"name": "tensorboard"}],
                "mlflow-server": [{"name": "mlflow", "uri": uri, "experiment": f"bench-{k}"}],
                "mlflow-down": [{"name": "mlflow", "uri": f"http://127.0.0.1:{_free_port()}"}]}[variant]
    args = {"config": str(ROOT / "bundles" / "demo" / "configs" / "train.json"), "out": str(tmp / f"{variant}-{k}"),
            "data": str(tmp / "data"), "rounds": rounds, "tracking": tracking}
    proc = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True, text=True,
                          env={**os.environ, "MEDFL_NO_PLOTS": "1"}, timeout=3600)
    if proc.returncode != 0:
        raise SystemExit(f"{variant} failed:\n{proc.stderr[-3000:]}")
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def main(argv: list[str] | None = None) -> int:
    """Run every variant ``--repeats`` times (interleaved) and print the table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 2)[-1])
    p.add_argument("--rounds", type=int, default=5, help="rounds of each method's run (default 5)")
    p.add_argument("--repeats", type=int, default=1, help="experiments per variant, interleaved (default 1)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {', '.join(VARIANTS)}")
    args = p.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    bad = sorted(set(variants) - set(VARIANTS))
    if bad or args.rounds < 1 or args.repeats < 1:
        p.error(f"unknown variant(s) {bad}; valid: {', '.join(VARIANTS)}" if bad else "--rounds and --repeats >= 1")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="medfl-tracking-bench-") as name:
        tmp = Path(name)
        server, uri = start_server(tmp) if "mlflow-server" in variants else (None, None)
        try:
            for k in range(args.repeats):
                for v in variants:
                    results[v].append(run_variant(v, args.rounds, tmp, uri, k))
                    print(f"  {v} #{k + 1}: {results[v][-1]['wall']:.1f} s", file=sys.stderr, flush=True)
        finally:
            if server is not None:
                server.terminate()
                server.wait(timeout=60)
    base = None
    print(f"\ndemo job, {args.rounds} rounds x 2 methods, {args.repeats} repeat(s); seconds per round are medians")
    print(f"{'variant':<14} {'s/round':>8} {'vs none':>8} {'on-thread s/round':>18} {'% of round':>10} "
          f"{'end of runs s':>13} {'wall s':>7}")
    for v in variants:
        per_round = statistics.median([r for res in results[v] for r in res["rounds"]])
        n = sum(len(res["rounds"]) for res in results[v])
        critical = sum(res["critical"] for res in results[v]) / n
        finish = statistics.median([res["finish"] for res in results[v]])
        wall = statistics.median([res["wall"] for res in results[v]])
        if v == "none":
            base = per_round
        diff = "" if base is None or v == "none" else f"{100 * (per_round - base) / base:+.1f}%"
        print(f"{v:<14} {per_round:8.3f} {diff:>8} {critical:18.4f} {100 * critical / per_round:9.2f}% "
              f"{finish:13.2f} {wall:7.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
