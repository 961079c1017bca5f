"""The content of every message medfl sends, and its byte encoding.

Both transports build their messages here: the Flower coordinator and sites
(:mod:`medfl.flower`, which hand them to Flower through :mod:`medfl.flower.proxy`) and the
in-process engine (:class:`medfl.engine.runner.Run`), which builds the same contents to
measure what a deployment would send (:mod:`medfl.engine.traffic`): both count the same
bytes, :func:`encoded_size`. Nothing here needs Flower.

Contents (:class:`Content`: records :class:`Arrays`, :class:`Config`, :class:`Metrics`) and
their bytes (:func:`encode`, :func:`decode`, :func:`encoded_size`, :class:`WireError`) are
:mod:`medfl.wire_format`'s, re-exported here; that module imports NumPy only.

Values. An :class:`~medfl.messages.Instruction` or :class:`~medfl.messages.Reply` holds nested
dicts, lists and tuples of tensors and scalars. :func:`pack` turns such a value into two
records: ``<name>.arrays`` (every tensor as a NumPy array, dtype and shape kept, keyed by its
position in the tree, ``"0"``, ``"1"``...; bfloat16 as its int16 bits) and ``<name>.tree`` (one
entry ``tree``: the structure as JSON, scalars in place, each tensor replaced by its key; JSON
keeps ``int``/``float``/``bool``/``None``/``str`` apart and Python's float repr round-trips
exactly, ``NaN`` and ``inf`` included). :func:`unpack` reverses it exactly (tuples stay tuples,
dict order is kept). Both sides check what they send and receive with
:func:`medfl.messages.validate_payload`. Flat ``{name: number}`` results travel as
:class:`Metrics` (:func:`metrics_record`, :func:`read_metrics`), control fields as a
:class:`Config` of JSON texts named :data:`CONTROL` (:func:`put_json`, :func:`take_json`).

Messages (:mod:`medfl.engine.protocol` lists the types). Requests, coordinator to site:
:func:`instruction_request` (``train``, ``evaluate``, ``evaluate.validate``: the control record
and one instruction under ``ins``) and :func:`score_request` (``evaluate.score``: every
evaluation model and the shared evaluation instructions). Answers, site to coordinator, each
with the control record ``{"protocol": PROTOCOL, "client": id, ...}`` (:func:`answer`):
:func:`train_answer`, :func:`evaluate_answer`, :func:`validate_answer`, :func:`score_answer`.
:class:`RecordCache` lets many messages that carry the same tensors (one global model sent to
every client) pack them once.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import numpy as np
import torch

from medfl.messages import Instruction, validate_payload
from medfl.wire_format import Arrays, Config, Content, Metrics, PayloadError, WireError, decode, encode, encoded_size

__all__ = ["PROTOCOL", "CONTROL", "Content", "Arrays", "Config", "Metrics", "encode", "decode", "encoded_size",
           "pack", "unpack", "put", "take", "metrics_record", "read_metrics", "put_json", "take_json", "WireError",
           "RecordCache", "ContentSnapshot", "instruction_request", "instruction_request_size", "share_instructions",
           "score_request", "answer", "train_answer", "train_answer_size", "evaluate_answer", "validate_answer",
           "score_answer"]

#: Version of the medfl message protocol; a site refuses messages of another version.
PROTOCOL = 4

#: Name of the control record in every medfl message.
CONTROL = "medfl"


# ---------------------------------------------------------------------- values
@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The NumPy dtype a tensor of ``dtype`` travels as (bfloat16: int16)."""
    return np.dtype(np.int16) if dtype == torch.bfloat16 else torch.empty(0, dtype=dtype).numpy().dtype


def _tensor_to_array(t: torch.Tensor, measure: bool) -> np.ndarray:
    """A tensor as a NumPy array of its own (a copy); bfloat16 (no NumPy dtype) as its int16
    bits. ``measure``: a zero-strided array of the same dtype and shape, copying nothing
    (what :func:`encoded_size` needs; never sent)."""
    if measure:
        return np.broadcast_to(np.zeros((), _numpy_dtype(t.dtype)), tuple(t.shape))
    own = torch.empty_like(t, device="cpu", memory_format=torch.contiguous_format).copy_(t.detach())
    return (own.view(torch.int16) if t.dtype == torch.bfloat16 else own).numpy()


def _array_to_tensor(a: Any, special: str | None, where: str) -> torch.Tensor:
    if not isinstance(a, np.ndarray):
        raise WireError(f"{where}: a {type(a).__name__} where an array was expected")
    t = torch.from_numpy(np.array(a, copy=True))  # writable, owns its memory
    if special == "bfloat16":
        return t.view(torch.bfloat16)
    if special is not None:
        raise WireError(f"{where}: unknown tensor encoding {special!r}")
    return t


