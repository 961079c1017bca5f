"""Predictions of a finished (or stopped) run's client models on a dataset: :func:`predict`.

It reopens the run directory as :func:`medfl.experiment.resume` would, read-only, and has each
requested client build its evaluation model as in the run's last (or, with early stopping,
best) evaluation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd
import torch

from medfl.config import method_label
from medfl.engine.runner import RunError, build_source
from medfl.experiment import _reopen, _saved_config
from medfl.messages import Instruction

__all__ = ["open_run", "predict", "split_rows", "eval_models"]


def open_run(run_dir: Path, what: str = "predict") -> tuple[Any, int]:
    """A method run directory's engine :class:`~medfl.engine.runner.Run`, reopened read-only
    with its last checkpoint loaded (with early stopping, the best round's coordinator
    state), and that round: what :func:`predict` and :func:`medfl.export.export_run` build
    the run's models from.

    Args:
        run_dir: a method run directory.
        what: the verb for the error messages (``"predict"``, ``"export"``).

    Raises:
        RunError: no ``config.json`` (not a run), an experiment directory (the message lists
            its method runs), or no checkpoint yet.
    """
    saved = _saved_config(run_dir)
    if "method" not in saved:
        raise RunError(f"{run_dir}: an experiment directory; pass one method's run directory "
                       f"({', '.join(method_label(m) for m in saved['fl']['methods'])})")
    run = _reopen(run_dir, saved, saved["fl"])
    run.prepare(read_only=True)
    last = run.start_round - 1
    if last < 1:
        raise RunError(f"{run_dir}: no checkpoint yet; nothing to {what} with")
    best = run._restore_best()   # early stopping: the best round's models
    return run, last if best is None else best


def eval_models(run: Any, last: int, client_ids: list[str] | None = None) -> Iterator[tuple[str, Any, torch.nn.Module]]:
    """``(client id, its context, its evaluation model)`` at round ``last`` for each of
    ``client_ids`` (default: the run's evaluation clients), as the engine evaluates them
    (``Method.client_eval_model``): what :func:`predict`, :func:`medfl.export.export_run`
    and the trackers' final models are built from.

    A method may hand back one cached module, loaded with each client's weights in turn
    (FedBN): use or copy each model before taking the next.
    """
    evals = run.coordinator.configure_evaluate(last)
    for cid in run.federation.eval_client_ids if client_ids is None else client_ids:
        ctx = run.context(cid, last, state_before=last + 1)
        yield cid, ctx, run.client_method.client_eval_model(ctx, evals.get(cid, Instruction()))


def split_rows(table: pd.DataFrame, split: str | None) -> pd.DataFrame:
    """The rows of a dataset's table whose ``split`` column equals ``split`` (``None``, ``""``
    or ``"all"``: every row).

    Raises:
        RunError: a split is asked for and the table has no ``split`` column, or no row is left.
    """
    if split in (None, "", "all"):
        rows = table
    elif "split" not in table.columns:
        raise RunError(f"split {split!r} asked for, but the dataset has no 'split' column; use 'all'")
    else:
        rows = table[table["split"].astype(str) == split]
    if rows.empty:
        raise RunError(f"no samples to predict on{'' if split in (None, '', 'all') else f' with split == {split!r}'}")
    return rows


def predict(run_dir: str | Path, dataset: dict[str, Any] | None = None, output: str | Path | None = None,
            clients: list[str] | None = None, split: str | None = None) -> Path:
    """Predict with a finished (or stopped) run's models and write a predictions CSV.

    Each requested client builds its evaluation model exactly as in the run's last
    evaluation (the method's ``client_eval_model``: the global model, plus the client's
    local layers or state where the method keeps them) and predicts on ``dataset``; with
    early stopping (``fl.early_stopping``), as in the evaluation of the best round, from that
    round's checkpoint and client states (the models the run's final metrics are about).

    Args:
        run_dir: a method run directory (``config.json`` with a ``method``, a checkpoint).
        dataset: a dataset spec (``{"name": ..., ...}``); default: the run's own dataset.
        output: the CSV to write (default ``run_dir/predictions.csv``).
        clients: client ids whose models predict (default: every client of the run).
        split: keep only rows whose ``split`` column equals this (e.g. ``test``); ``None``,
            ``""`` or ``"all"``: every row; ``"global_test"``: the run's held-out global test
            samples as ``partition.csv`` lists them (by ``sample_id`` in another dataset
            spec; e.g. HAM10000, which has no official split).

    Returns:
        The CSV path: one row per (client, sample) with ``sample_id``, ``label``,
        ``prediction`` and ``prob_<class name>`` columns.

    Raises:
        RunError: no run or no checkpoint in ``run_dir``, or an unknown client id.
    """
    from medfl.training import predict_proba

    run_dir = Path(run_dir)
    run, last = open_run(run_dir, "predict")
    cfg = run.config
    target = run.data.source if dataset is None else build_source(dataset)
    if split == "global_test":
        a = run.data.assignments
        held = a[a["role"] == "global_test"]
        if dataset is None:
            rows = target.table.iloc[np.sort(held["row"].to_numpy())]
        elif "sample_id" in target.table.columns and "sample_id" in held.columns:
            rows = target.table[target.table["sample_id"].astype(str).isin(set(held["sample_id"].astype(str)))]
        else:
            raise RunError("split 'global_test' means the run's held-out samples, found by sample_id; this dataset "
                           "has no sample_id column (use 'all' or a value of its 'split' column)")
        if rows.empty:
            raise RunError("no samples to predict on with split == 'global_test'")
    else:
        rows = split_rows(target.table, split)
    ids = clients or run.federation.eval_client_ids
    unknown = sorted(set(ids) - set(run.federation.eval_client_ids))
    if unknown:
        raise RunError(f"unknown client(s) {unknown}; the run has {run.federation.eval_client_ids}")
    frames = []
    for cid, ctx, model in eval_models(run, last, ids):
        loader = torch.utils.data.DataLoader(target.make_dataset(rows, False),
                                             batch_size=int(cfg["train"].get("eval_batch_size", 64)))
        y, p = predict_proba(model, loader, ctx.device)
        df = pd.DataFrame({"client_id": cid,
                           "sample_id": rows["sample_id"].astype(str).to_numpy() if "sample_id" in rows
                           else np.arange(len(rows)).astype(str),
                           "label": y, "prediction": p.argmax(1)})
        for k, name in enumerate(target.class_names):
            df[f"prob_{name or k}"] = p[:, k]
        frames.append(df)
    out = Path(output) if output else run_dir / "predictions.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.concat(frames, ignore_index=True).to_csv(out, index=False)
    return out

