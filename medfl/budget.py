"""A site's own privacy budget: every DP release it made, counted by the site itself.

A site's policy (:mod:`medfl.policy`) says how much privacy its data may lose. What the
coordinator says about a run (how many releases it plans, at which rounds) is a plan for the
site to check against, never a factor the site multiplies by: a coordinator that claims
``releases: 0``, asks the same update again as extra steps or as rounds past the run's end,
or asks a per-sample release in every round, would otherwise spend far more than the site
accepts. So the site keeps its own budget, ``<state-dir>/budget.jsonl``, one JSON line per
answered DP request, appended and flushed to disk (``fsync``) *before* the reply leaves:

``{"type": "spend", "data": ..., "run": ..., "round": 3, "step": 0, "client": "0",
"kind": "train", "mechanism": "dp_gaussian", "unit": "client", "noise_multiplier": 1.1,
"sample_rate": 1.0, "steps": 1, "delta": 1e-05, "accountant": "rdp", "clip": 1.0, "time": ...}``

and one ``{"type": "plan", ...}`` line per run and coordinator session: the plan the site
accepted (the run's ``rounds`` and the ``releases`` it plans for this client).

Before a DP reply leaves, :meth:`SiteBudget.admit` checks the request against the accepted
plan and the spend against the policy's caps, with Opacus's accountant over the site's own
records (:func:`medfl.policy.composed_epsilon`):

* the plan: a round outside ``1..rounds``; a second DP training reply in one round (the same
  update asked again as another step); a per-sample release asked a second time in a run;
  more rounds with a DP training reply than the ``releases`` the plan names; a plan that
  changes within a coordinator session (a resumed session may plan more rounds: the budget
  still counts what was spent). Each is refused, naming the rule.
* the caps: the run's epsilon at this site with this request (``max_epsilon``) and the site's
  epsilon over every run on the same data set (``max_epsilon_total``). A refused request
  releases nothing.

Every epsilon is at the site's delta (the policy's ``max_delta``, default 1e-5), whatever
delta a record names: mechanisms compose by adding their epsilons (each mechanism's history
composed by its own accountant at the site's delta), across runs too: an upper bound, never
an under-count.

The budget fails closed. A line of the file that is not a budget record (not JSON, or a
field missing or of the wrong type) is refused in one line naming the file and line: the
last line cut short by a crash while it was written belongs to a reply that never left (the
record is written first), so the operator may delete it; any other is a changed file, to be
restored. A release that a release ledger of the same state directory records
(``<state-dir>/<run>/site_<client>/releases.jsonl``, :mod:`medfl.privacy.releases`, written
after the budget's record) but the budget does not (a missing, emptied or cut budget) is
refused too, naming the ledgers: the budget is never counted as zero. It is not rebuilt from
the ledgers, which lack what the count needs (DP-SGD's steps and sample rate, the delta and
accountant).
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from medfl.policy import SitePolicy, Spend, composed_epsilon
from medfl.privacy.releases import append_record, ledger_releases

__all__ = ["SiteBudget", "BudgetRefused", "data_key", "BUDGET_FILE", "KEY_PREFIX", "Spend", "composed_epsilon"]

#: The site's budget, in its ``--state-dir`` (shared by every run it serves).
BUDGET_FILE = "budget.jsonl"
#: What a :func:`data_key` begins with (keys of config text, written before, did not).
KEY_PREFIX = "table:"


class BudgetRefused(RuntimeError):
    """A request the site's own budget or its accepted plan does not allow (naming the rule)."""


def data_key(source: Any) -> str:
    """A short digest naming the data set a site serves: the fingerprint of its manifest table
    (every row and column, as the dataset plugin read it), its classes and its sample shape.
    The same data named another way (``root/.``, a symlink, other config text) is the same
    key, so the budget across runs counts every run on it; a digest of config text could be
    reset by rewording the config."""
    import pandas as pd

    table = source.table
    h = hashlib.sha256(json.dumps([list(map(str, table.columns)), int(source.num_classes),
                                   list(map(str, source.class_names)), list(source.sample_shape)]).encode())
    h.update(pd.util.hash_pandas_object(table, index=True).to_numpy().tobytes())
    return KEY_PREFIX + h.hexdigest()[:16]


#: The fields of each type of budget record, and the type of their values.
_FIELDS: dict[str, dict[str, type]] = {
    "spend": {"data": str, "run": str, "round": int, "step": int, "client": str, "kind": str, "mechanism": str,
              "noise_multiplier": float, "sample_rate": float, "steps": int, "delta": float, "accountant": str},
    "plan": {"data": str, "run": str, "session": str, "rounds": int, "releases": int}}


