"""The ClientApp each SuperNode starts per message: a thin proxy to the site's worker, and
the conversion of medfl's message contents to Flower's records and back.

Flower starts a fresh ``flwr-clientapp`` process for every message a SuperNode receives.
Importing torch, MONAI and medfl in each of them costs seconds per message, so ``medfl flower
site`` runs a long-lived *site worker* next to the SuperNode (:mod:`medfl.flower.worker`: the
site's config, data split and imports stay warm) and this ClientApp only forwards each
message's bytes to it over a local Unix socket (the node config's ``worker`` entry) and
returns the worker's answer. Without a ``worker`` entry the message is handled in this process
by :func:`medfl.site_messages.handle_locally` (slower, same result).

This module imports Flower, NumPy and medfl's codec (:mod:`medfl.wire_format`) only:
:func:`medfl.flower.deploy.write_app` ships a copy of it in the Flower app as
``medfl_flower_proxy``, with the codec's copy beside it as ``medfl_wire_format``, so that the
per-message process loads no torch.

Contents. A medfl :class:`~medfl.wire_format.Content` maps 1:1 onto a Flower ``RecordDict``
(:func:`to_records`, :func:`from_records`): ``Arrays`` is an ``ArrayRecord`` of NumPy
``Array`` s, ``Config`` a ``ConfigRecord``, ``Metrics`` a ``MetricRecord``. Flower moves every
array of a message as objects of its own, with a request per object on every hop, so the
coordinator sends a message's content *packed* (:func:`packed`: its
:func:`~medfl.wire_format.encode` bytes as one record), all but the hello (which says which
protocol a site speaks) and the messages of a SecAgg+ round (whose arrays Flower's
``secaggplus_mod`` masks at the site). A packed message is answered packed.

Frames on the socket: an 8-byte big-endian length, then that many bytes; a request is a
JSON header frame (``{"type": message type, "run_config": {...}, "age": seconds this process
had run}``, ``age`` where known) followed by the content's bytes
(:func:`~medfl.wire_format.encode`); an answer is a JSON header frame (``{"ok": true}`` or
``{"ok": false, "error": text}``) followed, when ok, by the answer's bytes.
"""

from __future__ import annotations

import io
import json
import math
import os
import socket
import struct
import time
from typing import Any, Callable

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

if __name__.startswith("medfl."):
    from medfl import wire_format as codec
else:  # the copy in medfl's Flower app, beside the codec's copy (medfl.flower.deploy.write_app)
    import medfl_wire_format as codec  # type: ignore[no-redef]

__all__ = ["app", "client_app", "forward_bytes", "send_frame", "recv_frame", "to_records", "from_records", "PACKED",
           "INLINE_MAX", "packed", "packed_bytes", "records_of", "content_of", "answer_with", "WorkerError",
           "secure_aggregation_mod", "process_age"]

_LEN = struct.Struct(">Q")

#: The one record of a packed message's content (:func:`packed`).
PACKED = "medfl.packed"
_PACKED_ARRAY = "records"
#: The packed array's ``stype``: what its bytes are (:func:`medfl.wire_format.encode`'s).
PACKED_STYPE = "medfl.wire"
#: The largest packed content, in bytes, that travels as one bytes value of a config record
#: (:func:`packed`); a larger one is an array, which Flower sends in chunks. medfl's choice,
#: below Flower 1.42's array chunk size (5 MB).
INLINE_MAX = 4 << 20

_READ_HEADER = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}


class WorkerError(RuntimeError):
    """The site worker failed to handle a message, or could not be reached."""


