"""The coordinator of a run whose clients are sites elsewhere: :class:`RemoteRun`.

:class:`RemoteRun` is the in-process :class:`~medfl.engine.runner.Run` with its transport
methods replaced (:class:`~medfl.engine.remote_steps.RemoteSteps`): each addressed client's
:class:`~medfl.messages.Instruction` goes to the site serving that client as a message
(:mod:`medfl.wire`), through a :class:`medfl.transport.Transport` (Flower's, NVIDIA FLARE's, one
in this process), and the answers come back as :class:`~medfl.messages.Reply` objects and
metrics. Everything else - the method's coordinator role, checkpoints, ``metrics.csv``,
``summary.json``, resume - is ``Run``'s, unchanged, so any method registered through the plugin
contract runs at the sites with no method-specific code here: hub-and-spoke methods (FedAvg,
FedProx, FedKPer...) and peer-to-peer ones (FedSKD, FedCross: the coordinator relays one site's
model to another in the instructions; nothing is aggregated) alike.

Sites and dropouts (:class:`~medfl.engine.remote_sites.SiteDirectory`): a site whose node is
lost, or that does not answer a round's message within ``round_timeout`` seconds, is left out
of that round's replies - the method's ``server_update`` sees only the sites that answered,
exactly as with a sampled subset - and out of that round's evaluation rows; enough sites
(``fl.min_sites``, ``fl.min_fraction``) are waited for. Every exchange is recorded in
``flower_events.csv`` of the run directory, and the encoded size of every message sent and
received in ``communication.csv`` (as in process: :mod:`medfl.engine.traffic`).

Per-site persistent state is never at the coordinator: the ``clients/`` and ``eval_state/``
directories of a remote run stay empty; each site keeps them under its own state directory
(:mod:`medfl.site`).
"""

from __future__ import annotations

import json
import logging
import math
import time
import uuid
from pathlib import Path
from typing import Any, Callable

import pandas as pd

from medfl import wire
from medfl.engine.data import FederatedData, client_order
from medfl.engine.remote_sites import UNDECODABLE, RemoteSettings, SiteDirectory, SiteFailure, parse_pins
from medfl.engine.remote_steps import RemoteSteps
from medfl.engine.runner import Run, RunError
from medfl.engine.screening import TooFewSites, quorum_rule, sites_needed
from medfl.integrity import write_json
from medfl.engine import protocol as P
from medfl.messages import Instruction, SampleGuard
from medfl.transport import Outgoing, Transport
from medfl.wire import Content, WireError

__all__ = ["RemoteRun", "RemoteSettings", "SiteFailure", "remote_run_factory"]

logger = logging.getLogger(__name__)

#: an event row of ``flower_events.csv``, as :meth:`RemoteRun._log` takes it
Log = Callable[[dict[str, Any]], None]


