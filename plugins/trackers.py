"""Built-in trackers: ``mlflow`` and ``tensorboard`` (see :mod:`medfl.tracking`).

- ``mlflow``: the experiment is one MLflow run and each method run a run nested under it
  (``mlflow.parentRunId``), through :class:`mlflow.tracking.MlflowClient`: params and each
  round's scalars in ``log_batch`` calls, each finished method run's headline figures on the
  experiment's run, artifacts with ``log_artifact``, the final models with
  :func:`mlflow.pytorch.log_model` as TorchScript (they load where medfl is not installed).
  Every run is tagged as MLflow's own runs are (``mlflow.user``, ``mlflow.source.name``,
  ``mlflow.source.type``, ``mlflow.source.git.commit`` inside a git checkout, and what
  ``MLFLOW_RUN_CONTEXT`` adds) and with ``medfl.version``. The entry's ``uri`` and
  ``experiment`` win over ``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_NAME`` (or
  ``MLFLOW_EXPERIMENT_ID``); with neither, an embedded SQLite store ``mlflow.db`` (artifacts
  in ``mlartifacts/``) in the experiment directory: no server (MLflow 3 refuses the plain
  file store).
- ``tensorboard``: :class:`torch.utils.tensorboard.SummaryWriter` event files in
  ``tensorboard/<run>/`` of the experiment directory (one subdirectory per method run),
  scalars with ``step = round``.

MLflow and TensorBoard are imported when a run tracks with them, never when the plugin loads;
without them the tracker names ``pip install "medfl[tracking]"``.

A server that is down costs seconds: while the ``mlflow`` tracker talks to a server, MLflow's
HTTP client retries as :data:`MLFLOW_HTTP_DEFAULTS` says (MLflow's own defaults retry one call
for about 4 minutes), and :class:`medfl.tracking_feed.Tracking` stops waiting for a call after
``medfl.tracking.TRACKER_WAIT_S``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import threading
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, ContextManager, Iterator, TypeVar

from medfl import hookimpl
from medfl.config import ConfigError
from medfl.tracking import Tracker, missing_package, now_ms, run_status

__all__ = ["MLflow", "TensorBoard", "register_trackers", "MLFLOW_HTTP_DEFAULTS", "mlflow_http_defaults",
           "LAST_STEP_TAG", "VERSION_TAG", "run_tags", "git_commit", "scripted"]

#: MLflow's HTTP client settings while the ``mlflow`` tracker calls a server (``http://`` or
#: ``https://`` uri). MLflow's own (7 retries, backoff factor 2, 120 s timeout) make one call to
#: a server that is down take about 4 minutes; these give up on a refused connection in about
#: 3 s (2 retries, 0 s then 2-3 s apart), and each attempt waits 5 s for an answer (a server
#: that never answers is given up first by ``medfl.tracking.TRACKER_WAIT_S``, 10 s). A
#: variable already set in the environment wins over its value here (medfl sets only the ones
#: missing, for the length of each of its calls, and removes them after).
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
                        "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}

#: The tag holding the last round a run logged (read on a resume: nothing at or before it is
#: logged again, even if ``tracking.json`` was not written after it).
LAST_STEP_TAG = "medfl.last_step"
#: The tag holding the version of medfl that made a run (MLflow's own tags say the rest).
VERSION_TAG = "medfl.version"

_F = TypeVar("_F", bound=Callable[..., Any])


class _EnvDefaults:
    """Environment variables set while at least one block needs them (calls in several
    threads), each one only where the environment has none; removed when the last block ends."""

    def __init__(self, values: dict[str, str]) -> None:
        self.values = values
        self._lock = threading.Lock()
        self._users = 0
        self._added: list[str] = []

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._users == 0:
                self._added = [k for k in self.values if k not in os.environ]
                for k in self._added:
                    os.environ[k] = self.values[k]
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if self._users == 0:
                    for k in self._added:
                        if os.environ.get(k) == self.values[k]:   # not changed meanwhile
                            del os.environ[k]
                    self._added = []


#: ``with mlflow_http_defaults():`` :data:`MLFLOW_HTTP_DEFAULTS` in the environment, except those set.
mlflow_http_defaults = _EnvDefaults(MLFLOW_HTTP_DEFAULTS)


def _bounded(method: _F) -> _F:
    """An :class:`MLflow` method called with MLflow's HTTP retries bounded (:data:`MLFLOW_HTTP_DEFAULTS`)."""
    @functools.wraps(method)
    def call(self: "MLflow", *args: Any, **kwargs: Any) -> Any:
        with self._http():
            return method(self, *args, **kwargs)
    return call  # type: ignore[return-value]


