"""A site's privacy budget that the coordinator cannot talk around (issue 49, items 1, 2 and 4).

The audit of 2026-11-27 attacked sites through the coordinator's own messages; each attack
is replayed here on the loop-back transport of ``test_coordinator.py`` (the coordinator's and the
sites' real code), by sending a site a real training message with its control record or
payload changed as a hostile coordinator would:

* ``releases: 0`` in the plan, so that the policy multiplied the per-release epsilon by 0;
* the same update asked again as extra steps of its round and as rounds past the run's end;
* a per-sample release asked again in a later round;
* a method's own DP (``own_dp``) asked twice for one round, the second time with another model
  (``release(theta) - release(0)`` was the noise-free update);
* a site with an epsilon cap asked for its evaluation model (``cross_test``).

And :class:`medfl.budget.SiteBudget` counts, itself, across runs.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("flwr", reason="Flower is a dependency of medfl")

from medfl import wire  # noqa: E402
from medfl.budget import BUDGET_FILE, BudgetRefused, SiteBudget, Spend, composed_epsilon  # noqa: E402
from medfl.config import resolve_config  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl.flower.server import run_flower_experiment  # noqa: E402
from medfl.site import REPRODUCIBLE_NOISE_ENV, SiteError  # noqa: E402
from medfl.site_messages import answer_message  # noqa: E402
from medfl.policy import PolicyRefusal, SitePolicy  # noqa: E402
from medfl.privacy.accounting import epsilon_spent  # noqa: E402

from flower_cases import fl_config  # noqa: E402
from test_coordinator import FAST, _sites  # noqa: E402
from test_noise_secrets import RecordingTransport  # noqa: E402
from test_policy import _site_with_policy  # noqa: E402


JOB = {"rounds": 1, "eval_every": 0, "model": {"name": "small_cnn", "width": 4},
       "train": {"batch_size": 8, "lr": 0.05}, "methods": [{"name": "fedavg"}]}


def _run(work: Path, name: str, **job: Any) -> tuple[RecordingTransport, dict[str, Any]]:
    fl = fl_config(work, name, {**JOB, **job})
    grid = RecordingTransport(_sites(work, fl))
    out = run_flower_experiment(resolve_config(fl), grid, FAST)
    return grid, out


def _message(grid: RecordingTransport, **ctl_changes: Any) -> tuple[Any, dict[str, Any], wire.Content]:
    """The first training message of the run as it travelled, its site, and a copy with
    control fields changed (a hostile coordinator's message)."""
    node, content = grid.asked[0]
    ctl = wire.take_json(wire.decode(content), P.CONTROL, "test")
    other = wire.decode(content)
    wire.put_json(other, P.CONTROL, {**ctl, **ctl_changes})
    return grid.sites[node], ctl, other


def _budget(site: Any) -> list[dict[str, Any]]:
    path = site.settings.state_dir / BUDGET_FILE
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


@pytest.fixture(autouse=True)
def secret_noise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REPRODUCIBLE_NOISE_ENV, raising=False)


