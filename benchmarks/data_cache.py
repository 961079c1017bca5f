#!/usr/bin/env python
"""First-epoch (decode) vs cached-epoch loading throughput of full-size DICOM mammograms.

Writes a CBIS-DDSM fixture of full-size mammograms (default 12 images of 5000 x 3000 pixels,
16-bit, about 30 MB each, as the real files are) with ``medfl.fixtures.cbis_ddsm``, lists
their full-mammogram DICOMs in a manifest, and reads them through medfl's ``manifest``
dataset (MONAI ``LoadImage`` with pydicom, z-score, ``Resized`` to 512 x 320) for several
epochs with ``cache`` = ``memory`` and = ``disk`` (MONAI ``PersistentDataset``). Epoch 1
decodes every file; later epochs read the cache. Prints images/s per epoch and the ratio
of the cached epochs to the first (target: >= 10x).

    python benchmarks/data_cache.py [--images 12] [--height 5000 --width 3000] [--epochs 3]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

TARGET = 10.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Target: cached epochs >= 10x the first epoch's throughput.")
    p.add_argument("--images", type=int, default=12, help="number of mammograms (default 12)")
    p.add_argument("--height", type=int, default=5000, help="rows of a mammogram (default 5000)")
    p.add_argument("--width", type=int, default=3000, help="columns of a mammogram (default 3000)")
    p.add_argument("--size", type=int, nargs=2, default=[512, 320], metavar=("H", "W"),
                   help="size the loader resizes to (default 512 320)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per cache mode (default 3)")
    p.add_argument("--modes", default="memory,disk", help="cache modes, comma-separated (default memory,disk)")
    p.add_argument("--workdir", help="where the fixture and caches go (default: a temporary directory, removed)")
    p.add_argument("--json", metavar="OUT", help="also write the figures to this JSON file")
    a = p.parse_args(argv)
    if a.images < 4:
        p.error("--images must be >= 4 (the fixture spreads images over the four CSVs)")

    import pandas as pd
    import torch

    from medfl.data.manifest import manifest_source
    from medfl.fixtures.cbis_ddsm import generate

    work = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="medfl-cache-bench-"))
    try:
        t0 = time.perf_counter()
        info = generate(work / "raw", cases=a.images, seed=0, layout="classic", size=(a.height, a.width))
        files = sorted((work / "raw" / "CBIS-DDSM").glob("*_*_*_*/*/*/000000.dcm"))
        files = [f for f in files if f.parts[-4].count("_") == 4]  # not the ROI series (<Subject>_<n>)
        mb = sum(f.stat().st_size for f in files) / 2**20
        print(f"fixture: {len(files)} full mammograms of {a.height} x {a.width} (16-bit), {mb:.0f} MB on disk, "
              f"written in {time.perf_counter() - t0:.1f} s")
        manifest = work / "manifest.csv"
        pd.DataFrame({"sample_id": [f.parts[-4] for f in files],
                      "image_path": [str(f.relative_to(work / "raw")) for f in files],
                      "label": [i % 2 for i in range(len(files))]}).to_csv(manifest, index=False)
        figures: dict[str, dict[str, list[float] | float]] = {}
        for mode in [m.strip() for m in a.modes.split(",") if m.strip()]:
            src = manifest_source(str(manifest), root=str(work / "raw"), column="image_path", normalize="zscore",
                                  spatial_size=a.size, cache=mode, cache_dir=str(work / f"cache-{mode}"))
            rates = []
            for epoch in range(1, a.epochs + 1):
                ds = src.make_dataset(src.table, False)  # a new dataset every epoch, as the engine builds one per round
                loader = torch.utils.data.DataLoader(ds, batch_size=4)
                t = time.perf_counter()
                n = sum(x.shape[0] for x, _ in loader)
                dt = time.perf_counter() - t
                rates.append(n / dt)
                print(f"  cache={mode:<6s} epoch {epoch}: {n} images in {dt:6.2f} s = {n / dt:8.1f} images/s")
            cached = statistics.median(rates[1:]) if len(rates) > 1 else float("nan")
            ratio = cached / rates[0]
            figures[mode] = {"images_per_s": rates, "ratio_cached_vs_first": ratio}
            print(f"  cache={mode}: cached epochs / first epoch = {ratio:.1f}x  (target >= {TARGET:g}x)  "
                  f"{'PASS' if ratio >= TARGET else 'MISS'}")
        if a.json:
            Path(a.json).write_text(json.dumps({"settings": vars(a), "fixture": info, "figures": figures}, indent=2))
    finally:
        if not a.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
