#!/usr/bin/env python
"""A Flower soak: sites and the SuperLink die mid-run, and the run must still add up.

A real deployment on loopback (``tests/flower/local_federation.py``: a SuperLink with
a database and one ``medfl flower site`` per client, separate processes) runs a tiny FedAvg
job (default: 5 sites, 32 rounds, ``small_cnn`` width 4 on ``synthetic2d`` 16x16, evaluation
every round). While it runs (``tests/flower/soak.py``, reading ``status.json``):

- every ``--every`` rounds a random site (seeded) is killed with SIGKILL and started again on
  its state directory ``--down`` rounds later (it misses at least one whole round);
- once (``--superlink-at``, default half-way), while every site is up, the SuperLink's process
  group is killed with SIGKILL (the ServerApp with it), started again on its port and
  database, and the run resumed with ``--resume``, as docs/flower.md says to.

Then it checks, and prints:

- every round accounted for: each client of each training and evaluation exchange answered
  (``train_metrics.csv``, ``metrics.csv``), had its reply refused (``reply_events.csv``) or is
  recorded absent (``flower_events.csv``), and ``communication.csv`` counts every message
  sent (:func:`medfl.flower.replay.account_rounds`);
- each kill recorded: the killed site is absent from the training of the round after it was
  killed and the next (the rounds it was down);
- the final metrics: the same method run in process with the absences the Flower run
  recorded (``fl.absences``, :func:`medfl.flower.replay.replay_in_process`), whose
  ``metrics.csv`` and ``train_metrics.csv`` must equal the Flower run's (max |difference|).

Figures (rounds, kills, absences, wall time, max |difference|) go to stdout and, as JSON, to
``--out``. Exit code 0 when every check holds, 1 otherwise.
``python benchmarks/flower_soak.py --help`` lists the options.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from medfl.config import resolve_config
from medfl.engine.runner import build_source
from medfl.flower.replay import account_rounds, max_difference, recorded_absences, replay_in_process

# the harness of the real-process tests: a federation on loopback and the soak's disruptions
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "flower"))
from local_federation import LocalFederation  # noqa: E402
from soak import random_plan, soak  # noqa: E402


def job(work: Path, clients: int, rounds: int, seed: int) -> dict[str, Any]:
    """The ``fl`` config of the soak's job: FedAvg on a tiny CNN, evaluated every round."""
    return {
        "name": "soak", "output_dir": str(work / "runs"), "seed": seed, "rounds": rounds, "num_clients": clients,
        "progress": False, "plots": False, "eval_every": 1,
        "dataset": {"name": "synthetic2d", "root": str(work / "data"), "num_samples": 40 * clients,
                    "num_classes": 2, "image_size": 16, "noise": 0.5},
        "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8},
        "model": {"name": "small_cnn", "width": 4},
        "train": {"batch_size": 8, "lr": 0.05},
        "methods": [{"name": "fedavg"}],
    }


