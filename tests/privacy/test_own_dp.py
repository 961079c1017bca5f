"""A method that applies differential privacy in its own client step declares it
(``Method.own_dp`` -> :class:`medfl.OwnDp`), and the run accounts it like medfl's own
mechanisms instead of saying "no differential privacy" (issue 38, "Done when").

The plugin is the example plugin's ``dp_fedavg_opacus``, written the way an outside
DP-FedAvg author writes it from docs/plugins.md: Opacus's ``PrivacyEngine`` inside
``client_update``, nothing of medfl's DP code. The run's epsilon must then be exactly Opacus's for the declared noise, sampling rate
and steps, and a client that reports other steps than declared must stop the run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from opacus.accountants import create_accountant

from medfl.report import _privacy_line
from medfl.experiment import run_experiment
from medfl.privacy.accounting import PrivacyConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "medfl-plugin-example"


def _dp_fedavg(misreport: int = 0, declare: dict[str, Any] | None = None) -> type:
    """The example plugin's ``dp_fedavg_opacus`` (FedAvg whose local epochs are Opacus's
    DP-SGD, declared with ``own_dp``), as ``test_dp_fedavg``: ``misreport`` adds to the
    steps it reports; ``declare`` overrides fields of its declaration."""
    import dataclasses

    sys.path.insert(0, str(EXAMPLE))
    try:
        from medfl_median import DpFedAvgOpacus
    finally:
        sys.path.remove(str(EXAMPLE))

    class DpFedAvg(DpFedAvgOpacus):
        name = "test_dp_fedavg"

        def __init__(self, noise_multiplier: float = 1.2, max_grad_norm: float = 1.0, delta: float = 1e-3) -> None:
            super().__init__(noise_multiplier, max_grad_norm, delta)

        def own_dp(self, federation):  # type: ignore[no-untyped-def]
            return dataclasses.replace(super().own_dp(federation), **(declare or {}))

        def client_update(self, client, instruction):  # type: ignore[no-untyped-def]
            reply = super().client_update(client, instruction)
            reply.metrics["dp_steps"] += misreport
            return reply

    return DpFedAvg


def _fl(tiny_fl: dict[str, Any]) -> dict[str, Any]:
    return {**tiny_fl, "model": {"name": "two_block_cnn"}, "methods": [{"name": "test_dp_fedavg"}]}


def test_a_method_that_does_its_own_dp_declares_it_and_the_run_accounts_it(tiny_fl: dict, resolve: Any) -> None:
    from contract_methods import methods_registered

    with methods_registered(_dp_fedavg(), name="dp-fedavg-test"):
        out = run_experiment(resolve(_fl(tiny_fl)))
    run = Path(out["dir"]) / "test_dp_fedavg"
    df = pd.read_csv(run / "privacy.csv", dtype={"client_id": str})
    assert set(df["mechanism"]) == {"dp_fedavg_opacus_sgd"} and set(df["unit"]) == {"sample"} and len(df) == 2 * 3
    cfg = json.loads((run / "config.json").read_text())["privacy"]["dp_fedavg_opacus_sgd"]
    for _, row in df.iterrows():   # Opacus's epsilon for the declared history, round by round
        cid = row["client_id"]
        q, steps = cfg["sample_rate"][cid], cfg["steps_per_update"][cid]
        acc = create_accountant(mechanism="rdp")
        acc.history = [(1.2, q, steps * int(row["round"]))]
        assert row["epsilon"] == pytest.approx(float(acc.get_epsilon(1e-3)), rel=1e-9)
        assert row["total_steps"] == steps * int(row["round"])
    summary = json.loads((run / "summary.json").read_text())
    block = summary["privacy"]["mechanisms"]["dp_fedavg_opacus_sgd"]
    assert summary["privacy"]["private"] is True and block["performed_by"] == "method"
    assert summary["privacy"]["epsilon"] == pytest.approx(df.groupby("client_id")["epsilon"].last().max())
    assert any("applied by method 'test_dp_fedavg'" in u for u in summary["privacy"]["not_covered"])
    assert cfg["performed_by"] == "method" and cfg["statement"].startswith("Opacus's DP-SGD")
    line = _privacy_line(summary)
    assert "no differential privacy" not in line and "dp_fedavg_opacus_sgd epsilon" in line


def test_a_client_reporting_other_steps_than_declared_stops_the_run(tiny_fl: dict, resolve: Any) -> None:
    from contract_methods import methods_registered

    with methods_registered(_dp_fedavg(misreport=1), name="dp-fedavg-test"):
        with pytest.raises(PrivacyConfigError, match=r"reports \d+ steps of dp_fedavg_opacus_sgd \('dp_steps'\), the "
                                                     r"method's own_dp\(\) declares \d+"):
            run_experiment(resolve(_fl(tiny_fl)))


@pytest.mark.parametrize("declare, match", [
    ({"mechanism": "dp_sgd"}, "one of medfl's own"),
    ({"unit": "patient"}, "unit 'patient'"),
    ({"sample_rate": 0.0}, "sample_rate 0.0 of client 0"),
    ({"steps": {"0": 3}}, "for client 1"),
    ({"delta": 1.0}, r"delta 1.0 in \(0, 1\)"),
    ({"accountant": "moments"}, "accountant 'moments'"),
])
def test_a_bad_declaration_is_refused_before_training(tiny_fl: dict, resolve: Any, declare: dict, match: str
                                                      ) -> None:
    from contract_methods import methods_registered

    with methods_registered(_dp_fedavg(declare=declare), name="dp-fedavg-test"):
        with pytest.raises(PrivacyConfigError, match=r"method 'test_dp_fedavg''s own_dp\(\).*" + match):
            run_experiment(resolve(_fl(tiny_fl)))
    assert not list(Path(tiny_fl["output_dir"]).rglob("privacy.csv"))


def test_a_sites_privacy_policy_counts_the_methods_own_dp() -> None:
    """A site's policy (medfl.policy) computes the epsilon of a method's own DP itself, from
    the approved method's declaration and the site's own training-set size."""
    from contract_methods import methods_registered

    from medfl.policy import PolicyRefusal, SitePolicy
    from medfl.privacy.accounting import epsilon_spent

    ctl = {"method": {"name": "test_dp_fedavg"}, "filters": [], "client": "0", "seed": 0, "releases": 3,
           "train": {"batch_size": 8, "epochs": 1}, "model": {"name": "two_block_cnn", "num_classes": 2}}
    # 40 examples in batches of 8: 5 steps per update at sample rate 1/5, 3 updates, sigma 1.2 (at delta
    # 1e-3, which the site accepts)
    eps = epsilon_spent([(1.2, 0.2, 15)], 1e-3)
    with methods_registered(_dp_fedavg(), name="dp-fedavg-test"):
        SitePolicy(max_epsilon=eps + 1e-6, max_delta=1e-3).check(ctl, lambda: 40)
        with pytest.raises(PolicyRefusal, match=rf"rule max_epsilon: the run spends epsilon {eps:.4g} "
                                                r".*dp_fedavg_opacus_sgd over 3"):
            SitePolicy(max_epsilon=eps - 0.01, max_delta=1e-3).check(ctl, lambda: 40)
        with pytest.raises(PolicyRefusal, match=r"rule min_noise_multiplier: dp_fedavg_opacus_sgd adds noise "
                                                r"multiplier 1.2"):
            SitePolicy(min_noise_multiplier=2.0, max_delta=1e-3).check(ctl, lambda: 40)


def test_a_methods_own_dp_gets_the_engines_noise_to_signal_rows(tiny_fl: dict, resolve: Any) -> None:
    """Issue 48, item 7: the engine writes the noise against the clipped signal of the
    method's declared DP too, from the declaration and the steps the clients report."""
    from contract_methods import methods_registered
    from medfl.filters import trainable_count
    from medfl.privacy.signal import noise_to_signal

    fl = {**_fl(tiny_fl), "rounds": 1}
    with methods_registered(_dp_fedavg(), name="dp-fedavg-test"):
        out = run_experiment(resolve(fl))
    run = Path(out["dir"]) / "test_dp_fedavg"
    cfg = json.loads((run / "config.json").read_text())["privacy"]["dp_fedavg_opacus_sgd"]
    tm = pd.read_csv(run / "train_metrics.csv", dtype={"client_id": str}).set_index("client_id")
    mech = pd.read_csv(run / "mechanisms.csv", dtype={"id": str})
    mech = mech[mech["mechanism"] == "dp_fedavg_opacus_sgd"].set_index(["scope", "id", "name"])["value"]
    d = trainable_count({"name": "two_block_cnn", "spatial_dims": 2, "in_channels": 1, "num_classes": 2})
    steps, batches = [], []
    for cid, q in cfg["sample_rate"].items():
        t, b = float(cfg["steps_per_update"][cid]), q * int(tm.loc[cid, "num_examples"])
        assert mech["client", cid, "steps"] == t and mech["client", cid, "expected_batch"] == pytest.approx(b)
        assert mech["client", cid, "noise_to_signal"] == pytest.approx(noise_to_signal(d, [1.2], [t], [b]))
        steps.append(t), batches.append(b)
    assert mech["round", "mean", "clients"] == 3
    assert mech["round", "mean", "noise_to_signal"] == pytest.approx(noise_to_signal(d, [1.2] * 3, steps, batches))
