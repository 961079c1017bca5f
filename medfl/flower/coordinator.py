"""The coordinator over Flower: :class:`FlowerRun`, what the ``flower`` and ``ray`` backends run.

:class:`FlowerRun` is the in-process :class:`~medfl.engine.runner.Run` with its two
transport methods replaced: :meth:`~FlowerRun.update_clients` and
:meth:`~FlowerRun.evaluate_clients` send each addressed client's
:class:`~medfl.messages.Instruction` to the SuperNode serving that client, as a Flower
message (a :class:`medfl.wire.Content`, handed to Flower by :mod:`medfl.flower.records`),
and turn the answers back into :class:`~medfl.messages.Reply` objects and metrics.
Everything else - the method's coordinator role, checkpoints, ``metrics.csv``,
``summary.json``, resume - is ``Run``'s, unchanged, so any method registered through the
plugin contract runs over Flower with no method-specific code here: hub-and-spoke methods
(FedAvg, FedProx, FedKPer...) and peer-to-peer ones (FedSKD, FedCross: the coordinator
relays one site's model to another in the instructions; nothing is aggregated) alike.

Sites and dropouts. A first ``query.hello`` asks every node which client id it serves and
checks its partition fingerprint against the coordinator's (:class:`SiteDirectory`); a node
that fails the check is refused for the run, with an event, and cannot stop it. A
site that does not answer a round's message within ``round_timeout`` seconds (or whose
node the SuperLink reports unavailable) is left out of that round's replies - the
method's ``server_update`` sees only the sites that answered, exactly as with a sampled
subset - and out of that round's evaluation rows. Every exchange is recorded in
``flower_events.csv`` of the run directory, and the encoded size of every message sent
and received in ``communication.csv`` (as in process: :mod:`medfl.engine.traffic`). A
node that comes back (a restarted SuperNode gets a new node id) is recognised by its hello
before the next exchange and continues from the state it saved at the site.

Per-site persistent state is never at the coordinator: the ``clients/`` and
``eval_state/`` directories of a Flower run stay empty; each site keeps them under its
own ``state-dir`` (:mod:`medfl.flower.site`).

The ``ServerApp`` that drives experiments of these runs over a SuperLink is
:mod:`medfl.flower.server` (the top of its process, like the CLI).
"""

from __future__ import annotations

import json
import logging
import math
import re
import threading
import time
import uuid
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Iterable

import pandas as pd
from flwr.app import Message
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Stage
from flwr.serverapp import Grid

from medfl import wire
from medfl.engine.client import cross_test_mean, release_exemptions
from medfl.engine.data import FederatedData, client_order
from medfl.engine.runner import Run, RunError, TooFewSites, quorum_rule, sites_needed
from medfl.flower import protocol as P
from medfl.flower.proxy import pack_records, unpack_records
from medfl.flower.records import from_recorddict, to_recorddict
from medfl.flower.secagg import SecureAggregation, SecureRound, describe
from medfl.messages import Instruction, PayloadError, Reply, SampleGuard, validate_payload
from medfl.wire import Content, WireError

#: what decoding a site's message raises when the message is malformed (PayloadError is a TypeError)
_UNDECODABLE = (PayloadError, TypeError, ValueError, KeyError, OverflowError)


def _listed(ctl: dict[str, Any], key: str, where: str) -> list[str]:
    """The list of strings ``ctl[key]`` of a site's control record."""
    value = ctl.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PayloadError(f"{where}: {key!r} must be a list of names, got {value!r:.80}")
    return value

__all__ = ["FlowerSettings", "FlowerRun", "SiteDirectory", "SiteFailure", "SteadyGrid", "SuperLinkError",
           "transient_error", "flower_run_factory", "RUN_CONFIG", "FLOWER_TERMS"]

#: the words the coordinator's messages use for its transport: its name, a site's node, the
#: hub that routes the messages. A grid of another transport names its own in a ``terms``
#: attribute (:class:`medfl.nvflare.grid.TaskGrid`: NVFlare clients and server).
FLOWER_TERMS = {"name": "Flower", "node": "SuperNode", "hub": "SuperLink"}

logger = logging.getLogger(__name__)

# Flower's error codes (flwr.common.constant.ErrorCode): a node gone or a message lost is a
# dropout; an exception raised by the ClientApp is that site's failure: its reply is dropped
# (and counted), and the run stops only when every site asked failed.
_DROPOUT_CODES = {3, 4, 5, 8}   # MESSAGE_UNAVAILABLE, REPLY_MESSAGE_UNAVAILABLE, NODE_UNAVAILABLE, CLIENT_APP_CRASHED
_FAILURE_CODES = {0, 1, 2, 6, 7}  # UNKNOWN, LOAD_CLIENT_APP_EXCEPTION, CLIENT_APP_RAISED_EXCEPTION, ...


def error_reason(reason: str | None) -> str:
    """What a site's error reply says, without the runtime's wrapping: the simulation
    runtime sends a Ray traceback ending in ``ClientAppException ... Message: <the site's
    error>``; a deployed ClientApp sends ``<class '...'>:<'<the site's error>'>``."""
    text = (reason or "").strip()
    marker = "ClientAppException occurred. Message:"
    if marker in text:
        text = text.rsplit(marker, 1)[1].strip()
        text = text.removesuffix("'>").strip()
    found = re.fullmatch(r"<class '[\w.()]+'>:<'(.*)'>", text, flags=re.S)
    return found.group(1) if found else text


class SiteFailure(RunError):
    """Every site asked in an exchange answered with an error raised by medfl's ClientApp
    (a contract violation, a method or filter no site approved, a bug): the run stops,
    naming each site and its reason. One failing site among others is dropped instead."""


