"""medfl's message contents: exact round trips, only tensors and scalars travel, a strict
byte encoding whose size :func:`wire.encoded_size` gives without serialising, and the 1:1
conversion to Flower's records (:mod:`medfl.flower.proxy`)."""

from __future__ import annotations

import math
import struct

import numpy as np
import pytest
import torch

from medfl import wire
from medfl.messages import Instruction, PayloadError


def _same(a, b) -> None:  # type: ignore[no-untyped-def]
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=a.dtype.kind in "fc")
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


def _value() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "weights": {"conv.weight": torch.randn(3, 2, 3, 3, generator=g), "bn.num_batches_tracked": torch.tensor(7)},
        "mask": torch.tensor([True, False]), "half": torch.randn(4, generator=g).to(torch.bfloat16),
        "ids": torch.arange(5, dtype=torch.int64), "empty": torch.zeros(0, 3),
        "strided": torch.arange(12.0).reshape(3, 4).t(), "pair": (1, 2.5),
        "chain": [None, True, -3, float("nan"), float("inf"), 0.1 + 0.2], "name": "fedavg", "z": {},
    }


def _contents() -> list[wire.Content]:
    """Varied contents: packed values, every kind of config and metrics value, odd arrays."""
    out = []
    for value in (_value(), {}, [torch.ones(128 * 1024, dtype=torch.uint8)] * 3 + [1, -0.0, None, "é" * 300]):
        c = wire.Content()
        wire.put(c, "v", value, "test")
        wire.put_json(c, wire.CONTROL, {"client": "0", "spec": {"name": "resnet10"}, "fold": None})
        out.append(c)
    out.append(wire.Content())
    out.append(wire.Content({
        "a": wire.Arrays({"f": np.asfortranarray(np.arange(6.0).reshape(2, 3)), "s": np.array(3, np.int8),
                          "c": np.array([1 + 2j], np.complex64), "b": np.zeros((2, 0, 4), bool),
                          "big_endian": np.arange(3, dtype=">i4"), "u": np.arange(4, dtype=np.uint16)[::2]}),
        "c": wire.Config({"i": -2**63, "u": 2**64 - 1, "lu": [1, 2**63], "f": float("nan"), "t": True, "s": "ü",
                          "y": b"\x00\xff", "li": [1, 2],
                          "lf": [0.5], "lt": [False], "ls": ["a", ""], "ly": [b"k", b""], "empty": []}),
        "m": wire.Metrics({"auc": 0.75, "n": 12, "l": [1, 2], "lf": [float("inf")]}),
        "e": wire.Metrics(),
    }))
    return out


def test_pack_unpack_is_exact_through_the_encoding() -> None:
    value = _value()
    content = wire.Content()
    wire.put(content, "ins", value, "test")
    back = wire.take(wire.decode(wire.encode(content)), "ins", "test")
    _same(value, back)
    assert back["weights"]["conv.weight"].data_ptr() != value["weights"]["conv.weight"].data_ptr()
    back["ids"][0] = 9   # decoded tensors are writable and own their memory
    value["ids"][1] = 7  # and the content packed a copy: changing the tensor later changes nothing sent
    assert wire.take(content, "ins", "test")["ids"][1] == 1


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
        wire.unpack(wire.Arrays(), tree, "reply of site 2")
    with pytest.raises(wire.WireError, match="not valid JSON"):
        wire.unpack(arrays, wire.Config({"tree": "{"}), "reply")
    with pytest.raises(wire.WireError, match="unknown tree node"):
        wire.unpack(arrays, wire.Config({"tree": '{"q": 1}'}), "reply")
    with pytest.raises(wire.WireError, match="tensor '0': a list where an array"):
        wire.unpack(wire.Arrays({"0": [1.0]}), tree, "reply")
    with pytest.raises(PayloadError, match="strings may not leave"):   # checked again after decoding
        wire.unpack(*wire.pack({"s": "text"}, "x"), "reply", allow_str=False)
    with pytest.raises(wire.WireError, match="no 'reply.payload' in the message"):
        wire.take(wire.Content(), "reply.payload", "reply of site 1")
    with pytest.raises(wire.WireError, match="not dict"):
        wire.Content()["x"] = {"a": 1}   # records only


def test_metrics_and_control_records() -> None:
    rec = wire.metrics_record({"auc": 0.75, "n": 12, "nan": float("nan")}, "eval")
    assert isinstance(rec, wire.Metrics)
    got = wire.read_metrics(rec, "eval")
    assert got["auc"] == 0.75 and got["n"] == 12.0 and math.isnan(got["nan"])
    with pytest.raises(PayloadError, match=r"eval\['note'\]: metrics must be numbers, got str"):
        wire.metrics_record({"note": "x"}, "eval")
    with pytest.raises(wire.WireError, match="expected a Metrics record"):
        wire.read_metrics(wire.Config({"a": 1}), "eval")
    content = wire.Content()
    ctl = {"round": 3, "fold": None, "method": {"name": "fedskd", "gamma": 1.0}, "splits": ["test"]}
    wire.put_json(content, "medfl", ctl)
    assert wire.take_json(wire.decode(wire.encode(content)), "medfl", "x") == ctl