def test_releases_zero_is_a_plan_the_site_checks_not_a_factor_it_trusts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The audit: with ``releases: 0`` a site capped at epsilon 3 answered dp_gaussian at
    sigma 1e-3. Now the policy's projection passes (0 x anything), but the site's own plan
    check refuses the release: nothing is trained or sent."""
    _site_with_policy(tmp_path, monkeypatch, "--max-epsilon", "3", "--max-epsilon-total", "none")
    grid, _ = _run(tmp_path, "honest", filters=[{"name": "dp_gaussian", "epsilon": 2, "clip": 1.0}])
    site, ctl, attack = _message(grid, run="attack-zero", releases=0,
                                 filters=[{**_message(grid)[1]["filters"][0], "noise_multiplier": 1e-3}])
    before = len(_budget(site))
    with pytest.raises(SiteError, match=r"refused: round 1 would be this site's 1st round with a DP training reply "
                                        r"in run attack-zero, the plan this site accepted names 0 release\(s\)"):
        answer_message(site, P.TRAIN, attack)
    spent = [r for r in _budget(site)[before:] if r["type"] == "spend"]
    assert spent == [], "a refused request was counted as spent"
    assert not (site.settings.state_dir / "attack-zero" / f"site_{site.client_id}" / "releases").exists()
    # the honest run's release is in the site's own budget, at the epsilon privacy.csv shows
    honest = [r for r in _budget(site) if r["type"] == "spend" and r["run"] == ctl["run"]]
    assert [(r["mechanism"], r["round"], r["step"], r["kind"]) for r in honest] == [("dp_gaussian", 1, 0, "train")]
    sigma = float(ctl["filters"][0]["noise_multiplier"])
    assert composed_epsilon(honest, 1e-5) == pytest.approx(epsilon_spent([(sigma, 1.0, 1)], 1e-5), rel=1e-9)


def test_the_same_update_asked_again_as_steps_or_rounds_is_refused(tmp_path: Path) -> None:
    """The audit asked one round's update again as steps 1-7 and as rounds 101-107 of a
    1-round run and got 15 answers (their mean has a seventh of the noise). Now: one DP
    training reply per round, no round outside the plan, no more rounds than planned,
    and the plan is fixed within a coordinator session."""
    grid, _ = _run(tmp_path, "steps", filters=[{"name": "dp_gaussian", "noise_multiplier": 1.0, "clip": 1.0}])
    site, ctl, _ = _message(grid)
    for step in range(1, 8):
        _, _, attack = _message(grid, step=step)
        with pytest.raises(SiteError, match=rf"asks a second DP training reply in round 1 \(step {step}; answered at "
                                            r"step 0\); rule: one DP training reply per round"):
            answer_message(site, P.TRAIN, attack)
    for r in range(101, 108):
        _, _, attack = _message(grid, round=r)
        with pytest.raises(SiteError, match=rf"round {r} of run {ctl['run']} is outside the plan this site accepted "
                                            r"\(rounds 1-1\)"):
            answer_message(site, P.TRAIN, attack)
    # within the session the plan cannot grow
    _, _, attack = _message(grid, round=2, rounds=8, releases=8)
    with pytest.raises(SiteError, match=r"the plan of run .* changed within one coordinator session \(1 rounds with 1 "
                                        r"release\(s\) for this site accepted, now 8 rounds with 8\)"):
        answer_message(site, P.TRAIN, attack)
    # a new session (a resumed run) may plan more rounds, but not release past what it plans
    _, _, attack = _message(grid, round=2, rounds=8, session="resumed")
    with pytest.raises(SiteError, match=r"round 2 would be this site's 2nd round with a DP training reply .* names 1 "
                                        r"release\(s\)"):
        answer_message(site, P.TRAIN, attack)
    spends = [r for r in _budget(site) if r["type"] == "spend" and r["run"] == ctl["run"]]
    assert len(spends) == 1, "a refused request was counted, or an answered one was not"


def test_the_sites_own_count_stops_a_run_at_its_cap_across_sessions_and_runs(tmp_path: Path) -> None:
    """The budget composes what the site itself released: a coordinator that plans 1 release
    per session and resumes 8 times is refused once the run's epsilon passes max_epsilon; a
    new run on the same data set is refused past max_epsilon_total."""
    gauss = [Spend("dp_gaussian", "client", 1.0, 1.0, 1, 1e-5, "rdp", 1.0)]
    one = epsilon_spent([(1.0, 1.0, 1)], 1e-5)
    cap = epsilon_spent([(1.0, 1.0, 3)], 1e-5) + 1e-9    # three releases fit, a fourth does not
    budget = SiteBudget(tmp_path, "table:data-a", "0", "medfl site 0", SitePolicy(max_epsilon=cap))
    answered = 0
    with pytest.raises(BudgetRefused, match=r"would bring run r1's epsilon at this site to .* \(spent .* over 3 "
                                            rf"record\(s\) of its own\), this site accepts at most {cap:g} per run"):
        for k in range(1, 9):   # each session plans one more round
            plan = budget.plan("r1", f"session{k}", k, k)
            budget.admit("r1", k, 0, "train", gauss, plan)
            budget.record("r1", k, 0, "train", gauss)
            answered += 1
    assert answered == 3 and budget.spent("r1") == pytest.approx(cap, rel=1e-6)
    # another run, another data set: its own count; the same data set: the total
    other = SiteBudget(tmp_path, "table:data-b", "0", "medfl site 0", SitePolicy(max_epsilon_total=one + 1e-9))
    plan = other.plan("r2", "s", 1, 1)
    other.admit("r2", 1, 0, "train", gauss, plan)
    budget = SiteBudget(tmp_path, "table:data-a", "0", "medfl site 0", SitePolicy(max_epsilon_total=cap + 0.5))
    plan = budget.plan("r3", "s", 1, 1)
    with pytest.raises(BudgetRefused, match=r"would bring this site's epsilon over every run on its data set to .* "
                                            r"\(spent .* over 1 run\(s\)\), this site accepts at most .* in all"):
        budget.admit("r3", 1, 0, "train", gauss, plan)
    rows = budget.table()
    assert [r["run"] for r in rows] == ["r1", "(all runs)"] and rows[-1]["epsilon"] == pytest.approx(budget.spent())


def test_a_per_sample_release_is_answered_once_per_run(tmp_path: Path) -> None:
    """The audit asked ``dp_shared_images``'s release (epsilon 8) in rounds 1-8 and got 8
    answers (epsilon 29.8). Now the second request of a run is refused; a release of another
    run is counted toward the site's total."""
    budget = SiteBudget(tmp_path, "data", "0", "medfl site 0")
    rel = [Spend("feature_gaussian", "sample", 0.8, 1.0, 1, 1e-5, "rdp", 1.0, per_round=False)]
    plan = budget.plan("run", "s", 8, 8)
    budget.admit("run", 1, 0, "release", rel, plan)
    budget.record("run", 1, 0, "release", rel)
    for r in range(2, 9):
        with pytest.raises(BudgetRefused, match=rf"asks this site's per-sample release again \(round {r} step 0; "
                                                r"released in round 1 step 0\); rule: each training sample is "
                                                r"released once per run"):
            budget.admit("run", r, 0, "release", rel, plan)
    assert budget.spent("run") == pytest.approx(epsilon_spent([(0.8, 1.0, 1)], 1e-5))


