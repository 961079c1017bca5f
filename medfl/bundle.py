"""Glue between MONAI bundle configs and the engine.

A bundle's ``configs/train.json`` holds the experiment in its ``fl`` section and runs it with
``"run": "$medfl.bundle.run(@fl)"``, so ``python -m monai.bundle run --config_file
bundles/<name>/configs/train.json --fl#rounds 3`` works like ``medfl run``.

:func:`run` and :func:`infer` are command-line entry points: a mistake in the config or the
data (an unknown method or parameter, a missing file...) ends the process with one line
``medfl: error: ...`` on stderr and exit code 2, as ``medfl run`` does, instead of an
exception that MONAI would re-wrap in "Failed to evaluate ConfigExpression" (see
:func:`exit_on_user_error`). Python code that wants the exceptions calls
:func:`medfl.experiment.run_experiment` and :func:`medfl.predict.predict`.
"""

from __future__ import annotations

import ast
import json
import logging
import sys
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Iterator

from medfl.config import ConfigError, resolve_config, set_threads
from medfl.config_file import load_bundle_config
# print_result lives beside the tables it prints (medfl.report); kept importable here
from medfl.report import print_result

__all__ = ["run", "tracking_from_handlers", "choose", "print_result", "infer", "run_evaluator", "load_bundle_config", "parse_override_value", "user_errors",
           "exit_on_user_error", "user_error_message", "USER_ERROR_EXIT", "INTERRUPTED_EXIT"]

logger = logging.getLogger(__name__)

#: Exit code of a run stopped by a mistake in its input (that of ``medfl run``; argparse's too).
USER_ERROR_EXIT = 2
#: exit code after Ctrl-C (128 + SIGINT, as shells report it)
INTERRUPTED_EXIT = 130


def user_errors() -> tuple[type[BaseException], ...]:
    """The exceptions medfl raises, with a message meant for the user, about bad input: the
    config (:class:`~medfl.config.ConfigError`, and the method, model and partition
    parameter errors it wraps), plugin names (:class:`~medfl.plugins.PluginError`), the
    data (:class:`~medfl.data.source.DataError`), a run directory or a run that cannot go
    on (:class:`~medfl.engine.runner.RunError`), a method's payload breaking the message
    contract (:class:`~medfl.messages.PayloadError`), privacy settings no noise can meet
    (:class:`~medfl.privacy.accounting.PrivacyConfigError`: delta >= 1/N, a budget too low,
    a model Opacus cannot train; filter errors are :class:`~medfl.method.MethodConfigError`),
    a training run that diverged (:class:`~medfl.training.NonFiniteError`, naming the
    client and round), a missing file, and a full disk (:class:`~medfl.integrity.DiskFullError`,
    naming the file; an ``OSError`` of a full disk raised elsewhere is reported the same way by
    :func:`exit_on_user_error` and ``medfl``: :func:`user_error_message`).

    Anything else (``KeyError``, ``TypeError``, a plain ``ValueError``...) is taken for a
    bug and keeps its traceback."""
    from medfl.data.partition import PartitionError
    from medfl.data.source import DataError
    from medfl.integrity import DiskFullError
    from medfl.engine.runner import RunError
    from medfl.training import NonFiniteError
    from medfl.messages import PayloadError
    from medfl.method import MethodConfigError
    from medfl.models.registry import ModelConfigError
    from medfl.plugins import PluginError
    from medfl.privacy.accounting import PrivacyConfigError

    return (ConfigError, PluginError, RunError, DataError, PartitionError, MethodConfigError, ModelConfigError,
            PayloadError, PrivacyConfigError, NonFiniteError, FileNotFoundError, DiskFullError)


def user_error_message(exc: BaseException) -> str | None:
    """The ``medfl: error:`` message of ``exc`` when it is a mistake in the input or a full
    disk (:func:`user_errors`, or any ``OSError`` of a full disk: the file and "no space left
    on device"); ``None`` for anything else, which keeps its traceback."""
    from medfl.integrity import full_disk_message

    if isinstance(exc, user_errors()):
        return str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return full_disk_message(exc, "a file of the run") if isinstance(exc, OSError) else None


@contextmanager
def exit_on_user_error() -> Iterator[None]:
    """Turn a :func:`user_errors` exception into the line ``medfl: error: MESSAGE`` on stderr
    and ``SystemExit(USER_ERROR_EXIT)``.

    ``SystemExit`` is not an ``Exception``, so MONAI's expression evaluation (which
    re-raises every ``Exception`` as "Failed to evaluate ConfigExpression") lets it through:
    under ``python -m monai.bundle run`` the medfl message is the last line printed and the
    exit code is non-zero. The original exception stays attached as ``__cause__``. Ctrl-C
    (``KeyboardInterrupt``) ends the process with :data:`INTERRUPTED_EXIT` and no traceback.
    """
    try:
        yield
    except (*user_errors(), OSError) as exc:
        message = user_error_message(exc)
        if message is None:
            raise
        sys.stdout.flush()
        logger.error(f"medfl: error: {message}")
        raise SystemExit(USER_ERROR_EXIT) from exc
    except KeyboardInterrupt:   # the run printed what was saved and how to resume: no traceback
        raise SystemExit(INTERRUPTED_EXIT) from None