@dataclass
class FlowerSettings:
    """How the coordinator talks to the sites.

    Attributes:
        round_timeout: seconds to wait for the sites' answers to one exchange (a training
            step, an evaluation, a ``cross_test`` scoring); a site that has not answered
            by then is left out of that exchange (default 600).
        connect_timeout: seconds to wait at the start of a run for every client of the
            partition to be served by a node (default 300).
        hello_timeout: seconds to wait, before an exchange, for the hello of a node that
            joined (or rejoined) mid-run (default 60).
        poll_interval: seconds between two pulls of replies from the SuperLink (default 0.2).
        progress_interval: while waiting for the sites at the start, say every so many
            seconds which clients have no site yet (default 15).
        site_nodes: JSON ``{client id: node id}`` (``medfl flower register-site --client-id``):
            each client is served only by the node registered for it, whose id Flower binds
            to the site's key under SuperNode authentication; a hello from any other node for
            that client is refused. Empty (the default): the last node to say hello for a
            client serves it.
        launch: the options of ``medfl flower run`` that reached this SuperLink
            (``--superlink HOST:PORT`` and ``--insecure`` or ``--root-certificates CA``),
            recorded in the experiment's ``config.json`` so that every resume hint is a whole
            command (:meth:`FlowerRun.resume_command`). Empty: not known (placeholders).
    """

    round_timeout: float = 600.0
    connect_timeout: float = 300.0
    hello_timeout: float = 60.0
    poll_interval: float = 0.2
    progress_interval: float = 15.0
    site_nodes: str = ""
    max_reply_mb: float = 0.0
    launch: str = ""
    #: how often one call to the SuperLink that failed with a transient error (HTTP 5xx, as
    #: SQLite's "database is locked" behind ``--database`` gives; a lost connection) is tried
    #: again before the run fails (:class:`SteadyGrid`), and the first wait between two
    #: tries in seconds (doubling, at most 30 s)
    superlink_retries: float = 8.0
    superlink_backoff: float = 0.5
    #: set by the process that runs the coordinator in a thread (the simulation runtime) to
    #: stop it: the next wait raises ``KeyboardInterrupt`` there (not a run-config key)
    stop: threading.Event | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> "FlowerSettings":
        """Read ``round-timeout``, ``connect-timeout``, ``hello-timeout``, ``poll-interval``,
        ``progress-interval``, ``site-nodes``, ``max-reply-mb``, ``launch``, ``superlink-retries``
        and ``superlink-backoff`` from a Flower run config (absent keys keep their defaults)."""
        kw: dict[str, Any] = {}
        for f in fields(cls):
            if f.name == "stop":
                continue
            key = f.name.replace("_", "-")
            if key in run_config and run_config[key] not in ("", None):
                kw[f.name] = str(run_config[key]) if f.name in ("site_nodes", "launch") else float(run_config[key])
        return cls(**kw)

    def pause(self) -> None:
        """Wait one ``poll_interval`` between two pulls, unless the run was told to stop.

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
        """``site_nodes`` read: ``{client id: node id}`` (``{}`` when empty).

        Raises:
            RunError: not a JSON object of client ids to integer node ids.
        """
        return _pins(self.site_nodes, "site-nodes") if self.site_nodes else {}


def _pins(value: str | dict[str, Any], where: str) -> dict[str, int]:
    """``{client id: node id}`` from a site-nodes JSON text or mapping
    (:func:`medfl.flower.auth.parse_site_nodes`), its errors as :class:`RunError`."""
    from medfl.flower.auth import AuthError, parse_site_nodes

    try:
        return parse_site_nodes(value, where)
    except AuthError as exc:
        raise RunError(str(exc)) from None


class SuperLinkError(RunError):
    """A call to the SuperLink kept failing with a transient error after every retry of
    :class:`SteadyGrid`: the run fails (status ``failed``, resumable) with this one line."""


def transient_error(exc: BaseException) -> str:
    """What ``exc`` says when it is an error of the SuperLink that a later try may not
    meet ("": not one): an HTTP 5xx answer (a SuperLink on SQLite answers 500 when the
    database is locked), a pushed object the SuperLink did not store (Flower's
    ``ObjectPushError``: its database failed the same way), a lost or timed-out connection,
    a gRPC ``UNAVAILABLE``, ``INTERNAL``, ``UNKNOWN``, ``DEADLINE_EXCEEDED`` or
    ``RESOURCE_EXHAUSTED``, or SQLite's own locked/busy error. Refusals (HTTP 4xx: the run
    was stopped, a token is wrong) are not transient."""
    import sqlite3

    import httpx

    if isinstance(exc, httpx.HTTPStatusError):
        code = exc.response.status_code
        if code < 500:
            return ""
        try:
            body = " ".join(exc.response.text.split())[:200]
        except Exception:  # noqa: BLE001 - a streamed body that cannot be read
            body = ""
        return f"HTTP {code}" + (f": {body}" if body else "")
    if isinstance(exc, httpx.TransportError):
        return f"{type(exc).__name__}: {exc}"
    if isinstance(exc, sqlite3.OperationalError) and ("locked" in str(exc) or "busy" in str(exc)):
        return f"SQLite: {exc}"
    if type(exc).__name__ == "ObjectPushError":
        # the SuperLink answered that it did not store a pushed object: its store_object
        # turns any error of its database (SQLite's "database is locked") into that answer
        return f"it did not store a message's content ({exc})"
    try:
        import grpc
    except ImportError:  # pragma: no cover - grpc comes with flwr
        return ""
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED):
            details = exc.details() if hasattr(exc, "details") else ""
            return f"gRPC {code.name}" + (f": {details}" if details else "")
    return ""


class SteadyGrid:
    """The ServerApp's grid with bounded retries: a call to the SuperLink
    (:meth:`get_node_ids`, :meth:`push_messages`, :meth:`pull_messages`) that fails with a
    :func:`transient_error` is tried again after ``superlink_backoff`` seconds, doubling (at
    most 30 s), up to ``superlink_retries`` times; each retry is said on stderr and recorded
    with ``log`` (a ``superlink`` row of ``flower_events.csv``); then the run fails with one
    :class:`SuperLinkError` line. Any other error is raised as it is.

    Pushing again is safe: Flower's message ids are the messages' content digests and a
    SuperLink keeps one copy of a message id. A pull that failed after the SuperLink
    handed over some replies may lose them: those sites then count as timed out.

    Args:
        grid: the grid Flower gave the ServerApp.
        settings: the retry settings (and the stop event a wait honours).
        log: called with one event dict per retry.
    """

    def __init__(self, grid: Grid, settings: FlowerSettings, log: Any) -> None:
        self.grid = grid
        self.settings = settings
        self.log = log

    def _call(self, what: str, fn: Any, *args: Any) -> Any:
        tries = max(0, int(self.settings.superlink_retries))
        wait = max(0.0, float(self.settings.superlink_backoff))
        for attempt in range(tries + 1):
            try:
                return fn(*args)
            except Exception as exc:  # noqa: BLE001 - sorted by transient_error
                why = transient_error(exc)
                if not why:
                    raise
                if attempt == tries:
                    raise SuperLinkError(f"the SuperLink failed {what} {tries + 1} times in a row ({why}); "
                                         f"giving up (superlink-retries {tries}): check the SuperLink's log and its "
                                         "--database, then resume the run") from exc
                self.log({"phase": "superlink", "status": f"retry {attempt + 1}/{tries} of {what}: {why}",
                          "seconds": wait})
                logger.warning(f"medfl flower: the SuperLink failed {what} ({why}); trying again in {wait:.1f} s "
                               f"({attempt + 1} of {tries})")
                self.settings.sleep(wait)
                wait = min(30.0, max(wait * 2, 0.1))
        raise AssertionError("unreachable")

    def get_node_ids(self) -> list[int]:
        """The SuperLink's connected nodes (retried)."""
        return list(self._call("to list its nodes", self.grid.get_node_ids))

    def push_messages(self, messages: list[Message]) -> list[str]:
        """Push ``messages``; their ids (retried with the same messages)."""
        return list(self._call("to take messages", self.grid.push_messages, messages))

    def pull_messages(self, message_ids: list[str]) -> list[Message]:
        """The replies to ``message_ids`` that arrived (retried)."""
        return list(self._call("to hand over replies", self.grid.pull_messages, message_ids))


