"""Configs and comparisons shared by the Flower tests (the same jobs in process, over a
loop-back grid and over a real deployment)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from medfl.flower.replay import table_difference

#: What every site and every run share: the data and how it is split (3 clients).
DATA: dict[str, Any] = {
    "seed": 0, "num_clients": 3, "progress": False,
    "dataset": {"name": "synthetic2d", "num_samples": 96, "num_classes": 2, "image_size": 16, "noise": 0.5},
    "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8},
}

FEDAVG: dict[str, Any] = {"rounds": 2, "model": {"name": "small_cnn", "width": 4},
                          "train": {"batch_size": 8, "lr": 0.05}, "methods": [{"name": "fedavg"}]}
# FedSKD as in tests/methods/test_fedskd.py: heterogeneous ResNet-10s, the Global Test
FEDSKD: dict[str, Any] = {"rounds": 2, "model": {"name": "resnet10", "width": 6},
                          "client_models": [{"width": 6}, {"width": 5}, {"width": 4}],
                          "train": {"batch_size": 8, "lr": 0.001, "optimizer": "adam"},
                          "eval_splits": ["test", "cross_test"], "eval_every": 0,
                          "methods": [{"name": "fedskd", "iterations": 2}]}
#: Flower's SecAgg+ (``fl.secure_aggregation``) as the secure-aggregation tests run it
SECURE: dict[str, Any] = {"num_shares": 1.0, "reconstruction_threshold": 2}
# a stateful method (norm layers stay at the site) for the dropout runs
FEDBN: dict[str, Any] = {"rounds": 3, "model": {"name": "small_cnn", "width": 4},
                         "train": {"batch_size": 8, "lr": 0.05}, "eval_every": 0, "methods": [{"name": "fedbn"}]}


def fl_config(work: Path, name: str, extra: dict[str, Any]) -> dict[str, Any]:
    """The ``fl`` section of job ``name``: :data:`DATA` plus ``extra``, data and runs under ``work``."""
    fl = json.loads(json.dumps(DATA))
    fl["dataset"]["root"] = str(work / "data")
    fl.update(name=name, output_dir=str(work / "runs"), **json.loads(json.dumps(extra)))
    return fl


def write_config(path: Path, fl: dict[str, Any]) -> Path:
    """Write ``{"fl": fl}`` as a bundle config file."""
    path.write_text(json.dumps({"fl": fl}, indent=1))
    return path


def numeric_equal(a: pd.DataFrame, b: pd.DataFrame, what: str, atol: float = 1e-5) -> None:
    """Assert two metrics tables hold the same rows (sorted by their keys) and values."""
    table_difference(a, b, what, atol=atol)


def wait_until_empty(probe: Callable[[], list[str]], limit: float) -> list[str]:
    """Poll ``probe`` (every 0.5 s, up to ``limit`` s: a condition, not a sleep) until it finds
    nothing (processes that should have ended); what it finds then."""
    deadline = time.monotonic() + limit
    left = probe()
    while left and time.monotonic() < deadline:
        time.sleep(0.5)
        left = probe()
    return left
