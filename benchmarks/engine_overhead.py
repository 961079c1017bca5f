#!/usr/bin/env python
"""How much does medfl's in-process engine cost over a plain PyTorch FedAvg loop, and over
Flower's simulation? And how does its memory grow with the number of clients?

The same FedAvg job (default: 10 clients, 10 rounds, ``small_cnn`` on fixed random 1x28x28
images, 10 classes, SGD lr 0.01 momentum 0.9, batch 32, 1 local epoch) runs three ways:

``plain``
    A plain PyTorch loop: for each round, for each client, build the client's train set,
    load the global weights, train one epoch, keep the weights; then a weighted average.
    After the last round every client evaluates the final model on its test rows (accuracy).
``medfl``
    :func:`medfl.experiment.run_experiment` with method ``fedavg``, ``eval_every: 0``
    (evaluation at the last round only) and ``progress: False``. medfl still does all its
    usual work: it evaluates once at the end (every registered metric), writes
    partition/metrics/train_metrics CSVs, a checkpoint and status file every round,
    summary.json, comparison.csv and the reporting plugin's plots.
``flower``
    Flower's simulation (``flwr.simulation.run_simulation``, Ray backend) of a ServerApp
    running ``flwr.serverapp.strategy.FedAvg`` (Message API) for the same rounds, with
    a ClientApp whose train/evaluate functions are the plain loop's, and one final
    evaluation round (federated evaluation is off during the rounds, as in medfl).

All three see the same data: the rows of each client come from medfl's partition of the
``random_blocks`` dataset (``natural`` partitioner on column ``block``, each client's rows
split 80/20 into train/test, no global test set), and each client's dataset is built through
the same ``FederatedSource.make_dataset`` from a seeded generator, lazily, every round, as a
real client reads its data. The plain loop uses medfl's seeds (model init, per-client
DataLoader shuffling), so its final model must equal medfl's; the script checks this.

Every measurement runs in a fresh subprocess (this script re-invoking itself with
``--child``); the wall time is taken inside it around the run itself, after imports and
plugin loading. Peak memory is the child's ``VmHWM`` (peak resident set size).

The plain loop's and medfl's local training loops are clocked too, so each steady round
splits into training and everything else. Two processes running the very same training
steps differ by up to several per cent in speed (memory placement, the machine's load), which
is as large as what medfl adds on the ResNet jobs; the report therefore also gives medfl's own
work per round (its time besides training minus the plain loop's) and the per-round ratio at
equal training speed (the plain loop's training time plus each way's other work).

Run ``python benchmarks/engine_overhead.py --help`` for the options.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from medfl import hookimpl

HERE = Path(__file__).resolve().parent
MODEL = {"name": "small_cnn"}  # width 16, batch norm (set by --workload)
NUM_CLASSES = 10
IMAGE_SIZE = 28
SPATIAL_DIMS = 2

#: ``--workload`` presets: the model, the input and the defaults of the job's size (each can
#: still be set with its own option). ``tiny`` is the original job; ``resnet2d`` looks like a
#: Derm7pt run (2D ResNet-10 at 128x128, 20 clients), ``resnet3d`` like an ABIDE run (3D
#: ResNet-10 at 32^3, 4 clients). The ResNets are width 16 so that a 2-core machine measures
#: them in minutes; the overhead ratio is what the benchmark is for, not the absolute time.
WORKLOADS: dict[str, dict[str, Any]] = {
    "tiny": {"model": {"name": "small_cnn"}, "image_size": 28, "spatial_dims": 2, "clients": 10,
             "samples": 256, "batch_size": 32, "rounds": 10},
    "resnet2d": {"model": {"name": "resnet10", "width": 16}, "image_size": 128, "spatial_dims": 2,
                 "clients": 20, "samples": 160, "batch_size": 16, "rounds": 3},
    "resnet3d": {"model": {"name": "resnet10", "width": 16}, "image_size": 32, "spatial_dims": 3,
                 "clients": 4, "samples": 80, "batch_size": 4, "rounds": 3},
}


def set_workload(name: str) -> dict[str, Any]:
    """Make ``name`` the job of this process (module settings read by every way); return it."""
    global MODEL, IMAGE_SIZE, SPATIAL_DIMS
    w = WORKLOADS[name]
    MODEL, IMAGE_SIZE, SPATIAL_DIMS = dict(w["model"]), int(w["image_size"]), int(w["spatial_dims"])
    return w


#: ``--device``, ``--amp``, ``--channels-last``: where and how every way computes (medfl's
#: ``fl.device``, ``train.amp`` and ``train.channels_last``; the plain loop does the same by hand)
DEVICE = "cpu"
AMP: str | None = None
CHANNELS_LAST = False


def set_compute(device: str, amp: str | None, channels_last: bool) -> None:
    """Make ``device``, ``amp`` and ``channels_last`` the compute settings of this process."""
    global DEVICE, AMP, CHANNELS_LAST
    DEVICE, AMP, CHANNELS_LAST = device, amp, bool(channels_last)


def describe_compute() -> str:
    """The compute settings, for the report."""
    extra = [f"{AMP} autocast"] if AMP else []
    extra += ["channels-last"] if CHANNELS_LAST else []
    return DEVICE + (f" ({', '.join(extra)})" if extra else "")


#: seconds spent in local training loops so far in this process (the plain loop's ``for x, y in
#: loader`` loop; medfl's ``train_epochs``): a round's time minus its training time is what
#: each way does besides training, which does not depend on how fast this process happens to
#: train (two processes running the same code can differ by several per cent)
TRAIN_CLOCK = [0.0]


def _sync() -> None:
    """Wait for the GPU's queued work, so that a clock read after it counts that work."""
    if DEVICE.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def describe_model() -> str:
    """The model and input of the current workload, for the report."""
    extra = ", ".join(f"{k} {v}" for k, v in MODEL.items() if k != "name")
    return f"{MODEL['name']}{f' ({extra})' if extra else ''} on random 1x" + "x".join([str(IMAGE_SIZE)] * SPATIAL_DIMS)
CLIENT_SPLIT = {"train": 0.8, "test": 0.2}
EVAL_BATCH_SIZE = 64
LR, MOMENTUM = 0.01, 0.9

TARGET_PLAIN = 1.05   # medfl wall time <= 1.05 x plain loop
TARGET_FLOWER = 0.5   # medfl wall time <= 0.5 x Flower simulation
TARGET_MEMORY = 1.5   # peak memory of 100 clients <= 1.5 x that of 10


