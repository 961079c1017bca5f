"""Predictions of a finished (or stopped) run's client models on a dataset: :func:`predict`,
and the ``medfl predict`` command (:func:`add_parser`).

It reopens the run directory as :func:`medfl.experiment.resume` would, read-only, and has each
requested client build its evaluation model as in the run's last (or, with early stopping,
best) evaluation.

Heavy imports (torch, pandas, the engine) happen inside the functions: the ``medfl`` command
line imports this module to build its parser.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from medfl.rundir import RunError

if TYPE_CHECKING:
    import pandas as pd
    import torch

__all__ = ["predict", "split_rows", "data_spec", "add_parser", "cmd_predict"]

logger = logging.getLogger(__name__)

#: The dataset plugins whose samples are files a manifest names (``--data`` can replace them).
_FILE_DATASETS = ("manifest", "synthetic2d")
#: A column of the temporary manifest :func:`data_spec` writes: the rows that had no label.
_UNLABELLED = "_medfl_unlabelled"


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


def _rows(run: Any, target: Any, where: str | None, split: str | None) -> pd.DataFrame:
    """The rows of ``target``'s table to predict on (:func:`predict`'s ``split``); ``where``
    names ``target`` when it is not the run's own dataset, refused unless its samples, preprocessed,
    are of the shape the run's models take."""
    import numpy as np

    from medfl.data.source import DataError

    if where is not None:
        want, got = tuple(map(int, run.data.source.sample_shape)), tuple(map(int, target.sample_shape))
        if want != got:
            raise DataError(f"{where}: its first image is {got} (channels, spatial size) after the run's "
                            f"preprocessing, but the run's models take {want}")
    if split != "global_test":
        return split_rows(target.table, split)
    a = run.data.assignments
    held = a[a["role"] == "global_test"]
    if where is None:   # the run's own dataset
        rows = target.table.iloc[np.sort(held["row"].to_numpy())]
    elif "sample_id" in target.table.columns and "sample_id" in held.columns:
        rows = target.table[target.table["sample_id"].astype(str).isin(set(held["sample_id"].astype(str)))]
    else:
        raise RunError("split 'global_test' means the run's held-out samples, found by sample_id; this dataset "
                       "has no sample_id column (use 'all' or a value of its 'split' column)")
    if rows.empty:
        raise RunError("no samples to predict on with split == 'global_test'")
    return rows


def _check_clients(run: Any, ids: list[str]) -> None:
    unknown = sorted(set(ids) - set(run.federation.eval_client_ids))
    if unknown:
        raise RunError(f"unknown client(s) {unknown}; the run has {run.federation.eval_client_ids}")


