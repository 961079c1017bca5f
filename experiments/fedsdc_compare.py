#!/usr/bin/env python
"""FedSDC, FedSDC+, the ablations M1-M3 and six baselines on the HAM10000 and Derm7pt
fixtures under FedSDC's two non-IID splits (the paper's Tables 1 and 2), micro-F1 mean ± std
over seeds, and what the ensemble costs at test time.

Arms (method entries; every arm of one setting and seed shares the split and the body's
initialisation):

``fedsdc``            both switches on, majority vote over all N heads (the paper's FedSDC);
``fedsdc_plus``       FedSDC+: the top ``gamma`` = 0.3 of the heads by the clients' validation micro-F1;
``m1_nodiv_noshuf``   Table 2's M1: every head ``embed_dim`` wide, each client keeps its head;
``m2_div_noshuf``     Table 2's M2 (as its table prints it: Diversity on, Shuffle off);
``m3_nodiv_shuf``     Table 2's M3 (Diversity off, Shuffle on). The paper's text says the
                      opposite of its table for M2/M3 ("introducing the Shuffle feature in
                      Model M2"); we follow the table;
``fedavgm`` (beta 0.5, the body's momentum), ``fedadam``, ``fedyogi``, ``fedadagrad``,
``fedprox`` (mu 0.01) and ``feddisco``.

Named with ``--arms`` only (``OPTION_ARMS``): issue 37's readings against medfl's defaults:
``sdc_lowest_nofloor`` (FedSDC as before issue 37: ties to the lowest class, heads
``rho x embed_dim`` wide), ``sdc_meanprob_nofloor``, ``sdc_lowest_floor64``, ``sdc_floor32``,
``sdc_floor128``, ``sdc_linear``, ``sdc_nodropout``, the FedSDC+ counterparts
``plus_lowest_nofloor``, ``plus_lowest``, ``plus_floor_keep_round``, ``plus_linear``, and the
presets ``sdc_preset_paper`` / ``sdc_preset_authors`` (with this script's lr and batch).
Every FedSDC run writes ``mechanisms.csv`` (per-head validation accuracy, the vote's tie and
disagreement rates).

Settings (``--settings``):

``ham10000_niid1``  ``global_test_per_class`` k per class held out (paper: 30; here
                    ``--ham-k``, 30), the rest Dirichlet(5.0) over 5 clients;
``ham10000_niid2``  ``class_sample``: each of 5 clients takes 5-6 classes and 20-60 images of
                    each (scaled down to ``--per-class`` for the fixture), the rest is the
                    global test set. The paper builds NIID-2 from three white-blood-cell
                    datasets (5 clients each), not from HAM10000; we apply its rule to HAM10000
                    and Derm7pt because those are the skin datasets medfl reads;
``derm7pt_niid1`` / ``derm7pt_niid2``  the same on Derm7pt (5 classes: NIID-1 holds out
                    ``--derm-k`` per class (the fixture's rarest class is small), NIID-2 draws
                    3-4 classes per client, because 5-6 of 5 would be no label skew at all);
                    Derm7pt's official split is ignored (``use_official_split`` false) so
                    both splits are FedSDC's.

Data: fixtures in the real raw layouts (``medfl.fixtures``), prepared by ``data_prep`` at
``--image-size`` (32); each client keeps 15 % of its rows as ``val`` (FedSDC+ ranks heads
there) and the rest trains; the global test set scores every arm (``eval_splits``
``global_test``: micro-F1, which for one label per image equals accuracy). Model: the body is
``--model`` (``small_cnn`` width ``--width``; the paper's ResNet-50 is far beyond 2 CPU cores
for this many runs); SGD with the paper's NIID-1 settings (lr 1e-3 is too small to move a
randomly initialised small CNN in ``--rounds`` rounds of one epoch, so the default is
``--lr`` 0.05, batch 16: a deviation, stated in the table). ``--rounds`` 20 (paper: up to
1500 with early stopping; ``experiments/fedsdc_evidence.py`` runs FedSDC, FedSDC+ and FedAvgM
with ``fl.early_stopping`` and reports them at their best validation rounds). This script
reports the last round of every run (``seeds_results.csv``): a snapshot of how fast the arms
learn, not where they converge.

Ensemble cost: for the paper's body (ResNet-50 at 224 x 224, 2048-d embedding, five heads of
widths from the seeded rho) and for this experiment's body, the parameters and the measured
CPU forward time per image (median of ``--timing-repeats``) of: the plain model (body and
its own linear head, what the baselines evaluate), body + one FedSDC head, body + all N
heads (FedSDC), body + ceil(gamma N) heads (FedSDC+).

Writes to ``--out`` (default ``experiments/results/fedsdc/``): ``table.md`` (printed too),
``table.csv``, ``per_seed.csv``, ``ensemble_cost.csv``, and each setting's experiment under
``runs/<setting>/`` (``seeds_table.md``, ``seeds_metrics.png``, ``seed_<s>/<arm>/``).

    python experiments/fedsdc_compare.py [--seeds 0 1 2] [--rounds 20] [--settings ham10000_niid1 ...]
    # issue 37's quick check (per seed, ~5 min an arm on 2 busy cores):
    python experiments/fedsdc_compare.py --settings ham10000_niid1 --seeds 0 --rounds 15 --eval-every 15 \
        --timing-repeats 0 --arms sdc_lowest_nofloor fedsdc sdc_linear fedavgm plus_lowest fedsdc_plus
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from medfl.config import resolve_config
from medfl.experiment import run_experiment
from medfl.fixtures import generate

ROOT = Path(__file__).resolve().parents[1]

ARMS: list[dict[str, Any]] = [
    {"name": "fedsdc"},
    {"name": "fedsdc", "label": "fedsdc_plus", "gamma": 0.3},
    {"name": "fedsdc", "label": "m1_nodiv_noshuf", "diversity": False, "shuffle": False},
    {"name": "fedsdc", "label": "m2_div_noshuf", "diversity": True, "shuffle": False},
    {"name": "fedsdc", "label": "m3_nodiv_shuf", "diversity": False, "shuffle": True},
    {"name": "fedavgm", "beta": 0.5},
    {"name": "fedadam"},
    {"name": "fedyogi"},
    {"name": "fedadagrad"},
    {"name": "fedprox", "mu": 0.01},
    {"name": "feddisco"},
]
#: Arms run only when named in ``--arms``: the readings of issue 37 (tie rule, head width and
#: kind, FedSDC+'s rounding) against medfl's defaults, and the method's presets.
OPTION_ARMS: list[dict[str, Any]] = [
    {"name": "fedsdc", "label": "sdc_lowest_nofloor", "tie_break": "lowest", "min_hidden": None},
    {"name": "fedsdc", "label": "sdc_meanprob_nofloor", "tie_break": "mean_probability", "min_hidden": None},
    {"name": "fedsdc", "label": "sdc_lowest_floor64", "tie_break": "lowest", "min_hidden": 64},
    {"name": "fedsdc", "label": "sdc_floor32", "min_hidden": 32},
    {"name": "fedsdc", "label": "sdc_floor128", "min_hidden": 128},
    {"name": "fedsdc", "label": "sdc_floor256", "min_hidden": 256},
    {"name": "fedsdc", "label": "sdc_floor512", "min_hidden": 512},
    {"name": "fedsdc", "label": "sdc_floor2048", "min_hidden": 2048},
    {"name": "fedsdc", "label": "sdc_linear", "head": "linear"},
    {"name": "fedsdc", "label": "sdc_nodropout", "dropout": 0.0},
    {"name": "fedsdc", "label": "plus_lowest_nofloor", "gamma": 0.3, "tie_break": "lowest", "min_hidden": None},
    {"name": "fedsdc", "label": "plus_lowest", "gamma": 0.3, "tie_break": "lowest"},
    {"name": "fedsdc", "label": "plus_floor128", "gamma": 0.3, "min_hidden": 128},
    {"name": "fedsdc", "label": "plus_lowest_floor128", "gamma": 0.3, "min_hidden": 128, "tie_break": "lowest"},
    {"name": "fedsdc", "label": "sdc_lowest_floor2048", "min_hidden": 2048, "tie_break": "lowest"},
    {"name": "fedsdc", "label": "plus_floor2048", "gamma": 0.3, "min_hidden": 2048},
    {"name": "fedsdc", "label": "plus_lowest_floor2048", "gamma": 0.3, "min_hidden": 2048, "tie_break": "lowest"},
    {"name": "fedsdc", "label": "plus_floor_keep_round", "gamma": 0.3, "keep_rounding": "round"},
    {"name": "fedsdc", "label": "plus_linear", "gamma": 0.3, "head": "linear"},
    {"name": "fedsdc", "label": "sdc_preset_paper", "preset": "paper", "train": {"lr": 0.05, "batch_size": 16}},
    {"name": "fedsdc", "label": "sdc_preset_authors", "preset": "authors",
     "train": {"lr": 0.05, "batch_size": 16, "epochs": 1}},
]
SETTINGS = ("ham10000_niid1", "ham10000_niid2", "derm7pt_niid1", "derm7pt_niid2")
#: The paper's Table 1 (NIID-1 column) and Table 2, micro-F1 %, for the printed comparison.
PAPER_NIID1 = {"fedavgm": "66.29 ± 1.63", "fedadam": "58.95 ± 1.89", "fedyogi": "62.00 ± 2.06",
               "fedadagrad": "65.24 ± 1.39", "fedprox": "63.71 ± 1.63", "feddisco": "65.91 ± 2.64",
               "fedsdc": "68.76 ± 0.99", "fedsdc_plus": "70.00 ± 1.12", "m1_nodiv_noshuf": "56.67 ± 0.96",
               "m2_div_noshuf": "57.62 ± 1.03", "m3_nodiv_shuf": "66.29 ± 1.70"}
PAPER_NIID2 = {"fedavgm": "89.52 ± 0.65", "fedadam": "88.52 ± 0.59", "fedyogi": "89.15 ± 1.09",
               "fedadagrad": "88.82 ± 0.51", "fedprox": "89.15 ± 1.09", "feddisco": "89.39 ± 0.76",
               "fedsdc": "91.37 ± 0.25", "fedsdc_plus": "91.41 ± 0.25"}


def label(arm: dict[str, Any]) -> str:
    """An arm's run-directory name."""
    return str(arm.get("label", arm["name"]))


