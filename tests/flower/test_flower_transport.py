"""medfl's Flower transport (:class:`medfl.flower.transport.FlowerTransport`) over a Flower grid
in this process (:mod:`flower_grid`): messages travel packed but for the hello, a reply whose
packed bytes are not records is the site's error, and Flower's error codes are sorted into
dropouts and the site's errors. The SuperLink's retries: tests/flower/test_quorum.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

pytest.importorskip("flwr", reason="Flower is a test dependency of medfl (pip install -e '.[test]')")

from flwr.app import Error, Message  # noqa: E402

from medfl.config import resolve_config  # noqa: E402
from medfl.engine.remote import RemoteSettings  # noqa: E402
from medfl.engine import protocol as P  # noqa: E402
from medfl.flower.proxy import packed, packed_bytes  # noqa: E402
from medfl.flower.server import run_flower_experiment  # noqa: E402
from medfl.flower.transport import FlowerTransport  # noqa: E402
from medfl.transport import Outgoing  # noqa: E402
from medfl.wire import Content  # noqa: E402

from flower_cases import FEDAVG, fl_config  # noqa: E402
from flower_grid import LoopGrid  # noqa: E402
from test_coordinator import FAST, _sites  # noqa: E402


def test_messages_travel_packed_and_a_garbled_pack_is_refused_with_the_site_named(tmp_path: Path) -> None:
    """Issue 50: every message but the hello travels as one packed array; a reply whose
    packed bytes are not a medfl content is refused, naming the site, and the run goes on."""
    kinds: dict[str, set[bool]] = {}

    class Garbling(LoopGrid):
        def push_messages(self, messages: list[Message]) -> list[str]:
            for msg in messages:
                kinds.setdefault(msg.metadata.message_type, set()).add(packed_bytes(msg.content) is not None)
            return super().push_messages(messages)

        def _answer(self, msg: Message, what: str, ctl: dict[str, Any]) -> Message:
            reply = super()._answer(msg, what, ctl)
            if msg.metadata.dst_node_id == 102 and msg.metadata.message_type == P.TRAIN and ctl.get("round") == 1:
                return Message(packed(b"\xff\x00 not records"), reply_to=msg)
            return reply

    fl = fl_config(tmp_path, "garbled", {**FEDAVG, "rounds": 2})
    out = run_flower_experiment(resolve_config(fl), Garbling(_sites(tmp_path, fl)), FAST)
    assert kinds == {P.HELLO: {False}, P.TRAIN: {True}, P.EVALUATE: {True}}
    run_dir = Path(out["dir"]) / "fedavg"
    events = pd.read_csv(run_dir / "reply_events.csv", dtype={"client_id": str})
    row = events[(events["round"] == 1) & (events["client_id"] == "1")]
    assert row["status"].tolist() == ["dropped"]
    assert "not a medfl message content" in row["reason"].iloc[0]
    assert json.loads((run_dir / "summary.json").read_text())["rounds"] == 2


class _Errors:
    """A grid answering every message with Flower's error ``code``."""

    def __init__(self, code: int, reason: str) -> None:
        self.code, self.reason, self.pushed = code, reason, []

    def get_node_ids(self) -> list[int]:
        return [7]

    def push_messages(self, messages: list[Message]) -> list[str]:
        self.pushed += messages
        for i, msg in enumerate(messages):
            msg.metadata.__dict__["_message_id"] = f"m{i}"
        return [f"m{i}" for i in range(len(messages))]

    def pull_messages(self, ids: list[str]) -> list[Message]:
        return [Message(Error(code=self.code, reason=self.reason), reply_to=m) for m in self.pushed]


@pytest.mark.parametrize("code, lost", [(5, True), (3, True), (8, True), (2, False), (0, False)])
def test_flowers_error_codes_are_dropouts_or_the_sites_errors(code: int, lost: bool) -> None:
    """A node gone, a message lost or a crashed ClientApp is a dropout; an exception the
    ClientApp raised is the site's error, its text without Flower's wrapping."""
    grid = _Errors(code, "<class 'medfl.site.SiteError'>:<'medfl site 0: refused'>")
    transport = FlowerTransport(grid, RemoteSettings(), lambda event: None)
    assert transport.nodes() == [7]
    ids = transport.send([Outgoing(7, P.TRAIN, Content(), "1", 60.0)])
    [answer] = transport.receive(ids)
    assert answer.to == "m0" and answer.content is None and answer.lost is lost
    assert answer.error.endswith("medfl site 0: refused") and "<class" not in answer.error