def pack(value: Any, where: str = "message", *, allow_str: bool = True, measure: bool = False
         ) -> tuple[Arrays, Config]:
    """Encode a tree of tensors and scalars as ``(Arrays, Config)`` records.

    Args:
        value: dicts (string keys), lists and tuples of tensors, ``int``, ``float``,
            ``bool``, ``None`` and (when ``allow_str``) ``str``.
        where: where the value goes, for error messages.
        allow_str: whether strings may be sent (instructions yes, anything from a site no).
        measure: hold zero-strided stand-ins of the tensors, copying none: only for
            :func:`encoded_size` (the in-process engine measures what it never sends).

    Raises:
        PayloadError: ``value`` holds anything else (checked before encoding).
    """
    validate_payload(value, where, allow_str=allow_str)
    arrays = Arrays()

    def enc(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            key = str(len(arrays))
            arrays[key] = _tensor_to_array(v, measure)
            return {"t": key} if v.dtype != torch.bfloat16 else {"t": key, "x": "bfloat16"}
        if isinstance(v, dict):
            return {"d": [[k, enc(x)] for k, x in v.items()]}
        if isinstance(v, tuple):
            return {"u": [enc(x) for x in v]}
        if isinstance(v, list):
            return {"l": [enc(x) for x in v]}
        return {"s": v}

    return arrays, Config({"tree": json.dumps(enc(value), allow_nan=True)})


def unpack(arrays: Arrays, tree: Config, where: str = "message", *, allow_str: bool = True) -> Any:
    """Decode what :func:`pack` encoded, and check it again.

    Raises:
        WireError: the records are malformed (a tensor key missing, an unknown node).
        PayloadError: the decoded value holds something that may not travel.
    """
    if not isinstance(tree.get("tree"), str):
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
            return _array_to_tensor(arrays[key], node.get("x"), f"{where}: tensor {key!r}")
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


def put(content: Content, name: str, value: Any, where: str, *, allow_str: bool = True,
        cache: "RecordCache | None" = None, measure: bool = False) -> None:
    """Pack ``value`` into ``content`` as ``<name>.arrays`` and ``<name>.tree`` (with
    ``cache``: the records ``cache`` already packed for this very object, if any; ``measure``:
    as :func:`pack`'s)."""
    arrays, tree = (cache.pack if cache is not None else pack)(value, where, allow_str=allow_str, measure=measure)
    content[f"{name}.arrays"] = arrays
    content[f"{name}.tree"] = tree


def take(content: Content, name: str, where: str, *, allow_str: bool = True) -> Any:
    """Unpack the value :func:`put` stored under ``name``.

    Raises:
        WireError: the message has no such value.
    """
    a, t = content.get(f"{name}.arrays"), content.get(f"{name}.tree")
    if not isinstance(a, Arrays) or not isinstance(t, Config):
        raise WireError(f"{where}: no {name!r} in the message (records {sorted(content)})")
    return unpack(a, t, where, allow_str=allow_str)


def put_json(content: Content, name: str, value: dict[str, Any]) -> None:
    """Store a small dict of JSON scalars (control fields) as a :class:`Config` record: every
    entry as its own JSON text, so ``None`` and nested specs travel too."""
    content[name] = Config({k: json.dumps(v, allow_nan=True) for k, v in value.items()})


def take_json(content: Content, name: str, where: str) -> dict[str, Any]:
    """Read what :func:`put_json` stored.

    Raises:
        WireError: the record is missing or not JSON.
    """
    rec = content.get(name)
    if not isinstance(rec, Config):
        raise WireError(f"{where}: no {name!r} record in the message (records {sorted(content)})")
    try:
        return {k: json.loads(v) for k, v in rec.items()}  # type: ignore[arg-type]
    except (TypeError, json.JSONDecodeError) as exc:
        raise WireError(f"{where}: record {name!r} is not JSON ({exc})") from None


def metrics_record(metrics: dict[str, float], where: str) -> Metrics:
    """A flat ``{name: number}`` dict as a :class:`Metrics` record (values as ``float``).

    Raises:
        PayloadError: a value is not a number.
    """
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise PayloadError(f"{where}[{k!r}]: metrics must be numbers, got {type(v).__name__}")
        out[str(k)] = float(v)
    return Metrics(out)


def read_metrics(record: Any, where: str) -> dict[str, float]:
    """The ``{name: float}`` dict of a :class:`Metrics` record.

    Raises:
        WireError: ``record`` is not a :class:`Metrics` record of scalars.
    """
    if not isinstance(record, Metrics):
        raise WireError(f"{where}: expected a Metrics record, got {type(record).__name__}")
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
        self._packed: dict[Any, tuple[list[torch.Tensor], Arrays, Config]] = {}

    def pack(self, value: Any, where: str, *, allow_str: bool = True, measure: bool = False
             ) -> tuple[Arrays, Config]:
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


# ---------------------------------------------------------------------- requests
def _put_instruction(content: Content, ins: Instruction, prefix: str, where: str, where_config: str,
                     cache: RecordCache | None, measure: bool = False) -> None:
    put(content, f"{prefix}.payload", ins.payload, where, cache=cache, measure=measure)
    put(content, f"{prefix}.config", ins.config, where_config, cache=cache, measure=measure)


def instruction_request(control: dict[str, Any], ins: Instruction, cache: RecordCache | None = None, *,
                        _measure: bool = False) -> Content:
    """The content of a ``train``, ``evaluate`` or ``evaluate.validate`` message: the control
    record (:data:`CONTROL`: the coordinator's control fields, ``client`` among them) and the
    instruction (``ins.payload``, ``ins.config``; packed once per structure with ``cache``).

    Raises:
        PayloadError: the instruction holds something that may not travel.
    """
    cid = control.get("client")
    content = Content()
    put_json(content, CONTROL, control)
    _put_instruction(content, ins, "ins", f"instruction to client {cid}", f"instruction config to client {cid}",
                     cache, _measure)
    return content


def instruction_request_size(control: dict[str, Any], ins: Instruction, cache: RecordCache | None = None) -> int:
    """``encoded_size(instruction_request(control, ins, cache))`` without copying the
    instruction's tensors (the in-process engine measures every message it would send this
    way; ``cache`` measures a value shared by several messages once).

    Raises:
        PayloadError: as :func:`instruction_request`.
    """
    return encoded_size(instruction_request(control, ins, cache, _measure=True))


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
    return key[0] in ("l", "u") and any(_holds_nan(v) for v in key[1])


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
                  cache: RecordCache | None = None) -> Content:
    """The content of an ``evaluate.score`` message (``cross_test``): the control record
    (with ``specs`` and ``ins_of``, :func:`share_instructions`), every evaluation model
    (``models``: ``{owner: state}``) and each shared evaluation instruction (``ins.<k>.*``),
    packed once per structure with ``cache``.

    Raises:
        PayloadError: a model or instruction holds something that may not travel.
    """
    cid = control.get("client")
    content = Content()
    put_json(content, CONTROL, control)
    put(content, "models", models, f"cross_test models to site {cid}", cache=cache)
    for k, ins in enumerate(shared):
        where = f"cross_test instruction {k} to site {cid}"
        _put_instruction(content, ins, f"ins.{k}", where, where, cache)
    return content


