"""The GPU paths on a CUDA device (issue 20): every built-in method end to end with
``device: cuda``, mixed precision and channels-last on the GPU, the DataLoader's workers
with pinned memory, and the simulation runtime with clients sharing a GPU.

Skipped where torch sees no CUDA device (CI's machines have none); on a GPU machine run
``python -m pytest tests/engine/test_cuda.py``. A GPU computes in another order than a CPU
(other kernels, other sums), so the numbers are compared with tolerances, not exactly.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from medfl.config import resolve_config
from medfl.experiment import run_experiment
from medfl.training import compute_settings, get_state, move_state, predict_proba, train_epochs

from test_builtin_numbers import BYTES_ATOL, GOLDEN, JOBS, run_job
from test_compute import _loader, _manifest, _model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="no CUDA device on this machine: the GPU paths run where torch sees one")

#: relative tolerance of a training loss on the GPU (full float32) against the CPU's recorded one
LOSS_RTOL = 1e-3

#: methods whose recorded job draws random numbers on the device (dropout masks come from the
#: CUDA generator, not the CPU's), so their GPU losses are not the CPU's; the entry is the
#: method's settings without those draws, run on both devices and compared instead
DEVICE_DRAWS: dict[str, dict | None] = {
    "fedsdc": {"dropout": 0.0},   # dropout between its heads' layers
    "pfedcdp": None,              # the server-side student's dropout (no setting turns it off)
}


@pytest.fixture
def exact_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """Full float32 on the GPU: PyTorch lets cuDNN convolve in TF32 by default (10-bit
    mantissa; a tiny job's losses then move by percents from the CPU's), and cuDNN may pick
    kernels that sum in a varying order. Both off, the GPU computes what the CPU computes up
    to float32 rounding."""
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", True)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)


@pytest.mark.parametrize("method", sorted(JOBS))
def test_builtin_method_runs_on_cuda(method: str, tmp_path: Path, exact_float32: None) -> None:
    """The method's tiny job on the GPU: the same rows and sizes as on the CPU, finite
    numbers, training losses within :data:`LOSS_RTOL` of the CPU's, and the GPU used."""
    torch.cuda.reset_peak_memory_stats()
    now = run_job(method, tmp_path / "cuda", {"device": "cuda"})
    assert torch.cuda.max_memory_allocated() > 0, "nothing was computed on the GPU"
    golden = json.loads(GOLDEN.read_text())[method]
    _compare_to_cpu(method, golden, now, exact=method not in DEVICE_DRAWS)
    if DEVICE_DRAWS.get(method) is not None:   # without the draws: the CPU's numbers
        spec = {**JOBS[method][0], **DEVICE_DRAWS[method]}
        cpu = run_job(method, tmp_path / "cpu-nodraws", {"methods": [spec]})
        gpu = run_job(method, tmp_path / "cuda-nodraws", {"methods": [spec], "device": "cuda"})
        _compare_to_cpu(method, cpu, gpu, exact=True)


def _compare_to_cpu(method: str, cpu: dict[str, str], gpu: dict[str, str], exact: bool) -> None:
    """The same rows, counts and sizes; finite numbers; with ``exact``, training values
    within :data:`LOSS_RTOL` of the CPU's."""
    for f, text in cpu.items():
        want, got = pd.read_csv(io.StringIO(text)), pd.read_csv(io.StringIO(gpu[f]))
        assert len(got) == len(want), f"{method} {f}: {len(got)} rows on cuda, {len(want)} on cpu"
        for col in want.columns:
            w, g = want[col], got[col]
            what = f"{method} {f} column {col!r}"
            if col.startswith("bytes_"):
                assert (g - w).abs().max() <= BYTES_ATOL, f"{what}: {g.tolist()} vs {w.tolist()}"
            elif w.dtype.kind != "f" or col in ("n", "round", "steps", "count"):
                pd.testing.assert_series_equal(g, w, check_exact=True, obj=what)
            elif f == "train_metrics.csv":
                assert (g.isna() == w.isna()).all(), f"{what}: missing values moved"
                assert np.isfinite(g.dropna()).all(), f"{what}: {g.tolist()}"
                if exact:
                    pd.testing.assert_series_equal(g, w, check_exact=False, rtol=LOSS_RTOL, atol=1e-6, obj=what)
            else:   # evaluation metrics: finite where the CPU's are, in range
                assert (g.isna() == w.isna()).all(), f"{what}: missing values moved: {g.tolist()} vs {w.tolist()}"
                if col in ("accuracy", "auc", "f1", "micro_f1", "precision", "recall"):
                    assert g.dropna().between(0, 1).all(), f"{what}: {g.tolist()}"


def _train_cuda(train: dict, spatial_dims: int = 2, max_steps: int | None = None
                ) -> tuple[dict[str, float], torch.nn.Module]:
    model = _model(spatial_dims=spatial_dims)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    with compute_settings(train, "cuda"):
        stats = train_epochs(model.cuda(), _loader(spatial_dims=spatial_dims), opt, 2, device="cuda",
                             max_steps=max_steps)
    return stats, model


