"""medfl messages as Flower records: exact round trips, and only tensors and scalars travel."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict  # noqa: E402

from medfl import wire  # noqa: E402
from medfl.flower.proxy import decode_records, encode_records  # noqa: E402
from medfl.messages import Instruction, PayloadError  # noqa: E402


def _same(a, b) -> None:  # type: ignore[no-untyped-def]
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def test_pack_unpack_is_exact_through_flowers_protobuf() -> None:
    g = torch.Generator().manual_seed(0)
    value = {
        "weights": {"conv.weight": torch.randn(3, 2, 3, 3, generator=g), "bn.num_batches_tracked": torch.tensor(7)},
        "mask": torch.tensor([True, False]), "half": torch.randn(4, generator=g).to(torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64), "empty": torch.zeros(0, 3),
        "pair": (1, 2.5), "chain": [None, True, -3, float("nan"), float("inf"), 0.1 + 0.2], "name": "fedavg",
        "z": {},
    }
    content = RecordDict()
    wire.put(content, "ins", value, "test")
    back = wire.take(decode_records(encode_records(content)), "ins", "test")
    _same(value, back)
    assert back["weights"]["conv.weight"].data_ptr() != value["weights"]["conv.weight"].data_ptr()
    back["ids"][0] = 9   # decoded tensors are writable and own their memory


@pytest.mark.parametrize("bad, match", [
    ({"x": object()}, r"\['x'\].*object"),
    ({"x": {1, 2}}, r"\['x'\].*set"),
    ({"path": "/data/a.dcm"}, "strings may not leave a client"),
])
def test_only_tensors_and_scalars_leave_a_site(bad: dict, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        wire.pack(bad, "reply of site 0", allow_str=False)


def test_malformed_records_are_refused_with_where() -> None:
    arrays, tree = wire.pack({"a": torch.ones(2)}, "x")
    with pytest.raises(wire.WireError, match="reply of site 2: tensor '0' missing"):
        wire.unpack(ArrayRecord({}), tree, "reply of site 2")
    with pytest.raises(wire.WireError, match="not valid JSON"):
        wire.unpack(arrays, ConfigRecord({"tree": "{"}), "reply")
    with pytest.raises(wire.WireError, match="unknown tree node"):
        wire.unpack(arrays, ConfigRecord({"tree": '{"q": 1}'}), "reply")
    with pytest.raises(PayloadError, match="strings may not leave"):   # checked again after decoding
        wire.unpack(*wire.pack({"s": "text"}, "x"), "reply", allow_str=False)
    with pytest.raises(wire.WireError, match="no 'reply.payload' in the message"):
        wire.take(RecordDict(), "reply.payload", "reply of site 1")


def test_metrics_and_control_records() -> None:
    rec = wire.metrics_record({"auc": 0.75, "n": 12, "nan": float("nan")}, "eval")
    assert isinstance(rec, MetricRecord)
    got = wire.read_metrics(rec, "eval")
    assert got["auc"] == 0.75 and got["n"] == 12.0 and math.isnan(got["nan"])
    with pytest.raises(PayloadError, match=r"eval\['note'\]: metrics must be numbers, got str"):
        wire.metrics_record({"note": "x"}, "eval")
    with pytest.raises(wire.WireError, match="expected a MetricRecord"):
        wire.read_metrics(ConfigRecord({"a": 1}), "eval")
    content = RecordDict()
    ctl = {"round": 3, "fold": None, "method": {"name": "fedskd", "gamma": 1.0}, "splits": ["test"]}
    wire.put_json(content, "medfl", ctl)
    assert wire.take_json(decode_records(encode_records(content)), "medfl", "x") == ctl


def test_reply_size_without_copying_equals_the_encoded_reply() -> None:
    """The in-process engine measures each reply with :func:`wire.train_answer_size` (no
    tensor copied); it must be the byte count of the reply Flower would carry."""
    g = torch.Generator().manual_seed(1)
    payloads = [
        {"model": {"w": torch.randn(16, 8, 3, 3, generator=g), "n": torch.tensor(3)}},
        {"half": torch.randn(5, generator=g).to(torch.bfloat16), "flags": torch.tensor([True, False]),
         "nested": [torch.zeros(0, 4), (torch.arange(3, dtype=torch.int32), 2.5)], "none": None},
        {"big": torch.randn(300, 700, generator=g, dtype=torch.float64)},   # a long NumPy header
        {},
    ]
    for i, payload in enumerate(payloads):
        for metrics in ({}, {"loss": 0.123456789, "steps": 3.0}):
            want = wire.encoded_size(wire.train_answer("12", payload, metrics, 40 + i))
            assert wire.train_answer_size("12", payload, metrics, 40 + i) == want, (i, metrics)
            # twice: the second answer comes from the size cache
            assert wire.train_answer_size("12", payload, metrics, 40 + i) == want
    with pytest.raises(PayloadError, match="strings may not leave a client"):
        wire.train_answer_size("1", {"path": "/x.dcm"}, {}, 1)


def test_instruction_size_without_copying_equals_the_encoded_request() -> None:
    """The in-process engine measures each instruction with :func:`wire.instruction_request_size`
    (no tensor copied): the byte count of the request Flower would carry, for every kind of
    payload and config, and the same strings refused."""
    g = torch.Generator().manual_seed(2)
    payloads = [
        {"model": {"w": torch.randn(16, 8, 3, 3, generator=g), "n": torch.tensor(3)}, "tag": "x" * 40},
        {"half": torch.randn(5, generator=g).to(torch.bfloat16), "flags": torch.tensor([True, False]),
         "nested": [torch.zeros(0, 4), (torch.arange(3, dtype=torch.int32), 2.5)], "none": None},
        {"big": torch.randn(300, 700, generator=g, dtype=torch.float64)},
        {},
    ]
    control = {"protocol": wire.PROTOCOL, "client": "4", "round": 2, "method": {"name": "fedavg"}, "fold": None}
    for payload in payloads:
        for config in ({}, {"lr": 0.05, "dp_release": True, "splits": ["test"]}):
            ins = Instruction(payload=payload, config=config)
            want = wire.encoded_size(wire.instruction_request(control, ins))
            cache = wire.RecordCache()
            assert wire.instruction_request_size(control, ins) == want
            assert [wire.instruction_request_size(control, ins, cache) for _ in range(2)] == [want, want]
    with pytest.raises(PayloadError, match="only tensors and scalars"):
        wire.instruction_request_size(control, Instruction(payload={"f": open}))