def prepare(dataset: str, a: argparse.Namespace) -> Path:
    """Generate the fixture once and prepare it at ``--image-size``; return the prepared folder."""
    out = a.out / "data" / f"{dataset}_{a.image_size}"
    if (out / "manifest.csv").is_file():
        return out
    raw = a.out / "data" / f"{dataset}_raw"
    if not raw.is_dir():
        generate(dataset, raw, cases=a.ham_cases if dataset == "ham10000" else a.derm_cases, seed=0,
                 reference=False)
    if dataset == "ham10000":
        from medfl.prep.ham10000 import main as prep

        args = ["--raw", str(raw), "--out", str(out), "--size", str(a.image_size)]
    else:
        from medfl.prep.derm7pt import main as prep

        args = ["--raw", str(raw), "--out", str(out), "--size", str(a.image_size), "--crop-border", "2"]
    assert prep(args) == 0
    return out


def setting_config(setting: str, data: Path, a: argparse.Namespace, arms: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``fl`` config of one setting (every arm, every seed)."""
    dataset, split = setting.split("_")
    classes = 7 if dataset == "ham10000" else 5
    fl: dict[str, Any] = {
        "name": setting, "output_dir": str(a.out / "runs"), "seeds": list(a.seeds), "rounds": a.rounds,
        "num_clients": 5, "progress": False, "overwrite": True, "eval_every": a.eval_every,
        "dataset": {"name": "manifest", "path": str(data / "manifest.csv"), "column": "path",
                    "num_classes": classes, "normalize": "zscore", "spatial_size": [a.image_size, a.image_size],
                    "cache": "memory"},
        "use_official_split": False, "group_column": "subject_id",
        "client_split": {"train": 0.85, "val": 0.15}, "eval_splits": ["global_test"],
        "model": {"name": a.model, "width": a.width},
        "train": {"epochs": 1, "batch_size": a.batch_size, "eval_batch_size": 128, "lr": a.lr,
                  "optimizer": "sgd", "momentum": a.momentum, "weight_decay": 0.0},
        "methods": arms,
    }
    if split == "niid1":
        fl["global_test_per_class"] = a.ham_k if dataset == "ham10000" else a.derm_k
        fl["partition"] = {"name": "dirichlet", "alpha": 5.0, "min_size": 10, "max_retries": 1000}
    else:
        fl["global_test_fraction"] = 0.0
        fl["partition"] = {"name": "class_sample", "classes": [5, 6] if classes == 7 else [3, 4],
                           "per_class": list(a.per_class)}
    return fl


def _forward_ms(models: list[torch.nn.Module], x: torch.Tensor, repeats: int) -> list[float]:
    """Median milliseconds per image of each ``model(x)`` (eval mode, no grad), the models
    timed in turn within each repeat so that drift on a shared machine hits all alike."""
    times: list[list[float]] = [[] for _ in models]
    with torch.no_grad():
        for m in models:
            m.eval()
            m(x)
            m(x)
        for _ in range(repeats):
            for i, m in enumerate(models):
                t = time.perf_counter()
                m(x)
                times[i].append(time.perf_counter() - t)
    return [1000 * statistics.median(t) / len(x) for t in times]


def ensemble_cost(name: str, spec: dict[str, Any], size: int, n_heads: int, gamma: float, seed: int,
                  batch: int, repeats: int) -> list[dict[str, Any]]:
    """Parameters and ms/image of the plain model, body + 1 head, FedSDC and FedSDC+."""
    from medfl.models.registry import build_model
    from medfl_plugins.fedsdc.models import HeadEnsemble, head_widths, make_head

    torch.manual_seed(seed)
    body = build_model(dict(spec))
    dim = int(body.embed_dim)
    widths = head_widths(n_heads, dim, seed, 0.4, 1.0, True)
    heads = [make_head(dim, w, int(spec["num_classes"]), 0.5) for w in widths]
    keep = max(1, math.ceil(gamma * n_heads))
    x = torch.randn(batch, int(spec["in_channels"]), size, size)
    own = sum(p.numel() for k, p in body.named_parameters() if k in set(body.head_keys()))
    body_params = sum(p.numel() for p in body.parameters()) - own
    arms = [("plain model (baselines)", body, body_params + own),
            ("body + 1 head", HeadEnsemble(body, heads[:1], "majority"),
             body_params + sum(p.numel() for p in heads[0].parameters())),
            (f"FedSDC: body + {n_heads} heads", HeadEnsemble(body, heads, "majority"),
             body_params + sum(p.numel() for h in heads for p in h.parameters())),
            (f"FedSDC+: body + {keep} heads", HeadEnsemble(body, heads[:keep], "majority"),
             body_params + sum(p.numel() for h in heads[:keep] for p in h.parameters()))]
    ms = _forward_ms([m for _, m, _ in arms], x, repeats)
    rows = [{"body": name, "model": what, "parameters": int(params), "ms_per_image": round(t, 3)}
            for (what, _, params), t in zip(arms, ms)]
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run every setting, print and write the tables."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", nargs="+", choices=SETTINGS, default=list(SETTINGS))
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--model", default="small_cnn")
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--momentum", type=float, default=0.0, help="local SGD momentum (default 0: the paper's SGD)")
    p.add_argument("--ham-cases", type=int, default=1400, help="HAM10000 fixture images (default 1400)")
    p.add_argument("--derm-cases", type=int, default=800, help="Derm7pt fixture cases (default 800)")
    p.add_argument("--ham-k", type=int, default=30, help="NIID-1 test images per class on HAM10000 (paper 30)")
    p.add_argument("--derm-k", type=int, default=10, help="NIID-1 test cases per class on Derm7pt")
    p.add_argument("--per-class", type=int, nargs=2, default=[10, 30],
                   help="NIID-2 images per class and client, lo hi (paper 20 60; default 10 30 for the fixtures)")
    p.add_argument("--arms", nargs="+", default=None, metavar="LABEL",
                   help=f"run only these arms (default: {', '.join(label(x) for x in ARMS)}; also "
                        f"{', '.join(label(x) for x in OPTION_ARMS)})")
    p.add_argument("--timing-repeats", type=int, default=5, help="0: skip the ensemble-cost timing")
    p.add_argument("--out", type=Path, default=ROOT / "experiments" / "results" / "fedsdc")
    p.add_argument("--smoke", action="store_true",
                   help="the test suite's run (tests/test_experiments.py): ham10000_niid1, 400 images at 16 px, 5 "
                   "held out a class, seed 0, 2 rounds, fedsdc and fedavgm, no timing; it checks that the "
                   "script runs, its numbers are no evidence")
    a = p.parse_args(argv)
    if a.smoke:
        a.settings, a.ham_cases, a.ham_k, a.image_size, a.seeds = ["ham10000_niid1"], 400, 5, 16, [0]
        a.rounds, a.eval_every, a.arms, a.timing_repeats = 2, 1, ["fedsdc", "fedavgm"], 0
    arms = [x for x in ARMS + OPTION_ARMS if (a.arms is None and x in ARMS) or label(x) in (a.arms or ())]
    if not arms or (a.arms and len(arms) != len(a.arms)):
        p.error(f"--arms: expected labels among {', '.join(label(x) for x in ARMS + OPTION_ARMS)}")
    os.environ.setdefault("MEDFL_NO_PROGRESS", "1")
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    a.out.mkdir(parents=True, exist_ok=True)
    per_seed, rows, started = [], [], time.time()
    for setting in a.settings:
        dataset = setting.split("_")[0]
        data = prepare(dataset, a)
        t0 = time.time()
        result = run_experiment(resolve_config(setting_config(setting, data, a, arms)))
        print(f"{setting}: {time.time() - t0:.0f} s, {result['dir']}", flush=True)
        res = pd.read_csv(Path(result["dir"]) / "seeds_results.csv")
        res = res[res["split"] == "global_test"].assign(setting=setting)
        per_seed.append(res)
        for arm in arms:
            v = res[res["method"] == label(arm)]["micro_f1"].astype(float)
            rows.append({"setting": setting, "method": label(arm),
                         "micro_f1": f"{100 * v.mean():.2f} ± {100 * v.std(ddof=0):.2f}",
                         "mean": v.mean(), "std": v.std(ddof=0), "seeds": len(v)})
    table = pd.DataFrame(rows)
    pd.concat(per_seed, ignore_index=True).to_csv(a.out / "per_seed.csv", index=False)
    table.to_csv(a.out / "table.csv", index=False)
    wide = table.pivot(index="method", columns="setting", values="micro_f1").reindex([label(x) for x in arms])
    wide["paper NIID-1 (HAM10000)"] = [PAPER_NIID1.get(m, "") for m in wide.index]
    wide["paper NIID-2 (blood cells)"] = [PAPER_NIID2.get(m, "") for m in wide.index]
    cost: list[dict[str, Any]] = []
    if a.timing_repeats > 0:
        cost += ensemble_cost("ResNet-50 at 224 (paper)", {"name": "resnet50", "width": 64, "in_channels": 3,
                                                           "num_classes": 7, "spatial_dims": 2},
                              224, 5, 0.3, 0, 8, a.timing_repeats)
        cost += ensemble_cost(f"{a.model} width {a.width} at {a.image_size} (here)",
                              {"name": a.model, "width": a.width, "in_channels": 3, "num_classes": 7,
                               "spatial_dims": 2}, a.image_size, 5, 0.3, 0, 256, a.timing_repeats)
    cost_df = pd.DataFrame(cost)
    cost_df.to_csv(a.out / "ensemble_cost.csv", index=False)
    settings_line = (f"seeds {a.seeds}, {a.rounds} rounds of 1 epoch, 5 clients, {a.model} width {a.width} at "
                     f"{a.image_size}x{a.image_size}, SGD lr {a.lr} momentum {a.momentum:g} batch {a.batch_size} "
                     f"(paper: ResNet-50, lr 1e-3, "
                     f"batch 64, up to 1500 rounds); fixtures: HAM10000 {a.ham_cases} images, Derm7pt {a.derm_cases} "
                     f"cases; NIID-1 k = {a.ham_k} (HAM10000) / {a.derm_k} (Derm7pt); NIID-2 per class "
                     f"{a.per_class[0]}-{a.per_class[1]}; total {time.time() - started:.0f} s on "
                     f"{torch.get_num_threads()} torch thread(s)")
    md = ["# FedSDC on the fixtures: global-test micro-F1 (%), mean ± std over seeds", "", settings_line, "",
          "| method | " + " | ".join(wide.columns) + " |", "|---" * (len(wide.columns) + 1) + "|"]
    md += [f"| {m} | " + " | ".join(str(v) for v in r) + " |" for m, r in wide.iterrows()]
    md += ["", "## Ensemble cost at test time (CPU, forward pass only)", "",
           "| body | model | parameters | ms / image |", "|---|---|---|---|"]
    md += [f"| {r.body} | {r.model} | {r.parameters:,} | {r.ms_per_image} |" for r in cost_df.itertuples()]
    (a.out / "table.md").write_text("\n".join(md) + "\n")
    (a.out / "table.json").write_text(json.dumps({"settings": settings_line, "rows": rows, "cost": cost},
                                                 indent=2, default=float))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
