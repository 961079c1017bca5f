#!/usr/bin/env python
"""The DP warning against utility (issue 63, item 4): FedAvg with ``dp_gaussian`` (clip 1.0)
at epsilon 1, 3, 8, 30, 100, 1000 and without DP, on the demo bundle's fixture and on the
CBIS-DDSM fixture, over seeds; per arm the accuracy at the best validation round, the
majority-class score, the worst-case ``noise_to_signal`` and whether the run warned that the
noise drowns the signal (``medfl.privacy.signal``).

One more arm, ``clip_only``: ``dp_gaussian`` with noise multiplier 1e-6 (no noise to speak of,
no privacy): the clip and the BatchNorm statistics that ``dp_gaussian`` leaves at their initial
values (it sends parameters only), without the noise, so the table tells what the noise costs
from what the rest of the mechanism costs; and ``clip_only_all``, the same with ``keys: "all"``
(the BatchNorm statistics sent, clipped with the update).

The fixtures (one experiment per fixture and seed, the nine arms in it):

``demo``
    ``bundles/demo/configs/train.json``'s ``fl`` section as it is (synthetic2d, 800 images
    32x32, 3 classes, noise 0.8; 4 clients, Dirichlet 0.5; ``resnet10`` width 8 with
    BatchNorm; one local epoch, batch 16, SGD lr 0.01), with ``--rounds`` rounds (5, the bundle's own);
``cbis``
    the CBIS-DDSM fixture (``medfl.fixtures``: ``--cbis-cases`` synthetic mammograms, lesion
    crops of 32 px by ``medfl.prep.cbis_ddsm --roi-crops``, benign/malignant), 4 clients,
    Dirichlet 0.5, the demo's model and training settings;
``demo_groupnorm``, ``cbis_groupnorm``
    the same with ``"dp_compatible": true`` on the model (Opacus's fixer makes every
    BatchNorm a GroupNorm: no running statistics, so nothing the noise leaves out).

Every run: each client's rows 70/15/15 train/val/test, ``eval_splits`` val and test,
evaluated every round, ``early_stopping`` on ``val/accuracy`` with a patience of ``--rounds``
(it never stops a run: it picks the best validation round, where every score is read).

Writes to ``--out`` (default ``experiments/results/dp_warning_utility/``):
``dp_warning_utility.csv`` (one row per fixture, seed and arm), ``dp_warning_utility.md``
(mean +- std over seeds) and ``dp_warning_utility.json`` (the rows and settings: the table
``tests/privacy/test_dp_warning_utility.py`` checks the warning's criterion against is a copy
of it, ``tests/privacy/dp_warning_utility.json``). About 25 CPU-minutes with the defaults
(4 fixtures, 3 seeds, 8-9 arms, 5 rounds).

    python experiments/dp_warning_utility.py [--seeds 0 1 2] [--rounds 5] [--fixtures demo cbis]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "experiments" / "results" / "dp_warning_utility"
EPSILONS = (1.0, 3.0, 8.0, 30.0, 100.0, 1000.0)
FIXTURES = ("demo", "cbis", "demo_groupnorm", "cbis_groupnorm")


def log(msg: str) -> None:
    print(msg, flush=True)


def label(eps: float | None) -> str:
    return "no_dp" if eps is None else f"dp_eps{eps:g}"


def ARMS(a: argparse.Namespace, fixture: str) -> list[str]:  # noqa: N802 - the arms' labels, in table order
    extra = [] if a.smoke else ["clip_only"] if fixture.endswith("_groupnorm") else ["clip_only", "clip_only_all"]
    return ["no_dp", *extra, *[label(e) for e in a.epsilons]]


def arms(a: argparse.Namespace, fixture: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = [{"name": "fedavg", "label": "no_dp", "filters": []}]
    if not a.smoke:   # the clip and the stale BatchNorm statistics without the noise (sigma 1e-6)
        out.append({"name": "fedavg", "label": "clip_only",
                    "filters": [{"name": "dp_gaussian", "noise_multiplier": 1e-6, "clip": a.clip, "delta": a.delta}]})
    if "clip_only_all" in ARMS(a, fixture):
        out.append({"name": "fedavg", "label": "clip_only_all",
                    "filters": [{"name": "dp_gaussian", "noise_multiplier": 1e-6, "clip": a.clip, "delta": a.delta,
                                 "keys": "all"}]})
    for eps in a.epsilons:
        out.append({"name": "fedavg", "label": label(eps),
                    "filters": [{"name": "dp_gaussian", "epsilon": eps, "clip": a.clip, "delta": a.delta}]})
    return out


def demo_fl() -> dict[str, Any]:
    """The demo bundle's ``fl`` section, its ``@`` references (device, folders) made plain."""
    fl = dict(json.loads((ROOT / "bundles" / "demo" / "configs" / "train.json").read_text())["fl"])
    fl["device"] = "cpu"
    return fl


