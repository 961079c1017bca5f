#!/usr/bin/env python
"""FedTPF, FedFed and FedAvg on the MedMNIST (PathMNIST) fixture under the paper's non-IID
splits and participation rates, FedTPF's ablations, and the privacy side: the epsilon each
run recorded and the size of the released features ``x_s`` against the raw images ``x``.

Arms (method entries; every arm of one setting shares the split and the task model's
initialisation):

``fedtpf``            the paper's method (prototypes, critic, stop condition, eq. 8-9 decay);
``fedfed``            the baseline it extends (VAE + noised-residual classifier, plain FedAvg);
``fedavg``            no shared set;
ablations (``--ablations``, on the first setting only): ``fedtpf_noproto`` (``lambda_proto``
0), ``fedtpf_nodecay`` (``decay`` off), ``fedtpf_nocritic`` (``lambda_wgan`` 0) and
``fedtpf_nonoise`` (``epsilon`` null: the release is clipped, not noised; a measurement,
flagged non-private in its ``privacy.csv`` and here), and a control, ``fedtpf_labelsonly``
(clip 1e-6: the shared features are all but zero, so the shared set carries only its labels:
what the labels alone buy).

Settings: ``--splits`` among ``dirichlet_0.1``, ``dirichlet_0.3``, ``dirichlet_1.0``,
``label_skew_2`` (#C=2) and ``subset`` (90 % of each client's data from one class) at
participation ``--participation`` (0.4), and ``--sweep`` participation rates (0.1 0.4 0.8)
on ``dirichlet_0.1`` as the paper's Fig. 4 does. Data: the PathMNIST fixture
(``medfl.fixtures``, the official npz layout; ``--cases`` tiles over train/val/test)
prepared by ``data_prep/medmnist.py``; the official test split is the global test set.
Model: ``small_cnn`` (``--width``) at 28 x 28, SGD ``--lr`` batch 32, ``--rounds`` rounds of
one epoch, stage 1 capped at ``--distill-rounds``, at least ``--distill-steps`` distillation
steps per client and round; 9 clients (every class dominates one in ``subset``). The release:
the DP one at ``--epsilon`` and ``--clip`` (a number, or ``public_quantile`` with ``--public N``
fixture tiles of another seed as ``fl.public_dataset``), or the paper's ``--noise-variance``
(not private); ``--mix`` fixes stage 2's share of shared samples per batch; ``--paper`` adds
FedTPF's ``"paper"`` preset as an arm. The table has what each run's mechanisms did: clients
that met the stop condition and that reached the cap, the smallest eq. 8 weight, the
residual classifier's last accuracy on ``x_s`` and ``x_p``, the release's noise-to-signal.

The privacy-utility claim (section III-E): after each FedTPF run, the final global
distillation model (from the last checkpoint) is applied to all training tiles, and
:func:`medfl.privacy.feature_release.noise_comparison` gives, at the run's epsilon, the
Gaussian noise std one release needs when the clip follows the 95th percentile of the
per-sample norms of ``x_s`` against ``x``; the ratio of the two is what the paper's argument
rests on.

Writes to ``--out`` (default ``experiments/results/fedtpf/``): ``table.md`` (printed too),
``table.csv``, ``noise.csv`` and each setting's experiment under ``runs/``.

    python experiments/fedtpf_compare.py [--splits dirichlet_0.1 subset] [--rounds 12] [--ablations] [--sweep 0.1 0.8]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from medfl.config import resolve_config
from medfl.experiment import run_experiment
from medfl.fixtures import generate

ROOT = Path(__file__).resolve().parents[1]
SPLITS: dict[str, dict[str, Any]] = {
    "dirichlet_0.1": {"name": "dirichlet", "alpha": 0.1, "min_size": 5, "max_retries": 2000},
    "dirichlet_0.3": {"name": "dirichlet", "alpha": 0.3, "min_size": 5, "max_retries": 2000},
    "dirichlet_1.0": {"name": "dirichlet", "alpha": 1.0, "min_size": 5},
    "label_skew_2": {"name": "label_skew", "k": 2},
    "subset": {"name": "subset", "share": 0.9},
}


def arms(a: argparse.Namespace, ablations: bool) -> list[dict[str, Any]]:
    """The method entries of one setting."""
    common: dict[str, Any] = {"distill_rounds": a.distill_rounds, "epsilon": a.epsilon, "clip": a.clip,
                              "distill_epochs": 1, "distill_steps": a.distill_steps, "mix": a.mix}
    if a.noise_variance is not None:
        common.update(noise={"variance": a.noise_variance}, epsilon=None)
    out = [{"name": "fedtpf", **common}, {"name": "fedfed", **common}, {"name": "fedavg"}]
    if a.paper:
        out.insert(1, {"name": "fedtpf", "label": "fedtpf_paper", "preset": "paper",
                       "distill_rounds": a.distill_rounds})
    if ablations:
        out += [{"name": "fedtpf", "label": "fedtpf_noproto", **common, "lambda_proto": 0.0},
                {"name": "fedtpf", "label": "fedtpf_nodecay", **common, "decay": False},
                {"name": "fedtpf", "label": "fedtpf_nocritic", **common, "lambda_wgan": 0.0},
                {"name": "fedtpf", "label": "fedtpf_nonoise", **common, "epsilon": None},
                {"name": "fedtpf", "label": "fedtpf_labelsonly", **{**common, "clip": 1e-6, "noise": None,
                                                                       "epsilon": a.epsilon}}]
    return out


def _clip(text: str) -> float | str:
    return text if text == "public_quantile" else float(text)


def _fixture(a: argparse.Namespace, name: str, cases: int, seed: int, texture: float = 0.0,
             texture_period: float = 3.0) -> Path:
    """Generate and prepare ``cases`` PathMNIST fixture tiles of ``seed`` once, as ``name``;
    ``texture`` > 0 adds the fixture's class-oriented grating (:func:`medfl.fixtures.medmnist.generate`)."""
    if texture:
        name = f"{name}_texture{texture:g}p{texture_period:g}"
    out = a.out / "data" / f"{name}_{cases}"
    if not (out / "manifest.csv").is_file():
        from medfl.prep.medmnist import main as prep

        raw = a.out / "data" / f"{name}_raw"
        generate("medmnist", raw, cases=cases, seed=seed, flag="pathmnist", texture=texture,
                 texture_period=texture_period)
        assert prep(["--raw", str(raw), "--out", str(out), "--flag", "pathmnist", "--overwrite"]) == 0
    return out


