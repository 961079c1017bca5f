"""A site's budget that fails closed and says what it is (the hostile-coordinator review,
item 4): a damaged line anywhere in ``budget.jsonl`` is refused in one line naming the file
and line; a missing, emptied or cut budget beside release ledgers that record earlier
releases is refused naming the ledgers, never counted as zero; ``medfl policy --max-epsilon``
asks for ``--max-epsilon-total`` and ``medfl budget`` prints both caps; ordinals are right.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest
import torch

from medfl.budget import BUDGET_FILE, BudgetRefused, SiteBudget, Spend
from medfl.cli import main
from medfl.privacy.releases import SiteReleaseLedger

GAUSS = [Spend("dp_gaussian", "client", 1.0, 1.0, 1, 1e-5, "rdp", 1.0)]


def _site(state: Path, answered: int = 2) -> SiteBudget:
    """A site's state directory after ``answered`` DP training replies of run ``r``: each
    recorded in the budget, then in the run's release ledger (as ``Site.train`` does)."""
    budget = SiteBudget(state, "data", "0", "medfl site 0")
    ledger = SiteReleaseLedger(state / "r" / "site_0", "medfl site 0")
    plan = budget.plan("r", "s", 4, 4)
    for k in range(1, answered + 1):
        budget.admit("r", k, 0, "train", GAUSS, plan)
        budget.record("r", k, 0, "train", GAUSS)
        ledger.record("r", k, "0", 0, [s.ledger_entry() for s in GAUSS], f"ins{k}", {"w": torch.zeros(2)}, 4, {})
    return budget


def _lines(path: Path, change: Callable[[list[str]], list[str]]) -> None:
    path.write_text("".join(f"{line}\n" for line in change(path.read_text().splitlines())))


def _refused(budget: SiteBudget, match: str) -> None:
    """Every reader of the budget refuses, in one line; so does ``medfl budget``."""
    for read in (budget.records, budget.spends, lambda: budget.plan("r", "s", 4, 4),
                 lambda: budget.admit("r", 3, 0, "train", GAUSS, {"rounds": 4, "releases": 4})):
        with pytest.raises(BudgetRefused, match=match) as got:
            read()
        assert "\n" not in str(got.value)
    assert main(["budget", str(budget.path.parent), "--file", str(budget.path.parent / "none.json")]) == 2


DAMAGED = [
    ("a line mid-file", lambda lines: [lines[0], "not json", *lines[2:]],
     r"line 2 of 3 of its privacy budget .*budget\.jsonl is not a budget record \(the file was changed: restore it "
     r"from a backup\); rule: the budget fails closed$"),
    ("a field of the wrong type", lambda lines: [lines[0], lines[1].replace('"steps": 1', '"steps": "x"'), lines[2]],
     r"line 2 of 3 of its privacy budget .* is not a budget record \(the file was changed"),
    ("a number that is not finite", lambda lines: [*lines[:2], lines[2].replace('"delta": 1e-05', '"delta": NaN')],
     r"line 3 of 3 of its privacy budget .* is not a budget record \(if a crash cut it short"),
    ("an unknown record", lambda lines: [*lines, "[1, 2]", lines[0]], r"line 4 of 5 .* \(the file was changed"),
    ("emptied", lambda lines: [],
     r"its release ledger\(s\) .*r/site_0/releases\.jsonl record 2 release\(s\) \(the first: run r round 1 step 0\) "
     r"and its privacy budget .*budget\.jsonl is empty: restore the budget from a backup, or move those run folders "
     r"out of the state directory to count from zero knowingly; rule: the budget fails closed"),
    ("cut to its first spend", lambda lines: lines[:2], r"record 1 release\(s\) \(the first: run r round 2 step 0\) "
                                                        r"and its privacy budget .* lacks them"),
]