# ------------------------------------------------------------------------------ shared setup
def fl_config(clients: int, rounds: int, samples: int, batch_size: int, seed: int,
              output_dir: str) -> dict[str, Any]:
    """The medfl ``fl`` config of the job (also what the plain loop and Flower copy)."""
    return {
        "name": "engine_overhead", "output_dir": output_dir, "overwrite": True,
        "seed": seed, "rounds": rounds, "num_clients": clients,
        "dataset": {"name": "random_blocks", "num_blocks": clients, "samples_per_block": samples,
                    "num_classes": NUM_CLASSES, "image_size": IMAGE_SIZE, "seed": seed,
                    "spatial_dims": SPATIAL_DIMS},
        "global_test_fraction": 0.0,
        "partition": {"name": "natural", "column": "block"},
        "client_split": dict(CLIENT_SPLIT),
        "model": dict(MODEL),
        "device": DEVICE,
        "train": {"epochs": 1, "batch_size": batch_size, "eval_batch_size": EVAL_BATCH_SIZE,
                  "lr": LR, "optimizer": "sgd", "momentum": MOMENTUM, "weight_decay": 0.0,
                  "num_workers": 0, "amp": AMP, "channels_last": CHANNELS_LAST},
        "methods": [{"name": "fedavg"}],
        "eval_splits": ["test"],
        "eval_every": 0,
        "progress": False,
    }


class _DatasetPlugin:
    """Throwaway plugin with timing hooks (``random_blocks`` is a built-in dataset)."""

    def __init__(self) -> None:
        self.marks: dict[str, float] = {}
        self.profiler: Any = None
        self.profile_span: tuple[int, int, str] = (0, 0, "")
        self.counting = False          # ``--steps``: the step clocks count (rounds in count_span)
        self.count_span = (0, 0)

    @hookimpl
    def on_run_start(self, run):  # noqa: ANN001
        self.marks["run_start"] = time.perf_counter()
        if self.profiler is not None and self.profile_span[0] == 0:
            self.profiler.enable()

    @hookimpl
    def on_client_end(self, run, round, client_id, metrics):  # noqa: ANN001, A002
        self.marks[f"client_end_{round}"] = time.perf_counter()

    @hookimpl
    def on_round_end(self, run, round, metrics):  # noqa: ANN001, A002
        self.marks[f"round_end_{round}"] = time.perf_counter()
        self.marks[f"loop_{round}"] = TRAIN_CLOCK[0]
        if round == self.count_span[0]:
            self.counting = True
        elif round == self.count_span[1]:
            self.counting = False
        if self.profiler is not None and round == self.profile_span[0]:
            self.profiler.enable()
        elif self.profiler is not None and round == self.profile_span[1]:
            self.profiler.disable()
            self.profiler.dump_stats(self.profile_span[2])

    def count_rounds(self, after: int, until: int) -> None:
        """Let the step clocks count from the end of round ``after`` to the end of round ``until``."""
        self.count_span = (after, until)

    def profile_rounds(self, after: int, until: int, out: str) -> None:
        """Profile from the end of round ``after`` (0: the start of the run) to the end of round
        ``until`` into ``out``."""
        import cProfile

        self.profiler, self.profile_span = cProfile.Profile(), (after, until, out)

    @hookimpl(tryfirst=True)
    def on_run_end(self, run, summary):  # noqa: ANN001
        self.marks["run_end"] = time.perf_counter()


@functools.lru_cache(maxsize=1)
def ensure_plugin() -> _DatasetPlugin:
    """Register the throwaway plugin (once per process) and load every plugin."""
    from medfl.plugins import get_plugin_manager, registry

    plugin = _DatasetPlugin()
    get_plugin_manager().register(plugin, name="bench_random_blocks")
    registry()
    return plugin


@functools.lru_cache(maxsize=4)
def _source(clients: int, samples: int, seed: int):  # noqa: ANN202
    from medfl.data.random_blocks import random_blocks

    return random_blocks(num_blocks=clients, samples_per_block=samples, num_classes=NUM_CLASSES,
                         image_size=IMAGE_SIZE, seed=seed, spatial_dims=SPATIAL_DIMS)


def client_rows(clients: int, samples: int, seed: int, rounds: int, batch_size: int
                ) -> dict[str, dict[str, Any]]:
    """medfl's assignment of table rows to each client's train and test split."""
    from medfl.config import resolve_config
    from medfl.engine.data import split_data

    ensure_plugin()
    cfg = resolve_config(fl_config(clients, rounds, samples, batch_size, seed, "unused"))
    data = split_data(_source(clients, samples, seed), cfg)
    a = data.assignments
    out = {}
    for cid in data.client_ids:
        mine = a[a["client_id"] == cid]
        out[cid] = {role: mine.loc[mine["role"] == role, "row"].to_numpy() for role in ("train", "test")}
    return out


def build_model():  # noqa: ANN201
    """The workload's model, built from its spec as medfl builds it."""
    from medfl.models.registry import build_model as from_spec

    return from_spec({**MODEL, "spatial_dims": SPATIAL_DIMS, "in_channels": 1, "num_classes": NUM_CLASSES})


def initial_state(seed: int) -> dict[str, Any]:
    """The initial global model, initialised as medfl initialises it."""
    import torch

    from medfl.method import derive_seed

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(derive_seed(seed, "init", "global"))
        return {k: v.detach().clone() for k, v in build_model().state_dict().items()}


@functools.lru_cache(maxsize=1)
def _model():  # noqa: ANN202
    """The plain loop's one model object, on the device: every client loads the global weights
    into it."""
    return build_model().to(DEVICE)


def _on_device(x: Any, y: Any) -> tuple[Any, Any]:
    """A batch on the device, channels-last where asked (as medfl's ``train_epochs`` does)."""
    import torch

    x, y = x.to(DEVICE, non_blocking=True), y.to(DEVICE, non_blocking=True)
    if CHANNELS_LAST and x.dim() in (4, 5):
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4 else torch.channels_last_3d)
    return x, y


def _autocast() -> Any:
    import contextlib

    import torch

    if AMP is None:
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if AMP == "bf16" else torch.float16
    return torch.autocast(device_type=torch.device(DEVICE).type, dtype=dtype)


