"""Cost of the payload guard (:mod:`medfl.guard`) on a realistic client.

A client with 500 single-channel 128x128 images stored as cached ``.npy`` arrays (medfl's
:class:`~medfl.data.source.ArrayDataset`, split 350 train / 50 val / 100 test, 2 classes)
replies with a ResNet-18 (2D, 11.2 M parameters). The script prints:

- the time to build the client's reference (one pass over its 500 images, including
  reading them from disk) and its memory (probes, label vectors, prefilter tables);
- the time of one check of the ResNet-18 reply in float32, float16, bfloat16 and int8
  (per-tensor quantised), of a metrics dict, and of an image leak (to show it is caught);
- the peak of NumPy memory allocated during a check (``tracemalloc``).

Usage::

    python benchmarks/payload_guard.py                 # about a minute on 2 cores
    python benchmarks/payload_guard.py --zscore        # images of mean 0, std 1
    python benchmarks/payload_guard.py --images 200 --size 64 --repeats 3
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from medfl.data.source import ArrayDataset
from medfl.guard import ContentGuard, clear_reference_cache
from medfl.messages import PayloadError


def _write_images(root: Path, n: int, size: int, zscore: bool, seed: int = 0) -> list[str]:
    """``n`` smooth-plus-noise images, normalised per image to [0, 1] (``normalize: minmax``)
    or to mean 0 and standard deviation 1 (``zscore``)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size] / size
    names = []
    for i in range(n):
        img = np.exp(-((yy - rng.uniform(0.2, 0.8)) ** 2 + (xx - rng.uniform(0.2, 0.8)) ** 2) / 0.05)
        img = img + rng.normal(0, 0.2, img.shape)
        img = (img - img.mean()) / img.std() if zscore else (img - img.min()) / (img.max() - img.min())
        name = f"s{i:05d}.npy"
        np.save(root / name, img[None].astype(np.float32))
        names.append(name)
    return names


def _quantise_int8(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, w in state.items():
        if w.is_floating_point():
            scale = w.abs().max().clamp_min(1e-12) / 127
            out[k] = (w / scale).round().clamp(-127, 127).to(torch.int8)
        else:
            out[k] = w
    return out


def _time(fn: Callable[[], Any], repeats: int) -> tuple[float, float]:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), min(times)


def main() -> None:
    """Build a client, time its reference and the check of typical replies, print figures."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--images", type=int, default=500, help="images of the client (default 500)")
    ap.add_argument("--size", type=int, default=128, help="image side (default 128)")
    ap.add_argument("--repeats", type=int, default=5, help="checks timed per reply (default 5)")
    ap.add_argument("--zscore", action="store_true", help="z-scored images (default: min-max to [0, 1])")
    args = ap.parse_args()
    torch.set_num_threads(1)

    from medfl.models.registry import build_model

    with tempfile.TemporaryDirectory(prefix="medfl-guard-bench-") as tmp:
        root = Path(tmp)
        names = _write_images(root, args.images, args.size, args.zscore)
        labels = np.random.default_rng(1).integers(0, 2, args.images)
        n_train, n_val = int(0.7 * args.images), int(0.1 * args.images)
        cuts = {"train": slice(0, n_train), "val": slice(n_train, n_train + n_val),
                "test": slice(n_train + n_val, args.images)}
        datasets = {s: ArrayDataset(names[c], labels[c], root=root) for s, c in cuts.items()}

        clear_reference_cache()
        guard = ContentGuard("0", datasets)
        t0 = time.perf_counter()
        guard.index()
        build = time.perf_counter() - t0
        stats = guard.stats()
        t0 = time.perf_counter()
        ContentGuard("0", datasets).index()          # the next round's guard: cached reference
        cached = time.perf_counter() - t0

        model = build_model({"name": "resnet18", "spatial_dims": 2, "in_channels": 1, "num_classes": 2})
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        params = sum(v.numel() for v in sd.values())
        replies = {
            "ResNet-18 float32": sd,
            "ResNet-18 float16": {k: v.half() if v.is_floating_point() else v for k, v in sd.items()},
            "ResNet-18 bfloat16": {k: v.bfloat16() if v.is_floating_point() else v for k, v in sd.items()},
            "ResNet-18 int8 (per-tensor)": _quantise_int8(sd),
            "metrics (5 scalars)": {"loss": 0.41, "accuracy": 0.83, "auc": 0.9, "n": 350, "lr": 1e-3},
        }
        print(f"client: {args.images} images 1x{args.size}x{args.size} (.npy, "
              f"{'z-scored' if args.zscore else 'min-max to [0, 1]'}), splits "
              f"{ {s: c.stop - c.start for s, c in cuts.items()} }")
        print(f"reference: built in {build:.2f} s ({1000 * build / args.images:.2f} ms per image, reading "
              f"included); next round's guard {1000 * cached:.1f} ms (cached)")
        print(f"  {stats['samples']} samples, {stats['unprotected_samples']} unprotected, "
              f"{stats['value_probes']} value probes, gram probes {stats['gram_probes']}, "
              f"{stats['label_vectors']} label vectors")
        print(f"  memory: reference {stats['reference_bytes'] / 2**20:.2f} MiB "
              f"({stats['reference_bytes'] / stats['samples']:.0f} bytes per sample) + prefilter tables "
              f"{stats['table_bytes'] / 2**20:.0f} MiB")
        print(f"check of one reply (median and min of {args.repeats}; {params / 1e6:.1f} M values for the model):")
        for what, reply in replies.items():
            med, best = _time(lambda: guard.check(reply, "reply"), args.repeats)
            tracemalloc.start()
            guard.check(reply, "reply")
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            print(f"  {what:<30} {1000 * med:8.1f} ms (min {1000 * best:.1f})   NumPy peak {peak / 2**20:6.1f} MiB")
        leak = {**sd, "x": torch.stack([datasets["train"][i][0] for i in range(8)])}
        t0 = time.perf_counter()
        try:
            guard.check(leak, "reply")
            print("  ResNet-18 + 8 training images: NOT caught")
        except PayloadError as exc:
            print(f"  ResNet-18 + 8 training images: caught in {1000 * (time.perf_counter() - t0):.0f} ms: "
                  f"{str(exc)[:110]}...")


if __name__ == "__main__":
    main()
