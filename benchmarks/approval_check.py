#!/usr/bin/env python
"""What a site's approvals cost: ``medfl approve --all`` and the check of one message.

Approves every installed plugin into a temporary approvals file (``medfl approve --all``),
then times :func:`medfl.approval.check_control` on the control record of a FedAvg training
message with a ``quantize`` filter (method, filter, model, every installed metric, the
site's dataset and partitioner: what :meth:`medfl.site.Site.check` asks for every
message). Prints the approval's wall time, the file's size and the mean time per check
(file read, every pinned file stat'ed and its bytecode checked; hashes are cached by
mtime and size).

    python benchmarks/approval_check.py [--checks 20]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checks", type=int, default=20, help="checks to time (default 20)")
    args = p.parse_args(argv)

    from medfl.approval import check_control
    from medfl.cli import main as medfl

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "approvals.json"
        t = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()):
            assert medfl(["approve", "--all", "--file", str(path)]) == 0
        print(f"medfl approve --all: {time.perf_counter() - t:.2f} s, approvals file {path.stat().st_size / 1024:.0f} KiB")
        ctl = {"method": {"name": "fedavg"}, "model": {"name": "small_cnn"},
               "filters": [{"name": "quantize", "bits": 8}]}
        site = [("dataset", "synthetic2d"), ("partitioner", "dirichlet")]
        check_control(ctl, "site", path=path, site=site)   # first check: imports and hashes
        t = time.perf_counter()
        for _ in range(args.checks):
            check_control(ctl, "site", path=path, site=site)
        print(f"check of one message: {(time.perf_counter() - t) / args.checks * 1000:.1f} ms "
              f"(mean of {args.checks})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