def test_a_methods_own_dp_is_in_the_ledger_and_a_second_model_for_its_round_is_refused(tmp_path: Path) -> None:
    """The audit: ``own_dp`` replies were in no ledger; the same (run, round, step) asked again
    with an all-zero model was answered, and the two replies' difference was the noise-free
    update. Now the release is journaled and budgeted like medfl's own, its noise names the
    instruction, and the second request is refused."""
    from contract_methods import methods_registered
    from privacy.test_own_dp import _dp_fedavg

    with methods_registered(_dp_fedavg(), name="dp-fedavg-test"):
        grid, _ = _run(tmp_path, "own", model={"name": "two_block_cnn"}, methods=[{"name": "test_dp_fedavg"}])
        site, ctl, _ = _message(grid)
        node, content = grid.asked[0]
        root = site.settings.state_dir / str(ctl["run"]) / f"site_{site.client_id}"
        records = [json.loads(line) for line in (root / "releases.jsonl").read_text().splitlines()]
        assert [m["mechanism"] for m in records[0]["mechanisms"]] == ["dp_fedavg_opacus_sgd"]
        spends = [r for r in _budget(site) if r["type"] == "spend" and r["run"] == ctl["run"]]
        assert [(r["mechanism"], r["unit"], r["noise_multiplier"]) for r in spends] == [
            ("dp_fedavg_opacus_sgd", "sample", 1.2)]
        # the same request: the same bytes
        again = wire.encode(answer_message(site, P.TRAIN, wire.decode(content)))
        assert again == grid.answered[(1, str(ctl["client"]))]
        # the same round with an all-zero model: refused before anything is trained or drawn
        other = wire.decode(content)
        payload = wire.take(other, "ins.payload", "test")
        zeros = {k: torch.zeros_like(v) for k, v in payload["model"].items()}
        wire.put(other, "ins.payload", {**payload, "model": zeros}, "test")
        with pytest.raises(SiteError, match=r"refused to release round 1 step 0 of run .* again: it was released under "
                                            r"another instruction \(dp_fedavg_opacus_sgd at noise multiplier 1\.2"):
            answer_message(site, P.TRAIN, other)