class SiteDirectory:
    """Which Flower node serves which client id, kept up to date through ``query.hello``.

    Args:
        grid: the ServerApp's grid.
        expected: ``{client id: (split sizes, partition digest)}`` the coordinator computed.
        fold: the cross-validation fold (``None``: none), sent with the hello.
        settings: timeouts.
        log: called with one event dict per hello answered or lost.
        seed: the run seed, sent with the hello: the site draws its split with it (``None``:
            the site's config's).
    """

    def __init__(self, grid: "Grid | SteadyGrid", expected: dict[str, tuple[dict[str, int], int]], fold: int | None,
                 settings: FlowerSettings, log: Any, seed: int | None = None) -> None:
        self.grid = grid
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
        #: the grid's nodes are all it will ever have (an NVFlare job's clients): see :meth:`settled`
        self.fixed_nodes = False

    def _push_hello(self, node: int) -> None:
        content = Content()
        wire.put_json(content, P.CONTROL, {"protocol": P.PROTOCOL, "fold": self.fold, "seed": self.seed})
        msg = Message(to_recorddict(content), dst_node_id=node, message_type=P.HELLO,
                      ttl=max(60.0, self.settings.hello_timeout + self.settings.connect_timeout))
        for mid in self.grid.push_messages([msg]):
            if mid:     # "": the node left meanwhile; a node listed again is asked again
                self.pending[mid] = node
                self.asked.add(node)

    def _refuse(self, node: int, cid: str, reason: str) -> None:
        """Refuse ``node`` for this run: an event, a line on stderr, and it is never asked
        again; the run goes on with the other nodes (a hostile or misconfigured node cannot
        stop it; if a client is then left without a site, the connect error quotes this)."""
        self.refused[node] = reason
        self.log({"phase": "hello", "client_id": cid, "node_id": node, "status": f"refused: {reason}"})
        logger.warning(f"medfl flower: node {node} refused: {reason}")

    def _accept(self, node: int, reply: Message) -> None:
        try:
            ctl = wire.take_json(from_recorddict(reply.content), P.CONTROL, f"hello from node {node}")
            cid = str(ctl.get("client"))
            protocol = int(ctl.get("protocol", -1))
            sizes_got, digest_got = dict(ctl.get("sizes", {})), int(ctl.get("digest", -1))
        except _UNDECODABLE as exc:
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
            self._refuse(node, cid, f"site {cid} (node {node}) speaks medfl-over-Flower protocol {protocol}, the "
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
        for reply in self.grid.pull_messages(list(self.pending)):
            node = self.pending.pop(reply.metadata.reply_to_message_id, None)
            if node is None:
                continue
            if reply.has_error():
                if reply.error.code in _DROPOUT_CODES:
                    continue
                self._refuse(node, "", f"node {node} failed to answer medfl's hello: "
                                         f"{error_reason(reply.error.reason)}")
                continue
            self._accept(node, reply)

    def refresh(self, need: Iterable[str] = (), timeout: float | None = None, enough: int | None = None) -> None:
        """Ask new nodes who they are; re-ask nodes lost earlier; wait up to ``timeout``
        (default ``hello_timeout``) for the hellos of new nodes, and until every client of
        ``need`` is served (``enough``: until that many of them are; a lost node is waited
        for only through ``need``).

        Raises:
            RunError: a node serves an unknown client or drew another partition.
        """
        wait = self.settings.hello_timeout if timeout is None else timeout
        deadline = time.monotonic() + wait
        need = set(need)
        while True:
            online = set(self.grid.get_node_ids())
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
        """Whether no hello can change which clients are served any more: the grid's nodes are
        fixed (:attr:`fixed_nodes`), no hello is awaited, and every node serves a client or was
        refused (never asked again); waiting longer for a client without a node is then waiting
        for nothing."""
        if not self.fixed_nodes or self.pending:
            return False
        return set(self.grid.get_node_ids()) <= set(self.nodes.values()) | set(self.refused) | self.retired

    def drop(self, cid: str) -> None:
        """Forget ``cid``'s node after it missed an exchange (it is asked again later)."""
        node = self.nodes.pop(cid, None)
        if node is not None:
            self.lost.add(node)


class FlowerRun(Run):
    """A :class:`~medfl.engine.runner.Run` whose clients are Flower SuperNodes.

    Args:
        cfg: the resolved ``fl`` config.
        method_spec: this run's entry of ``cfg["methods"]``.
        run_dir: the run directory (on the coordinator's machine).
        data: the coordinator's copy of the split (sizes, ids, names, ``partition.csv``;
            no sample is read from it here).
        grid: the ServerApp's grid.
        settings: timeouts (:class:`FlowerSettings`).
        fold: the cross-validation fold of this run (default: the ``fold`` of the
            ``config.json`` beside ``run_dir``, as the runner writes it for each fold).

    Raises:
        RunError: the method pools every client's data (``centralized``): that cannot
            run across sites.
    """

    hides_replies = True
    transport = "over Flower, at the sites"
    noise_source = ("each site's own secrets (<state-dir>/noise.key and a fresh random secret per run) mixed with "
                    "the run seed, unless a site sets MEDFL_REPRODUCIBLE_NOISE=1")
    #: what to do about clients without a node at the start, for a transport whose sites are
    #: not started with ``medfl flower site`` (a simulation, an NVFlare job); ``None``: a
    #: deployment's advice, which names what registered (:meth:`connect_advice`)
    connect_hint: str | None = None

    def resume_command(self, top: Path) -> str:
        """Over Flower a run continues with ``medfl flower run --resume`` (the sites keep
        their state), with the options that reached the SuperLink
        (:meth:`medfl_plugins.backends.Flower.resume_command`: this session's, else those the
        experiment recorded)."""
        from medfl.backend import recorded_backend
        from medfl.plugins import lookup

        record = recorded_backend(top)[1]
        return lookup("backend", "flower")().resume_command(top, {**record, "launch": self.settings.launch
                                                                   or record.get("launch", "")})

    def __init__(self, cfg: dict[str, Any], method_spec: dict[str, Any], run_dir: str | Path,
                 data: FederatedData, grid: Grid, settings: FlowerSettings | None = None,
                 fold: int | None = None) -> None:
        super().__init__(cfg, method_spec, run_dir, data)
        self.terms = {**FLOWER_TERMS, **getattr(grid, "terms", {})}
        if self.coordinator.pools_data:
            raise RunError(f"method {self.label!r} pools every client's data in one place; it cannot run "
                           f"across sites over {self.terms['name']} (run it in process)")
        self.settings = settings or FlowerSettings()
        self.grid = SteadyGrid(grid, self.settings, self._log)
        if fold is not None:   # else Run's: the fold of the config.json beside run_dir
            self.fold = int(fold)
        self.run_id = ""       # set by prepare (flower.json)
        self.session = ""
        self._events: list[dict[str, Any]] = []
        expected = {cid: (P.split_sizes(data, cid), P.partition_digest(data, cid))
                    for cid in self.federation.eval_client_ids}
        self.sites = SiteDirectory(self.grid, expected, self.fold, self.settings, self._log, self.federation.seed)
        self._guard = SampleGuard(tuple(data.source.sample_shape))   # the same for every site
        self._model_bytes: dict[str, int] = {}   # model spec (JSON) -> bytes of its state (reply_limit)
        #: SecAgg+ for the training replies (``fl.secure_aggregation``; ``None``: off)
        self.secure = (SecureAggregation(cfg["secure_aggregation"], self.federation.seed)
                       if cfg.get("secure_aggregation") else None)
        self._secure_round: SecureRound | None = None

    # ------------------------------------------------------------------ bookkeeping
    def _log(self, event: dict[str, Any]) -> None:
        row = {"time": time.time(), "session": self.session, "round": None, "phase": "",
               "client_id": "", "node_id": "", "status": "", "seconds": float("nan"), **event}
        row["node_id"] = "" if row["node_id"] is None else str(row["node_id"])
        self._events.append(row)

    def _flush_events(self) -> None:
        if not self._events:
            return
        path = self.run_dir / "flower_events.csv"
        df = pd.DataFrame(self._events)
        df.to_csv(path, mode="a", header=not path.is_file(), index=False)
        self._events.clear()

    def prepare(self, resume: bool = False, read_only: bool = False) -> None:
        """As :meth:`Run.prepare`, then open a Flower session: a run id the sites key
        their state by (new for a fresh run, kept on resume, in ``flower.json``), and wait
        up to ``connect_timeout`` for a node serving every client.

        Raises:
            RunError: some client has no node by then, or a node's partition differs (the
                run directory is unlocked; a new run's ``status.json`` says ``failed to
                start``, :meth:`_not_started`).
        """
        super().prepare(resume=resume, read_only=read_only)
        if read_only:
            return
        meta_path = self.run_dir / "flower.json"
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if not resume or not meta.get("run_id"):
            meta["run_id"] = uuid.uuid4().hex
        self.run_id = str(meta["run_id"])
        self.session = uuid.uuid4().hex   # resume_round and _ckpt: set by Run.prepare
        meta.setdefault("sessions", []).append({"session": self.session, "resumed_from": self.resume_round,
                                                "started": time.time()})
        if self.sites.pins:
            meta["site_nodes"] = self.sites.pins          # a resume keeps them without --site-nodes
        elif resume and isinstance(meta.get("site_nodes"), dict):
            self.sites.pins = _pins(meta["site_nodes"], f"{meta_path} site_nodes")
            logger.info(f"medfl flower: clients are served only by the nodes registered for them ({meta_path})")
        tmp = meta_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(meta, indent=2))
        tmp.replace(meta_path)
        t0 = time.monotonic()
        ids = self.federation.eval_client_ids
        self._connect(ids, t0)
        missing = [c for c in ids if c not in self.sites.nodes]
        self._log({"phase": "connect", "status": "ok" if not missing else "missing " + " ".join(missing),
                   "seconds": time.monotonic() - t0})
        self._flush_events()
        if missing:
            refused = "".join(f"; refused {why}" if why.startswith(("node", "site")) else f"; refused node {n}: {why}"
                              for n, why in sorted(self.sites.refused.items()))
            error = (f"no {self.terms['node']} serves client(s) {missing} after {time.monotonic() - t0:.0f} s "
                     f"(connected: {sorted(self.sites.nodes)}){refused}; "
                     f"{self.connect_hint if self.connect_hint is not None else self.connect_advice(missing)}")
            self._not_started(error, resume)
            raise RunError(error)

    def connect_advice(self, missing: list[str]) -> str:
        """What the connect error of a deployment says after the clients ``missing``: which
        sites registered at the SuperLink (client and node ids; a node that registered but had
        not answered medfl's hello, a site still starting), the ``connect-timeout`` it waited
        and how to raise it, and whether no site registered at all (start one per client) or
        the others are late or missing."""
        try:
            online = sorted(set(self.grid.get_node_ids()))
        except Exception:  # noqa: BLE001 - the SuperLink's own trouble; the advice goes without it
            online = []
        served = set(self.sites.nodes.values())
        quiet = [n for n in online if n not in served and n not in self.sites.refused and n not in self.sites.retired]
        limit = f"--connect-timeout {self.settings.connect_timeout:g} s"
        if not served and not quiet and not self.sites.refused:
            return (f"no site registered at the {self.terms['hub']} within {limit}: start a site per client with "
                    "`medfl flower site --client-id ID ...` (sites still starting on a busy machine: raise "
                    "--connect-timeout)")
        registered = [f"client {cid} (node {self.sites.nodes[cid]})" for cid in client_order(self.sites.nodes)]
        registered += [f"node {n} (no answer to medfl's hello yet)" for n in quiet]
        return (f"registered: {', '.join(registered) or 'no site that may serve a client'}; late or missing: "
                f"client(s) {', '.join(missing)}, not served within {limit}: raise --connect-timeout for sites "
                "still starting (a busy machine), or start the missing ones (`medfl flower site --client-id ID ...`)")

    def _not_started(self, error: str, resume: bool) -> None:
        """After ``error`` stopped the run at its start: release the run directory's lock, and
        for a new run say so in ``status.json`` (``medfl runs`` lists it as ``failed to start:
        ERROR``; ``--resume`` starts it once its sites are up). A resumed run keeps its status."""
        from medfl.runs import FAILED_TO_START

        try:
            if not resume:
                self._status(FAILED_TO_START, 0, error)
        except OSError:   # a full disk: the run stays unlocked without it
            pass
        finally:
            self.files.unlock()

    def _connect(self, ids: list[str], t0: float) -> None:
        """Wait up to ``connect_timeout`` for a node serving each client of ``ids``, saying on
        stderr every ``progress_interval`` seconds which are still missing (sites on other
        machines may never come: the coordinator cannot tell, the user can)."""
        self._await_sites(ids, len(ids), t0 + self.settings.connect_timeout, t0)

    def _await_sites(self, ids: list[str], enough: int, deadline: float, t0: float, what: str = "") -> list[str]:
        """Wait until ``deadline`` (``time.monotonic()``) for nodes serving at least
        ``enough`` of the clients ``ids`` (new nodes, and nodes lost earlier, are asked for
        their hello), saying on stderr every ``progress_interval`` seconds which clients have
        no site yet (``what``: what is waiting, e.g. ``round 3 (train): ``); return the
        clients still without a node."""
        waited = False
        while True:
            left = max(0.0, deadline - time.monotonic())
            self.sites.refresh(need=ids, enough=enough,
                               timeout=min(left, max(self.settings.progress_interval, 0.1)))
            missing = [c for c in ids if c not in self.sites.nodes]
            if len(ids) - len(missing) >= enough or self.sites.settled() or time.monotonic() >= deadline:
                break
            waited = True
            nodes = len(self.grid.get_node_ids())
            logger.info(f"medfl flower: {what}waiting for sites ({time.monotonic() - t0:.0f} of {deadline - t0:.0f} s): "
                        f"no site serves client(s) {', '.join(missing)} yet; "
                        f"connected: {', '.join(c for c in ids if c in self.sites.nodes) or 'none'} "
                        f"({nodes} {self.terms['node']}(s) registered)")
        if waited and len(ids) - len(missing) >= enough:
            who = "every site" if not missing else f"{len(ids) - len(missing)} of {len(ids)} sites"
            logger.info(f"medfl flower: {what}{who} connected after {time.monotonic() - t0:.0f} s")
        return missing

    def _await_quorum(self, r: int, phase: str, ids: list[str]) -> None:
        """Before an exchange with the clients ``ids``: when fewer of them have a node than
        :func:`~medfl.engine.runner.sites_needed` asks for, ask the lost nodes for their
        hello again and wait up to ``fl.site_wait_s`` seconds for enough of them (recorded in
        ``flower_events.csv``: a ``waiting`` row, then ``waited``).

        Raises:
            TooFewSites: still too few after the wait, naming the round, the sites and the rule.
        """
        need = sites_needed(len(ids), self.config)
        have = [c for c in ids if c in self.sites.nodes]
        if len(have) >= need:
            return
        wait = float(self.config.get("site_wait_s", 300.0))
        t0 = time.monotonic()
        self._log({"round": r, "phase": phase, "status": f"waiting: {len(have)} of {len(ids)} sites available, "
                                                         f"{need} needed ({quorum_rule(self.config)})"})
        logger.warning(f"medfl flower: round {r} ({phase}): {len(have)} of {len(ids)} sites available, {need} needed "
                       f"({quorum_rule(self.config)}); waiting up to {wait:.0f} s (fl.site_wait_s)")
        missing = self._await_sites(ids, need, t0 + wait, t0, f"round {r} ({phase}): ")
        got = len(ids) - len(missing)
        self._log({"round": r, "phase": phase, "status": f"waited: {got} of {len(ids)} sites available",
                   "seconds": time.monotonic() - t0})
        if got < need:
            self._flush_events()
            raise TooFewSites(
                f"round {r}: {got} of {len(ids)} sites available for {phase} after waiting {wait:.0f} s "
                f"(fl.site_wait_s; no site serves client(s) {', '.join(missing)}), the round needs at least {need} "
                f"({quorum_rule(self.config)}); the run stops here rather than go on without its sites; once they "
                f"are back, continue with: {self.resume_command(self._top())}")

    def check_quorum(self, r: int, phase: str, addressed: list[str], answered: list[str]) -> None:
        """As :meth:`Run.check_quorum`; the exchange's events are written before the run fails."""
        try:
            super().check_quorum(r, phase, addressed, answered)
        except TooFewSites:
            self._log({"round": r, "phase": phase, "status": f"too few sites: {len(answered)} of {len(addressed)}"})
            self._flush_events()
            raise

    def record_absence(self, r: int, phase: str, cid: str) -> None:
        """A client ``fl.absences`` keeps out of an exchange is sent nothing: an ``absent
        (scheduled)`` row in ``flower_events.csv``."""
        self._log({"round": r, "phase": phase, "client_id": cid, "status": "absent (scheduled)"})

    def _save_checkpoint(self, r: int) -> None:
        super()._save_checkpoint(r)
        self._flush_events()

    def _instruction_content(self, r: int, cid: str, ins: Instruction, **extra: Any) -> Content:
        return wire.instruction_request(self._control(r, cid, **extra), ins)

    # ------------------------------------------------------------------ one exchange
    def exchange(self, r: int, phase: str, message_type: str, outgoing: dict[str, Content],
                 releases: frozenset[str] | set[str] = frozenset(), counted_as: str | None = None,
                 controlled: bool = True) -> dict[str, Content]:
        """Send each client's content to its node and collect the answers.

        Returns the contents of the replies of the clients that answered in time, in the
        engine's client order; a client without a node, one whose node is unavailable and one that has
        not answered within ``round_timeout`` are left out (and logged).

        Enough sites (:func:`~medfl.engine.runner.sites_needed`: ``fl.min_sites``,
        ``fl.min_fraction``): before sending, fewer sites with a node than needed are waited
        for (:meth:`_await_quorum`); after it, when fewer answered than needed, the sites
        that timed out or were unavailable are asked for their hello again and waited for,
        up to ``fl.site_wait_s`` seconds, and the same content is sent again to those that
        came back (a site computes the same answer again: its state is versioned by round).
        SecAgg+'s stages are not sent again (their masks belong to one exchange). Each wait
        is a ``waiting`` / ``waited`` row of ``flower_events.csv``; what is still missing
        after it fails the round (:meth:`Run.check_quorum`).

        Every message sent is recorded in :attr:`traffic` under ``phase`` with the encoded
        size of its content and of the answer's (:func:`medfl.wire.encoded_size`; a client
        that did not answer counts its request only; one without a node was sent nothing).

        An answer larger than :meth:`reply_limit` (``releases``: the clients asked for a
        per-sample release in this exchange) is refused like a bad reply, with its size.
        A site that answers with an error (its ClientApp raised: its plugin failed, it
        refused an unapproved method) is dropped like a bad reply (:meth:`Run.refuse`: an
        event, exclusion after ``max_reply_failures``), so one site cannot stop the run.

        ``counted_as``: the traffic phase when it is not ``phase`` (SecAgg+'s key-exchange
        stages count as ``secagg``); ``controlled``: the answers carry medfl's control record
        naming the client (SecAgg+'s key-exchange answers are Flower's ``secaggplus_mod``'s own
        and carry only its record).

        Raises:
            SiteFailure: every site asked answered with an error (each one's reason quoted).
            TooFewSites: too few sites are available before sending, after ``fl.site_wait_s``.
        """
        self.sites.refresh()
        ids = client_order(outgoing)
        self._await_quorum(r, phase, ids)
        t0 = time.monotonic()
        need = sites_needed(len(ids), self.config)
        again = controlled and not (self.secure is not None and message_type == P.TRAIN)
        replies: dict[str, Content] = {}
        failed: dict[str, str] = {}     # sites that answered with an error -> what it said
        settled: set[str] = set()       # sites that answered (accepted, refused or with an error)
        asked: list[str] = []           # sites sent the content at least once
        todo, until = ids, None
        while True:
            asked += [c for c in self._send(r, phase, message_type, {c: outgoing[c] for c in todo}, releases,
                                            counted_as, controlled, replies, failed, settled) if c not in asked]
            short = [c for c in ids if c not in settled]   # timed out, unavailable or without a node
            if len(replies) >= need or not short or not again:
                break
            until = until or time.monotonic() + float(self.config.get("site_wait_s", 300.0))
            if time.monotonic() >= until:
                break
            todo = self._await_return(r, phase, short, need - len(replies), until)
            if not todo:
                break
        self._log({"round": r, "phase": phase + ":all", "status": f"{len(replies)}/{len(outgoing)}",
                   "seconds": time.monotonic() - t0})
        if failed and len(failed) == len(asked):
            # every site asked failed: the method, a filter or an approval is wrong everywhere
            self._flush_events()
            raise SiteFailure("; ".join(failed[cid] for cid in client_order(failed)))
        for cid in client_order(failed):
            # one site's error (its code failed, it refused the method, or it answers errors on
            # purpose) cannot stop the run: dropped like any bad reply, excluded by policy
            self.refuse(r, cid, failed[cid])
        return {cid: replies[cid] for cid in client_order(replies)}

    def _await_return(self, r: int, phase: str, short: list[str], more: int, until: float) -> list[str]:
        """After an exchange that fewer sites answered than needed: wait until ``until`` for
        nodes serving at least ``more`` of the clients ``short`` (those that timed out or were
        unavailable: asked for their hello again), then up to ``hello_timeout`` more for the
        rest of them; return those that have one, to send the exchange to again (none: too
        few came back)."""
        t0 = time.monotonic()
        self._log({"round": r, "phase": phase, "status": f"waiting: {len(short)} site(s) missing ({' '.join(short)}), "
                                                         f"{more} more needed ({quorum_rule(self.config)})"})
        logger.warning(f"medfl flower: round {r} ({phase}): too few sites answered, {more} more needed "
                       f"({quorum_rule(self.config)}); waiting up to {max(0.0, until - t0):.0f} s more (fl.site_wait_s) for "
                       f"client(s) {', '.join(short)} to come back")
        missing = self._await_sites(short, more, until, t0, f"round {r} ({phase}): ")
        if missing and len(short) - len(missing) >= more:
            # enough are back: give the others (still busy with the message they missed) up
            # to hello_timeout to come back too, so that a slow round is not a smaller one
            self.sites.refresh(need=short, timeout=min(self.settings.hello_timeout, max(0.0, until - time.monotonic())))
        back = [c for c in short if c in self.sites.nodes]
        self._log({"round": r, "phase": phase, "status": f"waited: {len(back)} back ({' '.join(back)})",
                   "seconds": time.monotonic() - t0})
        if len(back) < more:
            return []
        logger.info(f"medfl flower: round {r} ({phase}): sending it again to client(s) {', '.join(back)}")
        return back

    def _send(self, r: int, phase: str, message_type: str, outgoing: dict[str, Content],
              releases: frozenset[str] | set[str], counted_as: str | None, controlled: bool,
              replies: dict[str, Content], failed: dict[str, str], settled: set[str]) -> list[str]:
        """One round trip of :meth:`exchange`: send each client of ``outgoing`` that has a
        node its content, collect the answers for up to ``round_timeout`` seconds into
        ``replies`` (accepted), ``failed`` (Flower errors) and ``settled`` (every client that
        answered, refused ones included), record the traffic; return the clients sent to."""
        t0 = time.monotonic()
        by_msg: dict[str, str] = {}
        sent_at: dict[str, float] = {}
        msgs, order = [], []
        size_to: dict[str, int] = {}
        size_from: dict[str, int] = {}
        for cid in client_order(outgoing):
            node = self.sites.nodes.get(cid)
            if node is None:
                self._log({"round": r, "phase": phase, "client_id": cid, "status": "absent"})
                continue
            size_to[cid] = wire.encoded_size(outgoing[cid])
            # packed into one array (a handful of Flower objects instead of one per tensor, each a request on
            # every hop), but for SecAgg+'s messages: Flower's secaggplus_mod reads and masks their records
            records = to_recorddict(outgoing[cid])
            content = records if RECORD_KEY_CONFIGS in records.config_records else pack_records(records)
            msgs.append(Message(content, dst_node_id=node, message_type=message_type, group_id=str(r),
                                ttl=self.settings.round_timeout + 60.0))
            order.append(cid)
        for cid, mid in zip(order, self.grid.push_messages(msgs)):
            if not mid:
                # the SuperLink did not take it: the node left the federation since its hello
                # (a SuperNode that stopped on an error of the SuperLink unregisters itself)
                self._log({"round": r, "phase": phase, "client_id": cid, "node_id": self.sites.nodes.get(cid),
                           "status": f"unavailable (the {self.terms['hub']} refused the message: the node left)"})
                self.sites.drop(cid)
                continue
            by_msg[mid] = cid
            sent_at[cid] = time.monotonic()
        order = [cid for cid in order if cid in sent_at]
        del msgs
        deadline = t0 + self.settings.round_timeout
        while by_msg and time.monotonic() < deadline:
            for reply in self.grid.pull_messages(list(by_msg)):
                cid = by_msg.pop(reply.metadata.reply_to_message_id, None)
                if cid is None:
                    continue
                node = self.sites.nodes.get(cid)
                secs = time.monotonic() - sent_at[cid]
                if reply.has_error():
                    code, reason = reply.error.code, error_reason(reply.error.reason)
                    if code in _DROPOUT_CODES:
                        self._log({"round": r, "phase": phase, "client_id": cid, "node_id": node,
                                   "status": f"dropped (error {code})", "seconds": secs})
                        self.sites.drop(cid)
                        continue
                    self._log({"round": r, "phase": phase, "client_id": cid, "node_id": node,
                               "status": f"failed (error {code})", "seconds": secs})
                    failed[cid] = f"site {cid} failed in {phase} of round {r} ({self.terms['name']} error {code}): {reason}"
                    settled.add(cid)
                    continue
                settled.add(cid)
                try:
                    got = from_recorddict(unpack_records(reply.content))
                    ctl = (wire.take_json(got, P.CONTROL, f"{phase} reply of site {cid}") if controlled
                           else {"client": cid})
                    if str(ctl.get("client")) != cid:
                        raise WireError(f"{phase} reply of node {node}: answered as client {ctl.get('client')!r}, "
                                        f"but serves client {cid!r} for this run")
                except _UNDECODABLE as exc:
                    self._log({"round": r, "phase": phase, "client_id": cid, "node_id": node,
                               "status": "refused", "seconds": secs})
                    self.refuse(r, cid, f"{phase}: {exc}")
                    continue
                size_from[cid] = wire.encoded_size(got)
                limit = self.reply_limit(cid, size_to[cid], cid in releases)
                if size_from[cid] > limit:
                    self._log({"round": r, "phase": phase, "client_id": cid, "node_id": node,
                               "status": "refused (size)", "seconds": secs})
                    self.refuse(r, cid, f"{phase}: the answer of site {cid} is {size_from[cid] / 2**20:.1f} MiB, "
                                        f"more than the {limit / 2**20:.1f} MiB it can need (max-reply-mb)")
                    continue
                replies[cid] = got
                self._log({"round": r, "phase": phase, "client_id": cid, "node_id": node, "status": "ok",
                           "seconds": secs})
            if by_msg:
                self.settings.pause()
        for cid in by_msg.values():
            self._log({"round": r, "phase": phase, "client_id": cid, "node_id": self.sites.nodes.get(cid),
                       "status": "timeout", "seconds": time.monotonic() - sent_at[cid]})
            logger.warning(f"medfl flower: round {r}: site {cid} did not answer {phase} within "
                           f"{self.settings.round_timeout:.0f} s; left out")
            self.sites.drop(cid)
        for cid in order:
            self.traffic.add(r, cid, counted_as or phase, size_to[cid], size_from.get(cid, 0))
        return order

    def reply_limit(self, cid: str, sent: int, release: bool = False) -> int:
        """The largest answer (encoded bytes) the coordinator takes from ``cid`` after sending
        it ``sent`` bytes: ``max-reply-mb`` when set; else four times the larger of what was
        sent and the client's model state, plus 64 MiB for metrics and predictions, plus, in
        an exchange that asks for a per-sample release (``release``), twice the client's
        training set as float32 samples. Anything more is not something the method sends: a
        site that appends a 512 MiB tensor is refused, not decoded into the round."""
        if self.settings.max_reply_mb > 0:
            return int(self.settings.max_reply_mb * 2**20)
        spec = self.federation.model_spec(cid)
        key = json.dumps(spec, sort_keys=True, default=str)
        if key not in self._model_bytes:
            model = self.federation.build_model(cid)
            self._model_bytes[key] = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        limit = 4 * max(sent, self._model_bytes[key]) + 64 * 2**20
        if release:
            samples = int(self.federation.num_examples.get(cid, 0))
            limit += 2 * samples * 4 * math.prod(self.data.source.sample_shape)
        return limit

    # ------------------------------------------------------------------ the transport seam
    def update_clients(self, r: int, instructions: dict[str, Instruction]) -> dict[str, Reply]:
        """Send every addressed client its instruction as a ``train`` message; return the
        replies of the sites that answered, in the engine's client order. Each reply is
        checked on arrival: tensors and numbers only, nothing shaped like a batch of the
        site's images (:func:`~medfl.messages.validate_payload`; the site compared the reply
        with its own labels and images before sending it, :mod:`medfl.guard`)."""
        if self.secure is not None:
            return self._secure_update(r, instructions)
        outgoing = {cid: self._instruction_content(r, cid, ins) for cid, ins in instructions.items()}
        releases = {cid for cid, ins in instructions.items() if release_exemptions(self.coordinator, ins)}
        answers = self.exchange(r, "train", P.TRAIN, outgoing, releases)
        return self._decode(r, "train", answers, lambda cid, msg: self._train_reply(r, cid, msg, instructions[cid]))

    def _train_reply(self, r: int, cid: str, content: Content, instruction: Instruction) -> Reply:
        """A site's answer to ``train`` as a :class:`Reply`, checked (tensors and numbers only,
        nothing shaped like the site's images, an integer ``num_examples``).

        Raises:
            PayloadError: the answer is not what a site sends.
        """
        where = f"reply of site {cid} in round {r}"
        payload = wire.take(content, "reply.payload", where, allow_str=False)
        metrics = wire.take(content, "reply.metrics", where + " (metrics)", allow_str=False)
        validate_payload(payload, where, allow_str=False, guard=self._guard,
                         exempt=release_exemptions(self.coordinator, instruction))
        if not isinstance(payload, dict) or not isinstance(metrics, dict):
            raise PayloadError(f"{where}: payload and metrics must be dicts")
        ctl = wire.take_json(content, P.CONTROL, where)
        n = ctl.get("num_examples", 0)
        if isinstance(n, bool) or not isinstance(n, int):
            raise PayloadError(f"{where}: num_examples {n!r} is not an integer")
        return Reply(payload=payload, metrics=metrics, num_examples=n)

    def _secure_update(self, r: int, instructions: dict[str, Instruction]) -> dict[str, Reply]:
        """One training step under SecAgg+ (:class:`~medfl.flower.secagg.SecureAggregation`):
        the replies (metrics and ``num_examples`` only) of the sites whose masked update is in
        the round's sum; the sum itself waits for :meth:`aggregated`."""
        assert self.secure is not None
        self.sites.refresh()
        nodes = {cid: self.sites.nodes[cid] for cid in instructions if cid in self.sites.nodes}
        max_weight = max([int(self.federation.num_examples.get(cid, 0)) for cid in instructions] + [1])

        def control(cid: str, stage: str) -> dict[str, Any]:
            return {"protocol": wire.PROTOCOL, "run": self.run_id, "session": self.session, "round": r,
                    "client": cid, "step": self._step, "secure_aggregation": stage}

        def exchange(stage: str, outgoing: dict[str, Content], counted_as: str, controlled: bool
                     ) -> dict[str, Content]:
            phase = "train" if counted_as == "train" else f"secagg.{stage}"
            return self.exchange(r, phase, P.TRAIN, outgoing, counted_as=counted_as, controlled=controlled)

        done = self.secure.run(
            r, self._step, type(self.coordinator), instructions, nodes, float(max_weight),
            request=lambda cid, ins: self._instruction_content(r, cid, ins,
                                                                secure_aggregation=Stage.COLLECT_MASKED_VECTORS),
            control=control, exchange=exchange,
            decode=lambda cid, msg: self._train_reply(r, cid, msg, instructions[cid]),
            refuse=lambda cid, why: self.refuse(r, cid, why))
        self._secure_round = done
        self._log({"round": r, "phase": "secagg", "status": done.halted or
                   f"aggregated {len(done.included)}: {' '.join(done.included)}"})
        if done.halted:
            logger.warning(f"medfl [{self.label}] round {r}: {done.halted}")
        return done.replies

    def aggregated(self, r: int, replies: dict[str, Reply]) -> dict[str, Reply]:
        """Under secure aggregation, the round's weighted mean as the one reply the method
        receives (:meth:`SecureRound.as_replies`: none when the round could not be unmasked,
        or when a site whose update is in the sum had its reply refused by the checks);
        otherwise the replies themselves."""
        if self.secure is None:
            return replies
        done, self._secure_round = self._secure_round, None
        if done is None:
            return {}
        out = done.as_replies(replies)
        if done.aggregate is not None and not out:
            refused = sorted(set(done.included) - set(replies))
            logger.warning(f"medfl [{self.label}] round {r}: the secure sum includes the update of site(s) {refused}, whose "
                           "reply was refused; it cannot be taken out of the sum: no update this round")
        return out

    def secure_aggregation(self) -> dict[str, Any] | None:
        """What ``fl.secure_aggregation`` protects (:func:`medfl.flower.secagg.describe`), or ``None``."""
        return None if self.secure is None else describe(self.secure.settings)

    def _decode(self, r: int, phase: str, answers: dict[str, Content], decode: Any) -> dict[str, Any]:
        """``decode(cid, content)`` for every answer; one that cannot be decoded (a missing or
        malformed record, a payload the audit rejects) is refused (:meth:`Run.refuse`: dropped
        from the round with a row in ``reply_events.csv``, the site excluded after
        ``max_reply_failures``) and the round goes on with the others."""
        out: dict[str, Any] = {}
        for cid, content in answers.items():
            try:
                out[cid] = decode(cid, content)
            except _UNDECODABLE as exc:
                self.refuse(r, cid, f"{phase}: {exc}")
        return out

    def validate_clients(self, r: int, instructions: dict[str, Instruction]) -> dict[str, dict[str, float]]:
        """Send every addressed client its validation instruction (``evaluate.validate``);
        return the scalars of the sites that answered, in the engine's client order."""
        return self._scalar_exchange(r, instructions, "validate", f"validation of site {{}} in round {r}")

    def profile_clients(self, r: int, instructions: dict[str, Instruction]) -> dict[str, dict[str, float]]:
        """Send every addressed client its profile instruction (an ``evaluate.validate``
        message whose control record says ``exchange: profile``); return the scalars of the
        sites that answered (measured on each site's machine: ``ClientContext.deployed``)."""
        return self._scalar_exchange(r, instructions, "profile", "profile of site {}", exchange="profile")

    def _scalar_exchange(self, r: int, instructions: dict[str, Instruction], phase: str, where: str,
                         **extra: Any) -> dict[str, dict[str, float]]:
        """One ``evaluate.validate`` exchange (``extra``: control fields telling the site which
        client step to run); the scalars of the sites that answered (``where``: the error
        location, ``{}`` the site)."""
        outgoing = {cid: self._instruction_content(r, cid, ins, **extra) for cid, ins in instructions.items()}
        answers = self.exchange(r, phase, P.VALIDATE, outgoing)
        return self._decode(r, phase, answers,
                            lambda cid, got: wire.read_metrics(got.get("validate"), where.format(cid)))

    def final_evaluate_clients(self, r: int, finals: dict[str, tuple[dict[str, Any], dict[str, Any]]],
                               splits: list[str]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
        """Send the final models to every site (an ``evaluate`` message with ``final`` in
        its control record); each site rebuilds them from their registered specs, scores
        them on its own splits and returns only metrics (``eval.<model>/<split>``)."""
        ins = self.final_instruction(finals)
        outgoing = {cid: self._instruction_content(r, cid, ins, splits=splits, final=True)
                    for cid in self.federation.eval_client_ids}
        answers = self.exchange(r, "final", P.EVALUATE, outgoing)

        def decode(cid: str, got: Content) -> dict[str, dict[str, dict[str, float]]]:
            where = f"final evaluation of site {cid}"
            ctl = wire.take_json(got, P.CONTROL, where)
            per: dict[str, dict[str, dict[str, float]]] = {}
            for key in _listed(ctl, "splits", where):
                name, _, split = str(key).partition("/")
                if name not in finals or split not in splits:
                    raise PayloadError(f"{where}: unexpected result {key!r}")
                per.setdefault(name, {})[split] = wire.read_metrics(got.get(f"eval.{key}"), f"{where} ({key})")
            return per

        return self._decode(r, "final", answers, decode)

    def evaluate_clients(self, r: int, evals: dict[str, Instruction], splits: list[str]
                         ) -> dict[str, dict[str, dict[str, float]]]:
        """Each site scores its client's evaluation model of round ``r`` on its own splits.

        With ``cross_test``, the sites also return their evaluation model's state; the
        coordinator sends every model to every site (``evaluate.score``) with its owner's
        model spec and evaluation instruction (identical instructions are sent once), and the
        site rebuilds each model with the method's ``eval_model_skeleton`` (any evaluation
        model: ensembles, probability models), scores it on its local test split and returns
        only metrics; the per-pair scores and their mean are assembled as in process (a site
        that is out counts as neither model nor data for that round)."""
        own = [s for s in splits if s != "cross_test"]
        cross = "cross_test" in splits
        ids = self.asked(r, "evaluate", self.federation.eval_client_ids)
        outgoing = {cid: self._instruction_content(r, cid, evals.get(cid, Instruction()), splits=own,
                                                   want_model=cross) for cid in ids}
        answers = self.exchange(r, "evaluate", P.EVALUATE, outgoing)
        out: dict[str, dict[str, dict[str, float]]] = {}
        models: dict[str, Any] = {}

        def decode(cid: str, got: Content) -> tuple[dict[str, dict[str, float]], Any]:
            where = f"evaluation of site {cid} in round {r}"
            ctl = wire.take_json(got, P.CONTROL, where)
            results = {}
            for split in _listed(ctl, "splits", where):
                if split not in own:
                    raise PayloadError(f"{where}: metrics for split {split!r}, which was not asked for ({own})")
                results[str(split)] = wire.read_metrics(got.get(f"eval.{split}"), f"{where} ({split})")
            state = None
            if cross:
                state = wire.take(got, "model", where + " (model)", allow_str=False)
                validate_payload(state, where + " (model)", allow_str=False, guard=self._guard)
            return results, state

        for cid, (results, state) in self._decode(r, "evaluate", answers, decode).items():
            out[cid] = results
            if cross:
                models[cid] = state
        if cross and models:
            specs = {cid: self.federation.model_spec(cid) for cid in models}
            # each distinct evaluation instruction once
            shared, ins_of = wire.share_instructions({owner: evals.get(owner, Instruction()) for owner in models})
            outgoing = {cid: wire.score_request(self._control(r, cid, specs=specs, ins_of=ins_of), models, shared)
                        for cid in ids}
            scored = self.exchange(r, "score", P.SCORE, outgoing)
            del models, outgoing
            by_owner: dict[str, dict[str, dict[str, float]]] = {}

            def scores(data_cid: str, content: Content) -> dict[str, dict[str, float]]:
                got = {}
                for key in content:
                    if key.startswith("score."):
                        owner = key[len("score."):]
                        if owner not in specs:
                            raise PayloadError(f"score reply of site {data_cid}: a score for client {owner!r}, "
                                               "whose model it was not sent")
                        got[owner] = wire.read_metrics(content[key], f"cross_test of client {owner} at site {data_cid}")
                return got

            for data_cid, got in self._decode(r, "score", scored, scores).items():
                for owner, m in got.items():
                    by_owner.setdefault(owner, {})[data_cid] = m
            for owner in client_order(by_owner):
                if owner not in out:
                    continue
                per_peer = []
                for data_cid in client_order(by_owner[owner]):
                    out[owner][f"cross_test@{data_cid}"] = by_owner[owner][data_cid]
                    per_peer.append(by_owner[owner][data_cid])
                out[owner]["cross_test"] = cross_test_mean(per_peer)
        return out


# ---------------------------------------------------------------------- the ServerApp's run config
#: The run-config keys of medfl's Flower app and their defaults (``flwr run --run-config``).
RUN_CONFIG: dict[str, Any] = {
    "config": "",            # the bundle config (train.json) on the SuperLink's machine
    "overrides": "{}",       # JSON of '#'-path overrides: {"fl#rounds": 3}
    "workdir": "",           # where relative paths of the config are read
    "resume": "",            # a stopped Flower run directory to continue instead
    "rounds": 0,             # with resume: a new total number of rounds (0: as configured)
    "result-file": "",       # where to write the result as JSON (on the SuperLink's machine)
    "round-timeout": 600.0,
    "connect-timeout": 300.0,
    "hello-timeout": 60.0,
    "poll-interval": 0.2,
    "progress-interval": 15.0,   # seconds between "waiting for sites" lines at the start
    "site-nodes": "",        # JSON {client id: node id}: only that node may serve the client
    "max-reply-mb": 0.0,     # the largest answer taken from a site (0: bounded by what the method sends)
    "launch": "",            # the options of `medfl flower run` that reach the SuperLink (for resume hints)
    "threads": "",           # with resume: the coordinator's torch threads (--threads; a new run: fl#threads)
    "superlink-retries": 8,  # tries again of a SuperLink call failing with HTTP 5xx ("database is locked")...
    "superlink-backoff": 0.5,  # ... after this many seconds, doubling (at most 30 s)
}


# ---------------------------------------------------------------------- runs on a grid
def flower_run_factory(grid: Grid, settings: FlowerSettings | None) -> Any:
    """The runner's ``run_factory`` building :class:`FlowerRun` on ``grid``."""
    def build(cfg: dict[str, Any], spec: dict[str, Any], run_dir: Path, data: FederatedData) -> FlowerRun:
        return FlowerRun(cfg, spec, run_dir, data, grid, settings)
    return build