def _frames(run: Any, last: int, target: Any, rows: pd.DataFrame, ids: list[str]) -> Iterator[pd.DataFrame]:
    """Each of ``ids``' predictions on ``rows`` of ``target``: ``client_id``, ``sample_id``,
    ``label``, ``prediction`` and ``prob_<class>`` per class of the run (its classes: those
    the models output), one frame per client, with a progress bar where stderr is a terminal."""
    import numpy as np
    import pandas as pd
    import torch
    from tqdm.auto import tqdm

    from medfl.logs import progress_bar_disabled
    from medfl.reopen import eval_models
    from medfl.training import predict_proba

    batch = int(run.config["train"].get("eval_batch_size", 64))
    names = [n or str(k) for k, n in enumerate(run.data.source.class_names)]
    for cid, ctx, model in eval_models(run, last, ids):
        loader = torch.utils.data.DataLoader(target.make_dataset(rows, False), batch_size=batch)
        bar = tqdm(loader, desc=f"client {cid}", unit="batch", disable=progress_bar_disabled(), leave=False)
        y, p = predict_proba(model, bar, ctx.device)
        df = pd.DataFrame({"client_id": cid,
                           "sample_id": rows["sample_id"].astype(str).to_numpy() if "sample_id" in rows
                           else np.arange(len(rows)).astype(str),
                           "label": y, "prediction": p.argmax(1)})
        for k, name in enumerate(names):
            df[f"prob_{name}"] = p[:, k]
        yield df


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
        The CSV path: one row per (client, sample) with ``client_id``, ``sample_id``,
        ``label``, ``prediction`` and ``prob_<class name>`` columns (the run's classes).

    Raises:
        RunError: no run or no checkpoint in ``run_dir``, or an unknown client id.
        DataError: ``dataset``'s samples are not of the shape the run's models take.
    """
    import pandas as pd

    from medfl.engine.runner import build_source
    from medfl.reopen import open_run

    run_dir = Path(run_dir)
    run, last = open_run(run_dir, "predict")
    target = run.data.source if dataset is None else build_source(dataset)
    rows = _rows(run, target, None if dataset is None else f"dataset {dataset.get('name')!r}", split)
    ids = clients or run.federation.eval_client_ids
    _check_clients(run, ids)
    frames = list(_frames(run, last, target, rows, ids))
    out = Path(output) if output else run_dir / "predictions.csv"
    out.parent.mkdir(parents=True, exist_ok=True)
    pd.concat(frames, ignore_index=True).to_csv(out, index=False)
    return out


# ---------------------------------------------------------------------------------- medfl predict


def _csv_lines(mask: Any, limit: int = 3) -> str:
    """The CSV line numbers (header = line 1) of the first ``limit`` true rows of ``mask``,
    and how many more there are."""
    lines = [str(i + 2) for i in mask.to_numpy().nonzero()[0][:limit]]
    more = int(mask.sum()) - len(lines)
    return ", ".join(lines) + (f" ({more} more)" if more > 0 and limit > 1 else "")


def data_spec(run: Any, data: str | Path, root: str | Path | None = None,
              workdir: str | Path | None = None) -> dict[str, Any]:
    """The dataset spec ``medfl predict --data`` runs the models of ``run`` on: the run's own
    dataset spec (its image column, normalisation, resize: the same evaluation-time
    preprocessing) with the manifest ``data`` instead of the run's, checked first so that each
    problem is one message naming the file and what was expected.

    Args:
        run: an opened run (:func:`medfl.reopen.open_run`), of a ``manifest`` or ``synthetic2d`` dataset.
        data: a folder holding ``manifest.csv`` (as a data_prep script writes it), or a
            manifest CSV. It needs the column the run read its images from (``dataset.column``,
            default ``path``); ``label`` is optional (integer class ids of the run; an empty
            cell, or no column, is an unlabelled image); ``sample_id`` and ``split`` are used
            where present; a ``class_name`` column must agree with the run's classes.
        root: the folder the manifest's relative file names are read from (default: the
            manifest's folder).
        workdir: where a copy of the manifest with a placeholder label is written when some
            images are unlabelled (the ``manifest`` dataset needs a label on every row); the
            copy marks those rows (column ``_medfl_unlabelled``). Needed only then.

    Returns:
        A ``manifest`` dataset spec.

    Raises:
        DataError: ``data`` is missing, not a readable CSV, or lacks the image column; a file it
            names is missing; a label is no class id of the run; a class name disagrees; the
            run's dataset is not read from files (``random_blocks``, a plugin's dataset).
    """
    from medfl.data.source import DataError

    own = dict(run.config["dataset"])
    kind = str(own.get("name", "")).rsplit(":", 1)[-1]
    if kind not in _FILE_DATASETS:
        raise DataError(f"--data: the run's dataset {own.get('name')!r} is made by its code, not read from a "
                        "manifest's files, so new images cannot replace it; leave --data out to predict on the "
                        "run's own samples, or call medfl.predict.predict(RUN, dataset_spec) from Python")
    path, table = _read_manifest(data)
    column = "path" if kind == "synthetic2d" else str(own.get("column", "path"))
    base = _check_images(path, table, column, root)
    source = run.data.source
    label, unlabelled = _labels(path, table, source)
    spec = {key: value for key, value in own.items() if key not in ("path", "root", "cache", "cache_dir")}
    if kind == "synthetic2d":
        spec = {"column": "path", "normalize": "none"}
    spec.update(name="manifest", path=str(path), root=str(base), num_classes=int(source.num_classes), column=column)
    if unlabelled.any():
        if workdir is None:
            raise ValueError("data_spec: unlabelled rows need a workdir for the manifest copy")
        copy = table.copy()
        copy["label"] = label.fillna(0).astype(int)
        copy[_UNLABELLED] = unlabelled.to_numpy()
        spec["path"] = str(Path(workdir) / "manifest.csv")
        copy.to_csv(spec["path"], index=False)
    return spec


def _read_manifest(data: str | Path) -> tuple[Path, pd.DataFrame]:
    """``(manifest path, its table)`` of ``--data`` (a data_prep folder or a manifest CSV);
    a DataError where there is none, or it is no readable CSV with rows."""
    import pandas as pd

    from medfl.data.source import DataError

    path = Path(data).expanduser()
    if path.is_dir():
        if not (path / "manifest.csv").is_file():
            raise DataError(f"{path}: no manifest.csv; --data takes a folder a data_prep script wrote "
                            "(FOLDER/manifest.csv) or a manifest CSV")
        path = path / "manifest.csv"
    elif not path.exists():
        raise DataError(f"{path}: no such file or folder (--data: a data_prep folder or a manifest CSV)")
    try:
        table = pd.read_csv(path)
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not a readable CSV manifest ({str(exc).strip()})") from None
    if table.empty:
        raise DataError(f"{path}: the manifest has no rows (no images to predict on)")
    return path, table


def _check_images(path: Path, table: pd.DataFrame, column: str, root: str | Path | None) -> Path:
    """The folder the manifest ``path``'s relative file names are read from (``root``, else
    the manifest's folder), once every row of ``column`` names a file found there (else a DataError)."""
    from medfl.data.source import DataError

    if column not in table.columns:
        raise DataError(f"{path}: no column {column!r}; the run read its images from that column (dataset.column), "
                        f"so the new images must be named there. Found: {', '.join(map(str, table.columns))}")
    names = table[column]
    empty = names.isna() | (names.astype(str).str.strip() == "")
    if empty.any():
        raise DataError(f"{path}: column {column!r} is empty on line(s) {_csv_lines(empty)}; every row names "
                        "an image file")
    base = Path(root).expanduser() if root else path.parent
    if root and not base.is_dir():
        raise DataError(f"{base}: --root: no such folder")
    missing = ~names.astype(str).map(lambda f: (base / f).is_file())
    if missing.any():
        first = base / str(names[missing].iloc[0])
        raise DataError(f"{path}: {int(missing.sum())} of {len(table)} file(s) of column {column!r} not found "
                        f"(e.g. {first}, line {_csv_lines(missing, 1)}); relative names are read from {base}"
                        f"{'' if root else ' (the manifest folder; --root sets another)'}")
    return base