def test_a_capped_site_sends_no_model_for_cross_test_unless_its_policy_says_so() -> None:
    """A model sent for cross_test leaves without noise (BatchNorm statistics included): a
    site with an epsilon cap keeps it unless ``cross_test: true`` is written."""
    ask = {"want_model": True, "method": {"name": "fedavg"}, "filters": [], "train": {}}
    with pytest.raises(PolicyRefusal, match=r"rule cross_test: .*a site with an epsilon cap sends only when its policy "
                                            r"says cross_test: true"):
        SitePolicy(max_epsilon=3).check({"want_model": True}, lambda: 40)
    with pytest.raises(PolicyRefusal, match=r"rule cross_test"):
        SitePolicy(max_epsilon_total=10).check({"want_model": True}, lambda: 40)
    SitePolicy().check({"want_model": True}, lambda: 40)                       # no cap: as before
    SitePolicy(max_epsilon=3, cross_test=True).check({"want_model": True}, lambda: 40)
    with pytest.raises(PolicyRefusal, match=r"which its policy never sends"):
        SitePolicy(cross_test=False).check(ask, lambda: 40)
    policy = SitePolicy.from_dict({"max_epsilon": 3})
    assert not policy.sends_models and policy.to_dict() == {"max_epsilon": 3.0}
    assert any("never sends its evaluation model" in line for line in policy.describe())
    assert SitePolicy.from_dict({"max_epsilon": 3, "cross_test": True}).to_dict()["cross_test"] is True
    assert math.isinf(composed_epsilon([Spend("dp_gaussian", "client", 0.0, 1.0, 1, 1e-5, "rdp")], 1e-5))


def test_medfl_budget_prints_what_the_site_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from medfl.cli import main

    approvals = tmp_path / "approvals.json"
    assert main(["budget", str(tmp_path), "--file", str(approvals)]) == 2
    assert "no budget.jsonl" in capsys.readouterr().err
    budget = SiteBudget(tmp_path, "data", "0", "medfl site 0")
    gauss = [Spend("dp_gaussian", "client", 1.0, 1.0, 1, 1e-5, "rdp", 1.0)]
    for run in ("first", "second"):
        plan = budget.plan(run, "s", 2, 2)
        for r in (1, 2):
            budget.admit(run, r, 0, "train", gauss, plan)
            budget.record(run, r, 0, "train", gauss)
    assert main(["budget", str(tmp_path), "--file", str(approvals)]) == 0
    out = capsys.readouterr().out
    two, four = epsilon_spent([(1.0, 1.0, 2)], 1e-5), epsilon_spent([(1.0, 1.0, 4)], 1e-5)
    lines = [" ".join(line.split()) for line in out.splitlines()]
    assert f"first epsilon {two:.4g} rounds 2 dp_gaussian" in lines
    assert f"second epsilon {two:.4g} rounds 2 dp_gaussian" in lines
    assert f"(all runs) epsilon {four:.4g} rounds 4 dp_gaussian" in lines   # composed, not 2 x 7.08
    assert "policy (none): max_epsilon none per run, max_epsilon_total none over every run on a data set; epsilon at " \
           "delta 1e-05" in lines
    assert main(["policy", "--max-epsilon-total", "8", "--file", str(approvals)]) == 0
    assert json.loads(approvals.read_text())["policy"]["max_epsilon_total"] == 8.0
    assert "max_epsilon_total: largest epsilon over every run on this site's data set 8" in capsys.readouterr().out
    assert main(["budget", str(tmp_path), "--file", str(approvals)]) == 0
    assert f"policy ({approvals}): max_epsilon none per run, max_epsilon_total 8 over every run on a data set; " \
           "epsilon at delta 1e-05" in capsys.readouterr().out


