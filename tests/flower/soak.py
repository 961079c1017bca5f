"""Disrupt a Flower run on one machine as a deployment would be: sites killed and restarted,
the SuperLink killed and restarted (and the run resumed), each at a round boundary.

:func:`soak` launches a run on a :class:`local_federation.LocalFederation`, watches the
run's ``status.json`` (never a clock) and applies a plan of :class:`Disruption` s as the run
reaches their rounds. A killed site stays down until the run has finished ``down`` more
rounds after the one it was killed at, so it misses at least one whole round; the SuperLink
is restarted only while every site is up (a resumed coordinator waits for every client
before its first round). What the run's files then say is checked with
:mod:`medfl.flower.replay`. ``benchmarks/flower_soak.py`` (5 sites, 30+ rounds, a seeded
random plan) and ``tests/flower/test_soak.py`` (3 sites, a fixed plan) use it.
"""

from __future__ import annotations

import fcntl
import json
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from medfl.flower.deploy import FlowerDeployError

from local_federation import LocalFederation, kill_group

__all__ = ["Disruption", "SoakResult", "random_plan", "last_round", "wait_unlocked", "soak"]
#: Seconds until a SuperLink restarted on its database gives up a run whose ServerApp died with
#: it (Flower 1.42: its task's heartbeat lapses after twice its 30 s interval), plus a minute.
_STALE_RUN_EXPIRY = 2 * 30.0 + 60.0


@dataclass
class Disruption:
    """One scripted failure.

    Attributes:
        after_round: applied once the run has finished this round (``status.json``).
        action: ``"site"`` (kill site ``client_id`` with SIGKILL, start it again on the same
            state directory once ``down`` more rounds have finished) or ``"superlink"``
            (SIGKILL to the SuperLink's process group, start it again on its port and database, and
            resume the run with ``--resume``).
        client_id: the site (``"site"`` only).
        down: rounds the killed site stays down, counted from the round it was killed at
            (at least 2: one whole round runs without it).
    """

    after_round: int
    action: str
    client_id: str = ""
    down: int = 2
    applied_at: int | None = None     # the finished round when it was applied
    restarted_at: int | None = None   # a killed site: the finished round when it came back


