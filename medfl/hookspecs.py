"""The medfl plugin contract: pluggy markers and hook specifications.

Every extension point of medfl is one of the hooks below. Built-in methods, models,
partitioners, datasets and metrics are plugins answering these hooks, loaded through the
``medfl`` entry-point group exactly like third-party packages.

Registration hooks receive a ``register`` callable built by the host; a plugin calls
``register(obj)`` (or ``register(obj, name="...")``) once per thing it provides. Every name
is also reachable qualified, ``dist:name``; a bare name two plugins register is refused
only where it is used, naming both qualified names (docs/plugins.md, "Names, clashes and
versions"). Event hooks are called for every plugin
that implements them; their return values are ignored.
"""

from __future__ import annotations

from typing import Any, Callable

from pluggy import HookimplMarker, HookspecMarker

__all__ = ["hookspec", "hookimpl", "PLUGIN_API_VERSION"]

#: The version of this plugin contract, ``"MAJOR.MINOR"``. MINOR grows when the contract
#: gains something (a hook, a method attribute, a keyword) that existing plugins need not
#: know; MAJOR grows when something a plugin may rely on is removed or changes meaning
#: (after a deprecation period: docs/plugins.md). A plugin states what it needs with a
#: module- or class-level ``requires_medfl_api = ">=1.0,<2"``.
PLUGIN_API_VERSION = "1.0"

hookspec = HookspecMarker("medfl")
hookimpl = HookimplMarker("medfl")

Register = Callable[..., None]


@hookspec
def register_methods(register: Register) -> None:
    """Register federated-learning methods.

    Called once when the registry is first built. Call ``register(MethodClass)`` for each
    :class:`medfl.Method` subclass; the name is ``MethodClass.name``.
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model factories.

    Call ``register(factory, name="resnet18")``. A factory takes keyword-only arguments
    (``spatial_dims``, ``in_channels``, ``num_classes``, which the engine passes from the
    dataset, and its own options such as ``width``, which a config's model spec sets) and
    returns a :class:`torch.nn.Module` following the :class:`medfl.models.FeatureModel`
    protocol (``forward``, ``forward_features``, ``embed`` and ``embed_dim``, ``head``,
    ``head_prefix``, ``body_keys``, ``head_keys``). An inner registered model is built with
    :func:`medfl.models.registry.build_model`. docs/plugins.md, *Writing a model plugin*,
    walks through the example plugin's ``stem_cnn``.
    """


@hookspec
def register_partitioners(register: Register) -> None:
    """Register partitioners that split a dataset's training pool across clients.

    Call ``register(func, name="dirichlet")``. ``func(table, num_clients, seed, **params)``
    receives the manifest table (a :class:`pandas.DataFrame` with at least a ``label``
    column) and returns ``{client_id: numpy array of row positions}``. A partitioner with a
    ``group_column`` parameter gets the run's ``fl.group_column`` (unless the partition spec
    sets one; ``None``: no grouping) and should keep rows sharing that column at one client.
    """


@hookspec
def register_datasets(register: Register) -> None:
    """Register dataset sources.

    Call ``register(factory, name="synthetic2d")``. ``factory(**params)`` returns a
    :class:`medfl.data.FederatedSource`: the manifest table plus a way to build a
    :class:`torch.utils.data.Dataset` from a subset of its rows.
    """


@hookspec
def register_metrics(register: Register) -> None:
    """Register per-client evaluation metrics.

    Call ``register(func, name="auc")``. ``func(y_true, probs)`` takes integer labels of
    shape ``(N,)`` and class probabilities of shape ``(N, C)`` and returns a float.
    """


@hookspec
def register_filters(register: Register) -> None:
    """Register reply filters.

    Call ``register(FilterClass)`` for each :class:`medfl.filters.Filter` subclass; the name
    is ``FilterClass.name``. A run names a chain of them in ``fl.filters`` (or a method
    entry's ``filters``); each transforms the model state of a client's reply at the client
    and is undone at the coordinator (see :mod:`medfl.filters` and docs/plugins.md).
    """


@hookspec
def register_backends(register: Register) -> None:
    """Register backends: where an experiment's runs meet their clients.

    Call ``register(BackendClass)`` for each :class:`medfl.backend.Backend` subclass; the
    name is ``BackendClass.name``, which ``fl.backend`` (or ``medfl run --backend``) chooses.
    The registry builds it with no arguments; the experiment runs (or resumes, with ``path``)
    inside its ``runs(cfg, path=None)``, a context manager giving ``(run_factory, meta)`` (see
    :mod:`medfl.backend` and docs/plugins.md).
    A backend whose clients run elsewhere overrides ``resume_command(path, record)`` (the
    command every "continue with" hint names) and ``check_resume(path)`` (refuse ``medfl
    resume`` there, naming that command).
    """


@hookspec
def register_trackers(register: Register) -> None:
    """Register experiment trackers: where params, per-round scalars, artifacts and final
    models go (MLflow, TensorBoard...).

    Call ``register(TrackerClass)`` for each :class:`medfl.tracking.Tracker` subclass; the
    name is ``TrackerClass.name``, which ``fl.tracking`` (or ``medfl run --tracking``)
    chooses. The experiment builds it with its directory and the options of its
    ``fl.tracking`` entry (checked against ``TrackerClass.options``) and calls it from a
    background thread of its own; a tracker that raises, or whose call has not returned
    ``medfl.tracking.TRACKER_WAIT_S`` after it began, is left out (logged, and named in each
    finished run's ``summary.json``) and the run goes on (see :mod:`medfl.tracking` and
    docs/plugins.md).
    """


@hookspec
def on_run_start(run: Any) -> None:
    """Called once when a run starts or resumes, before its first round.

    ``run`` is the :class:`medfl.engine.Run` (``run.run_dir``, ``run.config``, ``run.start_round``).
    """


@hookspec
def on_client_end(run: Any, round: int, client_id: str, metrics: dict[str, float]) -> None:
    """Called after a client's update in a round has been received by the coordinator.

    ``metrics`` holds the scalars the client reported for its local training.
    """


@hookspec
def on_round_end(run: Any, round: int, metrics: list[dict[str, Any]]) -> None:
    """Called after each round has been aggregated, evaluated and checkpointed.

    ``metrics`` holds one row per (client, split) with the evaluation metrics of the round.
    """


@hookspec
def on_run_end(run: Any, summary: dict[str, Any]) -> None:
    """Called once when a run has finished all its rounds, after the summary is written.

    Loggers, plotters and export plugins answer this hook; ``summary`` is the content of
    ``summary.json``.
    """
