"""Every built-in method's numbers on a tiny job, against numbers recorded before a change.

A change of the method contract or the engine must not move any built-in method's results.
``builtin_numbers.json`` holds, per method, the ``metrics.csv`` and ``train_metrics.csv`` of
a two-round job on the synthetic set, as the code wrote them when the file was recorded;
this test reruns the jobs and compares them: evaluation metrics and counts exactly, training
losses to a relative 1e-5 and message sizes to 32 bytes. The pinned torch computes the same
numbers on one machine kind, but another CPU kind (AVX-512 or AVX2 kernels) sums in another
order: training losses then move by about 1e-7 relative (2e-6 where noise is scaled by them)
and a reply's size by a byte or two (scalars travel as text). A change of a method moves
them by orders of magnitude more. When a change moves a method's numbers on purpose, re-record with
``python tests/engine/test_builtin_numbers.py --write`` and say why in the commit.
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from medfl.config import resolve_config
from medfl.experiment import run_experiment

GOLDEN = Path(__file__).with_name("builtin_numbers.json")

_DATA: dict[str, Any] = {
    "seed": 3, "num_clients": 3, "progress": False,
    "dataset": {"name": "synthetic2d", "num_samples": 96, "num_classes": 2, "image_size": 16, "noise": 0.5},
    "partition": {"name": "dirichlet", "alpha": 1.0, "min_size": 8},
    "train": {"batch_size": 8, "lr": 0.05}, "rounds": 2,
}
_CNN = {"model": {"name": "small_cnn", "width": 4}}
_P2P = {"model": {"name": "resnet10", "width": 4}, "client_models": [{"width": 4}, {"width": 3}, {"width": 2}],
        "train": {"batch_size": 8, "lr": 0.001, "optimizer": "adam"}, "eval_splits": ["test", "cross_test"]}

#: method entry and job of each built-in method
JOBS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "centralized": ({"name": "centralized"}, _CNN),
    "local": ({"name": "local"}, _CNN),
    "fedavg": ({"name": "fedavg"}, {**_CNN, "fraction": 0.67}),
    "fedprox": ({"name": "fedprox", "mu": 0.1}, _CNN),
    "fedavgm": ({"name": "fedavgm"}, _CNN),
    "fedbn": ({"name": "fedbn"}, _CNN),
    "fedadam": ({"name": "fedadam"}, _CNN),
    "fedyogi": ({"name": "fedyogi"}, _CNN),
    "fedadagrad": ({"name": "fedadagrad"}, _CNN),
    "feddisco": ({"name": "feddisco"}, _CNN),
    "fedsdc": ({"name": "fedsdc", "gamma": 0.5}, _CNN),
    "fedkper": ({"name": "fedkper"}, _CNN),
    "fedskd": ({"name": "fedskd", "iterations": 2}, _P2P),
    "fedcross": ({"name": "fedcross", "iterations": 2}, {k: v for k, v in _P2P.items() if k != "client_models"}),
    "fedcross_het": ({"name": "fedcross_het", "iterations": 2}, _P2P),
    "fedtpf": ({"name": "fedtpf", "distill_rounds": 1, "vae_width": 4, "critic_width": 4}, _CNN),
    "fedfed": ({"name": "fedfed", "distill_rounds": 1, "vae_width": 4}, _CNN),
    "pfedcdp": ({"name": "pfedcdp", "refine_epochs": 1, "capabilities": "draw"},
                {**_CNN, "public_dataset": {"name": "synthetic2d", "num_samples": 40, "num_classes": 2,
                                            "image_size": 16, "noise": 0.5, "seed": 1}}),
}

#: every built-in method that runs across sites (``centralized`` pools the clients' data): the
#: jobs tests/flower/test_builtin_numbers_flower.py and tests/nvflare/test_builtin_numbers_nvflare.py run
REMOTE = sorted(m for m in JOBS if m != "centralized")


def job_config(method: str, work: Path, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``fl`` config of ``method``'s job in ``work`` (with top-level ``overrides``, e.g.
    ``{"device": "cuda"}`` or other ``methods``)."""
    spec, job = JOBS[method]
    fl = json.loads(json.dumps({**_DATA, **job, "methods": [spec], **(overrides or {})}))
    fl["train"] = {**_DATA["train"], **job.get("train", {})}
    fl.update(name=method, output_dir=str(work / "runs"))
    fl["dataset"]["root"] = str(work / "data")
    if "public_dataset" in fl:
        fl["public_dataset"]["root"] = str(work / "public")
    return fl


