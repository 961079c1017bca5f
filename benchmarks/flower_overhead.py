#!/usr/bin/env python
"""What does running a medfl job over Flower cost, against the in-process engine?

The same FedAvg job (default: 3 clients, 4 rounds, ``small_cnn`` width 8 on the generated
``synthetic2d`` set, 240 images of 32x32, batch 16, one local epoch, evaluation every
round) runs twice:

``in-process``
    :func:`medfl.experiment.run_experiment` in this process (imports and plugin loading
    done before the clock starts).
``flower``
    a real deployment on loopback: ``medfl flower superlink``, one ``medfl flower site``
    per client (a SuperNode and its site worker, separate processes), and the run launched
    with ``flwr run`` (``LocalFederation`` of ``tests/flower/local_federation.py``).

Measured:

- start-up. In process: from the call to the first round's start (data split, run
  directory, method set-up). Flower: *deployment* (SuperLink and sites started until every
  SuperNode has registered; paid once for many runs) and *run* (from ``flwr run`` to the
  coordinator having found every site: ServerApp process start, imports, hellos).
- per-round seconds: in process from the ``on_round_end`` hook; over Flower from the
  coordinator's ``flower_events.csv`` (end of each round's evaluation exchange). The first
  round is reported apart (it warms caches); the per-round figure is the median of the
  others.
- overhead: Flower per round minus in-process per round, and their ratio; and the metrics
  of both runs must agree (max absolute difference printed).
- where a Flower round goes (:func:`breakdown`), per round from the run's files: the
  coordinator's exchanges (``train:all``, ``evaluate:all`` rows of ``flower_events.csv``)
  against its own work between them (aggregation, checkpoint, metrics); and within each
  exchange, for the site that answered last (the one the exchange waited for): its own work
  (decode, train or evaluate, encode: the ``answered in`` line of the site's ``log.txt``),
  Flower's start of the per-message ClientApp process until it forwarded the message (the
  ``ClientApp process had run`` part of that line), and the rest of what the coordinator
  measured for that site: Flower's transport and idle waits (the SuperNode asking the
  SuperLink for work, the objects of the message pulled and pushed, the SuperExec handing
  the task over, the reply's way back, the coordinator's pull interval); what is left of the
  exchange is the coordinator's sending: it encodes the messages and uploads them to the
  SuperLink (Flower pushes each array of a message as an object of its own, one request
  each) before a site's clock starts. A site that picked its message up while the others were
  still being uploaded started before its clock did, which can make its transport figure
  small or even negative: the parts are exact only as a sum.

medfl runs Flower's commands unchanged (issue 65): what a round costs over Flower is Flower's
own start of a process per message, its 3-s idle wait of each SuperNode and its transport, and
the breakdown says which.

The anchor (issue 20): the same job as a plain Flower app (``plain_flower_app.py``: Flower's
own ``FedAvg`` strategy, a plain PyTorch ClientApp, same data, model and rounds) on the same
kind of loopback deployment (a SuperLink and one plain ``flower-supernode`` per client); its
per-round time is what medfl over Flower is compared with (target: medfl <= 1.1x plain Flower).
The job evaluates each client's test split every round in all three.

Writes ``flower_overhead.csv`` and ``flower_overhead.json`` to ``--out`` and prints a
table. ``python benchmarks/flower_overhead.py --help`` lists the options.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from medfl import hookimpl

# the harness of the real-process tests: a federation on loopback (LocalFederation)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "flower"))


def job(work: Path, clients: int, rounds: int, samples: int, image_size: int, seed: int) -> dict[str, Any]:
    """The ``fl`` config of the job (run name and output directory set by the caller)."""
    return {
        "seed": seed, "rounds": rounds, "num_clients": clients, "progress": False, "overwrite": True,
        "dataset": {"name": "synthetic2d", "root": str(work / "data"), "num_samples": samples, "num_classes": 3,
                    "image_size": image_size, "noise": 0.8},
        "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 20},
        "model": {"name": "small_cnn", "width": 8},
        "train": {"epochs": 1, "batch_size": 16, "lr": 0.01, "optimizer": "sgd"},
        "eval_splits": ["test"], "eval_every": 1,   # what the plain Flower anchor evaluates too
        "methods": [{"name": "fedavg"}],
    }


def bundle_job(config: str, work: Path, rounds: int, seed: int | None) -> dict[str, Any]:
    """The ``fl`` section of a bundle config (``--bundle``), its ``bundle_root`` in ``work`` (so
    its generated data and runs stay there), with ``rounds`` rounds and its first method only
    (the breakdown follows one method's exchanges; the demo's second, ``local``, exchanges the
    same messages)."""
    from medfl.config_file import load_bundle_config

    fl = load_bundle_config(config, {"bundle_root": str(work / "bundle")})
    fl = {**fl, "rounds": rounds, "progress": False, "overwrite": True, "methods": list(fl["methods"])[:1]}
    if seed is not None:
        fl["seed"] = seed
    return fl


def _label(fl: dict[str, Any]) -> str:
    """The run folder of the job's (one) method."""
    from medfl.config import method_label

    return method_label(fl["methods"][0])


