"""medfl's message contents and their byte encoding: NumPy and the standard library only.

The lowest layer of every message medfl sends, in process, over Flower and over NVIDIA FLARE.
It imports nothing else (not medfl, torch or Flower), so that the Flower ClientApp each
SuperNode starts per message can carry a copy of it (:func:`medfl.flower.deploy.write_app`
ships it beside :mod:`medfl.flower.proxy` as ``medfl_wire_format.py``) and convert records to
these bytes without importing torch. :mod:`medfl.wire` builds medfl's messages from these
contents and re-exports every name here.

Contents. A :class:`Content` is an ordered ``{name: record}``; a record is one of three kinds,
as Flower's: :class:`Arrays` (``{key: NumPy array}``, Flower's ``ArrayRecord``), :class:`Config`
(``{key: int | float | bool | str | bytes}`` or a list of one of them, ``ConfigRecord``) and
:class:`Metrics` (``{key: int | float}`` or a list of ints or of floats, ``MetricRecord``).

Encoding (:func:`encode`, :func:`decode`; integers little-endian, ``str``: a u32 byte length
and UTF-8)::

    content = b"MFLW" | u8 version (1) | u32 record count | record*
    record  = str name | u8 kind (b"a" arrays, b"c" config, b"m" metrics) | u32 entry count | entry*
    arrays entry = str key | str dtype (NumPy's ``dtype.str``, e.g. "<f4"; kinds b, i, u, f, c)
                   | u8 ndim | u64 dim * ndim | data (C order, itemsize * prod(dims) bytes)
    config or metrics entry = str key | value
    value   = u8 tag | "i": i64 | "u": u64 (an int of 2**63 or more) | "f": f64 | "?": u8 0 or 1
                     | "s": str | "y": u32 length, bytes
                     | "l": u8 element tag, u32 count, count element payloads (no tag each)

Metrics take the tags ``i``, ``u``, ``f`` and lists of them; a list holding an int of 2**63 or
more is all ``u`` (as Flower's records). :func:`decode` is strict: a buffer that is
truncated, has bytes after the content, or declares sizes it does not hold raises
:class:`WireError` saying what and where, before anything is allocated for it.
:func:`encoded_size` is ``len(encode(content))`` computed from the arrays' dtypes and shapes
(no array is serialised). The message's envelope is not counted (the transport's headers,
Flower's ``Metadata``).
"""

from __future__ import annotations

import math
import re
import struct
from typing import Any, Iterator

import numpy as np

__all__ = ["PayloadError", "WireError", "Content", "Arrays", "Config", "Metrics", "encode", "decode", "encoded_size"]


class PayloadError(TypeError):
    """A message carried something other than tensors and scalars, or client data
    (:mod:`medfl.messages` says what may travel)."""


class WireError(PayloadError):
    """A message does not hold what a medfl message must (missing or malformed records or bytes)."""


class Arrays(dict):
    """An arrays record (Flower's ``ArrayRecord``): ``{key: NumPy array}`` of kinds b, i, u, f, c."""


class Config(dict):
    """A config record (Flower's ``ConfigRecord``): ``{key: value}``, a value an ``int``, ``float``,
    ``bool``, ``str`` or ``bytes``, or a list of one of them."""


class Metrics(dict):
    """A metrics record (Flower's ``MetricRecord``): ``{key: int | float}``, or a list of ints or of floats."""


class Content(dict):
    """A message's content (Flower's ``RecordDict``): an ordered ``{name: record}`` of
    :class:`Arrays`, :class:`Config` and :class:`Metrics` records."""

    def __setitem__(self, name: str, record: Arrays | Config | Metrics) -> None:
        if not isinstance(name, str) or type(record) not in _KINDS:
            raise WireError(f"record {name!r}: a content holds Arrays, Config and Metrics records by name, "
                            f"not {type(record).__name__}")
        super().__setitem__(name, record)


