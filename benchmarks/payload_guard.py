"""Cost of the payload guard (:mod:`medfl.guard`) on a realistic client.

A client with 500 single-channel 128x128 images stored as cached ``.npy`` arrays (medfl's
:class:`~medfl.data.source.ArrayDataset`, split 350 train / 50 val / 100 test, 2 classes)
replies with a ResNet-18 (2D, 11.2 M parameters). The script prints:

- the time to build the client's reference (one pass over its 500 images, including
  reading them from disk) and its memory (probes, label vectors, prefilter tables);
- the time of one check of the ResNet-18 reply in float32, float16, bfloat16 and int8
  (per-tensor quantised), of a metrics dict, and of an image leak (to show it is caught);
- the peak of NumPy memory allocated during a check (``tracemalloc``), and how many times the
  check reads off the tensors' device (``.cpu()``, ``.item()``, ``nonzero``...: on a GPU each
  waits for it; a figure any machine measures the same);
- whether the plain mistakes of issue 38 (item 4) with 8 training images are caught, and
  the time of that check: scaled by 0.5, uint8 with a per-image min-max, halved (2 x 2
  means), 4 x 4 crops, plus 1e-6 noise.

``--fixture pathmnist|mias|abide`` takes the client's images from a fixture in its real
layout (``medfl.fixtures``, prepared as the tests do: PathMNIST 3 x 28 x 28, MIAS 1 x 128 x
128 with its black background, ABIDE 4 x 32^3) instead of the synthetic images, and the
ResNet-18 of the matching dimensions. The script uses only the guard's public API, so the
same command on an older checkout (``PYTHONPATH=<old checkout> python ...``) gives the
figures before a change.

Usage::

    python benchmarks/payload_guard.py                 # about a minute on 2 cores
    python benchmarks/payload_guard.py --zscore        # images of mean 0, std 1
    python benchmarks/payload_guard.py --images 200 --size 64 --repeats 3
    python benchmarks/payload_guard.py --fixture pathmnist --repeats 3
    python benchmarks/payload_guard.py --device cuda   # the replies on a GPU, scanned there
    python benchmarks/payload_guard.py --scan device   # the GPU's code path on the CPU device

``--device`` puts the replies (and the leaks) on a device, as a method training there sends
them; ``--scan`` sets :data:`medfl.guard.device.SCAN` (``auto``: a GPU message is scanned on
its GPU, a CPU one with NumPy; ``host``: always NumPy, GPU tensors copied off first, the path
before issue 50; ``device``: always torch). An older checkout has no ``--scan``.
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
from medfl.guard.device import DeviceReads
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


def _fixture(name: str, root: Path, cases: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """Write fixture ``name`` (``cases`` cases), prepare it, and return its splits as a
    client's datasets (train / val / test of one client, no augmentation) and the ResNet-18
    spec that fits its images."""
    from medfl.config import resolve_config
    from medfl.engine.data import split_data
    from medfl.engine.runner import build_source
    from medfl.fixtures import generate

    raw, out = root / "raw", root / "data"
    dataset: dict[str, Any] = {"name": "manifest", "path": str(out / "manifest.csv"), "normalize": "minmax"}
    if name == "pathmnist":
        from medfl.prep.medmnist import main as prep

        generate("medmnist", raw, cases=cases, seed=0, flag="pathmnist")
        assert prep(["--raw", str(raw), "--out", str(out), "--flag", "pathmnist"]) == 0
        dataset["num_classes"] = 9
    elif name == "mias":
        from medfl.prep.mias import main as prep

        generate("mias", raw, cases=cases, seed=0, reference=False)
        assert prep(["--raw", str(raw), "--out", str(out), "--size", "128"]) == 0
        dataset["num_classes"] = 3
    else:
        from medfl.prep.abide import main as prep

        info = generate("abide", raw, cases=cases, seed=0, reference=False)
        assert prep(["--raw", str(raw), "--out", str(out), "--size", "32", "--test-fold", "none",
                     "--atlas", "file", "--atlas-file", str(info["signal_atlas"])]) == 0
        dataset.update(num_classes=2, normalize="zscore", spatial_size=[32, 32, 32])
    cfg = resolve_config({"name": name, "output_dir": str(root / "runs"), "seed": 0, "num_clients": 1,
                          "progress": False, "dataset": dataset, "partition": {"name": "iid"},
                          "global_test_fraction": 0.0, "methods": [{"name": "fedavg"}]})
    data = split_data(build_source(cfg["dataset"]), cfg)
    datasets = {s: f() for s, f in data.dataset_factories("0", ["train", "val", "test"]).items()}
    first = datasets["train"][0][0]
    return datasets, {"name": "resnet18", "spatial_dims": first.dim() - 1, "in_channels": first.shape[0],
                      "num_classes": dataset["num_classes"]}


def _mistakes(x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Issue 38's plain mistakes with the images ``x`` (``(n, C, *spatial)``)."""
    flat = x.reshape(x.shape[0], -1)
    shape = (-1,) + (1,) * (x.dim() - 1)
    lo, hi = flat.min(1).values.reshape(shape), flat.max(1).values.reshape(shape)
    crop = x[(slice(None), slice(None), *(slice(3, 7) for _ in x.shape[2:]))]
    return {"x 0.5": x * 0.5, "uint8 per-image min-max": ((x - lo) / (hi - lo) * 255).round().to(torch.uint8),
            "halved (2x2 means)": torch.nn.functional.interpolate(x, scale_factor=0.5, mode="area"),
            "4x4 crops": crop.contiguous(), "+ 1e-6 noise": x + 1e-6 * torch.randn(x.shape, device=x.device)}


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
    ap.add_argument("--fixture", choices=("pathmnist", "mias", "abide"), default=None,
                    help="a fixture's images instead of the synthetic ones (--images cases)")
    ap.add_argument("--device", default="cpu", help="device the replies are on (default cpu; e.g. cuda)")
    ap.add_argument("--scan", choices=("auto", "device", "host"), default=None,
                    help="where the guard scans (medfl.guard.device.SCAN; default: its own, auto)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.scan:
        import medfl.guard.device as device_scan

        device_scan.SCAN = args.scan
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)   # noqa: E731

    from medfl.models.registry import build_model

    with tempfile.TemporaryDirectory(prefix="medfl-guard-bench-") as tmp:
        root = Path(tmp)
        spec = {"name": "resnet18", "spatial_dims": 2, "in_channels": 1, "num_classes": 2}
        if args.fixture:
            datasets, spec = _fixture(args.fixture, root, args.images)
            shape = "x".join(map(str, datasets["train"][0][0].shape))
            what = f"fixture {args.fixture} ({shape}, as the engine builds them)"
        else:
            names = _write_images(root, args.images, args.size, args.zscore)
            labels = np.random.default_rng(1).integers(0, 2, args.images)
            n_train, n_val = int(0.7 * args.images), int(0.1 * args.images)
            cuts = {"train": slice(0, n_train), "val": slice(n_train, n_train + n_val),
                    "test": slice(n_train + n_val, args.images)}
            datasets = {s: ArrayDataset(names[c], labels[c], root=root) for s, c in cuts.items()}
            what = (f"1x{args.size}x{args.size} (.npy, {'z-scored' if args.zscore else 'min-max to [0, 1]'})")

        clear_reference_cache()
        guard = ContentGuard("0", datasets)
        t0 = time.perf_counter()
        guard.index()
        build = time.perf_counter() - t0
        stats = guard.stats()
        t0 = time.perf_counter()
        ContentGuard("0", datasets).index()          # the next round's guard: cached reference
        cached = time.perf_counter() - t0

        model = build_model(spec).to(device)
        sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
        params = sum(v.numel() for v in sd.values())
        replies = {
            "ResNet-18 float32": sd,
            "ResNet-18 float16": {k: v.half() if v.is_floating_point() else v for k, v in sd.items()},
            "ResNet-18 bfloat16": {k: v.bfloat16() if v.is_floating_point() else v for k, v in sd.items()},
            "ResNet-18 int8 (per-tensor)": _quantise_int8(sd),
            "metrics (5 scalars)": {"loss": 0.41, "accuracy": 0.83, "auc": 0.9, "n": 350, "lr": 1e-3},
        }
        print(f"client: {sum(len(d) for d in datasets.values())} images {what}, splits "
              f"{ {s: len(d) for s, d in datasets.items()} }")
        print(f"reference: built in {build:.2f} s ({1000 * build / args.images:.2f} ms per image, reading "
              f"included); next round's guard {1000 * cached:.1f} ms (cached)")
        print(f"  {stats['samples']} samples, {stats['unprotected_samples']} unprotected, "
              f"{stats['value_probes']} value probes, gram probes {stats['gram_probes']}, "
              f"{stats['label_vectors']} label vectors")
        if "crop_probes" in stats:
            print(f"  plane signatures {stats['plane_signatures']} ({stats['samples_without_plane_signature']} "
                  f"samples without), {stats['crop_probes']} crop probes")
        print(f"  memory: reference {stats['reference_bytes'] / 2**20:.2f} MiB "
              f"({stats['reference_bytes'] / stats['samples']:.0f} bytes per sample) + prefilter tables "
              f"{stats['table_bytes'] / 2**20:.0f} MiB")
        print(f"check of one reply on {device} (median and min of {args.repeats}; {params / 1e6:.1f} M values "
              f"for the model):")
        for what, reply in replies.items():
            guard.check(reply, "reply")   # the index's tables on the device: once per client
            sync()
            med, best = _time(lambda: (guard.check(reply, "reply"), sync()), args.repeats)
            tracemalloc.start()
            guard.check(reply, "reply")
            _, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            with DeviceReads() as reads:
                guard.check(reply, "reply")
            print(f"  {what:<30} {1000 * med:8.1f} ms (min {1000 * best:.1f})   NumPy peak {peak / 2**20:6.1f} MiB"
                  f"   {reads.count:4d} reads off the device")
        x = torch.stack([torch.as_tensor(datasets["train"][i][0]) for i in range(8)]).to(device)
        for form, leaked in {"8 training images": x, **_mistakes(x)}.items():
            t0 = time.perf_counter()
            try:
                guard.check({**sd, "x": leaked}, "reply")
                print(f"  ResNet-18 + {form}: NOT caught ({1000 * (time.perf_counter() - t0):.0f} ms)")
            except PayloadError as exc:
                print(f"  ResNet-18 + {form}: caught in {1000 * (time.perf_counter() - t0):.0f} ms: "
                      f"{str(exc)[:110]}...")


if __name__ == "__main__":
    main()