def test_a_capped_site_refuses_an_entry_beside_its_noised_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                                ) -> None:
    """Issue 49, item 3, at the site: FedKPer's ``score`` leaves beside the model that
    ``dp_gaussian`` noises; the coordinator opted in (``fl.uncovered_entries``), so its run says
    it is not private, but a site with an epsilon cap refuses to send it, naming the entry."""
    from medfl.engine.remote import SiteFailure
    from test_approval import _approve

    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedkper")
    from medfl.cli import main

    assert main(["approve", "--all", "--kind", "filter", "--file", str(approvals)]) == 0
    assert main(["policy", "--max-epsilon", "30", "--max-epsilon-total", "none", "--file", str(approvals)]) == 0
    monkeypatch.setenv("MEDFL_APPROVALS", str(approvals))
    with pytest.raises(SiteFailure, match=r"site 0 failed in train of round 1 .*refused by its privacy policy: rule "
                                          r"max_epsilon: method 'fedkper' would reply \['score'\] beside its noised "
                                          r"model state \['model'\], in the clear"):
        _run(tmp_path, "score", methods=[{"name": "fedkper"}], uncovered_entries={"under_dp": "send_in_clear"},
             filters=[{"name": "dp_gaussian", "epsilon": 20, "clip": 1.0}])


def test_a_coordinators_delta_half_is_refused_at_the_site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The review: dp_gaussian at sigma 0.5 and delta 0.5 (epsilon 2.44, 10.7 at delta 1e-5)
    passed a site's --max-epsilon 3. Now the site's delta bounds every release."""
    _site_with_policy(tmp_path, monkeypatch, "--max-epsilon", "3", "--max-epsilon-total", "none", "--max-delta", "1e-5")
    grid, _ = _run(tmp_path, "honest", filters=[{"name": "dp_gaussian", "epsilon": 2, "clip": 1.0}])
    site, ctl, attack = _message(grid, run="attack-delta",
                                 filters=[{**_message(grid)[1]["filters"][0], "noise_multiplier": 0.5, "delta": 0.5}])
    with pytest.raises(SiteError, match=r"refused by its privacy policy \(.*approvals\.json\): rule max_delta: "
                                        r"dp_gaussian releases at delta 0\.5, this site accepts at most 1e-05"):
        answer_message(site, P.TRAIN, attack)
    assert [r["run"] for r in _budget(site) if r["type"] == "spend"] == [ctl["run"]]


def test_a_site_whose_budget_is_gone_refuses_the_next_run(tmp_path: Path) -> None:
    """The review: a deleted budget.jsonl counted zero while the run's release ledger listed
    the releases. Now the site refuses, naming the ledger, and releases nothing."""
    grid, _ = _run(tmp_path, "gone", filters=[{"name": "dp_gaussian", "noise_multiplier": 1.0, "clip": 1.0}])
    site, ctl, again = _message(grid, run="again")
    (site.settings.state_dir / BUDGET_FILE).unlink()
    with pytest.raises(SiteError, match=rf"refused: its release ledger\(s\) .*{ctl['run']}/site_{site.client_id}/"
                                        rf"releases\.jsonl record 1 release\(s\) \(the first: run {ctl['run']} round 1 "
                                        r"step 0\) and its privacy budget .*budget\.jsonl is missing"):
        answer_message(site, P.TRAIN, again)
    assert not (site.settings.state_dir / "again" / f"site_{site.client_id}" / "releases").exists()
