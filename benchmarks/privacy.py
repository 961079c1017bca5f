#!/usr/bin/env python
"""What do medfl's privacy and compression filters cost? Bytes per round of FedAvg with and
without ``quantize`` and ``dp_gaussian``, and the wall time of DP-SGD and of ``dp_gaussian``.

Three measurements (docs/privacy.md describes the features):

``bytes``
    FedAvg on a MONAI ResNet-10 (2D, single-channel 64x64 ``synthetic2d`` images, 4 clients,
    Dirichlet 1.0, 2 rounds) run by :func:`medfl.experiment.run_experiment` once per
    ``--widths`` entry, with six method entries: no filter, ``quantize`` at 8, 4 and 1 bits,
    ``dp_gaussian`` (epsilon 3, clip 1, delta 1e-3) alone and ``dp_gaussian`` + 8-bit
    ``quantize``. The figures are the run's own ``communication.csv`` (the encoded size of
    the messages as Flower sends them): train phase, bytes from one client per round and to
    one client per round, and the ratio to the unfiltered run. Bytes do not depend on the
    number of images, so the dataset is small (``--bytes-samples``). For reference the
    model's raw state is given (float32 tensor bytes, parameters and buffers) and, per
    filter, the bytes of the tensors it sends (packed codes, int tensors) and what the
    message adds on top (per-tensor range and shape, names, the reply's metrics, control).
``dp_sgd``
    One local update (1 epoch) of the same ResNet-10 (``--width``) on ``--samples`` random
    64x64 images, batch 16, SGD (lr 0.01, momentum 0.9, medfl's defaults): plain
    :func:`medfl.training.train_epochs` on the BatchNorm model; the same on the model
    Opacus's validator fixed (BatchNorm -> GroupNorm, :func:`medfl.privacy.dp_sgd.make_private_model`),
    which separates the architecture change from the per-sample gradients; and
    :func:`medfl.privacy.dp_sgd.train_epochs_dp` (noise multiplier 1, max_grad_norm 1).
    One warm-up each, then ``--repeats`` (9) rounds in which the three variants take turns; each
    run starts from a copy of the same initial weights; median and min-max.
``filters``
    :meth:`medfl.filters.FilterChain.apply` + :meth:`~medfl.filters.FilterChain.undo` of
    ``[dp_gaussian]``, ``[dp_gaussian, quantize 8]`` and ``[quantize 8]`` on FedAvg's reply
    (the state after the plain local update, against the state it started from), planned for
    4 clients and 2 rounds: median of ``--filter-repeats`` in ms, and as a fraction of the
    plain local update's median time. The chains take turns within every repeat.

Results go to ``--out`` (default ``benchmarks/results/privacy/``): ``privacy_benchmark.json``
(every figure) and ``privacy_benchmark.md`` (the tables printed at the end). Defaults take
3-9 minutes on 2 CPU cores (the bytes runs 2.5 minutes; the rest depends on what else runs);
``--quick`` 0.5-1.5 minutes (width 16 only, 32 images, fewer repeats). The timings print the
machine's load average: read them with it (see ``--threads``).

    python benchmarks/privacy.py [--quick] [--widths 16,64] [--only bytes,dp_sgd,filters]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
IMAGE_SIZE = 64
NUM_CLIENTS = 4
NUM_CLASSES = 2
BATCH_SIZE = 16
LR, MOMENTUM = 0.01, 0.9
DP_GAUSSIAN = {"name": "dp_gaussian", "epsilon": 3.0, "clip": 1.0, "delta": 1e-3}
# label -> filter chain of the bytes measurement (the first is the reference)
CHAINS: dict[str, list[dict[str, Any]]] = {
    "none": [],
    "quantize8": [{"name": "quantize", "bits": 8}],
    "quantize4": [{"name": "quantize", "bits": 4}],
    "quantize1": [{"name": "quantize", "bits": 1}],
    "dp_gaussian": [dict(DP_GAUSSIAN)],
    "dp_gaussian+quantize8": [dict(DP_GAUSSIAN), {"name": "quantize", "bits": 8}],
}
SECTIONS = ("bytes", "dp_sgd", "filters")


def log(msg: str) -> None:
    print(msg, flush=True)


def model_spec(width: int) -> dict[str, Any]:
    return {"name": "resnet10", "width": width, "spatial_dims": 2, "in_channels": 1, "num_classes": NUM_CLASSES}


# ------------------------------------------------------------------------------ bytes
def state_layout(width: int) -> dict[str, Any]:
    """Tensor counts and sizes of the model's state (what FedAvg sends)."""
    from medfl.models.registry import build_model

    model = build_model(model_spec(width))
    params = {n for n, _ in model.named_parameters()}
    state = model.state_dict()
    floats = {k: v.numel() for k, v in state.items() if v.is_floating_point()}
    ints = {k: v.numel() * v.element_size() for k, v in state.items() if not v.is_floating_point()}
    return {
        "tensors": len(state),
        "float_tensors": len(floats),
        "parameter_tensors": sum(1 for k in floats if k in params),
        "int_tensors": len(ints),
        "float_values": sum(floats.values()),
        "parameter_values": sum(n for k, n in floats.items() if k in params),
        "float32_bytes": 4 * sum(floats.values()),
        "parameter_float32_bytes": 4 * sum(n for k, n in floats.items() if k in params),
        "int_bytes": sum(ints.values()),
        "_floats": floats,
        "_params": params,
    }


