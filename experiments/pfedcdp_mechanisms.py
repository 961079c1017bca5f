#!/usr/bin/env python
"""PFedCDP's mechanisms acting, in minutes: a few rounds on the CBIS-DDSM / MIAS fixtures of
``experiments/pfedcdp_compare.py`` (lesion crops, Dirichlet 0.5), four arms that share the
partition, the capability clusters, the initialisations and the authors' training recipe
(``"preset": "authors_formula"``: 5 local epochs, Adam 1e-3, batch 64, KD T 3 and lambda 0.3):

``nodp``
    no noise (``noise_multiplier`` null), the update quantized to 8 bits (eq. 14);
``nodp_weights``
    the same with the weights quantized instead (``quantize: "weights"``, medfl's old default);
``authors_formula``
    the authors' sigma formula at the paper's epsilon: sigma 0.969 added to every cluster's
    update every round (the run records the epsilon it spends);
``authors_v1_7``
    PFedCDP's ``authors`` preset, the authors' v1.7 clients as they run: model B's weights
    clipped per tensor and noised at sigma 0.606, 12 bits; A and C in the clear;
``paper_dp``
    the paper's: epsilon 5 over the run (sigma from the accountant for the planned rounds).

What it shows, per arm, from each run's own files: the personalized models' mean local test
accuracy per round (``metrics.csv``), the worst client's epsilon (``privacy.csv``), the noise
in each cluster's averaged update against the largest clipped update and quantization's error
against the update (``mechanisms.csv``), the clients' share of own weights above 1 in
magnitude, the largest training loss and the warnings (``summary.json``). Not a comparison of
methods: the evidence experiments (many seeds, best-validation rounds) are another script.

    python experiments/pfedcdp_mechanisms.py [--rounds 3] [--clients 10] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

import pfedcdp_compare as compare  # noqa: E402  (the fixtures and the run config are that script's)

#: label -> the method entry's own keys on top of its preset (``"authors_formula"``, or
#: :data:`ARM_PRESETS`)
ARMS: dict[str, dict[str, Any]] = {
    "nodp": {"noise_multiplier": None},
    "nodp_weights": {"noise_multiplier": None, "quantize": "weights"},
    "authors_formula": {},
    "authors_v1_7": {},
    "paper_dp": {"noise_multiplier": None, "epsilon": 5.0},
}
ARM_PRESETS = {"authors_v1_7": "authors_v1_7"}


def entries(a: argparse.Namespace, labels: list[str]) -> list[dict[str, Any]]:
    """The method entries of the arms ``labels``: the authors' preset, the arm's keys, the quick settings."""
    quick = {"capabilities": "draw", "feature_shap": "off", "supcon_views": 1, "refine_epochs": a.refine_epochs}
    return [{"name": "pfedcdp", "preset": ARM_PRESETS.get(label, "authors_formula"), "label": label, **quick,
             **ARMS[label]} for label in labels]


def read(run: Path) -> dict[str, Any]:
    """One arm's figures from its run directory."""
    import pandas as pd

    summary = json.loads((run / "summary.json").read_text())
    metrics = pd.read_csv(run / "metrics.csv")
    local = metrics[metrics["split"] == "local_test"].groupby("round")["accuracy"].mean()
    train = pd.read_csv(run / "train_metrics.csv")
    mech = pd.read_csv(run / "mechanisms.csv", dtype={"id": str, "text": str}, keep_default_na=False,
                       na_values=[""])

    def per_cluster(mechanism: str, name: str, r: int) -> dict[str, float]:
        part = mech[(mech["mechanism"] == mechanism) & (mech["name"] == name) & (mech["round"] == r)]
        return {str(k): round(float(v), 4) for k, v in zip(part["id"], part["value"])}

    last = int(metrics["round"].max())
    above = train.groupby("round")["above_one"].mean()
    privacy = summary.get("privacy") or {}
    return {
        "local_test_accuracy_by_round": {int(r): round(float(v), 4) for r, v in local.items()},
        "epsilon": privacy.get("epsilon") if privacy.get("private") else None,
        "sigma": summary["method_report"]["mechanisms"]["dp"]["sigma_per_round"],
        "noise_to_update_min_round1": per_cluster("dp_noise", "noise_to_update_min", 1),
        "quantization_error_to_update_round1": per_cluster("quantization", "error_to_update", 1),
        "quantization_error_norm_round1": per_cluster("quantization", "error_norm", 1),
        "update_norm_round1": per_cluster("quantization", "update_norm", 1),
        "above_one_by_round": {int(r): round(float(v), 4) for r, v in above.items()},
        "max_train_loss": float(train["loss"].max()),
        "last_round": last,
        "warnings": [w["warning"][:90] for w in summary.get("warnings", [])],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "pfedcdp_mechanisms")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cbis-cases", type=int, default=400)
    p.add_argument("--mias-cases", type=int, default=300)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--refine-epochs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--smoke", action="store_true",
                   help="the test suite's run (tests/test_experiments.py): 300 CBIS-DDSM and 120 MIAS fixture "
                   "images at 16 px, 4 clients, 2 rounds, arms nodp and authors_v1_7, no refinement; it checks that "
                   "the script runs, its numbers are no evidence")
    a = p.parse_args(argv)
    labels = list(ARMS)
    if a.smoke:
        a.cbis_cases, a.mias_cases, a.image_size, a.clients, a.rounds, a.refine_epochs = 300, 120, 16, 4, 2, 0
        labels = ["nodp", "authors_v1_7"]
    a.out = a.out.resolve()
    a.out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("MEDFL_NO_PROGRESS", "1")
    import torch

    torch.set_num_threads(a.threads)
    from medfl.config import resolve_config
    from medfl.experiment import run_experiment

    # the compare script's data and run config (its arms replaced by these)
    c = argparse.Namespace(out=a.out, cbis_dir=None, mias_dir=None, cbis_cases=a.cbis_cases, mias_cases=a.mias_cases,
                           fixture_seed=0, test_ratio=1 / 3, image_size=a.image_size, roi=True, rounds=a.rounds,
                           epochs=1, batch_size=16, optimizer="sgd", lr=0.01, refine_epochs=a.refine_epochs,
                           min_size=None, arms=None)
    cbis, mias, info = compare.prepare_data(c)
    fl = compare.fl_config(c, cbis, mias, a.clients, a.seed)
    fl.update(name=f"mech_c{a.clients}_seed{a.seed}", methods=entries(a, labels), eval_splits=["test"], overwrite=True)
    t0 = time.perf_counter()
    exp = Path(run_experiment(resolve_config(fl))["dir"])
    results = {label: read(exp / label) for label in labels}
    results["_settings"] = {"rounds": a.rounds, "clients": a.clients, "seed": a.seed, "data": info,
                            "wall_s": round(time.perf_counter() - t0, 1),
                            "command": " ".join(["python experiments/pfedcdp_mechanisms.py", *(argv or sys.argv[1:])])}
    (a.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    print(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