def _labels(path: Path, table: pd.DataFrame, source: Any) -> tuple[pd.Series, pd.Series]:
    """``(label, unlabelled)`` of the manifest ``path``'s rows (NaN, True: an empty cell or no
    ``label`` column); a DataError for a label or ``class_name`` that is not the run's ``source``'s."""
    import pandas as pd

    from medfl.data.source import DataError

    k = int(source.num_classes)
    raw = table["label"] if "label" in table.columns else pd.Series([pd.NA] * len(table), index=table.index)
    unlabelled = raw.isna() | (raw.astype(str).str.strip() == "")
    label = pd.to_numeric(raw.where(~unlabelled), errors="coerce")
    bad = ~unlabelled & (label.isna() | (label != label.round()) | (label < 0) | (label >= k))
    if bad.any():
        first = raw[bad].iloc[0]
        raise DataError(f"{path}: column 'label' has {str(first)!r} on line {_csv_lines(bad, 1)}"
                        f"{f' ({int(bad.sum())} such rows)' if bad.sum() > 1 else ''}; expected a class id of the "
                        f"run, 0 to {k - 1} ({', '.join(f'{i} = {n}' for i, n in enumerate(source.class_names))}), "
                        "or an empty cell for an unlabelled image")
    if "class_name" in table.columns and "class_name" in source.table.columns:
        given = table["class_name"]
        want = label.where(~unlabelled).map(lambda v: source.class_names[int(v)] if pd.notna(v) else None)
        named = given.notna() & (given.astype(str).str.strip() != "")
        wrong = ~unlabelled & named & (given.astype(str) != want.astype(str))
        if wrong.any():
            i = wrong.to_numpy().nonzero()[0][0]
            raise DataError(f"{path}: line {i + 2}: label {int(label.iloc[i])} is class {want.iloc[i]!r} in the run "
                            f"but {given.iloc[i]!r} here (column class_name); the labels must use the run's "
                            "class ids")
    return label, unlabelled


def _refuse_existing(paths: list[Path], overwrite: bool) -> None:
    for p in paths:
        if p.is_dir():
            raise RunError(f"{p}: a folder; --out takes the CSV file to write")
        if p.exists() and not overwrite:
            raise RunError(f"{p}: exists; medfl predict overwrites nothing unless --overwrite (or choose another "
                           "--out)")