def tensor_bytes(layout: dict[str, Any], chain: list[dict[str, Any]]) -> dict[str, Any]:
    """The bytes of the tensors a reply carries under ``chain`` (no message overhead)."""
    floats, params = layout["_floats"], layout["_params"]
    dp = any(f["name"] == "dp_gaussian" for f in chain)
    bits = next((f["bits"] for f in chain if f["name"] == "quantize"), None)
    sent = {k: n for k, n in floats.items() if (k in params or not dp)}
    data = sum(math.ceil(n * bits / 8) for n in sent.values()) if bits else 4 * sum(sent.values())
    ints = 0 if dp else layout["int_bytes"]   # dp_gaussian (keys "parameters") sends parameters only
    return {"float_tensors_sent": len(sent), "value_bytes": data, "int_bytes": ints,
            "tensor_bytes": data + ints}


def bytes_config(width: int, out: Path, samples: int, rounds: int, seed: int) -> dict[str, Any]:
    return {
        "name": f"bytes_w{width}", "output_dir": str(out / "runs"), "overwrite": True,
        "seed": seed, "rounds": rounds, "num_clients": NUM_CLIENTS, "progress": False,
        "dataset": {"name": "synthetic2d", "root": str(out / "data"), "num_samples": samples,
                    "num_classes": NUM_CLASSES, "image_size": IMAGE_SIZE, "noise": 0.5},
        "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 10},
        "model": {"name": "resnet10", "width": width},
        "train": {"batch_size": BATCH_SIZE, "lr": LR, "momentum": MOMENTUM, "epochs": 1},
        "methods": [{"name": "fedavg", "label": label, "filters": chain} for label, chain in CHAINS.items()],
        "eval_splits": ["test"],
        "eval_every": 0,
    }


def measure_bytes(width: int, work: Path, samples: int, rounds: int, seed: int) -> dict[str, Any]:
    import pandas as pd

    from medfl.config import resolve_config
    from medfl.experiment import run_experiment

    t0 = time.perf_counter()
    out = run_experiment(resolve_config(bytes_config(width, work, samples, rounds, seed)))
    wall = time.perf_counter() - t0
    exp = Path(out["dir"])
    layout = state_layout(width)
    rows: dict[str, Any] = {}
    for label, chain in CHAINS.items():
        comm = pd.read_csv(exp / label / "communication.csv")
        train = comm[comm["phase"] == "train"]
        summary = json.loads((exp / label / "summary.json").read_text())
        row = {
            "filters": chain,
            "train_bytes_from_client": float(train["bytes_from_client"].mean()),
            "train_bytes_from_client_min": int(train["bytes_from_client"].min()),
            "train_bytes_from_client_max": int(train["bytes_from_client"].max()),
            "train_bytes_to_client": float(train["bytes_to_client"].mean()),
            "round_bytes_from_clients": float(comm.groupby("round")["bytes_from_client"].sum().mean()),
            "round_bytes_to_clients": float(comm.groupby("round")["bytes_to_client"].sum().mean()),
            "summary_communication": summary.get("communication"),
            "epsilon": (summary.get("privacy") or {}).get("epsilon"),
        }
        row.update(tensor_bytes(layout, chain))
        row["message_overhead_bytes"] = row["train_bytes_from_client"] - row["tensor_bytes"]
        rows[label] = row
    ref = rows["none"]
    for row in rows.values():
        row["ratio_from"] = ref["train_bytes_from_client"] / row["train_bytes_from_client"]
        row["ratio_to"] = ref["train_bytes_to_client"] / row["train_bytes_to_client"]
    return {"width": width, "wall_s": wall, "run_dir": str(exp),
            "state": {k: v for k, v in layout.items() if not k.startswith("_")}, "chains": rows}


