"""A run's exchanges with its clients in process: every client runs in this process, one at
a time, its context built here (:func:`client_context`) and its state loaded from and saved
to ``clients/``; each message is measured as a deployment sends it (:func:`medfl.wire.encoded_size`,
``communication.csv``) with the control fields a deployment sends (:meth:`Exchanges._control`).

:class:`Exchanges` is a part of the engine's :class:`~medfl.engine.runner.Run` (a mixin):
:meth:`Exchanges.update_clients`, :meth:`Exchanges.validate_clients` and
:meth:`Exchanges.profile_clients` are the transport seam a transport's run
(:class:`medfl.engine.remote.RemoteRun`) overrides to reach sites instead.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Iterator

from tqdm.auto import tqdm

from medfl import wire
from medfl.context import ClientContext
from medfl.engine.client import run_client_profile, run_client_update, run_client_validate
from medfl.engine.data import POOLED, FederatedData, client_order
from medfl.engine.store import ClientStore
from medfl.logs import Throttle, progress_bar_disabled
from medfl.messages import Instruction, Reply
from medfl.method import derive_seed
from medfl.privacy.ledger import planned_releases

__all__ = ["Exchanges", "client_context", "ROLES", "PLACEHOLDER_ID", "RoundBar", "RoundProgress", "PROGRESS_EVERY_S",
           "rounds_span"]

logger = logging.getLogger(__name__)

#: The shortest time between two INFO lines of progress inside a round, in seconds; every
#: other client's line is DEBUG (in ``log.txt`` under the ``medfl`` command, on the console
#: with ``-v``), so a 100-client round of a CI log says where it is without a line per client.
PROGRESS_EVERY_S = 30.0

#: The roles of the datasets in a client's context (a pooled client has no global test).
ROLES = ["train", "val", "test", "global_test"]

#: The run and session ids of an in-process run's control fields: placeholders as long as
#: the ``uuid4().hex`` ids a Flower run sends, so the measured messages have Flower's size.
PLACEHOLDER_ID = "0" * 32


def rounds_span(first: int, last: int) -> str:
    """``"round 3"`` or ``"rounds 3-5"``: the rounds a run trains now, for its progress line."""
    return f"round {first}" if last == first else f"rounds {first}-{last}"


def client_context(data: FederatedData, client_id: str, round: int, *, run_seed: int, model_spec: dict[str, Any],
                   train: dict[str, Any], device: str, store: ClientStore, state_before: int | None = None,
                   noise_key: str = "", deployed: bool = False, coordinator: str = "") -> ClientContext:
    """``client_id``'s context for ``round`` on the split ``data``, its persistent state
    loaded from ``store``: the newest state saved before round ``state_before`` (default
    ``round + 1``: the latest, including what an earlier step of this round saved).

    Every transport builds contexts here (:meth:`Run.context` in process, a Flower site at
    the site), so the same run seed gives the same numbers. ``noise_key`` is the site's
    secret for privacy noise (:attr:`medfl.context.ClientContext.noise_key`; empty in process);
    ``deployed`` and ``coordinator`` say whether the client runs on its own machine and
    where the coordinator is (a Flower site)."""
    roles = ROLES if client_id != POOLED else ["train", "val", "test"]
    return ClientContext(client_id=client_id, round=round, seed=derive_seed(run_seed, round, client_id),
                         datasets=data.dataset_factories(client_id, roles), model_spec=dict(model_spec),
                         train=dict(train), device=device,
                         state=store.load(client_id, round + 1 if state_before is None else state_before),
                         sample_shape=tuple(data.source.sample_shape),
                         split_sizes=data.sizes(client_id, [r for r in roles if r != "global_test"]),
                         noise_key=noise_key, deployed=deployed, coordinator=coordinator)


class RoundBar:
    """The run's progress over its rounds: a tqdm bar of rounds where stderr is a terminal
    (:func:`medfl.logs.progress_bar_disabled`: none in a redirected stderr, a log file or CI,
    none with ``fl.progress`` false or ``MEDFL_NO_PROGRESS``), and a line per round finished
    (``medfl [fedavg] round 3 of 5 done (2.1 s): local_acc=0.812``) at INFO where progress is
    wanted but no bar is drawn, else at DEBUG (the run's ``log.txt`` has it either way).

    Args:
        rounds: the round numbers to run.
        label: the run's label.
        initial: the rounds done before (a resumed run).
        total: the rounds planned.
        wanted: whether progress may be shown (the config's ``progress``).
    """

    def __init__(self, rounds: Iterable[int], label: str, initial: int, total: int, wanted: bool = True) -> None:
        disable = progress_bar_disabled(wanted)
        self.label, self.total, self.post = label, total, ""
        self.bar = tqdm(rounds, desc=label, unit="round", disable=disable, leave=True, initial=initial, total=total)
        self.level = logging.INFO if disable is None and self.bar.disable else logging.DEBUG

    def __iter__(self) -> Iterator[int]:
        for r in self.bar:
            t0 = time.perf_counter()
            self.post = ""
            yield r
            logger.log(self.level, f"medfl [{self.label}] round {r} of {self.total} done "
                                   f"({time.perf_counter() - t0:.1f} s){': ' + self.post if self.post else ''}")

    def set_postfix(self, post: dict[str, str]) -> None:
        """The round's numbers, on the bar and in its line (``{"local_acc": "0.812"}``)."""
        self.post = ", ".join(f"{k}={v}" for k, v in post.items())
        self.bar.set_postfix(post)

    def close(self) -> None:
        """The rounds ended (the bar stays on the terminal)."""
        self.bar.close()


class RoundProgress:
    """Progress of one round's training exchange, client by client: a tqdm bar under the
    round's bar where stderr is a terminal (none in a log file or CI: tqdm's ``disable=None``;
    none with ``fl.progress`` false or ``MEDFL_NO_PROGRESS``),
    and a line per client trained (``round r: client c trained (k/n, 12.3 s)``) at DEBUG, or
    INFO when :data:`PROGRESS_EVERY_S` seconds have passed since the round began or the last
    INFO line (:class:`medfl.logs.Throttle`).

    Args:
        label: the run's label.
        r: the round.
        n: how many clients train in it.
        bar: whether a terminal bar may be drawn (the config's ``progress``).
    """

    def __init__(self, label: str, r: int, n: int, bar: bool = True) -> None:
        self.label, self.r, self.n, self.k = label, r, n, 0
        self.throttle = Throttle(PROGRESS_EVERY_S)
        self.bar = tqdm(total=n, desc=f"{label} round {r}", unit="client", leave=False,
                        disable=progress_bar_disabled(bar))
        self.t0 = time.perf_counter()

    def start(self, cid: str) -> None:
        """Client ``cid`` starts training (DEBUG)."""
        logger.debug(f"medfl [{self.label}] round {self.r}: client {cid} training ({self.k + 1}/{self.n})")
        self.t0 = time.perf_counter()

    def done(self, cid: str) -> None:
        """Client ``cid`` finished: the bar moves, and its line is logged."""
        self.k += 1
        seconds = time.perf_counter() - self.t0
        self.bar.update(1)
        level = logging.INFO if self.throttle.due() else logging.DEBUG
        logger.log(level, f"medfl [{self.label}] round {self.r}: client {cid} trained ({self.k}/{self.n} clients, "
                          f"{seconds:.1f} s)")

    def close(self) -> None:
        """The round's exchange ended (the bar goes)."""
        self.bar.close()


class Exchanges:
    """The run's exchanges with its clients, in process (a mixin of
    :class:`~medfl.engine.runner.Run`, whose ``__init__`` sets the ids and bookkeeping its
    messages carry)."""

    def context(self, client_id: str, round: int, state_before: int | None = None) -> ClientContext:
        """Build ``client_id``'s context for ``round`` with its persistent state loaded."""
        return client_context(self.data, client_id, round, run_seed=self.federation.seed,
                              model_spec=self.federation.model_spec(client_id),
                              train=self.privacy.client_train(client_id),
                              device=self.federation.device, store=self.store, state_before=state_before)

    def _control(self, r: int, cid: str, **extra: Any) -> dict[str, Any]:
        """The control fields of a message to client ``cid`` in round ``r`` (the ``medfl``
        record of :mod:`medfl.wire`), plus ``extra``. Over Flower they travel with every
        message; in process they are built only to measure the messages a deployment would
        send, with :data:`PLACEHOLDER_ID` for the run and session ids. With early stopping,
        ``pinned`` lists the older checkpoints the run keeps (best rounds, :meth:`_pins`),
        whose client states a site keeps beside those of ``ckpt`` and later."""
        return {"protocol": wire.PROTOCOL, "run": self.run_id, "session": self.session, "resume": self.resume_round,
                "ckpt": self._prune_to, "round": r, "seed": self.federation.seed, "client": cid, "fold": self.fold,
                "method": self.method_spec, "model": self.federation.model_spec(cid),
                "train": self.privacy.client_train(cid), "filters": self.privacy.chain.specs(), "step": self._step,
                **({"pinned": list(self._pinned)} if self.early is not None else {}),
                **({"releases": self._planned_releases().get(cid, 0), "rounds": int(self.federation.rounds)}
                   if self.privacy.private else {}), **extra}

    def _planned_releases(self) -> dict[str, int]:
        """How many releases the run plans for each client (:func:`medfl.privacy.ledger.planned_releases`),
        sent with every message of a private run with the run's ``rounds``: the plan a site
        checks every request against and projects its epsilon over (:mod:`medfl.budget`,
        :mod:`medfl.policy`)."""
        key = int(self.federation.rounds)
        if self._planned is None or self._planned[0] != key:
            self._planned = (key, planned_releases(self.federation))
        return self._planned[1]

    def _request_sizes(self, r: int, instructions: dict[str, Instruction], **extra: Any) -> dict[str, int]:
        """Encoded size of the message each client of ``instructions`` would be sent
        (:func:`medfl.wire.instruction_request`), measured without copying a tensor
        (:func:`medfl.wire.instruction_request_size`); a value that several clients are sent
        (the global model) is measured once (:class:`medfl.wire.RecordCache`)."""
        cache = wire.RecordCache()
        return {cid: wire.instruction_request_size(self._control(r, cid, **extra), ins, cache)
                for cid, ins in instructions.items()}

    # ------------------------------------------------------------------ the transport seam
    def update_clients(self, r: int, instructions: dict[str, Instruction]) -> dict[str, Reply]:
        """Run ``client_update`` on each addressed client; return the replies received.

        Every client runs in this process, one at a time, its state loaded from and saved to
        ``clients/`` (a transport seam: the module docstring). Each exchange is recorded in
        :attr:`traffic` (``train``) with the sizes of the instruction and reply as a deployment
        sends them; the round's progress, client by client, is logged (:class:`RoundProgress`).
        """
        order = client_order(instructions)
        sent = self._request_sizes(r, {cid: instructions[cid] for cid in order})
        replies: dict[str, Reply] = {}
        self._checked_finite.clear()
        progress = RoundProgress(self.label, r, len(order), bool(self.config.get("progress", True)))
        try:
            for cid in order:
                progress.start(cid)
                reply = run_client_update(self.client_method, self.context(cid, r), instructions[cid],
                                          store=self.store, filters=self.privacy.chain, step=self._step)
                if not self.privacy.chain:   # the payload as run_client_update checked it
                    self._checked_finite[cid] = wire.ContentSnapshot(reply.payload)
                back = wire.train_answer_size(cid, reply.payload, reply.metrics, reply.num_examples)
                self.traffic.add(r, cid, "train", sent[cid], back)
                replies[cid] = reply
                progress.done(cid)
        finally:
            progress.close()
        return replies

    def validate_clients(self, r: int, instructions: dict[str, Instruction]) -> dict[str, dict[str, float]]:
        """Run ``client_validate`` on each addressed client (the validation exchange of
        :meth:`Method.configure_validate`); return each client's scalars. A transport seam
        like :meth:`update_clients`: over Flower, the sites that answered."""
        return self._scalar_clients(r, instructions, run_client_validate, "validate")

    def profile_clients(self, r: int, instructions: dict[str, Instruction]) -> dict[str, dict[str, float]]:
        """Run ``client_profile`` on each addressed client (the profile exchange of
        :meth:`Method.configure_profile`, before round ``r`` = 1); return each client's
        scalars. A transport seam like :meth:`update_clients`."""
        return self._scalar_clients(r, instructions, run_client_profile, "profile", exchange="profile")

    def _scalar_clients(self, r: int, instructions: dict[str, Instruction], step: Callable[..., dict[str, float]],
                        phase: str, **extra: Any) -> dict[str, dict[str, float]]:
        """Run a scalar exchange's client ``step`` on each addressed client, in process,
        recording its messages under ``phase`` (``extra``: the control fields Flower adds)."""
        order = client_order(instructions)
        sent = self._request_sizes(r, {cid: instructions[cid] for cid in order}, **extra)
        out = {}
        for cid in order:
            out[cid] = step(self.client_method, self.context(cid, r), instructions[cid], store=self.store)
            self.traffic.add(r, cid, phase, sent[cid], wire.encoded_size(wire.validate_answer(cid, out[cid])))
        return out
