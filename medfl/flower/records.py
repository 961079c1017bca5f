"""medfl's message contents (:class:`medfl.wire.Content`) as Flower's records, and back.

The one place that converts: the Flower coordinator, sites and SecAgg+ build and read
:mod:`medfl.wire` contents and call :func:`to_recorddict` where they hand a message to Flower
(``Message(content=...)``), :func:`from_recorddict` where they take one from it
(``message.content``). The mapping is 1:1: :class:`~medfl.wire.Arrays` is an ``ArrayRecord`` of
NumPy ``Array`` s (``np.save`` bytes), :class:`~medfl.wire.Config` a ``ConfigRecord``,
:class:`~medfl.wire.Metrics` a ``MetricRecord``.
"""

from __future__ import annotations

import io
import math

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from medfl.wire import Arrays, Config, Content, Metrics, WireError

__all__ = ["to_recorddict", "from_recorddict"]

_READ_HEADER = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


def to_recorddict(content: Content) -> RecordDict:
    """``content`` as the ``RecordDict`` of a Flower message (same names, same order).

    Raises:
        WireError: a record that is not :class:`~medfl.wire.Arrays`, ``Config`` or ``Metrics``.
    """
    out = RecordDict()
    for name, record in content.items():
        if isinstance(record, Arrays):
            out[name] = ArrayRecord({k: Array(a) for k, a in record.items()})
        elif isinstance(record, (Config, Metrics)):
            out[name] = (ConfigRecord if isinstance(record, Config) else MetricRecord)(dict(record))
        else:
            raise WireError(f"record {name!r}: {type(record).__name__} is not a record (Arrays, Config, Metrics)")
    return out


def _numpy(a: Array, where: str) -> np.ndarray:
    """An ``Array``'s NumPy array, a read-only view of its bytes; its ``.npy`` header is read
    and checked against them first, so a header that declares more than the bytes hold
    allocates nothing."""
    if not isinstance(a, Array) or a.stype != "numpy.ndarray":
        raise WireError(f"{where}: not a NumPy array (stype {getattr(a, 'stype', None)!r})")
    buf = io.BytesIO(a.data)
    try:
        shape, fortran, dtype = _READ_HEADER[np.lib.format.read_magic(buf)](buf)
    except (KeyError, ValueError, TypeError, EOFError) as exc:
        raise WireError(f"{where}: not .npy bytes ({exc})") from None
    need, held = dtype.itemsize * math.prod(shape), len(a.data) - buf.tell()
    if dtype.kind not in "biufc" or dtype.fields is not None or need != held:
        raise WireError(f"{where}: a {dtype} array of shape {shape} ({need} bytes) in {held} bytes of data")
    return np.frombuffer(a.data, dtype=dtype, offset=buf.tell()).reshape(shape, order="F" if fortran else "C")


def from_recorddict(rd: RecordDict) -> Content:
    """The :class:`~medfl.wire.Content` of a Flower message's ``RecordDict`` (its arrays are
    read-only views of the message's bytes).

    Raises:
        WireError: a record of another kind, or an array that is not a numeric NumPy array.
    """
    out = Content()
    for name, record in rd.items():
        if isinstance(record, ArrayRecord):
            out[name] = Arrays({k: _numpy(a, f"record {name!r} entry {k!r}") for k, a in record.items()})
        elif isinstance(record, ConfigRecord):
            out[name] = Config(record)
        elif isinstance(record, MetricRecord):
            out[name] = Metrics(record)
        else:
            raise WireError(f"record {name!r}: a {type(record).__name__}, not an ArrayRecord, ConfigRecord or "
                            "MetricRecord")
    return out