@pytest.mark.parametrize("what, change, match", DAMAGED, ids=[d[0] for d in DAMAGED])
def test_a_damaged_budget_is_refused_in_one_line(tmp_path: Path, what: str, change: Callable[[list[str]], list[str]],
                                                 match: str) -> None:
    budget = _site(tmp_path)
    _lines(budget.path, change)
    _refused(budget, match)


def test_a_missing_budget_beside_a_ledger_is_refused_not_counted_as_zero(tmp_path: Path) -> None:
    """The review: a deleted budget counted zero while the ledger listed the releases."""
    budget = _site(tmp_path)
    budget.path.unlink()
    _refused(budget, r"record 2 release\(s\) .* and its privacy budget .*budget\.jsonl is missing: restore")
    assert not budget.path.exists(), "a refused budget was written"


def test_a_last_line_cut_by_a_crash_is_refused_until_the_operator_deletes_it(tmp_path: Path) -> None:
    """A crash while round 3's record was written (before its ledger record and its reply)."""
    budget = _site(tmp_path)
    kept = budget.path.read_text()
    budget.path.write_text(kept + '{"type": "spend", "data": "data", "run": "r", "rou')
    _refused(budget, r"line 4 of 4 of its privacy budget .*budget\.jsonl is not a budget record \(if a crash cut it "
                     r"short while it was written, its reply never left \(the record is written first\): delete that "
                     r"line\); rule: the budget fails closed$")
    budget.path.write_text(kept)   # what the operator does
    budget.admit("r", 3, 0, "train", GAUSS, budget.plan("r", "s", 4, 4))


def test_ordinals_are_right(tmp_path: Path) -> None:
    budget = SiteBudget(tmp_path, "data", "0", "medfl site 0")
    plan = budget.plan("r", "s", 30, 22)
    for k in range(1, 23):
        budget.admit("r", k, 0, "train", GAUSS, plan)
        budget.record("r", k, 0, "train", GAUSS)
    with pytest.raises(BudgetRefused, match=r"round 23 would be this site's 23rd round with a DP training reply in run "
                                            r"r, the plan this site accepted names 22 release\(s\)"):
        budget.admit("r", 23, 0, "train", GAUSS, plan)
    from medfl.budget import _ordinal

    assert [_ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101, 111, 112)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st", "111th", "112th"]


def test_max_epsilon_asks_for_a_total_and_medfl_budget_prints_both(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The review: with --max-epsilon 3 alone, seven runs were answered, 9.25 in all, and
    nothing said that --max-epsilon is per run."""
    approvals = tmp_path / "approvals.json"
    assert main(["policy", "--max-epsilon", "3", "--file", str(approvals)]) == 2
    err = capsys.readouterr().err
    assert "--max-epsilon caps each run anew: give --max-epsilon-total NUMBER too (the cap over every run on this " \
           "site's data set), or --max-epsilon-total none for no such cap" in err and not approvals.exists()
    assert main(["policy", "--max-epsilon", "3", "--max-epsilon-total", "bogus", "--file", str(approvals)]) == 2
    assert "--max-epsilon-total: expected a number or none, got 'bogus'" in capsys.readouterr().err
    assert main(["policy", "--max-epsilon", "3", "--max-epsilon-total", "none", "--file", str(approvals)]) == 0
    assert "max_epsilon_total: none, so every run may spend max_epsilon anew" in capsys.readouterr().out
    assert main(["policy", "--max-epsilon-total", "8", "--max-delta", "1e-6", "--file", str(approvals)]) == 0
    assert main(["policy", "--max-epsilon", "2", "--file", str(approvals)]) == 0    # the file has a total
    capsys.readouterr()
    _site(tmp_path / "state")
    assert main(["budget", str(tmp_path / "state"), "--file", str(approvals)]) == 0
    out = capsys.readouterr().out
    assert f"policy ({approvals}): max_epsilon 2 per run, max_epsilon_total 8 over every run on a data set; epsilon " \
           "at delta 1e-06" in out
    assert (tmp_path / "state" / BUDGET_FILE).is_file()
