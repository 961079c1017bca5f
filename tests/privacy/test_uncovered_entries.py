"""No clear entry beside a noised model (issue 49, item 3).

The audit's outside SCAFFOLD variant replied ``model`` and ``delta_c`` under ``dp_gaussian``:
``delta_c`` gave each client's trained parameters to 1.5e-9 while ``summary.json``, ``medfl
runs`` and the site policy all said epsilon 3; only ``not_covered`` named the entry. Now a
reply entry beside the noised model that no mechanism covers (the method's ``reply_keys``
beyond its ``reply_state``) stops the run before anything is sent, unless the config opts in
(``fl.uncovered_entries: {"under_dp": "send_in_clear"}``), and then the run says it is not
private everywhere it prints its privacy; a site with an epsilon cap refuses such a reply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from medfl.config import ConfigError
from medfl.experiment import run_experiment
from medfl.hub import HubAndSpoke
from medfl.messages import Instruction, Reply

DP = [{"name": "dp_gaussian", "epsilon": 3.0, "clip": 1.0}]
OPT_IN = {"under_dp": "send_in_clear"}


class ScaffoldLike(HubAndSpoke):
    """An outside SCAFFOLD variant as the audit wrote it: the model under ``reply_state``
    (so ``dp_gaussian`` clips and noises it) and the control variate's change ``delta_c``
    beside it, which no filter touches."""

    name = "test_scaffold_like"

    def reply_keys(self, instruction: Instruction) -> frozenset[str]:
        return super().reply_keys(instruction) | {"delta_c"}

    def client_update(self, client: Any, instruction: Instruction) -> Reply:
        reply = super().client_update(client, instruction)
        sent = instruction.payload["model"]
        reply.payload["delta_c"] = {k: (v.float() - sent[k].float()) for k, v in reply.payload["model"].items()
                                    if torch.is_floating_point(v)}
        return reply


def _fl(tiny_fl: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {**tiny_fl, "rounds": 1, "methods": [{"name": "test_scaffold_like"}], "filters": DP, **extra}


def test_an_entry_beside_the_noised_model_stops_the_run_before_anything_is_sent(tiny_fl: dict, resolve: Any) -> None:
    from contract_methods import methods_registered

    with methods_registered(ScaffoldLike, name="scaffold-like-test"):
        with pytest.raises(ConfigError, match=r"method 'test_scaffold_like' replies \['delta_c'\] beside its model "
                                              r"state \['model'\] under differential privacy, and no mechanism covers "
                                              r"them.*fl.uncovered_entries \{\"under_dp\": \"send_in_clear\"\}"):
            resolve(_fl(tiny_fl))
        # FedKPer's score is such an entry too
        with pytest.raises(ConfigError, match=r"method 'fedkper' replies \['score'\]"):
            resolve({**tiny_fl, "methods": [{"name": "fedkper"}], "filters": DP})
        with pytest.raises(ConfigError, match=r"fl.uncovered_entries.under_dp: expected one of 'refuse', "
                                              r"'send_in_clear'"):
            resolve(_fl(tiny_fl, uncovered_entries={"under_dp": "yes"}))
    assert not list(Path(tiny_fl["output_dir"]).rglob("metrics.csv"))


def test_with_the_opt_in_the_run_says_it_is_not_private_everywhere(tiny_fl: dict, resolve: Any,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    from contract_methods import methods_registered
    from medfl.cli import main
    from medfl.report import _privacy_line

    with methods_registered(ScaffoldLike, name="scaffold-like-test"):
        out = run_experiment(resolve(_fl(tiny_fl, uncovered_entries=OPT_IN)))
    run = Path(out["dir"]) / "test_scaffold_like"
    summary = json.loads((run / "summary.json").read_text())["privacy"]
    config = json.loads((run / "config.json").read_text())["privacy"]
    what = ("reply entries ['delta_c'] of method 'test_scaffold_like': beside its noised model, in the clear "
            "(no DP covers them)")
    assert summary["private"] is False and summary["epsilon"] is None and summary["sent_in_clear"] == [what]
    assert config["private"] is False and what in config["sent_in_clear"]
    assert summary["mechanisms"]["dp_gaussian"]["epsilon"] > 0        # what the release alone spent
    assert "NOT private" in _privacy_line({"privacy": summary})
    capsys.readouterr()
    assert main(["runs", str(Path(tiny_fl["output_dir"]))]) == 0
    row = [line.split() for line in capsys.readouterr().out.splitlines() if "test_scaffold_like" in line][0]
    assert row[7] == "inf", row        # the epsilon column (the headline is two words): not private, as comparison.csv says


def test_without_dp_on_the_model_the_entries_are_nothing_to_refuse(tiny_fl: dict, resolve: Any) -> None:
    from contract_methods import methods_registered

    with methods_registered(ScaffoldLike, name="scaffold-like-test"):
        resolve({**_fl(tiny_fl), "filters": [{"name": "quantize", "bits": 8}]})
