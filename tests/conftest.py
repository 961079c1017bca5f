"""Shared fixtures: a tiny resolved config on the generated synthetic dataset."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from medfl.config import resolve_config


@pytest.fixture
def tiny_fl(tmp_path: Path) -> dict[str, Any]:
    """A fast experiment: 3 clients, 48 tiny images, small CNN, 2 rounds, no progress bar."""
    return {
        "name": "t", "output_dir": str(tmp_path / "runs"), "seed": 0, "rounds": 2,
        "num_clients": 3, "progress": False,
        "dataset": {"name": "synthetic2d", "root": str(tmp_path / "data"), "num_samples": 96,
                    "num_classes": 2, "image_size": 12, "noise": 0.5},
        "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8},
        "model": {"name": "small_cnn", "width": 4},
        "train": {"batch_size": 8, "lr": 0.05},
        "methods": [{"name": "fedavg"}],
    }


@pytest.fixture
def resolve():
    """resolve_config, for tests that tweak the tiny config first."""
    return resolve_config


@pytest.fixture(scope="session")
def reference_data() -> Path:
    """The real metadata files (``../shared/reference_data``); skips when absent, as in a
    user's own clone without the shared folder."""
    from medfl.fixtures import reference_data_dir

    found = reference_data_dir()
    if found is None:
        pytest.skip("real metadata files not found: ../shared/reference_data beside the clone "
                    "(or MEDFL_REFERENCE_DATA) is needed for this test")
    return found
