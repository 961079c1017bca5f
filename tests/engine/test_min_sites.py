"""A round needs its sites (issue 39, item 1): ``fl.min_sites`` and ``fl.min_fraction`` say
how many of a round's sites must answer its training and evaluation. In process a site is
missing from a round when its reply was refused or it was excluded after
``max_reply_failures``; a run whose round has too few sites fails, naming the round, how
many answered and the minimum, and never says "finished". The same rule
(:func:`medfl.engine.screening.sites_needed`) holds over Flower (tests/flower/test_quorum.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from medfl.cli import main
from medfl.config import ConfigError, resolve_config
from medfl.engine.runner import Run
from medfl.engine.screening import TooFewSites, sites_needed
from medfl.experiment import resume, run_experiment
from medfl.messages import Reply


def _spoiling(clients: set[str], rounds: set[int]) -> type[Run]:
    """Runs whose transport turns the model of ``clients``' replies in ``rounds`` into NaN
    after the client's own checks (a hostile or broken site): the coordinator refuses them."""
    class Spoiled(Run):
        def update_clients(self, r, instructions):  # type: ignore[no-untyped-def]
            replies: dict[str, Reply] = super().update_clients(r, instructions)
            for cid, reply in replies.items():
                if cid in clients and r in rounds:
                    state = reply.payload["model"]
                    key = next(iter(state))
                    state[key] = state[key] * math.nan
            return replies
    return Spoiled


@pytest.mark.parametrize("change, message", [
    ({"min_sites": 0}, r"fl.min_sites: expected an integer from 1 to fl.num_clients \(3\).*got 0"),
    ({"min_sites": 4}, r"fl.min_sites: expected an integer from 1 to fl.num_clients \(3\).*got 4"),
    ({"min_sites": 1.5}, r"fl.min_sites: expected an integer .*got 1.5"),
    ({"min_sites": True}, r"fl.min_sites: expected an integer .*got True"),
    ({"min_fraction": 0}, r"fl.min_fraction: expected null or a number in \(0, 1\].*got 0"),
    ({"min_fraction": 1.5}, r"fl.min_fraction: expected null or a number in \(0, 1\].*got 1.5"),
    ({"min_fraction": "all"}, r"fl.min_fraction: expected null or a number in \(0, 1\].*got 'all'"),
    ({"site_wait_s": -1}, r"fl.site_wait_s: expected a number of seconds >= 0.*got -1"),
])
def test_bad_quorum_settings_are_refused_by_name(tiny_fl, change, message) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_config({**tiny_fl, **change})


def test_a_bad_quorum_setting_is_one_error_line_and_no_run_directory(tiny_fl, tmp_path, capsys) -> None:
    cfg = tmp_path / "train.json"
    cfg.write_text(json.dumps({"fl": {**tiny_fl, "min_sites": 5}}))
    assert main(["run", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "medfl: error: fl.min_sites: expected an integer from 1 to fl.num_clients (3)" in err
    assert "Traceback" not in err and not (Path(tiny_fl["output_dir"]) / "t").exists()


def test_sites_needed_is_the_larger_rule_capped_at_the_sites_addressed() -> None:
    assert sites_needed(4, {}) == 1                                       # a config from before the keys
    assert sites_needed(4, {"min_sites": 1, "min_fraction": None}) == 1
    assert sites_needed(4, {"min_sites": 2, "min_fraction": 0.75}) == 3   # ceil(0.75 * 4)
    assert sites_needed(3, {"min_sites": 1, "min_fraction": 0.5}) == 2    # ceil(1.5)
    assert sites_needed(5, {"min_sites": 4, "min_fraction": 0.2}) == 4
    assert sites_needed(2, {"min_sites": 3, "min_fraction": None}) == 2   # a sampled round of 2 needs both
    assert sites_needed(0, {"min_sites": 3}) == 0                         # a step addressing nobody


def test_a_round_whose_every_reply_was_refused_fails_instead_of_finishing(tiny_fl) -> None:
    """Before: every site's reply refused (or every site excluded), the run went on with
    nothing trained and wrote "finished"."""
    job = dict(tiny_fl, rounds=3, max_reply_failures=1)
    with pytest.raises(TooFewSites, match=r"round 2: 0 of 3 sites answered train \(missing: 0, 1, 2; excluded after "
                                          r"max_reply_failures: 0, 1, 2\), the round needs at least 1 "
                                          r"\(fl.min_sites 1\)"):
        run_experiment(resolve_config(job), run_factory=_spoiling({"0", "1", "2"}, {2}))
    run_dir = Path(tiny_fl["output_dir"]) / "t" / "fedavg"
    status = json.loads((run_dir / "status.json").read_text())
    assert status["status"] == "failed" and status["last_round"] == 1
    assert status["reason"].startswith("TooFewSites: round 2: 0 of 3 sites answered train")
    assert not (run_dir / "summary.json").exists()


def test_min_fraction_fails_a_round_missing_one_site_and_the_run_resumes(tiny_fl) -> None:
    """With ``fl.min_fraction`` 1.0 one refused reply fails the round; resumed with the site
    healthy again, the run ends with the numbers of a run that never failed."""
    job = dict(tiny_fl, rounds=3, min_fraction=1.0)
    with pytest.raises(TooFewSites, match=r"round 2: 2 of 3 sites answered train \(missing: 1\), the round needs "
                                          r"at least 3 \(fl.min_sites 1, fl.min_fraction 1.0\)"):
        run_experiment(resolve_config(job), run_factory=_spoiling({"1"}, {2}))
    run_dir = Path(tiny_fl["output_dir"]) / "t" / "fedavg"
    assert json.loads((run_dir / "status.json").read_text())["status"] == "failed"
    resume(run_dir)
    assert json.loads((run_dir / "status.json").read_text())["status"] == "finished"
    ref = run_experiment(resolve_config(dict(job, name="ref")))
    for f in ("metrics.csv", "train_metrics.csv"):
        assert (run_dir / f).read_text() == (Path(ref["dir"]) / "fedavg" / f).read_text(), f
