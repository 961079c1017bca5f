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

Mechanisms compose by adding their epsilons (each mechanism's history composed by its own
accountant at its own delta), across runs too: an upper bound, never an under-count.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from medfl.policy import Spend, composed_epsilon
from medfl.privacy.releases import append_record, read_records

__all__ = ["SiteBudget", "BudgetRefused", "data_key", "BUDGET_FILE", "Spend", "composed_epsilon"]

#: The site's budget, in its ``--state-dir`` (shared by every run it serves).
BUDGET_FILE = "budget.jsonl"


class BudgetRefused(RuntimeError):
    """A request the site's own budget or its accepted plan does not allow (naming the rule)."""


def data_key(dataset: Any) -> str:
    """A short digest naming the data set a site serves (its config's ``dataset`` entry): the
    budget across runs counts the runs on the same data set."""
    text = json.dumps(dataset, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class SiteBudget:
    """A site's budget file (see the module docstring).

    Args:
        state_dir: the site's ``--state-dir``.
        data: :func:`data_key` of the data set the site serves.
        client: the client id the site serves.
        where: who keeps it, for messages (``"medfl site 0"``).
    """

    def __init__(self, state_dir: Path, data: str, client: str, where: str) -> None:
        self.path = Path(state_dir) / BUDGET_FILE
        self.data, self.client, self.where = data, str(client), where

    def records(self) -> list[dict[str, Any]]:
        """Every record, oldest first (a last line cut short by a crash is ignored)."""
        return read_records(self.path)

    def spends(self, run: str | None = None) -> list[dict[str, Any]]:
        """The spend records of this site's data set (of one ``run``, or of all)."""
        return [r for r in self.records() if r.get("type") == "spend" and r.get("data") == self.data
                and (run is None or r.get("run") == run)]

    def spent(self, run: str | None = None) -> float:
        """Epsilon spent so far (in ``run``, or over every run on this data set)."""
        return composed_epsilon(self.spends(run))

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
    def admit(self, run: str, round: int, step: int, kind: str, spends: list[Spend], plan: dict[str, Any],
              max_epsilon: float | None = None, max_epsilon_total: float | None = None) -> None:
        """Check one DP request against the accepted ``plan`` and the caps, before anything
        is trained or drawn. ``kind``: ``train`` (a training reply) or ``release`` (a
        method's per-sample release).

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
                                    f"{len(done) + 1}th round with a DP training reply in run {run}, the plan this "
                                    f"site accepted names {planned} release(s); rule: no release beyond the plan")
        if max_epsilon is not None:
            eps = composed_epsilon([*mine, *spends])
            if eps > max_epsilon:
                raise BudgetRefused(
                    f"{self.where}: refused by its privacy budget: this reply ({_names(spends)}, round {round} step "
                    f"{step}) would bring run {run}'s epsilon at this site to {eps:.4g} (spent {composed_epsilon(mine):.4g} "
                    f"over {len(mine)} record(s) of its own), this site accepts at most {max_epsilon:g} per run "
                    "(rule max_epsilon, counted by the site from its budget file "
                    f"{self.path})")
        if max_epsilon_total is not None:
            eps = composed_epsilon([*every, *spends])
            if eps > max_epsilon_total:
                runs = len({r["run"] for r in every})
                raise BudgetRefused(
                    f"{self.where}: refused by its privacy budget: this reply ({_names(spends)}, run {run} round "
                    f"{round}) would bring this site's epsilon over every run on its data set to {eps:.4g} (spent "
                    f"{composed_epsilon(every):.4g} over {runs} run(s)), this site accepts at most "
                    f"{max_epsilon_total:g} in all (rule max_epsilon_total, budget file {self.path})")

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
        with a release, mechanisms and epsilon; then a row ``run: "(all runs)"`` composed over
        every run. What ``medfl budget`` prints."""
        every = self.spends()
        runs = list(dict.fromkeys(r["run"] for r in every))
        rows = []
        for run in runs:
            mine = [r for r in every if r["run"] == run]
            rows.append({"run": run, "rounds": len({int(r["round"]) for r in mine}),
                         "mechanisms": ", ".join(sorted({str(r["mechanism"]) for r in mine})),
                         "epsilon": composed_epsilon(mine)})
        if rows:
            rows.append({"run": "(all runs)", "rounds": sum(r["rounds"] for r in rows),
                         "mechanisms": ", ".join(sorted({str(r["mechanism"]) for r in every})),
                         "epsilon": composed_epsilon(every)})
        return rows


def _names(spends: list[Spend]) -> str:
    return ", ".join(f"{s.mechanism} at noise multiplier {s.noise_multiplier:.4g}" for s in spends) or "no mechanism"
