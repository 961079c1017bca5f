"""Who takes part in an exchange of a run, and which replies the coordinator takes: the
clients each exchange addresses (``fl.absences``, exclusion after ``max_reply_failures``),
the screening of every reply before the method sees it (:meth:`Screening.screen`: declared
names, NaN/inf, state shapes, update norms) with a row in ``reply_events.csv`` for each one
dropped, and the quorum a round needs (:func:`sites_needed`).

:class:`Screening` is a part of the engine's :class:`~medfl.engine.runner.Run` (a mixin): its
methods use the run's ``config``, ``coordinator``, ``federation``, ``privacy``, ``files`` and
bookkeeping, and a transport's run (:class:`medfl.engine.remote.RemoteRun`) overrides them
as it overrides the run's.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Iterable

import numpy as np
import pandas as pd
import torch

from medfl import wire
from medfl.engine.client import first_non_finite, payload_problem, release_exemptions, reported_problem
from medfl.engine.data import client_order
from medfl.messages import RELEASE_FLAG, Instruction, PayloadError, Reply, state_mismatch
from medfl.method import derive_seed
from medfl.privacy.feature_release import RELEASE_METRICS
from medfl.privacy.releases import asked_releases
from medfl.rundir import RunError

__all__ = ["Screening", "update_norm", "TooFewSites", "sites_needed", "quorum_rule"]

logger = logging.getLogger(__name__)


def update_norm(reply: Reply, instruction: Instruction, reply_state: dict[str, str | None]) -> float | None:
    """The L2 norm of a reply's update: its model state (each ``reply_state`` entry with a
    reference in ``instruction``) minus the state the client was sent, over the floating
    tensors both hold with the same shape; ``None`` when no entry has a reference (nothing
    to measure the update against)."""
    squares: list[torch.Tensor] = []   # summed where they lie, read once (one wait for a GPU)
    for key, ref_key in reply_state.items():
        ref = instruction.payload.get(ref_key) if ref_key else None
        new = reply.payload.get(key)
        if not isinstance(ref, dict) or not isinstance(new, dict):
            continue
        for name, value in new.items():
            old = ref.get(name)
            if (isinstance(value, torch.Tensor) and value.is_floating_point() and isinstance(old, torch.Tensor)
                    and old.shape == value.shape):
                diff = value.detach().double() - old.detach().to(value.device).double()
                squares.append(diff.square().sum())
    if not squares:
        return None
    return math.sqrt(float(torch.stack([q.to(squares[0].device) for q in squares]).sum()))


def _finite_number(value: Any) -> bool:
    """Whether a reported value is a finite number (a one-element tensor counts as its value)."""
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, RuntimeError):
        return False


class TooFewSites(RunError):
    """A round had fewer sites than ``fl.min_sites`` / ``fl.min_fraction`` ask for (fewer
    answered its training or evaluation, or, over Flower, fewer were available after
    ``fl.site_wait_s``): the run fails (status ``failed``, resumable from its last
    checkpoint) rather than go on, or finish, without its sites."""


def sites_needed(addressed: int, cfg: dict[str, Any]) -> int:
    """The fewest sites whose answers an exchange addressed to ``addressed`` sites needs: the
    larger of ``fl.min_sites`` (default 1) and ``fl.min_fraction`` of ``addressed`` (rounded
    up; null: unused), never more than ``addressed`` (0 when none is addressed). The one rule
    of the in-process engine (:meth:`Run.check_quorum`) and of Flower's coordinator, which
    waits for that many sites before it sends and, when fewer answered, for the missing ones
    to come back (:meth:`medfl.engine.remote.RemoteRun.exchange`)."""
    fraction = cfg.get("min_fraction")
    want = max(int(cfg.get("min_sites", 1)), math.ceil(float(fraction) * addressed - 1e-9) if fraction else 0)
    return min(int(addressed), want)


def quorum_rule(cfg: dict[str, Any]) -> str:
    """The settings behind :func:`sites_needed`, as an error message names them."""
    rule = f"fl.min_sites {int(cfg.get('min_sites', 1))}"
    return rule + (f", fl.min_fraction {cfg['min_fraction']}" if cfg.get("min_fraction") else "")


def _absence_schedule(schedule: dict[str, dict[str, list[str]]] | None, clients: list[str]
                      ) -> dict[str, dict[str, list[str]]]:
    """``fl.absences`` as resolved by :func:`medfl.config.check_absences` (``{}`` without
    one), its client ids checked against the run's partition.

    Raises:
        RunError: a client id that is not one of the partition's, naming where it is listed.
    """
    for r, phases in (schedule or {}).items():
        for phase, ids in phases.items():
            unknown = [c for c in ids if c not in clients]
            if unknown:
                raise RunError(f"fl.absences[{r}].{phase}: client(s) {unknown} are not in this run's partition "
                               f"(clients {', '.join(client_order(clients))})")
    return dict(schedule or {})


class Screening:
    """The run's screening of replies, exclusion of clients and quorum (a mixin of
    :class:`~medfl.engine.runner.Run`, whose ``__init__`` sets the state it keeps:
    ``_failures``, ``_excluded``, ``absences``, ``_checked_finite``, ``_step``)."""

    def check_quorum(self, r: int, phase: str, addressed: list[str], answered: list[str]) -> None:
        """Fail round ``r`` when fewer of the ``addressed`` sites took part in ``phase``
        (``answered``: those whose answers the method received) than :func:`sites_needed`
        asks for (``fl.min_sites``, ``fl.min_fraction``): a site excluded after
        ``max_reply_failures``, refused, timed out or absent does not count.

        Raises:
            TooFewSites: naming the round, how many sites answered and the minimum; the run
                is then marked ``failed`` and resumes from its last checkpoint.
        """
        need = sites_needed(len(addressed), self.config)
        if len(answered) >= need:
            return
        missing = [cid for cid in client_order(addressed) if cid not in answered]
        excluded = [cid for cid in missing if cid in self._excluded]
        raise TooFewSites(
            f"round {r}: {len(answered)} of {len(addressed)} sites answered {phase} (missing: {', '.join(missing)}"
            + (f"; excluded after max_reply_failures: {', '.join(excluded)}" if excluded else "")
            + f"), the round needs at least {need} ({quorum_rule(self.config)}); the run stops here rather than "
            f"go on without its sites; once they are back, continue with: {self.resume_command(self._top())}")

    # ------------------------------------------------------------------ untrusted replies
    def unfilter(self, r: int, instructions: dict[str, Instruction], replies: dict[str, Reply]
                 ) -> dict[str, Reply]:
        """Undo the run's reply filters on each reply (dequantize, add back the state the
        client was sent...) so the method receives full states, whatever the transport. A
        reply the chain cannot have filtered (tensors outside the method's ``reply_state``
        while a ``reply_state`` key is missing: :meth:`FilterChain.check_covered`) is dropped
        with the client named, as a reply that fails :meth:`screen`; so is a reply the chain
        cannot undo (codes of another width, a NaN where a range was expected: what a
        changed site may send), instead of stopping the run.
        """
        chain = self.privacy.chain
        for cid, reply in list(replies.items()):
            self.privacy.note_reply(reply.payload)
            train = self.privacy.client_train(cid)
            if asked_releases(self.coordinator, chain, train, instructions[cid]):   # a DP release: journaled
                self.journal.note(r, self._step, cid, chain.specs(), train.get("dp"), reply.payload)
            if not chain:
                continue
            try:
                reply.payload = chain.undo(type(self.coordinator), reply.payload, instructions[cid].payload,
                                           client_id=cid, round=r, step=self._step,
                                           seed=derive_seed(self.federation.seed, r, cid),
                                           model_spec=self.federation.model_spec(cid),
                                           where=f"reply of client {cid} in round {r}",
                                           exempt=release_exemptions(self.coordinator, instructions[cid]))
            except PayloadError as exc:   # not what the chain produces: a site's garbage
                self.refuse(r, cid, str(exc))
                del replies[cid]
        return replies

    def screen(self, r: int, instructions: dict[str, Instruction], replies: dict[str, Reply]) -> dict[str, Reply]:
        """Check every reply against what the coordinator expects before the method sees it;
        drop one that fails from the round (the others go on, as for a client that timed
        out) with a row in ``reply_events.csv`` naming the client and the reason, and exclude
        a client from later rounds once ``max_reply_failures`` of its replies failed."""
        kept: dict[str, Reply] = {}
        for cid, reply in replies.items():
            reason = self.reply_problem(cid, instructions[cid], reply)
            if not reason:
                kept[cid] = reply
                continue
            self.refuse(r, cid, reason)
        for cid, reason in self.norm_outliers(instructions, kept).items():
            self.refuse(r, cid, reason)
            del kept[cid]
        return kept

    def norm_outliers(self, instructions: dict[str, Instruction], replies: dict[str, Reply]) -> dict[str, str]:
        """The replies of one training step whose update (:func:`update_norm`: the model state
        minus the state sent) is longer than ``fl.update_norm_factor`` times the median
        update norm of the step's replies in the same group, each with a reason that gives its
        norm and the bound, as robust aggregators bound updates (a site scaling its weights by
        1e6 would otherwise drag the mean). The groups are the method's
        :meth:`~medfl.method.Method.client_groups` (one group when it names none): clients of
        different groups may train different models with different noise (PFedCDP's clusters;
        its ``authors_v1_7`` preset noises model B's weights only, whose updates are hundreds of
        times longer than the clear clusters'), so their norms are not compared. The median of
        one reply is its own norm and a median of two is their mean, which neither exceeds
        twice: with a factor >= 2 (the least allowed) a group needs three replies in the step
        before one can be dropped. Nothing is bounded when the factor is 0, when the median is 0
        (no update to compare with), or under secure aggregation (the coordinator never sees a
        single update)."""
        factor = float(self.config.get("update_norm_factor", 0) or 0)
        if not factor or self.secure_aggregation() is not None:
            return {}
        state = type(self.coordinator).reply_state
        norms = {cid: n for cid, reply in replies.items()
                 for n in [update_norm(reply, instructions[cid], state)] if n is not None}
        groups = self.coordinator.client_groups() or {}
        by_group: dict[str, dict[str, float]] = {}
        for cid, n in norms.items():
            by_group.setdefault(str(groups.get(cid, "")), {})[cid] = n
        out: dict[str, str] = {}
        for group, members in by_group.items():
            if len(members) < 3:
                continue
            median = float(np.median(list(members.values())))
            bound = factor * median
            if not median > 0:
                continue
            where = f"the step's {len(members)} replies" + (f" of group {group!r}" if group else "")
            out.update({cid: (f"update norm {n:.6g} is above the bound {bound:.6g} (fl.update_norm_factor {factor:g} "
                              f"x the median update norm {median:.6g} of {where})")
                        for cid, n in members.items() if n > bound})
        return out

    def screen_scores(self, r: int, exchange: str, instructions: dict[str, Instruction],
                      scores: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """The scalars of a validation or profile exchange (``exchange``) whose names the
        method declared (:func:`~medfl.engine.client.reported_problem`); a client's answer
        with another name is dropped as a reply that fails :meth:`screen` (whatever the
        transport: a site may send anything)."""
        kept: dict[str, dict[str, float]] = {}
        for cid, values in scores.items():
            reason = reported_problem(self.coordinator, exchange, instructions[cid], values)
            if reason:
                self.refuse(r, cid, f"{exchange}: {reason}")
            else:
                kept[cid] = values
        return kept

    def refuse(self, r: int, cid: str, reason: str) -> None:
        """Drop a reply of ``cid`` from round ``r`` (a row in ``reply_events.csv``) and exclude
        the client from later rounds once ``max_reply_failures`` of its replies were refused:
        for the engine's checks (:meth:`screen`) and a transport's (a Flower message that
        cannot be decoded)."""
        self._failures[cid] = self._failures.get(cid, 0) + 1
        self._reply_event(r, cid, "dropped", reason)
        limit = int(self.config.get("max_reply_failures", 3))
        if limit and self._failures[cid] >= limit and cid not in self._excluded:
            self._excluded.add(cid)
            self._reply_event(r, cid, "excluded", f"{self._failures[cid]} replies failed the checks "
                                                  f"(max_reply_failures {limit}); no further instructions")

    def reply_problem(self, cid: str, instruction: Instruction, reply: Reply) -> str:
        """Why the coordinator cannot take ``reply`` from ``cid`` ("" when it can): metric
        names the method did not declare or a ``num_examples`` other than the one it declares
        for the client's training split (:func:`~medfl.engine.client.reported_problem`), payload
        keys other than those it declares (:func:`~medfl.engine.client.payload_problem`: a
        reply without its model, an extra tensor), NaN or infinite values in the metrics or
        anywhere in the payload, a model state (the method's ``reply_state``) whose keys,
        shapes or dtypes differ from the state the client was sent, or the method's own
        :meth:`~medfl.method.Method.check_reply`. In process, a payload that the client step
        checked for NaN on its way out and that nothing replaced or changed since
        (:class:`medfl.wire.ContentSnapshot`) is not walked a second time."""
        problem = reported_problem(self.coordinator, "train", instruction, reply.metrics, reply.num_examples,
                                   int(self.federation.num_examples.get(cid, 0)))
        if not problem and self.secure_aggregation() is None:   # under SecAgg+ the payload travels masked
            problem = payload_problem(self.coordinator, instruction, reply.payload)
        if problem:
            return problem
        # medfl's record of a release it performed may say inf (epsilon of a noiseless release)
        record = frozenset(RELEASE_METRICS) if instruction.config.get(RELEASE_FLAG) is True else frozenset()
        bad = [k for k, v in reply.metrics.items() if k not in record and not _finite_number(v)]
        if bad:
            return f"metrics[{bad[0]!r}] holds NaN or infinite values"
        checked = self._checked_finite.pop(cid, None)
        if checked is None or not checked.unchanged(reply.payload):
            bad = first_non_finite(reply.payload)
            if bad:
                return f"payload{bad} holds NaN or infinite values"
        for key, ref_key in type(self.coordinator).reply_state.items():
            ref = instruction.payload.get(ref_key) if ref_key else None
            if isinstance(ref, dict) and key in reply.payload:
                problem = state_mismatch(reply.payload[key], ref, f"payload[{key!r}]")
                if problem:
                    return problem
        return str(self.coordinator.check_reply(cid, instruction, reply) or "")

    def _reply_event(self, r: int, cid: str, status: str, reason: str) -> None:
        """Say on stderr and in ``reply_events.csv`` that ``cid``'s reply of round ``r`` was
        ``status`` (``dropped``, ``excluded``) and why."""
        logger.warning(f"medfl [{self.label}] round {r}: reply of client {cid} {status}: {reason}")
        self.files.append_rows("reply_events.csv", pd.DataFrame([{"round": r, "step": self._step, "client_id": cid,
                                                                  "status": status, "reason": reason}]))

    def asked(self, r: int, phase: str, ids: Iterable[str]) -> list[str]:
        """The clients of ``ids`` that exchange ``phase`` (``train``, ``validate``,
        ``evaluate``) of round ``r`` addresses, in the engine's order: not those excluded by
        ``max_reply_failures``, nor those ``fl.absences`` keeps out of it, each of which is
        recorded with :meth:`record_absence`. In process and over Flower alike, who is asked is
        decided here, so a scripted absence is what a site that dropped out of that exchange
        is: not in the round's replies (``server_update`` sees the others) or evaluation rows."""
        absent = set(self.absences.get(str(r), {}).get(phase, ()))
        out = []
        for cid in client_order(ids):
            if cid in self._excluded:
                continue
            if cid in absent:
                self.record_absence(r, phase, cid)
                continue
            out.append(cid)
        return out

    def record_absence(self, r: int, phase: str, cid: str) -> None:
        """Note that ``fl.absences`` kept ``cid`` out of ``phase`` of round ``r``; in process
        the missing rows of ``train_metrics.csv``/``metrics.csv`` are the record (a Flower run
        adds an ``absent (scheduled)`` row to ``flower_events.csv``)."""

    def check_uncovered(self, instructions: dict[str, Instruction], r: int) -> None:
        """Before round ``r``'s ``instructions`` are sent: under DP on the model (a DP filter,
        DP-SGD, the method's own DP), a reply entry the method declares beside its model state
        (:func:`medfl.config.uncovered_keys`) would leave in the clear; without the opt-in
        ``fl.uncovered_entries`` the run stops here, before anything is sent, and with it the
        run records it as sent in the clear (``"private": false``).

        Raises:
            PrivacyConfigError: naming the method, the entries and the opt-in.
        """
        from medfl.config import ConfigError, uncovered_in_clear, uncovered_keys
        from medfl.privacy.accounting import PrivacyConfigError

        p = self.privacy
        if not (p.chain.releases() or p.dp_sgd is not None or p.own is not None):
            return
        for ins in instructions.values():
            keys = uncovered_keys(self.coordinator, ins)
            if keys:
                try:
                    p.send_in_clear(uncovered_in_clear(self.config, keys, self.coordinator,
                                                       f"method {self.label!r}, round {r}"))
                except ConfigError as exc:
                    raise PrivacyConfigError(str(exc)) from None

    def _without_excluded(self, instructions: dict[str, Instruction], r: int, phase: str) -> dict[str, Instruction]:
        """``instructions`` for the clients :meth:`asked` in ``phase`` of round ``r``."""
        return {cid: instructions[cid] for cid in self.asked(r, phase, instructions)}

    def _addressed(self, instructions: dict[str, Instruction], allowed: list[str], r: int, hook: str) -> None:
        """Refuse ``instructions`` (of the method's ``hook`` in round ``r``) addressed to a
        client outside ``allowed``.

        Raises:
            RunError: naming the unknown clients.
        """
        unknown = sorted(set(instructions) - set(allowed))
        if unknown:
            raise RunError(f"method {self.label!r} addressed unknown client(s) {unknown} in {hook} of round {r}")