def local_train(source: Any, rows: Any, state: dict[str, Any], seed: int, rnd: int, cid: str,
                batch_size: int) -> tuple[dict[str, Any], int, float]:
    """One client's round of the plain loop: returns (new weights, #examples, mean loss).

    Seeds as medfl does: torch's global seed and the DataLoader's shuffling generator derive
    from (run seed, round, client id).
    """
    import torch
    from torch.utils.data import DataLoader

    from medfl.method import derive_seed

    ds = source.make_dataset(source.table.iloc[rows], True)
    cseed = derive_seed(seed, rnd, cid)
    torch.manual_seed(cseed)
    gen = torch.Generator().manual_seed(derive_seed(cseed, "loader", "train"))
    pin = torch.device(DEVICE).type == "cuda"   # medfl's default pin_memory on CUDA
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True, generator=gen, pin_memory=pin)
    model = _model()
    model.load_state_dict(state)
    model.train()
    if CHANNELS_LAST:
        model.to(memory_format=torch.channels_last if SPATIAL_DIMS == 2 else torch.channels_last_3d)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    scaler = torch.amp.GradScaler(torch.device(DEVICE).type) if AMP == "fp16" else None
    losses, sizes = [], []
    t_loop = time.perf_counter()
    for x, y in loader:
        if x.shape[0] < 2:
            continue   # BatchNorm cannot train on one sample (medfl skips such a batch too)
        x, y = _on_device(x, y)
        opt.zero_grad(set_to_none=True)
        with _autocast():
            loss = torch.nn.functional.cross_entropy(model(x), y)
        losses.append(loss.detach())   # read once at the end: no wait for the GPU every step
        sizes.append(x.shape[0])
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
    total = sum(v * n for v, n in zip(torch.stack(losses).cpu().tolist(), sizes)) if losses else 0.0
    count = sum(sizes)
    _sync()
    TRAIN_CLOCK[0] += time.perf_counter() - t_loop
    if CHANNELS_LAST:
        model.to(memory_format=torch.contiguous_format)
    # the weights leave the device, as a client's reply does (medfl aggregates on the CPU)
    new = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return new, len(ds), total / max(count, 1)


def local_eval(source: Any, rows: Any, state: dict[str, Any]) -> tuple[int, int]:
    """Accuracy of ``state`` on one client's rows: returns (#correct, #samples)."""
    import torch
    from torch.utils.data import DataLoader

    ds = source.make_dataset(source.table.iloc[rows], False)
    model = _model()
    model.load_state_dict(state)
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in DataLoader(ds, batch_size=EVAL_BATCH_SIZE, shuffle=False):
            x, y = _on_device(x, y)
            with _autocast():
                correct += int((model(x).argmax(1) == y).sum())
    return correct, len(ds)


def weighted_average(states: list[dict[str, Any]], weights: list[float]) -> dict[str, Any]:
    """FedAvg: weighted average, in float64, cast back (integer buffers rounded)."""
    total = float(sum(weights))
    out = {}
    for k in states[0]:
        acc = sum((w / total) * s[k].double() for w, s in zip(weights, states))
        ref = states[0][k]
        out[k] = acc.to(ref.dtype) if ref.is_floating_point() else acc.round().to(ref.dtype)
    return out


def _durations(start: float, ends: list[float]) -> list[float]:
    out, prev = [], start
    for e in ends:
        out.append(e - prev)
        prev = e
    return out


def steady_round_s(rounds: list[float]) -> float:
    """Median seconds per round over rounds 2..R-1 (the first warms up, the last evaluates)."""
    inner = rounds[1:-1] if len(rounds) >= 3 else rounds
    return float(statistics.median(inner))


def _proc_status_mb(key: str) -> float | None:
    """A memory figure of this process from /proc/self/status (``VmHWM``, ``VmRSS``), MiB."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    """This process's peak resident set size (VmHWM, else getrusage's ru_maxrss), in MiB."""
    found = _proc_status_mb("VmHWM")
    if found is not None:
        return found
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def current_rss_mb() -> float:
    """This process's resident set size now (NaN where /proc is absent), in MiB."""
    found = _proc_status_mb("VmRSS")
    return float("nan") if found is None else found


