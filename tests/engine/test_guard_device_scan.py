"""Issue 50, item 1: the content guard scans a message on the device that holds it.

A reply computed on a GPU is checked there with torch (:mod:`medfl.guard.device`): only
what the scans find comes off the device. These tests run that code on the CPU device
(``SCAN = "device"``) and on a GPU where there is one, and hold it to the host path: every
leak form of the guard's catch tests gets the same verdict and the same error message on
both, model weights of every dtype pass on both, and the device's gram keys are the host's
bit for bit.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import pytest
import torch

import medfl.guard.device as device_scan
from medfl.guard import ContentGuard, clear_reference_cache
from medfl.guard.device import DeviceReads, _rolling_keys_torch
from medfl.guard.images import _rolling_keys
from medfl.guard.walk import _Leaves, _walk
from medfl.messages import PayloadError

from test_guard_plain_mistakes import MISTAKES
from test_payload_guard import IMAGE_LEAKS, LABEL_LEAKS, _ctx, _data, _quantise, _trained

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _to(value: Any, device: str) -> Any:
    """``value`` with every tensor moved to ``device``."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    return value


def _verdict(guard: ContentGuard, message: Any, scan: str, device: str, monkeypatch: pytest.MonkeyPatch
             ) -> str | None:
    """The guard's error for ``message`` (None: it passes) with the scans on ``scan``'s path,
    the message's tensors on ``device``."""
    monkeypatch.setattr(device_scan, "SCAN", scan)
    try:
        guard.check(_to(message, device), "reply")
    except PayloadError as e:
        return str(e)
    return None


@pytest.fixture(scope="module")
def data() -> dict[str, Any]:
    clear_reference_cache()
    return {"2d": (_data(64, (1, 16, 16), seed=0), _data(24, (1, 16, 16), seed=1)),
            "3d": (_data(64, (1, 16, 16, 16), seed=20, normal=True),
                   _data(24, (1, 16, 16, 16), seed=21, normal=True))}


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(32, 16, generator=g), "b": torch.zeros(32), "steps": torch.tensor(48)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind, form", [("labels", f) for f in LABEL_LEAKS] + [("images", f) for f in IMAGE_LEAKS]
                         + [("mistake", f) for f in MISTAKES])
def test_every_leak_form_gets_the_hosts_verdict_on_the_device(data: dict[str, Any], kind: str, form: str,
                                                              device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Labels, images and the plain mistakes with the images, beside a model's weights: the
    device path refuses each with the host path's message (the same tensor, sample and what
    matched)."""
    ctx = _ctx(*data["2d"])
    make: Callable[[Any], Any]
    if kind == "labels":
        make = LABEL_LEAKS[form]
    elif kind == "images":
        make = IMAGE_LEAKS[form]
    else:
        make = lambda c, _f=MISTAKES[form][0]: _f(c.dataset("train").tensors[0])  # noqa: E731
    message = {**_weights(1), "leak": make(ctx)}
    host = _verdict(ctx.guard, message, "host", "cpu", monkeypatch)
    assert host is not None, f"{kind} {form}: the host path let it through"
    assert _verdict(ctx.guard, message, "device" if device == "cpu" else "auto", device, monkeypatch) == host


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mistake", list(MISTAKES))
def test_a_volumes_plain_mistakes_are_refused_on_the_device(data: dict[str, Any], mistake: str, device: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The same for 3D volumes (plane signatures of every slice view, crop probes)."""
    ctx = _ctx(*data["3d"])
    message = {**_weights(2), "leak": MISTAKES[mistake][0](ctx.dataset("train").tensors[0])}
    host = _verdict(ctx.guard, message, "host", "cpu", monkeypatch)
    assert host is not None
    assert _verdict(ctx.guard, message, "device" if device == "cpu" else "auto", device, monkeypatch) == host


