"""The method contract: one class per federated-learning method.

A method runs in two roles. The *coordinator* instance gets :meth:`Method.setup`, decides
who trains with what (:meth:`Method.configure_round`), and folds the replies in
(:meth:`Method.server_update`). The *client* instance runs :meth:`Method.client_update` and
:meth:`Method.client_eval_model` on one client at a time and sees only that client's
:class:`~medfl.context.ClientContext` (its data, its persistent state) and the
instruction. The engine builds the two roles as separate objects from the same parameters,
in-process as over Flower, so a method can never reach coordinator state from a client.

Lifecycle of a run (rounds are numbered from 1)::

    coordinator.setup(federation)
    profiles = coordinator.configure_profile()                     # {} (the default): no exchange
    scores = {cid: client.client_profile(ctx[cid], ins) ...}       # scalars, once, before round 1
    coordinator.server_profile(scores)
    for round in 1..R:
        for step in range(coordinator.round_steps(round)):         # 1 unless the method chains
            instructions = coordinator.configure_round(round)      # {client_id: Instruction}
            replies = {cid: client.client_update(ctx[cid], ins) ...}   # on each client
            coordinator.server_update(round, replies)
        checks = coordinator.configure_validate(round)             # {} (the default): no exchange
        scores = {cid: client.client_validate(ctx[cid], ins) ...}  # scalars, on each client
        coordinator.server_validate(round, scores)
        if round is evaluated (eval_every, and always the last):
            evals = coordinator.configure_evaluate(round)          # {client_id: Instruction}
            model = client.client_eval_model(ctx[cid], evals[cid])  # evaluated at the client
            coordinator.server_evaluate(round, results)            # the scalars of every split
        coordinator.mechanisms(round), coordinator.mechanism_warnings(round)   # mechanisms.csv, warnings
        checkpoint(coordinator.state_dict())
        if early stopping (fl.early_stopping) decides to stop: leave the loop
    if early stopping: coordinator.load_state_dict(the best round's checkpoint)
    coordinator.finalize()
    for name, rows in coordinator.final_tables().items():           # {} (the default): none
        <name>.csv in the run directory
    for name, (spec, state) in coordinator.final_models().items():   # {} (the default): none
        scores of the model on the public test split (at the coordinator) and on every
        client's own splits (at the client), in final_metrics.csv

A client's ``ctx.state`` is the state it saved last: a second step of the same round
(``round_steps`` > 1) and the validation exchange see what the first step left.

Messages carry tensors and scalars only (see :mod:`medfl.messages`).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn

from medfl.config_values import ConfigError, read_plugin_values
from medfl.context import ClientContext
from medfl.messages import RELEASE_FLAG, Instruction, Reply
from medfl.preset import SOURCE_KINDS, Preset, parse_source
from medfl.privacy.declared import OwnDp
from medfl.privacy.feature_release import method_release
from medfl.seeding import derive_seed, round_half_up

__all__ = ["Configurable", "Federation", "Method", "MethodConfigError", "EvalResults", "ClientContext", "Preset",
           "OwnDp", "SOURCE_KINDS", "parse_source", "derive_seed", "ENGINE_TRAIN_METRICS", "REPORTED_EXCHANGES"]

#: What the clients reported from one evaluation: ``{client_id: {split: {metric: value}}}``
#: (splits named as in ``metrics.csv``'s rows before the ``local_`` prefix: ``test``, ``val``,
#: ``global_test``, ``cross_test``; ``cross_test@<peer>`` holds one peer's scores).
EvalResults = dict[str, dict[str, dict[str, float]]]


#: The training metrics the engine's local training reports (``train_epochs``: ``loss``,
#: ``steps``; ``train_epochs_dp`` adds the ``dp_*`` values): :attr:`Method.train_metrics`'s default.
ENGINE_TRAIN_METRICS: frozenset[str] = frozenset({"loss", "steps", "dp_steps", "dp_sample_rate", "dp_noise_multiplier"})

#: The exchanges whose value names a method declares (:meth:`Method.reported_names`): a
#: reply's ``metrics`` (``train``), :meth:`Method.client_validate`'s and
#: :meth:`Method.client_profile`'s scalars.
REPORTED_EXCHANGES = ("train", "validate", "profile")


class MethodConfigError(ValueError):
    """A method refuses its settings: a hyperparameter it does not accept, or one that does
    not fit the run's training settings. Import it as ``from medfl import MethodConfigError``.

    Raise it from ``__init__`` (the hyperparameters alone: checked when the config is read)
    or from :meth:`Method.setup` (where the method first sees the
    :class:`Federation`: rounds, clients, ``train``, models, the public dataset). Either way
    the run stops before its first round with one ``medfl: error: MESSAGE`` line (``medfl
    run``, a bundle's ``python -m monai.bundle run``, and ``medfl flower run``, where ``setup``
    runs at the coordinator) and leaves no run directory. Name the setting, the value and what
    would be accepted in the message. Any other exception from ``setup`` (a plain
    ``ValueError`` included) is taken for a bug: its traceback, and the run directory kept
    for a look (``medfl runs`` lists it as crashed).
    """


@dataclass
class Federation:
    """What the coordinator knows about a federation: ids, sizes and settings, no data.

    Attributes:
        client_ids: clients that take part in training rounds (a single ``"pooled"``
            client for methods with ``pools_data``).
        eval_client_ids: clients whose models are evaluated each round (all real clients).
        num_examples: number of local training examples per client.
        num_classes: number of classes.
        rounds: total number of rounds.
        seed: run seed.
        fraction: fraction of ``client_ids`` sampled each round (at least one client).
        model: the model spec ``{"name": ..., **kwargs}``; ``client_models`` overrides it
            per client (heterogeneous federations).
        client_models: per-client model overrides ``{client_id: {kwarg: value}}``.
        train: local-training settings (epochs, batch_size, lr, optimizer, ...).
        device: torch device string.
        public: the coordinator's public dataset (``fl.public_dataset``, a
            :class:`medfl.public.PublicData`: ``dataset(split)``, ``loader(split)``,
            splits ``train`` and ``test``), or ``None``. It exists only at the coordinator:
            clients never see a :class:`Federation`, so no client code can reach it.
    """

    client_ids: list[str]
    eval_client_ids: list[str]
    num_examples: dict[str, int]
    num_classes: int
    rounds: int
    seed: int
    fraction: float = 1.0
    model: dict[str, Any] = field(default_factory=dict)
    client_models: dict[str, dict[str, Any]] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)
    device: str = "cpu"
    in_channels: int = 1
    spatial_dims: int = 2
    public: Any = None

    def sample(self, round: int) -> list[str]:
        """Clients sampled for ``round``: seeded by (seed, round) only, so every method
        sees the same clients for the same seed. With ``fraction == 1`` all clients."""
        ids = list(self.client_ids)
        if self.fraction >= 1.0:
            return ids
        m = max(1, int(round_half_up(self.fraction * len(ids))))
        rng = np.random.default_rng(derive_seed(self.seed, "sample", round))
        chosen = rng.choice(len(ids), size=m, replace=False)
        return [ids[i] for i in sorted(chosen)]

    def model_spec(self, client_id: str | None = None) -> dict[str, Any]:
        """The model spec for a client (global spec merged with its overrides)."""
        return {**self.model, "spatial_dims": self.spatial_dims, "in_channels": self.in_channels,
                "num_classes": self.num_classes, **self.client_models.get(client_id, {})}

    def build_model(self, client_id: str | None = None, *, seed_tag: Any = "init") -> nn.Module:
        """Build a freshly initialised model (seeded by run seed, tag and client id)."""
        from medfl.models.registry import build_seeded

        return build_seeded(self.model_spec(client_id), derive_seed(self.seed, seed_tag, client_id or "global"))


class Configurable:
    """Something built from a config entry ``{"name": ..., **parameters}``: a method or a
    reply filter. Its parameters are the keyword arguments of ``__init__`` (with defaults);
    :meth:`from_config` refuses any other key."""

    name: ClassVar[str] = ""
    _kind: ClassVar[str] = "plugin"   # for error messages: "method", "filter"

    @classmethod
    def parameters(cls) -> dict[str, Any]:
        """The hyperparameters and their defaults, from ``__init__``'s signature."""
        params = inspect.signature(cls.__init__).parameters.items()
        return {n: None if p.default is p.empty else p.default for n, p in params
                if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    @classmethod
    def from_config(cls, params: dict[str, Any]) -> Any:
        """Instantiate from a config dict, refusing unknown parameters; boolean parameters are
        read with :func:`medfl.config.read_bool` (``"false"``, ``"no"``, 0: ``False``).

        Raises:
            MethodConfigError: naming the unknown keys and listing the valid ones, or a value
                that is not a boolean for a boolean parameter.
        """
        valid = cls.parameters()
        unknown = sorted(set(params) - set(valid))
        if unknown:
            raise MethodConfigError(f"{cls._kind} {cls.name!r} has no parameter(s) {', '.join(map(repr, unknown))}; "
                                    f"valid parameters: {', '.join(sorted(valid)) or '(none)'}")
        try:   # a boolean hyperparameter reads "false", "no", 0 as False, as every config boolean does
            params = read_plugin_values(inspect.signature(cls.__init__).parameters, dict(params),
                                        f"{cls._kind} {cls.name!r}", sizes=False)
        except ConfigError as exc:
            raise MethodConfigError(str(exc)) from None
        return cls(**params)

    def hparams(self) -> dict[str, Any]:
        """The values of this instance's hyperparameters (for the resolved config)."""
        return {k: getattr(self, k, v) for k, v in self.parameters().items()}


class Method(Configurable):
    """Base class of every federated-learning method (one subclass per method).

    Subclasses set ``name`` (the registry name), ``description``, and accept their
    hyperparameters as keyword arguments of ``__init__`` (with defaults); the config's
    method section is checked against that signature.

    Class attributes:
        name: registry name, e.g. ``"fedavg"``.
        description: one line for ``medfl plugins``.
        pools_data: the engine pools every client's training data into one ``"pooled"``
            client (the Centralized reference); not available in a federated deployment.
        reply_state: the reply-payload keys that carry model state (a flat dict of tensors,
            e.g. a state dict), each mapped to the instruction-payload key holding the state
            the client started from (``None``: no such reference). Reply filters
            (``fl.filters``: quantization, ``dp_gaussian``...) transform exactly these
            entries; a filter that works on the update (``dp_gaussian``: returned minus
            received) needs the reference. Empty (the default): the reply carries no model
            state and no filter can be applied.
        supports_dp_sgd: the method's local training honours ``train.dp`` (DP-SGD with
            Opacus, :mod:`medfl.privacy.dp_sgd`); a run asking for ``train.dp`` with another
            method is refused before training.
        secure_aggregation: the coordinator needs the clients' replies only through their
            mean weighted by ``num_examples``, so ``fl.secure_aggregation`` (Flower's SecAgg+,
            :mod:`medfl.flower.secagg`) may hide every individual reply from it. A method that
            sets it promises: every reply carries only its ``reply_state`` entries, each with a
            reference in the instruction, and :meth:`server_update` does the same when handed,
            instead of the clients' replies, one reply (client id
            :data:`medfl.messages.SECURE_AGGREGATE`) whose entries are that weighted mean and
            whose ``num_examples`` is the clients' total. Default ``False``: a method that
            weighs, selects or scores individual replies (robust aggregation, FedKPer's scores,
            clustering, peer-to-peer) is refused with it. An instance attribute may refine it
            (FedAvg with a robust ``aggregation`` sets it ``False``).
        presets: named settings (:class:`Preset`) an entry selects with ``"preset"``, e.g.
            ``"paper"`` (every value the paper states) and ``"authors"`` (the authors'
            published code where it differs from the paper).
        train_metrics: every name a reply's ``metrics`` may carry (default
            :data:`ENGINE_TRAIN_METRICS`, what the engine's local training reports). A name is
            a free string leaving the site, so it is declared with the method's code, before
            round 1: a reply with any other name is refused at the client (the run stops
            naming the method and the name) and dropped at the coordinator
            (``reply_events.csv``). A method that reports more extends the default
            (``train_metrics = ENGINE_TRAIN_METRICS | {"ce_dam"}``).
        validate_metrics: every name :meth:`client_validate` may return (default none),
            checked the same way.
        profile_metrics: every name :meth:`client_profile` may return (default none),
            checked the same way.
        min_train_samples: the fewest training samples every client needs (default 1): a
            split that leaves a client fewer is refused before the run directory is created,
            in one line naming the client and what to change (FedSKD's P2P training needs a
            batch of two).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    pools_data: ClassVar[bool] = False
    reply_state: ClassVar[dict[str, str | None]] = {}
    supports_dp_sgd: ClassVar[bool] = False
    secure_aggregation: bool = False
    presets: ClassVar[dict[str, Preset]] = {}
    train_metrics: ClassVar[frozenset[str]] = ENGINE_TRAIN_METRICS
    validate_metrics: ClassVar[frozenset[str]] = frozenset()
    profile_metrics: ClassVar[frozenset[str]] = frozenset()
    min_train_samples: ClassVar[int] = 1
    _kind: ClassVar[str] = "method"

    federation: Federation

    # ---------------------------------------------------------------- coordinator side
    def setup(self, federation: Federation) -> None:
        """Build the initial coordinator state. Default: remember the federation.

        Raises:
            MethodConfigError: a hyperparameter does not fit the run (its rounds, clients,
                training settings, models or public dataset); the run stops with that one
                line and leaves no directory (see :class:`MethodConfigError`).
        """
        self.federation = federation

    def configure_profile(self) -> dict[str, Instruction]:
        """Who reports a profile before round 1, and with what (e.g. PFedCDP asks every
        client for its capability scores to cluster them). The engine runs this exchange
        once, before the first round of a run (again only if the run is resumed before its
        first checkpoint); :meth:`server_profile` stores what it needs in the coordinator
        state, which the checkpoints keep. Default: nobody (no exchange; nothing is sent)."""
        return {}

    def server_profile(self, results: dict[str, dict[str, float]]) -> None:
        """Receive the scalars each client's :meth:`client_profile` returned (only clients
        that answered), before round 1. Default: nothing."""

    def round_steps(self, round: int) -> int:
        """How many train steps ``round`` has (default 1). The engine calls
        :meth:`configure_round`, the clients and :meth:`server_update` that many times in the
        round, so a method can chain clients within a round (FedCross visits them one after
        another); evaluation and the checkpoint follow the last step."""
        return 1

    def configure_round(self, round: int) -> dict[str, Instruction]:
        """Who trains in ``round`` and with what. Default: sampled clients, empty payload."""
        return {cid: Instruction() for cid in self.federation.sample(round)}

    def server_update(self, round: int, replies: dict[str, Reply]) -> None:
        """Fold the clients' replies into the coordinator state. Default: nothing."""

    def configure_validate(self, round: int) -> dict[str, Instruction]:
        """Who runs :meth:`client_validate` after the training steps of ``round``, and with
        what (e.g. FedSDC+ sends every head to rank them on each client's validation split).
        Default: nobody (no validation exchange; nothing is sent)."""
        return {}

    def server_validate(self, round: int, results: dict[str, dict[str, float]]) -> None:
        """Receive the scalars each client's :meth:`client_validate` returned in ``round``
        (only clients that answered). Runs before the round's evaluation and checkpoint, so
        what it stores in the coordinator state is checkpointed with the round. Default: nothing."""

    def configure_evaluate(self, round: int) -> dict[str, Instruction]:
        """What each client needs to build its evaluation model. Default: nothing."""
        return {cid: Instruction() for cid in self.federation.eval_client_ids}

    def server_evaluate(self, round: int, results: EvalResults) -> None:
        """Receive the evaluation scalars of ``round`` (what ``metrics.csv`` gets), per client
        and split, before the round's checkpoint. Called only in rounds that are evaluated
        (``eval_every``, and always the last); clients that did not answer are absent.
        Default: nothing."""

    def finalize(self) -> None:
        """Post-hoc stages after the last round (server refinement, ensembles). Default: none."""

    def final_models(self) -> dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]]:
        """Models the coordinator built in :meth:`finalize` that the run should score:
        ``{name: (model spec, state dict)}``, the spec naming a registered model
        (``{"name": "pfedcdp_student", ...}``; ``spatial_dims``, ``in_channels`` and
        ``num_classes`` are filled in from the dataset when absent). The engine scores each
        on the public test split at the coordinator (``fl.public_dataset``) and sends it to
        every evaluated client, which scores it on its own splits (``eval_splits`` but
        ``cross_test``) and returns only metrics: ``final_metrics.csv`` and the summary's
        ``final_models`` block. Default: none."""
        return {}

    def final_tables(self) -> dict[str, list[dict[str, Any]]]:
        """Tables the coordinator built in :meth:`finalize` for a person to read (PFedCDP's
        student after every refinement epoch, the paper's Fig. 3): ``{name: rows}``, each row a
        flat dict of numbers (or ``None``) and short strings; rows may have different keys (a
        missing value is empty in the file). The engine writes each table as ``<name>.csv`` in
        the run directory right after :meth:`finalize`; a name is lowercase letters, digits and
        underscores and not one of the engine's own files (``metrics``, ``final_metrics``,
        ``mechanisms``...: :data:`medfl.engine.evaluation.ENGINE_TABLES`). Default: none."""
        return {}

    def report(self) -> dict[str, Any]:
        """What the method wants a person to read about the run (JSON values: PFedCDP's
        clusters, teacher weights and Shapley values), written to ``summary.json`` under
        ``method_report`` at the end of the run. Default: nothing."""
        return {}

    def mechanisms(self, round: int) -> list[dict[str, Any]]:
        """What the method's own mechanisms did in ``round``, for a person to check that they
        act (FedTPF's stop condition and decay weights, PFedCDP's noise-to-update ratio,
        FedSDC's per-head accuracy and vote ties): rows of ``mechanisms.csv``.

        Each row is a flat dict: ``mechanism`` (what acted: ``"stop_condition"``), ``scope``
        (``"client"``, ``"cluster"``, ``"head"``, ``"run"``...) and ``id`` (which one), then
        named numbers or short strings (``{"alpha": 0.93, "stop_round": "cap"}``); the engine
        writes one line per value (``round, mechanism, scope, id, name, value``). Asked after
        every round (evaluated or not), before its checkpoint, so it must follow from the
        coordinator state (what the replies, validation and evaluation scalars brought).
        Default: none."""
        return []

    def scored_from(self, round: int) -> int | None:
        """The first round whose evaluated models the method's own mechanism shaped, as known
        after ``round`` (asked after every round, from the coordinator state): FedTPF/FedFed
        the first round trained with the shared set, PFedCDP the first round whose personal
        models saw a noisy or distilled update. ``None``: no such round yet (still in a first
        stage). Early stopping and :mod:`medfl.arm_report` choose the best round among the
        rounds from it on (earlier rounds are recorded, never the best round, and do not count
        toward patience). Once it names a round it keeps naming it
        (:meth:`medfl.engine.runner.Run.ask_scored_from` stops the run otherwise); name it
        as soon as it is known, at the latest after that round itself: a round named later
        may have lost its checkpoint (``keep_checkpoints``), which stops the run too.
        The engine keeps the answer in every checkpoint, in ``summary.json``'s ``selection``
        block and, for a method that overrides this hook, in ``mechanisms.csv`` (mechanism
        ``selection``). Default: 1 (every round)."""
        return 1

    def mechanism_warnings(self, round: int) -> list[str]:
        """Why one of the method's mechanisms cannot act, as found in ``round`` (``"the
        release's noise is 31x the clipped signal: the shared features carry no label
        information"``): each is printed on stderr once, with the method's label and the
        round, and kept in ``summary.json``'s ``warnings``. Asked after :meth:`mechanisms`;
        return a warning in the round its evidence appears, not again. Default: none."""
        return []

    def client_groups(self) -> dict[str, str]:
        """A group name per client (PFedCDP's capability clusters), for per-group curves and
        final metrics (``groups.csv``, the summary's ``groups`` block, ``plots/groups.png``).
        Asked at the end of a run. Default: no groups."""
        return {}

    def default_filters(self) -> list[dict[str, Any]]:
        """Reply filters this method always applies (e.g. PFedCDP's clipping, noise and 8-bit
        quantization of its update), as config entries ``{"name": ..., **parameters}``.
        They run before the run's configured ``filters`` and are planned, applied at each
        client, undone at the coordinator and accounted (``privacy.csv``) exactly like them.
        Default: none."""
        return []

    def release_plan(self) -> Any:
        """The per-sample release of this method (FedTPF's shared features), which medfl
        performs: a :class:`medfl.privacy.feature_release.SampleRelease` naming the reply keys
        of the features (and of their labels), the clip and the noise, or ``None`` (the
        default: the method releases nothing per sample). The method's client step returns
        the features *unnoised* under those keys in its reply to an instruction whose config
        carries ``"dp_release": True``; medfl clips and noises them at the client after the
        method's code returned, the content guard checks what leaves, and the ledger records
        this plan. A release key in any other reply is refused. Computed from the method's
        hyperparameters alone: the run asks for it before :meth:`setup`, and each client asks
        its own instance again when it performs the release. A release with
        ``noise_multiplier`` 0 is a non-private measurement: its epsilon is recorded as
        infinite."""
        return None

    def own_dp(self, federation: Federation) -> OwnDp | None:
        """The differential privacy this method applies in its own client step, as an
        :class:`OwnDp` (accounted by the run, ``performed_by: method`` in the summary), or
        ``None`` (the default: the method adds no noise itself). Asked once at the coordinator
        before training, with the run's federation (each client's ``num_examples``, the
        ``train`` settings), so per-client steps and sampling rates can be computed from it.
        Each client must report the noise applications of every local update in the
        training metric ``steps_metric``."""
        return None

    def round_releases(self, round: int) -> list[str]:
        """The clients this round's instructions asked for the release of
        :meth:`release_plan` (instructions whose config carries ``"dp_release": True``),
        asked after the round's training steps. The privacy ledger records one release per
        client named here, whether or not its reply arrived (a lost reply may have been
        seen). Default: none."""
        return []

    def check_reply(self, client_id: str, instruction: Instruction, reply: Reply) -> str:
        """Why the coordinator cannot take ``reply`` (a short reason), or ``""``. Called for
        every reply before :meth:`server_update`, after the engine's own checks (declared
        metric names, the declared num_examples (an integer >= 1), the declared payload keys
        (:meth:`reply_keys`), finite values in the payload and the metrics, model states
        shaped like the state sent, an update norm within ``fl.update_norm_factor`` times the
        step's median); a reply with a reason is dropped from the round and the client's failures
        counted (``max_reply_failures``). Default: ``""``."""
        return ""

    def reported_names(self, exchange: str, instruction: Instruction) -> frozenset[str]:
        """The value names a client's answer to ``instruction`` may carry in ``exchange``
        (``"train"``: the reply's ``metrics``; ``"validate"``, ``"profile"``: the scalars of
        :meth:`client_validate`, :meth:`client_profile`). Both ends ask it: the client
        before its answer leaves (another name stops the run, naming the method and the
        name), the coordinator when it arrives (the answer is dropped, the site named in
        ``reply_events.csv``). Computed from the method's class, hyperparameters and the
        instruction alone, never from the client's data. Default: the class attribute
        ``<exchange>_metrics``. Override it for names numbered after something the
        instruction carries (FedSDC's ``micro_f1_<i>`` for each head it sends)."""
        return frozenset(getattr(type(self), f"{exchange}_metrics"))

    def reply_keys(self, instruction: Instruction) -> frozenset[str]:
        """The payload keys a client's reply to ``instruction`` carries: every one of them,
        and no other. Both ends ask it, as :meth:`reported_names`: the client before its reply
        leaves (a missing or another key stops the run, naming the method and the key), the
        coordinator when it arrives (the reply is dropped, the site named in
        ``reply_events.csv``, so a reply without its model never reaches
        :meth:`server_update` and no extra tensor rides along). Computed from the method's
        class, hyperparameters and the instruction alone. Default: the :attr:`reply_state`
        keys, or, in a reply to an instruction that asks for the method's per-sample release
        (:meth:`release_plan`, config ``"dp_release": True``), the release's feature and
        label keys. Override it when a reply carries more (FedDisco's ``discrepancy``) or
        differs by stage (FedTPF's ``distill``)."""
        plan = method_release(self)
        if plan is not None and instruction.config.get(RELEASE_FLAG) is True:
            return frozenset(plan.keys) | frozenset([plan.labels] if plan.labels else [])
        return frozenset(type(self).reply_state)

    def expected_num_examples(self, instruction: Instruction, train_size: int) -> int:
        """The ``num_examples`` a client's reply to ``instruction`` must carry, given the
        size of its training split (``train_size``: what the partition gives the client;
        the coordinator knows it from the partition). Both ends check it, as
        :meth:`reported_names`: a number that could be anything up to the split size could
        encode the client's labels. Default: ``train_size``. A method that trains on a
        subsample declares its count here, from the instruction and the size alone
        (e.g. ``min(train_size, int(instruction.config["subsample"]))``)."""
        return int(train_size)

    def state_dict(self) -> dict[str, Any]:
        """Coordinator state to checkpoint (tensors and scalars). Default: empty."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore coordinator state written by :meth:`state_dict`."""

    # ---------------------------------------------------------------- client side
    def client_update(self, client: ClientContext, instruction: Instruction) -> Reply:
        """Run on one client: train and reply. Must be overridden."""
        raise NotImplementedError(f"method {self.name!r} does not implement client_update")

    def client_profile(self, client: ClientContext, instruction: Instruction) -> dict[str, float]:
        """Run on one client when :meth:`configure_profile` addresses it, before round 1:
        return a flat dict of numbers about the client (capability scores...). Checked like
        a reply (numbers only, nothing that repeats the client's labels or images).
        ``client.deployed`` tells whether it runs on the client's own machine (a Flower
        site, where it can measure it) or in a simulation; ``client.coordinator`` is the
        coordinator's address where the site knows it."""
        raise NotImplementedError(f"method {self.name!r} addressed clients in configure_profile "
                                  "but does not implement client_profile")

    def client_validate(self, client: ClientContext, instruction: Instruction) -> dict[str, float]:
        """Run on one client when :meth:`configure_validate` addresses it: compute scalars
        (e.g. each head's micro-F1 on ``client.dataset("val")``) for :meth:`server_validate`.

        Returns a flat dict of numbers; it is checked like a reply (numbers only, nothing
        that repeats the client's labels or images). ``client.state`` may be read and
        updated (it is saved again after the exchange)."""
        raise NotImplementedError(f"method {self.name!r} addressed clients in configure_validate "
                                  "but does not implement client_validate")

    def client_eval_model(self, client: ClientContext, instruction: Instruction) -> nn.Module:
        """Run on one client: the model whose predictions are this client's evaluation.

        The returned module maps a batch ``(B, C, H, W[, D])`` to logits ``(B, K)``, which
        the engine turns into probabilities with a softmax. A module that computes class
        probabilities itself (a mean of softmaxes, vote fractions) sets the attribute
        ``returns_probabilities = True`` (see :class:`medfl.models.ProbabilityModel`); its
        rows must be non-negative and sum to 1. Must be overridden.

        Global Test (``cross_test``) over Flower scores this model at the other sites: they
        rebuild its structure with :meth:`eval_model_skeleton` and load its state dict.
        """
        raise NotImplementedError(f"method {self.name!r} does not implement client_eval_model")

    def eval_model_skeleton(self, client: ClientContext, instruction: Instruction) -> nn.Module:
        """A module with the structure of ``client``'s evaluation model, whose weights are
        then replaced by the evaluated model's state dict (``load_state_dict(strict=True)``).

        Used where a client's evaluation model is scored away from that client: ``cross_test``
        over Flower, where each site scores every other site's model on its own test split.
        ``client`` is then a context of the model's owner that holds **no data and no state**
        (its ``model_spec``, ``train`` settings, ``seed`` and ``client_id`` are the owner's),
        and ``instruction`` is the owner's evaluation instruction. The default calls
        :meth:`client_eval_model` on that context, which is right whenever the evaluation
        model's structure follows from the model spec and the instruction (every built-in
        method). Override it when the structure depends on the client's state.
        """
        return self.client_eval_model(client, instruction)
