"""A medfl site: what answers the coordinator's messages where one client's data lives (behind
a Flower SuperNode's ``ClientApp``, :mod:`medfl.flower.proxy`, or an NVIDIA FLARE executor).

The SuperNode is started with a node config naming the site (``medfl flower site`` writes
it)::

    flower-supernode --insecure --superlink HOST:PORT \\
        --node-config "client-id='0' config='/abs/train.json' state-dir='/abs/site0'"

``client-id``
    the client this site serves (an id of the experiment's partition, ``0``...).
``config``
    a medfl bundle config (``train.json``) whose ``fl`` section says where the data is
    (``dataset``) and how the federation's partition is drawn (``num_clients``,
    ``partition``, ``client_split``, ``global_test_fraction``, ``cv``...; the seed is the
    run's, sent by the coordinator with every message, so an experiment repeated over
    ``seeds`` draws each seed's split). The site draws
    the split itself with :func:`medfl.engine.data.split_data`, exactly as the in-process
    engine does, and keeps only its own rows (plus the global test rows); the coordinator
    checks the result against its own through :func:`~medfl.engine.protocol.partition_digest`.
``state-dir``
    where this site keeps each run's persistent client state
    (``<state-dir>/<run id>/site_<client id>/clients/``, a
    :class:`~medfl.engine.store.ClientStore` versioned by round as in process), its
    evaluation memory (``.../eval_state/``), its secrets for privacy noise
    (``<state-dir>/noise.key``, :func:`site_noise_key`, and one more per run,
    ``.../noise_run.key``, :meth:`Site.run_noise_key`) and its ledger of the DP releases it
    made (``.../releases.jsonl`` and ``.../releases/``, :mod:`medfl.privacy.releases`), and
    its log of the run (``.../log.txt``: what the site logged while handling the run's
    messages, :mod:`medfl.logs`). Nothing of it is sent to the coordinator.
``overrides`` (optional)
    JSON of ``#``-path overrides of the config (``{"fl#dataset#root": "/data"}``).
``workdir`` (optional)
    directory in which relative paths of the config are read (default: the SuperNode's).
``device`` (optional)
    torch device for this site's training (default: the config's ``device``).

Which method runs, the model of each client, the local-training settings and the run seed
come from the coordinator with every message. Each message is handled by the same
functions the in-process engine calls (:func:`~medfl.engine.client.run_client_update`, and
the two steps of :func:`~medfl.engine.client_eval.run_client_evaluate`) on a
:class:`~medfl.engine.client.ClientContext` built by the engine's own
:func:`medfl.engine.exchanges.client_context`, so the same seed gives the same numbers. Every
payload is checked on receipt and before it leaves (:func:`medfl.messages.validate_payload`): tensors and numbers only;
what leaves (reply payload, reply metrics, the evaluation model sent for ``cross_test``) is
also compared with this site's own labels and images (:mod:`medfl.guard`).

Which plugins run here is the site operator's decision (:mod:`medfl.approval`): with an
approvals file (``medfl flower site --approvals FILE``, or ``MEDFL_APPROVALS=FILE`` in the
environment of a plain ``flower-supernode``), :meth:`Site.check` refuses, before the method's
code runs, every message naming a plugin not approved there with the same version and code,
or asking for less privacy than the file's ``policy`` accepts (:mod:`medfl.policy`); the
coordinator's run then fails with a :class:`~medfl.engine.remote_sites.SiteFailure` naming the
site and the reason. Without one, the site runs any method installed in its environment and
says so. The messages themselves are read and answered by :mod:`medfl.site_messages`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from medfl.engine.client import (ClientContext, ClientStore, build_eval_model, build_peer_model,
                                 evaluate_final_models, evaluate_model, run_client_profile, run_client_update,
                                 run_client_validate, score_dataset)
from medfl.engine.data import FederatedData, client_order, split_data
from medfl.approval import ApprovalError, check_control, guarded_models, required
from medfl.budget import BudgetRefused, SiteBudget, data_key
from medfl.config import build_method, local_sites, resolve_config, set_threads, uncovered_keys
from medfl.engine import protocol as P
from medfl.filters import FilterChain
from medfl.integrity import write_text
from medfl.messages import RELEASE_FLAG, Instruction, validate_payload
from medfl.method import Method
from medfl.policy import SitePolicy, request_releases
from medfl.wire import Config, Content

__all__ = ["SiteSettings", "Site", "SiteError", "site_noise_key", "instruction_digest", "REPRODUCIBLE_NOISE_ENV"]

logger = logging.getLogger(__name__)


class SiteError(RuntimeError):
    """A site cannot serve a message (wrong client id, bad node config, unknown protocol)."""


@dataclass
class SiteSettings:
    """A site's node config (see the module docstring).

    Attributes:
        client_id: the client this site serves.
        config: the bundle config file.
        state_dir: the site's state directory.
        overrides: ``#``-path overrides of the config.
        workdir: where relative paths of the config are read (``None``: the current one).
        device: torch device (``None``: the config's).
        superlink: the SuperLink's Fleet API address (``host:port``) the site connects to,
            when the node config names it (``medfl flower site`` does): what a method
            measures the coordinator's latency against (``ClientContext.coordinator``).
        resolved: the resolved ``fl`` config itself, instead of reading ``config`` (the
            simulation runtime, :mod:`medfl.flower.simulation`, hands every simulated site
            the coordinator's; ``config`` is then only a name in messages).
        simulated: a site of the simulation runtime, not on a machine of its own: as in
            process, privacy noise is drawn from the run seed alone (coordinator and sites are
            one user's processes; a deployed site keeps its own secret, :func:`site_noise_key`)
            and ``ClientContext.deployed`` is false.
    """

    client_id: str
    config: Path
    state_dir: Path
    overrides: dict[str, Any] = field(default_factory=dict)
    workdir: Path | None = None
    device: str | None = None
    superlink: str = ""
    resolved: dict[str, Any] | None = None
    simulated: bool = False

    @classmethod
    def from_node_config(cls, node_config: dict[str, Any]) -> "SiteSettings":
        """Read a SuperNode's ``--node-config``.

        Raises:
            SiteError: a required key is missing or a value is malformed.
        """
        missing = [k for k in ("client-id", "config", "state-dir") if k not in node_config]
        if missing:
            raise SiteError(f"medfl site: node config lacks {', '.join(missing)}; start the SuperNode with "
                            "--node-config \"client-id='0' config='/path/train.json' state-dir='/path/state'\" "
                            f"(got keys {sorted(node_config)})")
        overrides: dict[str, Any] = {}
        raw = str(node_config.get("overrides", "") or "")
        if raw:
            try:
                overrides = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise SiteError(f"medfl site: node config 'overrides' is not JSON: {exc}") from None
            if not isinstance(overrides, dict):
                raise SiteError("medfl site: node config 'overrides' must be a JSON object")
        workdir = str(node_config.get("workdir", "") or "")
        device = str(node_config.get("device", "") or "")
        return cls(client_id=str(node_config["client-id"]), config=Path(str(node_config["config"])),
                   state_dir=Path(str(node_config["state-dir"])), overrides=overrides,
                   workdir=Path(workdir) if workdir else None, device=device or None,
                   superlink=str(node_config.get("superlink", "") or ""))


class Site:
    """One site: its config, its split of the data and its state stores.

    Args:
        settings: the node config.
    """

    def __init__(self, settings: SiteSettings) -> None:
        from medfl.config_file import load_bundle_config

        self.settings = settings
        self.client_id = settings.client_id
        if settings.workdir is not None:
            os.chdir(settings.workdir)
        if settings.resolved is not None:
            self.cfg = resolve_config(settings.resolved)
        else:
            if not settings.config.is_file():
                raise SiteError(f"medfl site {self.client_id}: config {settings.config} not found "
                                f"(paths in the node config are read on the site's machine, from {Path.cwd()})")
            self.cfg = resolve_config(load_bundle_config(settings.config, settings.overrides))
        self.device = settings.device or str(self.cfg["device"])
        if not settings.simulated:   # a simulated site's actor set its threads (medfl.config.actor_threads)
            # the site's worker trains in this process: fl.threads or --threads ("auto", shared
            # with the other sites medfl started on this machine, is set by `medfl flower site`)
            self.threads = set_threads(self.cfg.get("threads"), local_sites(), apply_auto=False)
        self._data: dict[tuple[int | None, int], FederatedData] = {}
        self._source: Any = None
        self._data_key: str | None = None
        self.noise_key = "" if settings.simulated else site_noise_key(settings.state_dir, self.client_id)
        #: the policy of the message being handled (read by :meth:`check`), or None
        self.policy: Any = None
        #: the approvals file :meth:`check` read for the message being handled, or None
        self.approvals: Any = None

    # ------------------------------------------------------------------ data and state
    def data(self, fold: int | None, seed: Any = None) -> FederatedData:
        """This site's view of the split (``fold`` of a cross-validated experiment), drawn
        with the run's ``seed`` (the coordinator's; an experiment repeated over ``seeds``
        draws one split per seed) or, without one, the config's."""
        seed = int(self.cfg["seed"] if seed is None else seed)
        key = (fold, seed)
        if key not in self._data:
            data = split_data(self.source(), {**self.cfg, "seed": seed}, fold=fold)
            if self.client_id not in data.client_ids:
                raise SiteError(f"medfl site: client id {self.client_id!r} is not in this config's partition "
                                f"(clients {data.client_ids}); check client-id and num_clients")
            self._data[key] = data
        return self._data[key]

    def source(self) -> Any:
        """The data set this site's config names (built once)."""
        if self._source is None:
            from medfl.engine.runner import build_source

            self._source = build_source(self.cfg["dataset"])
        return self._source

    def _root(self, ctl: dict[str, Any]) -> Path:
        run = str(ctl["run"])
        # a coordinator names the run; it must not be able to point the site outside its
        # --state-dir (everything the site writes or deletes lives under state_dir/run/)
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_-]{0,127}", run):
            raise SiteError(f"medfl site: bad run id {run!r}; expected letters, digits, '_' or '-'")
        return self.settings.state_dir / run / f"site_{self.client_id}"

    def run_noise_key(self, ctl: dict[str, Any]) -> str:
        """This site's secret for the privacy noise of the message's run
        (:attr:`medfl.context.ClientContext.noise_key`): a hash of the site's persistent
        secret (:func:`site_noise_key`) and 32 bytes from ``os.urandom`` drawn the first time
        the site sees the run, kept in ``<state-dir>/<run id>/site_<client>/noise_run.key`` (so a
        SuperNode restarted within the run continues with the same noise). Nothing the
        coordinator sends goes into it but the run id that names the file: two runs draw
        independent noise whatever their seeds and configs, and knowing ``noise.key`` is not
        enough to regenerate it. Empty where :attr:`noise_key` is (a simulated site, or
        :data:`REPRODUCIBLE_NOISE_ENV`): noise from the run seed alone."""
        if not self.noise_key:
            return ""
        run_secret = _secret_file(self._root(ctl) / "noise_run.key", self.client_id)
        return hashlib.sha256(f"{self.noise_key}:{run_secret}".encode()).hexdigest()

    def stores(self, ctl: dict[str, Any]) -> tuple[ClientStore, ClientStore]:
        """The run's client-state and evaluation-memory stores, brought in line with the
        coordinator: the first message of a new coordinator session rolls back versions
        written after the round the session resumed from (as ``Run.prepare(resume=True)``
        does in process), and every message prunes versions the coordinator's kept
        checkpoints no longer need (as ``Run._save_checkpoint``: those of ``ckpt`` and later,
        and with early stopping those of the best rounds the control record's ``pinned`` lists)."""
        root = self._root(ctl)
        store, eval_store = ClientStore(root / "clients"), ClientStore(root / "eval_state")
        marker = root / "session.json"
        session = str(ctl["session"])
        seen = json.loads(marker.read_text()).get("session") if marker.is_file() else None
        if seen != session:
            k = int(ctl["resume"])
            store.rollback(k)
            eval_store.rollback(k)
            root.mkdir(parents=True, exist_ok=True)
            write_text(marker, json.dumps({"session": session, "resumed_from": k}))
        ckpt = int(ctl.get("ckpt", 0))
        if ckpt > 0:
            pinned = [int(k) for k in ctl.get("pinned") or []]   # early stopping's best rounds
            store.prune(ckpt, pinned)
            eval_store.prune(ckpt, pinned)
        return store, eval_store

    def method(self, ctl: dict[str, Any]) -> Method:
        """The method's client role, built from the coordinator's method entry."""
        return build_method(dict(ctl["method"]))

    def request_noise_key(self, ctl: dict[str, Any], instruction: str = "") -> str:
        """The secret mixed into the seeds of a request's privacy noise: this run's
        (:meth:`run_noise_key`) and, for a training request, the digest of its instruction
        (``instruction``: the control fields, the payload with the model sent, the config),
        so two different requests never draw the same noise (the difference of two replies
        to the same round with two models would otherwise cancel it). Empty where
        :meth:`run_noise_key` is."""
        key = self.run_noise_key(ctl)
        return hashlib.sha256(f"{key}:{instruction}".encode()).hexdigest() if key and instruction else key

    def context(self, ctl: dict[str, Any], store: ClientStore, state_before: int | None = None,
                instruction: str = "") -> ClientContext:
        """This client's context for the message's round, built as in process
        (:func:`medfl.engine.exchanges.client_context`); ``instruction``: the digest of a
        training request's instruction, which the noise key names (:meth:`request_noise_key`)."""
        from medfl.engine.exchanges import client_context

        return client_context(self.data(ctl.get("fold"), ctl.get("seed")), self.client_id, int(ctl["round"]),
                              run_seed=int(ctl["seed"]), model_spec=dict(ctl["model"]), train=dict(ctl["train"]),
                              device=self.device, store=store, state_before=state_before,
                              noise_key=self.request_noise_key(ctl, instruction),
                              deployed=not self.settings.simulated, coordinator=self.settings.superlink)

    def check(self, ctl: dict[str, Any]) -> None:
        """Refuse a message of another protocol, addressed to another client, asking for a
        plugin this site's operator did not approve, or for less privacy than the site's
        policy accepts. With an approvals file (:data:`medfl.approval.APPROVALS_ENV`, set by
        ``medfl flower site --approvals``), every plugin the message makes the site run (its
        method, filters, models and metrics, and the site's own dataset and partitioner) must
        be in it with the same version and code (:mod:`medfl.approval`), and the message's
        filter chain, ``train.dp``, method release and ``cross_test`` request must meet the
        file's ``policy`` (:mod:`medfl.policy`). Runs before the method's code."""
        if int(ctl.get("protocol", -1)) != P.PROTOCOL:
            raise SiteError(f"medfl site {self.client_id}: message of protocol {ctl.get('protocol')}, "
                            f"this site speaks {P.PROTOCOL} (same medfl version on both sides?)")
        if "client" in ctl and str(ctl["client"]) != self.client_id:
            raise SiteError(f"medfl site {self.client_id}: message addressed to client {ctl['client']!r}")
        if self.settings.simulated:   # the user's own simulated sites: nothing to approve
            return
        own = [(kind, str(entry["name"] if isinstance(entry, dict) else entry))
               for kind, entry in (("dataset", self.cfg.get("dataset")), ("partitioner", self.cfg.get("partition")))
               if isinstance(entry, (dict, str)) and (not isinstance(entry, dict) or "name" in entry)]
        try:
            approvals = check_control(ctl, f"medfl site {self.client_id}", site=own)
        except ApprovalError as exc:
            raise SiteError(f"medfl site {self.client_id}: {exc}") from None
        self.approvals = approvals
        self.policy = None
        if approvals is None or approvals.policy is None:
            return
        try:
            self.policy = SitePolicy.from_dict(approvals.policy, f"approvals file {approvals.path}: policy")
            self.policy.check(ctl, lambda: self.num_examples(ctl), budget=self.budget())
        except ApprovalError as exc:
            raise SiteError(f"medfl site {self.client_id}: refused by its privacy policy ({approvals.path}): "
                            f"{exc}") from None

    @contextmanager
    def models_guarded(self, ctl: dict[str, Any]) -> Iterator[None]:
        """Handle the message ``ctl`` (checked by :meth:`check`) in this block: every model
        plugin built in it, the inner model a wrapper builds from its options included, must
        be approved as the message's own models are (:func:`medfl.approval.guarded_models`).

        Raises:
            SiteError: a model built in the block is not approved (naming it and the
                wrapper that builds it), before its factory runs.
        """
        if self.settings.simulated:   # the user's own simulated sites: nothing to approve
            yield
            return
        allowed = [name for kind, name in required({"model": ctl.get("model"), "specs": ctl.get("specs")})
                   if kind == "model"]
        try:
            with guarded_models(self.approvals, f"medfl site {self.client_id}", allowed):
                yield
        except ApprovalError as exc:
            raise SiteError(f"medfl site {self.client_id}: {exc}") from None

    def num_examples(self, ctl: dict[str, Any]) -> int:
        """This site's training-set size in the message's split (what DP-SGD's steps and
        sample rate are computed from)."""
        return int(self.data(ctl.get("fold"), ctl.get("seed")).num_examples()[self.client_id])

    def budget(self) -> SiteBudget:
        """This site's own privacy budget (:mod:`medfl.budget`, ``<state-dir>/budget.jsonl``),
        for the data set its config names (keyed by the data's own fingerprint)."""
        if self._data_key is None:
            self._data_key = data_key(self.source())
        return SiteBudget(self.settings.state_dir, self._data_key, self.client_id,
                          f"medfl site {self.client_id}", self.policy)

    def check_models(self, specs: dict[str, dict[str, Any]]) -> None:
        """Refuse model specs (a method's final models, named inside an instruction rather
        than in the control record) whose model plugin this site's operator did not approve
        (:func:`medfl.approval.check_control`); before any of them is built."""
        if self.settings.simulated:
            return
        try:
            check_control({"specs": specs}, f"medfl site {self.client_id}", kinds=("model",))
        except ApprovalError as exc:
            raise SiteError(f"medfl site {self.client_id}: {exc}") from None

    # ------------------------------------------------------------------ the steps
    def hello(self, ctl: dict[str, Any]) -> dict[str, Any]:
        """Who this site is and what its partition looks like (no data, no state)."""
        data = self.data(ctl.get("fold"), ctl.get("seed"))
        return {"protocol": P.PROTOCOL, "client": self.client_id, "sizes": P.split_sizes(data, self.client_id),
                "digest": P.partition_digest(data, self.client_id)}

    def train(self, ctl: dict[str, Any], ins: Instruction) -> tuple[Any, int, dict[str, Any]]:
        """Run the method's ``client_update``; save the client's state at the site.

        A reply that carries a DP release (a DP filter, DP-SGD, the method's per-sample
        release, its own DP: :func:`medfl.policy.request_releases`, as this site computes
        them) is recorded in the site's release ledger
        (:class:`medfl.privacy.releases.SiteReleaseLedger`) and, at a deployed site, in its
        budget (:class:`medfl.budget.SiteBudget`) before it leaves. A request for a release
        this site already made in the run (same round and step) gets the reply it sent then,
        byte for byte, when its instruction is the same (the update runs again, to restore
        the client's state, but its reply stays here); under any other instruction it is
        refused before the client step runs (nothing is trained or drawn). A new release is
        first checked against the plan the site accepted for the run and against its
        policy's caps over what it has released itself (:meth:`medfl.budget.SiteBudget.admit`);
        its noise is seeded from the instruction's digest too (:meth:`request_noise_key`).

        Raises:
            SiteError: the release was made before under another instruction, or the
                site's plan or budget refuses it (naming the rule).
        """
        from medfl.privacy.releases import ReleaseRefused, SiteReleaseLedger

        # the coordinator's resolved filter entries (approved by Site.check): applied to the
        # reply here, undone at the coordinator
        filters = FilterChain.from_specs(ctl.get("filters") or [], f"filters sent to site {self.client_id}")
        method = self.method(ctl)
        is_release = ins.config.get(RELEASE_FLAG) is True
        spends = request_releases(ctl, lambda: self.num_examples(ctl), method, is_release, chain=filters)
        asked = [s.ledger_entry() for s in spends]
        policy = self.policy
        if spends and policy is not None and policy.capped:
            self._refuse_uncovered(method, ins, policy)
        ledger = SiteReleaseLedger(self._root(ctl), f"medfl site {self.client_id}") if asked else None
        release = (str(ctl["run"]), int(ctl["round"]), self.client_id, int(ctl.get("step", 0)))
        digest, sent_before, budget = "", None, None
        kind = "release" if is_release else "train"
        if ledger is not None:
            digest = instruction_digest(ctl, ins)
            try:
                sent_before = ledger.replay(*release, asked, digest)
                if sent_before is None and not self.settings.simulated:
                    budget = self.budget()
                    plan = budget.plan(release[0], str(ctl.get("session", "")), ctl.get("rounds"), ctl.get("releases"))
                    budget.admit(release[0], release[1], release[3], kind, spends, plan)
            except (ReleaseRefused, BudgetRefused) as exc:
                raise SiteError(str(exc)) from None
        store, _ = self.stores(ctl)
        # checks the reply (tensors and numbers, none of this site's labels or images) before
        # and after the filters, before the wire side packs it, which checks its types again
        reply = run_client_update(method, self.context(ctl, store, instruction=digest), ins, store=store,
                                  filters=filters, step=release[3])
        if sent_before is not None:
            return sent_before
        if budget is not None:
            budget.record(release[0], release[1], release[3], kind, spends)
        if ledger is not None:
            ledger.record(*release, asked, digest, reply.payload, int(reply.num_examples), dict(reply.metrics))
            ledger.prune(int(ctl.get("ckpt", 0)))   # replies no resume can ask for again
        return reply.payload, int(reply.num_examples), dict(reply.metrics)

    def _refuse_uncovered(self, method: Method, ins: Instruction, policy: Any) -> None:
        """A site with an epsilon cap sends no reply entry beside its noised model that no DP
        covers (:func:`medfl.config.uncovered_keys`, the approved method's own declaration):
        the run's epsilon would not be what leaves.

        Raises:
            SiteError: naming the entries and the rule.
        """
        keys = uncovered_keys(method, ins)   # none for a per-sample release (its labels are declared)
        if keys:
            rule = "max_epsilon" if policy.max_epsilon is not None else "max_epsilon_total"
            raise SiteError(f"medfl site {self.client_id}: refused by its privacy policy: rule {rule}: method "
                            f"{method.name!r} would reply {keys} beside its noised model state "
                            f"{sorted(type(method).reply_state)}, in the clear (no DP mechanism covers them), so "
                            "the run's epsilon would not bound what leaves this site")

    def secure_train(self, ctl: dict[str, Any], ins: Instruction, content: Content) -> Content:
        """:meth:`train` in a secure-aggregation round (``fl.secure_aggregation``): the answer
        carries the update (the reply's model state minus the state sent) for SecAgg+ to mask
        (:func:`medfl.flower.secagg.secure_train_answer`), and no model payload.

        Raises:
            SiteError: the message did not come through SecAgg+'s collect stage (the update
                would leave unmasked).
            PayloadError: the reply carries more than the method's ``reply_state``.
        """
        from medfl.flower.secagg import RECORD_KEY_CONFIGS, secure_train_answer, secure_update

        if not isinstance(content.get(RECORD_KEY_CONFIGS), Config):
            raise SiteError(f"medfl site {self.client_id}: a secure-aggregation training message without SecAgg+'s "
                            f"{RECORD_KEY_CONFIGS!r} record: refusing to send the update unmasked")
        payload, n, metrics = self.train(ctl, ins)
        method = type(self.method(ctl))
        update = secure_update(method, payload, ins.payload, f"reply of site {self.client_id}")
        return secure_train_answer(self.client_id, update, metrics, n)

    def evaluate(self, ctl: dict[str, Any], ins: Instruction) -> tuple[dict[str, dict[str, float]],
                                                                          dict[str, torch.Tensor] | None]:
        """Score the client's evaluation model of the round on its own splits (and return
        the model's state when the coordinator asks for it, for ``cross_test``)."""
        from medfl.engine.evaluation import evaluate_metrics, final_models_of

        store, eval_store = self.stores(ctl)
        r = int(ctl["round"])
        ctx = self.context(ctl, store, state_before=r + 1)
        if ctl.get("final"):
            # the coordinator's final models (Method.final_models): rebuilt from registered
            # specs, scored on this client's splits; no evaluation memory is touched
            finals = final_models_of(ins, f"final models sent to site {self.client_id}")
            self.check_models({name: spec for name, (spec, _) in finals.items()})
            per = evaluate_final_models(ctx, finals, [str(s) for s in ctl["splits"]], evaluate_metrics)
            return {f"{name}/{split}": m for name, d in per.items() for split, m in d.items()}, None
        memory = eval_store.load(self.client_id, r)
        # the two steps of run_client_evaluate, keeping the model for cross_test
        model = build_eval_model(self.method(ctl), ctx, ins)
        out = evaluate_model(model, ctx, [str(s) for s in ctl["splits"]], evaluate_metrics, memory=memory)
        eval_store.save(self.client_id, r, memory)
        state = None
        if ctl.get("want_model"):
            state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            validate_payload(state, f"evaluation model of site {self.client_id}", allow_str=False, guard=ctx.guard)
        return out, state

    def validate(self, ctl: dict[str, Any], ins: Instruction) -> dict[str, float]:
        """Run the method's ``client_validate`` (the validation exchange), or its
        ``client_profile`` when the control record says ``exchange: profile`` (the profile
        exchange before round 1, measured on this machine); save the client's state at the site."""
        store, _ = self.stores(ctl)
        step = run_client_profile if ctl.get("exchange") == "profile" else run_client_validate
        return step(self.method(ctl), self.context(ctl, store), ins, store=store)

    def score(self, ctl: dict[str, Any], models: dict[str, dict[str, torch.Tensor]],
              instructions: dict[str, Instruction]) -> dict[str, dict[str, float]]:
        """``cross_test`` at this site: each given model scored on this client's test split.

        Each owner's evaluation model is rebuilt by the method's ``eval_model_skeleton``
        from the owner's model spec and evaluation instruction
        (:func:`~medfl.engine.client_eval.build_peer_model`), so ensembles and probability models
        score here exactly as at their owner."""
        from medfl.engine.evaluation import evaluate_metrics

        data = self.data(ctl.get("fold"), ctl.get("seed"))
        specs: dict[str, Any] = dict(ctl["specs"])
        method = self.method(ctl)
        ds = data.dataset_factories(self.client_id, ["test"])["test"]()
        out: dict[str, dict[str, float]] = {}
        for owner in client_order(models):
            if owner not in specs or owner not in instructions:
                raise SiteError(f"cross_test: the coordinator sent the model of client {owner} without its "
                                "spec or evaluation instruction")
            try:
                model = build_peer_model(method, owner, int(ctl["round"]), int(ctl["seed"]), dict(specs[owner]),
                                         dict(ctl["train"]), self.device, instructions[owner], models[owner])
            except ValueError as exc:
                raise SiteError(str(exc)) from None
            out[owner] = score_dataset(model, ds, dict(ctl["train"]), self.device, evaluate_metrics)
        return out


#: Set to ``1`` in a site's environment to draw privacy noise from the run seed alone, as in
#: process (tests and simulations that compare the two; no guarantee against the coordinator).
REPRODUCIBLE_NOISE_ENV = "MEDFL_REPRODUCIBLE_NOISE"


def site_noise_key(state_dir: Path, client_id: str) -> str:
    """The site's secret for privacy noise: 32 random bytes (hex) kept in
    ``<state-dir>/noise.key`` (created on first use, readable by its owner only), mixed into
    the seeds of every DP draw at this site (:attr:`medfl.context.ClientContext.noise_key`).
    The run seed is known to the coordinator; without a secret it could regenerate the noise
    and subtract it. Empty (noise from the run seed alone) when :data:`REPRODUCIBLE_NOISE_ENV`
    is ``1``, which the site says on stderr."""
    if os.environ.get(REPRODUCIBLE_NOISE_ENV, "") == "1":
        logger.warning(f"medfl site {client_id}: {REPRODUCIBLE_NOISE_ENV}=1: privacy noise is drawn from the run seed alone "
                       "(reproducible, as in process): no DP guarantee against whoever knows the seed")
        return ""
    return _secret_file(Path(state_dir) / "noise.key", client_id)


def _secret_file(path: Path, client_id: str) -> str:
    """The secret kept in ``path``: 32 bytes from ``os.urandom`` (hex), created on first use
    (readable by its owner only, written atomically)."""
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(os.urandom(32).hex())
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(path)
    key = path.read_text().strip()
    if len(key) < 32:
        raise SiteError(f"medfl site {client_id}: {path} holds no usable secret (expected 64 hex characters); "
                        "delete it to make a new one")
    return key


#: The control fields that make up a training instruction, besides its payload and config
#: (the session fields, which change with every coordinator session, are not part of it).
_INSTRUCTION_FIELDS = ("run", "round", "step", "client", "seed", "fold", "method", "model", "train", "filters")


def instruction_digest(ctl: dict[str, Any], ins: Instruction) -> str:
    """The digest of a training instruction (its control fields :data:`_INSTRUCTION_FIELDS`,
    the payload with the model sent, the config): what a site's release ledger compares and
    what its noise key names (:meth:`Site.request_noise_key`)."""
    from medfl.privacy.releases import payload_digest

    return payload_digest({k: ctl.get(k) for k in _INSTRUCTION_FIELDS}, ins.payload, ins.config)
