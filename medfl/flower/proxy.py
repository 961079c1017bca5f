"""The ClientApp each SuperNode starts per message: a thin proxy to the site's worker.

Flower 1.41 starts a fresh ``flwr-clientapp`` process for every message a SuperNode
receives. Importing torch, MONAI and medfl in each of them costs seconds per message, so
``medfl flower site`` runs a long-lived *site worker* next to the SuperNode
(:mod:`medfl.flower.worker`: the site's config, data split and imports stay warm) and this
ClientApp only forwards each message's records to it over a local Unix socket (the node
config's ``worker`` entry) and returns the worker's answer. Without a ``worker`` entry the
message is handled in this process by :func:`medfl.flower.site.handle` (slower, same result).

This module imports nothing from medfl at import time (importing the ``medfl`` package
pulls in torch): :func:`medfl.flower.deploy.write_app` ships a copy of it in the Flower
app as ``medfl_flower_proxy``, so the per-message process loads only Flower.

The coordinator sends a message's records packed into one record (:func:`pack_records`; all
but the hello, which says which protocol a site speaks, and the messages of a SecAgg+ round,
whose arrays Flower's ``secaggplus_mod`` masks): Flower moves every array of a message as
objects of its own, with a request per object on every hop. This proxy hands the packed bytes
to the worker as they are and packs its answer, decoding nothing.

Frames on the socket: an 8-byte big-endian length, then that many bytes; a request is a
JSON header frame (``{"type": message type, "age": seconds this process had run}``, ``age``
where known) followed by the serialized ``RecordDict``
(Flower's protobuf); an answer is a JSON header frame (``{"ok": true}`` or
``{"ok": false, "error": text}``) followed, when ok, by the reply's ``RecordDict``.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import time
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

__all__ = ["app", "forward", "forward_bytes", "send_frame", "recv_frame", "encode_records", "decode_records",
           "PACKED", "pack_records", "packed", "inline_max", "packed_bytes", "unpack_records", "WorkerError",
           "secure_aggregation_mod", "process_age"]

_LEN = struct.Struct(">Q")

#: The one record of a packed message's content (:func:`pack_records`).
PACKED = "medfl.packed"
_PACKED_ARRAY = "records"
#: The packed array's ``stype``: what its bytes are (Flower's protobuf of a ``RecordDict``).
PACKED_STYPE = "medfl.recorddict.protobuf"


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


def encode_records(content: RecordDict) -> bytes:
    """A ``RecordDict`` as Flower's protobuf bytes."""
    from flwr.common.serde import recorddict_to_proto

    return recorddict_to_proto(content).SerializeToString()


def decode_records(data: bytes) -> RecordDict:
    """The ``RecordDict`` of :func:`encode_records`' bytes."""
    from flwr.common.serde import recorddict_from_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=E0611

    return recorddict_from_proto(ProtoRecordDict.FromString(data))


def inline_max() -> int:
    """The largest packed message, in bytes, that travels as one bytes value of a config record
    (:func:`packed`): Flower's array chunk size (``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``, 5 MB),
    the most Flower itself puts in one request."""
    from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE

    return int(FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE)


def packed(data: bytes) -> RecordDict:
    """A message content that carries ``data`` (a ``RecordDict``'s protobuf bytes,
    :func:`encode_records`) as one record: Flower moves each array of a message as objects of
    its own (a request per object on every hop: coordinator, SuperLink, SuperNode, ClientApp),
    so a message of 60 tensors took 60-odd requests each way where this takes three to five.

    Up to :func:`inline_max` bytes, ``data`` is the one bytes value of a config record: three
    Flower objects (the message, its record dict, the record). Larger, it is one uint8 array,
    which Flower cuts into chunks of that size, so that no request carries a whole model: five
    objects, and one per further chunk."""
    data = bytes(data)
    if len(data) <= inline_max():
        return RecordDict({PACKED: ConfigRecord({_PACKED_ARRAY: data})})
    return RecordDict({PACKED: ArrayRecord({_PACKED_ARRAY: Array(dtype="uint8", shape=(len(data),),
                                                                    stype=PACKED_STYPE, data=data)})})


def pack_records(content: RecordDict) -> RecordDict:
    """``content`` packed into one record (:func:`packed`); :func:`unpack_records` gives it back."""
    return packed(encode_records(content))


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


def unpack_records(content: RecordDict) -> RecordDict:
    """The content a packed content carries (:func:`pack_records`), or ``content`` itself when it is not packed.

    Raises:
        ValueError: the packed bytes are not a ``RecordDict`` (the decoder's error quoted).
    """
    data = packed_bytes(content)
    if data is None:
        return content
    try:
        return decode_records(data)
    except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and Flower's checks: one error
        raise ValueError(f"a packed message's bytes are not a record dict ({type(exc).__name__}: {exc})") from None


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


def forward(socket_path: str, message_type: str, content: RecordDict, timeout: float | None = None,
            run_config: dict[str, Any] | None = None) -> RecordDict:
    """Send one message's records to the site worker at ``socket_path``; return its answer
    (:func:`forward_bytes` of their protobuf bytes).

    Raises:
        WorkerError: the worker is not running, or it failed (its error text included).
    """
    return decode_records(forward_bytes(socket_path, message_type, encode_records(content), timeout, run_config))


def forward_bytes(socket_path: str, message_type: str, data: bytes, timeout: float | None = None,
                  run_config: dict[str, Any] | None = None) -> bytes:
    """Send one message's records (their protobuf bytes, :func:`encode_records`) to the site
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
        data = packed_bytes(msg.content)
        if data is not None:   # the worker reads the packed bytes as they are; its answer goes back packed
            return Message(packed(forward_bytes(worker, message_type, data, run_config=rc)), reply_to=msg)
        content = forward(worker, message_type, msg.content, run_config=rc)
    else:  # no worker: handle the message in this process (it answers a packed message packed)
        from medfl.config_file import refuse_syntax
        from medfl.flower.site import handle_locally

        refuse_syntax(rc, f"medfl site {node_config.get('client-id', '?')}: the Flower run config")
        content = handle_locally(node_config, message_type, msg.content)
    return Message(content, reply_to=msg)


app = ClientApp()


@app.query("hello")
def hello(msg: Message, context: Context) -> Message:
    """``query.hello``: forwarded to the site."""
    return _dispatch(msg, context)


@app.train(mods=[secure_aggregation_mod])
def train(msg: Message, context: Context) -> Message:
    """``train``: forwarded to the site (through SecAgg+ in a secure-aggregation round)."""
    return _dispatch(msg, context)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """``evaluate``: forwarded to the site."""
    return _dispatch(msg, context)


@app.evaluate("validate")
def validate(msg: Message, context: Context) -> Message:
    """``evaluate.validate``: forwarded to the site."""
    return _dispatch(msg, context)


@app.evaluate("score")
def score(msg: Message, context: Context) -> Message:
    """``evaluate.score``: forwarded to the site."""
    return _dispatch(msg, context)