# ------------------------------------------------------------------------------ the children
def child_plain(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    rows = client_rows(a.clients, a.samples_per_client, a.seed, a.rounds, a.batch_size)
    source = _source(a.clients, a.samples_per_client, a.seed)
    state = initial_state(a.seed)
    rss0 = current_rss_mb()
    t0 = time.perf_counter()
    ends: list[float] = []
    loops: list[float] = []
    clock0 = TRAIN_CLOCK[0]
    for r in range(1, a.rounds + 1):
        states, weights = [], []
        for cid in rows:  # medfl's client order
            s, n, _ = local_train(source, rows[cid]["train"], state, a.seed, r, cid, a.batch_size)
            states.append(s)
            weights.append(float(n))
        state = weighted_average(states, weights)
        del states
        _sync()
        ends.append(time.perf_counter())
        loops.append(TRAIN_CLOCK[0])
    t_train = time.perf_counter() - t0
    accs = []
    for cid in rows:
        c, n = local_eval(source, rows[cid]["test"], state)
        accs.append(c / n)
    wall = time.perf_counter() - t0
    torch.save(state, work / "plain_final.pt")
    return {"wall_s": wall, "train_s": t_train, "eval_s": wall - t_train,
            "round_s": _durations(t0, ends), "loop_s": _durations(clock0, loops),
            "mean_local_test_acc": sum(accs) / len(accs), "rss_before_run_mb": rss0,
            "final_state": str(work / "plain_final.pt")}


def _clock_train_epochs() -> None:
    """Count medfl's ``train_epochs`` (FedAvg's local training loop) in :data:`TRAIN_CLOCK`."""
    import medfl.hub as hub
    import medfl.training as training

    inner = training.train_epochs
    if getattr(inner, "_bench_clock", False):
        return

    @functools.wraps(inner)
    def clocked(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _sync()
            TRAIN_CLOCK[0] += time.perf_counter() - t

    clocked._bench_clock = True  # type: ignore[attr-defined]
    training.train_epochs = hub.train_epochs = clocked


#: ``--steps``: medfl's own steps around a client update, each timed where the engine calls it
#: (module, attribute, label); a class attribute is given as "Class.method".
STEPS: list[tuple[str, str, str]] = [
    ("medfl.engine.client", "_check_instruction", "instruction type walk (client)"),
    ("medfl.engine.client", "_seed_all", "seeding (client)"),
    ("medfl.hub", "HubAndSpoke.client_model", "global weights into the model (client)"),
    ("medfl.hub", "make_optimizer", "optimizer (client)"),
    ("medfl.context", "ClientContext.loader", "dataset and DataLoader (client)"),
    ("medfl.hub", "train_epochs", "training loop (client)"),
    ("medfl.hub", "get_state", "weights off the model (client)"),
    ("medfl.engine.client", "first_non_finite", "NaN check of the reply (client)"),
    ("medfl.engine.client", "validate_payload", "type walks + payload guard (client)"),
    ("medfl.engine.client", "_keep_state", "client state store (client)"),
    ("medfl.engine.exchanges", "Exchanges._request_sizes", "request wire sizes (coordinator)"),
    ("medfl.wire", "train_answer_size", "reply wire size (coordinator)"),
    ("medfl.engine.screening", "first_non_finite", "NaN check of the reply (coordinator)"),
    ("medfl.engine.screening", "Screening.reply_problem", "reply screening (coordinator)"),
    ("medfl.engine.runner", "Run.run_round", "whole round (coordinator)"),
]


def _clock_steps(plugin: "_DatasetPlugin") -> dict[str, list[float]]:
    """Wrap each of :data:`STEPS` with a clock that counts while ``plugin.counting`` is set
    (rounds 2..R-1); a call inside another call of the same step (recursion) is not counted
    again, under whichever name it was called (the engine's modules import some functions
    under their own names). Returns label -> [seconds, calls], filled as the run goes."""
    import importlib

    totals: dict[str, list[float]] = {}
    depths: dict[int, list[int]] = {}
    for module, attr, label in STEPS:
        owner: Any = importlib.import_module(module)
        name = attr
        if "." in attr:
            cls, name = attr.split(".")
            owner = getattr(owner, cls)
        inner = getattr(owner, name)
        inner = getattr(inner, "_bench_inner", inner)
        totals[label] = [0.0, 0]
        depth = depths.setdefault(id(inner), [0])

        def clocked(*args: Any, _inner: Any = inner, _label: str = label, _depth: list[int] = depth,
                    **kwargs: Any) -> Any:
            if not plugin.counting or _depth[0]:
                return _inner(*args, **kwargs)
            _depth[0] += 1
            t = time.perf_counter()
            try:
                return _inner(*args, **kwargs)
            finally:
                _sync()
                totals[_label][0] += time.perf_counter() - t
                totals[_label][1] += 1
                _depth[0] -= 1

        functools.update_wrapper(clocked, inner)
        clocked._bench_inner = inner  # type: ignore[attr-defined]
        setattr(owner, name, clocked)
    return totals


def child_medfl(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    from medfl.config import resolve_config
    from medfl.experiment import run_experiment

    plugin = ensure_plugin()  # plugin discovery happens once per process, before the clock starts
    build_model()   # imports what building the model imports (MONAI for a ResNet), as the plain loop does before its clock
    _clock_train_epochs()
    steps = _clock_steps(plugin) if getattr(a, "steps", False) else None
    if steps is not None:
        plugin.count_rounds(2, a.rounds - 1)   # the end of round 2 to the end of round R-1
    if getattr(a, "profile", None):
        plugin.profile_rounds(*((0, 1) if a.profile_first else (2, a.rounds - 1)), a.profile)
    cfg = resolve_config(fl_config(a.clients, a.rounds, a.samples_per_client, a.batch_size,
                                   a.seed, str(work / "runs")))
    rss0 = current_rss_mb()
    clock0 = TRAIN_CLOCK[0]
    t0 = time.perf_counter()
    out = run_experiment(cfg)
    wall = time.perf_counter() - t0
    m = plugin.marks
    run_dir = Path(out["dir"]) / "fedavg"
    summary = out["summaries"]["fedavg"]
    last = a.rounds
    res = {
        "wall_s": wall,
        "setup_s": m["run_start"] - t0,
        "rounds_before_last_s": m.get(f"round_end_{last - 1}", m["run_start"]) - m["run_start"],
        "last_round_train_s": m[f"client_end_{last}"] - m.get(f"round_end_{last - 1}", m["run_start"]),
        "last_round_aggregate_eval_write_s": m[f"round_end_{last}"] - m[f"client_end_{last}"],
        "finish_s": t0 + wall - m[f"round_end_{last}"],
        "plots_and_comparison_s": t0 + wall - m["run_end"],
        "round_s": _durations(m["run_start"], [m[f"round_end_{r}"] for r in range(1, last + 1)]),
        "loop_s": _durations(clock0, [m[f"loop_{r}"] for r in range(1, last + 1)]),
        "mean_local_test_acc": summary["final"]["local_test"]["accuracy"]["mean"],
        "rss_before_run_mb": rss0,
        "final_state": str(sorted((run_dir / "checkpoints").glob("round_*.pt"))[-1]),
        "run_dir": str(run_dir),
    }
    if steps is not None:
        res["steps"] = steps
        res["steps_client_updates"] = a.clients * max(a.rounds - 3, 0)   # rounds 3..R-1
    return res


def child_flower(a: argparse.Namespace, work: Path) -> dict[str, Any]:
    # Flower's telemetry would try the network (there may be none); it does no FL work.
    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    import logging

    import torch
    from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg
    from flwr.simulation import run_simulation

    if not a.flower_logs:
        logging.getLogger("flwr").setLevel(logging.WARNING)
    rows = client_rows(a.clients, a.samples_per_client, a.seed, a.rounds, a.batch_size)
    ids = list(rows)  # partition-id k is medfl's k-th client
    spec = (a.clients, a.samples_per_client, a.seed)
    seed, bs, threads = a.seed, a.batch_size, a.flower_client_cpus
    client_app = ClientApp()

    @client_app.train()
    def train(msg: Message, context: Context) -> Message:
        import torch as _t

        _t.set_num_threads(threads)
        cid = ids[int(context.node_config["partition-id"])]
        rnd = int(msg.content["config"]["server-round"])
        state = msg.content["arrays"].to_torch_state_dict()
        new, n, loss = local_train(_source(*spec), rows[cid]["train"], state, seed, rnd, cid, bs)
        return Message(RecordDict({"arrays": ArrayRecord(new),
                                   "metrics": MetricRecord({"num-examples": n, "loss": loss})}),
                       reply_to=msg)

    @client_app.evaluate()
    def evaluate(msg: Message, context: Context) -> Message:
        import torch as _t

        _t.set_num_threads(threads)
        cid = ids[int(context.node_config["partition-id"])]
        c, n = local_eval(_source(*spec), rows[cid]["test"], msg.content["arrays"].to_torch_state_dict())
        return Message(RecordDict({"metrics": MetricRecord({"num-examples": n, "accuracy": c / n})}),
                       reply_to=msg)

    server_app = ServerApp()
    found: dict[str, Any] = {}

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        t0 = time.perf_counter()
        n = a.clients
        strategy = FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_train_nodes=n,
                          min_available_nodes=n)
        marks: list[float] = []

        def clock(server_round: int, arrays: ArrayRecord) -> None:
            # no server-side evaluation: only notes when each round has been aggregated
            marks.append(time.perf_counter())

        result = strategy.start(grid=grid, initial_arrays=ArrayRecord(initial_state(seed)),
                                num_rounds=a.rounds, evaluate_fn=clock)
        found["round_s"] = _durations(marks[0], marks[1:])
        found["rounds_s"] = time.perf_counter() - t0
        final = result.arrays
        msgs = [Message(RecordDict({"arrays": final, "config": ConfigRecord({})}),
                        message_type=MessageType.EVALUATE, dst_node_id=node)
                for node in grid.get_node_ids()]
        replies = list(grid.send_and_receive(msgs))
        accs = [m.content["metrics"]["accuracy"] for m in replies if m.has_content()]
        found["server_s"] = time.perf_counter() - t0
        found["accs"] = accs
        found["errors"] = [str(m.error) for m in replies if m.has_error()]
        found["state"] = final.to_torch_state_dict()

    # on a GPU each client holds the whole GPU: one at a time, as plain and medfl train
    gpus = 1.0 if DEVICE.startswith("cuda") else 0.0
    backend = {"client_resources": {"num_cpus": a.flower_client_cpus, "num_gpus": gpus},
               "init_args": {"num_cpus": a.cpus}}
    rss0 = current_rss_mb()
    t0 = time.perf_counter()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=a.clients,
                   backend_config=backend)
    wall = time.perf_counter() - t0
    if len(found.get("accs", [])) != a.clients or not found.get("state"):
        raise RuntimeError(f"Flower simulation did not complete: {found.get('errors') or 'no result'}")
    torch.save({k: v for k, v in found["state"].items()}, work / "flower_final.pt")
    return {"wall_s": wall, "rounds_s": found["rounds_s"], "server_s": found["server_s"],
            "round_s": found["round_s"],
            "startup_shutdown_s": wall - found["server_s"],
            "mean_local_test_acc": sum(found["accs"]) / len(found["accs"]),
            "rss_before_run_mb": rss0, "final_state": str(work / "flower_final.pt")}


def run_child(a: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(a.cpus)
    if a.deterministic:   # exact float32 kernels: the ways can then be compared on a GPU too
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    # torch imports torch._dynamo (about 2 s) when the first optimizer is built; every way
    # pays that once per process, so pay it here, before the clock starts.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    work = Path(a.child_dir)
    work.mkdir(parents=True, exist_ok=True)
    fn = {"plain": child_plain, "medfl": child_medfl, "flower": child_flower}[a.child]
    res = fn(a, work)
    res["peak_rss_mb"] = peak_rss_mb()
    res["torch_threads"] = torch.get_num_threads()
    (work / "result.json").write_text(json.dumps(res))


# ------------------------------------------------------------------------------ the parent
def spawn(a: argparse.Namespace, mode: str, clients: int, rounds: int, work: Path, label: str
          ) -> dict[str, Any]:
    d = work / f"{label}"
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", mode, "--child-dir", str(d),
           "--clients", str(clients), "--rounds", str(rounds),
           "--samples-per-client", str(a.samples_per_client), "--batch-size", str(a.batch_size),
           "--seed", str(a.seed), "--cpus", str(a.cpus), "--workload", a.workload,
           "--flower-client-cpus", str(a.flower_client_cpus), "--device", a.device]
    if a.amp:
        cmd += ["--amp", a.amp]
    if a.channels_last:
        cmd.append("--channels-last")
    if a.deterministic:
        cmd.append("--deterministic")
    if a.flower_logs:
        cmd.append("--flower-logs")
    if getattr(a, "profile", None):
        cmd += ["--profile", str(Path(a.profile).resolve())] + (["--profile-first"] if a.profile_first else [])
    if getattr(a, "steps", False):
        cmd.append("--steps")
    print(f"  {label:<28s} ...", end="", flush=True)
    t0 = time.perf_counter()
    with open(d / "log.txt", "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(HERE.parent),
                              timeout=a.child_timeout)
    elapsed = time.perf_counter() - t0
    res_file = d / "result.json"
    if proc.returncode != 0 or not res_file.is_file():
        tail = "\n".join((d / "log.txt").read_text(errors="replace").splitlines()[-30:])
        print(f" FAILED (exit {proc.returncode}) after {elapsed:.1f}s")
        raise RuntimeError(f"{label} failed (exit {proc.returncode}); last lines of {d / 'log.txt'}:\n{tail}")
    res = json.loads(res_file.read_text())
    print(f" {res['wall_s']:7.2f} s run, peak RSS {res['peak_rss_mb']:7.1f} MiB "
          f"(child process {elapsed:.1f} s)", flush=True)
    return res


def _med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def compare_states(p1: str, p2: str) -> float:
    import torch

    a = torch.load(p1, weights_only=True, map_location="cpu")
    b = torch.load(p2, weights_only=True, map_location="cpu")
    a = a.get("method", {}).get("global", a) if "method" in a else a
    b = b.get("method", {}).get("global", b) if "method" in b else b
    if set(a) != set(b):
        return float("inf")
    # floating-point entries only: integer buffers (BatchNorm's num_batches_tracked) are
    # averaged and rounded by medfl and the plain loop, and truncated by Flower's float32 mean
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a if a[k].is_floating_point())