@dataclass
class SoakResult:
    """What :func:`soak` did: the plan as applied, the runs it launched (the first and one
    per resume: each :meth:`LocalFederation.run` result, or ``{"deploy_error": ...}``), the
    run directory and the wall time."""

    plan: list[Disruption]
    runs: list[dict[str, Any]] = field(default_factory=list)
    run_dir: Path | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Whether the last run finished."""
        return bool(self.runs and self.runs[-1].get("ok"))


def random_plan(rounds: int, clients: list[str], seed: int, every: int = 3, down: int = 2,
                superlink_at: int | None = None) -> list[Disruption]:
    """A seeded plan: every ``every`` rounds a random site is killed (down for ``down``
    rounds) while no other site is down, and the SuperLink is restarted once, after round
    ``superlink_at`` (default: half-way), at a boundary where every site is up."""
    rng = random.Random(seed)
    link = rounds // 2 if superlink_at is None else superlink_at
    plan: list[Disruption] = []
    r = every
    while r + down < rounds:
        if r <= link < r + down + 1:      # the SuperLink goes down while every site is up
            r = link + 1
            continue
        plan.append(Disruption(after_round=r, action="site", client_id=rng.choice(clients), down=down))
        r += max(every, down + 1)
    plan.append(Disruption(after_round=link, action="superlink"))
    return sorted(plan, key=lambda d: d.after_round)


def last_round(run_dir: Path) -> int:
    """The last round a run directory's ``status.json`` says is finished (0: none yet)."""
    try:
        return int(json.loads((run_dir / "status.json").read_text())["last_round"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def wait_unlocked(run_dir: Path, timeout: float) -> None:
    """Wait until no process holds ``run_dir/.lock`` (a stopped coordinator has ended).

    Raises:
        FlowerDeployError: still held after ``timeout`` seconds (naming the holder).
    """
    deadline = time.monotonic() + timeout
    while True:
        with open(run_dir / ".lock", "a+") as fh:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                fcntl.flock(fh, fcntl.LOCK_UN)
                return
            except OSError:
                fh.seek(0)
                holder = fh.read().strip()
        if time.monotonic() >= deadline:
            cmd = Path(f"/proc/{holder}/cmdline") if holder.isdigit() else None
            what = cmd.read_bytes().replace(b"\0", b" ")[:300].decode(errors="replace") if cmd and cmd.is_file() else "?"
            raise FlowerDeployError(f"{run_dir}: the stopped run's coordinator (pid {holder}: {what}) never ended")
        time.sleep(0.2)


def soak(fed: LocalFederation, config: str | Path, run_dir: Path, plan: list[Disruption], *,
         site_config: str | Path, database: str | Path, round_timeout: float = 30.0,
         hello_timeout: float = 120.0, timeout: float = 3600.0, poll: float = 0.05) -> SoakResult:
    """Run ``config`` on ``fed`` (its SuperLink started with ``database``, its sites started
    from ``site_config``) while applying ``plan``; return once the run (resumed after each
    SuperLink restart) has ended.

    Args:
        run_dir: the method's run directory the run writes (watched for ``status.json``).
        round_timeout: the coordinator's wait for a site's answer (a killed site costs one).
        timeout: the whole soak, at most.

    Raises:
        FlowerDeployError: the soak did not end within ``timeout``, or a coordinator stopped
            by a SuperLink restart never released its run directory.
    """
    t0 = time.monotonic()
    deadline = t0 + timeout
    assert fed.superlink is not None, "start the SuperLink first"
    port = int(fed.superlink.rsplit(":", 1)[1])
    result = SoakResult(plan=sorted(plan, key=lambda d: d.after_round), run_dir=run_dir)
    exp_dir = run_dir.parent
    current: dict[str, Any] = {}

    def launch(**kw: Any) -> threading.Thread:
        current.clear()
        out = current

        def go() -> None:
            try:
                out.update(fed.run(round_timeout=round_timeout, hello_timeout=hello_timeout,
                                   timeout=max(60.0, deadline - time.monotonic()), **kw))
            except FlowerDeployError as exc:     # a ServerApp ended with its SuperLink
                out["deploy_error"] = str(exc)

        thread = threading.Thread(target=go, daemon=True)
        thread.start()
        return thread

    runner = launch(config=config, name="soak")
    down: list[Disruption] = []          # sites killed and not yet started again
    pending = list(result.plan)
    while True:
        done = last_round(run_dir)
        for d in list(down):
            if d.applied_at is not None and done >= d.applied_at + d.down:
                fed.start_site(d.client_id, site_config, wait=False)
                d.restarted_at = last_round(run_dir)
                down.remove(d)
        while pending and done >= pending[0].after_round and runner.is_alive():
            d = pending[0]
            if d.action == "superlink" and down:
                break                    # only while every site is up
            pending.pop(0)
            if d.action == "site":
                fed.kill_site(d.client_id)
                d.applied_at = last_round(run_dir)     # read after the kill: the next round runs without it
                down.append(d)
            else:
                d.applied_at = done
                link = fed.procs["superlink"].popen
                kill_group(link, signal.SIGKILL)    # a crash, not a shutdown: no chance to clean up
                link.wait(timeout=30)
                fed.stop_superlink()                 # forget it (its log is kept aside)
                fed.start_superlink(port=port, database=str(database))
                runner.join(max(1.0, deadline - time.monotonic()))
                result.runs.append(dict(current))
                wait_unlocked(run_dir, max(1.0, deadline - time.monotonic()))
                # a site may be held by the crashed run's last message, its content lost with the SuperLink,
                # until that run's ServerApp task expires (2 task windows): the resumed run waits that long
                runner = launch(resume=exp_dir, name="resumed", connect_timeout=_STALE_RUN_EXPIRY)
            done = last_round(run_dir)
        if not runner.is_alive():
            break
        if time.monotonic() >= deadline:
            raise FlowerDeployError(f"the soak did not end within {timeout:.0f} s (round {done})")
        time.sleep(poll)
    runner.join()
    result.runs.append(dict(current))
    result.seconds = time.monotonic() - t0
    return result