def send_frame(sock: socket.socket, data: bytes) -> None:
    """Send one length-prefixed frame."""
    sock.sendall(_LEN.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            raise WorkerError("the site worker closed the connection")
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_frame(sock: socket.socket) -> bytes:
    """Receive one length-prefixed frame."""
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return _recv_exact(sock, n)


def to_records(content: codec.Content) -> RecordDict:
    """``content`` as the ``RecordDict`` of a Flower message (same names, same order).

    Raises:
        WireError: a record that is not ``Arrays``, ``Config`` or ``Metrics``.
    """
    out = RecordDict()
    for name, record in content.items():
        if isinstance(record, codec.Arrays):
            out[name] = ArrayRecord({k: Array(a) for k, a in record.items()})
        elif isinstance(record, (codec.Config, codec.Metrics)):
            out[name] = (ConfigRecord if isinstance(record, codec.Config) else MetricRecord)(dict(record))
        else:
            raise codec.WireError(f"record {name!r}: {type(record).__name__} is not a record (Arrays, Config, "
                                  "Metrics)")
    return out


def _numpy(a: Array, where: str) -> np.ndarray:
    """An ``Array``'s NumPy array, a read-only view of its bytes; its ``.npy`` header is read
    and checked against them first, so a header that declares more than the bytes hold
    allocates nothing."""
    if not isinstance(a, Array) or a.stype != "numpy.ndarray":
        raise codec.WireError(f"{where}: not a NumPy array (stype {getattr(a, 'stype', None)!r})")
    buf = io.BytesIO(a.data)
    try:
        shape, fortran, dtype = _READ_HEADER[np.lib.format.read_magic(buf)](buf)
    except (KeyError, ValueError, TypeError, EOFError) as exc:
        raise codec.WireError(f"{where}: not .npy bytes ({exc})") from None
    need, held = dtype.itemsize * math.prod(shape), len(a.data) - buf.tell()
    if dtype.kind not in "biufc" or dtype.fields is not None or need != held:
        raise codec.WireError(f"{where}: a {dtype} array of shape {shape} ({need} bytes) in {held} bytes of data")
    return np.frombuffer(a.data, dtype=dtype, offset=buf.tell()).reshape(shape, order="F" if fortran else "C")


def from_records(rd: RecordDict) -> codec.Content:
    """The content of a Flower message's ``RecordDict`` (its arrays are read-only views of the
    message's bytes).

    Raises:
        WireError: a record of another kind, or an array that is not a numeric NumPy array.
    """
    out = codec.Content()
    for name, record in rd.items():
        if isinstance(record, ArrayRecord):
            out[name] = codec.Arrays({k: _numpy(a, f"record {name!r} entry {k!r}") for k, a in record.items()})
        elif isinstance(record, ConfigRecord):
            out[name] = codec.Config(record)
        elif isinstance(record, MetricRecord):
            out[name] = codec.Metrics(record)
        else:
            raise codec.WireError(f"record {name!r}: a {type(record).__name__}, not an ArrayRecord, ConfigRecord "
                                  "or MetricRecord")
    return out


def packed(data: bytes) -> RecordDict:
    """A message content that carries ``data`` (a content's :func:`~medfl.wire_format.encode`
    bytes) as one record: Flower moves each array of a message as objects of its own (a
    request per object on every hop: coordinator, SuperLink, SuperNode, ClientApp), so a
    message of 60 tensors took 60-odd requests each way where this takes three to five.

    Up to :data:`INLINE_MAX` bytes, ``data`` is the one bytes value of a config record: three
    Flower objects (the message, its record dict, the record). Larger, it is one uint8 array,
    which Flower cuts into chunks, so that no request carries a whole model."""
    data = bytes(data)
    if len(data) <= INLINE_MAX:
        return RecordDict({PACKED: ConfigRecord({_PACKED_ARRAY: data})})
    return RecordDict({PACKED: ArrayRecord({_PACKED_ARRAY: Array(dtype="uint8", shape=(len(data),),
                                                                    stype=PACKED_STYPE, data=data)})})


def packed_bytes(content: RecordDict) -> bytes | None:
    """The bytes a packed content carries (:func:`packed`); ``None`` for a content that is not packed.

    Raises:
        ValueError: the content has the packed record but not as :func:`packed` writes it.
    """
    if PACKED not in content:
        return None
    record = content[PACKED]
    if len(content) != 1 or not isinstance(record, (ConfigRecord, ArrayRecord)) \
            or list(record.keys()) != [_PACKED_ARRAY]:
        raise ValueError(f"a packed message holds the one record {PACKED!r} (a config record or an array record) "
                         f"with the one entry {_PACKED_ARRAY!r}; got records {sorted(content)}")
    if isinstance(record, ConfigRecord):
        value = record[_PACKED_ARRAY]
        if not isinstance(value, bytes):
            raise ValueError(f"a packed message's config record holds bytes; got {type(value).__name__}")
        return value
    array = record[_PACKED_ARRAY]
    if array.stype != PACKED_STYPE or array.dtype != "uint8" or list(array.shape) != [len(array.data)]:
        raise ValueError(f"a packed message's array is {PACKED_STYPE!r} uint8 bytes; got stype {array.stype!r}, "
                         f"dtype {array.dtype!r}, shape {list(array.shape)} for {len(array.data)} bytes")
    return bytes(array.data)


def records_of(content: codec.Content, pack: bool) -> RecordDict:
    """``content`` as a Flower message's records: :func:`packed` (``pack``) or record by record."""
    return packed(codec.encode(content)) if pack else to_records(content)


def content_of(rd: RecordDict) -> codec.Content:
    """The content a Flower message's records carry, packed or not.

    Raises:
        ValueError: a malformed packed record. WireError (a TypeError): bytes or records that
            are not a medfl content.
    """
    data = packed_bytes(rd)
    return from_records(rd) if data is None else codec.decode(data)


def answer_with(rd: RecordDict, respond: Callable[[bytes], bytes]) -> RecordDict:
    """The records answering a message's records ``rd``: ``respond`` takes the content's bytes
    and gives the answer's, which go back packed when ``rd`` was packed (:func:`packed`) and
    record by record otherwise (SecAgg+'s mod reads the arrays of an answer)."""
    data = packed_bytes(rd)
    if data is not None:
        return packed(respond(data))
    return to_records(codec.decode(respond(codec.encode(from_records(rd)))))


def process_age() -> float | None:
    """Seconds since this process started (Linux ``/proc``; ``None`` elsewhere): in a ClientApp
    process, what Flower's start of it (imports, pulling the message) took before medfl's code ran."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        ticks = int(stat[stat.rindex(b")") + 2:].split()[19])   # field 22: start time, clock ticks after boot
        return max(0.0, time.clock_gettime(time.CLOCK_BOOTTIME) - ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def forward_bytes(socket_path: str, message_type: str, data: bytes, timeout: float | None = None,
                  run_config: dict[str, Any] | None = None) -> bytes:
    """Send one message's content (its :func:`~medfl.wire_format.encode` bytes) to the site
    worker at ``socket_path``; return its answer's. The request's header also says how long
    this process had run (:func:`process_age`), which the site logs with the time it took
    (its ``log.txt``), and carries the run's config (``run_config``), which the worker refuses
    before anything else when it holds MONAI syntax (:meth:`medfl.flower.worker.SiteWorker.handle_connection`).

    Raises:
        WorkerError: the worker is not running, or it failed (its error text included).
    """
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(socket_path)
    except OSError as exc:
        raise WorkerError(f"medfl site worker not reachable at {socket_path} ({exc}); "
                          "start the site with `medfl flower site`") from None
    request: dict[str, Any] = {"type": message_type}
    if run_config is not None:
        request["run_config"] = run_config
    age = process_age()
    if age is not None:
        request["age"] = round(age, 3)
    with sock:
        send_frame(sock, json.dumps(request).encode())
        send_frame(sock, data)
        header: dict[str, Any] = json.loads(recv_frame(sock))
        if not header.get("ok"):
            raise WorkerError(str(header.get("error", "the site worker failed")))
        return recv_frame(sock)


def secure_aggregation_mod(msg: Message, context: Context, call_next: Any) -> Message:
    """Flower's ``secaggplus_mod`` for the ``train`` messages of a secure-aggregation round
    (``fl.secure_aggregation``: those carrying SecAgg+'s configs record); every other message
    goes straight to the handler. The mod keeps its keys and shares in ``context.state``
    (which Flower keeps per run on the SuperNode), answers the key-exchange stages itself, and
    in its collect stage masks the update the handler put in the answer
    (:func:`medfl.flower.secagg.secure_train_answer`)."""
    from flwr.client.mod import secaggplus_mod
    from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

    if msg.metadata.message_type == "train" and RECORD_KEY_CONFIGS in msg.content.config_records:
        return secaggplus_mod(msg, context, call_next)
    return call_next(msg, context)


def _json_or_text(value: Any) -> Any:
    """A run-config value holding a JSON object or list (``overrides``, ``site-nodes``) as
    that object; any other value as it is."""
    if isinstance(value, str) and value[:1] in ("{", "["):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _dispatch(msg: Message, context: Context) -> Message:
    node_config = dict(context.node_config)
    # the run config is the coordinator's text: plain data (its JSON strings too, e.g. overrides), or
    # nothing runs, although no site reads it. The worker checks it (this process imports Flower
    # only: medfl's check would import torch, seconds a message)
    rc = {k: _json_or_text(v) for k, v in dict(context.run_config).items()}
    worker = str(node_config.get("worker", "") or "")
    message_type = msg.metadata.message_type
    if worker:
        def respond(data: bytes) -> bytes:
            return forward_bytes(worker, message_type, data, run_config=rc)
    else:  # no worker: handle the message in this process
        from medfl.config_file import refuse_syntax
        from medfl.site_messages import handle_locally

        refuse_syntax(rc, f"medfl site {node_config.get('client-id', '?')}: the Flower run config")

        def respond(data: bytes) -> bytes:
            return handle_locally(node_config, message_type, data)
    return Message(answer_with(msg.content, respond), reply_to=msg)


def client_app(handler: Callable[[Message, Context], Message]) -> ClientApp:
    """A ClientApp that answers every medfl message type (``query.hello``, ``train`` through
    :func:`secure_aggregation_mod`, ``evaluate``, ``evaluate.validate``, ``evaluate.score``)
    with ``handler``: the deployment's (:data:`app`) and each simulated node's."""
    out = ClientApp()
    for register in (out.query("hello"), out.train(mods=[secure_aggregation_mod]), out.evaluate(),
                     out.evaluate("validate"), out.evaluate("score")):
        register(handler)
    return out


#: The deployment's ClientApp: every message forwarded to the site.
app = client_app(_dispatch)
