"""medfl messages as Flower records, and the content of every message medfl sends.

Both transports build their messages here: the Flower coordinator and sites
(:mod:`medfl.flower`) send them, and the in-process engine (:class:`medfl.engine.runner.Run`)
builds the same contents to measure what a deployment would send
(:mod:`medfl.engine.traffic`), so the two count the same bytes.

Values. An :class:`~medfl.messages.Instruction` or :class:`~medfl.messages.Reply` holds nested
dicts, lists and tuples of tensors and scalars. :func:`pack` turns such a value into two
Flower records that travel in a :class:`flwr.app.RecordDict`:

``<name>.arrays`` (``ArrayRecord``)
    every tensor, as a NumPy array (``np.save`` bytes: dtype and shape kept exactly), keyed
    by its position in the tree (``"0"``, ``"1"``, ...);
``<name>.tree`` (``ConfigRecord``)
    one entry ``tree``: the structure as JSON, with the scalars in place and each tensor
    replaced by its key. JSON keeps ``int``/``float``/``bool``/``None``/``str`` apart and
    Python's float repr round-trips exactly (``NaN`` and ``inf`` included).

:func:`unpack` reverses it exactly (tuples stay tuples, dict order is kept), so a value
sent over Flower equals the in-process one bit for bit. Both sides check what they send
and what they receive with :func:`medfl.messages.validate_payload`: only tensors and
scalars ever reach the wire, and a decoded value is checked again before anyone uses it.

Flat ``{name: number}`` results (evaluation metrics) travel as ``MetricRecord``
(:func:`metrics_record`, :func:`read_metrics`); control fields as a ``ConfigRecord`` of JSON
texts named :data:`CONTROL` (:func:`put_json`, :func:`take_json`).

Messages (:mod:`medfl.flower.protocol` lists the message types). Requests, coordinator to
site: :func:`instruction_request` (``train``, ``evaluate``, ``evaluate.validate``: the control
record and one instruction under ``ins``) and :func:`score_request` (``evaluate.score``:
every evaluation model and the shared evaluation instructions). Answers, site to
coordinator, each with the control record ``{"protocol": PROTOCOL, "client": id, ...}``
(:func:`answer`): :func:`train_answer`, :func:`evaluate_answer`, :func:`validate_answer`,
:func:`score_answer`. :func:`encoded_size` is the size of a content as Flower serialises it;
:class:`RecordCache` lets many messages that carry the same tensors (one global model sent to
every client) pack them once.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.serde import recorddict_to_proto

from medfl.messages import Instruction, PayloadError, validate_payload

__all__ = ["PROTOCOL", "CONTROL", "pack", "unpack", "put", "take", "metrics_record", "read_metrics", "put_json",
           "take_json", "WireError", "RecordCache", "ContentSnapshot", "encoded_size", "instruction_request", "instruction_request_size",
           "share_instructions",
           "score_request", "answer", "train_answer", "train_answer_size", "ArraySizes", "evaluate_answer", "validate_answer", "score_answer"]

#: Version of the medfl-over-Flower protocol; a site refuses messages of another version.
PROTOCOL = 4

#: Name of the control ``ConfigRecord`` in every medfl message.
CONTROL = "medfl"


class WireError(PayloadError):
    """A Flower message does not hold what a medfl message must (missing or malformed records)."""


def _tensor_to_array(t: torch.Tensor) -> tuple[Array, str | None]:
    """A tensor as a Flower ``Array``; bfloat16 (no NumPy dtype) travels as its int16 bits."""
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        return Array(t.contiguous().view(torch.int16).numpy()), "bfloat16"
    return Array(t.contiguous().numpy()), None


def _array_to_tensor(a: Array, special: str | None) -> torch.Tensor:
    arr = a.numpy()
    t = torch.from_numpy(np.array(arr, copy=True))  # writable, owns its memory
    if special == "bfloat16":
        return t.view(torch.bfloat16)
    if special is not None:
        raise WireError(f"unknown tensor encoding {special!r}")
    return t


class ArraySizes:
    """What :func:`encoded_size` needs of the ``ArrayRecord`` that :func:`pack` would build -
    each array's key, NumPy dtype and shape - without copying a tensor: how the in-process
    engine measures a reply it never sends (:func:`train_answer_size`).

    Args:
        entries: ``(key, numpy dtype name, shape)`` per array, in :func:`pack`'s order.
    """

    def __init__(self, entries: list[tuple[str, str, tuple[int, ...]]]) -> None:
        self.entries = entries

    def record(self) -> ArrayRecord:
        """An ``ArrayRecord`` of zeros of the same keys, dtypes and shapes (the same encoded size)."""
        return ArrayRecord({k: Array(np.zeros(shape, dtype=dt)) for k, dt, shape in self.entries})


#: Serialised byte length of an ``Array`` by (dtype, shape): the data plus NumPy's header.
_DATA_LENGTHS: dict[tuple[str, tuple[int, ...]], int] = {}
#: NumPy dtype name of each torch dtype (bfloat16 travels as int16).
_NUMPY_DTYPES: dict[torch.dtype, str] = {}


def _numpy_dtype(dtype: torch.dtype) -> str:
    if dtype not in _NUMPY_DTYPES:
        _NUMPY_DTYPES[dtype] = ("int16" if dtype == torch.bfloat16
                                else str(torch.empty(0, dtype=dtype).numpy().dtype))
    return _NUMPY_DTYPES[dtype]


def _data_length(dtype: str, shape: tuple[int, ...]) -> int:
    key = (dtype, shape)
    n = _DATA_LENGTHS.get(key)
    if n is None:
        n = len(Array(np.zeros(shape, dtype=dtype)).data)
        if len(_DATA_LENGTHS) >= 4096:
            _DATA_LENGTHS.clear()
        _DATA_LENGTHS[key] = n
    return n


def pack(value: Any, where: str = "message", *, allow_str: bool = True, measure: bool = False
         ) -> tuple[Any, ConfigRecord]:
    """Encode a tree of tensors and scalars as ``(ArrayRecord, ConfigRecord)``.

    Args:
        value: dicts (string keys), lists and tuples of tensors, ``int``, ``float``,
            ``bool``, ``None`` and (when ``allow_str``) ``str``.
        where: where the value goes, for error messages.
        allow_str: whether strings may be sent (instructions yes, anything from a site no).
        measure: return :class:`ArraySizes` instead of the ``ArrayRecord`` (no tensor is
            copied; only :func:`encoded_size`-style measuring can use it).

    Raises:
        PayloadError: ``value`` holds anything else (checked before encoding).
    """
    validate_payload(value, where, allow_str=allow_str)
    arrays: dict[str, Any] = {}

    def enc(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            key = str(len(arrays))
            if measure:
                arrays[key] = (_numpy_dtype(v.dtype), tuple(v.shape))
                special = "bfloat16" if v.dtype == torch.bfloat16 else None
            else:
                arrays[key], special = _tensor_to_array(v)
            return {"t": key} if special is None else {"t": key, "x": special}
        if isinstance(v, dict):
            return {"d": [[k, enc(x)] for k, x in v.items()]}
        if isinstance(v, tuple):
            return {"u": [enc(x) for x in v]}
        if isinstance(v, list):
            return {"l": [enc(x) for x in v]}
        return {"s": v}

    tree = json.dumps(enc(value), allow_nan=True)
    if measure:
        return ArraySizes([(k, dt, shape) for k, (dt, shape) in arrays.items()]), ConfigRecord({"tree": tree})
    return ArrayRecord(arrays), ConfigRecord({"tree": tree})


def unpack(arrays: ArrayRecord, tree: ConfigRecord, where: str = "message", *,
           allow_str: bool = True) -> Any:
    """Decode what :func:`pack` encoded, and check it again.

    Raises:
        WireError: the records are malformed (a tensor key missing, an unknown node).
        PayloadError: the decoded value holds something that may not travel.
    """
    if "tree" not in tree or not isinstance(tree["tree"], str):
        raise WireError(f"{where}: no 'tree' entry in the config record")
    try:
        root = json.loads(tree["tree"])
    except json.JSONDecodeError as exc:
        raise WireError(f"{where}: the tree is not valid JSON ({exc})") from None

    def dec(node: Any) -> Any:
        if not isinstance(node, dict) or len(node) not in (1, 2):
            raise WireError(f"{where}: malformed tree node {node!r:.80}")
        if "t" in node:
            key = node["t"]
            if key not in arrays:
                raise WireError(f"{where}: tensor {key!r} missing from the array record")
            return _array_to_tensor(arrays[key], node.get("x"))
        if "d" in node:
            return {str(k): dec(x) for k, x in node["d"]}
        if "u" in node:
            return tuple(dec(x) for x in node["u"])
        if "l" in node:
            return [dec(x) for x in node["l"]]
        if "s" in node:
            return node["s"]
        raise WireError(f"{where}: unknown tree node {sorted(node)}")

    value = dec(root)
    validate_payload(value, where, allow_str=allow_str)
    return value


def put(content: RecordDict, name: str, value: Any, where: str, *, allow_str: bool = True,
        cache: "RecordCache | None" = None) -> None:
    """Pack ``value`` into ``content`` as ``<name>.arrays`` and ``<name>.tree`` (with
    ``cache``: the records ``cache`` already packed for this very object, if any)."""
    if cache is None:
        arrays, tree = pack(value, where, allow_str=allow_str)
    else:
        arrays, tree = cache.pack(value, where, allow_str=allow_str)
    content[f"{name}.arrays"] = arrays
    content[f"{name}.tree"] = tree


def take(content: RecordDict, name: str, where: str, *, allow_str: bool = True) -> Any:
    """Unpack the value :func:`put` stored under ``name``.

    Raises:
        WireError: the message has no such value.
    """
    a, t = content.get(f"{name}.arrays"), content.get(f"{name}.tree")
    if not isinstance(a, ArrayRecord) or not isinstance(t, ConfigRecord):
        raise WireError(f"{where}: no {name!r} in the message (records {sorted(content)})")
    return unpack(a, t, where, allow_str=allow_str)


def put_json(content: RecordDict, name: str, value: dict[str, Any]) -> None:
    """Store a small dict of JSON scalars (control fields) as a ``ConfigRecord``: every
    entry as its own JSON text, so ``None`` and nested specs travel too."""
    content[name] = ConfigRecord({k: json.dumps(v, allow_nan=True) for k, v in value.items()})


def take_json(content: RecordDict, name: str, where: str) -> dict[str, Any]:
    """Read what :func:`put_json` stored.

    Raises:
        WireError: the record is missing or not JSON.
    """
    rec = content.get(name)
    if not isinstance(rec, ConfigRecord):
        raise WireError(f"{where}: no {name!r} record in the message (records {sorted(content)})")
    try:
        return {k: json.loads(v) for k, v in rec.items()}  # type: ignore[arg-type]
    except (TypeError, json.JSONDecodeError) as exc:
        raise WireError(f"{where}: record {name!r} is not JSON ({exc})") from None


def metrics_record(metrics: dict[str, float], where: str) -> MetricRecord:
    """A flat ``{name: number}`` dict as a ``MetricRecord`` (values as ``float``).

    Raises:
        PayloadError: a value is not a number.
    """
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise PayloadError(f"{where}[{k!r}]: metrics must be numbers, got {type(v).__name__}")
        out[str(k)] = float(v)
    return MetricRecord(out)


def read_metrics(record: Any, where: str) -> dict[str, float]:
    """The ``{name: float}`` dict of a ``MetricRecord``.

    Raises:
        WireError: ``record`` is not a ``MetricRecord`` of scalars.
    """
    if not isinstance(record, MetricRecord):
        raise WireError(f"{where}: expected a MetricRecord, got {type(record).__name__}")
    out = {}
    for k, v in record.items():
        if isinstance(v, list):
            raise WireError(f"{where}[{k!r}]: a list where a scalar metric was expected")
        out[k] = float(v)
    return out


# ---------------------------------------------------------------------- sizes
def _structure(value: Any, tensors: list[torch.Tensor]) -> Any:
    """A hashable image of a value: its tree, its scalars (with their types) and the
    identity of each tensor (collected in ``tensors``)."""
    if isinstance(value, torch.Tensor):
        tensors.append(value)
        return ("t", id(value))
    if isinstance(value, dict):
        return ("d", tuple((k, _structure(v, tensors)) for k, v in value.items()))
    if isinstance(value, (list, tuple)):
        return ("l" if isinstance(value, list) else "u", tuple(_structure(v, tensors) for v in value))
    return ("s", type(value), repr(value) if isinstance(value, float) else value)   # 0.0 vs -0.0, NaN


class RecordCache:
    """Records packed once for many messages that carry the same value.

    The coordinator often sends the same tensors to every client (the global model of a
    round, in a new dict for each client); :func:`put` with a cache packs a value once per
    structure: values with the same tree, the same scalars and the very same tensor objects
    share their records. Entries keep their tensors alive (an identity is never reused while
    cached), so use one cache for the messages of one exchange and then drop it; a cached
    tensor must not change shape or dtype meanwhile.
    """

    def __init__(self) -> None:
        self._packed: dict[Any, tuple[list[torch.Tensor], Any, ConfigRecord]] = {}

    def pack(self, value: Any, where: str, *, allow_str: bool = True, measure: bool = False
             ) -> tuple[Any, ConfigRecord]:
        """:func:`pack` of ``value``, done once per structure (``measure``: as :func:`pack`'s)."""
        tensors: list[torch.Tensor] = []
        try:
            key = (allow_str, measure, _structure(value, tensors))
            hit = self._packed.get(key)
        except TypeError:   # an unhashable scalar: pack refuses it
            return pack(value, where, allow_str=allow_str, measure=measure)
        if hit is not None:
            return hit[1], hit[2]
        arrays, tree = pack(value, where, allow_str=allow_str, measure=measure)
        self._packed[key] = (tensors, arrays, tree)
        return arrays, tree


#: Encoded share of an ``ArrayRecord`` by its signature (see :func:`encoded_size`).
_ARRAY_RECORD_SIZES: dict[Any, int] = {}


def _share(name: str, record: Any) -> int:
    """Bytes that ``record`` stored under ``name`` adds to an encoded ``RecordDict``."""
    if isinstance(record, (ArrayRecord, ArraySizes)):
        if isinstance(record, ArraySizes):
            sig = (name, tuple((k, dt, shape, "numpy.ndarray", _data_length(dt, shape))
                               for k, dt, shape in record.entries))
        else:
            sig = (name, tuple((k, a.dtype, tuple(a.shape), a.stype, len(a.data)) for k, a in record.items()))
        n = _ARRAY_RECORD_SIZES.get(sig)
        if n is None:
            real = record.record() if isinstance(record, ArraySizes) else record
            n = recorddict_to_proto(RecordDict({name: real})).ByteSize()
            if len(_ARRAY_RECORD_SIZES) >= 4096:
                _ARRAY_RECORD_SIZES.clear()
            _ARRAY_RECORD_SIZES[sig] = n
        return n
    return recorddict_to_proto(RecordDict({name: record})).ByteSize()


def encoded_size(content: RecordDict) -> int:
    """Bytes of a message's content as Flower serialises it: the size of the protobuf
    encoding of the ``RecordDict``, ``flwr.common.serde.recorddict_to_proto(content).ByteSize()``.

    The message's envelope (Flower's ``Metadata``: ids, message type, ttl...) is not counted,
    nor the transport's framing; Flower (1.20+) moves a content as content-addressed objects
    (arrays in chunks of at most 5 MiB, each object with a small header), so the bytes on the
    network differ from this by those headers.

    Computed record by record (the encoding is a list of ``(name, record)`` items, so the
    size is the sum of each item's). An ``ArrayRecord``'s share depends only on its name and
    on its arrays' keys, dtypes, shapes, stypes and byte lengths (protobuf writes a byte
    string as its length and its bytes), so it is encoded once per such signature and
    remembered: measuring the same model's state again costs no second encoding.
    """
    return sum(_share(name, record) for name, record in content.items())


# ---------------------------------------------------------------------- requests
def _put_instruction(content: RecordDict, ins: Instruction, prefix: str, where: str, where_config: str,
                     cache: RecordCache | None) -> None:
    put(content, f"{prefix}.payload", ins.payload, where, cache=cache)
    put(content, f"{prefix}.config", ins.config, where_config, cache=cache)


def instruction_request(control: dict[str, Any], ins: Instruction, cache: RecordCache | None = None
                        ) -> RecordDict:
    """The content of a ``train``, ``evaluate`` or ``evaluate.validate`` message: the control
    record (:data:`CONTROL`: the coordinator's control fields, ``client`` among them) and the
    instruction (``ins.payload``, ``ins.config``; packed once per structure with ``cache``).

    Raises:
        PayloadError: the instruction holds something that may not travel.
    """
    cid = control.get("client")
    content = RecordDict()
    put_json(content, CONTROL, control)
    _put_instruction(content, ins, "ins", f"instruction to client {cid}", f"instruction config to client {cid}",
                     cache)
    return content


def instruction_request_size(control: dict[str, Any], ins: Instruction, cache: RecordCache | None = None) -> int:
    """``encoded_size(instruction_request(control, ins, cache))`` without copying the
    instruction's tensors (the in-process engine measures every message it would send this
    way; ``cache`` measures a value shared by several messages once).

    Raises:
        PayloadError: as :func:`instruction_request`.
    """
    cid = control.get("client")
    content = RecordDict()
    put_json(content, CONTROL, control)
    return (encoded_size(content) + _measured("ins.payload", ins.payload, f"instruction to client {cid}", cache=cache)
            + _measured("ins.config", ins.config, f"instruction config to client {cid}", cache=cache))


class ContentSnapshot:
    """A value's content (nested dicts, lists, tuples) as it is now, to tell later whether
    anything in it was replaced or changed in place: its :func:`_structure` (tree, scalars,
    each tensor's identity) and each tensor's in-place version counter (it grows with every
    in-place operation). It holds the tensors (so none can be freed and another take its
    identity) and reads none of their values.

    What it is for: the in-process engine skips the coordinator's NaN check of a reply
    payload that the client step checked on its way out and that nothing touched since."""

    def __init__(self, value: Any) -> None:
        self._tensors: list[torch.Tensor] = []
        self._key = _structure(value, self._tensors)
        self._versions = [t._version for t in self._tensors]
        self._nan = _holds_nan(self._key)

    def unchanged(self, value: Any) -> bool:
        """Whether ``value`` holds exactly what the snapshot saw: the same tensor objects at
        the same versions, the same tree and scalars (a NaN scalar never counts as unchanged)."""
        if self._nan:
            return False
        tensors: list[torch.Tensor] = []
        return _structure(value, tensors) == self._key and all(
            t._version == v for t, v in zip(tensors, self._versions))


def _holds_nan(key: Any) -> bool:
    """Whether a :func:`_structure` image holds a NaN scalar."""
    if key[0] == "s":   # a float's image holds its repr (NumPy's floats are floats too)
        return issubclass(key[1], float) and "nan" in key[2]
    if key[0] == "d":
        return any(_holds_nan(v) for _, v in key[1])
    if key[0] in ("l", "u"):
        return any(_holds_nan(v) for v in key[1])
    return False


def _measured(name: str, value: Any, where: str, *, allow_str: bool = True, cache: RecordCache | None = None) -> int:
    """Bytes that :func:`put` of ``value`` under ``name`` adds to an encoded message, measured
    without copying a tensor (through ``cache`` when given)."""
    if cache is None:
        arrays, tree = pack(value, where, allow_str=allow_str, measure=True)
    else:
        arrays, tree = cache.pack(value, where, allow_str=allow_str, measure=True)
    return _share(f"{name}.arrays", arrays) + _share(f"{name}.tree", tree)


def share_instructions(instructions: dict[str, Instruction]) -> tuple[list[Instruction], dict[str, int]]:
    """Each distinct instruction object once (in order of first use) and, per client, the
    index of its own: what a ``score_request`` carries (``ins.<k>.*`` and ``ins_of``)."""
    shared: list[Instruction] = []
    ins_of: dict[str, int] = {}
    for owner, ins in instructions.items():
        k = next((i for i, x in enumerate(shared) if x is ins), None)
        if k is None:
            shared.append(ins)
            k = len(shared) - 1
        ins_of[owner] = k
    return shared, ins_of


def score_request(control: dict[str, Any], models: dict[str, Any], shared: list[Instruction],
                  cache: RecordCache | None = None) -> RecordDict:
    """The content of an ``evaluate.score`` message (``cross_test``): the control record
    (with ``specs`` and ``ins_of``, :func:`share_instructions`), every evaluation model
    (``models``: ``{owner: state}``) and each shared evaluation instruction (``ins.<k>.*``),
    packed once per structure with ``cache``.

    Raises:
        PayloadError: a model or instruction holds something that may not travel.
    """
    cid = control.get("client")
    content = RecordDict()
    put_json(content, CONTROL, control)
    put(content, "models", models, f"cross_test models to site {cid}", cache=cache)
    for k, ins in enumerate(shared):
        where = f"cross_test instruction {k} to site {cid}"
        _put_instruction(content, ins, f"ins.{k}", where, where, cache)
    return content


# ---------------------------------------------------------------------- answers
def answer(client: str, content: RecordDict | None = None, **control: Any) -> RecordDict:
    """``content`` (default: empty) with a site's control record added:
    ``{"protocol": PROTOCOL, "client": client, **control}``."""
    content = RecordDict() if content is None else content
    put_json(content, CONTROL, {"protocol": PROTOCOL, "client": client, **control})
    return content


def train_answer(client: str, payload: Any, metrics: dict[str, Any], num_examples: int) -> RecordDict:
    """A site's answer to ``train``: the reply's payload (``reply.payload``), its metrics
    (``reply.metrics``) and ``num_examples`` in the control record.

    Raises:
        PayloadError: anything other than tensors and numbers (strings included).
    """
    me = f"site {client}"
    out = RecordDict()
    put(out, "reply.payload", payload, f"reply of {me}", allow_str=False)
    put(out, "reply.metrics", metrics, f"reply metrics of {me}", allow_str=False)
    return answer(client, out, num_examples=int(num_examples))


def train_answer_size(client: str, payload: Any, metrics: dict[str, Any], num_examples: int) -> int:
    """``encoded_size(train_answer(client, payload, metrics, num_examples))`` without copying
    the payload's tensors (the in-process engine measures every reply this way).

    Raises:
        PayloadError: as :func:`train_answer`.
    """
    me = f"site {client}"
    rest = RecordDict()
    put(rest, "reply.metrics", metrics, f"reply metrics of {me}", allow_str=False)
    answer(client, rest, num_examples=int(num_examples))
    return _measured("reply.payload", payload, f"reply of {me}", allow_str=False) + encoded_size(rest)


def evaluate_answer(client: str, results: dict[str, dict[str, float]], state: dict[str, Any] | None = None
                    ) -> RecordDict:
    """A site's answer to ``evaluate``: one ``MetricRecord`` per split (``eval.<split>``), the
    splits in the control record, and (``cross_test``) the evaluation model's state (``model``).

    Raises:
        PayloadError: a metric is not a number, or the state holds something else than tensors.
    """
    me = f"site {client}"
    out = RecordDict()
    for split, m in results.items():
        out[f"eval.{split}"] = metrics_record(m, f"evaluation of {me} ({split})")
    if state is not None:
        put(out, "model", state, f"evaluation model of {me}", allow_str=False)
    return answer(client, out, splits=list(results))


def validate_answer(client: str, scores: dict[str, float]) -> RecordDict:
    """A site's answer to ``evaluate.validate``: its scalars as one ``MetricRecord`` (``validate``)."""
    out = RecordDict()
    out["validate"] = metrics_record(scores, f"validation of site {client}")
    return answer(client, out)


def score_answer(client: str, results: dict[str, dict[str, float]]) -> RecordDict:
    """A site's answer to ``evaluate.score``: each owner's model's metrics on this site's test
    split (``score.<owner>``), the owners in the control record."""
    out = RecordDict()
    for owner, m in results.items():
        out[f"score.{owner}"] = metrics_record(m, f"cross_test score at site {client}")
    return answer(client, out, owners=list(results))