@pytest.mark.parametrize("spatial_dims", [2, 3])
def test_mixed_precision_and_channels_last_steps_on_cuda(spatial_dims: int, exact_float32: None) -> None:
    """bf16 and fp16 (with the gradient scaler) autocast and channels-last train a ResNet-10
    on the GPU: convolutions run in the half type, weights stay float32 on the GPU, the first
    step's loss is full precision's up to the half type's rounding (channels-last: float32's),
    and six steps (lr 0.05, momentum 0.9: they amplify any rounding) stay finite."""
    ref1, _ = _train_cuda({}, spatial_dims, max_steps=1)
    for amp, tol in (("bf16", 3e-2), ("fp16", 5e-3)):
        first, _ = _train_cuda({"amp": amp}, spatial_dims, max_steps=1)
        assert abs(first["loss"] - ref1["loss"]) < tol, (amp, first, ref1)
        stats, model = _train_cuda({"amp": amp}, spatial_dims)
        assert np.isfinite(stats["loss"]) and stats["steps"] == 6
        assert all(p.dtype == torch.float32 and p.is_cuda for p in model.parameters())
        assert all(torch.isfinite(p).all() for p in model.parameters())
        seen: list[torch.dtype] = []
        conv = next(m for m in model.modules() if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)))
        conv.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
        with compute_settings({"amp": amp}, "cuda"):
            y, p = predict_proba(model, _loader(spatial_dims=spatial_dims), "cuda")
        assert set(seen) == {torch.bfloat16 if amp == "bf16" else torch.float16}
        assert p.dtype == np.float32 and np.allclose(p.sum(1), 1, atol=1e-3)
    first, _ = _train_cuda({"channels_last": True}, spatial_dims, max_steps=1)
    assert abs(first["loss"] - ref1["loss"]) < 1e-4
    stats, model = _train_cuda({"channels_last": True}, spatial_dims)
    assert np.isfinite(stats["loss"]) and stats["steps"] == 6
    assert all(p.is_contiguous() for p in model.parameters())   # the usual layout on return


def _manifest_run(tmp_path: Path, name: str, train: dict) -> Path:
    fl = {"output_dir": str(tmp_path / "runs"), "seed": 0, "rounds": 2, "num_clients": 3, "progress": False,
          "name": name, "device": "cuda",
          "dataset": {"name": "manifest", "path": str(tmp_path / "manifest.csv"), "num_classes": 2},
          "partition": {"name": "natural", "column": "site"}, "global_test_fraction": 0.0,
          "model": {"name": "small_cnn", "width": 4}, "methods": [{"name": "fedavg"}],
          "train": {"batch_size": 4, "lr": 0.05, **train}}
    return Path(run_experiment(resolve_config(fl))["dir"]) / "fedavg"


def test_loader_workers_pinned_memory_and_amp_on_cuda(tmp_path: Path, exact_float32: None) -> None:
    """Two loader worker processes with pinned memory feed the GPU the batches that no
    workers feed it (with cuDNN's deterministic kernels the runs agree); bf16 + channels-last
    runs end to end."""
    _manifest(tmp_path)
    ref = _manifest_run(tmp_path, "ref", {})
    workers = _manifest_run(tmp_path, "workers", {"num_workers": 2, "pin_memory": True})
    a, b = (pd.read_csv(d / "metrics.csv") for d in (ref, workers))
    pd.testing.assert_frame_equal(a, b, check_exact=False, atol=1e-6)
    ta, tb = (pd.read_csv(d / "train_metrics.csv") for d in (ref, workers))
    np.testing.assert_allclose(ta["loss"], tb["loss"], rtol=1e-5)
    mixed = _manifest_run(tmp_path, "mixed", {"amp": "bf16", "channels_last": True, "pin_memory": True})
    t = pd.read_csv(mixed / "train_metrics.csv")
    assert np.isfinite(t["loss"]).all() and (t["steps"] > 0).all()
    m = pd.read_csv(mixed / "metrics.csv")
    assert len(m) == len(a) and m["accuracy"].dropna().between(0, 1).all()


def test_simulated_clients_share_the_gpu(tmp_path: Path) -> None:
    """``backend: ray`` with ``client_gpus: 0.5``: two simulated clients at a time on the
    GPU give the in-process GPU run's numbers (up to the GPU's rounding)."""
    pytest.importorskip("ray", reason="the simulation runtime needs Ray: pip install -e '.[simulation]'")
    fl = {"output_dir": str(tmp_path / "runs"), "seed": 1, "rounds": 2, "num_clients": 3, "progress": False,
          "device": "cuda", "dataset": {"name": "synthetic2d", "num_samples": 96, "num_classes": 2,
                                        "image_size": 16, "root": str(tmp_path / "data")},
          "model": {"name": "small_cnn", "width": 4}, "methods": [{"name": "fedavg"}, {"name": "fedbn"}],
          "train": {"batch_size": 8, "lr": 0.05}}
    ref = Path(run_experiment(resolve_config({**fl, "name": "ref"}))["dir"])
    sim = Path(run_experiment(resolve_config({**fl, "name": "sim", "backend": {
        "name": "ray", "client_cpus": 1, "client_gpus": 0.5, "num_cpus": 4}}))["dir"])
    assert json.loads((sim / "config.json").read_text())["engine"] == "simulation"
    for label in ("fedavg", "fedbn"):
        a, b = (pd.read_csv(d / label / "metrics.csv") for d in (ref, sim))
        pd.testing.assert_frame_equal(a, b, check_exact=False, atol=0.06)   # at most one flip in 19
        ta, tb = (pd.read_csv(d / label / "train_metrics.csv") for d in (ref, sim))
        np.testing.assert_allclose(ta["loss"], tb["loss"], rtol=1e-3)


def test_weights_cross_between_cpu_and_gpu_in_one_transfer_per_dtype() -> None:
    """:func:`get_state` of a GPU model and :func:`move_state` to the GPU give exactly the
    per-tensor copies, each tensor in its own storage."""
    model = _model(spatial_dims=3).cuda()
    state = get_state(model)
    for k, v in model.state_dict().items():
        assert state[k].device.type == "cpu" and torch.equal(state[k], v.cpu()), k
        assert state[k].untyped_storage().nbytes() == state[k].numel() * state[k].element_size(), k
    back = move_state(state, "cuda")
    assert all(v.is_cuda and torch.equal(v.cpu(), state[k]) for k, v in back.items())
