"""A method run directory opened again: its saved config, its engine run on its saved
partition, and the models its clients evaluate with.

What :mod:`medfl.experiment` (resume, the trackers' final models), :mod:`medfl.predict` and
:mod:`medfl.export` share, below all three so that none imports another for it.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from medfl.config import method_label
from medfl.engine.data import split_data
from medfl.engine.runner import Run, RunError, RunFactory, build_source
from medfl.messages import Instruction
from medfl.runs import missing_folder

__all__ = ["saved_config", "reopen", "open_run", "eval_models", "client_models", "same_state", "one_model"]


def saved_config(path: Path) -> dict[str, Any]:
    """A run or experiment directory's ``config.json``.

    Raises:
        RunError: ``path`` does not exist (said as such), there is no ``config.json``, or it
            is not the JSON object medfl wrote (garbled, cut
            short, edited by hand): naming the file and where it stops being JSON.
    """
    cfg_file = path / "config.json"
    if missing_folder(path):
        raise RunError(missing_folder(path))
    if not cfg_file.is_file():
        raise RunError(f"{path}: no config.json; not a medfl run or experiment directory")
    try:
        saved = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f"line {exc.lineno} column {exc.colno}: {exc.msg}" if isinstance(exc, json.JSONDecodeError) else str(exc)
        raise RunError(f"{cfg_file}: not the JSON medfl wrote ({where}); medfl cannot reopen the run "
                       "(resume, report, export) from it. Restore it from a copy, or start the run again in a new "
                       "directory") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("fl"), dict):
        raise RunError(f"{cfg_file}: expected a JSON object with an 'fl' section (what medfl writes), got "
                       f"{type(saved).__name__}{'' if not isinstance(saved, dict) else ' without fl'}; medfl cannot "
                       "reopen the run (resume, report, export) from it")
    return saved


def reopen(path: Path, saved: dict[str, Any], cfg: dict[str, Any], run_factory: RunFactory = Run) -> Run:
    """The :class:`Run` of a method run directory, on its saved partition (``saved``: its
    ``config.json``; ``cfg``: the ``fl`` config to run it with)."""
    data = split_data(build_source(cfg["dataset"]), cfg, saved=path / "partition.csv")
    return run_factory(cfg, saved["method"], path, data)


def open_run(run_dir: Path, what: str = "predict") -> tuple[Any, int]:
    """A method run directory's engine :class:`~medfl.engine.runner.Run`, reopened read-only
    with its last checkpoint loaded (with early stopping, the best round's coordinator
    state), and that round: what :func:`medfl.predict.predict` and
    :func:`medfl.export.export_run` build the run's models from.

    Args:
        run_dir: a method run directory.
        what: the verb for the error messages (``"predict"``, ``"export"``).

    Raises:
        RunError: no ``config.json`` (not a run), an experiment directory (the message lists
            its method runs), or no checkpoint yet.
    """
    saved = saved_config(run_dir)
    if "method" not in saved:
        raise RunError(f"{run_dir}: an experiment directory; pass one method's run directory "
                       f"({', '.join(method_label(m) for m in saved['fl']['methods'])})")
    run = reopen(run_dir, saved, saved["fl"])
    run.prepare(read_only=True)
    last = run.start_round - 1
    if last < 1:
        raise RunError(f"{run_dir}: no checkpoint yet; nothing to {what} with")
    best = run._restore_best()   # early stopping: the best round's models
    return run, last if best is None else best


def eval_models(run: Any, last: int, client_ids: list[str] | None = None) -> Iterator[tuple[str, Any, torch.nn.Module]]:
    """``(client id, its context, its evaluation model)`` at round ``last`` for each of
    ``client_ids`` (default: the run's evaluation clients), as the engine evaluates them
    (``Method.client_eval_model``): what :func:`medfl.predict.predict`,
    :func:`medfl.export.export_run` and the trackers' final models are built from.

    A method may hand back one cached module, loaded with each client's weights in turn
    (FedBN): use or copy each model before taking the next.
    """
    evals = run.coordinator.configure_evaluate(last)
    for cid in run.federation.eval_client_ids if client_ids is None else client_ids:
        ctx = run.context(cid, last, state_before=last + 1)
        yield cid, ctx, run.client_method.client_eval_model(ctx, evals.get(cid, Instruction()))


def client_models(run: Any, last: int, client_ids: list[str] | None = None) -> dict[str, torch.nn.Module]:
    """``{client id: a copy of its evaluation model}`` (:func:`eval_models`), each copied at
    once: a method may hand back one cached module, loaded with each client's weights in turn
    (FedBN), so a later client's load would change it."""
    return {cid: copy.deepcopy(model) for cid, _, model in eval_models(run, last, client_ids)}


def same_state(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    """Whether two state dicts hold the same keys and equal tensors."""
    return a.keys() == b.keys() and all(torch.equal(a[k].cpu(), b[k].cpu()) for k in a)


def one_model(models: Mapping[str, torch.nn.Module]) -> bool:
    """Whether every model of ``models`` has the same state dict (a global model), as the
    trackers' final models, ``medfl predict`` and ``medfl export`` decide."""
    states = [m.state_dict() for m in models.values()]
    return all(same_state(s, states[0]) for s in states[1:])
