"""A site bounds delta (the hostile-coordinator review, item 3): the policy's ``max_delta``
(default 1e-5) applies to every release the site makes (a filter's, ``train.dp``'s, a
method's per-sample release's and its own DP's), and every epsilon the site computes is at
that delta, whatever delta the coordinator named.

The review: ``dp_gaussian`` at noise multiplier 0.5 is epsilon 10.7 at delta 1e-5 but 2.44 at
delta 0.5, so a coordinator that chose delta 0.5 passed ``--max-epsilon 3``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from medfl.approval import Approvals
from medfl.budget import BudgetRefused, SiteBudget, Spend
from medfl.cli import main
from medfl.policy import PolicyError, PolicyRefusal, SitePolicy, composed_epsilon
from medfl.privacy.accounting import epsilon_spent

HALF = {"name": "dp_gaussian", "clip": 1.0, "noise_multiplier": 0.5, "delta": 0.5, "accountant": "rdp",
        "keys": "parameters"}


def _ctl(filters: list[dict[str, Any]] | None = None, **extra: Any) -> dict[str, Any]:
    return {"method": {"name": "fedavg"}, "filters": filters or [], "train": {"batch_size": 8}, "releases": 1,
            "client": "0", **extra}


def test_delta_half_is_refused_at_a_site_with_max_delta(tmp_path: Path) -> None:
    approvals = tmp_path / "approvals.json"
    assert main(["policy", "--max-delta", "1e-5", "--max-epsilon", "3", "--max-epsilon-total", "none",
                 "--file", str(approvals)]) == 0
    policy = SitePolicy.from_dict(Approvals.load(approvals).policy)
    assert policy.to_dict() == {"max_epsilon": 3.0, "max_delta": 1e-5}
    with pytest.raises(PolicyRefusal, match=r"^rule max_delta: dp_gaussian releases at delta 0\.5, this site accepts "
                                            r"at most 1e-05"):
        policy.check(_ctl([HALF]), lambda: 40)
    # the same noise at the site's delta: epsilon 10.7, above the cap
    with pytest.raises(PolicyRefusal, match=r"rule max_epsilon: the run spends epsilon 10\.73 "):
        policy.check(_ctl([{**HALF, "delta": 1e-5}]), lambda: 40)


@pytest.mark.parametrize("ctl, mechanism", [
    (_ctl([HALF]), "dp_gaussian"),
    (_ctl(train={"batch_size": 8, "dp": {"noise_multiplier": 1.0, "delta": 0.5, "max_grad_norm": 1.0}}), "dp_sgd"),
    (_ctl(method={"name": "fedtpf", "delta": 0.5}), "feature_gaussian"),     # a per-sample release
])
def test_every_release_is_bounded_by_the_default_delta(ctl: dict[str, Any], mechanism: str) -> None:
    """A policy that sets no max_delta accepts at most 1e-5; one that sets it accepts up to it."""
    with pytest.raises(PolicyRefusal, match=rf"^rule max_delta: {mechanism} releases at delta 0\.5, this site "
                                            r"accepts at most 1e-05"):
        SitePolicy(max_epsilon=1e6).check(ctl, lambda: 40)
    SitePolicy(max_delta=0.5).check(ctl, lambda: 40)


def test_a_methods_own_dp_is_bounded_too() -> None:
    """``test_dp_fedavg`` declares its own DP-SGD at delta 1e-3."""
    from contract_methods import methods_registered
    from test_own_dp import _dp_fedavg

    ctl = _ctl(method={"name": "test_dp_fedavg"}, model={"name": "two_block_cnn", "num_classes": 2})
    with methods_registered(_dp_fedavg(), name="dp-fedavg-test"):
        with pytest.raises(PolicyRefusal, match=r"^rule max_delta: dp_fedavg_opacus_sgd releases at delta 0\.001, "
                                                r"this site accepts at most 1e-05"):
            SitePolicy(mechanisms=("dp_fedavg_opacus_sgd",)).check(ctl, lambda: 40)
        SitePolicy(max_delta=1e-3).check(ctl, lambda: 40)


def test_the_budget_counts_every_spend_at_the_sites_delta(tmp_path: Path) -> None:
    """A spend recorded at delta 0.5 (before the site bounded delta) counts 10.7 at the site's
    delta, not 2.44: the total cap of 3 refuses the next reply."""
    at_site, at_half = epsilon_spent([(0.5, 1.0, 1)], 1e-5), epsilon_spent([(0.5, 1.0, 1)], 0.5)
    assert (round(at_site, 1), round(at_half, 2)) == (10.7, 2.44)
    budget = SiteBudget(tmp_path, "data", "0", "medfl site 0", SitePolicy(max_epsilon_total=3))
    budget.record("old", 1, 0, "train", [Spend("dp_gaussian", "client", 0.5, 1.0, 1, 0.5, "rdp", 1.0)])
    assert budget.spent() == pytest.approx(at_site) and budget.table()[-1]["epsilon"] == pytest.approx(at_site)
    plan = budget.plan("new", "s", 1, 1)
    quiet = [Spend("dp_gaussian", "client", 50.0, 1.0, 1, 1e-5, "rdp", 1.0)]
    with pytest.raises(BudgetRefused, match=r"over every run on its data set to 10\.7\d* at delta 1e-05 \(spent "
                                            r"10\.7\d* over 1 run\(s\)\), this site accepts at most 3 in all"):
        budget.admit("new", 1, 0, "train", quiet, plan)
    # another site delta, another epsilon of the same records
    looser = SiteBudget(tmp_path, "data", "0", "medfl site 0", SitePolicy(max_delta=0.5))
    assert looser.spent() == pytest.approx(at_half)
    assert composed_epsilon([{**quiet[0].__dict__, "delta": 0.9}], 1e-5) == pytest.approx(
        epsilon_spent([(50.0, 1.0, 1)], 1e-5))


def test_max_delta_is_read_checked_and_shown() -> None:
    with pytest.raises(PolicyError, match=r"policy\.max_delta: expected a delta in \(0, 1\) such as 1e-05, got 1"):
        SitePolicy.from_dict({"max_delta": 1})
    with pytest.raises(PolicyError, match=r"policy\.max_delta: expected a finite number > 0, got 0"):
        SitePolicy.from_dict({"max_delta": 0})
    assert "max_delta: largest delta of any release, the delta every epsilon is computed at, 1e-05 (the default)" \
        in SitePolicy(max_epsilon_total=8).describe()
    assert SitePolicy.from_dict({"max_delta": 1e-6}).describe() == [
        "max_delta: largest delta of any release, the delta every epsilon is computed at, 1e-06"]
