"""The transport seam of :class:`medfl.engine.remote.RemoteRun`: :class:`RemoteSteps`.

The engine's transport methods (:meth:`~medfl.engine.runner.Run.update_clients`,
:meth:`~medfl.engine.runner.Run.evaluate_clients` and the validation, profile and final
evaluation exchanges) as messages to the sites (:mod:`medfl.wire`) and their answers read back,
checked (tensors and numbers only, nothing shaped like a site's images), into the objects the
method and the run's files receive. Under ``fl.secure_aggregation`` the training step is
SecAgg+'s four stages (:mod:`medfl.flower.secagg`, imported only then).
"""

from __future__ import annotations

import logging
from typing import Any

from medfl import wire
from medfl.engine.client import cross_test_mean, release_exemptions
from medfl.engine.data import client_order
from medfl.engine.remote_sites import UNDECODABLE
from medfl.engine import protocol as P
from medfl.messages import Instruction, PayloadError, Reply, validate_payload
from medfl.wire import Content

__all__ = ["RemoteSteps"]

logger = logging.getLogger(__name__)


def _listed(ctl: dict[str, Any], key: str, where: str) -> list[str]:
    """The list of strings ``ctl[key]`` of a site's control record."""
    value = ctl.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise PayloadError(f"{where}: {key!r} must be a list of names, got {value!r:.80}")
    return value


class RemoteSteps:
    """The transport methods of :class:`medfl.engine.remote.RemoteRun` (a mixin before
    :class:`~medfl.engine.runner.Run`: it uses the run's :meth:`exchange`, sites and settings)."""

    def update_clients(self, r: int, instructions: dict[str, Instruction]) -> dict[str, Reply]:
        """Send every addressed client its instruction as a ``train`` message; return the
        replies of the sites that answered, in the engine's client order, each checked on
        arrival (:meth:`_train_reply`; the site compared it with its own labels and images
        before sending it, :mod:`medfl.guard`)."""
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
        from medfl.flower.secagg import Stage

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
        receives (:meth:`medfl.flower.secagg.SecureRound.as_replies`: none when the round could not be unmasked,
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
        if self.secure is None:
            return None
        from medfl.flower.secagg import describe

        return describe(self.secure.settings)

    def _decode(self, r: int, phase: str, answers: dict[str, Content], decode: Any) -> dict[str, Any]:
        """``decode(cid, content)`` for every answer; one that cannot be decoded (a missing or
        malformed record, a payload the audit rejects) is refused (:meth:`Run.refuse`: dropped
        from the round with a row in ``reply_events.csv``, the site excluded after
        ``max_reply_failures``) and the round goes on with the others."""
        out: dict[str, Any] = {}
        for cid, content in answers.items():
            try:
                out[cid] = decode(cid, content)
            except UNDECODABLE as exc:
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