def metrics_files(run_dir: Path) -> dict[str, str]:
    """The recorded files of a method's run directory, as CSV text."""
    return {f: (run_dir / f).read_text() for f in ("metrics.csv", "train_metrics.csv")}


def run_job(method: str, work: Path, overrides: dict[str, Any] | None = None) -> dict[str, str]:
    """Run ``method``'s job in ``work`` in process (:func:`job_config`); its metrics files as CSV text."""
    out = run_experiment(resolve_config(job_config(method, work, overrides)))
    return metrics_files(Path(out["dir"]) / method)


def assert_recorded(method: str, now: dict[str, str]) -> None:
    """``now`` (``{file: CSV text}`` of ``method``'s job, run here or through a backend) has
    the recorded numbers of ``builtin_numbers.json``: every recorded column, its values."""
    golden = json.loads(GOLDEN.read_text())
    assert sorted(golden) == sorted(JOBS), "re-record builtin_numbers.json after adding a job"
    for f, text in golden[method].items():
        want, got = pd.read_csv(io.StringIO(text)), pd.read_csv(io.StringIO(now[f]))
        # columns may be added by a change; every recorded column keeps its exact values
        missing = [c for c in want.columns if c not in got.columns]
        assert not missing, f"{method} {f}: columns {missing} are gone"
        got = got[list(want.columns)]
        assert len(got) == len(want), f"{method} {f}: {len(got)} rows, recorded {len(want)}"
        for col in want.columns:
            assert_column_matches(got[col], want[col], f"{method} {f} column {col!r}")


@pytest.mark.parametrize("method", sorted(JOBS))
def test_builtin_method_numbers_are_unchanged(method: str, tmp_path: Path) -> None:
    assert_recorded(method, run_job(method, tmp_path))


#: floating-point training values (losses, distances) that another CPU kind rounds differently
RTOL = 1e-5
#: message sizes: a scalar's text may gain or lose a digit
BYTES_ATOL = 32


def assert_column_matches(got: pd.Series, want: pd.Series, what: str) -> None:
    """Compare one recorded column: metrics.csv and any non-float column exactly, except
    ``bytes_*`` counts (within :data:`BYTES_ATOL`); floats of train_metrics.csv within
    :data:`RTOL`. Missing values must stay missing."""
    assert (got.isna() == want.isna()).all(), f"{what}: missing values moved: {got.tolist()} vs {want.tolist()}"
    if str(got.name).startswith("bytes_"):
        diff = (got - want).abs().max()
        assert diff <= BYTES_ATOL, f"{what}: sizes differ by up to {diff} bytes: {got.tolist()} vs {want.tolist()}"
    elif want.dtype.kind == "f" and "train_metrics" in what:
        pd.testing.assert_series_equal(got.astype(float), want, check_exact=False, rtol=RTOL, atol=1e-8,
                                       obj=what)
    else:
        pd.testing.assert_series_equal(got, want, check_exact=True, obj=what)


def test_every_built_in_method_has_recorded_numbers() -> None:
    from medfl.plugins import registry

    builtin = {n for n, reg in registry()["method"].items() if reg.distribution == "medfl"}
    assert builtin <= set(JOBS), f"record numbers for {sorted(builtin - set(JOBS))}"


if __name__ == "__main__":  # re-record: python tests/engine/test_builtin_numbers.py --write
    import tempfile

    if "--write" not in sys.argv:
        raise SystemExit("usage: python tests/engine/test_builtin_numbers.py --write")
    with tempfile.TemporaryDirectory() as tmp:
        numbers = {m: run_job(m, Path(tmp) / m) for m in sorted(JOBS)}
    GOLDEN.write_text(json.dumps(numbers, indent=1, sort_keys=True) + "\n")
    print(f"wrote {GOLDEN}")