@pytest.mark.parametrize("device", DEVICES)
def test_model_weights_of_every_dtype_pass_on_the_device(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Initial and trained-like ResNet-10 weights (width 16), float32/16, bfloat16 and quantised, against
    a client whose split sizes equal the BatchNorm lengths and whose exact gram probes are on
    (integer-valued images): no refusal on the device path either."""
    from medfl.models.registry import build_model

    g = torch.Generator().manual_seed(3)
    whole = _data(64, (1, 16, 16), seed=5, classes=2)
    whole.tensors[0].copy_(torch.randint(0, 256, whole.tensors[0].shape, generator=g).float())   # exact grams (uint8-like)
    guard = ContentGuard("0", {"split16": _data(16, (1, 16, 16), seed=16, classes=2), "ints": whole})
    assert "exact" in guard.index().grams
    torch.manual_seed(7)   # the model's initial weights, whatever ran before
    model = build_model({"name": "resnet10", "width": 16, "spatial_dims": 2, "in_channels": 1, "num_classes": 2})
    for weights in (model.state_dict(), _trained(model)):
        for how in ("float32", "float16", "bfloat16", "int8", "int2"):
            message = _quantise(weights, how)
            assert _verdict(guard, message, "device" if device == "cpu" else "auto", device, monkeypatch) is None


@pytest.mark.parametrize("device", DEVICES)
def test_integer_images_are_found_by_exact_grams_on_the_device(device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Images with few distinct values have exact gram probes instead of value probes: a
    flattened copy among weights, as int64 and as float16, is refused on both paths alike."""
    g = torch.Generator().manual_seed(8)
    ds = _data(32, (1, 16, 16), seed=9)
    ds.tensors[0].copy_(torch.randint(0, 256, ds.tensors[0].shape, generator=g).float())
    guard = ContentGuard("7", {"train": ds})
    for leak in (ds.tensors[0].flatten(), ds.tensors[0].long(), ds.tensors[0][:, 0].half()):
        message = {**_weights(4), "leak": leak}
        host = _verdict(guard, message, "host", "cpu", monkeypatch)
        assert host is not None and "holds image" in host
        assert _verdict(guard, message, "device" if device == "cpu" else "auto", device, monkeypatch) == host


@pytest.mark.parametrize("device", DEVICES)
def test_gram_keys_on_the_device_are_the_hosts_bit_for_bit(device: str) -> None:
    """16-bit and 32-bit codes (high bits set: the products wrap) hash to the same keys."""
    rng = np.random.default_rng(0)
    for codes in (rng.integers(0, 1 << 16, 5000).astype(np.uint16), rng.integers(0, 1 << 32, 5000, dtype=np.uint64)
                  .astype(np.uint32)):
        want = _rolling_keys(codes)
        got = _rolling_keys_torch(torch.from_numpy(codes.astype(np.int64)).to(device)).cpu().numpy().view(np.uint64)
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_one_value_tensors_are_read_in_one_copy_in_message_order(device: str) -> None:
    """The message's scalars keep their order whatever holds them (Python numbers and
    one-value tensors of every dtype)."""
    leaves = _Leaves()
    message = {"a": 1.5, "b": torch.tensor(2, device=device), "c": [torch.tensor([True], device=device), 4],
               "d": torch.tensor(0.25, dtype=torch.bfloat16, device=device)}
    _walk(message, "", leaves, frozenset(), True)
    leaves.resolve()
    assert leaves.scalars == [1.5, 2.0, 1.0, 4.0, 0.25] and not leaves.pending
    assert leaves.scalar_paths == ["['a']", "['b']", "['c'][0]", "['c'][1]", "['d']"]


def test_an_unknown_scan_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """``MEDFL_GUARD_SCAN`` other than auto, device or host: one clear error."""
    monkeypatch.setattr(device_scan, "SCAN", "gpu")
    with pytest.raises(ValueError, match="MEDFL_GUARD_SCAN.*'gpu'.*auto, device or host"):
        ContentGuard("0", {"train": _data(8, (1, 8, 8), seed=1)}).check({"w": torch.randn(4, 4)}, "reply")


def test_a_replys_scan_reads_off_the_device_a_few_times_whatever_its_tensors(monkeypatch: pytest.MonkeyPatch
                                                                            ) -> None:
    """What made a GPU round slow (issue 50): the host path copies each tensor off the
    device, and again for each plane-signature view: 98 reads for a ResNet-10's 77 tensors,
    156 for a ResNet-18's 125 here. The device path reads a fixed handful (counts, hits, the
    tensors that may hold labels in one copy), however many tensors the reply has."""
    from medfl.models.registry import build_model

    guard = ContentGuard("0", {"train": _data(64, (1, 16, 16), seed=5), "test": _data(16, (1, 16, 16), seed=6)})
    reads = {}
    for name in ("resnet10", "resnet18"):
        state = _trained(build_model({"name": name, "width": 16, "spatial_dims": 2, "in_channels": 1,
                                      "num_classes": 2}))
        for scan in ("host", "device"):
            monkeypatch.setattr(device_scan, "SCAN", scan)
            guard.check(state, "reply")   # the device tables, built once
            with DeviceReads() as counted:
                guard.check(state, "reply")
            reads[name, scan] = counted.count
    assert reads["resnet10", "host"] > 60 and reads["resnet18", "host"] > reads["resnet10", "host"]
    assert reads["resnet10", "device"] <= 16 and reads["resnet18", "device"] <= 16, reads