def main(argv: list[str] | None = None) -> int:
    """Run the soak; print and write its figures; 0 when every check holds."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="Example: python benchmarks/flower_soak.py --sites 5 --rounds 32 --seed 0")
    ap.add_argument("--sites", type=int, default=5, help="sites (clients), default 5")
    ap.add_argument("--rounds", type=int, default=32, help="rounds, default 32")
    ap.add_argument("--every", type=int, default=3, help="a site is killed every so many rounds (default 3)")
    ap.add_argument("--down", type=int, default=2, help="rounds a killed site stays down (default 2, at least 2)")
    ap.add_argument("--superlink-at", type=int, default=None,
                    help="kill the SuperLink after this round (default: half-way)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the run and of the kill plan (default 0)")
    ap.add_argument("--round-timeout", type=float, default=90.0,
                    help="seconds the coordinator waits for a site's answer (default 90: no honest site on a "
                         "loaded machine reaches it; a killed site is answered by Flower after about 60 s)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="the whole soak, at most (default 3600 s)")
    ap.add_argument("--workdir", type=Path, default=None, help="where runs, logs and state go (default: a temp dir)")
    ap.add_argument("--out", type=Path, default=Path("flower_soak.json"), help="the figures as JSON")
    ap.add_argument("--check", action="store_true",
                    help="no deployment: check the soak already in --workdir again (kills and wall time from --out)")
    args = ap.parse_args(argv)
    if args.down < 2 or args.every < 1 or args.sites < 2 or args.rounds < 2 * (args.every + args.down):
        ap.error("need --down >= 2, --every >= 1, --sites >= 2 and --rounds >= 2 * (--every + --down)")
    if args.check and args.workdir is None:
        ap.error("--check needs the --workdir of an earlier soak")
    work = args.workdir or Path(tempfile.mkdtemp(prefix="medfl-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    run_dir = work / "runs" / "soak" / "fedavg"
    if args.check:
        earlier = json.loads(args.out.read_text())
        return check(args, run_dir, earlier["site_kills"], earlier["superlink_kills"], earlier["deployment_s"],
                     earlier["soak_wall_s"], done_ok=earlier["finished"], stray=earlier["stray_processes"])
    fl = job(work, args.sites, args.rounds, args.seed)
    build_source(resolve_config(fl)["dataset"])           # the data, once, before the sites read it
    config = work / "soak.json"
    config.write_text(json.dumps({"fl": fl}, indent=1))
    clients = [str(i) for i in range(args.sites)]
    plan = random_plan(args.rounds, clients, args.seed, every=args.every, down=args.down,
                       superlink_at=args.superlink_at)
    print(f"flower soak: {args.sites} sites, {args.rounds} rounds, work in {work}", flush=True)
    fed = LocalFederation(work / "fed")
    t0 = time.monotonic()
    try:
        database = work / "superlink.db"
        fed.start_superlink(database=str(database))
        for cid in clients:
            fed.start_site(cid, config, wait=False)
        fed.wait_for_nodes(args.sites)
        started = time.monotonic() - t0
        done = soak(fed, config, run_dir, plan, site_config=config, database=database,
                    round_timeout=args.round_timeout, timeout=args.timeout)
    finally:
        fed.close()
    kills = [{"client_id": d.client_id, "after_round": d.applied_at, "restarted_after": d.restarted_at, "down": d.down}
             for d in done.plan if d.action == "site" and d.applied_at is not None]
    links = [d.applied_at for d in done.plan if d.action == "superlink" and d.applied_at is not None]
    return check(args, run_dir, kills, links, round(started, 1), round(done.seconds, 1), done_ok=done.ok,
                 stray=fed.stray_processes())


def check(args: argparse.Namespace, run_dir: Path, kills: list[dict[str, Any]], links: list[int], started: float,
          soak_s: float, *, done_ok: bool, stray: list[int]) -> int:
    """Check the soak's run (accounted rounds, recorded kills, the in-process replay); print
    and write the figures; 0 when every check holds."""
    work = run_dir.parents[2]
    saved = json.loads((run_dir / "config.json").read_text())["fl"]
    cfg_rounds = int(saved["rounds"])
    acc = account_rounds(run_dir)
    absences = recorded_absences(run_dir)
    t1 = time.monotonic()
    replay = replay_in_process(run_dir, work / "replay")
    replay_s = time.monotonic() - t1
    diff = max_difference(run_dir, replay)
    unrecorded = [f"site {k['client_id']} killed after round {k['after_round']}" for k in kills
                  if any(k["client_id"] not in absences.get(str(r), {}).get("train", [])
                         for r in range(k["after_round"] + 2, min(k["after_round"] + k.get("down", 2), acc.rounds) + 1))]
    sessions = json.loads((run_dir / "flower.json").read_text())["sessions"]
    by_phase: dict[str, int] = {}
    for phases in absences.values():
        for phase, ids in phases.items():
            by_phase[phase] = by_phase.get(phase, 0) + len(ids)
    figures = {
        "sites": int(saved["num_clients"]), "rounds": acc.rounds, "rounds_planned": cfg_rounds,
        "seed": int(saved["seed"]),
        "site_kills": kills, "superlink_kills": links,
        "sessions": [{"resumed_from": s["resumed_from"]} for s in sessions],
        "absences": sum(by_phase.values()), "absences_by_phase": by_phase, "absence_schedule": absences,
        "trained": acc.trained, "evaluated": acc.evaluated, "refused": acc.refused,
        "unaccounted": acc.problems, "kills_not_recorded": unrecorded,
        "max_abs_difference": diff, "stray_processes": stray,
        "deployment_s": started, "soak_wall_s": soak_s, "replay_s": round(replay_s, 1),
        "finished": done_ok, "run_dir": str(run_dir),
    }
    ok = done_ok and not acc.problems and not unrecorded and diff <= 1e-5 and not stray and acc.rounds == cfg_rounds
    figures["ok"] = ok
    args.out.write_text(json.dumps(figures, indent=1, default=str))
    print(f"rounds finished      {acc.rounds} of {cfg_rounds} ({len(sessions)} coordinator sessions, resumed from "
          f"{', '.join(str(s['resumed_from']) for s in sessions[1:]) or '-'})")
    print(f"site kills           {len(kills)}: " + ", ".join(f"site {k['client_id']} after round {k['after_round']} "
                                                          f"(back after {k['restarted_after']})" for k in kills))
    print(f"SuperLink kills      {len(figures['superlink_kills'])}: after round(s) "
          f"{', '.join(map(str, figures['superlink_kills']))}")
    print(f"absences recorded    {figures['absences']} ({', '.join(f'{k} {v}' for k, v in by_phase.items())})")
    print(f"replies taken        train {acc.trained}, evaluate {acc.evaluated}, refused {acc.refused}")
    print(f"unaccounted          {len(acc.problems)}" + "".join(f"\n  {p}" for p in acc.problems[:20]))
    print(f"kills not recorded   {len(unrecorded)}" + "".join(f"\n  {u}" for u in unrecorded))
    print(f"max |difference|     {diff:.3g} (metrics.csv, train_metrics.csv vs in process with fl.absences)")
    print(f"wall time            deployment {started:.1f} s, soak {soak_s:.1f} s, in-process replay "
          f"{replay_s:.1f} s")
    print(f"stray processes      {len(stray)}")
    print(f"{'OK' if ok else 'FAILED'}; figures in {args.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
