"""Robust aggregation (issue 19): coordinate median and trimmed mean by hand, and FedAvg with
either keeps a site that scales its weights by 1e6 from taking over the global model (the
mean was dragged to abs-max 466432 in the probe)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch

from medfl.config import resolve_config
from medfl.engine.runner import Run
from medfl.experiment import run_experiment
from medfl.training import coordinate_median, trimmed_mean


def test_median_and_trimmed_mean_by_hand() -> None:
    states = [{"w": torch.tensor([1.0, 10.0]), "n": torch.tensor(1)},
              {"w": torch.tensor([2.0, 20.0]), "n": torch.tensor(2)},
              {"w": torch.tensor([3.0, 1e6]), "n": torch.tensor(3)},
              {"w": torch.tensor([4.0, 40.0]), "n": torch.tensor(8)}]
    med = coordinate_median(states)
    torch.testing.assert_close(med["w"], torch.tensor([2.5, 30.0]))     # mean of the two middle values
    assert int(med["n"]) == 2                                             # integers: the lower middle value
    tm = trimmed_mean(states, 0.25)                                      # drop 1 at each end
    torch.testing.assert_close(tm["w"], torch.tensor([2.5, 30.0]))
    torch.testing.assert_close(trimmed_mean(states, 0.0)["w"], torch.tensor([2.5, 250017.5]))
    with pytest.raises(ValueError, match="trim must be in"):
        trimmed_mean(states, 0.5)


class _Scaled(Run):
    """Client 1 sends its model scaled by 1e6 (finite, well-formed: only robust rules help)."""

    def update_clients(self, r, instructions):  # type: ignore[no-untyped-def]
        replies = super().update_clients(r, instructions)
        if "1" in replies:
            replies["1"].payload["model"] = {k: v * 1e6 if v.is_floating_point() else v
                                             for k, v in replies["1"].payload["model"].items()}
        return replies


@pytest.mark.parametrize("aggregation", ["median", "trimmed_mean"])
def test_a_scaled_site_does_not_take_over_a_robust_fedavg(tiny_fl, aggregation) -> None:
    # the update-norm bound off: the robust rules alone keep the scaled site out
    job = dict(tiny_fl, num_clients=5, rounds=2, partition={"name": "iid"}, update_norm_factor=0,
               methods=[{"name": "fedavg", "label": "mean"},
                        {"name": "fedavg", "label": "robust", "aggregation": aggregation, "trim": 0.2}])
    out = Path(run_experiment(resolve_config(job), run_factory=_Scaled)["dir"])
    ckpt = {label: torch.load(sorted((out / label / "checkpoints").glob("*.pt"))[-1], weights_only=True)
            for label in ("mean", "robust")}
    biggest = {label: max(float(v.abs().max()) for v in c["method"]["global"].values() if v.is_floating_point())
               for label, c in ckpt.items()}
    assert biggest["mean"] > 1e4 and biggest["robust"] < 100
    acc = pd.read_csv(out / "comparison.csv").set_index("method")
    assert "robust" in acc.index


def test_the_update_norm_bound_keeps_a_scaled_site_out_of_the_plain_mean(tiny_fl) -> None:
    """Issue 39, 6b: weights x1e6 passed FedAvg's mean (abs-max above 1e4 in the global model).
    With ``fl.update_norm_factor`` (default 10) the scaled reply's update is 1e5 times the
    median's: it is dropped every round (reply_events.csv), the global model stays in range,
    and the other sites' numbers are those of a run where site 1 is silent."""
    job = dict(tiny_fl, num_clients=5, rounds=2, partition={"name": "iid"})
    out = Path(run_experiment(resolve_config(job), run_factory=_Scaled)["dir"]) / "fedavg"
    ckpt = torch.load(sorted((out / "checkpoints").glob("*.pt"))[-1], weights_only=True)
    assert max(float(v.abs().max()) for v in ckpt["method"]["global"].values() if v.is_floating_point()) < 100
    events = pd.read_csv(out / "reply_events.csv", dtype={"client_id": str})
    assert events[["round", "client_id", "status"]].values.tolist() == [[1, "1", "dropped"], [2, "1", "dropped"]]
    assert events["reason"].str.contains("is above the bound").all()
