"""medfl's messages over Flower: :class:`FlowerTransport`, a ServerApp's grid as a
:class:`medfl.transport.Transport`.

Each :class:`~medfl.transport.Outgoing` becomes a Flower ``Message`` to its node (its content
packed into one record, :func:`medfl.flower.proxy.records_of`,
but for the hello, which says which protocol a site speaks, and SecAgg+'s stages, whose records
Flower's ``secaggplus_mod`` reads and masks at the site); each reply comes back as an
:class:`~medfl.transport.Answer`. Flower's error codes are sorted: a node gone or a message
lost is a dropout (``lost``); an exception the ClientApp raised is the site's error.

A call to the SuperLink that fails with a transient error (:func:`transient_error`: SQLite's
"database is locked" behind ``--database`` answers HTTP 500; a lost connection) is tried
again with a growing wait, each retry recorded (a ``superlink`` row of ``flower_events.csv``);
then the run fails with one :class:`SuperLinkError` line.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable

from flwr.app import Message
from flwr.serverapp import Grid

from medfl.engine.remote_sites import RemoteSettings
from medfl.engine.runner import RunError
from medfl.engine import protocol as P
from medfl.flower.proxy import content_of, records_of
from medfl.transport import Answer, Outgoing, Transport

__all__ = ["FlowerTransport", "FLOWER_TERMS", "RUN_CONFIG", "SuperLinkError", "error_reason", "transient_error"]

logger = logging.getLogger(__name__)

#: the words of the coordinator's messages over Flower (:attr:`medfl.transport.Transport.terms`)
FLOWER_TERMS = {"name": "Flower", "node": "SuperNode", "hub": "SuperLink"}

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

# Flower's error codes (flwr.common.constant.ErrorCode): MESSAGE_UNAVAILABLE,
# REPLY_MESSAGE_UNAVAILABLE, NODE_UNAVAILABLE, CLIENT_APP_CRASHED are dropouts; the others
# (UNKNOWN, LOAD_CLIENT_APP_EXCEPTION, CLIENT_APP_RAISED_EXCEPTION...) the site's error
_DROPOUT_CODES = {3, 4, 5, 8}


class SuperLinkError(RunError):
    """A call to the SuperLink kept failing with a transient error after every retry of
    :class:`FlowerTransport`: the run fails (status ``failed``, resumable) with this one line."""


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


def transient_error(exc: BaseException) -> str:
    """What ``exc`` says when it is an error of the SuperLink that a later try may not
    meet ("": not one): an HTTP 5xx answer (a SuperLink on SQLite answers 500 when the
    database is locked), a pushed object the SuperLink did not store (Flower's
    ``ObjectPushError``: its database failed the same way), a lost or timed-out connection,
    a gRPC ``UNAVAILABLE``, ``INTERNAL``, ``UNKNOWN``, ``DEADLINE_EXCEEDED`` or
    ``RESOURCE_EXHAUSTED``, or SQLite's own locked/busy error. Refusals (HTTP 4xx: the run
    was stopped, a token is wrong) are not transient."""
    import sqlite3

    import grpc
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
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED):
            details = exc.details() if hasattr(exc, "details") else ""
            return f"gRPC {code.name}" + (f": {details}" if details else "")
    return ""


class FlowerTransport(Transport):
    """A ServerApp's grid as medfl's transport (the module docstring).

    Pushing again after a failed push is safe: Flower's message ids are the messages' content
    digests and a SuperLink keeps one copy of a message id. A pull that failed after the
    SuperLink handed over some replies may lose them: those sites then count as timed out.

    Args:
        grid: the grid Flower gave the ServerApp.
        settings: the retry settings (``superlink_retries``, ``superlink_backoff``) and the
            stop event a wait honours.
        log: called with one event dict per retry.
    """

    terms = FLOWER_TERMS
    secure_aggregation = True

    def __init__(self, grid: Grid, settings: RemoteSettings, log: Callable[[dict[str, Any]], None]) -> None:
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

    def nodes(self) -> list[int]:
        """The SuperLink's connected nodes (retried)."""
        return list(self._call("to list its nodes", self.grid.get_node_ids))

    def send(self, messages: list[Outgoing]) -> list[str]:
        """Push ``messages`` as Flower messages; their ids (retried with the same messages)."""
        flower = []
        for m in messages:
            # packed: a handful of Flower objects instead of one per tensor, each a request on every hop
            content = records_of(m.content, pack=not (m.secure or m.kind == P.HELLO))
            flower.append(Message(content, dst_node_id=m.node, message_type=m.kind, ttl=m.ttl,
                                  **({"group_id": m.group} if m.group else {})))
        return list(self._call("to take messages", self.grid.push_messages, flower))

    def receive(self, ids: list[str]) -> list[Answer]:
        """The answers to ``ids`` that arrived (retried); an answer whose records cannot be
        read is the site's error."""
        out = []
        for reply in self._call("to hand over replies", self.grid.pull_messages, ids):
            to = reply.metadata.reply_to_message_id
            if reply.has_error():
                code = reply.error.code
                out.append(Answer(to, error=f"error {code}: {error_reason(reply.error.reason)}" if code in
                                  _DROPOUT_CODES else error_reason(reply.error.reason), lost=code in _DROPOUT_CODES))
                continue
            try:
                out.append(Answer(to, content_of(reply.content)))
            except (ValueError, TypeError) as exc:   # WireError is a TypeError
                out.append(Answer(to, error=f"its answer cannot be read: {exc}"))
        return out