class _RoundClock:
    """A throwaway plugin timing each round's end."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self.start = 0.0

    @hookimpl
    def on_run_start(self, run: Any) -> None:  # noqa: ARG002
        self.start = time.perf_counter()

    @hookimpl
    def on_round_end(self, run: Any, round: int, metrics: Any) -> None:  # noqa: A002, ARG002
        self.ends.append(time.perf_counter())


def in_process(fl: dict[str, Any]) -> dict[str, Any]:
    """Run the job in process; return timings and the metrics file."""
    from medfl.config import resolve_config
    from medfl.experiment import run_experiment
    from medfl.plugins import get_plugin_manager, registry

    registry()
    clock = _RoundClock()
    pm = get_plugin_manager()
    pm.register(clock, name="flower-overhead-clock")
    try:
        t0 = time.perf_counter()
        out = run_experiment(resolve_config(fl))
        total = time.perf_counter() - t0
    finally:
        pm.unregister(clock)
    ends = [clock.start] + clock.ends
    rounds = [b - a for a, b in zip(ends, ends[1:])]
    return {"startup_s": clock.start - t0, "round_s": rounds, "total_s": total,
            "metrics": str(Path(out["dir"]) / _label(fl) / "metrics.csv")}


_SITE_LINE = re.compile(r"^(\S+ \S+) DEBUG \S+: site (\S+): (\S+) message, round (\d+): answered in ([0-9.]+) s"
                        r"(?:; its ClientApp process had run ([0-9.]+) s)?")


def site_timings(sites_dir: Path) -> pd.DataFrame:
    """Every site's ``answered in`` lines (its run ``log.txt`` files under ``sites_dir``): one
    row per message answered, with ``round``, ``phase``, ``client_id``, ``site_s`` (the site's
    own work) and ``clientapp_s`` (how long the ClientApp process had run when it forwarded the
    message; NaN where not known)."""
    rows = []
    for log in sorted(sites_dir.glob("*/*/site_*/log.txt")):
        for line in log.read_text(errors="replace").splitlines():
            m = _SITE_LINE.match(line)
            if m:
                rows.append({"round": int(m.group(4)), "phase": m.group(3), "client_id": m.group(2),
                             "site_s": float(m.group(5)),
                             "clientapp_s": float(m.group(6)) if m.group(6) else float("nan")})
    return pd.DataFrame(rows, columns=["round", "phase", "client_id", "site_s", "clientapp_s"])


def breakdown(events: pd.DataFrame, sites: pd.DataFrame) -> pd.DataFrame:
    """Where each round of a Flower run went (see the module's docstring): one row per round
    with ``round_s`` (from the end of the previous round, or from every site connected),
    ``exchanges_s`` (the coordinator sending and waiting for replies, its exchanges summed),
    ``coordinator_s`` (the rest: its own work between exchanges), and the exchanges split
    for the site each one waited for: ``site_s`` (its own work), ``clientapp_s`` (Flower
    starting the ClientApp process), ``flower_s`` (Flower's transport and idle waits: what the
    coordinator measured for that site minus the two others) and ``send_s`` (the exchange
    minus what it measured for that site: encoding the messages and uploading them to the
    SuperLink), and ``transport_s``, the sum of the last two (exact where the split is not). The
    components of a round (``coordinator_s``, ``clientapp_s``, ``site_s``, ``transport_s``) add
    up to its ``round_s``."""
    ev = events.copy()
    ev["client_id"] = ev["client_id"].astype(str).str.replace(r"\.0$", "", regex=True)
    ev["round"] = pd.to_numeric(ev["round"], errors="coerce")
    connect = float(ev.loc[ev["phase"] == "connect", "time"].iloc[0])
    ends = ev[ev["phase"] == "evaluate:all"].sort_values("round")
    start, rows = connect, []
    site_of = {(int(r.round), str(r.phase), str(r.client_id)): r for r in sites.itertuples()}
    for end in ends.itertuples():
        r = int(end.round)
        row: dict[str, Any] = {"round": r, "round_s": float(end.time) - start, "exchanges_s": 0.0, "site_s": 0.0,
                               "clientapp_s": 0.0, "flower_s": 0.0, "send_s": 0.0}
        for phase in ("train", "evaluate"):
            whole = ev[(ev["round"] == r) & (ev["phase"] == f"{phase}:all")]
            replies = ev[(ev["round"] == r) & (ev["phase"] == phase) & (ev["status"] == "ok")]
            if whole.empty or replies.empty:
                continue
            exchange = float(whole["seconds"].iloc[0])
            last = replies.loc[replies["seconds"].astype(float).idxmax()]
            seen = float(last["seconds"])
            site = site_of.get((r, phase, str(last["client_id"])))
            work = float(site.site_s) if site is not None else float("nan")
            app = float(site.clientapp_s) if site is not None and not np.isnan(site.clientapp_s) else 0.0
            row["exchanges_s"] += exchange
            row["site_s"] += work
            row["clientapp_s"] += app
            row["flower_s"] += seen - work - app
            row["send_s"] += exchange - seen
            row[f"{phase}_s"] = exchange
        row["transport_s"] = row["send_s"] + row["flower_s"]
        row["coordinator_s"] = row["round_s"] - row["exchanges_s"]
        rows.append(row)
        start = float(end.time)
    return pd.DataFrame(rows)


#: What each long-lived process of a loopback deployment is, by its name (``comm``) and command
#: line; a process's CPU includes the children it has reaped (a fork server's ClientApps, a
#: SuperExec's ``flwr-clientapp`` commands). Short-lived processes are counted through them.
_KINDS: list[tuple[str | None, str | None, str | None]] = [
          ("flower-superexe", None, "SuperExecs (+ the flwr-clientapp commands they ran)"),
          ("flwr-serverapp", None, "ServerApp (medfl's coordinator)"),
          (None, " supervise --superexec ", "SuperLink's supervisor"),
          (None, "flower-superlink", "SuperLink"),
          (None, "flower-supernode", "SuperNodes"),
          (None, " flower site ", "site workers (train, evaluate)"),
          (None, "flwr run", "flwr run --stream")]


def _kind(comm: str, cmdline: str) -> str | None:
    for name, words, kind in _KINDS:
        if (name is not None and comm.startswith(name)) or (words is not None and words in cmdline):
            return kind
    return None


class CpuSampler:
    """The CPU seconds of every process below this one, sampled every ``interval`` seconds in a
    thread (Linux ``/proc``; elsewhere nothing is sampled): ``(time, {pid: (kind, seconds)})``,
    a process's seconds being its own and those of the children it has reaped."""

    def __init__(self, interval: float = 0.25) -> None:
        import threading

        self.interval = interval
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self._stop = threading.Event()
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> "CpuSampler":
        if Path("/proc/self/stat").is_file():
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _snapshot(self) -> dict[int, tuple[str, float]]:
        from local_federation import descendants

        out: dict[int, tuple[str, float]] = {}
        for pid in descendants(os.getpid()):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            comm, rest = stat[stat.find("(") + 1:stat.rfind(")")], stat[stat.rfind(")") + 2:].split()
            kind = _kind(comm, f" {cmd} ")
            if kind is not None:
                out[pid] = (kind, sum(int(v) for v in rest[11:15]) / self._tick)
        return out

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), self._snapshot()))
            self._stop.wait(self.interval)

    def per_round(self, start: float, end: float, rounds: int) -> dict[str, float]:
        """CPU seconds a round by kind of process between the wall-clock times ``start`` and
        ``end`` (``rounds`` rounds), over the processes alive at both ends."""
        if rounds < 1 or not self.samples:
            return {}
        first = min(self.samples, key=lambda s: abs(s[0] - start))[1]
        last = min(self.samples, key=lambda s: abs(s[0] - end))[1]
        out: dict[str, float] = {}
        for pid, (kind, seconds) in last.items():
            if pid in first and first[pid][0] == kind:
                out[kind] = out.get(kind, 0.0) + (seconds - first[pid][1]) / rounds
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def over_flower(fl: dict[str, Any], work: Path, clients: int, round_timeout: float, tag: str = "fed") -> dict[str, Any]:
    """Run the job over a local Flower deployment; return timings, the breakdown and the metrics file."""
    from local_federation import LocalFederation

    cfg_file = work / "flower.json"
    cfg_file.write_text(json.dumps({"fl": fl}))
    with LocalFederation(work / tag, sites=clients) as fed, CpuSampler() as cpu:
        # sites=clients: each site's torch threads are its share of the cores, as on one machine they should be
        t0 = time.perf_counter()
        fed.start_superlink()
        for cid in range(clients):
            fed.start_site(str(cid), cfg_file, wait=False)
        fed.wait_for_nodes(clients)
        deploy_s = time.perf_counter() - t0
        launch = time.time()
        t1 = time.perf_counter()
        res = fed.run(cfg_file, round_timeout=round_timeout, timeout=3600, name="bench")
        total = time.perf_counter() - t1
    if not res.get("ok"):
        raise RuntimeError(f"the Flower run failed: {res.get('error')}\n{res.get('traceback')}")
    run_dir = Path(res["dir"]) / _label(fl)
    ev = pd.read_csv(run_dir / "flower_events.csv")
    connect = float(ev.loc[ev["phase"] == "connect", "time"].iloc[0])
    ends = ev[ev["phase"] == "evaluate:all"].sort_values("round")["time"].astype(float).tolist()
    marks = [connect] + ends
    rounds = [b - a for a, b in zip(marks, marks[1:])]
    phases = ev[ev["phase"].isin(["train:all", "evaluate:all"])].groupby("phase")["seconds"].median().to_dict()
    parts = breakdown(ev, site_timings(work / tag / "sites"))
    steady = marks[1:] if len(marks) > 2 else marks   # rounds 2.. (round 1 imports and warms caches)
    cpu_s = cpu.per_round(steady[0], steady[-1], len(steady) - 1)
    return {"deploy_startup_s": deploy_s, "run_startup_s": connect - launch, "round_s": rounds, "total_s": total,
            "exchange_median_s": phases, "metrics": str(run_dir / "metrics.csv"),
            "breakdown": parts.to_dict(orient="records"), "cpu_per_round_s": cpu_s}


