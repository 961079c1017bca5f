"""What a Flower run's sites missed, read back from its files, and the same run in process.

A deployment loses sites: one times out, crashes, restarts, the SuperLink goes down and the
run is resumed. :func:`recorded_absences` reads the exchanges each site missed from the run
directory (``flower_events.csv``, of the coordinator session whose rows a resume kept) as an
``fl.absences`` schedule (:func:`medfl.config.check_absences`); :func:`replay_in_process`
runs the same method in process with that schedule, which must give the same
``metrics.csv`` and ``train_metrics.csv`` (:func:`max_difference`). :func:`account_rounds`
checks that every round of the run is accounted for: each client of each exchange either
answered (a row in ``train_metrics.csv``/``metrics.csv``, its message in
``communication.csv``), had its reply refused (``reply_events.csv``), or is recorded absent.
``benchmarks/flower_soak.py`` and ``tests/flower/test_soak.py`` use them after killing
sites and the SuperLink.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from medfl.config import ABSENCE_PHASES, resolve_config
from medfl.engine.data import client_order, split_data
from medfl.engine.runner import Run, RunError, build_source

__all__ = ["ABSENT_STATUSES", "RoundAccount", "recorded_absences", "account_rounds", "replay_in_process",
           "table_difference", "max_difference"]

#: The ``flower_events.csv`` statuses of a site that missed an exchange (it was sent nothing,
#: or its answer never came): ``absent`` (no node served it), ``absent (scheduled)``
#: (``fl.absences``), ``timeout`` and ``dropped (WHY)`` (the transport reported the node gone or
#: the message lost; ``dropped (error N)`` in a run written before).
ABSENT_STATUSES = ("absent", "absent (scheduled)", "timeout", "dropped (")


def _read(path: Path, **kw: Any) -> pd.DataFrame:
    """A CSV of the run, or an empty table when it is missing or has no row."""
    return pd.read_csv(path, **kw) if path.is_file() and path.stat().st_size > 1 else pd.DataFrame()


def _events(run_dir: Path) -> pd.DataFrame:
    """``flower_events.csv`` with only the rows of the session that ran each round last (a
    resumed session redoes the rounds after the checkpoint it resumed from; rows an earlier
    session wrote for those rounds are not the run's record)."""
    events = _read(run_dir / "flower_events.csv", dtype={"client_id": str, "node_id": str, "session": str})
    if events.empty:
        raise RunError(f"{run_dir}: no flower_events.csv; not a Flower run directory")
    meta_path = run_dir / "flower.json"
    sessions = json.loads(meta_path.read_text()).get("sessions", []) if meta_path.is_file() else []
    events = events[events["round"].notna()].copy()
    events["round"] = events["round"].astype(int)

    def owner(r: int) -> str:
        found = [str(s["session"]) for s in sessions if int(s.get("resumed_from") or 0) < r]
        return found[-1] if found else ""

    keep = [owner(r) in ("", s) for r, s in zip(events["round"], events["session"].fillna(""))]
    return events[keep]


def _missed(events: pd.DataFrame) -> pd.DataFrame:
    """The rows of ``events`` saying a site missed a train/validate/evaluate exchange."""
    status = events["status"].fillna("").astype(str)
    return events[events["phase"].isin(ABSENCE_PHASES) & status.str.startswith(ABSENT_STATUSES)]


def recorded_absences(run_dir: str | Path) -> dict[str, dict[str, list[str]]]:
    """The exchanges each site of Flower run ``run_dir`` missed, as an ``fl.absences``
    schedule: ``{"<round>": {phase: [client ids]}}`` (rounds and phases without an absence
    left out).

    Raises:
        RunError: ``run_dir`` has no ``flower_events.csv``.
    """
    out: dict[str, dict[str, list[str]]] = {}
    missed = _missed(_events(Path(run_dir)))
    for (r, phase), rows in missed.groupby(["round", "phase"]):
        out.setdefault(str(int(r)), {})[str(phase)] = client_order(set(rows["client_id"]))
    return dict(sorted(out.items(), key=lambda kv: int(kv[0])))


@dataclass
class RoundAccount:
    """Every round of a Flower run, accounted for (:func:`account_rounds`).

    Attributes:
        rounds: the rounds the run finished.
        trained: (round, client) training replies taken (rows of ``train_metrics.csv``).
        evaluated: (round, client) evaluations taken (clients with rows in ``metrics.csv``).
        absences: exchanges a site missed, recorded in ``flower_events.csv``.
        refused: replies refused by the coordinator's checks (``reply_events.csv``).
        problems: what is not accounted for (empty when everything is).
    """

    rounds: int = 0
    trained: int = 0
    evaluated: int = 0
    absences: int = 0
    refused: int = 0
    problems: list[str] = field(default_factory=list)


def account_rounds(run_dir: str | Path) -> RoundAccount:
    """Check that every exchange of every round of Flower run ``run_dir`` is accounted for:
    each client of the partition (until ``max_reply_failures`` excluded it) either answered
    (``train_metrics.csv``; ``metrics.csv`` in an evaluated round), had its reply refused
    (``reply_events.csv``) or is recorded absent (``flower_events.csv``), and never two of
    these; every training message sent (answered or not) is in ``communication.csv``, and no
    absent client that was sent nothing is.

    Raises:
        RunError: ``run_dir`` has no ``flower_events.csv`` or no ``status.json``.
    """
    run_dir = Path(run_dir)
    status_path = run_dir / "status.json"
    if not status_path.is_file():
        raise RunError(f"{run_dir}: no status.json; not a run directory")
    cfg = json.loads((run_dir / "config.json").read_text())["fl"]
    rounds = int(json.loads(status_path.read_text()).get("last_round", 0))
    every = int(cfg.get("eval_every", 1))
    clients = client_order({c for c in pd.read_csv(run_dir / "partition.csv", dtype={"client_id": str})["client_id"]
                            .dropna() if c})
    train = _read(run_dir / "train_metrics.csv", dtype={"client_id": str})
    metrics = _read(run_dir / "metrics.csv", dtype={"client_id": str})
    traffic = _read(run_dir / "communication.csv", dtype={"client_id": str})
    replies = _read(run_dir / "reply_events.csv", dtype={"client_id": str})
    missed = _missed(_events(run_dir))
    acc = RoundAccount(rounds=rounds, absences=len(missed))

    def pairs(df: pd.DataFrame, **match: str) -> set[tuple[int, str]]:
        for col, value in match.items():
            df = df[df[col] == value] if not df.empty else df
        return set() if df.empty else {(int(r), str(c)) for r, c in zip(df["round"], df["client_id"])}

    trained = pairs(train)
    evaluated = pairs(metrics)
    refused = pairs(replies, status="dropped")
    excluded = {c: r for r, c in sorted(pairs(replies, status="excluded"), reverse=True)}
    sent = pairs(traffic, phase="train")
    acc.trained, acc.evaluated, acc.refused = len(trained), len(evaluated), len(refused)
    for phase, answered in (("train", trained), ("evaluate", evaluated)):
        absent = pairs(missed, phase=phase)
        unsent = pairs(missed[missed["status"].str.startswith("absent")], phase=phase)
        for r in range(1, rounds + 1):
            if phase == "evaluate" and not (r == int(cfg["rounds"]) or (every > 0 and r % every == 0)):
                continue
            for cid in clients:
                if cid in excluded and excluded[cid] < r:
                    continue
                key = (r, cid)
                how = [name for name, found in (("answered", key in answered), ("recorded absent", key in absent),
                                                ("refused", phase == "train" and key in refused)) if found]
                if len(how) != 1:
                    acc.problems.append(f"round {r}, {phase}, client {cid}: "
                                        + (" and ".join(how) if how else "neither answered, refused nor recorded "
                                                                         "absent"))
                if phase == "train" and (key in sent) == (key in unsent):
                    acc.problems.append(f"round {r}, train, client {cid}: " + (
                        "in communication.csv, yet recorded as sent nothing" if key in sent
                        else "sent a message that communication.csv does not count"))
    return acc


def replay_in_process(run_dir: str | Path, output_dir: str | Path, name: str = "replay",
                      absences: dict[str, dict[str, list[str]]] | None = None) -> Path:
    """Run the method of Flower run ``run_dir`` again in process, from its saved config and
    partition, with the absences it recorded (:func:`recorded_absences`, or ``absences``) as
    ``fl.absences``, stopped and resumed after the rounds its coordinator sessions resumed
    from (``flower.json``: a resumed session's messages say where it resumed from, so even
    their sizes in ``train_metrics.csv`` match); return the new run's directory,
    ``output_dir/name/<method>`` (replaced if it exists)."""
    run_dir = Path(run_dir)
    saved = json.loads((run_dir / "config.json").read_text())
    fl = dict(saved["fl"])
    schedule = recorded_absences(run_dir) if absences is None else absences
    fl.update(name=name, output_dir=str(output_dir), methods=[saved["method"]], absences=schedule or None,
              progress=False, stop_after_round=None, plots=False)
    cfg = resolve_config(fl)
    meta = run_dir / "flower.json"
    sessions = json.loads(meta.read_text()).get("sessions", []) if meta.is_file() else []
    stops: list[int] = []
    for s in sessions[1:]:
        k = int(s.get("resumed_from") or 0)
        if k > (stops[-1] if stops else 0):
            stops.append(k)
    out = Path(output_dir) / name / run_dir.name
    if out.exists():
        shutil.rmtree(out)
    data = split_data(build_source(cfg["dataset"]), cfg, saved=run_dir / "partition.csv")
    for i, stop in enumerate([*stops, None]):
        run = Run(cfg, cfg["methods"][0], out, data)
        run.prepare(resume=i > 0)
        run.execute(stop)
    return out


def table_difference(x: pd.DataFrame, y: pd.DataFrame, what: str, atol: float | None = None) -> float:
    """The largest absolute difference between the numbers of two tables of the same run
    layout (``metrics.csv``, ``train_metrics.csv``...), rows matched by round, client, split
    and data client; with ``atol``, also assert every number is close (``np.allclose``:
    ``atol`` plus 1e-5 relative).

    Raises:
        AssertionError: their columns, rows or text values differ, or (with ``atol``) numbers
            are not close (naming ``what`` and the column).
    """
    assert list(x.columns) == list(y.columns), f"{what}: columns {list(x.columns)} vs {list(y.columns)}"
    assert len(x) == len(y), f"{what}: {len(x)} rows vs {len(y)}"
    keys = [c for c in ("round", "client_id", "split", "data_client_id") if c in x.columns]
    x, y = x.sort_values(keys).reset_index(drop=True), y.sort_values(keys).reset_index(drop=True)
    worst = 0.0
    for c in x.columns:
        if x[c].dtype.kind in "fiub" and y[c].dtype.kind in "fiub":
            u, v = x[c].to_numpy(float), y[c].to_numpy(float)
            assert (np.isnan(u) == np.isnan(v)).all(), f"{what}: column {c} is missing in different rows"
            worst = max(worst, float(np.nanmax(np.abs(u - v), initial=0.0)))
            assert atol is None or np.allclose(u, v, atol=atol, equal_nan=True), (what, c)
        else:
            assert x[c].astype(str).tolist() == y[c].astype(str).tolist(), (what, c)
    return worst


def max_difference(a: str | Path, b: str | Path, files: tuple[str, ...] = ("metrics.csv", "train_metrics.csv")
                   ) -> float:
    """The largest absolute difference between the numbers of ``files`` in run directories
    ``a`` and ``b`` (:func:`table_difference`).

    Raises:
        AssertionError: a file's columns, rows or text values differ (naming the file).
    """
    return max(table_difference(pd.read_csv(Path(a) / f), pd.read_csv(Path(b) / f), f) for f in files)