# ---------------------------------------------------------------------- encoding
_MAGIC, _VERSION = b"MFLW", 1
_KINDS: dict[type, bytes] = {Arrays: b"a", Config: b"c", Metrics: b"m"}
_RECORDS = {v: k for k, v in _KINDS.items()}
_U8, _U32, _U64, _I64, _F64 = (struct.Struct("<" + c) for c in "BIQqd")
_NUMBERS = {b"i": _I64, b"u": _U64, b"f": _F64}
_TAGS = {b"c": {b"i", b"u", b"f", b"?", b"s", b"y"}, b"m": {b"i", b"u", b"f"}}   # the value tags of each kind of record
_DTYPE = re.compile(r"[<>|][biufc]\d{1,2}")


def _text(s: str) -> bytes:
    b = s.encode()
    return _U32.pack(len(b)) + b


def _tag(v: Any) -> bytes:
    if isinstance(v, bool):
        return b"?"
    if isinstance(v, int) and v >= 2**63:
        return b"u"
    for tag, kind in ((b"i", int), (b"f", float), (b"s", str), (b"y", bytes), (b"l", list)):
        if isinstance(v, kind):
            return tag
    return b""


def _payload(tag: bytes, v: Any) -> bytes:
    if tag == b"s":
        return _text(v)
    if tag == b"y":
        return _U32.pack(len(v)) + v
    return _U8.pack(v) if tag == b"?" else _NUMBERS[tag].pack(v)


def _value(v: Any, kind: bytes, where: str) -> bytes:
    """A config or metrics entry's value, tagged (the module docstring's ``value``)."""
    tag = _tag(v)
    tags = [_tag(x) for x in v] if tag == b"l" else [tag]
    if set(tags) == {b"i", b"u"}:
        tags = [b"u"] * len(tags)
    if len(set(tags)) > 1 or not set(tags) <= _TAGS[kind]:
        raise WireError(f"{where}: {type(v).__name__} {v!r:.60} cannot travel in a "
                        f"{_RECORDS[kind].__name__} record")
    try:
        if tag != b"l":
            return tag + _payload(tag, v)
        elem = tags[0] if v else b"i"
        return b"l" + elem + _U32.pack(len(v)) + b"".join(_payload(elem, x) for x in v)
    except (struct.error, UnicodeEncodeError) as exc:
        raise WireError(f"{where}: {v!r:.60} cannot be encoded ({exc})") from None


def _chunks(content: Content, measure: bool) -> Iterator[bytes | int]:
    """The encoding of ``content`` in pieces; with ``measure``, each array's data as its length."""
    yield _MAGIC + _U8.pack(_VERSION) + _U32.pack(len(content))
    for name, record in content.items():
        kind = _KINDS.get(type(record))
        if kind is None or not isinstance(name, str):
            raise WireError(f"record {name!r}: {type(record).__name__} is not a record (Arrays, Config, Metrics)")
        yield _text(name) + kind + _U32.pack(len(record))
        for key, v in record.items():
            where = f"record {name!r} entry {key!r}"
            if kind != b"a":
                yield _text(key) + _value(v, kind, where)
                continue
            if not isinstance(v, np.ndarray) or not _DTYPE.fullmatch(v.dtype.str) or v.ndim > 32:
                raise WireError(f"{where}: {type(v).__name__} {getattr(v, 'dtype', '')} is not a numeric NumPy "
                                "array of at most 32 dimensions")
            yield _text(key) + _text(v.dtype.str) + _U8.pack(v.ndim) + b"".join(_U64.pack(d) for d in v.shape)
            yield v.nbytes if measure else v.tobytes()


def encode(content: Content) -> bytes:
    """``content`` as bytes (the module docstring's format); :func:`decode` gives it back.

    Raises:
        WireError: a record or value that the format cannot carry.
    """
    return b"".join(_chunks(content, False))  # type: ignore[arg-type]


def encoded_size(content: Content) -> int:
    """``len(encode(content))``, from the arrays' dtypes and shapes (none is serialised): the
    bytes medfl records for a message, in process, over Flower and over NVIDIA FLARE alike.

    Raises:
        WireError: as :func:`encode`.
    """
    return sum(c if isinstance(c, int) else len(c) for c in _chunks(content, True))