def prepare_public(a: argparse.Namespace) -> Path:
    """A public set for ``clip public_quantile``: ``--public`` fixture tiles of another seed."""
    return _fixture(a, "public", a.public, 7)


def prepare(a: argparse.Namespace) -> Path:
    """Generate and prepare the PathMNIST fixture once."""
    return _fixture(a, "pathmnist", a.cases, 0)


def noise_needed(run: Path, data: Path, epsilon: float) -> dict[str, float]:
    """:func:`noise_comparison` on every training tile of the run with its final global
    distillation model (the last checkpoint's coordinator state)."""
    from medfl.models.feature_distill import DistillVAE
    from medfl.privacy.feature_release import noise_comparison

    ckpt = sorted((run / "checkpoints").glob("round_*.pt"))[-1]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["method"]["distill"]
    vae_state = {k[4:]: v for k, v in state.items() if k.startswith("vae.")}
    cfg = json.loads((run / "config.json").read_text())
    entry = cfg["method"] if "method" in cfg else {}
    vae = DistillVAE(3, int(vae_state["mu.weight"].shape[0]), 2, width=int(entry.get("vae_width", 16)),
                     grid=int(entry.get("vae_grid", 4)))
    vae.load_state_dict(vae_state)
    vae.eval()
    manifest = pd.read_csv(data / "manifest.csv", keep_default_na=False)
    part = pd.read_csv(run / "partition.csv", keep_default_na=False)
    rows = manifest.iloc[part.loc[part["role"] == "train", "row"].to_numpy()]
    import numpy as np

    x = torch.stack([torch.from_numpy(np.load(data / p)).float() for p in rows["path"]])
    with torch.no_grad():
        mu, _ = vae.encode(x)
        x_s = x - vae.decode(mu, tuple(x.shape[2:]))
    return noise_comparison(x, x_s, epsilon=epsilon)