# ------------------------------------------------------------------------------ timing
def _median(xs: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "all": xs}


def measure_dp_sgd(width: int, samples: int, repeats: int, seed: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One local epoch three ways; returns (results, objects for the filter timing)."""
    from torch.utils.data import DataLoader, TensorDataset

    from medfl.training import train_epochs
    from medfl.models.registry import build_model
    from medfl.privacy.dp_sgd import make_private_model, train_epochs_dp

    torch.manual_seed(seed)
    bn = build_model(model_spec(width))
    gn, replaced = make_private_model(copy.deepcopy(bn))
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, 1, IMAGE_SIZE, IMAGE_SIZE, generator=gen)
    y = torch.randint(0, NUM_CLASSES, (samples,), generator=gen)
    data = TensorDataset(x, y)

    def plain(init: torch.nn.Module) -> Callable[[int], torch.nn.Module]:
        def run(rep: int) -> torch.nn.Module:
            model = copy.deepcopy(init)
            opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
            loader = DataLoader(data, batch_size=BATCH_SIZE, shuffle=True,
                                generator=torch.Generator().manual_seed(seed + rep))
            train_epochs(model, loader, opt, 1)
            return model
        return run

    def dp(rep: int) -> torch.nn.Module:
        model = copy.deepcopy(gn)
        opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
        train_epochs_dp(model, data, opt, 1, batch_size=BATCH_SIZE, noise_multiplier=1.0, max_grad_norm=1.0,
                        seed=seed + rep)
        return model

    variants = {"plain_batchnorm": plain(bn), "plain_groupnorm": plain(gn), "dp_sgd": dp}
    times: dict[str, list[float]] = {k: [] for k in variants}
    trained = None
    for rep in range(-1, repeats):  # rep -1: warm-up, not counted
        for name, fn in variants.items():
            t0 = time.perf_counter()
            model = fn(rep)
            dt = time.perf_counter() - t0
            if rep >= 0:
                times[name].append(dt)
            if name == "plain_batchnorm":
                trained = model
        log("  dp_sgd timing warm-up done" if rep < 0 else f"  dp_sgd timing repeat {rep + 1}/{repeats}: "
            + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()))
    res = {k: _median(v) for k, v in times.items()}
    base = res["plain_batchnorm"]["median"]
    for v in res.values():
        v["ratio_to_plain_batchnorm"] = v["median"] / base
    res["dp_sgd"]["ratio_to_plain_groupnorm"] = res["dp_sgd"]["median"] / res["plain_groupnorm"]["median"]
    info = {"width": width, "samples": samples, "image_size": IMAGE_SIZE, "batch_size": BATCH_SIZE,
            "steps_plain": math.ceil(samples / BATCH_SIZE), "optimizer": f"SGD lr {LR} momentum {MOMENTUM}",
            "noise_multiplier": 1.0, "max_grad_norm": 1.0, "repeats": repeats, "model_fix": replaced,
            "data": "random normal images, random labels (the time does not depend on the content)"}
    return {"setup": info, "times_s": res}, {"initial": bn.state_dict(), "trained": trained.state_dict()}


def measure_filters(width: int, states: dict[str, Any], repeats: int, seed: int, local_update_s: float
                    ) -> dict[str, Any]:
    from medfl.filters import FilterChain
    from medfl.method import Federation
    from medfl.plugins import lookup

    fedavg = lookup("method", "fedavg")
    ids = [str(i) for i in range(NUM_CLIENTS)]
    fed = Federation(client_ids=ids, eval_client_ids=ids, num_examples={c: 128 for c in ids},
                     num_classes=NUM_CLASSES, rounds=2, seed=seed, model={"name": "resnet10", "width": width})
    spec = fed.model_spec()
    ins = {"model": {k: v.clone() for k, v in states["initial"].items()}}
    reply = {"model": {k: v.clone() for k, v in states["trained"].items()}}
    chains = {"dp_gaussian": [dict(DP_GAUSSIAN)],
              "dp_gaussian+quantize8": [dict(DP_GAUSSIAN), {"name": "quantize", "bits": 8}],
              "quantize8": [{"name": "quantize", "bits": 8}]}
    update_norm = math.sqrt(sum(float((states["trained"][k] - states["initial"][k]).float().pow(2).sum())
                                for k in states["initial"] if states["initial"][k].is_floating_point()))
    out: dict[str, Any] = {"update_l2_norm_all_floats": update_norm, "chains": {}}
    built = {}
    for name, specs in chains.items():
        chain = FilterChain.from_specs(specs)
        chain.check(fedavg, name)
        chain.plan(fed, name)
        built[name] = chain
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in chains}
    back: dict[str, Any] = {}
    for rep in range(-1, repeats):  # rep -1: warm-up; the chains take turns in every repeat
        for name, chain in built.items():
            kw = dict(client_id="0", round=1, step=0, seed=seed, model_spec=spec, where=f"benchmark {name}")
            t0 = time.perf_counter()
            sent = chain.apply(fedavg, reply, ins, **kw)
            t1 = time.perf_counter()
            back[name] = chain.undo(fedavg, sent, ins, **kw)
            t2 = time.perf_counter()
            if rep >= 0:
                times[name][0].append(1e3 * (t1 - t0))
                times[name][1].append(1e3 * (t2 - t1))
    for name, chain in built.items():
        apply_t, undo_t = times[name]
        total = [x + y for x, y in zip(apply_t, undo_t)]
        err = max(float((back[name]["model"][k].float() - reply["model"][k].float()).abs().max())
                  for k in reply["model"] if reply["model"][k].is_floating_point())
        out["chains"][name] = {
            "filters": chain.specs(),
            "apply_ms": _median(apply_t), "undo_ms": _median(undo_t), "total_ms": _median(total),
            "fraction_of_local_update": statistics.median(total) / 1e3 / local_update_s,
            "max_abs_change_of_the_state": err,
        }
        log(f"  filters {name}: apply {statistics.median(apply_t):.1f} ms, undo {statistics.median(undo_t):.1f} ms "
            f"(total min {min(total):.1f} ms)")
    return out


# ------------------------------------------------------------------------------ report
def _kb(b: float) -> str:
    return f"{b / 1024:,.1f}"


def tables(res: dict[str, Any]) -> str:
    lines: list[str] = []
    m = res["machine"]
    load = "/".join(f"{x:.1f}" for x in m["load_average_start"][:1] + m.get("load_average_end", [])[:1])
    lines.append(f"Machine: {m['cpus']} CPUs, torch {m['torch']} with {m['torch_threads']} threads, "
                 f"{m['platform']}, Python {m['python']}; 1-minute load average at start/end {load} "
                 "(other processes share the machine: read the timings with it).\n")
    for b in res.get("bytes", []):
        s = b["state"]
        lines.append(f"### Bytes per round: FedAvg, ResNet-10 width {b['width']} (2D, 1x64x64), "
                     f"{NUM_CLIENTS} clients, train phase, per client and round\n")
        lines.append(f"Model state: {s['tensors']} tensors, {s['float_values']:,} float32 values = "
                     f"{_kb(s['float32_bytes'])} KiB ({s['parameter_values']:,} in {s['parameter_tensors']} "
                     f"parameters = {_kb(s['parameter_float32_bytes'])} KiB; the rest BatchNorm running "
                     f"statistics) + {s['int_tensors']} int64 batch counters ({s['int_bytes']} B).\n")
        lines.append("| filters | from client KiB | ratio | tensors KiB | message overhead KiB | "
                     "to client KiB | ratio | epsilon |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for label, r in b["chains"].items():
            eps = "-" if r["epsilon"] is None else f"{r['epsilon']:.3f}"
            lines.append(f"| {label} | {_kb(r['train_bytes_from_client'])} | {r['ratio_from']:.2f}x | "
                         f"{_kb(r['tensor_bytes'])} | {_kb(r['message_overhead_bytes'])} | "
                         f"{_kb(r['train_bytes_to_client'])} | {r['ratio_to']:.2f}x | {eps} |")
        lines.append("")
    if "dp_sgd" in res:
        d = res["dp_sgd"]
        st = d["setup"]
        lines.append(f"### One local update: ResNet-10 width {st['width']}, {st['samples']} images 64x64, "
                     f"batch {st['batch_size']}, 1 epoch, {st['optimizer']} (median of {st['repeats']})\n")
        lines.append("| local training | median s | min-max s | vs plain BatchNorm | vs plain GroupNorm |")
        lines.append("|---|---|---|---|---|")
        gn = d["times_s"]["plain_groupnorm"]["median"]
        for name, t in d["times_s"].items():
            lines.append(f"| {name} | {t['median']:.2f} | {t['min']:.2f}-{t['max']:.2f} | "
                         f"{t['ratio_to_plain_batchnorm']:.2f}x | {t['median'] / gn:.2f}x |")
        lines.append("")
    if "filters" in res:
        f = res["filters"]
        lines.append(f"### Reply filters on that update (FilterChain apply + undo, median of "
                     f"{res['args']['filter_repeats']}); update L2 norm {f['update_l2_norm_all_floats']:.3f}\n")
        lines.append("| chain | apply ms | undo ms | total ms (min-max) | of the plain local update (median) |")
        lines.append("|---|---|---|---|---|")
        for label, c in f["chains"].items():
            t = c["total_ms"]
            lines.append(f"| {label} | {c['apply_ms']['median']:.1f} | {c['undo_ms']['median']:.1f} | "
                         f"{t['median']:.1f} ({t['min']:.1f}-{t['max']:.1f}) | {100 * c['fraction_of_local_update']:.1f} % |")
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=HERE / "results" / "privacy",
                   help="where privacy_benchmark.json/.md go (default benchmarks/results/privacy/)")
    p.add_argument("--quick", action="store_true",
                   help="0.5-1.5 minutes: width 16 only, 32 images for the timing, 3 repeats, 10 filter repeats")
    p.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--widths", default=None, help="ResNet-10 widths for the bytes (default 16,64; --quick: 16)")
    p.add_argument("--width", type=int, default=16, help="ResNet-10 width for the timings (default 16)")
    p.add_argument("--bytes-samples", type=int, default=160,
                   help="images in the bytes runs' dataset (bytes do not depend on it; default 160)")
    p.add_argument("--rounds", type=int, default=2, help="rounds of the bytes runs (default 2)")
    p.add_argument("--samples", type=int, default=None, help="training images of the local update (default 128; --quick 32)")
    p.add_argument("--repeats", type=int, default=None, help="timed local updates per variant (default 9; --quick 3)")
    p.add_argument("--filter-repeats", type=int, default=None, help="timed filter applications (default 50; --quick 10)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's own choice, one per core). On a machine "
                        "other processes share, 1 avoids oversubscription: with 2 threads on 2 busy cores "
                        "a local update took 10-100x longer in some repeats")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-runs", action="store_true", help="keep the bytes runs' directories under --out/runs")
    a = p.parse_args(argv)
    only = [s.strip() for s in a.only.split(",") if s.strip()]
    bad = sorted(set(only) - set(SECTIONS))
    if bad:
        p.error(f"--only: unknown section(s) {bad}; choose from {SECTIONS}")
    widths = [int(w) for w in (a.widths or ("16" if a.quick else "16,64")).split(",")]
    samples = a.samples or (32 if a.quick else 128)
    repeats = a.repeats or (3 if a.quick else 9)
    a.filter_repeats = a.filter_repeats or (10 if a.quick else 50)
    if a.threads:
        torch.set_num_threads(a.threads)
    os.environ.setdefault("MEDFL_NO_PROGRESS", "1")

    from medfl.plugins import registry

    registry()
    res: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_start": list(os.getloadavg())},
        "args": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
                 "widths": widths, "samples": samples, "repeats": repeats},
    }
    a.out.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    if "bytes" in only:
        work = a.out if a.keep_runs else Path(tempfile.mkdtemp(prefix="medfl_privacy_bench_"))
        try:
            res["bytes"] = []
            for w in widths:
                log(f"bytes: FedAvg, resnet10 width {w}, {len(CHAINS)} filter chains, {a.rounds} rounds ...")
                b = measure_bytes(w, work, a.bytes_samples, a.rounds, a.seed)
                log(f"  done in {b['wall_s']:.1f} s: " + ", ".join(
                    f"{k} {_kb(r['train_bytes_from_client'])} KiB" for k, r in b["chains"].items()))
                if not a.keep_runs:
                    b["run_dir"] = None
                res["bytes"].append(b)
        finally:
            if not a.keep_runs:
                shutil.rmtree(work, ignore_errors=True)
    if "dp_sgd" in only or "filters" in only:
        log(f"dp_sgd: one local epoch of resnet10 width {a.width}, {samples} images, "
            f"{torch.get_num_threads()} torch threads ...")
        d, states = measure_dp_sgd(a.width, samples, repeats, a.seed)
        if "dp_sgd" in only:
            res["dp_sgd"] = d
        if "filters" in only:
            log("filters: FilterChain apply + undo ...")
            res["filters"] = measure_filters(a.width, states, a.filter_repeats, a.seed,
                                             d["times_s"]["plain_batchnorm"]["median"])
    res["wall_s"] = time.perf_counter() - t_all
    res["machine"]["load_average_end"] = list(os.getloadavg())
    md = tables(res)
    (a.out / "privacy_benchmark.json").write_text(json.dumps(res, indent=2, default=str))
    (a.out / "privacy_benchmark.md").write_text(md + "\n")
    print("\n" + md)
    log(f"total {res['wall_s']:.0f} s; wrote {a.out / 'privacy_benchmark.json'} and privacy_benchmark.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