def test_every_content_round_trips_and_encoded_size_is_its_length() -> None:
    for content in _contents():
        data = wire.encode(content)
        assert wire.encoded_size(content) == len(data)
        back = wire.decode(data)
        assert list(back) == list(content) and [type(r) for r in back.values()] == [type(r) for r in content.values()]
        _same(dict(content), dict(back))
        assert wire.encode(back) == data


def test_encode_refuses_what_the_format_cannot_carry() -> None:
    for record, match in [(wire.Config({"x": [1, 2.0]}), "cannot travel in a Config"),
                          (wire.Config({"x": None}), "NoneType None cannot travel"),
                          (wire.Config({"x": [[1]]}), "cannot travel"),
                          (wire.Metrics({"x": "1"}), "cannot travel in a Metrics"),
                          (wire.Metrics({"x": True}), "cannot travel in a Metrics"),
                          (wire.Config({"x": 2**64}), "cannot be encoded"),
                          (wire.Config({"x": [-1, 2**63]}), "cannot be encoded"),   # a list is all i64 or all u64
                          (wire.Arrays({"x": np.array(["a"])}), "not a numeric NumPy array"),
                          (wire.Arrays({"x": [1.0]}), "not a numeric NumPy array")]:
        for measure in (wire.encode, wire.encoded_size):
            with pytest.raises(wire.WireError, match=match):
                measure(wire.Content({"r": record}))
    smuggled = wire.Content()
    dict.__setitem__(smuggled, "r", {"a": 1})   # a plain dict past Content's own check
    with pytest.raises(wire.WireError, match="is not a record"):
        wire.encode(smuggled)


def _header(records: int = 1) -> bytes:
    return b"MFLW" + bytes([1]) + struct.pack("<I", records)


def _text(s: str) -> bytes:
    return struct.pack("<I", len(s.encode())) + s.encode()


def test_decode_is_strict() -> None:
    data = wire.encode(_contents()[-1])
    for n in range(len(data)):   # every truncation names what it cut
        with pytest.raises(wire.WireError, match="truncated|bytes after"):
            wire.decode(data[:n])
    cases = [
        (b"GIF89a" + data[6:], "bad magic"),
        (data[:4] + bytes([2]) + data[5:], "format version 2"),
        (data + b"\x00", "1 bytes after the content's end"),
        ("text", "not bytes"),
        (_header() + _text("r") + b"z" + struct.pack("<I", 0), "unknown kind b'z'"),
        (_header(2) + (_text("r") + b"m" + struct.pack("<I", 0)) * 2, "duplicate name"),
        (_header() + _text("r") + b"m" + struct.pack("<I", 2) + (_text("k") + b"i" + struct.pack("<q", 1)) * 2,
         "duplicate entry 'k'"),
        (_header() + _text("r") + b"m" + struct.pack("<I", 1) + _text("k") + b"s" + _text("x"), "unknown value tag"),
        (_header() + _text("r") + b"c" + struct.pack("<I", 1) + _text("k") + b"?\x02", "bool byte 2"),
        (_header() + struct.pack("<I", 2) + b"\xff\xfe", "not UTF-8"),
        (_header() + _text("r") + b"a" + struct.pack("<I", 1) + _text("k") + _text("|O8") + b"\x00",
         "not a numeric NumPy dtype"),
        (_header() + _text("r") + b"a" + struct.pack("<I", 1) + _text("k") + _text("<f3") + b"\x00",
         "dtype '<f3' is not a numeric NumPy dtype"),
        # huge declared sizes: refused before anything is allocated for them
        (_header() + struct.pack("<I", 2**32 - 1), "truncated: record 0 name"),
        (_header(2**32 - 1), "truncated: record 0 name length"),
        (_header() + _text("r") + b"c" + struct.pack("<I", 1) + _text("k") + b"y" + struct.pack("<I", 2**32 - 1),
         "needs 4294967295 bytes"),
        (_header() + _text("r") + b"c" + struct.pack("<I", 1) + _text("k") + b"li" + struct.pack("<I", 2**32 - 1),
         "truncated"),
        (_header() + _text("r") + b"a" + struct.pack("<I", 1) + _text("k") + _text("<f8") + bytes([2])
         + struct.pack("<QQ", 2**40, 2**40), r"needs 9671406556917033397649408 bytes"),
        (_header() + _text("r") + b"a" + struct.pack("<I", 1) + _text("k") + _text("<f8") + bytes([40]),
         "40 dimensions"),
        (_header() + _text("r") + b"a" + struct.pack("<I", 1) + _text("k") + _text("<f8") + bytes([2])
         + struct.pack("<QQ", 0, 2**64 - 1), r"shape \[0, 18446744073709551615\]"),
    ]
    for bad, match in cases:
        with pytest.raises(wire.WireError, match=match):
            wire.decode(bad)
    rng = np.random.default_rng(0)
    for _ in range(500):   # garbage: a few bytes changed anywhere decode or raise WireError, never crash
        garbled = bytearray(data)
        for i in rng.integers(len(data), size=3):
            garbled[i] = int(rng.integers(256))
        try:
            wire.decode(bytes(garbled))
        except wire.WireError:
            pass