def profile_steady_rounds(a: argparse.Namespace) -> int:
    """``--profile``: one medfl run in a fresh process, profiled over its steady rounds; print
    where the time goes (by own time and by cumulative time)."""
    import pstats

    if a.rounds < (2 if a.profile_first else 4):
        raise SystemExit(f"--profile needs --rounds >= 4 (rounds 3..R-1 are profiled; with --profile-first "
                         f">= 2), got {a.rounds}")
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="medfl-bench-"))
    try:
        res = spawn(a, "medfl", a.clients, a.rounds, work, "medfl-profiled")
        if a.profile_first:
            print(f"\nround 1 under cProfile: {res['round_s'][0]:.3f} s, round 2 (not profiled) "
                  f"{res['round_s'][1]:.3f} s (profiling slows Python code; compare shares, not seconds)")
        else:
            steady = res["round_s"][2:a.rounds - 1]
            print(f"\nrounds 3..{a.rounds - 1} under cProfile: {sum(steady) / len(steady):.3f} s/round "
                  f"(profiling slows Python code; compare shares, not seconds)")
        stats = pstats.Stats(a.profile)
        stats.sort_stats("tottime").print_stats(25)
        stats.sort_stats("cumulative").print_stats(40)
        print(f"stats written to {a.profile} (python -m pstats {a.profile})")
    finally:
        if not a.keep and not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def time_steps(a: argparse.Namespace) -> int:
    """``--steps``: one medfl run in a fresh process with each of medfl's own steps of a round
    clocked (rounds 3..R-1); print milliseconds per client update (the plain loop does some of
    these too: a model load, a DataLoader, weights off the model)."""
    if a.rounds < 4:
        raise SystemExit(f"--steps needs --rounds >= 4 (rounds 3..R-1 are timed), got {a.rounds}")
    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="medfl-bench-"))
    try:
        res = spawn(a, "medfl", a.clients, a.rounds, work, "medfl-steps")
    finally:
        if not a.keep and not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    n = max(int(res["steps_client_updates"]), 1)
    rounds = max(a.rounds - 3, 1)
    print(f"\n{describe_model()}, {a.clients} clients, {describe_compute()}: medfl's steps in rounds 3..{a.rounds - 1} "
          f"({n} client updates), ms per client update (a step nested in another is in both):")
    for label, (secs, calls) in res["steps"].items():
        if label.startswith("whole round"):
            continue
        print(f"  {label:<46s} {1000 * secs / n:8.2f} ms   ({calls} calls)")
    whole = res["steps"].get("whole round (coordinator)", [0.0, 0])[0]
    print(f"  {'a whole round, per client':<46s} {1000 * whole / n:8.2f} ms   ({whole / rounds:.3f} s a round)")
    if a.json:
        Path(a.json).write_text(json.dumps({"steps_ms_per_client_update": {
            k: 1000 * v[0] / n for k, v in res["steps"].items()}, "client_updates": n,
            "settings": {"workload": a.workload, "clients": a.clients, "rounds": a.rounds, "device": a.device}},
            indent=2) + "\n")
        print(f"Figures written to {a.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Wall time and memory of the same FedAvg job run as a plain PyTorch loop, with "
                    "medfl's in-process engine and with Flower's simulation.",
        epilog="Targets: medfl <= 1.05x plain loop, medfl <= 0.5x Flower simulation, peak memory "
               "with 100 clients <= 1.5x that with 10. See benchmarks/README.md.")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="tiny",
                   help="the job: tiny (small_cnn, 1x28x28, 10 clients; the default), resnet2d (ResNet-10 width 16, "
                        "1x128x128, 20 clients), resnet3d (3D ResNet-10 width 16, 1x32^3, 4 clients); the options "
                        "below override its sizes")
    p.add_argument("--clients", type=int, default=None, help="number of clients (default: the workload's)")
    p.add_argument("--rounds", type=int, default=None, help="FedAvg rounds (default: the workload's)")
    p.add_argument("--samples-per-client", type=int, default=None,
                   help="samples per client, split 80/20 into train/test (default: the workload's)")
    p.add_argument("--batch-size", type=int, default=None, help="local batch size (default: the workload's)")
    p.add_argument("--repeats", type=int, default=5,
                   help="timed runs of plain and medfl, interleaved; medians are reported (default 5)")
    p.add_argument("--flower-repeats", type=int, default=1,
                   help="timed runs of Flower (default 1: it is slow and far from the target)")
    p.add_argument("--skip-flower", action="store_true", help="do not run Flower's simulation")
    p.add_argument("--memory-only", action="store_true", help="only the peak-memory measurement")
    p.add_argument("--skip-memory", action="store_true", help="skip the peak-memory measurement")
    p.add_argument("--memory-clients", type=str, default="10,100",
                   help="client counts of the memory measurement, comma-separated (default 10,100)")
    p.add_argument("--memory-rounds", type=int, default=2,
                   help="rounds of the memory measurement (default 2)")
    p.add_argument("--seed", type=int, default=0, help="seed of data, init and shuffling (default 0)")
    p.add_argument("--cpus", type=int, default=os.cpu_count() or 1,
                   help="torch threads (plain, medfl) and Ray CPUs (Flower) (default: all cores)")
    p.add_argument("--flower-client-cpus", type=int, default=None,
                   help="num_cpus of each Flower client (default: --cpus, i.e. one client at a time "
                        "with all cores, as plain and medfl run)")
    p.add_argument("--device", default="cpu",
                   help="where every way trains and evaluates: cpu (the default), cuda, cuda:N (medfl's fl.device)")
    p.add_argument("--amp", choices=["bf16", "fp16"], default=None,
                   help="mixed precision of every way (medfl's train.amp; fp16 with a gradient scaler); "
                        "default: full precision")
    p.add_argument("--channels-last", action="store_true",
                   help="channels-last model and batches in every way (medfl's train.channels_last)")
    p.add_argument("--deterministic", action="store_true",
                   help="on a GPU: cuDNN's deterministic kernels and no TF32 (PyTorch's default lets cuDNN "
                        "convolve in TF32), so that plain and medfl train to the same model; slower")
    p.add_argument("--flower-logs", action="store_true", help="keep Flower's INFO logs (in the child log)")
    p.add_argument("--json", metavar="OUT", help="also write every figure to this JSON file")
    p.add_argument("--profile", metavar="OUT",
                   help="instead of timing: run medfl once under cProfile from the end of round 2 to the end "
                        "of round R-1 (the steady rounds; needs --rounds >= 4), write the stats to OUT (pstats) "
                        "and print the functions that take the most time")
    p.add_argument("--profile-first", action="store_true",
                   help="with --profile: profile round 1 instead (from the start of the run: the payload guard's "
                        "reference of every client, first model builds); needs --rounds >= 2")
    p.add_argument("--steps", action="store_true",
                   help="instead of timing the ways: run medfl once with each of its own steps around a client "
                        "update clocked (seeding, model load, checks, payload guard, wire sizes...) over rounds "
                        "3..R-1 (needs --rounds >= 4) and print milliseconds per client update")
    p.add_argument("--workdir", help="where runs are written (default: a temporary directory, removed)")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    p.add_argument("--child-timeout", type=float, default=900, help=argparse.SUPPRESS)
    p.add_argument("--child", choices=["plain", "medfl", "flower"], help=argparse.SUPPRESS)
    p.add_argument("--child-dir", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    w = set_workload(a.workload)
    set_compute(a.device, a.amp, a.channels_last)
    for opt, key in (("clients", "clients"), ("rounds", "rounds"), ("samples_per_client", "samples"),
                     ("batch_size", "batch_size")):
        if getattr(a, opt) is None:
            setattr(a, opt, int(w[key]))
    if a.flower_client_cpus is None:
        a.flower_client_cpus = a.cpus
    if a.child:
        run_child(a)
        return 0
    if a.profile:
        return profile_steady_rounds(a)
    if a.steps:
        return time_steps(a)

    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="medfl-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "settings": {"clients": a.clients, "rounds": a.rounds, "samples_per_client": a.samples_per_client,
                     "train_per_client": None, "batch_size": a.batch_size, "workload": a.workload,
                     "model": dict(MODEL), "input": [1, *[IMAGE_SIZE] * SPATIAL_DIMS], "classes": NUM_CLASSES,
                     "optimizer":
                     f"sgd lr {LR} momentum {MOMENTUM}", "local_epochs": 1, "seed": a.seed,
                     "cpus": a.cpus, "flower_client_cpus": a.flower_client_cpus, "device": a.device,
                     "amp": a.amp, "channels_last": a.channels_last, "deterministic": a.deterministic,
                     "repeats": a.repeats, "python": sys.version.split()[0]},
    }
    try:
        import torch

        import medfl

        report["settings"].update(torch=torch.__version__, medfl=medfl.__version__)
        if a.device.startswith("cuda"):
            if not torch.cuda.is_available():
                raise SystemExit(f"--device {a.device}: torch sees no CUDA device on this machine")
            report["settings"]["gpu"] = torch.cuda.get_device_name(torch.device(a.device))
        try:
            import flwr

            report["settings"]["flwr"] = flwr.__version__
        except ImportError:
            pass
        n_train = int(round(CLIENT_SPLIT["train"] * a.samples_per_client))
        report["settings"]["train_per_client"] = f"about {n_train}"
        print(f"FedAvg, {a.clients} clients x {a.rounds} rounds, {describe_model()} "
              f"({NUM_CLASSES} classes), {a.samples_per_client} samples per client "
              f"(80% train / 20% test), batch {a.batch_size}, SGD lr {LR} momentum {MOMENTUM}, "
              f"1 local epoch, {a.cpus} CPU thread(s), on {describe_compute()}; every run in a fresh process.")
        if not a.memory_only:
            ways = ["plain", "medfl"] + ([] if a.skip_flower else ["flower"])
            fr = a.flower_repeats
            runs: dict[str, list[dict[str, Any]]] = {w: [] for w in ways}
            print(f"\nWall time ({a.repeats} interleaved repeat(s); Flower: {fr if 'flower' in ways else 0}):")
            for i in range(max(a.repeats, fr if "flower" in ways else 0)):
                # ABBA order (plain, medfl, then medfl, plain...): a drift of the machine's
                # speed during the benchmark then biases neither way
                order = ["plain", "medfl"] if i % 2 == 0 else ["medfl", "plain"]
                for w in order + [w for w in ways if w not in order]:
                    if (w == "flower" and i >= fr) or (w != "flower" and i >= a.repeats):
                        continue
                    runs[w].append(spawn(a, w, a.clients, a.rounds, work, f"{w}-{i + 1}"))
            report["timing"] = _timing_report(a, runs)
        if not a.skip_memory:
            counts = [int(c) for c in a.memory_clients.split(",") if c.strip()]
            print(f"\nPeak memory of medfl ({a.memory_rounds} rounds, {a.samples_per_client} samples per "
                  f"client, fresh process each):")
            mem = {}
            for c in counts:
                mem[c] = spawn(a, "medfl", c, a.memory_rounds, work, f"memory-medfl-{c}-clients")
            report["memory"] = _memory_report(counts, mem)
    finally:
        if not a.keep and not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
        elif a.keep or a.workdir:
            print(f"\nRun directories kept in {work}")
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2, default=str))
        print(f"\nFigures written to {a.json}")
    return 0