def cbis_manifest(a: argparse.Namespace) -> Path:
    """The CBIS-DDSM fixture's prepared manifest (lesion crops), made once under ``--out/data``."""
    from medfl.fixtures import generate
    from medfl.prep.cbis_ddsm import main as prep

    raw = a.out / "data" / f"cbis_ddsm_raw{a.cbis_cases}"
    prep_dir = a.out / "data" / f"cbis_ddsm_roi{a.image_size}_{a.cbis_cases}"
    manifest = prep_dir / "manifest.csv"
    if not manifest.is_file():
        generate("cbis_ddsm", raw, cases=a.cbis_cases, seed=0, reference=False)
        rc = prep(["--raw", str(raw), "--out", str(prep_dir), "--size", str(a.image_size), str(a.image_size),
                   "--overwrite", "--roi-crops", "--roi-size", str(a.image_size), str(a.image_size)])
        if rc:
            raise SystemExit(f"medfl.prep.cbis_ddsm failed ({rc})")
    return manifest


def config(a: argparse.Namespace, fixture: str, seed: int, manifest: Path | None) -> dict[str, Any]:
    fl = demo_fl()
    fl.update({"name": f"{fixture}_seed{seed}", "output_dir": str(a.out / "runs"), "overwrite": True, "seed": seed,
               "rounds": a.rounds, "progress": False, "client_split": {"train": 0.7, "val": 0.15, "test": 0.15},
               "eval_splits": ["val", "test"], "eval_every": 1, "keep_checkpoints": 1,
               "early_stopping": {"metric": "val/accuracy", "patience": a.rounds},
               "methods": arms(a, fixture)})
    fl["dataset"] = {**fl["dataset"], "root": str(a.out / "data" / "synthetic2d")}
    if fixture.endswith("_groupnorm"):   # Opacus's fixer: every BatchNorm becomes a GroupNorm (no statistics)
        fl["model"] = {**fl["model"], "dp_compatible": True}
    if fixture.startswith("cbis"):
        assert manifest is not None
        fl["dataset"] = {"name": "manifest", "path": str(manifest), "column": "path", "num_classes": 2,
                         "normalize": "zscore", "spatial_size": [a.image_size, a.image_size], "cache": "memory"}
        fl["use_official_split"] = False
        fl["partition"] = {"name": "dirichlet", "alpha": 0.5, "min_size": 20, "max_retries": 5000}
    if a.smoke:
        fl["dataset"] = {**fl["dataset"], **({"num_samples": 200} if fixture == "demo" else {})}
    return fl


def read_arm(run: Path) -> dict[str, Any]:
    """One arm's numbers: accuracy at the best validation round, the worst-case ratio, the
    run's warnings, and the verdict of the warning's criterion on the run's own files
    (:func:`medfl.privacy.signal.utility_of` and :func:`~medfl.privacy.signal.drowned`, as the
    engine judges at the end of a run: the score on ``local_test`` at the best ``local_val``
    round against the majority-class score of the clients' test labels)."""
    import pandas as pd

    from medfl.privacy.signal import DROWNED, STALE_BATCHNORM, drowned, utility_of

    summary = json.loads((run / "summary.json").read_text())
    final = summary["final"]
    warnings = [str(w.get("warning", "")) for w in summary.get("warnings") or []]
    best = int(summary["selection"]["reported_round"])
    row: dict[str, Any] = {
        "best_round": best,
        "test_accuracy": final.get("local_test", {}).get("accuracy", {}).get("mean"),
        "val_accuracy": final.get("local_val", {}).get("accuracy", {}).get("mean"),
        "warned_in_run": any(w.startswith(DROWNED) for w in warnings),
        "batchnorm_warning": any(w.startswith(STALE_BATCHNORM) for w in warnings),
    }
    part = pd.read_csv(run / "partition.csv", dtype={"client_id": str})

    def labels(split: str, ids: list[str]) -> dict[str, Any]:
        rows = part[part["role"] == split.removeprefix("local_")]
        return {cid: rows[rows["client_id"] == cid]["label"].to_numpy() for cid in ids}

    u = utility_of(pd.read_csv(run / "metrics.csv", dtype={"client_id": str}), best, "local_val", labels)
    assert u is not None
    row.update({"judged_split": u.split, "score": u.score, "majority_score": u.majority, "margin": u.margin,
                "examples": u.examples, "learned": u.learned})
    ratio = math.nan
    mech = run / "mechanisms.csv"
    if mech.is_file():
        df = pd.read_csv(mech, dtype={"id": str})
        nts = df[(df["scope"] == "round") & (df["name"] == "noise_to_signal")]["value"]
        ratio = float(nts.max()) if len(nts) else math.nan
        clients = df[(df["scope"] == "round") & (df["name"] == "clients")]["value"]
        row["clients"] = int(clients.iloc[0]) if len(clients) else None
        # the split the run's own verdict read (mechanisms.csv, id utility): the same as
        # judged_split when the run was made with this criterion, so warned_in_run is its warning
        split = df[(df["scope"] == "run") & (df["id"] == "utility") & (df["name"] == "split")]["text"]
        row["run_judged_split"] = str(split.iloc[0]) if len(split) else None
    row["noise_to_signal"] = None if math.isnan(ratio) else ratio
    row["warned"] = drowned(ratio, u) if not math.isnan(ratio) else False
    privacy = run / "privacy.csv"
    if privacy.is_file():
        row["noise_multiplier"] = float(pd.read_csv(privacy)["noise_multiplier"].iloc[0])
    return row


