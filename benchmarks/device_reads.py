#!/usr/bin/env python
"""Where a round makes the device wait: medfl's reads off the tensors' device, by line.

On a GPU, every ``.cpu()``, ``.item()``, ``.tolist()``, ``nonzero`` or ``unique`` waits for
the device and copies off it: a step that reads each tensor of a model one by one pays that
once per tensor (what made a GPU round twice as slow in issue 50). A CPU run hides the cost,
but makes the same calls, so this script counts them on any machine
(:class:`medfl.guard.device.DeviceReads`) and names the medfl line that made each one.

The same tiny job runs twice in this process, with ``R`` and ``R + 1`` rounds; the
difference is one round's reads, divided by the clients for a client update's (the first
round's one-off work, such as the guard's reference, cancels out). The guard scans on the
device (``medfl.guard.device.SCAN = "device"``), as it does for a reply on a GPU. Run with
``PYTHONPATH=<an older checkout>`` it counts that checkout's reads (before issue 50, the
guard read a reply on the host, tensor by tensor).

Usage::

    python benchmarks/device_reads.py                       # ResNet-10 width 8, 3 clients, CPU
    python benchmarks/device_reads.py --device cuda         # the same on a GPU
    python benchmarks/device_reads.py --model small_cnn --clients 4 --top 30
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
import traceback
from pathlib import Path
from typing import Any

from torch.overrides import TorchFunctionMode

from medfl.config import resolve_config
from medfl.experiment import run_experiment

__all__ = ["ByLine", "count_reads", "main"]


def _short(path: str) -> str:
    """A file's name from its package folder on (``medfl/...`` or ``plugins/...``)."""
    at = max(path.rfind("/medfl/"), path.rfind("/plugins/"))
    return path[at + 1:] if at >= 0 else path


class ByLine(TorchFunctionMode):
    """Counts reads off the device as :class:`medfl.guard.device.DeviceReads` does (the same
    calls), each by the last medfl (or built-in plugin) line on the stack: ``"<call>
    <file>:<line> <function>"``. Defined here, not imported, so that the script measures an
    older checkout too (``PYTHONPATH=<checkout>``), before the guard had that class."""

    READS = frozenset({"cpu", "item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "unique", "_unique2"})

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.lines: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        """Count ``func`` (by its medfl line) when it reads off the device, then call it."""
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.count += 1
            ours = [f for f in traceback.extract_stack()[:-1] if "/medfl/" in f.filename or "/plugins/" in f.filename]
            if ours:
                f = ours[-1]
                self.lines[f"{name} {_short(f.filename)}:{f.lineno} {f.name}"] += 1
        return func(*args, **(kwargs or {}))


def count_reads(a: argparse.Namespace, rounds: int, root: Path) -> ByLine:
    """Run the job with ``rounds`` rounds under :class:`ByLine`; return the counter."""
    cfg = {"name": f"reads{rounds}", "output_dir": str(root / "runs"), "seed": 0, "rounds": rounds,
           "num_clients": a.clients, "progress": False, "device": a.device,
           "dataset": {"name": "synthetic2d", "root": str(root / "data"), "num_samples": 32 * a.clients,
                       "num_classes": 2, "image_size": a.size, "noise": 0.5},
           "partition": {"name": "iid"},
           "model": {"name": a.model, "width": a.width}, "train": {"batch_size": 8, "lr": 0.05},
           "methods": [{"name": a.method}]}
    with ByLine() as counter:
        run_experiment(resolve_config(cfg))
    return counter


def main() -> None:
    """Count a round's reads off the device by medfl line and print them."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", help="the run's device (default cpu; e.g. cuda)")
    ap.add_argument("--model", default="resnet10", help="registered model (default resnet10)")
    ap.add_argument("--width", type=int, default=8, help="model width (default 8)")
    ap.add_argument("--size", type=int, default=16, help="image side (default 16)")
    ap.add_argument("--clients", type=int, default=3, help="clients (default 3)")
    ap.add_argument("--rounds", type=int, default=2, help="R: the runs have R and R + 1 rounds (default 2)")
    ap.add_argument("--method", default="fedavg", help="method (default fedavg)")
    ap.add_argument("--top", type=int, default=20, help="lines printed (default 20)")
    a = ap.parse_args()
    if a.rounds < 1 or a.clients < 2:
        raise SystemExit(f"--rounds must be >= 1 and --clients >= 2 (got {a.rounds}, {a.clients})")
    try:   # the guard scans on the device, as for a reply on a GPU (a checkout before issue 50: on the host)
        import medfl.guard.device as device_scan

        device_scan.SCAN = "device"
    except ImportError:
        pass
    os.environ.setdefault("MEDFL_NO_PLOTS", "1")
    with tempfile.TemporaryDirectory(prefix="medfl-reads-") as tmp:
        short = count_reads(a, a.rounds, Path(tmp) / "a")
        long = count_reads(a, a.rounds + 1, Path(tmp) / "b")
    one_round = long.lines - short.lines
    total = sum(one_round.values())
    print(f"{a.model} width {a.width}, {a.clients} clients, {a.method}, device {a.device}: one round reads off the "
          f"device {total} times ({total / a.clients:.1f} per client update); the runs: {short.count} "
          f"({a.rounds} rounds) and {long.count} ({a.rounds + 1})")
    for line, n in one_round.most_common(a.top):
        print(f"  {n:6d}  {n / a.clients:7.1f}/update  {line}")


if __name__ == "__main__":
    main()