def test_reply_size_without_copying_equals_the_encoded_reply() -> None:
    """The in-process engine measures each reply with :func:`wire.train_answer_size` (no
    tensor copied); it must be the byte count of the reply a deployment carries."""
    g = torch.Generator().manual_seed(1)
    payloads = [
        {"model": {"w": torch.randn(16, 8, 3, 3, generator=g), "n": torch.tensor(3)}},
        {"half": torch.randn(5, generator=g).to(torch.bfloat16), "flags": torch.tensor([True, False]),
         "nested": [torch.zeros(0, 4), (torch.arange(3, dtype=torch.int32), 2.5)], "none": None},
        {"big": torch.randn(300, 700, generator=g, dtype=torch.float64)},
        {},
    ]
    for i, payload in enumerate(payloads):
        for metrics in ({}, {"loss": 0.123456789, "steps": 3.0}):
            want = len(wire.encode(wire.train_answer("12", payload, metrics, 40 + i)))
            assert wire.train_answer_size("12", payload, metrics, 40 + i) == want, (i, metrics)
    with pytest.raises(PayloadError, match="strings may not leave a client"):
        wire.train_answer_size("1", {"path": "/x.dcm"}, {}, 1)


def test_instruction_size_without_copying_equals_the_encoded_request() -> None:
    """The in-process engine measures each instruction with :func:`wire.instruction_request_size`
    (no tensor copied): the byte count of the request a deployment carries, for every kind of
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
            want = len(wire.encode(wire.instruction_request(control, ins)))
            cache = wire.RecordCache()
            assert wire.instruction_request_size(control, ins) == want
            assert [wire.instruction_request_size(control, ins, cache) for _ in range(2)] == [want, want]
    with pytest.raises(PayloadError, match="only tensors and scalars"):
        wire.instruction_request_size(control, Instruction(payload={"f": open}))


# ---------------------------------------------------------------------- Flower's records
def test_records_round_trip_exactly_through_flowers_protobuf() -> None:
    pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")
    from flwr.app import ArrayRecord, ConfigRecord, MetricRecord

    from medfl.flower.proxy import content_of, from_records, records_of, to_records
    from flower_grid import over_the_wire

    for content in _contents():
        rd = to_records(content)
        assert list(rd) == list(content)
        kinds = {wire.Arrays: ArrayRecord, wire.Config: ConfigRecord, wire.Metrics: MetricRecord}
        assert [type(r) for r in rd.values()] == [kinds[type(r)] for r in content.values()]
        back = from_records(over_the_wire(rd))
        assert [type(r) for r in back.values()] == [type(r) for r in content.values()]
        _same(dict(content), dict(back))
        assert wire.encode(back) == wire.encode(content)
        assert wire.encode(content_of(over_the_wire(records_of(content, pack=True)))) == wire.encode(content)
    value = _value()
    content = wire.Content()
    wire.put(content, "ins", value, "test")
    _same(value, wire.take(from_records(over_the_wire(to_records(content))), "ins", "t"))


def test_from_records_refuses_what_is_not_a_medfl_record() -> None:
    pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")
    import io

    from flwr.app import Array, ArrayRecord, RecordDict

    from medfl.flower.proxy import from_records

    with pytest.raises(wire.WireError, match="record 'x': a dict, not an ArrayRecord"):
        from_records({"x": {"a": 1}})   # type: ignore[arg-type]
    torchy = Array(dtype="float32", shape=(1,), stype="torch.raw", data=b"\x00" * 4)
    with pytest.raises(wire.WireError, match="entry 'w': not a NumPy array"):
        from_records(RecordDict({"a": ArrayRecord({"w": torchy})}))
    head = np.lib.format.header_data_from_array_1_0(np.zeros(2))
    head["shape"] = (2**40, 2**20)   # declares 8 PiB in 16 bytes
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, head)
    huge = Array(dtype="float64", shape=(2,), stype="numpy.ndarray", data=buf.getvalue() + b"\x00" * 16)
    with pytest.raises(wire.WireError, match=r"shape \(1099511627776, 1048576\).* in 16 bytes"):
        from_records(RecordDict({"a": ArrayRecord({"w": huge})}))
    junk = Array(dtype="float64", shape=(2,), stype="numpy.ndarray", data=b"not npy")
    with pytest.raises(wire.WireError, match="not .npy bytes"):
        from_records(RecordDict({"a": ArrayRecord({"w": junk})}))