def cmd_predict(args: argparse.Namespace) -> int:
    """``medfl predict``: the run's model(s) on new images (or its own), one CSV per model."""
    import tempfile

    from medfl.arm_report import run_json
    from medfl.data.source import DataError
    from medfl.engine.runner import build_source
    from medfl.plugins import registry
    from medfl.reopen import client_models, one_model, open_run
    from medfl.rundir import resume_command

    if args.root and args.data is None:
        raise DataError("--root goes with --data (the folder the new manifest's file names are read from)")
    registry()
    run_dir = Path(args.run_dir)
    try:
        run, last = open_run(run_dir, "predict")
    except DataError as exc:   # the run's own data: the partition and the models' shapes come from it
        raise DataError(f"{run_dir}: reopening the run reads its own dataset, which failed: {exc}") from None
    status = run_json(run_dir, "status.json")
    if status and status.get("status") != "finished":
        logger.warning(f"medfl predict: {run_dir} is {status.get('status')!r} at round {status.get('last_round')} of "
                       f"{status.get('rounds')}: predicting with round {last}'s models ({resume_command(run_dir)} "
                       "finishes the run)")
    out = Path(args.out) if args.out else run_dir / "predictions.csv"
    clients = list(dict.fromkeys(args.client or []))
    _check_clients(run, clients)
    with tempfile.TemporaryDirectory(prefix=".medfl-predict-") as work:
        target = run.data.source if args.data is None else build_source(data_spec(run, args.data, args.root, work))
        rows = _rows(run, target, None if args.data is None else str(args.data), args.split)
        ids = clients or list(run.federation.eval_client_ids)
        if not clients and one_model(client_models(run, last, ids)):
            plan = [(ids[0], out, "the global model")]
        elif len(ids) == 1:
            plan = [(ids[0], out, f"client {ids[0]}'s model")]
        else:
            plan = [(cid, out.with_name(f"{out.stem}_client_{cid}{out.suffix}"), f"client {cid}'s model")
                    for cid in ids]
        _refuse_existing([p for _, p, _ in plan], args.overwrite)
        unlabelled = rows[_UNLABELLED].to_numpy(dtype=bool) if _UNLABELLED in rows.columns else None
        for (cid, path, what), frame in zip(plan, _frames(run, last, target, rows, [c for c, _, _ in plan])):
            frame = frame.drop(columns="client_id")
            if unlabelled is not None:
                frame["label"] = frame["label"].astype("Int64").mask(unlabelled)
            path.parent.mkdir(parents=True, exist_ok=True)
            frame.to_csv(path, index=False)
            print(f"predictions: {path} ({what}, round {last}, {len(frame)} samples)")
    return 0


def add_parser(sub: Any) -> None:
    """Add ``medfl predict`` to the command line's subcommands ``sub``."""
    sp = sub.add_parser(
        "predict", help="run a finished (or stopped) run's model(s) on new images; write a predictions CSV",
        description="Predict with the models a method run evaluated with (its last round's; with early stopping, "
                    "the best round's) and write a CSV with the columns of an exported bundle's "
                    "eval/predictions.csv: sample_id, label (empty for an unlabelled image), prediction (the most "
                    "probable class id) and prob_<class> for each class of the run. The images are read and "
                    "preprocessed as the run's dataset was at evaluation time. Default: the run's global model "
                    "where every client evaluates with it (FedAvg and its kin), written to OUT; else each "
                    "client's own model (FedBN, Local, ...), written to OUT's name with _client_<id>. An "
                    "existing CSV is never replaced without --overwrite.")
    sp.add_argument("run_dir", metavar="RUN", help="a method run directory (e.g. runs/demo/fedavg)")
    sp.add_argument("--data", metavar="DIR_OR_MANIFEST", default=None,
                    help="the images: a folder a data_prep script wrote (its manifest.csv) or a manifest CSV, with "
                         "the column the run read its images from (dataset.column, e.g. path) and optionally label "
                         "(the run's class ids; empty or no column: unlabelled), sample_id and split (default: the "
                         "run's own dataset)")
    sp.add_argument("--root", metavar="DIR", default=None,
                    help="with --data: the folder the manifest's relative file names are read from (default: the "
                         "manifest's folder)")
    sp.add_argument("--split", default="all",
                    help="only the rows whose split column equals this (e.g. test); global_test: the run's "
                         "held-out samples, by sample_id (default: all)")
    sp.add_argument("--client", metavar="ID", action="append", default=None,
                    help="predict with this client's evaluation model (repeatable: one CSV per client)")
    sp.add_argument("--out", metavar="CSV", default=None,
                    help="the CSV to write (default RUN/predictions.csv); per-client CSVs are named "
                         "<CSV stem>_client_<id>.csv beside it")
    sp.add_argument("--overwrite", action="store_true", help="replace existing CSVs (default: refuse, writing nothing)")
    sp.set_defaults(func=cmd_predict)