class _Reader:
    """Reads :func:`encode`'s bytes, refusing any length the buffer does not hold."""

    def __init__(self, data: bytes) -> None:
        self.data, self.pos = memoryview(data).cast("B"), 0

    def take(self, n: int, what: str) -> memoryview:
        left = len(self.data) - self.pos
        if n > left:
            raise WireError(f"truncated: {what} needs {n} bytes at offset {self.pos}, {left} left")
        self.pos += n
        return self.data[self.pos - n:self.pos]

    def num(self, st: struct.Struct, what: str) -> Any:
        return st.unpack(self.take(st.size, what))[0]

    def text(self, what: str) -> str:
        raw = self.take(self.num(_U32, what + " length"), what)
        try:
            return str(raw, "utf-8")
        except UnicodeDecodeError as exc:
            raise WireError(f"{what} at offset {self.pos - len(raw)} is not UTF-8 ({exc})") from None

    def scalar(self, tag: bytes, what: str) -> Any:
        if tag == b"s":
            return self.text(what)
        if tag == b"y":
            return bytes(self.take(self.num(_U32, what + " length"), what))
        if tag == b"?":
            b = self.num(_U8, what)
            if b > 1:
                raise WireError(f"{what}: bool byte {b} at offset {self.pos - 1}")
            return bool(b)
        return self.num(_NUMBERS[tag], what)

    def value(self, kind: bytes, what: str) -> Any:
        tag = bytes(self.take(1, what + " tag"))
        listed = tag == b"l"
        if listed:
            tag = bytes(self.take(1, what + " element tag"))
        if tag not in _TAGS[kind]:
            raise WireError(f"{what}: unknown value tag {tag!r} at offset {self.pos - 1} in a "
                            f"{_RECORDS[kind].__name__} record")
        if not listed:
            return self.scalar(tag, what)
        return [self.scalar(tag, what) for _ in range(self.num(_U32, what + " count"))]

    def array(self, what: str) -> np.ndarray:
        dtype = self.text(what + " dtype")
        try:
            dt = np.dtype(dtype if _DTYPE.fullmatch(dtype) else "O")
        except TypeError:
            dt = np.dtype("O")
        if dt.kind == "O":
            raise WireError(f"{what}: dtype {dtype!r:.40} is not a numeric NumPy dtype")
        ndim = self.num(_U8, what + " ndim")
        if ndim > 32:
            raise WireError(f"{what}: {ndim} dimensions (at most 32)")
        dims = [self.num(_U64, what + " shape") for _ in range(ndim)]
        n = dt.itemsize * math.prod(dims)
        raw = self.take(n, f"{what} data (shape {dims}, {dtype})")
        try:
            return np.frombuffer(raw, dtype=dt).reshape(dims).copy()
        except ValueError as exc:
            raise WireError(f"{what}: shape {dims} ({exc})") from None


def decode(data: bytes) -> Content:
    """The :class:`Content` that :func:`encode` wrote as ``data``.

    Raises:
        WireError: ``data`` is not exactly one encoded content (bad magic or version, truncated,
            a length it does not hold, an unknown record kind or value tag, a duplicate name,
            bytes after the end), naming what and where.
    """
    try:
        r = _Reader(data)
    except TypeError as exc:
        raise WireError(f"not bytes: {type(data).__name__} ({exc})") from None
    magic = bytes(r.take(len(_MAGIC), "the magic"))
    if magic != _MAGIC:
        raise WireError(f"bad magic {magic!r}: not a medfl message content (b'MFLW')")
    version = r.num(_U8, "the version")
    if version != _VERSION:
        raise WireError(f"format version {version}, this medfl reads version {_VERSION}")
    content = Content()
    for i in range(r.num(_U32, "the record count")):
        name = r.text(f"record {i} name")
        kind = bytes(r.take(1, f"record {name!r} kind"))
        if kind not in _RECORDS or name in content:
            raise WireError(f"record {name!r}: " + ("a duplicate name" if name in content else
                                                    f"unknown kind {kind!r} at offset {r.pos - 1}"))
        record = _RECORDS[kind]()
        for j in range(r.num(_U32, f"record {name!r} entry count")):
            key = r.text(f"record {name!r} entry {j} key")
            if key in record:
                raise WireError(f"record {name!r}: duplicate entry {key!r}")
            what = f"record {name!r} entry {key!r}"
            record[key] = r.array(what) if kind == b"a" else r.value(kind, what)
        content[name] = record
    if r.pos != len(r.data):
        raise WireError(f"{len(r.data) - r.pos} bytes after the content's end (offset {r.pos})")
    return content