def run(fl: dict[str, Any], *, exit_on_error: bool = True, handlers: list[Any] | None = None) -> dict[str, Any]:
    """Resolve and run the ``fl`` section of a bundle config; print where results went.

    Args:
        fl: the ``fl`` section (MONAI has resolved its references).
        exit_on_error: end the process on a mistake in the input (see
            :func:`exit_on_user_error`); ``False`` raises the exception instead.
        handlers: the bundle's ``train#handlers`` (``"run": "$medfl.bundle.run(@fl,
            handlers=@train#handlers)"``), where ``python -m monai.bundle run ... --tracking
            mlflow`` puts its ``MLFlowHandler``: its tracking URI, experiment and run name
            become an ``mlflow`` entry of ``fl.tracking`` (:func:`tracking_from_handlers`).

    Raises:
        SystemExit: with ``exit_on_error``, a mistake in the config or the data, after
            printing ``medfl: error: ...`` to stderr.
    """
    from medfl.experiment import run_experiment
    from medfl.logs import ensure_console

    ensure_console()   # python -m monai.bundle run without a logging.conf: medfl's lines as the CLI shows them
    with exit_on_user_error() if exit_on_error else nullcontext():
        cfg = resolve_config(tracking_from_handlers(fl, handlers))
        set_threads(cfg.get("threads"))   # the top of this process: "auto" too (one process trains)
        result = run_experiment(cfg)
        print_result(result)
    return result


def tracking_from_handlers(fl: dict[str, Any], handlers: list[Any] | None) -> dict[str, Any]:
    """``fl`` with an ``mlflow`` entry in ``fl.tracking`` for each MONAI ``MLFlowHandler`` in
    ``handlers`` (what MONAI's ``--tracking mlflow`` adds to a bundle's ``train#handlers``):
    its tracking URI (MONAI's default: ``sqlite:///<output_dir>/mlruns.db``), experiment name
    and run name. An ``mlflow`` entry the config has already wins. medfl logs through its own
    tracker (the federated rounds are not an ignite engine the handler could attach to)."""
    entries = fl.get("tracking") or []
    entries = [entries] if isinstance(entries, (str, dict)) else list(entries)
    named = {e if isinstance(e, str) else e.get("name") for e in entries if isinstance(e, (str, dict))}
    for handler in handlers or []:
        if type(handler).__name__ != "MLFlowHandler" or "mlflow" in named:
            continue
        client = getattr(handler, "client", None)
        uri = getattr(client, "tracking_uri", None) or getattr(getattr(client, "_tracking_client", None),
                                                                "tracking_uri", None)
        entry = {"name": "mlflow", "uri": uri, "experiment": getattr(handler, "experiment_name", None),
                 "run_name": getattr(handler, "run_name", None)}
        location = getattr(handler, "artifact_location", None)
        if location:
            entry["artifact_location"] = location
        entries.append({k: v for k, v in entry.items() if v is not None or k == "uri"})
        named.add("mlflow")
    return {**fl, "tracking": entries} if entries else fl


def choose(options: dict[str, Any], key: Any, what: str) -> Any:
    """``options[key]``, for a bundle variable that picks one of several named settings
    (``"partition": "$medfl.bundle.choose(@splits, @split, 'split')"``); an unknown key stops
    the run with one message naming ``what`` and listing the valid keys.

    Raises:
        ConfigError: ``key`` is not one of ``options``.
    """
    if not isinstance(key, str) or key not in options:
        raise ConfigError(f"{what}: {key!r} is not one of {', '.join(map(repr, options))}")
    return options[key]


def infer(run_dir: str | Path, dataset: dict[str, Any] | None = None, output: str | Path | None = None,
          clients: list[str] | None = None, split: str | None = None) -> Path:
    """A bundle's ``inference.json`` entry point: predict with a finished run's client
    models (see :func:`medfl.predict.predict`) and print where the CSV went.

    Raises:
        SystemExit: a mistake in the arguments, the run directory or the data (see
            :func:`exit_on_user_error`), after printing ``medfl: error: ...`` to stderr.
    """
    from medfl.predict import predict

    return _predict_and_say(lambda: predict(run_dir, dataset, output, clients, split))


def run_evaluator(evaluator: Any) -> Path:
    """A bundle's ``inference.json`` entry point (its ``run``): run the inference workflow's
    ``evaluator`` (:class:`medfl.export.RunPredictor`: the finished run's client models, as
    :func:`infer`) and print where the CSV went.

    Raises:
        SystemExit: as :func:`infer`.
    """
    return _predict_and_say(evaluator.run)


def _predict_and_say(write: Any) -> Path:
    """Call ``write()`` (which writes a predictions CSV and returns its path) with the plugins
    loaded and user errors turned into one ``medfl: error:`` line; print the path."""
    from medfl.logs import ensure_console
    from medfl.plugins import registry

    ensure_console()
    with exit_on_user_error():
        registry()
        path = write()
        print(f"predictions: {path}")
    return path


def parse_override_value(text: str) -> Any:
    """Parse a command-line value: JSON, else a Python literal, else the string itself."""
    for parse in (json.loads, ast.literal_eval):
        try:
            return parse(text)
        except (ValueError, SyntaxError):
            continue
    return text
