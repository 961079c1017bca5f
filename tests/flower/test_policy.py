"""A site's own privacy policy (issue 38, item 6): the least privacy it accepts, written in
its approvals file and checked at the site before the method's code runs.

The sites run behind the loop-back transport of ``test_coordinator.py``, as in
``test_approval.py``: a refusal travels to the coordinator as Flower does it (the
ClientApp's exception becomes an error reply) and, every site refusing, fails the run with
a :class:`SiteFailure` naming the site and the rule.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from medfl.approval import APPROVALS_ENV, ApprovalError, Approvals  # noqa: E402
from medfl.cli import main  # noqa: E402
from medfl.config import resolve_config  # noqa: E402
from medfl.engine.remote import SiteFailure  # noqa: E402
from medfl.flower.server import run_flower_experiment  # noqa: E402
from medfl.policy import PolicyError, PolicyRefusal, SitePolicy  # noqa: E402

from flower_cases import FEDAVG, fl_config  # noqa: E402
from test_approval import _approve  # noqa: E402
from test_coordinator import FAST, LoopTransport, _sites  # noqa: E402


def _site_with_policy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *policy: str) -> Path:
    """Approve fedavg, the filters and what every site runs; write ``medfl policy`` options;
    enforce the file at the sites."""
    approvals = tmp_path / "approvals.json"
    _approve(approvals, "fedavg")
    assert main(["approve", "--all", "--kind", "filter", "--file", str(approvals)]) == 0
    assert main(["policy", *policy, "--file", str(approvals)]) == 0
    monkeypatch.setenv(APPROVALS_ENV, str(approvals))
    return approvals


def _run(tmp_path: Path, name: str, filters: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    fl = fl_config(tmp_path, name, {**FEDAVG, "rounds": 1, "eval_every": 0, "filters": filters, **extra})
    return run_flower_experiment(resolve_config(fl), LoopTransport(_sites(tmp_path, fl)), FAST)


def test_a_site_capping_epsilon_refuses_a_run_above_it_and_accepts_one_below(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _site_with_policy(tmp_path, monkeypatch, "--max-epsilon", "3", "--max-epsilon-total", "none")
    with pytest.raises(SiteFailure, match=r"site 0 failed in train of round 1 .*medfl site 0: refused by its privacy "
                                          r"policy \(.*approvals\.json\): rule max_epsilon: the run spends epsilon "
                                          r"7\.\d+ of this site's data \(dp_gaussian over 1 planned release\(s\)\), "
                                          r"this site accepts at most 3"):
        _run(tmp_path, "eps8", [{"name": "dp_gaussian", "epsilon": 8}])
    out = _run(tmp_path, "eps2", [{"name": "dp_gaussian", "epsilon": 2}])
    assert out["summaries"]["fedavg"]["rounds"] == 1


def test_a_noise_multiplier_below_the_sites_minimum_is_refused(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    _site_with_policy(tmp_path, monkeypatch, "--min-noise-multiplier", "0.5")
    with pytest.raises(SiteFailure, match=r"site 0 .*refused by its privacy policy .*rule min_noise_multiplier: "
                                          r"dp_gaussian adds noise multiplier 1e-09, this site requires at least 0\.5"):
        _run(tmp_path, "tiny_noise", [{"name": "dp_gaussian", "noise_multiplier": 1e-9}])


def test_a_required_quantize_filter_missing_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _site_with_policy(tmp_path, monkeypatch, "--require-filter", "quantize:bits<=8")
    with pytest.raises(SiteFailure, match=r"site 0 .*refused by its privacy policy .*rule required_filters: the run's "
                                          r"reply filters \(none\) lack 'quantize', which this site requires"):
        _run(tmp_path, "no_quantize", [])
    out = _run(tmp_path, "quantized", [{"name": "quantize", "bits": 8}])
    assert out["summaries"]["fedavg"]["rounds"] == 1


def test_a_site_that_keeps_its_model_refuses_cross_test(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _site_with_policy(tmp_path, monkeypatch, "--cross-test", "no")
    with pytest.raises(SiteFailure, match=r"site 0 failed in evaluate .*rule cross_test: the coordinator asks for this "
                                          r"site's evaluation model"):
        _run(tmp_path, "cross", [], eval_splits=["test", "cross_test"], eval_every=1)


# ---------------------------------------------------------------------- the rules, without Flower
DP = {"name": "dp_gaussian", "clip": 1.0, "noise_multiplier": 1.0, "delta": 1e-5, "accountant": "rdp",
      "keys": "parameters"}


def _ctl(filters: list[dict[str, Any]], releases: int | None = 10, **extra: Any) -> dict[str, Any]:
    ctl: dict[str, Any] = {"method": {"name": "fedavg"}, "filters": filters, "train": {"batch_size": 8}, **extra}
    if releases is not None:
        ctl["releases"] = releases
    return ctl


def test_the_site_computes_epsilon_itself_per_run_and_per_release() -> None:
    from medfl.privacy.accounting import epsilon_spent

    one, ten = epsilon_spent([(1.0, 1.0, 1)], 1e-5), epsilon_spent([(1.0, 1.0, 10)], 1e-5)
    SitePolicy(max_epsilon=ten + 1e-6, max_epsilon_per_release=one + 1e-6).check(_ctl([DP]), lambda: 40)
    with pytest.raises(PolicyRefusal, match=rf"rule max_epsilon: the run spends epsilon {ten:.4g} .*over 10 planned"):
        SitePolicy(max_epsilon=ten - 0.01).check(_ctl([DP]), lambda: 40)
    with pytest.raises(PolicyRefusal, match=rf"rule max_epsilon_per_release: one dp_gaussian release spends epsilon "
                                            rf"{one:.4g}"):
        SitePolicy(max_epsilon_per_release=one - 0.01).check(_ctl([DP]), lambda: 40)
    with pytest.raises(PolicyRefusal, match=r"rule max_epsilon: the coordinator does not say how many releases"):
        SitePolicy(max_epsilon=100).check(_ctl([DP], releases=None), lambda: 40)
    with pytest.raises(PolicyRefusal, match=r"rule max_epsilon: the run makes no differential-privacy release"):
        SitePolicy(max_epsilon=100).check(_ctl([]), lambda: 40)


def test_dp_sgd_is_counted_from_the_sites_own_training_set() -> None:
    from medfl.privacy.accounting import epsilon_spent

    dp = {"noise_multiplier": 1.1, "delta": 1e-5, "accountant": "rdp", "max_grad_norm": 1.0}
    ctl = _ctl([], releases=3, train={"batch_size": 8, "epochs": 1, "dp": dp})
    # 40 examples, batches of 8: 5 steps per update at sample rate 1/5, 3 updates
    eps = epsilon_spent([(1.1, 0.2, 15)], 1e-5)
    SitePolicy(max_epsilon=eps + 1e-6, mechanisms=("dp_sgd",)).check(ctl, lambda: 40)
    with pytest.raises(PolicyRefusal, match=rf"rule max_epsilon: the run spends epsilon {eps:.4g} .*dp_sgd over 3"):
        SitePolicy(max_epsilon=eps - 0.01).check(ctl, lambda: 40)
    with pytest.raises(PolicyRefusal, match=r"rule mechanisms: the run releases with dp_sgd, this site accepts only "
                                            r"dp_gaussian"):
        SitePolicy(mechanisms=("dp_gaussian",)).check(ctl, lambda: 40)


def test_a_method_release_without_noise_is_refused() -> None:
    """FedTPF with ``epsilon: null`` releases its features without noise: epsilon infinite."""
    ctl = _ctl([], releases=2, method={"name": "fedtpf", "epsilon": None})
    with pytest.raises(PolicyRefusal, match=r"rule max_epsilon: the run spends epsilon inf"):
        SitePolicy(max_epsilon=5).check(ctl, lambda: 40)


def test_required_filter_bounds_and_hello() -> None:
    policy = SitePolicy.from_dict({"required_filters": [{"name": "quantize", "max": {"bits": 8}}]})
    policy.check(_ctl([{"name": "quantize", "bits": 8}]), lambda: 40)
    with pytest.raises(PolicyRefusal, match=r"rule required_filters: filter 'quantize' has bits 16, this site requires "
                                            r"at most 8"):
        policy.check(_ctl([{"name": "quantize", "bits": 16}]), lambda: 40)
    policy.check({"protocol": 1}, lambda: 40)   # hello: no method, nothing to check


@pytest.mark.parametrize("policy, message", [
    ([], r"policy: expected an object of rules"),
    ({"max_eps": 3}, r"policy: unknown rule\(s\) \['max_eps'\]; rules: mechanisms, max_epsilon"),
    ({"max_epsilon": -1}, r"policy\.max_epsilon: expected a finite number > 0, got -1"),
    ({"max_epsilon": "3"}, r"policy\.max_epsilon: expected a finite number > 0, got '3'"),
    ({"min_noise_multiplier": math.inf}, r"policy\.min_noise_multiplier: expected a finite number > 0, got inf"),
    ({"mechanisms": "dp_gaussian"}, r"policy\.mechanisms: expected a list of mechanism names"),
    ({"required_filters": {"name": "quantize"}}, r"policy\.required_filters: expected a list"),
    ({"required_filters": [{"bits": 8}]}, r"policy\.required_filters\[0\]: expected \{\"name\": FILTER"),
    ({"required_filters": [{"name": "quantize", "max": {"bits": "8"}}]},
     r"policy\.required_filters\[0\]\.max\['bits'\]: expected a finite number, got '8'"),
    ({"required_filters": [{"name": "quantize", "bits": 8}]},
     r"policy\.required_filters\[0\]: unknown key\(s\) \['bits'\]; expected name, max, min"),
    ({"cross_test": "no"}, r"policy\.cross_test: expected true or false, got 'no'"),
])
def test_policy_parser_errors(policy: Any, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        SitePolicy.from_dict(policy)


def test_a_malformed_policy_in_the_approvals_file_names_the_file(tmp_path: Path) -> None:
    approvals = tmp_path / "approvals.json"
    approvals.write_text(json.dumps({"medfl_approvals": 2, "approved": [], "policy": {"max_epsilon": 0}}))
    with pytest.raises(ApprovalError, match=rf"approvals file {approvals}: policy\.max_epsilon: expected a finite "
                                            r"number > 0, got 0"):
        Approvals.load(approvals)


def test_policy_command_writes_and_shows(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    approvals = tmp_path / "approvals.json"
    assert main(["policy", "--max-epsilon", "3", "--file", str(approvals)]) == 2
    assert "--max-epsilon caps each run anew: give --max-epsilon-total NUMBER too" in capsys.readouterr().err
    assert main(["policy", "--max-epsilon", "3", "--max-epsilon-total", "8", "--min-noise-multiplier", "0.8",
                 "--mechanisms", "dp_gaussian,dp_sgd", "--require-filter", "quantize:bits<=8", "--cross-test", "no",
                 "--file", str(approvals)]) == 0
    assert json.loads(approvals.read_text())["policy"] == {
        "mechanisms": ["dp_gaussian", "dp_sgd"], "max_epsilon": 3.0, "max_epsilon_total": 8.0,
        "min_noise_multiplier": 0.8, "required_filters": [{"name": "quantize", "max": {"bits": 8.0}}],
        "cross_test": False}
    assert main(["policy", "--max-epsilon", "2", "--max-epsilon-total", "none", "--file", str(approvals)]) == 0
    assert "max_epsilon_total: none, so every run may spend max_epsilon anew" in capsys.readouterr().out
    assert main(["policy", "--max-epsilon", "3", "--max-epsilon-total", "8", "--file", str(approvals)]) == 0
    capsys.readouterr()
    assert main(["policy", "--file", str(approvals)]) == 0
    shown = capsys.readouterr().out
    assert "max_epsilon: largest epsilon over a run 3" in shown and "required_filters: quantize with bits <= 8" in shown
    assert main(["policy", "--require-filter", "quantize:bits<8", "--file", str(approvals)]) == 2
    assert "expected FILTER[:PARAM<=NUMBER,PARAM>=NUMBER...]" in capsys.readouterr().err
    assert main(["policy", "--clear", "--file", str(approvals)]) == 0
    assert "policy" not in json.loads(approvals.read_text())
