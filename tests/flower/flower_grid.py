"""A Flower grid in this process, for the tests of medfl's Flower transport
(:class:`medfl.flower.transport.FlowerTransport`): every message is serialized to Flower's
protobuf and back, as on the wire (:func:`over_the_wire`), answered by the addressed node's
:class:`Site` as a SuperNode's ClientApp answers it (:func:`medfl.flower.proxy.answer_with` and
:func:`medfl.site_messages.handle`), and its answer serialized back. The coordinator's own tests use
:class:`test_coordinator.LoopTransport`, which needs no Flower grid."""

from __future__ import annotations

from typing import Any, Callable

from flwr.app import Error, Message, RecordDict

from medfl import wire
from medfl.engine import protocol as P
from medfl.flower.proxy import answer_with, content_of, packed_bytes, records_of
from medfl.site import Site
from medfl.site_messages import handle
from medfl.wire import Content

#: ``(node, message type, control fields, reply content) -> reply content``
Tamper = Callable[[int, str, dict[str, Any], Content], Content]


def over_the_wire(rd: RecordDict) -> RecordDict:
    """``rd`` through Flower's protobuf and back, as a message's records travel (a test's
    stand-in for Flower's transport; medfl's code never calls Flower's serializer)."""
    from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
    from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=E0611

    return recorddict_from_proto(ProtoRecordDict.FromString(recorddict_to_proto(rd).SerializeToString()))


class LoopGrid:
    """A Flower ``Grid`` whose nodes are :class:`Site` objects in this process.

    Args:
        sites: node id -> the site it runs.
        rule: ``(node, message type, control fields) -> "ok" | "unavailable" | "silent"``:
            answer, answer with Flower's NODE_UNAVAILABLE error, or never answer.
        tamper: rewrites a site's reply before it travels back.
    """

    def __init__(self, sites: dict[int, Site], rule: Callable[[int, str, dict[str, Any]], str] | None = None,
                 tamper: Tamper | None = None) -> None:
        self.sites = dict(sites)
        self.rule = rule
        self.tamper = tamper
        self.pending: dict[str, tuple[Message, str, dict[str, Any]]] = {}
        self.sent: list[tuple[int, str, int]] = []   # (node, message type, round)
        self._n = 0

    def get_node_ids(self) -> list[int]:
        return sorted(self.sites)

    def push_messages(self, messages: list[Message]) -> list[str]:
        ids = []
        for msg in messages:
            self._n += 1
            mid = f"m{self._n}"
            msg.metadata.__dict__["_message_id"] = mid   # the SuperLink's job
            node, kind = msg.metadata.dst_node_id, msg.metadata.message_type
            ctl = wire.take_json(content_of(msg.content), P.CONTROL, "loop grid")
            self.sent.append((node, kind, int(ctl.get("round", 0) or 0)))
            what = self.rule(node, kind, ctl) if self.rule else "ok"
            ids.append(mid)
            if what != "silent":   # answered when pulled, as a node answers after the push
                self.pending[mid] = (msg, what, ctl)
        return ids

    def _answer(self, msg: Message, what: str, ctl: dict[str, Any]) -> Message:
        node, kind = msg.metadata.dst_node_id, msg.metadata.message_type
        if what == "unavailable" or node not in self.sites:
            return Message(Error(code=5, reason="node unavailable"), reply_to=msg)
        try:
            out = answer_with(over_the_wire(msg.content), lambda data: handle(self.sites[node], kind, data))
            if self.tamper:   # on what the site answered; it travels as the site sends it (packed or not)
                out = records_of(self.tamper(node, kind, ctl, content_of(out)), pack=packed_bytes(out) is not None)
            return Message(over_the_wire(out), reply_to=msg)
        except Exception as exc:  # noqa: BLE001 - as Flower reports a ClientApp exception
            return Message(Error(code=2, reason=f"{type(exc).__name__}: {exc}"), reply_to=msg)

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        return [self._answer(*self.pending.pop(m)) for m in message_ids if m in self.pending]
