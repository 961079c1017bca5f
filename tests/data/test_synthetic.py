"""The generated ``synthetic2d`` set: written once, atomically, also by processes at once."""

from __future__ import annotations

import multiprocessing as mp
import signal
from pathlib import Path

import numpy as np
import pandas as pd

from medfl.data.synthetic import generate_synthetic2d


def _generate(root: str) -> str:
    return str(generate_synthetic2d(root, num_samples=40, image_size=8, seed=3))


def _default_signals() -> None:
    """A pool worker ends on the SIGTERM that ``Pool.terminate`` sends, whatever handlers it
    inherited: a forked worker gets the test process's, and an earlier test's ``ray.init`` (the
    simulation backend) leaves its own SIGTERM handler there. In a CI run a worker idle on the
    task queue caught that SIGTERM and did not end, and ``with Pool`` waited for it forever; the
    kernel's default action cannot be caught."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_processes_generating_the_same_set_at_once_get_one_complete_set(tmp_path: Path) -> None:
    """As sites of a federation started together on one machine do."""
    with mp.get_context("fork").Pool(3, initializer=_default_signals) as pool:
        dirs = pool.map(_generate, [str(tmp_path)] * 3)
    assert len(set(dirs)) == 1
    out = Path(dirs[0])
    assert [p.name for p in tmp_path.iterdir()] == [out.name]    # no private directory left behind
    table = pd.read_csv(out / "manifest.csv")
    assert len(table) == 40 and all((out / p).is_file() for p in table["path"])
    again = generate_synthetic2d(tmp_path, num_samples=40, image_size=8, seed=3)
    assert again == out


def test_a_half_written_set_is_replaced(tmp_path: Path) -> None:
    ref = generate_synthetic2d(tmp_path / "a", num_samples=20, image_size=8)
    broken = tmp_path / "b" / ref.name
    (broken / "images").mkdir(parents=True)
    np.save(broken / "images" / "s00000.npy", np.zeros(3))       # no manifest: incomplete
    out = generate_synthetic2d(tmp_path / "b", num_samples=20, image_size=8)
    assert out == broken and (out / "manifest.csv").is_file()
    assert np.array_equal(np.load(out / "images" / "s00000.npy"), np.load(ref / "images" / "s00000.npy"))
