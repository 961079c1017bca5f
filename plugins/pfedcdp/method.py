"""PFedCDP (paper 000) as the paper's algorithm box: the profile exchange and the clusters
(eqs. 1-2), Algorithm 1 at the client (Fisher masks, eq. 6, classifier KD: eqs. 3-11) and
Algorithm 2 at the coordinator (FedAvg within each cluster, the server classifiers); the
private release (eqs. 12-15), the mechanism records and the post-hoc refinement (eqs. 16-19)
are the class's parts in :mod:`.release`, :mod:`.mechanisms` and :mod:`.refine`."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch import nn

from medfl.capability import CLUSTERS, SCORES, assign_cluster, draw_capabilities, measure_capabilities, overall_score
from medfl.logs import plugin_logger
from medfl.messages import Instruction, Reply
from medfl.method import ENGINE_TRAIN_METRICS, ClientContext, Federation, Method, MethodConfigError, derive_seed
from medfl.models.registry import build_seeded
from medfl.training import get_state, make_optimizer, train_epochs, weighted_average
from medfl_plugins.pfedcdp.losses import local_loss
from medfl_plugins.pfedcdp.mechanisms import MechanismRecords, personal_observables
from medfl_plugins.pfedcdp.models import (fisher_information, fisher_masks, frozen, mix_extractor, recalibrate_norms,
                                          split_keys)
from medfl_plugins.pfedcdp.presets import PRESETS
from medfl_plugins.pfedcdp.refine import Refinement
from medfl_plugins.pfedcdp.release import PrivateRelease
from medfl_plugins.pfedcdp.settings import State, read_settings

__all__ = ["PFedCDP"]

logger = plugin_logger(__package__ or __name__)


class PFedCDP(PrivateRelease, MechanismRecords, Refinement, Method):
    """PFedCDP (Shadin, Zhang, Wang, Pan; paper 000): capability clusters (eqs. 1-2),
    Fisher-masked personalisation of the extractor (eqs. 3-6), classifier KD from the cluster
    model (eqs. 7-11), private quantized extractor updates (eqs. 12-15), and post-hoc
    Shapley-weighted multi-teacher KD with supervised contrastive learning on the
    coordinator's public set (eqs. 16-19).

    Eqs. 1-2 are :meth:`server_profile`; Algorithm 1 is :meth:`client_update`; Algorithm 2 is
    :meth:`configure_round`, :meth:`server_update` (line 10) and ``finalize`` (lines 15-28,
    :mod:`.refine`). ``docs/pfedcdp.md`` has every step, every choice where the paper is silent,
    the settings (the keyword arguments) and every deviation; the main ones: ``extractor_epochs``
    of cross-entropy before Algorithm 1's classifier KD (as printed the extractor never trains);
    eqs. 4-5's ties at ``F = T`` personal; ``W_C,server`` (whose training is never said) fitted
    on the public set; BatchNorm statistics kept at the clients; eq. 19 read per feature with
    ``feature_shap="input"``; a ``grad_clip`` that keeps training finite under the paper's noise.
    """

    name = "pfedcdp"
    description = ("PFedCDP: capability clusters, Fisher-masked personalisation, classifier KD, DP + quantized "
                   "extractor updates, Shapley-weighted MTKD + SupCon on a public set")
    reply_state = {"extractor": "extractor"}
    supports_dp_sgd = False
    presets = PRESETS
    # the Fisher masks' share, the extractor's own epochs, personal_observables' norms
    train_metrics = ENGINE_TRAIN_METRICS | {"fisher_batches", "personal_fraction", "loss_extractor",
                                            "steps_extractor", "own_norm", "above_one", "personal_norm",
                                            "personal_norm_prev", "personal_drift", "weight_dp_releases"}
    profile_metrics = frozenset(SCORES)

    def __init__(self, capabilities: Any = "auto", capability_weights: list[float] | tuple[float, ...] = (0.25,) * 4,
                 t_high: float = 0.6, t_medium: float = 0.4, max_latency_ms: float = 200.0,
                 cluster_models: dict[str, dict[str, Any]] | None = None,
                 fisher_keep: float | None = 0.2, fisher_threshold: float | None = None,
                 fisher_batches: int | None = None, extractor_epochs: int = 1,
                 kd_lambda: float = 0.5, kd_temperature: float = 2.0,
                 server_classifier: str = "public", server_epochs: int = 1,
                 epsilon: float | None = 5.0, clip: float = 2.5, delta: float = 1e-5, accountant: str = "rdp",
                 bits: int | None = 8, refine: bool = True, student_model: dict[str, Any] | None = None,
                 refine_epochs: int = 5, refine_lr: float = 1e-3, alpha: float = 0.5,
                 refine_temperature: float = 2.0, tau: float = 0.07, teacher_weights: Any = "shapley",
                 shapley_score: str = "accuracy", shapley_samples: int | None = None,
                 feature_shap: str = "off", shap_samples: int = 16, shap_nsamples: int = 200,
                 grad_clip: float | None = 5.0, noise_multiplier: float | None = None, quantize: str = "update",
                 cluster_average: str = "weighted", supcon_reduction: str = "sum", supcon_views: int = 1,
                 dp_mode: str = "update", dp_clusters: list[str] | tuple[str, ...] | None = None,
                 apply_masks: bool = True, kd_scope: str = "classifier",
                 kd_clusters: list[str] | tuple[str, ...] | None = None,
                 cluster_lr: dict[str, float | None] | None = None, kd_input: str = "logits",
                 score: str = "personal") -> None:
        vars(self).update(read_settings({k: v for k, v in locals().items() if k != "self"}))

    # ------------------------------------------------------------------ shared
    def _model_spec(self, spec: dict[str, Any]) -> dict[str, Any]:
        """``spec`` with the run's data dimensions (``spatial_dims``, ``in_channels``, ``num_classes``)."""
        fed = self.federation
        return {"spatial_dims": fed.spatial_dims, "in_channels": fed.in_channels, "num_classes": fed.num_classes,
                **spec}

    def _spec(self, c: str) -> dict[str, Any]:
        """Cluster ``c``'s model spec."""
        return self._model_spec(self.cluster_models[c])

    @staticmethod
    def _loaded(spec: dict[str, Any], state: State, device: str) -> nn.Module:
        """A model of ``spec`` holding ``state``, on ``device``."""
        model = build_seeded(spec, 0, device)
        model.load_state_dict(state)
        return model

    # ------------------------------------------------------------------ coordinator: setup, profile (eqs. 1-2)
    def setup(self, federation: Federation) -> None:
        """One model per cluster (seeded); the server classifiers fitted on the public set."""
        super().setup(federation)
        if isinstance(self.capabilities, (list, tuple)) and len(self.capabilities) != len(federation.eval_client_ids):
            raise MethodConfigError(f"pfedcdp: capabilities lists {len(self.capabilities)} clients, the run has "
                                    f"{len(federation.eval_client_ids)}")
        if isinstance(self.capabilities, dict):
            missing = sorted(set(federation.eval_client_ids) - set(map(str, self.capabilities)))
            if missing:
                raise MethodConfigError(f"pfedcdp: capabilities has no scores for client(s) {missing}")
        needs_public = self.server_classifier == "public" or self.refine
        if needs_public and federation.public is None:
            raise MethodConfigError("pfedcdp: server_classifier 'public' and the post-hoc refinement need a public "
                                    "dataset at the coordinator: set fl.public_dataset (e.g. MIAS), or use "
                                    "server_classifier: 'init' and refine: false")
        self.extractors: dict[str, State] = {}
        self.buffers: dict[str, State] = {}
        self.heads: dict[str, State] = {}
        for c in CLUSTERS:
            model = build_seeded(self._spec(c), derive_seed(federation.seed, "pfedcdp", c))
            state = get_state(model)
            self.extractors[c], self.buffers[c], self.heads[c] = ({k: state[k] for k in keys}
                                                                  for keys in split_keys(model))
        # the initial models' BatchNorm statistics and server classifiers come from the public
        # set before round 1's instructions (configure_round); a resumed run loads them instead
        self._initial_fit_due = True
        self.assign: dict[str, str] = {}
        self.scores: dict[str, dict[str, float]] = {}
        self.trained: set[str] = set()
        self.report_: dict[str, Any] = {}
        self.student: State | None = None
        self._student_rows: list[dict[str, Any]] = []
        self.sigma = self.planned_sigma(federation)
        self.observed: dict[str, Any] = {}     # this round's mechanism observables (server_update)
        self.history: dict[str, dict[str, dict[str, float]]] = {}   # {observable: {id: {round: value}}}
        self.warned: list[str] = []            # what mechanism_warnings has said (once each)
        self.first_noised_round: int | None = None   # the first round a noised cluster's replies were averaged

    def configure_profile(self) -> dict[str, Instruction]:
        """Every client reports its four capability scores."""
        return {cid: Instruction() for cid in self.federation.eval_client_ids}

    def client_profile(self, client: "ClientContext", instruction: Instruction) -> dict[str, float]:
        """The four scores of eq. 1 (measured, drawn or configured; see the class docstring)."""
        mode = self.capabilities
        if isinstance(mode, dict):
            return {k: float(v) for k, v in dict(mode[client.client_id]).items() if k in SCORES}
        if isinstance(mode, (list, tuple)):
            if not client.client_id.isdigit() or int(client.client_id) >= len(mode):
                raise MethodConfigError(f"pfedcdp: capabilities is a list; client {client.client_id!r} has no entry")
            return {k: float(v) for k, v in dict(mode[int(client.client_id)]).items() if k in SCORES}
        if mode == "measure" or (mode == "auto" and client.deployed):
            scores, notes = measure_capabilities(client.coordinator or None, max_latency_ms=self.max_latency_ms)
            logger.info(f"medfl pfedcdp: client {client.client_id}: capability scores measured on this machine: "
                        + "; ".join(f"{k} {scores[k]:.3f} ({notes[k]})" for k in SCORES))
            return {k: float(scores[k]) for k in SCORES}
        return dict(draw_capabilities([client.client_id], client.seed)[client.client_id])

    def server_profile(self, results: dict[str, dict[str, float]]) -> None:
        """Eqs. 1-2: each client's overall score and cluster; missing or bad scores -> Low."""
        for cid in self.federation.eval_client_ids:
            got = results.get(cid)
            try:
                if got is None:
                    raise ValueError("no answer")
                scores = {k: float(got[k]) for k in SCORES}
                score = overall_score(scores, self.capability_weights)
                self.assign[cid] = assign_cluster(score, self.t_high, self.t_medium)
                self.scores[cid] = {**scores, "overall": score}
            except (KeyError, TypeError, ValueError) as exc:
                logger.warning(f"medfl pfedcdp: client {cid}: no usable capability scores ({exc}); placed in the low "
                               "cluster")
                self.assign[cid] = "low"
                self.scores[cid] = {"overall": float("nan")}

    def _cluster(self, cid: str) -> str:
        if not self.assign:  # a run resumed before round 1's checkpoint without a profile: all Low
            raise MethodConfigError("pfedcdp: clients have no clusters (the profile exchange did not run)")
        return self.assign.get(cid, "low")

    # ------------------------------------------------------------------ coordinator: Algorithm 2
    def configure_round(self, round: int) -> dict[str, Instruction]:
        """Each sampled client gets its cluster's extractor, server classifier and spec (the
        first call of a fresh run fits the initial models on the public set first, so round
        1's teacher is not random)."""
        if self._initial_fit_due:
            for c in CLUSTERS:
                self._calibrate(c)
                if self.server_classifier == "public":
                    self._fit_head(c, 0)
            self._initial_fit_due = False
        out = {}
        self._instructed = list(self.federation.sample(round))
        for cid in self._instructed:
            c = self._cluster(cid)
            config: dict[str, Any] = {"spec": json.dumps(self._spec(c)), "cluster": c}
            if self.in_step:        # the round seeds the client step's noise
                config["round"] = round
            out[cid] = Instruction(payload=self._payload(c), config=config)
        return out

    def _payload(self, c: str) -> dict[str, State]:
        """Cluster ``c``'s model as sent: the extractor's parameters (what the client's
        reply updates), its buffers and the server's classifier."""
        return {"extractor": self.extractors[c], "extractor_buffers": self.buffers[c], "server_head": self.heads[c]}

    def _state(self, c: str) -> State:
        """Cluster ``c``'s whole model state (extractor, its buffers, server classifier)."""
        return {**self.extractors[c], **self.buffers[c], **self.heads[c]}

    def _cluster_model(self, c: str) -> nn.Module:
        """Cluster ``c``'s model holding :meth:`_state`, on the run's device."""
        return self._loaded(self._spec(c), self._state(c), self.federation.device)

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """FedAvg (or the uniform mean) of the (dequantized, noised) extractors within each
        cluster; the server classifiers refitted on the public set; the round's observables."""
        self.observed = {"round": round, "clusters": {}, "clients": {},
                         "noised_missing": sorted(cid for cid in getattr(self, "_instructed", [])
                                                  if cid not in replies and self.noised(self._cluster(cid)))}
        for c in CLUSTERS:
            members = [cid for cid in replies if self._cluster(cid) == c]
            if not members:
                continue
            states = [replies[cid].payload["extractor"] for cid in members]
            weights = [float(max(replies[cid].num_examples, 0)) for cid in members]
            if self.cluster_average == "uniform" or sum(weights) <= 0:
                weights = [1.0] * len(members)
            old = self.extractors[c]
            self.extractors[c] = weighted_average(states, weights)
            self._observe_cluster(c, old, states, weights)
            for cid in members:
                self._observe_client(cid, c, replies[cid].metrics)
            self.trained.update(members)
            self._calibrate(c)
            if self.server_classifier == "public":
                self._fit_head(c, round)

    def _calibrate(self, c: str) -> None:
        """Re-estimate cluster ``c``'s BatchNorm statistics on the public training split
        (clients never send theirs; without a public set or BatchNorm, nothing changes)."""
        fed = self.federation
        if not self.buffers[c] or fed.public is None:
            return
        model = self._cluster_model(c)
        loader = fed.public.loader("train", batch_size=int(fed.train.get("batch_size", 16)), shuffle=False,
                                   augment=False)
        if recalibrate_norms(model, loader, fed.device):
            state = get_state(model)
            self.buffers[c] = {k: state[k] for k in self.buffers[c]}

    def _fit_head(self, c: str, round: int) -> None:
        """Fit cluster ``c``'s server classifier on the public training split on top of its
        frozen extractor (``server_epochs`` epochs of cross-entropy)."""
        fed = self.federation
        model = self._cluster_model(c)
        seed = derive_seed(fed.seed, "server_head", c, round)
        loader = fed.public.loader("train", batch_size=int(fed.train.get("batch_size", 16)), seed=seed)
        head = list(model.head.parameters())
        for p in model.parameters():
            p.requires_grad_(False)
        for p in head:
            p.requires_grad_(True)
        opt = make_optimizer(head, fed.train)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            train_epochs(model, loader, opt, self.server_epochs, device=fed.device, loss_fn=local_loss(),
                         clip_grad_norm=self.grad_clip)
        state = get_state(model)
        self.heads[c] = {k: state[k] for k in self.heads[c]}

    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """The cluster's spec; the cluster's model too for a client that never trained, and for
        every client with ``score="global"`` (its aggregated extractor is what is scored)."""
        out = {}
        for cid in self.federation.eval_client_ids:
            c = self._cluster(cid)
            payload = self._payload(c) if self.score == "global" or cid not in self.trained else {}
            out[cid] = Instruction(payload=payload, config={"spec": json.dumps(self._spec(c)), "cluster": c,
                                                            "score": self.score})
        return out

    def client_groups(self) -> dict[str, str]:
        """The capability cluster of each client."""
        return dict(self.assign)

    # ------------------------------------------------------------------ client: Algorithm 1
    def _client_spec(self, instruction: Instruction) -> dict[str, Any]:
        try:
            spec = json.loads(str(instruction.config["spec"]))
        except (KeyError, ValueError):
            raise MethodConfigError("pfedcdp: the instruction carries no model spec") from None
        return dict(spec)

    def client_train(self, cluster: str, train: dict[str, Any]) -> dict[str, Any]:
        """The local training settings of a client of ``cluster``: ``train`` with the learning rate
        of ``cluster_lr`` where it names one (the authors' v1.7 model C: Adam at 3e-4)."""
        lr = (self.cluster_lr or {}).get(cluster)
        return dict(train) if lr is None else {**train, "lr": float(lr)}

    def client_update(self, client: "ClientContext", instruction: Instruction) -> Reply:
        """Algorithm 1: the Fisher masks of the client's own model and eq. 6's mixing (l. 4-9;
        eqs. 3-6), ``extractor_epochs`` of cross-entropy (medfl's reading), the classifier on
        eq. 11 (l. 10-17; eqs. 7-11, :meth:`_distil`); the reply is the extractor (l. 18-21:
        the engine's filters clip, noise and quantize its update, eqs. 12-15, or the client
        step's :meth:`release_weights` in the authors' pipeline)."""
        spec = self._client_spec(instruction)
        g_ext: State = instruction.payload["extractor"]
        g_buf: State = instruction.payload["extractor_buffers"]
        s_head: State = instruction.payload["server_head"]
        model = build_seeded(spec, derive_seed(client.seed, "model"), client.device)
        body, buffer_keys, head_keys = split_keys(model)
        if set(body) != set(g_ext) or set(buffer_keys) != set(g_buf) or set(head_keys) != set(s_head):
            raise MethodConfigError(f"pfedcdp: client {client.client_id}: the cluster model sent does not match "
                                    f"its spec {spec.get('name')!r}")
        own_ext, own_head = client.state.get("extractor"), client.state.get("head")
        own_buf = client.state.get("buffers") or g_buf
        if own_ext is not None and set(own_ext) != set(g_ext):   # the cluster's model changed: start over
            own_ext, own_head, own_buf = None, None, g_buf
        # l. 4-9, eqs. 3-6: Fisher information of the own model, the masks, the mixed extractor;
        # round 1 (no own extractor) starts from the global one
        masks: State | None = None
        mixed = {k: v.clone() for k, v in g_ext.items()}
        metrics: dict[str, float] = {"fisher_batches": 0.0, "personal_fraction": 0.0}
        if own_ext is not None:
            model.load_state_dict({**own_ext, **own_buf, **(own_head or s_head)})
            masks, metrics = self._masks(model, client, body)
            if self.apply_masks:    # false: computed and not applied (the authors' v1.7 clients)
                mixed = mix_extractor(own_ext, g_ext, masks)
        model.load_state_dict({**mixed, **own_buf, **(own_head if own_head is not None else s_head)})
        for p in model.parameters():
            p.requires_grad_(True)
        cluster = str(instruction.config.get("cluster", ""))
        train_cfg = self.client_train(cluster, client.train)
        if self.extractor_epochs:   # the extractor's own epochs (0: Algorithm 1 as printed)
            opt = make_optimizer(model.parameters(), train_cfg)
            stats = train_epochs(model, client.loader("train"), opt, self.extractor_epochs, device=client.device,
                                 clip_grad_norm=self.grad_clip)
            metrics.update(loss_extractor=stats["loss"], steps_extractor=stats["steps"])
        # l. 10-17, eq. 11: teacher = the global extractor + the server's classifier; a cluster
        # outside kd_clusters builds none (the authors' v1.7 models B and C never load one)
        teacher = (frozen(self._loaded(spec, {**g_ext, **g_buf, **s_head}, client.device))
                   if cluster in self.kd_clusters else None)
        stats = self._distil(model, client, teacher, head_keys, train_cfg)
        metrics.update(loss=stats["loss"], steps=stats["steps"])
        state = get_state(model)
        ext = {k: state[k] for k in body}
        metrics.update(personal_observables(ext, own_ext, masks))
        client.state.update(extractor=ext, buffers={k: state[k] for k in buffer_keys},
                            head={k: state[k] for k in head_keys})
        sent = ext
        if self.in_step:        # the authors' pipeline: noise and quantize the weights here, per cluster
            sent = self.release_weights(ext, cluster, int(instruction.config.get("round", 0)), client.seed)
            if self.dp and self.dp_mode == "weights_per_tensor":
                metrics["weight_dp_releases"] = 1.0
        return Reply(payload={"extractor": sent}, metrics=metrics, num_examples=client.num_examples("train"))

    def _masks(self, model: nn.Module, client: "ClientContext", body: list[str]) -> tuple[State, dict[str, float]]:
        """Eqs. 3-5: the Fisher information of ``model`` (the client's own, of its last round) on
        its training split without augmentation, the personal masks, and their metrics (the
        batches used, the personal share)."""
        fisher, used = fisher_information(model, client.loader("train", augment=False), body, client.device,
                                          self.fisher_batches)
        masks = fisher_masks(fisher, keep=self.fisher_keep, threshold=self.fisher_threshold)
        total = sum(m.numel() for m in masks.values())
        return masks, {"fisher_batches": float(used),
                       "personal_fraction": float(sum(int(m.sum()) for m in masks.values())) / max(total, 1)}

    def _distil(self, model: nn.Module, client: "ClientContext", teacher: nn.Module | None, head_keys: list[str],
                train_cfg: dict[str, Any]) -> dict[str, float]:
        """Algorithm 1, l. 10-17: ``train.epochs`` epochs of eq. 11 (:func:`local_loss`;
        cross-entropy without a ``teacher``) on the classifier, the extractor frozen, or on the
        whole model (``kd_scope="model"``, the authors' v1.7); the training's loss and steps."""
        whole = self.kd_scope == "model"
        for n, p in model.named_parameters():
            p.requires_grad_(whole or n in set(head_keys))
        loss = local_loss(teacher, whole=whole, lam=self.kd_lambda, temperature=self.kd_temperature,
                          probabilities=self.kd_input == "probabilities")
        opt = make_optimizer(model.parameters() if whole else model.head.parameters(), train_cfg)
        return train_epochs(model, client.loader("train"), opt, int(client.train.get("epochs", 1)),
                            device=client.device, loss_fn=loss, clip_grad_norm=self.grad_clip)

    def client_eval_model(self, client: "ClientContext", instruction: Instruction) -> nn.Module:
        """The model a client's evaluation scores (``score``): ``"personal"``, its own extractor
        and classifier; ``"global"``, its cluster's aggregated extractor (and buffers) as sent
        with the client's own classifier (the authors' v1.7 ``evaluate``:
        ``set_feature_extractor_weights(parameters)``, then the full model). A client that has not
        trained yet scores the cluster's model (its server classifier)."""
        model = build_seeded(self._client_spec(instruction), 0, client.device)
        keys, p, mine = set(model.state_dict()), instruction.payload, client.state
        own = {**mine.get("extractor", {}), **mine.get("buffers", {}), **mine.get("head", {})}
        sent = {**p["extractor"], **p["extractor_buffers"]} if "extractor" in p else None
        if (str(instruction.config.get("score", self.score)) == "global" and sent is not None and mine.get("head")
                and set({**sent, **mine["head"]}) == keys):
            model.load_state_dict({**sent, **mine["head"]})
        elif own and set(own) == keys:
            model.load_state_dict(own)
        elif sent is not None:
            model.load_state_dict({**sent, **p["server_head"]})
        return model.eval()

    # ------------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        """Clusters, capability scores, teacher weights and Shapley values, and what the
        mechanisms did (``mechanisms``) (summary.json)."""
        counts = {c: sum(1 for v in self.assign.values() if v == c) for c in CLUSTERS}
        return {"clusters": dict(self.assign), "cluster_sizes": counts, "capability_scores": self.scores,
                "scoring": {"score": self.score, "kd_clusters": list(self.kd_clusters), "kd_input": self.kd_input,
                            "cluster_lr": self.cluster_lr},
                "thresholds": {"t_high": self.t_high, "t_medium": self.t_medium}, **self.report_,
                "mechanisms": self._mechanism_report()}

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        """Cluster extractors and server classifiers, the assignment, who trained, the
        mechanisms' history and what was warned."""
        return {"extractors": self.extractors, "buffers": self.buffers, "heads": self.heads,
                "assign": json.dumps(self.assign),
                "scores": json.dumps(self.scores), "trained": json.dumps(sorted(self.trained)),
                "mechanisms": json.dumps({"observed": self.observed, "history": self.history,
                                          "warned": self.warned, "first_noised_round": self.first_noised_round})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.extractors, self.buffers, self.heads = ({c: dict(v) for c, v in state[k].items()}
                                                     for k in ("extractors", "buffers", "heads"))
        self._initial_fit_due = False
        self.assign = dict(json.loads(state["assign"]))
        self.scores = dict(json.loads(state["scores"]))
        self.trained = set(json.loads(state["trained"]))
        mech = json.loads(state.get("mechanisms", "{}"))
        self.observed = dict(mech.get("observed", {}))
        self.history = dict(mech.get("history", {}))
        self.warned = list(mech.get("warned", []))
        self.first_noised_round = mech.get("first_noised_round")