# ---------------------------------------------------------------------- answers
def answer(client: str, content: Content | None = None, **control: Any) -> Content:
    """``content`` (default: empty) with a site's control record added:
    ``{"protocol": PROTOCOL, "client": client, **control}``."""
    content = Content() if content is None else content
    put_json(content, CONTROL, {"protocol": PROTOCOL, "client": client, **control})
    return content


def train_answer(client: str, payload: Any, metrics: dict[str, Any], num_examples: int, *,
                 _measure: bool = False) -> Content:
    """A site's answer to ``train``: the reply's payload (``reply.payload``), its metrics
    (``reply.metrics``) and ``num_examples`` in the control record.

    Raises:
        PayloadError: anything other than tensors and numbers (strings included).
    """
    me = f"site {client}"
    out = Content()
    put(out, "reply.payload", payload, f"reply of {me}", allow_str=False, measure=_measure)
    put(out, "reply.metrics", metrics, f"reply metrics of {me}", allow_str=False, measure=_measure)
    return answer(client, out, num_examples=int(num_examples))


def train_answer_size(client: str, payload: Any, metrics: dict[str, Any], num_examples: int) -> int:
    """``encoded_size(train_answer(client, payload, metrics, num_examples))`` without copying
    the payload's tensors (the in-process engine measures every reply this way).

    Raises:
        PayloadError: as :func:`train_answer`.
    """
    return encoded_size(train_answer(client, payload, metrics, num_examples, _measure=True))


def evaluate_answer(client: str, results: dict[str, dict[str, float]], state: dict[str, Any] | None = None
                    ) -> Content:
    """A site's answer to ``evaluate``: one :class:`Metrics` record per split (``eval.<split>``), the
    splits in the control record, and (``cross_test``) the evaluation model's state (``model``).

    Raises:
        PayloadError: a metric is not a number, or the state holds something else than tensors.
    """
    me = f"site {client}"
    out = Content()
    for split, m in results.items():
        out[f"eval.{split}"] = metrics_record(m, f"evaluation of {me} ({split})")
    if state is not None:
        put(out, "model", state, f"evaluation model of {me}", allow_str=False)
    return answer(client, out, splits=list(results))


def validate_answer(client: str, scores: dict[str, float]) -> Content:
    """A site's answer to ``evaluate.validate``: its scalars as one :class:`Metrics` record (``validate``)."""
    out = Content()
    out["validate"] = metrics_record(scores, f"validation of site {client}")
    return answer(client, out)


def score_answer(client: str, results: dict[str, dict[str, float]]) -> Content:
    """A site's answer to ``evaluate.score``: each owner's model's metrics on this site's test
    split (``score.<owner>``), the owners in the control record."""
    out = Content()
    for owner, m in results.items():
        out[f"score.{owner}"] = metrics_record(m, f"cross_test score at site {client}")
    return answer(client, out, owners=list(results))
