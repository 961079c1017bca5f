"""The sites of a remote run: which node serves which client (:class:`SiteDirectory`), and
how long the coordinator waits for them (:class:`RemoteSettings`).

A first ``query.hello`` asks every node of the transport (:class:`medfl.transport.Transport`)
which client it serves and checks its partition fingerprint against the coordinator's; a node
that fails the check is refused for the run, with an event, and cannot stop it. A node that
missed an exchange is asked again before the next one; a restarted site (a new node id) is
recognised by its hello.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterable

from medfl import wire
from medfl.engine.data import client_order
from medfl.engine.runner import RunError
from medfl.engine import protocol as P
from medfl.messages import PayloadError
from medfl.transport import Outgoing, Transport
from medfl.wire import Content

__all__ = ["RemoteSettings", "SiteDirectory", "SiteFailure", "parse_pins", "UNDECODABLE"]

logger = logging.getLogger(__name__)

#: what decoding a site's message raises when the message is malformed (PayloadError is a TypeError)
UNDECODABLE = (PayloadError, TypeError, ValueError, KeyError, OverflowError)


class SiteFailure(RunError):
    """Every site asked in an exchange answered with an error it raised (a contract violation,
    a method or filter no site approved, a bug): the run stops, naming each site and its
    reason. One failing site among others is dropped instead."""


@dataclass
class RemoteSettings:
    """How the coordinator waits for the sites.

    Attributes:
        round_timeout: seconds to wait for the sites' answers to one exchange (a training
            step, an evaluation, a ``cross_test`` scoring); a site that has not answered
            by then is left out of that exchange (default 600).
        connect_timeout: seconds to wait at the start of a run for every client of the
            partition to be served by a node (default 300).
        hello_timeout: seconds to wait, before an exchange, for the hello of a node that
            joined (or rejoined) mid-run (default 60).
        poll_interval: seconds between two looks for answers (default 0.2).
        progress_interval: while waiting for the sites at the start, say every so many
            seconds which clients have no site yet (default 15).
        site_nodes: JSON ``{client id: node id}`` (``medfl flower register-site --client-id``):
            each client is served only by the node registered for it, whose id Flower binds
            to the site's key under SuperNode authentication; a hello from any other node for
            that client is refused. Empty (the default): the last node to say hello for a
            client serves it.
        max_reply_mb: the largest answer taken from a site (0: what the method can send,
            :meth:`medfl.engine.remote.RemoteRun.reply_limit`).
        launch: the options of ``medfl flower run`` that reached the SuperLink, recorded in
            the experiment's ``config.json`` so that every resume hint is a whole command
            (:meth:`medfl.engine.remote.RemoteRun.resume_command`). Empty: not known.
        superlink_retries, superlink_backoff: the Flower transport's: how often a SuperLink
            call failing with a transient error is tried again, and the first wait between
            two tries in seconds (doubling, at most 30 s; :mod:`medfl.flower.transport`).
        stop: set by the process that runs the coordinator in a thread (Flower's simulation
            runtime, an NVFlare workflow) to stop it: its next wait raises ``KeyboardInterrupt``.
    """

    round_timeout: float = 600.0
    connect_timeout: float = 300.0
    hello_timeout: float = 60.0
    poll_interval: float = 0.2
    progress_interval: float = 15.0
    site_nodes: str = ""
    max_reply_mb: float = 0.0
    launch: str = ""
    superlink_retries: float = 8.0
    superlink_backoff: float = 0.5
    stop: threading.Event | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> "RemoteSettings":
        """The settings a Flower run config names (``round-timeout``, ``site-nodes``...: each
        field's name with dashes; absent keys keep their defaults)."""
        kw: dict[str, Any] = {}
        for f in fields(cls):
            key = f.name.replace("_", "-")
            if f.name != "stop" and run_config.get(key) not in ("", None):
                kw[f.name] = str(run_config[key]) if f.name in ("site_nodes", "launch") else float(run_config[key])
        return cls(**kw)

    def pause(self) -> None:
        """Wait one ``poll_interval`` between two looks for answers.

        Raises:
            KeyboardInterrupt: :attr:`stop` is set (the coordinator then saves what it has
                and says how to resume, as after Ctrl-C in process).
        """
        if self.stop is not None and self.stop.is_set():
            raise KeyboardInterrupt
        time.sleep(self.poll_interval)

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, unless the run is told to stop meanwhile (:meth:`pause`).

        Raises:
            KeyboardInterrupt: :attr:`stop` is set.
        """
        if self.stop is None:
            time.sleep(seconds)
        elif self.stop.wait(seconds):
            raise KeyboardInterrupt

    def pins(self) -> dict[str, int]:
        """``site_nodes`` read (:func:`parse_pins`; ``{}`` when empty)."""
        return parse_pins(self.site_nodes, "site-nodes") if self.site_nodes else {}


def parse_pins(text: str | dict[str, Any], where: str) -> dict[str, int]:
    """``{client id: node id}`` from JSON ``text``, or from a mapping already decoded (a
    run's ``flower.json``); ``where`` names it in errors.

    Raises:
        RunError: not a JSON object of client ids to positive integer node ids, or one node
            registered for two clients.
    """
    try:
        raw = json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError as exc:
        raise RunError(f"{where}: not JSON ({exc.msg} at line {exc.lineno} column {exc.colno}); expected "
                       '{"client id": node id, ...}') from None
    if not isinstance(raw, dict):
        raise RunError(f'{where}: expected a JSON object {{"client id": node id, ...}}, got {type(raw).__name__}')
    out: dict[str, int] = {}
    for cid, node in raw.items():
        if isinstance(node, bool) or not isinstance(node, int) or node <= 0:
            raise RunError(f"{where}: client {cid!r}: node id {node!r} is not a positive integer (the id "
                           "`medfl flower register-site` printed)")
        if node in out.values():
            raise RunError(f"{where}: node {node} is registered for clients "
                           f"{next(c for c, n in out.items() if n == node)!r} and {str(cid)!r}; a node serves one client")
        out[str(cid)] = node
    return out


class SiteDirectory:
    """Which node serves which client id, kept up to date through ``query.hello``.

    Args:
        transport: the run's transport.
        expected: ``{client id: (split sizes, partition digest)}`` the coordinator computed.
        fold: the cross-validation fold (``None``: none), sent with the hello.
        settings: timeouts.
        log: called with one event dict per hello answered or lost.
        seed: the run seed, sent with the hello: the site draws its split with it (``None``:
            the site's config's).
    """

    def __init__(self, transport: Transport, expected: dict[str, tuple[dict[str, int], int]], fold: int | None,
                 settings: RemoteSettings, log: Callable[[dict[str, Any]], None], seed: int | None = None) -> None:
        self.transport = transport
        self.expected = expected
        self.fold = fold
        self.seed = seed
        self.settings = settings
        self.log = log
        self.nodes: dict[str, int] = {}       # client id -> node id
        self.asked: set[int] = set()          # nodes sent a hello at least once
        self.lost: set[int] = set()           # nodes that failed to answer an exchange
        self.retired: set[int] = set()        # nodes replaced by a newer node of the same client
        self.refused: dict[int, str] = {}     # nodes whose hello was refused -> why (never asked again)
        self.pins = settings.pins()           # client id -> the only node that may serve it ({}: any)
        self.pending: dict[str, int] = {}     # hello message id -> node id

    def _push_hello(self, node: int) -> None:
        content = Content()
        wire.put_json(content, P.CONTROL, {"protocol": P.PROTOCOL, "fold": self.fold, "seed": self.seed})
        ttl = max(60.0, self.settings.hello_timeout + self.settings.connect_timeout)
        for mid in self.transport.send([Outgoing(node, P.HELLO, content, ttl=ttl)]):
            if mid:     # "": the node left meanwhile; a node listed again is asked again
                self.pending[mid] = node
                self.asked.add(node)

    def _refuse(self, node: int, cid: str, reason: str) -> None:
        """Refuse ``node`` for this run: an event, a warning, and it is never asked again; the
        run goes on with the other nodes (a hostile or misconfigured node cannot stop it; if a
        client is then left without a site, the connect error quotes this)."""
        self.refused[node] = reason
        self.log({"phase": "hello", "client_id": cid, "node_id": node, "status": f"refused: {reason}"})
        logger.warning(f"medfl: node {node} refused: {reason}")

    def _accept(self, node: int, content: Content) -> None:
        try:
            ctl = wire.take_json(content, P.CONTROL, f"hello from node {node}")
            cid = str(ctl.get("client"))
            protocol = int(ctl.get("protocol", -1))
            sizes_got, digest_got = dict(ctl.get("sizes", {})), int(ctl.get("digest", -1))
        except UNDECODABLE as exc:
            self._refuse(node, "", f"its hello cannot be read ({type(exc).__name__}: {exc})")
            return
        if cid not in self.expected:
            self._refuse(node, cid, f"node {node} serves client {cid!r}, which is not in this run's partition "
                                    f"(clients {client_order(self.expected)}); check the site's client-id and config")
            return
        if self.pins and self.pins.get(cid) != node:
            self._refuse(node, cid, f"node {node} says it serves client {cid!r}, which is registered to "
                                    + (f"node {self.pins[cid]}" if cid in self.pins else "no node")
                                    + " (site-nodes); a site registered for another client, or a node "
                                      "without a registration for this one")
            return
        sizes, digest = self.expected[cid]
        if protocol != P.PROTOCOL:
            self._refuse(node, cid, f"site {cid} (node {node}) speaks medfl's site protocol {protocol}, the "
                                    f"coordinator {P.PROTOCOL}: install the same medfl version on both sides")
            return
        if sizes_got != sizes or digest_got != digest:
            self._refuse(node, cid, f"site {cid} (node {node}) drew a different partition than the coordinator: its "
                                    f"split sizes are {sizes_got}, the coordinator's {sizes} (fingerprint "
                                    f"{digest_got} vs {digest}); give the site the same dataset and the same "
                                    "seed/num_clients/partition/client_split settings as the run's config")
            return
        old = self.nodes.get(cid)
        if old is not None and old != node:
            self.retired.add(old)
        self.nodes[cid] = node
        self.lost.discard(node)
        self.log({"phase": "hello", "client_id": cid, "node_id": node, "status": "joined" if old is None
                  else ("same" if old == node else f"replaces node {old}")})

    def _pull_hellos(self) -> None:
        if not self.pending:
            return
        for answer in self.transport.receive(list(self.pending)):
            node = self.pending.pop(answer.to, None)
            if node is None or answer.lost:
                continue
            if answer.content is None:
                self._refuse(node, "", f"node {node} failed to answer medfl's hello: {answer.error}")
                continue
            self._accept(node, answer.content)

    def refresh(self, need: Iterable[str] = (), timeout: float | None = None, enough: int | None = None) -> None:
        """Ask new nodes who they are; re-ask nodes lost earlier; wait up to ``timeout``
        (default ``hello_timeout``) for the hellos of new nodes, and until every client of
        ``need`` is served (``enough``: until that many of them are; a lost node is waited
        for only through ``need``)."""
        wait = self.settings.hello_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        need = set(need)
        while True:
            online = set(self.transport.nodes())
            for node in sorted(online - self.asked):
                self._push_hello(node)
            waiting_for = set(self.pending.values())
            for node in sorted((self.lost & online) - waiting_for - self.retired):
                self._push_hello(node)   # a node that missed an exchange: ask again (waited for through need)
            self._pull_hellos()
            fresh = {n for n in self.pending.values() if n not in self.lost}
            served = len(need & set(self.nodes))
            short = served < (len(need) if enough is None else min(enough, len(need)))
            if (not fresh and not short) or self.settled() or time.monotonic() >= deadline:
                return
            self.settings.pause()

    def settled(self) -> bool:
        """Whether no hello can change which clients are served any more: the transport's nodes
        are fixed (:attr:`~medfl.transport.Transport.fixed_nodes`) and listed, no hello is
        awaited, and every node serves a client or was refused (never asked again); waiting
        longer for a client without a node is then waiting for nothing."""
        if not self.transport.fixed_nodes or self.pending:
            return False
        online = set(self.transport.nodes())
        return bool(online) and online <= set(self.nodes.values()) | set(self.refused) | self.retired

    def drop(self, cid: str) -> None:
        """Forget ``cid``'s node after it missed an exchange (it is asked again later)."""
        node = self.nodes.pop(cid, None)
        if node is not None:
            self.lost.add(node)
