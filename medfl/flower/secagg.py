"""Secure aggregation over Flower: Flower's SecAgg+ for the FedAvg family (``fl.secure_aggregation``).

With ``fl.secure_aggregation`` the coordinator of a method that declares
``Method.secure_aggregation`` (FedAvg, FedProx, FedAvgM, FedAdam, FedBN...: their
``server_update`` needs only the ``num_examples``-weighted mean of the clients' model states)
never receives a client's model update: each site masks its quantized, weighted update
(the model it trained minus the model it was sent) with Flower's ``secaggplus_mod``, and the
coordinator unmasks only the sum of the updates of the sites that delivered one.

The site side is Flower's own client code, unchanged: :func:`medfl.flower.proxy.secure_aggregation_mod`
hands every ``train`` message that carries SecAgg+'s configs record to
``flwr.client.mod.secaggplus_mod``, whose collect stage calls medfl's ``train`` handler; under
secure aggregation that handler answers with the update as the mod expects it
(:func:`secure_train_answer`: a ``FitRes``-shaped content the mod quantizes, masks and then
empties of every array), and an empty model payload.

The coordinator side is :class:`SecureAggregation`: the four SecAgg+ stages (Bell et al.,
CCS 2020) driven over medfl's own exchanges (:meth:`medfl.engine.remote.RemoteRun.exchange`:
its timeouts, dropouts, events and byte counts), speaking the mod's message format
(``flwr.common.secure_aggregation.secaggplus_constants``) and reconstructing with Flower's
primitives (Shamir shares, key agreement, the mask generator, dequantization):

``setup``
    every addressed site gets the round's parameters (shares, threshold, clipping and
    quantization ranges, the largest weight) and answers two public keys;
``share_keys``
    each site gets its neighbours' public keys and answers its secrets' Shamir shares,
    encrypted for each neighbour (the coordinator cannot read them);
``collect_masked_vectors``
    the medfl ``train`` instruction plus the shares addressed to the site: the site trains,
    and answers ``[w, w * update]`` quantized and masked (``w``: its ``num_examples`` over
    the round's largest), with its training metrics and ``num_examples`` in the clear;
``unmask``
    each site answers its shares of the private-mask seeds of the sites that delivered a
    vector and of the pairwise-mask keys of those that dropped after sharing; the
    coordinator removes the masks from the sum, never from one site's vector.

A round in which some site has fewer than ``reconstruction_threshold`` neighbours online at a
stage makes no update (the method sees no reply; the event names the stage).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
from flwr.common import bytes_to_ndarray
from flwr.common.secure_aggregation.crypto.shamir import combine_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import generate_shared_key
from flwr.common.secure_aggregation.quantization import dequantize
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.common.secure_aggregation.secaggplus_utils import pseudo_rand_gen
from flwr.supercore.primitives.asymmetric import bytes_to_private_key, bytes_to_public_key

from medfl import wire
from medfl.config import SECURE_AGGREGATION_MODULUS
from medfl.engine.data import client_order
from medfl.training import weighted_average
from medfl.messages import SECURE_AGGREGATE, Instruction, PayloadError, Reply
from medfl.method import Method
from medfl.seeding import derive_seed
from medfl.wire import Arrays, Config, Content, Metrics

__all__ = ["RECORD_KEY_CONFIGS", "Stage", "SecureAggregation", "SecureRound", "secure_layout", "secure_update",
           "secure_train_answer", "describe"]

State = dict[str, torch.Tensor]


# ---------------------------------------------------------------------- both sides
def secure_layout(method: type[Method], reference: dict[str, Any], where: str) -> list[tuple[str, str]]:
    """The ``(reply key, tensor name)`` pairs, in order, that a secure-aggregation reply sums:
    every tensor of every ``reply_state`` entry, named as in the state the instruction sent
    (``reference``: the instruction's payload).

    Raises:
        PayloadError: a ``reply_state`` entry has no reference state in the instruction.
    """
    out: list[tuple[str, str]] = []
    for key, ref_key in sorted(method.reply_state.items()):
        ref = reference.get(ref_key) if ref_key else None
        if not isinstance(ref, dict):
            raise PayloadError(f"{where}: secure aggregation sums updates of the states the clients were sent, but "
                               f"reply entry {key!r} of method {method.name!r} has no state in the instruction "
                               f"(reply_state maps it to {ref_key!r})")
        out.extend((key, name) for name in sorted(ref))
    return out


# ---------------------------------------------------------------------- the site
def secure_update(method: type[Method], payload: dict[str, Any], reference: dict[str, Any], where: str
                  ) -> list[np.ndarray]:
    """At the site: the update (reply minus what was sent, float64) of every tensor of
    :func:`secure_layout`, the vector SecAgg+ masks.

    Raises:
        PayloadError: the reply carries anything besides the ``reply_state`` entries (it would
            be lost, or leave unmasked), or a tensor missing or shaped unlike the one sent.
    """
    layout = secure_layout(method, reference, where)
    extra = sorted(set(payload) - set(method.reply_state))
    if extra:
        raise PayloadError(f"{where}: under secure aggregation a reply carries only its reply_state entries "
                           f"{sorted(method.reply_state)}; method {method.name!r} also replied {extra}")
    out = []
    for key, name in layout:
        got = payload.get(key, {}).get(name) if isinstance(payload.get(key), dict) else None
        ref_key = method.reply_state[key]
        ref = reference[ref_key][name] if ref_key else None
        if not isinstance(got, torch.Tensor) or not isinstance(ref, torch.Tensor) or got.shape != ref.shape:
            raise PayloadError(f"{where}: reply entry {key!r} lacks tensor {name!r} shaped like the one sent")
        out.append((got.detach().cpu().double() - ref.detach().cpu().double()).numpy())
    return out


def secure_train_answer(client: str, update: list[np.ndarray], metrics: dict[str, Any], num_examples: int
                        ) -> Content:
    """A site's answer to a secure-aggregation ``train`` message before ``secaggplus_mod``
    masks it: medfl's answer with an empty payload (metrics and ``num_examples`` as usual),
    plus the ``FitRes`` records the mod reads (the update as ``fitres.parameters``, the weight
    as ``fitres.num_examples``); the mod replaces them with the masked vector and clears every
    array before the answer leaves (the arrays keyed ``"0"``, ``"1"``... as Flower's
    ``parameters_to_arrayrecord`` keys them)."""
    out = wire.train_answer(client, {}, metrics, num_examples)
    out["fitres.parameters"] = Arrays({str(i): a for i, a in enumerate(update)})
    out["fitres.num_examples"] = Metrics({"num_examples": int(num_examples)})
    out["fitres.metrics"] = Config({})
    out["fitres.status"] = Config({"code": 0, "message": "ok"})
    return out


# ---------------------------------------------------------------------- the coordinator
@dataclass
class SecureRound:
    """What one secure-aggregation training step gave the coordinator.

    Attributes:
        replies: each site that delivered a masked vector: its metrics and ``num_examples``
            (the payload is empty: the coordinator never sees a site's update).
        included: the clients whose updates are in :attr:`aggregate`.
        aggregate: the weighted mean of the included clients' ``reply_state`` entries (the
            mean update added to the mean of the states they were sent); ``None`` when the
            round could not be unmasked.
        total_weight: the sum of the included clients' weights (``num_examples``).
        halted: why the round has no aggregate ("" when it has one).
        bytes_masked: the bytes of the masked vectors received (all sites together).
    """

    replies: dict[str, Reply] = field(default_factory=dict)
    included: list[str] = field(default_factory=list)
    aggregate: dict[str, State] | None = None
    total_weight: float = 0.0
    halted: str = ""
    bytes_masked: int = 0

    def as_replies(self, replies: dict[str, Reply]) -> dict[str, Reply]:
        """What the method's ``server_update`` receives: one reply holding the aggregate
        (client id :data:`~medfl.messages.SECURE_AGGREGATE`), or none when the round has no
        aggregate or when a reply of an included client was refused after the sum was formed
        (its update cannot be taken out of it)."""
        if self.aggregate is None or sorted(replies) != sorted(self.included):
            return {}
        return {SECURE_AGGREGATE: Reply(payload=dict(self.aggregate), num_examples=int(round(self.total_weight)))}


#: ``exchange(stage, outgoing contents, counted as, replies carry medfl's control record)``
Exchange = Callable[[str, dict[str, Content], str, bool], dict[str, Content]]


@dataclass
class _Round:
    """One round of :meth:`SecureAggregation.run` at the coordinator: its sites, their
    neighbourhoods and the run's callbacks; the key-exchange stages are its methods, and a
    stage that leaves too few sites says why in ``out.halted``."""

    out: SecureRound
    nodes: dict[str, int]               # client id -> node id
    cid_of: dict[int, str]              # node id -> client id
    neigh: dict[int, set[int]]          # each node's neighbourhood (itself included)
    threshold: int
    where: str
    control: Callable[[str, str], dict[str, Any]]
    exchange: Exchange
    refuse: Callable[[str, str], None]

    def configs(self, cid: str, stage: str, values: dict[str, Any]) -> Content:
        """A key-exchange message to ``cid``: medfl's control record and SecAgg+'s configs."""
        content = Content()
        wire.put_json(content, wire.CONTROL, self.control(cid, stage))
        content[RECORD_KEY_CONFIGS] = Config({Key.STAGE: stage, **values})
        return content

    def ask(self, stage: str, values: dict[int, dict[str, Any]]) -> dict[int, Any]:
        """Send ``stage`` with its configs ``values`` to each node of ``values``; return the
        configs record of each site that answered, by node id (a site without one is refused)."""
        got = self.exchange(stage, {self.cid_of[n]: self.configs(self.cid_of[n], stage, v) for n, v in values.items()},
                            "secagg", False)
        res: dict[int, Any] = {}
        for cid, content in got.items():
            rec = content.get(RECORD_KEY_CONFIGS)
            if not isinstance(rec, Config):
                self.refuse(cid, f"{self.where}: its {stage} answer has no {RECORD_KEY_CONFIGS!r} record")
                continue
            res[self.nodes[cid]] = rec
        return res

    def enough(self, active: set[int], stage: str) -> bool:
        """Whether every site still has ``threshold`` neighbours in ``active`` after ``stage``."""
        short = sorted(self.cid_of[n] for n in self.neigh if len(self.neigh[n] & active) < self.threshold)
        if short:
            self.out.halted = (f"{self.where} halted after {stage}: site(s) {short} have fewer than {self.threshold} "
                               "neighbours online (reconstruction_threshold); no update this round")
        return not short

    def setup(self, cids: list[str], values: dict[str, Any]) -> dict[int, list[bytes]]:
        """Stage 0, ``setup``: the round's parameters out, each site's two public keys back."""
        keys: dict[int, list[bytes]] = {}
        for nid, rec in self.ask(Stage.SETUP, {self.nodes[c]: values for c in cids}).items():
            pk1, pk2 = rec.get(Key.PUBLIC_KEY_1), rec.get(Key.PUBLIC_KEY_2)
            if isinstance(pk1, bytes) and isinstance(pk2, bytes):
                keys[nid] = [pk1, pk2]
            else:
                self.refuse(self.cid_of[nid], f"{self.where}: its setup answer holds no public keys")
        return keys

    def share_keys(self, keys: dict[int, list[bytes]]) -> dict[int, tuple[list[int], list[bytes]]]:
        """Stage 1, ``share_keys``: the neighbours' public keys out, encrypted shares back;
        return, for each site that answered, the sources and ciphertexts addressed to it."""
        got = self.ask(Stage.SHARE_KEYS, {n: {str(m): keys[m] for m in sorted(self.neigh[n] & set(keys))}
                                          for n in sorted(keys)})
        forward: dict[int, tuple[list[int], list[bytes]]] = {n: ([], []) for n in got}
        for src, rec in got.items():
            dsts, texts = rec.get(Key.DESTINATION_LIST, []), rec.get(Key.CIPHERTEXT_LIST, [])
            for dst, text in zip(list(dsts), list(texts)):
                if dst in forward and dst in self.neigh[src]:
                    forward[dst][0].append(src)
                    forward[dst][1].append(text)
        return forward

    def unmask(self, shared: set[int], delivered: set[int]) -> dict[int, list[bytes]] | None:
        """Stage 3, ``unmask``: who delivered a vector out, shares of the masks to remove back;
        return the shares of each site that shared its keys (``None``: too few came back)."""
        dropped = shared - delivered
        got = self.ask(Stage.UNMASK, {n: {Key.ACTIVE_NODE_ID_LIST: sorted(self.neigh[n] & delivered),
                                          Key.DEAD_NODE_ID_LIST: sorted(self.neigh[n] & dropped)}
                                      for n in sorted(delivered)})
        collected: dict[int, list[bytes]] = {n: [] for n in sorted(shared)}
        for src, rec in got.items():
            for owner, share in zip(list(rec.get(Key.NODE_ID_LIST, [])), list(rec.get(Key.SHARE_LIST, []))):
                # a site holds shares of its neighbours only; anything else is not counted
                if owner in collected and owner in self.neigh[src] and isinstance(share, bytes):
                    collected[owner].append(share)
        short = sorted(self.cid_of[n] for n, s in collected.items() if len(s) < self.threshold)
        if short:
            self.out.halted = (f"{self.where} halted after unmask: fewer than {self.threshold} shares came back for "
                               f"site(s) {short}; no update this round")
            return None
        return collected


class SecureAggregation:
    """The coordinator's side of SecAgg+ for one run (module docstring).

    Args:
        settings: the resolved ``fl.secure_aggregation`` (:func:`medfl.config.check_secure_aggregation`).
        seed: the run seed (the neighbour graph of each round is drawn from it).
    """

    def __init__(self, settings: dict[str, Any], seed: int) -> None:
        self.settings = dict(settings)
        self.seed = int(seed)
        self.modulus = SECURE_AGGREGATION_MODULUS

    # ------------------------------------------------------------------ parameters
    def shares_and_threshold(self, n: int) -> tuple[int, int]:
        """The number of shares of each secret and the threshold for a round of ``n`` sites
        (fractions of ``n`` and of the shares, as Flower's workflow reads them)."""
        shares = self.settings["num_shares"]
        if isinstance(shares, float):
            shares = round(shares * n)
            if shares < n and shares % 2 == 0:
                shares += 1     # a ring neighbourhood holds an odd number of sites
            if shares <= 2:
                shares = n
        shares = min(int(shares), n)
        threshold = self.settings["reconstruction_threshold"]
        if isinstance(threshold, float):
            threshold = max(2, round(threshold * shares))
        return shares, int(threshold)

    def neighbours(self, r: int, step: int, nodes: list[int], shares: int) -> dict[int, set[int]]:
        """Each node's neighbourhood (itself included): ``shares`` consecutive nodes of a ring
        in an order drawn from the run seed, round and step."""
        order = sorted(nodes)
        random.Random(derive_seed(self.seed, r, step, "secure_aggregation")).shuffle(order)
        half, n = shares // 2, len(order)
        return {nid: {order[(i + k) % n] for k in range(-half, half + 1)} for i, nid in enumerate(order)}

    # ------------------------------------------------------------------ one round
    def run(self, r: int, step: int, method: type[Method], instructions: dict[str, Instruction],
            nodes: dict[str, int], max_weight: float, request: Callable[[str, Instruction], Content],
            control: Callable[[str, str], dict[str, Any]], exchange: Exchange,
            decode: Callable[[str, Content], Reply], refuse: Callable[[str, str], None]) -> SecureRound:
        """Run the four stages with the sites of ``instructions`` that have a node.

        Args:
            r, step: the round and training step.
            method: the method's class (its ``reply_state``).
            instructions: each addressed client's training instruction.
            nodes: ``{client id: node id}`` of the clients that have a node now.
            max_weight: the largest ``num_examples`` a site may weigh its update with.
            request: ``(client, instruction) -> content`` of medfl's training message.
            control: ``(client, stage) -> control fields`` of a key-exchange message.
            exchange: sends one stage's contents, returns the answers (see :data:`Exchange`).
            decode: medfl's decoding of a training answer (metrics, ``num_examples``).
            refuse: drops a client's reply with a reason (``reply_events.csv``).
        """
        out = SecureRound()
        cids = [c for c in client_order(instructions) if c in nodes]
        if len(cids) < 2:
            out.halted = f"secure aggregation needs at least 2 sites in a round, {len(cids)} can take part"
            return out
        cid_of = {nodes[c]: c for c in cids}
        shares, threshold = self.shares_and_threshold(len(cids))
        if threshold > shares:
            out.halted = (f"reconstruction_threshold {threshold} is more than the {shares} shares of a round with "
                          f"{len(cids)} sites (fl.secure_aggregation)")
            return out
        rnd = _Round(out, nodes, cid_of, self.neighbours(r, step, list(cid_of), shares), threshold,
                     f"secure aggregation of round {r}", control, exchange, refuse)
        keys = rnd.setup(cids, {Key.SAMPLE_NUMBER: len(cids), Key.SHARE_NUMBER: shares, Key.THRESHOLD: threshold,
                                Key.CLIPPING_RANGE: float(self.settings["clipping_range"]),
                                Key.TARGET_RANGE: int(self.settings["quantization_range"]),
                                Key.MOD_RANGE: self.modulus, Key.MAX_WEIGHT: float(max_weight)})
        if not rnd.enough(set(keys), Stage.SETUP):
            return out
        forward = rnd.share_keys(keys)
        shared = set(forward)
        if not rnd.enough(shared, Stage.SHARE_KEYS):
            return out
        first = instructions[cid_of[min(shared)]].payload
        layout = secure_layout(method, first, rnd.where)
        shapes = [(1,)] + [tuple(first[method.reply_state[k] or ""][name].shape) for k, name in layout]
        total, delivered = self._collect(rnd, forward, instructions, request, decode, shapes)
        if total is None or not rnd.enough(delivered, Stage.COLLECT_MASKED_VECTORS):
            return out
        collected = rnd.unmask(shared, delivered)
        if collected is None:
            return out
        total = self._remove_masks(rnd, total, collected, delivered, keys, shapes)
        out.included = client_order([cid_of[n] for n in delivered])
        self._finish(out, total, len(delivered), layout, method, instructions, max_weight)
        return out

    def _collect(self, rnd: _Round, forward: dict[int, tuple[list[int], list[bytes]]],
                 instructions: dict[str, Instruction], request: Callable[[str, Instruction], Content],
                 decode: Callable[[str, Content], Reply], shapes: list[tuple[int, ...]]
                 ) -> tuple[list[np.ndarray] | None, set[int]]:
        """Stage 2, ``collect_masked_vectors``: the training instruction and the shares
        forwarded to each site that shared its keys out, masked vectors back; return their
        sum (``None``: none came) and the nodes that delivered one (their replies in
        ``rnd.out``)."""
        def collect_request(nid: int) -> Content:
            cid = rnd.cid_of[nid]
            content = request(cid, instructions[cid])
            content[RECORD_KEY_CONFIGS] = Config({Key.STAGE: Stage.COLLECT_MASKED_VECTORS,
                                                  Key.CIPHERTEXT_LIST: forward[nid][1],
                                                  Key.SOURCE_LIST: forward[nid][0]})
            return content

        got_msgs = rnd.exchange(Stage.COLLECT_MASKED_VECTORS,
                                {rnd.cid_of[n]: collect_request(n) for n in sorted(forward)}, "train", True)
        total: list[np.ndarray] | None = None
        delivered: set[int] = set()
        for cid, content in got_msgs.items():
            try:
                reply = decode(cid, content)
                if reply.payload:
                    raise PayloadError(f"{rnd.where}: site {cid} sent a model payload beside its masked vector")
                vec = self._masked_vector(content, shapes, f"{rnd.where}: masked vector of site {cid}")
            except (PayloadError, TypeError, ValueError, KeyError) as exc:
                rnd.refuse(cid, str(exc))
                continue
            rnd.out.bytes_masked += sum(a.nbytes for a in vec)
            total = vec if total is None else [(a + b) % self.modulus for a, b in zip(total, vec)]
            rnd.out.replies[cid] = reply
            delivered.add(rnd.nodes[cid])
        return total, delivered

    def _remove_masks(self, rnd: _Round, total: list[np.ndarray], collected: dict[int, list[bytes]],
                      delivered: set[int], keys: dict[int, list[bytes]], shapes: list[tuple[int, ...]]
                      ) -> list[np.ndarray]:
        """The sum of the delivered vectors without their masks, from the shares of
        :meth:`_Round.unmask`: the private mask of each site that delivered, the pairwise
        masks a site that dropped after sharing left in its neighbours' vectors."""
        for nid in sorted(collected):
            secret = combine_shares(collected[nid])
            if nid in delivered:     # its private mask
                total = [(a - m) % self.modulus for a, m in zip(total, pseudo_rand_gen(secret, self.modulus, shapes))]
                continue
            for other in sorted(rnd.neigh[nid] & delivered):   # its pairwise masks in the delivered vectors
                key = generate_shared_key(bytes_to_private_key(secret), bytes_to_public_key(keys[other][0]))
                mask = pseudo_rand_gen(key, self.modulus, shapes)
                sign = 1 if nid > other else -1
                total = [(a + sign * m) % self.modulus for a, m in zip(total, mask)]
        return total

    def _masked_vector(self, content: Content, shapes: list[tuple[int, ...]], where: str) -> list[np.ndarray]:
        """A site's masked vector, checked: one integer array per expected shape, within the modulus."""
        rec = content.get(RECORD_KEY_CONFIGS)
        if not isinstance(rec, Config) or not isinstance(rec.get(Key.MASKED_PARAMETERS), list):
            raise PayloadError(f"{where}: no {Key.MASKED_PARAMETERS!r} in the answer")
        if any(len(ar) for ar in content.values() if isinstance(ar, Arrays)):
            raise PayloadError(f"{where}: the answer carries arrays beside the masked vector")
        vec = [bytes_to_ndarray(b) for b in rec[Key.MASKED_PARAMETERS]]
        if [tuple(a.shape) for a in vec] != [tuple(s) for s in shapes]:
            raise PayloadError(f"{where}: shapes {[a.shape for a in vec][:4]}... where {shapes[:4]}... were expected")
        for a in vec:
            if a.dtype.kind not in "iu" or (a.size and (int(a.min()) < 0 or int(a.max()) >= self.modulus)):
                raise PayloadError(f"{where}: not integers in [0, 2**32)")
        return [a.astype(np.int64) for a in vec]

    def _finish(self, out: SecureRound, total: list[np.ndarray], n: int, layout: list[tuple[str, str]],
                method: type[Method], instructions: dict[str, Instruction], max_weight: float) -> None:
        """Turn the unmasked sum into the weighted mean of the included clients' states."""
        q = int(self.settings["quantization_range"])
        clip = float(self.settings["clipping_range"])
        q_weight, parts = int(total[0].reshape(-1)[0]), total[1:]
        if q_weight <= 0:
            out.halted = "the secure sum's total weight is 0: no site had a training example"
            return
        mean = dequantize(parts, clip, q)
        # each site's quantized vector carries an offset of clip; the sum's dequantization one
        mean = [(a - (n - 1) * clip) * (q / q_weight) for a in mean]
        out.total_weight = q_weight / q * float(max_weight)
        weights = [float(out.replies[cid].num_examples) for cid in out.included]
        bases: dict[str, State] = {}
        for key, ref_key in method.reply_state.items():
            refs = [instructions[cid].payload[ref_key or ""] for cid in out.included]
            # what the included clients were sent: one global model for the FedAvg family
            bases[key] = refs[0] if all(ref is refs[0] for ref in refs) else weighted_average(refs, weights)
        aggregate: dict[str, State] = {key: {} for key in method.reply_state}
        for (key, name), delta in zip(layout, mean):
            ref = bases[key][name]
            value = ref.double() + torch.from_numpy(np.asarray(delta, dtype=np.float64)).reshape(ref.shape)
            aggregate[key][name] = value.to(ref.dtype) if ref.is_floating_point() else value.round().to(ref.dtype)
        out.aggregate = aggregate


def describe(settings: dict[str, Any]) -> dict[str, Any]:
    """The ``secure_aggregation`` entry of a run's privacy blocks (``config.json`` and
    ``summary.json``): what SecAgg+ protects, against whom, and what it does not."""
    return {
        "protocol": "SecAgg+ (Bell et al., CCS 2020): Flower's secaggplus_mod at each site, medfl's coordinator",
        "protects": "each client's model update in its training replies: the coordinator receives masked vectors "
                    "and unmasks only the num_examples-weighted mean of the updates of the sites that delivered one",
        "against": "an honest-but-curious coordinator (it follows the protocol), alone or colluding with fewer "
                   "than reconstruction_threshold sites, as long as two or more sites of the sum stay outside the "
                   "coalition (the sum minus the coalition's own updates is theirs)",
        "not": ["differential privacy: the mean (and the global model) is exact up to quantization; with 2 sites "
                "in a round each one can subtract its own update from it",
                "a coordinator that lies about who dropped out, or tells sites different stories (no consistency "
                "checks in this implementation), nor one that searches the masks' seeds: Flower's mask generator "
                "(secaggplus_utils.pseudo_rand_gen) folds every 32-byte seed into a 32-bit numpy seed",
                "the training metrics, num_examples and who took part, sent in the clear",
                "evaluation and cross_test exchanges (models sent for cross_test travel in the clear)"],
        "quantization": {"clipping_range": settings["clipping_range"],
                         "quantization_range": settings["quantization_range"],
                         "error_per_coordinate": "at most n_sites * 2 * clipping_range / quantization_range of "
                                                 "the mean update (stochastic rounding); coordinates of a "
                                                 "weighted update beyond clipping_range are clipped"},
        "num_shares": settings["num_shares"],
        "reconstruction_threshold": settings["reconstruction_threshold"],
    }