def pm(values: list[float], nd: int = 3) -> str:
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.{nd}f}"
    return f"{statistics.mean(values):.{nd}f} ± {statistics.pstdev(values):.{nd}f}"


def markdown(rows: list[dict[str, Any]], a: argparse.Namespace) -> str:
    head = ("| fixture | arm | σ | noise_to_signal (worst case) | test accuracy at best val round "
            "| majority-class score (test) + margin | val accuracy (best) | warned |")
    lines = [head, "|" + "---|" * 8]
    for fixture in a.fixtures:
        for arm in ARMS(a, fixture):
            part = [r for r in rows if r["fixture"] == fixture and r["arm"] == arm]
            if not part:
                continue
            sigma = part[0].get("noise_multiplier")
            ratio = [r.get("noise_to_signal") for r in part]
            big = ratio[0] is not None and ratio[0] >= 100
            lines.append(
                f"| {fixture} | {arm} | {'-' if sigma is None else f'{sigma:.3g}'} | "
                f"{'-' if ratio[0] is None else f'{statistics.mean(ratio):.{0 if big else 3}f}'} | "
                f"{pm([r['test_accuracy'] for r in part])} | {pm([r['majority_score'] for r in part])} + "
                f"{pm([r['margin'] for r in part])} | {pm([r['val_accuracy'] for r in part])} | "
                f"{sum(bool(r['warned']) for r in part)}/{len(part)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help="results and runs (default experiments/results/dp_warning_utility/)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds (default 0 1 2)")
    p.add_argument("--epsilons", type=float, nargs="+", default=list(EPSILONS),
                   help="target epsilons (default 1 3 8 30 100 1000)")
    p.add_argument("--rounds", type=int, default=5, help="rounds (default 5, the demo bundle's)")
    p.add_argument("--fixtures", nargs="+", choices=FIXTURES, default=list(FIXTURES),
                   help="fixtures (default all four)")
    p.add_argument("--cbis-cases", type=int, default=800, help="CBIS-DDSM fixture mammograms (default 800)")
    p.add_argument("--image-size", type=int, default=32, help="CBIS-DDSM lesion crop side (default 32)")
    p.add_argument("--clip", type=float, default=1.0, help="dp_gaussian clip (default 1.0)")
    p.add_argument("--delta", type=float, default=1e-5, help="dp_gaussian delta (default 1e-5)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    p.add_argument("--rerun", action="store_true", help="rerun seeds whose runs are already in --out/runs")
    p.add_argument("--smoke", action="store_true",
                   help="the test suite's run: demo fixture (200 images), seed 0, epsilon 3, 2 rounds")
    a = p.parse_args(argv)
    if a.smoke:
        a.fixtures, a.seeds, a.epsilons, a.rounds = ["demo"], [0], [3.0], 2
    os.environ.setdefault("MEDFL_NO_PLOTS", "1")
    import torch

    torch.set_num_threads(a.threads)
    sys.path.insert(0, str(ROOT))
    from medfl.config import resolve_config
    from medfl.experiment import run_experiment

    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    t_all = time.perf_counter()
    for fixture in a.fixtures:
        manifest = cbis_manifest(a) if fixture.startswith("cbis") else None
        for seed in a.seeds:
            t0 = time.perf_counter()
            exp = a.out / "runs" / f"{fixture}_seed{seed}"
            if a.rerun or not all((exp / arm / "summary.json").is_file() for arm in ARMS(a, fixture)):
                exp = Path(run_experiment(resolve_config(config(a, fixture, seed, manifest)))["dir"])
            per = {}
            for arm in ARMS(a, fixture):
                per[arm] = {"fixture": fixture, "seed": seed, "arm": arm,
                            "epsilon": float(arm.removeprefix("dp_eps")) if arm.startswith("dp_eps") else None,
                            **read_arm(exp / arm)}
            rows += per.values()
            log(f"{fixture} seed {seed}: {time.perf_counter() - t0:.0f} s; " + "; ".join(
                f"{arm} test {r['test_accuracy']:.3f} val {r['val_accuracy']:.3f}{' WARNED' if r['warned'] else ''}"
                f"{' (run: warned)' if r['warned_in_run'] else ''}"
                for arm, r in per.items()))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()}
    (a.out / "dp_warning_utility.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=1))
    import pandas as pd

    pd.DataFrame(rows).to_csv(a.out / "dp_warning_utility.csv", index=False)
    md = markdown(rows, a)
    (a.out / "dp_warning_utility.md").write_text(md + "\n")
    log(md)
    log(f"total {time.perf_counter() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