class SiteBudget:
    """A site's budget file (see the module docstring).

    Args:
        state_dir: the site's ``--state-dir``.
        data: :func:`data_key` of the data set the site serves.
        client: the client id the site serves.
        where: who keeps it, for messages (``"medfl site 0"``).
        policy: the site's policy: its caps, and the delta every epsilon is computed at
            (default: no cap, :data:`medfl.policy.DEFAULT_MAX_DELTA`).
    """

    def __init__(self, state_dir: Path, data: str, client: str, where: str, policy: SitePolicy | None = None) -> None:
        self.path = Path(state_dir) / BUDGET_FILE
        self.data, self.client, self.where = data, str(client), where
        self.policy = policy or SitePolicy()

    def records(self) -> list[dict[str, Any]]:
        """Every record, oldest first.

        Raises:
            BudgetRefused: a line is not a budget record, or a release ledger in the state
                directory records a release the budget lacks (naming the file and line, or
                the ledgers, and what the operator may do).
        """
        lines = self.path.read_text(encoding="utf-8").splitlines() if self.path.is_file() else []
        out = [_record(line) for line in lines]
        for n, rec in enumerate(out, 1):
            if rec is None:
                what = ("if a crash cut it short while it was written, its reply never left (the record is written "
                        "first): delete that line" if n == len(lines) else "the file was changed: restore it from a "
                        "backup")
                raise BudgetRefused(f"{self.where}: refused: line {n} of {len(lines)} of its privacy budget "
                                    f"{self.path} is not a budget record ({what}); rule: the budget fails closed")
        counted = {(r["run"], r["round"], r["client"], r["step"]) for r in out if r["type"] == "spend"}
        try:
            missing = {k: v for k, v in ledger_releases(self.path.parent).items() if k not in counted}
        except ValueError as exc:
            raise BudgetRefused(f"{self.where}: refused: {exc}; rule: the budget fails closed") from None
        if missing:
            run, round, _, step = min(missing)
            state = "is missing" if not self.path.is_file() else "is empty" if not lines else "lacks them"
            raise BudgetRefused(
                f"{self.where}: refused: its release ledger(s) {', '.join(sorted({str(v) for v in missing.values()}))} "
                f"record {len(missing)} release(s) (the first: run {run} round {round} step {step}) and its privacy "
                f"budget {self.path} {state}: restore the budget from a backup, or move those run folders out of the "
                "state directory to count from zero knowingly; rule: the budget fails closed, never counts as zero")
        return out

    def spends(self, run: str | None = None) -> list[dict[str, Any]]:
        """The spend records of this site's data set (of one ``run``, or of all). A record
        keyed the old way (a digest of config text, before :data:`KEY_PREFIX`) cannot be told
        to be of another data set, so it counts for every one."""
        return [r for r in self.records() if r.get("type") == "spend" and (run is None or r.get("run") == run)
                and (r.get("data") == self.data or not str(r.get("data")).startswith(KEY_PREFIX))]

    def spent(self, run: str | None = None) -> float:
        """Epsilon spent so far (in ``run``, or over every run on this data set) at the site's delta."""
        return composed_epsilon(self.spends(run), self.policy.delta)

    # ------------------------------------------------------------------ the plan
    def plan(self, run: str, session: str, rounds: Any, releases: Any) -> dict[str, Any]:
        """The plan of ``run`` this site accepted, recording it when the coordinator session
        ``session`` first names one.

        Raises:
            BudgetRefused: the message names no plan (``rounds``, ``releases``), or another
                plan than the one accepted in the same session.
        """
        for name, value in (("rounds", rounds), ("releases", releases)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise BudgetRefused(f"{self.where}: refused: the coordinator's message names no plan of the run "
                                    f"(control record {name!r}: {value!r}; expected a whole number >= 0), so the "
                                    "site cannot check what it is asked to release against it")
        plans = [r for r in self.records() if r.get("type") == "plan" and r.get("run") == run]
        same = [p for p in plans if p.get("session") == session]
        if same:
            accepted = same[-1]
            if (int(accepted["rounds"]), int(accepted["releases"])) != (rounds, releases):
                raise BudgetRefused(
                    f"{self.where}: refused: the plan of run {run} changed within one coordinator session "
                    f"({accepted['rounds']} rounds with {accepted['releases']} release(s) for this site accepted, "
                    f"now {rounds} rounds with {releases}); rule: a run's plan is fixed for a session")
            return accepted
        rec = {"type": "plan", "data": self.data, "run": run, "session": session, "client": self.client,
               "rounds": rounds, "releases": releases, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        append_record(self.path, rec)
        return rec

    # ------------------------------------------------------------------ one request
    def admit(self, run: str, round: int, step: int, kind: str, spends: list[Spend], plan: dict[str, Any]) -> None:
        """Check one DP request against the accepted ``plan`` and the policy's caps (at its
        delta), before anything is trained or drawn. ``kind``: ``train`` (a training reply)
        or ``release`` (a method's per-sample release).

        Raises:
            BudgetRefused: naming the rule, what was spent and what the request would spend.
        """
        rounds, planned = int(plan["rounds"]), int(plan["releases"])
        if not 1 <= round <= rounds:
            raise BudgetRefused(f"{self.where}: refused: round {round} of run {run} is outside the plan this site "
                                f"accepted (rounds 1-{rounds}); rule: a site releases only within the run's plan")
        every = self.spends()   # the file read once: this run's records and every run's
        mine = [r for r in every if r.get("run") == run]
        if kind == "release":
            before = sorted({(int(r["round"]), int(r["step"])) for r in mine if r.get("kind") == "release"})
            if before:
                raise BudgetRefused(f"{self.where}: refused: run {run} asks this site's per-sample release again "
                                    f"(round {round} step {step}; released in round {before[0][0]} step "
                                    f"{before[0][1]}); rule: each training sample is released once per run")
        else:
            steps = sorted({int(r["step"]) for r in mine if r.get("kind") == "train" and int(r["round"]) == round})
            if steps:
                raise BudgetRefused(f"{self.where}: refused: run {run} asks a second DP training reply in round "
                                    f"{round} (step {step}; answered at step {steps[0]}); rule: one DP training "
                                    "reply per round (the same update asked again would average its noise away)")
            done = {int(r["round"]) for r in mine if r.get("kind") == "train"}
            if len(done | {round}) > planned:
                raise BudgetRefused(f"{self.where}: refused: round {round} would be this site's "
                                    f"{_ordinal(len(done) + 1)} round with a DP training reply in run {run}, the plan "
                                    f"this site accepted names {planned} release(s); rule: no release beyond the plan")
        cap, delta = self.policy.max_epsilon, self.policy.delta
        if cap is not None:
            eps = composed_epsilon([*mine, *spends], delta)
            if eps > cap:
                raise BudgetRefused(
                    f"{self.where}: refused by its privacy budget: this reply ({_names(spends)}, round {round} step "
                    f"{step}) would bring run {run}'s epsilon at this site to {eps:.4g} at delta {delta:g} (spent "
                    f"{composed_epsilon(mine, delta):.4g} over {len(mine)} record(s) of its own), this site accepts at "
                    f"most {cap:g} per run (rule max_epsilon, counted by the site from its budget file {self.path})")
        cap = self.policy.max_epsilon_total
        if cap is not None:
            eps = composed_epsilon([*every, *spends], delta)
            if eps > cap:
                runs = len({r["run"] for r in every})
                raise BudgetRefused(
                    f"{self.where}: refused by its privacy budget: this reply ({_names(spends)}, run {run} round "
                    f"{round}) would bring this site's epsilon over every run on its data set to {eps:.4g} at delta "
                    f"{delta:g} (spent {composed_epsilon(every, delta):.4g} over {runs} run(s)), this site accepts at "
                    f"most {cap:g} in all (rule max_epsilon_total, budget file {self.path})")

    def record(self, run: str, round: int, step: int, kind: str, spends: list[Spend]) -> None:
        """Append the spends of one answered request (flushed to disk) before its reply leaves."""
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        for s in spends:
            d = asdict(s)
            d.pop("per_round")
            append_record(self.path, {"type": "spend", "data": self.data, "run": run, "round": int(round),
                                      "step": int(step), "client": self.client, "kind": kind, **d,
                                      "clip": d["clip"] if math.isfinite(d["clip"]) else None, "time": stamp})

    def table(self) -> list[dict[str, Any]]:
        """Per run (oldest first) what this site spent on its data set: rows of run, rounds
        with a release, mechanisms and epsilon (at the site's delta); then a row
        ``run: "(all runs)"`` composed over every run. What ``medfl budget`` prints."""
        every, delta = self.spends(), self.policy.delta
        runs = list(dict.fromkeys(r["run"] for r in every))
        rows = []
        for run in runs:
            mine = [r for r in every if r["run"] == run]
            rows.append({"run": run, "rounds": len({int(r["round"]) for r in mine}),
                         "mechanisms": ", ".join(sorted({str(r["mechanism"]) for r in mine})),
                         "epsilon": composed_epsilon(mine, delta)})
        if rows:
            rows.append({"run": "(all runs)", "rounds": sum(r["rounds"] for r in rows),
                         "mechanisms": ", ".join(sorted({str(r["mechanism"]) for r in every})),
                         "epsilon": composed_epsilon(every, delta)})
        return rows


def _record(line: str) -> dict[str, Any] | None:
    """The budget record a line holds, or None: not JSON, no known ``type``, or a field
    missing or of the wrong type (a number not finite)."""
    try:
        rec = json.loads(line)
    except json.JSONDecodeError:
        return None
    fields = _FIELDS.get(rec.get("type")) if isinstance(rec, dict) else None
    return rec if fields is not None and all(_fits(rec.get(k), t) for k, t in fields.items()) else None


def _fits(value: Any, kind: type) -> bool:
    if kind is str:
        return isinstance(value, str)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) if kind is int else math.isfinite(value)


def _ordinal(n: int) -> str:
    """``1st``, ``2nd``, ``3rd``, ``4th``, ``11th``, ``21st``..."""
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def _names(spends: list[Spend]) -> str:
    return ", ".join(f"{s.mechanism} at noise multiplier {s.noise_multiplier:.4g}" for s in spends) or "no mechanism"