def git_commit(folder: Path) -> str | None:
    """The commit checked out where ``folder`` is (``git rev-parse HEAD``), or ``None``: not
    in a git checkout, no ``git`` program, or no answer within 10 s."""
    try:
        out = subprocess.run(["git", "-C", str(folder), "rev-parse", "--verify", "-q", "HEAD"], capture_output=True,
                             text=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    commit = out.stdout.strip()
    return commit if out.returncode == 0 and len(commit) in (40, 64) else None


def run_tags() -> dict[str, str]:
    """The tags of every run the ``mlflow`` tracker starts: MLflow's own context tags, as its
    fluent API sets them (``mlflow.user``, ``mlflow.source.name``, ``mlflow.source.type``,
    those of ``MLFLOW_RUN_CONTEXT``...), ``mlflow.source.git.commit`` of the git checkout the
    run was started in (the current folder; else what MLflow found from the program's own
    file; none outside a checkout) and :data:`VERSION_TAG`."""
    import getpass
    import sys
    from importlib.metadata import PackageNotFoundError, version

    from mlflow.utils.mlflow_tags import MLFLOW_GIT_COMMIT, MLFLOW_SOURCE_NAME, MLFLOW_SOURCE_TYPE, MLFLOW_USER

    try:
        from mlflow.tracking.context.registry import resolve_tags

        tags = {str(k): str(v) for k, v in resolve_tags({}).items()}
    except Exception:  # noqa: BLE001 - MLflow's context providers are extras; the run is tagged anyway
        tags = {}
    if MLFLOW_USER not in tags:
        try:
            tags[MLFLOW_USER] = getpass.getuser()
        except Exception:  # noqa: BLE001 - no user name in this environment (a container without one)
            pass
    tags.setdefault(MLFLOW_SOURCE_NAME, sys.argv[0] if sys.argv and sys.argv[0] else "medfl")
    tags.setdefault(MLFLOW_SOURCE_TYPE, "LOCAL")
    commit = git_commit(Path.cwd())
    if commit and tags.get(MLFLOW_GIT_COMMIT) != commit:
        # MLflow's git tags (branch, repo URL) came from another checkout than the current folder's
        tags = {k: v for k, v in tags.items() if not k.startswith("mlflow.source.git.")}
        tags[MLFLOW_GIT_COMMIT] = commit
    try:
        tags[VERSION_TAG] = version("medfl")
    except PackageNotFoundError:   # a checkout that is not installed
        import medfl

        tags[VERSION_TAG] = str(getattr(medfl, "__version__", "unknown"))
    return tags


def scripted(model: Any, example: Any) -> tuple[Any, str]:
    """``model`` as TorchScript, which loads with ``torch`` alone (no medfl, no MONAI):
    scripted, else traced on ``example`` (a batch), each checked against the module's own
    output on ``example`` (:func:`monai.networks.utils.convert_to_torchscript`, as
    ``monai.bundle ckpt_export`` does).

    Returns:
        ``(script module, "torch.jit.script" | "torch.jit.trace")``, or ``(None, why)`` when
        neither works (``example`` is ``None`` and scripting failed, or both failed).
    """
    import copy

    from monai.networks.utils import convert_to_torchscript

    # on the CPU, as a copy: the logged module loads on a machine without a GPU
    model = copy.deepcopy(model).cpu().eval()
    example = None if example is None else example.detach().cpu()
    why = []
    for trace in (False, True):
        if trace and example is None:
            why.append("tracing needs an input example")
            break
        try:
            module = convert_to_torchscript(model, verify=example is not None, inputs=None if example is None
                                            else [example], use_trace=trace, rtol=1e-4, atol=1e-5)
            return module, "torch.jit.trace" if trace else "torch.jit.script"
        except Exception as exc:  # noqa: BLE001 - torch.jit raises many kinds; the reason is returned
            first = str(exc).splitlines()[0] if str(exc) else ""
            why.append(f"{'tracing' if trace else 'scripting'}: {type(exc).__name__}: {first}")
    return None, "; ".join(why)


def _chunks(items: list[Any], size: int) -> list[list[Any]]:
    return [items[i:i + size] for i in range(0, len(items), size)] or [[]]


class MLflow(Tracker):
    """MLflow: one parent run per experiment, a nested run per method run.

    Options: ``uri`` (a tracking URI: ``http://host:5000``, ``sqlite:///path/mlflow.db``;
    default: ``MLFLOW_TRACKING_URI`` when set, else ``sqlite:///<experiment dir>/mlflow.db``),
    ``experiment`` (MLflow's experiment name; default: ``MLFLOW_EXPERIMENT_NAME`` when set,
    else the experiment ``MLFLOW_EXPERIMENT_ID`` names, else the config's ``name``),
    ``run_name`` (the parent run's name; default: the experiment directory's name),
    ``artifact_location`` (where a new MLflow experiment keeps artifacts; default with the
    embedded store: ``<experiment dir>/mlartifacts``), ``per_client`` (``true``: each client's
    scalars too; default ``false``: the across-client means only).

    Each call to a server runs with MLflow's HTTP retries bounded (:data:`MLFLOW_HTTP_DEFAULTS`,
    unless the environment sets them), so a server that is down fails it in seconds.
    """

    name = "mlflow"
    description = "MLflow runs (nested per method run); embedded SQLite store unless uri names a server"
    options = {"uri": None, "experiment": None, "run_name": None, "artifact_location": None, "per_client": False}
    requires = ("mlflow",)

    def __init__(self, root: Path, **options: Any) -> None:
        super().__init__(root, **options)
        try:
            import mlflow  # noqa: F401
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise missing_package("mlflow", "mlflow", exc) from exc
        uri = self.settings["uri"]
        artifacts = self.settings["artifact_location"]
        where = "fl.tracking (mlflow).uri"
        if uri is None and os.environ.get("MLFLOW_TRACKING_URI", "").strip():
            uri, where = os.environ["MLFLOW_TRACKING_URI"].strip(), "MLFLOW_TRACKING_URI"
        if uri is None:
            uri = f"sqlite:///{(self.root / 'mlflow.db').resolve()}"
            artifacts = artifacts or (self.root / "mlartifacts").resolve().as_uri()
        elif not isinstance(uri, str) or ("://" not in uri and uri != "databricks") or uri.startswith("file:"):
            raise ConfigError(f"{where}: expected a tracking URI such as http://127.0.0.1:5000 or "
                              f"sqlite:///path/mlflow.db, got {uri!r} (MLflow 3 refuses the plain file store; "
                              "leave uri out and MLFLOW_TRACKING_URI unset for an embedded SQLite store in the "
                              "experiment directory)")
        self.uri = uri
        self.artifact_location = artifacts
        #: MLflow's HTTP retries bounded while calling a server; the embedded store makes no HTTP call
        self._http: Callable[[], ContextManager[Any]] = \
            mlflow_http_defaults if uri.startswith(("http://", "https://")) else nullcontext
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment_id: str | None = None
        #: run key -> (MLflow run id, the last round it logged before this session)
        self.runs: dict[str, tuple[str, int]] = {}
        self._tags: dict[str, str] | None = None

    def experiment_name(self, config_name: str | None) -> str | None:
        """The MLflow experiment's name: the entry's ``experiment``, else
        ``MLFLOW_EXPERIMENT_NAME``, else ``None`` when ``MLFLOW_EXPERIMENT_ID`` is set (that
        experiment), else ``config_name`` (the config's ``name``; ``"medfl"`` without one)."""
        for name in (self.settings["experiment"], os.environ.get("MLFLOW_EXPERIMENT_NAME", "").strip()):
            if name:
                return str(name)
        if os.environ.get("MLFLOW_EXPERIMENT_ID", "").strip():
            return None
        return str(config_name or "medfl")

    def _experiment(self, name: str | None) -> str:
        """The id of the experiment ``name`` (created when missing); ``None``: the one
        ``MLFLOW_EXPERIMENT_ID`` names, which must exist."""
        if self.experiment_id is None:
            if name is None:
                wanted = os.environ["MLFLOW_EXPERIMENT_ID"].strip()
                try:
                    self.experiment_id = self.client.get_experiment(wanted).experiment_id
                except Exception as exc:
                    raise ConfigError(f"MLFLOW_EXPERIMENT_ID={wanted!r}: no such experiment at {self.uri} "
                                      f"({type(exc).__name__}); set MLFLOW_EXPERIMENT_NAME or the entry's "
                                      "experiment instead") from exc
                return self.experiment_id
            found = self.client.get_experiment_by_name(name)
            self.experiment_id = found.experiment_id if found is not None else \
                self.client.create_experiment(name, artifact_location=self.artifact_location)
        return self.experiment_id

    @_bounded
    def start_run(self, key: str, name: str, params: dict[str, str], parent: dict[str, Any] | None,
                  saved: dict[str, Any] | None, last_step: int) -> dict[str, Any]:
        """Create the run (nested under ``parent``) and log ``params``; or set a saved run
        running again."""
        from mlflow.entities import Param, RunTag
        from mlflow.utils import validation

        if saved:
            run_id = str(saved["run_id"])
            run = self.client.get_run(run_id)
            self.experiment_id = run.info.experiment_id
            self.client.update_run(run_id, status="RUNNING")
            self.runs[key] = (run_id, max(last_step, int(run.data.tags.get(LAST_STEP_TAG, 0))))
            return dict(saved)
        exp = self._experiment(self.experiment_name(params.get("name")))
        if self._tags is None:
            self._tags = run_tags()
        tags = {**self._tags, "medfl.run": key or "(experiment)"}
        if parent and parent.get("run_id"):
            tags["mlflow.parentRunId"] = str(parent["run_id"])
        run_name = name if key else str(self.settings["run_name"] or name)
        run_id = self.client.create_run(exp, run_name=run_name, tags=tags).info.run_id
        klen = int(getattr(validation, "MAX_ENTITY_KEY_LENGTH", 250))
        vlen = int(getattr(validation, "MAX_PARAM_VAL_LENGTH", 500))
        items = [Param(k[:klen], v if len(v) <= vlen else v[:vlen - 3] + "...") for k, v in sorted(params.items())]
        for chunk in _chunks(items, int(getattr(validation, "MAX_PARAMS_TAGS_PER_BATCH", 100))):
            if chunk:
                self.client.log_batch(run_id, params=chunk)
        self.client.log_batch(run_id, tags=[RunTag(LAST_STEP_TAG, "0")])
        self.runs[key] = (run_id, 0)
        return {"run_id": run_id, "experiment_id": exp}

    def _log_scalars(self, run_id: str, scalars: dict[str, float], step: int, last_step: bool) -> None:
        """``scalars`` at ``step``, one ``log_batch`` per 1000; with ``last_step`` the last one
        also records ``step`` as logged (:data:`LAST_STEP_TAG`)."""
        from mlflow.entities import Metric, RunTag
        from mlflow.utils import validation

        ts = now_ms()
        items = [Metric(k, float(v), ts, int(step)) for k, v in sorted(scalars.items())]
        chunks = _chunks(items, int(getattr(validation, "MAX_METRICS_PER_BATCH", 1000)) - last_step)
        for i, chunk in enumerate(chunks):
            tags = [RunTag(LAST_STEP_TAG, str(int(step)))] if last_step and i == len(chunks) - 1 else []
            if chunk or tags:
                self.client.log_batch(run_id, metrics=chunk, tags=tags)

    @_bounded
    def log_metrics(self, key: str, metrics: dict[str, float], step: int) -> None:
        """One ``log_batch`` per 1000 scalars; the last one also records ``step`` as logged."""
        run_id, before = self.runs[key]
        if step > before:   # else logged before an interruption that tracking.json did not record
            self._log_scalars(run_id, metrics, step, last_step=True)

    @_bounded
    def log_summary(self, key: str, figures: dict[str, float], step: int) -> None:
        """The figures on the experiment's run (``<key>/<split>/<metric>``...), one
        ``log_batch`` per 1000 (not the per-round guard: each key is logged once, at the end
        of its run)."""
        if "" in self.runs:
            self._log_scalars(self.runs[""][0], figures, step, last_step=False)

    @_bounded
    def log_artifact(self, key: str, path: Path, artifact_path: str | None = None) -> None:
        """``MlflowClient.log_artifact``."""
        self.client.log_artifact(self.runs[key][0], str(path), artifact_path)

    @_bounded
    def log_model(self, key: str, name: str, model: Any, example: Any = None) -> None:
        """:func:`mlflow.pytorch.log_model` into the run (an MLflow logged model whose
        source run is this run) as TorchScript (:func:`scripted`), which
        ``mlflow.pytorch.load_model`` gives back where only ``torch`` and MLflow are installed
        (no medfl, no MONAI; requirements: ``torch``); with ``example`` (a batch) as its input
        example, from which MLflow infers the signature. A model that neither scripts nor
        traces is logged pickled, and its requirements then name ``medfl`` and ``monai`` (its
        classes are medfl's); the model's metadata says which (``medfl_format``)."""
        import inspect
        from importlib.metadata import PackageNotFoundError, version

        import mlflow
        import mlflow.pytorch
        import monai
        import torch

        run_id = self.runs[key][0]
        module, how = scripted(model, example)
        requirements = [f"torch=={torch.__version__.split('+')[0]}"]
        if module is None:
            try:
                requirements.append(f"medfl=={version('medfl')}")
            except PackageNotFoundError:   # a checkout that is not installed
                requirements.append("medfl")
            requirements.append(f"monai=={monai.__version__}")
        accepted = inspect.signature(mlflow.pytorch.log_model).parameters
        extra: dict[str, Any] = {}
        if "metadata" in accepted:
            extra["metadata"] = {"medfl_format": "torchscript" if module is not None else "pickle", "medfl_how": how}
        if "serialization_format" in accepted:   # MLflow 3's default, pt2, would need every model to export
            extra["serialization_format"] = "pickle"
        if example is not None:
            extra["input_example"] = example.detach().cpu().numpy()
        name_arg = "name" if "name" in accepted else "artifact_path"
        # the fluent API logs into the process-wide tracking URI (and MLFLOW_TRACKING_URI, which
        # processes started later inherit): set for this call only, then put back as it was
        from mlflow.tracking._tracking_service import utils as tracking_utils

        before, before_env = getattr(tracking_utils, "_tracking_uri", None), os.environ.get("MLFLOW_TRACKING_URI")
        mlflow.set_tracking_uri(self.uri)
        try:
            with mlflow.start_run(run_id=run_id):
                mlflow.pytorch.log_model(model.eval() if module is None else module, **{name_arg: name},
                                         pip_requirements=requirements, **extra)
        finally:
            mlflow.set_tracking_uri(before)
            if before_env is not None:
                os.environ["MLFLOW_TRACKING_URI"] = before_env

    @_bounded
    def end_run(self, key: str, status: str) -> None:
        """``MlflowClient.set_terminated`` with FINISHED, FAILED or KILLED (stopped, resumable)."""
        if key in self.runs:
            self.client.set_terminated(self.runs[key][0], status=run_status(status))


class TensorBoard(Tracker):
    """TensorBoard event files, one subdirectory per method run under ``log_dir`` (default:
    ``<experiment dir>/tensorboard``); the config as text, each round's scalars with
    ``step = round`` (``per_client``: each client's too; default: the across-client means).
    A continued run purges any event after its last logged round
    (``SummaryWriter(purge_step=...)``), so no step is written twice."""

    name = "tensorboard"
    description = "TensorBoard event files in the experiment directory (torch.utils.tensorboard)"
    options = {"log_dir": None, "per_client": False}
    requires = ("tensorboard",)

    def __init__(self, root: Path, **options: Any) -> None:
        super().__init__(root, **options)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise missing_package("tensorboard", "tensorboard", exc) from exc
        self._writer_class = SummaryWriter
        self.base = Path(self.settings["log_dir"] or self.root / "tensorboard")
        self.writers: dict[str, Any] = {}

    def start_run(self, key: str, name: str, params: dict[str, str], parent: dict[str, Any] | None,
                  saved: dict[str, Any] | None, last_step: int) -> dict[str, Any]:
        """A writer in ``log_dir/<key>`` (the experiment itself has none)."""
        if not key:
            return {}
        log_dir = self.base / key
        self.writers[key] = self._writer_class(str(log_dir), purge_step=last_step + 1 if saved else None)
        if not saved:
            self.writers[key].add_text("config", "\n".join(f"    {k} = {v}" for k, v in sorted(params.items())), 0)
        return {"log_dir": str(log_dir)}

    def log_metrics(self, key: str, metrics: dict[str, float], step: int) -> None:
        """``add_scalar`` per scalar, then a flush (the round is on disk)."""
        writer = self.writers[key]
        for tag, value in sorted(metrics.items()):
            writer.add_scalar(tag, value, int(step))
        writer.flush()

    def end_run(self, key: str, status: str) -> None:
        """Close the run's writer."""
        writer = self.writers.pop(key, None)
        if writer is not None:
            writer.close()

    def close(self) -> None:
        """Close every writer still open."""
        for key in list(self.writers):
            self.end_run(key, "stopped")


@hookimpl
def register_trackers(register: Any) -> None:
    """The built-in trackers."""
    register(MLflow)
    register(TensorBoard)