class RemoteRun(RemoteSteps, Run):
    """A :class:`~medfl.engine.runner.Run` whose clients are sites reached over a transport.

    Args:
        cfg: the resolved ``fl`` config.
        method_spec: this run's entry of ``cfg["methods"]``.
        run_dir: the run directory (on the coordinator's machine).
        data: the coordinator's copy of the split (sizes, ids, names, ``partition.csv``;
            no sample is read from it here).
        transport: the sites' :class:`~medfl.transport.Transport`, or a function of the run's
            event log that builds it (a transport that records events of its own).
        settings: timeouts (:class:`~medfl.engine.remote_sites.RemoteSettings`).
        fold: the cross-validation fold of this run (default: the ``fold`` of the
            ``config.json`` beside ``run_dir``, as the runner writes it for each fold).

    Raises:
        RunError: the method pools every client's data (``centralized``), or
            ``fl.secure_aggregation`` is set and the transport cannot carry SecAgg+.
    """

    hides_replies = True
    noise_source = ("each site's own secrets (<state-dir>/noise.key and a fresh random secret per run) mixed with "
                    "the run seed, unless a site sets MEDFL_REPRODUCIBLE_NOISE=1")

    def __init__(self, cfg: dict[str, Any], method_spec: dict[str, Any], run_dir: str | Path, data: FederatedData,
                 transport: Transport | Callable[[Log], Transport], settings: RemoteSettings | None = None,
                 fold: int | None = None) -> None:
        self.session = ""
        self._events: list[dict[str, Any]] = []
        self.settings = settings or RemoteSettings()
        self.transport = transport if isinstance(transport, Transport) else transport(self._log)
        t = self.transport
        self.terms = {"name": "the transport", "node": "node", "hub": "transport", **t.terms}
        self.where = self.terms.get("where") or f"over {self.terms['name']}, at the sites"
        if cfg.get("secure_aggregation") and not t.secure_aggregation:
            raise RunError(f"fl.secure_aggregation: SecAgg+ needs Flower's secaggplus_mod at each site, which "
                           f"{self.terms['name']} does not carry; unset it, or run over Flower (`medfl flower run`)")
        super().__init__(cfg, method_spec, run_dir, data)
        self.session = ""      # Run's placeholder until prepare opens a session
        if self.coordinator.pools_data:
            raise RunError(f"method {self.label!r} pools every client's data in one place; it cannot run "
                           f"across sites over {self.terms['name']} (run it in process)")
        if t.noise_source:
            self.noise_source = t.noise_source
        if fold is not None:   # else Run's: the fold of the config.json beside run_dir
            self.fold = int(fold)
        self.run_id = ""       # set by prepare (flower.json)
        expected = {cid: (P.split_sizes(data, cid), P.partition_digest(data, cid))
                    for cid in self.federation.eval_client_ids}
        self.sites = SiteDirectory(t, expected, self.fold, self.settings, self._log, self.federation.seed)
        self._guard = SampleGuard(tuple(data.source.sample_shape))   # the same for every site
        self._model_bytes: dict[str, int] = {}   # model spec (JSON) -> bytes of its state (reply_limit)
        #: SecAgg+ for the training replies (``fl.secure_aggregation``; ``None``: off)
        self.secure: Any = None
        if cfg.get("secure_aggregation"):
            from medfl.flower.secagg import SecureAggregation

            self.secure = SecureAggregation(cfg["secure_aggregation"], self.federation.seed)
        self._secure_round: Any = None

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

    def resume_command(self, top: Path) -> str:
        """The command of the backend that ran the experiment ``top``
        (:meth:`medfl.backend.Backend.resume_command`), with the options of this session that
        reached the hub (``launch``), else those the experiment recorded."""
        from medfl.plugins import lookup
        from medfl.rundir import recorded_backend

        name, record = recorded_backend(top)
        launch = self.settings.launch or record.get("launch", "")
        return lookup("backend", name)().resume_command(top, {**record, "launch": launch})

    def prepare(self, resume: bool = False, read_only: bool = False) -> None:
        """As :meth:`Run.prepare`, then open a session: a run id the sites key their state by
        (new for a fresh run, kept on resume, in ``flower.json``), and wait up to
        ``connect_timeout`` for a node serving every client.

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
            self.sites.pins = parse_pins(meta["site_nodes"], f"{meta_path} site_nodes")
            logger.info(f"medfl: clients are served only by the nodes registered for them ({meta_path})")
        write_json(meta_path, meta)
        t0 = time.monotonic()
        ids = self.federation.eval_client_ids
        self._await_sites(ids, len(ids), t0 + self.settings.connect_timeout, t0)
        missing = [c for c in ids if c not in self.sites.nodes]
        self._log({"phase": "connect", "status": "ok" if not missing else "missing " + " ".join(missing),
                   "seconds": time.monotonic() - t0})
        self._flush_events()
        if missing:
            refused = "".join(f"; refused {why}" if why.startswith(("node", "site")) else f"; refused node {n}: {why}"
                              for n, why in sorted(self.sites.refused.items()))
            hint = self.transport.connect_hint
            error = (f"no {self.terms['node']} serves client(s) {missing} after {time.monotonic() - t0:.0f} s "
                     f"(connected: {sorted(self.sites.nodes)}){refused}; "
                     f"{hint if hint is not None else self.connect_advice(missing)}")
            self._not_started(error, resume)
            raise RunError(error)

    def connect_advice(self, missing: list[str]) -> str:
        """What the connect error of a deployment says after the clients ``missing``: which
        sites registered at the hub (client and node ids; a node that registered but had not
        answered medfl's hello, a site still starting), the ``connect-timeout`` it waited and
        how to raise it, and whether no site registered at all (start one per client) or the
        others are late or missing."""
        try:
            online = sorted(set(self.transport.nodes()))
        except Exception:  # noqa: BLE001 - the hub's own trouble; the advice goes without it
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

    def _await_sites(self, ids: list[str], enough: int, deadline: float, t0: float, what: str = "") -> list[str]:
        """Wait until ``deadline`` (``time.monotonic()``) for nodes serving at least
        ``enough`` of the clients ``ids`` (new nodes, and nodes lost earlier, are asked for
        their hello), saying every ``progress_interval`` seconds which clients have no site yet
        (``what``: what is waiting, e.g. ``round 3 (train): ``); return the clients still
        without a node."""
        waited = False
        while True:
            left = max(0.0, deadline - time.monotonic())
            self.sites.refresh(need=ids, enough=enough,
                               timeout=min(left, max(self.settings.progress_interval, 0.1)))
            missing = [c for c in ids if c not in self.sites.nodes]
            if len(ids) - len(missing) >= enough or self.sites.settled() or time.monotonic() >= deadline:
                break
            waited = True
            nodes = len(self.transport.nodes())
            logger.info(f"medfl: {what}waiting for sites ({time.monotonic() - t0:.0f} of {deadline - t0:.0f} s): "
                        f"no site serves client(s) {', '.join(missing)} yet; "
                        f"connected: {', '.join(c for c in ids if c in self.sites.nodes) or 'none'} "
                        f"({nodes} {self.terms['node']}(s) registered)")
        if waited and len(ids) - len(missing) >= enough:
            who = "every site" if not missing else f"{len(ids) - len(missing)} of {len(ids)} sites"
            logger.info(f"medfl: {what}{who} connected after {time.monotonic() - t0:.0f} s")
        return missing

    def _await_quorum(self, r: int, phase: str, ids: list[str]) -> None:
        """Before an exchange with the clients ``ids``: when fewer of them have a node than
        :func:`~medfl.engine.screening.sites_needed` asks for, ask the lost nodes for their
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
        logger.warning(f"medfl: round {r} ({phase}): {len(have)} of {len(ids)} sites available, {need} needed "
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

        Returns the answers of the clients that answered in time, in the engine's client
        order; a client without a node, one whose node is lost and one that has not answered
        within ``round_timeout`` are left out (and logged).

        Enough sites (:func:`~medfl.engine.screening.sites_needed`) are waited for before
        sending (:meth:`_await_quorum`) and, when fewer answered, the sites that timed out or
        were lost are waited for and sent the same content again (:meth:`_await_return`; a
        site computes the same answer again, its state versioned by round; not SecAgg+'s
        stages, whose masks belong to one exchange); what is still missing after that fails
        the round (:meth:`Run.check_quorum`).

        Every message sent is recorded in :attr:`traffic` under ``phase`` with the encoded
        size of its content and of the answer's (:func:`medfl.wire.encoded_size`; a client
        that did not answer counts its request only; one without a node was sent nothing).

        An answer larger than :meth:`reply_limit` (``releases``: the clients asked for a
        per-sample release in this exchange) is refused like a bad reply, with its size.
        A site that answers with an error (it raised: its plugin failed, it refused an
        unapproved method) is dropped like a bad reply (:meth:`Run.refuse`: an event,
        exclusion after ``max_reply_failures``), so one site cannot stop the run.

        ``counted_as``: the traffic phase when it is not ``phase`` (SecAgg+'s key-exchange
        stages count as ``secagg``); ``controlled``: the answers carry medfl's control record
        naming the client (SecAgg+'s key-exchange answers carry only its record).

        Raises:
            SiteFailure: every site asked answered with an error (each one's reason quoted).
            TooFewSites: too few sites are available before sending, after ``fl.site_wait_s``.
        """
        self.sites.refresh()
        ids = client_order(outgoing)
        self._await_quorum(r, phase, ids)
        t0 = time.monotonic()
        need = sites_needed(len(ids), self.config)
        secure = self.secure is not None and message_type == P.TRAIN   # SecAgg+'s stages
        again = controlled and not secure
        replies: dict[str, Content] = {}
        failed: dict[str, str] = {}     # sites that answered with an error -> what it said
        settled: set[str] = set()       # sites that answered (accepted, refused or with an error)
        asked: list[str] = []           # sites sent the content at least once
        todo, until = ids, None
        while True:
            sent = self._send(r, phase, message_type, {c: outgoing[c] for c in todo}, releases, counted_as,
                              controlled, secure, replies, failed, settled)
            asked += [c for c in sent if c not in asked]
            short = [c for c in ids if c not in settled]   # timed out, lost or without a node
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
        lost: asked for their hello again), then up to ``hello_timeout`` more for the rest of
        them; return those that have one, to send the exchange to again (none: too few came
        back)."""
        t0 = time.monotonic()
        self._log({"round": r, "phase": phase, "status": f"waiting: {len(short)} site(s) missing ({' '.join(short)}), "
                                                         f"{more} more needed ({quorum_rule(self.config)})"})
        logger.warning(f"medfl: round {r} ({phase}): too few sites answered, {more} more needed "
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
        logger.info(f"medfl: round {r} ({phase}): sending it again to client(s) {', '.join(back)}")
        return back

    def _send(self, r: int, phase: str, message_type: str, outgoing: dict[str, Content],
              releases: frozenset[str] | set[str], counted_as: str | None, controlled: bool, secure: bool,
              replies: dict[str, Content], failed: dict[str, str], settled: set[str]) -> list[str]:
        """One round trip of :meth:`exchange`: send each client of ``outgoing`` that has a
        node its content, collect the answers for up to ``round_timeout`` seconds into
        ``replies`` (accepted), ``failed`` (the site's errors) and ``settled`` (every client
        that answered, refused ones included), record the traffic; return the clients sent to."""
        t0 = time.monotonic()
        by_msg, sent_at, size_to = self._post(r, phase, message_type, outgoing, secure)
        size_from: dict[str, int] = {}
        deadline = t0 + self.settings.round_timeout
        while by_msg and time.monotonic() < deadline:
            for answer in self.transport.receive(list(by_msg)):
                cid = by_msg.pop(answer.to, None)
                if cid is None:
                    continue
                node = self.sites.nodes.get(cid)
                event = {"round": r, "phase": phase, "client_id": cid, "node_id": node,
                         "seconds": time.monotonic() - sent_at[cid]}
                if answer.content is None and answer.lost:
                    self._log({**event, "status": f"dropped ({answer.error})"})
                    self.sites.drop(cid)
                    continue
                settled.add(cid)
                if answer.content is None:
                    self._log({**event, "status": "failed"})
                    failed[cid] = f"site {cid} failed in {phase} of round {r} ({self.terms['name']}): {answer.error}"
                    continue
                got = answer.content
                try:
                    ctl = wire.take_json(got, P.CONTROL, f"{phase} reply of site {cid}") if controlled else {"client": cid}
                    if str(ctl.get("client")) != cid:
                        raise WireError(f"{phase} reply of node {node}: answered as client {ctl.get('client')!r}, "
                                        f"but serves client {cid!r} for this run")
                except UNDECODABLE as exc:
                    self._log({**event, "status": "refused"})
                    self.refuse(r, cid, f"{phase}: {exc}")
                    continue
                size_from[cid] = wire.encoded_size(got)
                limit = self.reply_limit(cid, size_to[cid], cid in releases)
                if size_from[cid] > limit:
                    self._log({**event, "status": "refused (size)"})
                    self.refuse(r, cid, f"{phase}: the answer of site {cid} is {size_from[cid] / 2**20:.1f} MiB, "
                                        f"more than the {limit / 2**20:.1f} MiB it can need (max-reply-mb)")
                    continue
                replies[cid] = got
                self._log({**event, "status": "ok"})
            if by_msg:
                self.settings.pause()
        for cid in by_msg.values():
            self._log({"round": r, "phase": phase, "client_id": cid, "node_id": self.sites.nodes.get(cid),
                       "status": "timeout", "seconds": time.monotonic() - sent_at[cid]})
            logger.warning(f"medfl: round {r}: site {cid} did not answer {phase} within "
                           f"{self.settings.round_timeout:.0f} s; left out")
            self.sites.drop(cid)
        for cid in sent_at:
            self.traffic.add(r, cid, counted_as or phase, size_to[cid], size_from.get(cid, 0))
        return list(sent_at)

    def _post(self, r: int, phase: str, message_type: str, outgoing: dict[str, Content],
              secure: bool) -> tuple[dict[str, str], dict[str, float], dict[str, int]]:
        """Send each client of ``outgoing`` that has a node its content (:meth:`_send`); return
        the client of each message id, when each client's message left, in the clients' order,
        and the encoded bytes for each. A client without a node, or whose node the hub refused
        the message for (the node left; it is dropped), is logged and not sent to."""
        by_msg: dict[str, str] = {}
        sent_at: dict[str, float] = {}
        msgs, order = [], []
        size_to: dict[str, int] = {}
        for cid in client_order(outgoing):
            node = self.sites.nodes.get(cid)
            if node is None:
                self._log({"round": r, "phase": phase, "client_id": cid, "status": "absent"})
                continue
            size_to[cid] = wire.encoded_size(outgoing[cid])
            msgs.append(Outgoing(node, message_type, outgoing[cid], str(r), self.settings.round_timeout + 60.0, secure))
            order.append(cid)
        for cid, mid in zip(order, self.transport.send(msgs)):
            if not mid:
                # the hub did not take it: the node left since its hello (a SuperNode that
                # stopped on an error of the SuperLink unregisters itself)
                self._log({"round": r, "phase": phase, "client_id": cid, "node_id": self.sites.nodes.get(cid),
                           "status": f"unavailable (the {self.terms['hub']} refused the message: the node left)"})
                self.sites.drop(cid)
                continue
            by_msg[mid] = cid
            sent_at[cid] = time.monotonic()
        return by_msg, sent_at, size_to

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


def remote_run_factory(transport: Transport | Callable[[Log], Transport], settings: RemoteSettings | None) -> Any:
    """The runner's ``run_factory`` building :class:`RemoteRun` on ``transport`` (a function
    of a run's event log that builds one: one transport per run)."""
    def build(cfg: dict[str, Any], spec: dict[str, Any], run_dir: Path, data: FederatedData) -> RemoteRun:
        return RemoteRun(cfg, spec, run_dir, data, transport, settings)
    return build