_PARTS = [("round_s", "round"), ("exchanges_s", "exchanges (coordinator sends, waits for replies)"),
          ("clientapp_s", "  Flower starts a ClientApp process per message"),
          ("site_s", "  site's own work (decode, train/evaluate, encode)"),
          ("transport_s", "  transport + idle waits (both ways, polls included)"),
          ("send_s", "    before the site's clock: coordinator uploads"),
          ("flower_s", "    after it: SuperNode polls, pulls, the reply"),
          ("coordinator_s", "coordinator's own work between exchanges")]


def print_breakdown(label: str, parts: list[dict[str, Any]], in_process_round: float) -> None:
    """The per-round breakdown of one Flower run: every round, then the median of rounds 2.."""
    df = pd.DataFrame(parts)
    if df.empty:
        print(f"\n{label}: no round to break down")
        return
    steady = df[df["round"] > 1] if len(df) > 1 else df
    print(f"\nWhere a Flower round goes, {label} (s; exchanges split for the site each one waited for):")
    cols = ["round"] + [k for k, _ in _PARTS]
    print(df[cols].to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    med = steady[[k for k, _ in _PARTS]].median()
    for key, what in _PARTS:
        print(f"  median rounds 2..: {what:52s} {med[key]:6.2f}")
    # no target: the time is Flower's (issue 65; docs/flower.md, *Round latency*)
    print(f"  in process per round {in_process_round:.2f} s; over Flower {med['round_s']:.2f} s "
          f"(+{med['round_s'] - in_process_round:.2f} s, Flower's own)")


def print_cpu(label: str, cpu: dict[str, float], round_s: float) -> None:
    """CPU seconds a round by kind of process (rounds 2..), against the cores of this machine:
    a round cannot take less wall time than its CPU seconds over the cores it may use."""
    if not cpu:
        print(f"\n{label}: no CPU figures (Linux /proc only)")
        return
    from medfl.config import available_cores

    cores = available_cores()
    total = sum(cpu.values())
    print(f"\nCPU a round by process, {label} (s, rounds 2..; a process counts the children it reaped):")
    for kind, seconds in cpu.items():
        print(f"  {kind:52s} {seconds:6.2f}")
    print(f"  {'all':52s} {total:6.2f}  = {total / cores:.2f} s of wall time on {cores} core(s) at the least "
          f"(a round took {round_s:.2f} s)")


def plain_flower(fl: dict[str, Any], work: Path, clients: int, rounds: int, timeout: float = 3600) -> dict[str, Any]:
    """The anchor: Flower's own FedAvg (``plain_flower_app.py``) on the same job, on the same
    kind of loopback deployment (a SuperLink, one plain ``flower-supernode`` per client)."""
    import shutil

    from local_federation import LocalFederation, read_result
    from medfl.flower.deploy import flwr_run, free_port

    app = work / "plain_app"
    app.mkdir(parents=True, exist_ok=True)
    shutil.copy(Path(__file__).resolve().parent / "plain_flower_app.py", app / "plain_flower_app.py")
    (app / "pyproject.toml").write_text("\n".join([
        "[build-system]", 'requires = ["setuptools>=68"]', 'build-backend = "setuptools.build_meta"', "",
        "[project]", 'name = "plain-flower-anchor"', 'version = "1.0.0"', "dependencies = []", "",
        "[tool.flwr.app]", 'publisher = "medfl-benchmarks"', "",
        "[tool.flwr.app.components]", 'serverapp = "plain_flower_app:server"', 'clientapp = "plain_flower_app:client"',
        "", "[tool.flwr.app.config]", 'fl = "{}"', "rounds = 1", 'result-file = ""', ""]))
    result_file = work / "plain_result.json"
    with LocalFederation(work / "plain_fed") as fed:
        t0 = time.perf_counter()
        fed.start_superlink()
        for k in range(clients):
            # a plain SuperNode: Flower's own ClientApp process per message, no medfl site worker
            fed._start(f"site{k}", [str(Path(sys.executable).parent / "flower-supernode"), "--insecure",
                                    "--superlink", str(fed.superlink), "--port", str(free_port()),
                                    "--node-config", f"partition-id={k} num-partitions={clients}"])
        fed.wait_for_nodes(clients)
        deploy_s = time.perf_counter() - t0
        launch = time.time()
        t1 = time.perf_counter()
        log = work / "plain_run.log"
        with open(log, "wb") as fh:
            code = flwr_run(app, str(fed.superlink), {"fl": json.dumps(fl), "rounds": rounds,
                                                      "result-file": str(result_file)},
                            flwr_home=work / "plain_fed" / "flwr_home", env=fed.env, timeout=timeout, stream_to=fh)
        total = time.perf_counter() - t1
        found = read_result(result_file, log, code)
    marks = [found["start"]] + found["round_end"]
    return {"deploy_startup_s": deploy_s, "run_startup_s": found["start"] - launch,
            "round_s": [b - a for a, b in zip(marks, marks[1:])], "total_s": total}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", default=None, metavar="CONFIG",
                   help="run a bundle's job instead (its fl section, first method only, --rounds rounds, its own "
                        "clients, data and model; e.g. bundles/demo/configs/train.json); --clients, --samples and "
                        "--image-size are then not used")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--samples", type=int, default=240, help="images in the generated dataset")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=None, help="the job's seed (default 0; a bundle's own)")
    p.add_argument("--round-timeout", type=float, default=600.0)
    p.add_argument("--out", default="benchmarks/results", help="where the CSV and JSON go")
    p.add_argument("--skip-anchor", action="store_true",
                   help="do not run the plain Flower app (Flower's FedAvg) on the same deployment")
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="medfl-flower-bench-"))
    if args.bundle:
        base = bundle_job(args.bundle, work, args.rounds, args.seed)
        args.clients = int(base["num_clients"])
    else:
        base = job(work, args.clients, args.rounds, args.samples, args.image_size,
                   0 if args.seed is None else args.seed)
    ip = in_process({**base, "name": "inproc", "output_dir": str(work / "runs")})
    anchor = None if args.skip_anchor else plain_flower(base, work, args.clients, args.rounds)
    fw = over_flower({**base, "name": "flower", "output_dir": str(work / "runs")}, work, args.clients,
                     args.round_timeout)
    # the numbers are bit-equal only at equal torch threads (sums over more threads round
    # otherwise): the sites train on their share of the cores, so the check runs the job in
    # process on as many threads when the timed in-process run had more
    from medfl.config import auto_threads

    site_threads, own_threads = auto_threads(args.clients), auto_threads(1)
    same = ip if site_threads == own_threads else in_process(
        {**base, "name": "inproc_threads", "output_dir": str(work / "runs"), "threads": site_threads})
    a = pd.read_csv(same["metrics"])
    num = [c for c in a.columns if a[c].dtype.kind in "fi"]
    b = pd.read_csv(fw["metrics"])
    diff = float(np.nanmax(np.abs(a[num].to_numpy(float) - b[num].to_numpy(float)))) if len(a) == len(b) else float("nan")

    def steady(rounds: list[float]) -> float:
        return statistics.median(rounds[1:]) if len(rounds) > 1 else rounds[0]

    ip_round, fw_round = steady(ip["round_s"]), steady(fw["round_s"])
    rows = [
        {"what": "start-up (s)", "in_process": ip["startup_s"], "flower": fw["run_startup_s"],
         "note": "flower: flwr run -> every site connected (ServerApp start, hellos)"},
        {"what": "deployment start-up (s)", "in_process": 0.0, "flower": fw["deploy_startup_s"],
         "note": "SuperLink + sites until all registered (once per deployment)"},
        {"what": "round 1 (s)", "in_process": ip["round_s"][0], "flower": fw["round_s"][0], "note": "warm-up"},
        {"what": "per round, median of rounds 2.. (s)", "in_process": ip_round, "flower": fw_round,
         "note": f"overhead {fw_round - ip_round:+.2f} s/round, x{fw_round / ip_round:.1f}"},
        {"what": "whole run (s)", "in_process": ip["total_s"], "flower": fw["total_s"], "note": "flwr run wall time"},
    ]
    ratio_anchor = None
    if anchor is not None:
        plain_round = steady(anchor["round_s"])
        ratio_anchor = fw_round / plain_round
        for row, value in zip(rows, [anchor["run_startup_s"], anchor["deploy_startup_s"], anchor["round_s"][0],
                                     plain_round, anchor["total_s"]]):
            row["plain_flower"] = value
        rows[3]["note"] += (f"; medfl over Flower / plain Flower = {ratio_anchor:.2f}x "
                            f"(target <= 1.1: {'PASS' if ratio_anchor <= 1.1 else 'MISS'})")
    table = pd.DataFrame(rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "flower_overhead.csv", index=False)
    report = {"job": {k: getattr(args, k) for k in ("bundle", "clients", "rounds", "samples", "image_size", "seed")},
              "site_threads": "auto over MEDFL_LOCAL_SITES = clients",
              "in_process": ip, "flower": fw, "per_round_overhead_s": fw_round - ip_round,
              "per_round_ratio": fw_round / ip_round, "metrics_max_abs_diff": diff,
              "metrics_compared_at_threads": site_threads,
              "plain_flower": anchor, "per_round_ratio_vs_plain_flower": ratio_anchor,
              "python": sys.version.split()[0]}
    (out / "flower_overhead.json").write_text(json.dumps(report, indent=2, default=str))
    with pd.option_context("display.width", 160, "display.max_colwidth", 70):
        print(table.to_string(index=False, float_format=lambda v: f"{v:.2f}"))
    print_breakdown("Flower", fw["breakdown"], ip_round)
    print_cpu("Flower", fw.get("cpu_per_round_s") or {}, steady(fw["round_s"]))
    print(f"\nFlower exchange medians (s): {fw['exchange_median_s']}")
    print(f"metrics in process ({site_threads} torch thread(s), as each site) vs over Flower: max |diff| = {diff:.3g}"
          + ("" if same is ip else f" (the timed in-process run used {own_threads})"))
    print(f"wrote {out / 'flower_overhead.csv'} and {out / 'flower_overhead.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
