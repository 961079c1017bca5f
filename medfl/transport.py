"""The seam between medfl's remote coordinator and its sites: :class:`Transport`.

:class:`medfl.engine.remote.RemoteRun` runs the rounds of a run whose clients are sites
elsewhere. It sends each site a message (:class:`Outgoing`: one of medfl's message types,
:mod:`medfl.engine.protocol`, and its :class:`medfl.wire.Content`) and reads the site's
:class:`Answer`, through a :class:`Transport`, which only carries them: Flower's
(:class:`medfl.flower.transport.FlowerTransport`), NVIDIA FLARE's
(:class:`medfl.nvflare.transport.NVFlareTransport`), or :class:`InProcessTransport` (sites in
this process: tests, or trying a method across sites without a network).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable

from medfl import wire
from medfl.wire import Content

__all__ = ["Outgoing", "Answer", "Transport", "InProcessTransport"]


@dataclass
class Outgoing:
    """One message to one site.

    Attributes:
        node: the node serving the addressed client (one of :meth:`Transport.nodes`).
        kind: medfl's message type (``query.hello``, ``train``, ``evaluate``...).
        content: what the message carries.
        group: the round, as text ("" for the hello).
        ttl: seconds the message may wait for its answer; the transport may drop it after.
        secure: a SecAgg+ stage message: Flower carries its records as they are (its
            ``secaggplus_mod`` reads and masks them at the site).
    """

    node: int
    kind: str
    content: Content
    group: str = ""
    ttl: float = 60.0
    secure: bool = False


@dataclass
class Answer:
    """A site's answer to one message, or why there is none.

    Attributes:
        to: the id :meth:`Transport.send` returned for the message.
        content: the site's answer (``None`` with an :attr:`error`).
        error: the site's error text (it raised), or why the message was lost.
        lost: the node left, the message expired or the site's process crashed (a dropout:
            the client is asked for its hello again), not an error the site answered.
    """

    to: str
    content: Content | None = None
    error: str = ""
    lost: bool = False


class Transport:
    """How a remote run reaches its sites (subclasses implement the three methods, which the
    coordinator calls from one thread)."""

    #: the words of the coordinator's messages: the transport's name, a site's node, the hub
    #: that routes messages, and where the clients run (``where``: default "over NAME, at the sites")
    terms: dict[str, str] = {"name": "the transport", "node": "node", "hub": "transport"}
    #: the nodes listed are all there will be (an NVFlare job's clients, simulated nodes): once
    #: each has answered its hello or been refused, the coordinator waits for no other
    fixed_nodes: bool = False
    #: SecAgg+ (``fl.secure_aggregation``) can run over it: Flower's ``secaggplus_mod`` at the sites
    secure_aggregation: bool = False
    #: what the connect error advises about clients without a node (``None``: start a
    #: ``medfl flower site`` per client, :meth:`medfl.engine.remote.RemoteRun.connect_advice`)
    connect_hint: str | None = None
    #: where the sites' privacy noise comes from, for ``config.json`` ("": each site's own secrets)
    noise_source: str = ""

    def nodes(self) -> list[int]:
        """The nodes connected now."""
        raise NotImplementedError

    def send(self, messages: list[Outgoing]) -> list[str]:
        """Send ``messages``; an id per message ("" for one whose node cannot be reached)."""
        raise NotImplementedError

    def receive(self, ids: list[str]) -> list[Answer]:
        """The answers to the messages ``ids`` that arrived since the last call (without waiting)."""
        raise NotImplementedError


class InProcessTransport(Transport):
    """Sites in this process: ``answer(site, kind, content) -> content`` for each node's site
    (e.g. :func:`medfl.site_messages.answer_message` on :class:`medfl.site.Site` objects).
    Every content crosses as its bytes (:func:`medfl.wire.encode`, :func:`~medfl.wire.decode`),
    as over a network; a message is answered when received. An ``answer`` that raises is the
    site's error; a node no longer in :attr:`sites` (which may change) is lost.

    Args:
        sites: node id -> site.
        answer: how a site answers one message.
    """

    terms = {"name": "the in-process transport", "node": "node", "hub": "transport", "where": "in this process"}

    def __init__(self, sites: dict[int, Any], answer: Callable[[Any, str, Content], Content]) -> None:
        self.sites = sites
        self.answer = answer
        self.pending: dict[str, Outgoing] = {}
        self._ids = itertools.count(1)

    def nodes(self) -> list[int]:
        """The nodes of :attr:`sites`."""
        return sorted(self.sites)

    def send(self, messages: list[Outgoing]) -> list[str]:
        """Keep each message until it is received ("" for a node not in :attr:`sites`)."""
        ids = []
        for msg in messages:
            ids.append(f"m{next(self._ids)}" if msg.node in self.sites else "")
            if ids[-1]:
                self.pending[ids[-1]] = msg
        return ids

    def receive(self, ids: list[str]) -> list[Answer]:
        """Each pending message of ``ids`` answered by its site now (:meth:`deliver`)."""
        return [self.deliver(mid, self.pending.pop(mid)) for mid in ids if mid in self.pending]

    def deliver(self, mid: str, msg: Outgoing) -> Answer:
        """``msg`` (sent as ``mid``) answered by its node's site."""
        if msg.node not in self.sites:
            return Answer(mid, error=f"node {msg.node} left", lost=True)
        try:
            out = self.answer(self.sites[msg.node], msg.kind, wire.decode(wire.encode(msg.content)))
            return Answer(mid, wire.decode(wire.encode(out)))
        except Exception as exc:  # noqa: BLE001 - the site's error is its answer
            return Answer(mid, error=f"{type(exc).__name__}: {exc}")