def main(argv: list[str] | None = None) -> int:
    """Run every setting, print and write the tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--splits", nargs="+", choices=list(SPLITS), default=list(SPLITS))
    p.add_argument("--participation", type=float, default=0.4)
    p.add_argument("--sweep", nargs="*", type=float, default=[], metavar="C",
                   help="also run these participation rates on dirichlet_0.1 (paper: 0.1 0.4 0.8)")
    p.add_argument("--ablations", action="store_true", help="FedTPF's four ablations on the first split")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--distill-rounds", type=int, default=5)
    p.add_argument("--epsilon", type=float, default=8.0)
    p.add_argument("--clip", type=_clip, default=5.0, help="a number, or public_quantile (needs --public)")
    p.add_argument("--noise-variance", type=float, default=None,
                   help="the paper's noise on unclipped x_s instead of the DP release (0.15, 0.2, 0.25)")
    p.add_argument("--distill-steps", type=int, default=60, help="at least this many distillation steps a round")
    p.add_argument("--mix", type=float, default=None, help="share of shared samples in each stage-2 batch")
    p.add_argument("--paper", action="store_true", help="also run FedTPF's 'paper' preset")
    p.add_argument("--public", type=int, default=0, metavar="N",
                   help="a public set of N more fixture tiles (another seed) for clip public_quantile")
    p.add_argument("--cases", type=int, default=1800, help="fixture tiles over train/val/test (default 1800)")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "fedtpf")
    p.add_argument("--smoke", action="store_true",
                   help="the test suite's run (tests/test_experiments.py): dirichlet_1.0, 450 tiles, width 4, 2 "
                   "rounds with stage 1 capped at 1, 2 distillation steps, fedtpf and fedavg; it checks that "
                   "the script runs, its numbers are no evidence")
    a = p.parse_args(argv)
    if a.smoke:
        a.splits, a.sweep, a.ablations, a.cases, a.width = ["dirichlet_1.0"], [], False, 450, 4
        a.rounds, a.distill_rounds, a.distill_steps = 2, 1, 2
    os.environ.setdefault("MEDFL_NO_PROGRESS", "1")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    a.out.mkdir(parents=True, exist_ok=True)
    data = prepare(a)
    settings = [(s, a.participation, a.ablations and i == 0) for i, s in enumerate(a.splits)]
    settings += [("dirichlet_0.1", c, False) for c in a.sweep if c != a.participation or "dirichlet_0.1" not in a.splits]
    rows, noise_rows, started = [], [], time.time()
    for split, c, ablate in settings:
        name = f"{split}_c{c}"
        fl = {"name": name, "output_dir": str(a.out / "runs"), "seed": a.seed, "rounds": a.rounds,
              "num_clients": 9, "fraction": c, "progress": False, "overwrite": True, "eval_every": 0,
              "dataset": {"name": "manifest", "path": str(data / "manifest.csv"), "column": "path",
                          "num_classes": 9, "cache": "memory"},
              "partition": SPLITS[split], "client_split": {"train": 0.85, "val": 0.15},
              "eval_splits": ["val", "global_test"], "model": {"name": "small_cnn", "width": a.width},
              "train": {"epochs": 1, "batch_size": 32, "eval_batch_size": 256, "lr": a.lr},
              "methods": [m for m in arms(a, ablate) if not (a.smoke and m["name"] == "fedfed")]}
        if a.public:
            fl["public_dataset"] = {"name": "manifest", "path": str(prepare_public(a) / "manifest.csv"),
                                    "column": "path", "num_classes": 9, "cache": "memory"}
        t0 = time.time()
        result = run_experiment(resolve_config(fl))
        print(f"{name}: {time.time() - t0:.0f} s", flush=True)
        for arm in fl["methods"]:
            label = str(arm.get("label", arm["name"]))
            run = Path(result["dir"]) / label
            summary = json.loads((run / "summary.json").read_text())
            acc = summary["final"]["global_test"]["accuracy"]["mean"]
            priv = summary["privacy"]
            rep = summary.get("method_report", {})
            release = rep.get("release", {})
            stops = rep.get("stop_rounds", {})
            stop = rep.get("stop_condition", {})
            row = {"split": split, "participation": c, "method": label, "global_test_accuracy": round(acc, 4),
                   "epsilon": (None if not priv.get("mechanisms") else priv.get("epsilon")),
                   "private": priv.get("private"),
                   "stage1_rounds": rep.get("transition", {}).get("after_round"),
                   "stopped": sum(1 for v in stops.values() if isinstance(v, int)),
                   "capped": sum(1 for v in stops.values() if v == "cap"),
                   "min_alpha": rep.get("decay", {}).get("min_alpha"),
                   "acc_x_s": stop.get("residual_accuracy_x_s_last_mean"),
                   "acc_x_p": stop.get("residual_accuracy_x_p_last_mean"),
                   "noise_to_signal": release.get("noise_to_signal"), "clip": release.get("clip"),
                   "x_s_to_x_norm": release.get("x_s_to_x_norm"), "clipped_fraction": release.get("clipped_fraction"),
                   "warnings": len(summary.get("warnings", []))}
            rows.append(row)
            if arm["name"] == "fedtpf" and arm.get("epsilon") is not None and arm.get("noise") is None:
                n = noise_needed(run, data, float(a.epsilon))
                noise_rows.append({"split": split, "participation": c, "method": label, **n,
                                   "noise_ratio_x_s_over_x": n["x_s_noise_std"] / n["x_noise_std"]})
    table = pd.DataFrame(rows)
    table.to_csv(a.out / "table.csv", index=False)
    noise = pd.DataFrame(noise_rows)
    noise.to_csv(a.out / "noise.csv", index=False)
    lines = [f"# FedTPF on the PathMNIST fixture ({a.cases} tiles, 9 clients, small_cnn width {a.width}, "
             f"{a.rounds} rounds, stage 1 <= {a.distill_rounds}, epsilon {a.epsilon}, clip {a.clip}, seed {a.seed}; "
             f"{time.time() - started:.0f} s)", "", table.to_string(index=False), "", "## Noise one release needs at the same epsilon (clip = q95 of norms)",
             "", noise.to_string(index=False) if len(noise) else "(none)"]
    text = "\n".join(lines) + "\n"
    (a.out / "table.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