def _besides_training(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    """Each way's steady rounds split into its training loops and everything else (medians
    over the repeats of each run's median over rounds 2..R-1), medfl's own work per round
    (its other work minus the plain loop's) and the per-round ratio the two would have if
    medfl's loops ran as fast as the plain loop's: ``(plain loops + medfl's other work) /
    (plain loops + plain's other work)``. Empty when a run did not clock its loops."""
    if not all(runs.get(w) and all("loop_s" in r for r in runs[w]) for w in ("plain", "medfl")):
        return {}
    out: dict[str, Any] = {}
    for w in ("plain", "medfl"):
        loops = _med([steady_round_s(r["loop_s"]) for r in runs[w]])
        besides = _med([steady_round_s([t - c for t, c in zip(r["round_s"], r["loop_s"])]) for r in runs[w]])
        out[w] = {"loop_s": loops, "besides_s": besides}
    p, m = out["plain"], out["medfl"]
    out["loop_ratio"] = m["loop_s"] / p["loop_s"] if p["loop_s"] else float("nan")
    out["medfl_own_s"] = m["besides_s"] - p["besides_s"]
    out["per_round_equal_training"] = (p["loop_s"] + m["besides_s"]) / (p["loop_s"] + p["besides_s"])
    return out


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def _timing_report(a: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    walls = {w: [r["wall_s"] for r in rs] for w, rs in runs.items()}
    med = {w: _med(v) for w, v in walls.items()}
    steady = {w: _med([steady_round_s(r["round_s"]) for r in rs]) for w, rs in runs.items()}
    out: dict[str, Any] = {"median_wall_s": med, "min_wall_s": {w: min(v) for w, v in walls.items()},
                           "all_wall_s": walls, "steady_round_s": steady}
    plain, medfl_ = runs["plain"], runs["medfl"]
    plain_train = _med([r["train_s"] for r in plain])
    plain_eval = _med([r["eval_s"] for r in plain])
    acc = {w: rs[0]["mean_local_test_acc"] for w, rs in runs.items()}
    diff_pm = compare_states(plain[0]["final_state"], medfl_[0]["final_state"])
    paired = [m["wall_s"] / p["wall_s"] for p, m in zip(plain, medfl_)]
    out["median_paired_ratio_medfl_plain"] = _med(paired)
    out.update(plain_train_s=plain_train, plain_final_eval_s=plain_eval, mean_local_test_acc=acc,
               max_abs_diff_final_model_plain_vs_medfl=diff_pm, paired_ratios_medfl_plain=paired)
    keys = ["setup_s", "rounds_before_last_s", "last_round_train_s", "last_round_aggregate_eval_write_s",
            "finish_s", "plots_and_comparison_s"]
    out["medfl_breakdown_s"] = {k: _med([r[k] for r in medfl_]) for k in keys}

    def spread(w: str) -> str:
        v = walls[w]
        return f"{min(v):6.2f}-{max(v):6.2f}" if len(v) > 1 else f"{'':13s}"

    print("\nResults (wall time of the run itself, after imports; median of the repeats):")
    print(f"  {'way':<44s} {'wall s':>7s} {'min-max':>13s} {'vs plain':>8s} {'s/round':>8s}  final acc")
    print(f"  {'plain PyTorch loop (train + final eval)':<44s} {med['plain']:7.2f} {spread('plain')} "
          f"{1.0:7.2f}x {steady['plain']:8.3f}  {acc['plain']:.4f}")
    print(f"  {'  of which training rounds':<44s} {plain_train:7.2f}")
    print(f"  {'  of which final evaluation':<44s} {plain_eval:7.2f}")
    print(f"  {'medfl in-process engine':<44s} {med['medfl']:7.2f} {spread('medfl')} "
          f"{med['medfl'] / med['plain']:7.2f}x {steady['medfl']:8.3f}  {acc['medfl']:.4f}")
    b = out["medfl_breakdown_s"]
    print(f"  {'  setup (config, partition, partition.csv)':<44s} {b['setup_s']:7.2f}")
    print(f"  {'  rounds 1..R-1 (train, aggregate, write)':<44s} {b['rounds_before_last_s']:7.2f}")
    print(f"  {'  round R client training':<44s} {b['last_round_train_s']:7.2f}")
    print(f"  {'  round R aggregate + final eval + writes':<44s} {b['last_round_aggregate_eval_write_s']:7.2f}")
    print(f"  {'  finish (summary.json, plots, comparison)':<44s} {b['finish_s']:7.2f}")
    print(f"  {'    of which plots + comparison.csv':<44s} {b['plots_and_comparison_s']:7.2f}")
    if "flower" in runs:
        fl = runs["flower"]
        f_server = _med([r["server_s"] for r in fl])
        diff_pf = compare_states(plain[0]["final_state"], fl[0]["final_state"])
        out.update(flower_serverapp_s=f_server, max_abs_diff_final_model_plain_vs_flower=diff_pf)
        print(f"  {'Flower simulation (run_simulation, Ray)':<44s} {med['flower']:7.2f} {spread('flower')} "
              f"{med['flower'] / med['plain']:7.2f}x {steady['flower']:8.3f}  {acc['flower']:.4f}")
        print(f"  {'  of which ServerApp (rounds + final eval)':<44s} {f_server:7.2f}")
        print(f"  {'  of which Ray start-up and shutdown':<44s} {med['flower'] - f_server:7.2f}")
    print("\n  s/round: median time of rounds 2..R-1 (round 1 warms up, round R evaluates).")
    split = _besides_training(runs)
    out["besides_training"] = split
    if split:
        p_, m_ = split["plain"], split["medfl"]
        print(f"  Training loops, s/round: plain {p_['loop_s']:.3f}, medfl {m_['loop_s']:.3f} (x{split['loop_ratio']:.3f}:"
              f" the same steps; how fast each process happened to train)")
        print(f"  Besides training, s/round: plain {p_['besides_s']:.3f}, medfl {m_['besides_s']:.3f}: medfl's own "
              f"work {1000 * split['medfl_own_s']:.0f} ms a round ({1000 * split['medfl_own_s'] / a.clients:.1f} ms a client)")
        print(f"  Per round at equal training speed (plain's loops + each way's other work): "
              f"{split['per_round_equal_training']:.3f}")
    print(f"  medfl/plain per repeat (ABBA order): {', '.join(f'{x:.3f}' for x in paired)}; "
          f"median {_med(paired):.3f}")
    print(f"  Final model (floating-point entries), plain vs medfl: max |difference| = {diff_pm:.3g} "
          f"({'identical' if diff_pm == 0 else 'differs'})")
    if "flower" in runs:
        print(f"  Final model (floating-point entries), plain vs Flower: max |difference| = "
              f"{out['max_abs_diff_final_model_plain_vs_flower']:.3g} (Flower averages in float32, in reply order)")
    print("  medfl ran with eval_every 0 and progress off; it still evaluates every client once at the\n"
          "  end (all registered metrics), writes partition/metrics/train_metrics CSVs, a checkpoint\n"
          "  and status.json every round, summary.json, comparison.csv and the plots. The plain loop\n"
          "  and Flower are timed with the same final evaluation (accuracy only).")
    if "flower" in runs:
        print("  Flower's time includes its worker's one-off import of torch's optimizer machinery\n"
              "  (about 2 s, in round 1), which the other two pay before their clock starts.")
    r_plain = med["medfl"] / med["plain"]
    r_min = min(walls["medfl"]) / min(walls["plain"])
    r_steady = steady["medfl"] / steady["plain"]
    targets: dict[str, Any] = {"medfl_vs_plain": {"ratio": r_plain, "target": TARGET_PLAIN,
                                                  "pass": r_plain <= TARGET_PLAIN},
                               "medfl_vs_plain_min": r_min, "medfl_vs_plain_per_round": r_steady,
                               "medfl_vs_plain_per_round_equal_training": split.get("per_round_equal_training")}
    print("\nTargets (ratio of median wall times):")
    eq = f", at equal training speed {split['per_round_equal_training']:.3f}" if split else ""
    print(f"  medfl / plain loop = {r_plain:5.3f}  (target <= {TARGET_PLAIN})  {_verdict(r_plain <= TARGET_PLAIN)}"
          f"   [min/min {r_min:.3f}, per round {r_steady:.3f}{eq}]")
    if "flower" in runs:
        r_fl = med["medfl"] / med["flower"]
        r_fl_srv = med["medfl"] / out["flower_serverapp_s"]
        r_fl_steady = steady["medfl"] / steady["flower"]
        targets["medfl_vs_flower"] = {"ratio": r_fl, "target": TARGET_FLOWER, "pass": r_fl <= TARGET_FLOWER}
        targets["medfl_vs_flower_serverapp"] = r_fl_srv
        targets["medfl_vs_flower_per_round"] = r_fl_steady
        print(f"  medfl / Flower     = {r_fl:5.3f}  (target <= {TARGET_FLOWER})  {_verdict(r_fl <= TARGET_FLOWER)}"
              f"   [without Ray start-up/shutdown {r_fl_srv:.3f}, per round {r_fl_steady:.3f}]")
    out["targets"] = targets
    out["runs"] = runs
    return out


def _memory_report(counts: list[int], mem: dict[int, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"peak_rss_mb": {c: mem[c]["peak_rss_mb"] for c in counts},
                           "rss_before_run_mb": {c: mem[c]["rss_before_run_mb"] for c in counts},
                           "wall_s": {c: mem[c]["wall_s"] for c in counts}}
    print("\n  clients  peak RSS MiB  RSS before the run MiB  growth during the run MiB")
    for c in counts:
        m = mem[c]
        print(f"  {c:7d}  {m['peak_rss_mb']:12.1f}  {m['rss_before_run_mb']:22.1f}  "
              f"{m['peak_rss_mb'] - m['rss_before_run_mb']:25.1f}")
    if len(counts) >= 2:
        lo, hi = counts[0], counts[-1]
        ratio = mem[hi]["peak_rss_mb"] / mem[lo]["peak_rss_mb"]
        out["ratio"] = ratio
        out["target"] = {"ratio": ratio, "target": TARGET_MEMORY, "pass": ratio <= TARGET_MEMORY}
        print(f"\n  peak memory {hi} clients / {lo} clients = {ratio:5.3f}  (target <= {TARGET_MEMORY})  "
              f"{_verdict(ratio <= TARGET_MEMORY)}")
    return out


if __name__ == "__main__":
    # Run from an importable module ``engine_overhead`` rather than ``__main__``, so that the
    # functions Flower ships to its Ray workers are pickled by reference and resolve there.
    sys.path.insert(0, str(HERE))
    import engine_overhead

    sys.exit(engine_overhead.main())
