"""Find the runs under a folder and say where each stands: ``medfl runs [DIR]``.

A run directory is one with a ``config.json`` that names its ``method`` (what the engine
writes for every method run: :class:`medfl.rundir.RunDir`); experiments, their ``fold_<k>/``
and ``seed_<s>/`` folders hold them. For each run: its status (``status.json``, and whether a
process holds its lock now), method, rounds done of those planned, the headline metric (the
run's own metric, :func:`key_metric`, from the summary's ``final`` block: the best round under
early stopping, else the last round; for a run without a summary yet, the last round in
``metrics.csv``), the epsilon spent (worst client;
``-`` without differential privacy) and when it was last written. A run directory that cannot
be read is listed with a ``corrupt: <why>`` status, never an exception.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import time
from pathlib import Path
from typing import Any

import pandas as pd

from medfl.rundir import RunDir

__all__ = ["missing_folder", "FAILED_TO_START", "RUN_FIELDS", "HEADLINE_SPLITS", "HEADLINE_METRICS", "DEFAULT_DEPTH", "find_run_dirs", "key_metric",
           "run_row", "list_runs", "format_runs", "runs_csv", "runs_json"]

#: The ``status.json`` status of a run that stopped at its start, before any round (over
#: Flower: a client without a site within ``--connect-timeout``); listed as
#: ``failed to start: <why>``.
FAILED_TO_START = "failed to start"

#: The columns of the table, in order.
RUN_FIELDS = ("path", "status", "method", "rounds_done", "rounds_planned", "headline", "value", "epsilon", "modified")
#: The split of the headline metric: the first of these the run evaluated, else its first split.
HEADLINE_SPLITS = ("local_test", "global_test", "cross_test", "test", "val")
#: The headline metric of a run whose config names none (:func:`key_metric`): the first of
#: these the run reports, else its first metric.
HEADLINE_METRICS = ("accuracy", "auc", "f1")
#: How deep under the folder run directories are looked for (``runs/<exp>/fold_<k>/<method>``
#: is 4 below ``runs``'s parent).
DEFAULT_DEPTH = 5
#: Folders of a run or experiment that never hold a run (skipped, with dot-folders).
_SKIP = {"checkpoints", "eval_state", "data", "__pycache__"}


def missing_folder(path: str | Path) -> str | None:
    """``"PATH: no such folder ..."`` when ``path`` does not exist, naming the folder a relative
    path was looked for in (``make demo`` ran in ``bundles/demo``, so its ``runs/demo`` is not
    the current folder's); ``None`` when it exists. A path the system cannot even look up
    (a name too long, a component that is a file) is named with the system's reason."""
    path = Path(path)
    try:
        os.stat(path)
    except FileNotFoundError:
        where = "" if path.is_absolute() else f" (looked for in {Path.cwd()})"
        return f"{path}: no such folder{where}"
    except OSError as exc:
        return f"{path}: cannot be opened ({exc.strerror or exc})"
    return None


def find_run_dirs(root: str | Path, depth: int = DEFAULT_DEPTH, unsearched: list[Path] | None = None) -> list[Path]:
    """Every run directory at most ``depth`` folders below ``root`` (``root`` itself included):
    a folder whose ``config.json`` is not an experiment's (an experiment's has only ``fl`` and
    its metadata, a run's names its ``method``), or that has a ``status.json``. Folders that
    cannot be read are passed over; dot-folders and a run's own folders are not searched.

    Args:
        root: the folder to search.
        depth: how many folders below ``root`` to look (0: ``root`` itself).
        unsearched: when given, gets every folder ``depth`` below ``root`` that is not a run
            directory but has folders of its own, which were not searched (so a caller can say
            that runs may lie deeper, rather than missing them silently).
    """
    root = Path(root)
    found: list[Path] = []

    def walk(folder: Path, left: int) -> None:
        if _is_run_dir(folder):
            found.append(folder)
            return
        if left <= 0 and unsearched is None:
            return
        try:
            children = sorted(p for p in folder.iterdir() if p.is_dir() and not p.is_symlink()
                              and not p.name.startswith(".") and p.name not in _SKIP)
        except OSError:
            return
        if left <= 0:
            if children:
                unsearched.append(folder)   # type: ignore[union-attr] - not None here
            return
        for child in children:
            walk(child, left - 1)

    walk(root, depth)
    return found


def _is_run_dir(folder: Path) -> bool:
    """Whether ``folder`` is a method run's directory (not an experiment's)."""
    if (folder / "status.json").is_file():
        return True
    config = folder / "config.json"
    if not config.is_file():
        return False
    try:
        return "method" in json.loads(config.read_text())
    except (OSError, ValueError, TypeError):
        # unreadable: a run directory if it has a run's other files
        return (folder / "metrics.csv").is_file() or (folder / "checkpoints").is_dir()


def _read_json(path: Path) -> tuple[Any, str | None]:
    """``(data, None)``, or ``(None, why)`` when ``path`` is missing or not JSON."""
    try:
        return json.loads(path.read_text()), None
    except FileNotFoundError:
        return None, f"no {path.name}"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"{path.name} cannot be read ({exc.__class__.__name__})"
    except ValueError as exc:
        return None, f"{path.name} is not valid JSON ({exc})"


def _modified(folder: Path) -> float:
    """The newest modification time of the files directly in ``folder`` (its own if none)."""
    times = []
    try:
        with os.scandir(folder) as entries:
            times = [e.stat().st_mtime for e in entries if e.is_file(follow_symlinks=False)]
    except OSError:
        pass
    return max(times, default=folder.stat().st_mtime if folder.exists() else 0.0)


def key_metric(config: Any) -> tuple[str | None, str | None]:
    """``(split, metric)``: the metric a run's ``config.json`` names as its own, ``None`` for
    what it leaves open: early stopping's ``fl.early_stopping.metric`` (``"<split>/<metric>"``,
    the rounds are selected on it), else under cross-validation ``fl.cv.metric`` (the metric
    its ``cv_table`` reports: AUC for abide_fedskd and derm7pt_fedskd), else neither (the
    first of :data:`HEADLINE_METRICS` the run reports)."""
    fl = config.get("fl") if isinstance(config, dict) else None
    if not isinstance(fl, dict):
        return None, None
    early = fl.get("early_stopping")
    if isinstance(early, dict) and isinstance(early.get("metric"), str) and "/" in early["metric"]:
        split, metric = early["metric"].split("/", 1)
        return split, metric
    cv = fl.get("cv")
    if isinstance(cv, dict) and isinstance(cv.get("folds"), int) and cv["folds"] >= 2 \
            and isinstance(cv.get("metric"), str):
        return None, cv["metric"]
    return None, None


def _headline(final: dict[str, Any], key: tuple[str | None, str | None] = (None, None)) -> tuple[str, float] | None:
    """``("<split> <metric>", mean)`` from a summary's ``final`` block, or ``None``: the
    split and metric of ``key`` (:func:`key_metric`) where the run reports them, else the first
    of :data:`HEADLINE_SPLITS` and :data:`HEADLINE_METRICS`."""
    splits = [s for s, block in final.items() if isinstance(block, dict)]
    if not splits:
        return None
    split = next((s for s in (key[0], *HEADLINE_SPLITS) if s in splits), splits[0])
    metrics = [m for m, stats in final[split].items() if isinstance(stats, dict) and "mean" in stats]
    if not metrics:
        return None
    metric = next((m for m in (key[1], *HEADLINE_METRICS) if m in metrics), metrics[0])
    return f"{split} {metric}", float(final[split][metric]["mean"])


def _headline_from_metrics(folder: Path, key: tuple[str | None, str | None] = (None, None)) -> tuple[str, float] | None:
    """The headline of the last evaluated round in ``metrics.csv`` (a run with no summary yet),
    as ``("<split> <metric> (round r)", mean over clients)``; ``None`` without one."""
    path = folder / "metrics.csv"
    if not path.is_file():
        return None
    df = pd.read_csv(path)
    if df.empty or "round" not in df.columns or "split" not in df.columns:
        return None
    last = int(df["round"].max())
    rows = df[df["round"] == last]
    final = {split: {m: {"mean": pd.to_numeric(g[m], errors="coerce").mean()}
                     for m in g.columns if m in HEADLINE_METRICS or m == key[1]}
             for split, g in rows.groupby("split", sort=False)}
    found = _headline(final, key)
    return None if found is None else (f"{found[0]} (round {last})", found[1])


def _epsilon(summary: dict[str, Any] | None, folder: Path) -> float | None:
    """The epsilon spent (worst client): the summary's ``privacy.epsilon``, or for a run with no
    summary yet the largest epsilon of ``privacy.csv``'s last round; ``None`` without DP;
    infinite for a run that made DP releases but is not private (it sent something in the
    clear beside them, or released without noise), as ``comparison.csv`` shows it."""
    if summary is not None:
        privacy = summary.get("privacy") or {}
        eps = privacy.get("epsilon")
        if eps is None and (privacy.get("sent_in_clear") or privacy.get("non_private_releases")):
            return math.inf
        return None if eps is None else float(eps)
    path = folder / "privacy.csv"
    if not path.is_file():
        return None
    df = pd.read_csv(path)
    if df.empty or "epsilon" not in df.columns:
        return None
    eps = pd.to_numeric(df[df["round"] == df["round"].max()]["epsilon"], errors="coerce").max()
    return None if eps != eps else float(eps)


def _status(folder: Path, status: dict[str, Any] | None, why: str | None) -> str:
    """The status column: ``finished``, ``running (locked)``, ``stopped``, ``interrupted``,
    ``failed: <reason>``, ``failed to start: <reason>`` (:data:`FAILED_TO_START`), ``crashed
    (...)`` for a run marked running that no process holds, or ``corrupt: <why>``."""
    locked = RunDir(folder).locked_elsewhere()
    if locked:
        return "running (locked)"
    if status is None:
        if why == "no status.json":
            return "crashed (no status.json: stopped before its first round)"
        return f"corrupt: {why}"
    if not isinstance(status, dict) or not isinstance(status.get("status"), str):
        return "corrupt: status.json has no status"
    state = status["status"]
    if state == "running":
        return "crashed (status running, but no process holds its lock)"
    if state in ("failed", FAILED_TO_START):
        return f"{state}: {status.get('reason') or 'no reason recorded'}"
    return state


def run_row(folder: str | Path, root: str | Path | None = None) -> dict[str, Any]:
    """The row of one run directory (:data:`RUN_FIELDS`); ``path`` is relative to ``root``
    when given. Never raises on a damaged directory: its status says what is wrong."""
    folder = Path(folder)
    rel = str(folder.relative_to(root)) if root is not None and folder != Path(root) else str(folder)
    row: dict[str, Any] = {"path": rel or ".", "status": "", "method": folder.name, "rounds_done": None,
                           "rounds_planned": None, "headline": None, "value": None, "epsilon": None,
                           "modified": _modified(folder)}
    try:
        status, why = _read_json(folder / "status.json")
        row["status"] = _status(folder, status, why)
        if isinstance(status, dict):
            row["rounds_done"], row["rounds_planned"] = status.get("last_round"), status.get("rounds")
        config, _ = _read_json(folder / "config.json")
        key = key_metric(config)
        if isinstance(config, dict) and isinstance(config.get("method"), dict):
            name = str(config["method"].get("name", folder.name))
            row["method"] = name if name == folder.name else f"{folder.name} ({name})"
            if row["rounds_planned"] is None:
                row["rounds_planned"] = ((config.get("fl") or {}).get("rounds"))
        summary = None
        if (folder / "summary.json").exists() or row["status"] == "finished":
            summary, why = _read_json(folder / "summary.json")
            if not isinstance(summary, dict):
                row["status"] = f"corrupt: {why or 'summary.json is not a JSON object'}"
                summary = None
        found = (_headline(summary.get("final") or {}, key) if summary is not None else None) \
            or _headline_from_metrics(folder, key)
        if found is not None:
            row["headline"], row["value"] = found
        row["epsilon"] = _epsilon(summary, folder)
    except Exception as exc:   # noqa: BLE001 - a damaged run is a row, never a traceback
        row["status"] = f"corrupt: {exc.__class__.__name__}: {exc}"
    return row


def list_runs(root: str | Path, depth: int = DEFAULT_DEPTH, unsearched: list[Path] | None = None
              ) -> list[dict[str, Any]]:
    """The rows of every run under ``root`` (:func:`find_run_dirs`), oldest first (the
    newest last, by :data:`RUN_FIELDS` ``modified``, seconds since the epoch); ``unsearched``,
    when given, gets the folders at ``depth`` whose subfolders were not searched.

    Raises:
        FileNotFoundError: ``root`` does not exist.
        NotADirectoryError: ``root`` is a file.
    """
    root = Path(root)
    if not root.exists():
        raise FileNotFoundError(f"{root}: no such folder")
    if not root.is_dir():
        raise NotADirectoryError(f"{root}: not a folder (give the folder that holds the runs)")
    rows = [run_row(folder, root) for folder in find_run_dirs(root, depth, unsearched)]
    return sorted(rows, key=lambda r: (r["modified"], r["path"]))


def _text(value: Any, field: str) -> str:
    """One cell of the plain-text table."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if field == "modified":
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(value))
    if isinstance(value, float):
        return "inf" if math.isinf(value) else f"{value:.4f}"
    return str(value)


def format_runs(rows: list[dict[str, Any]]) -> str:
    """The rows as one plain-text table: path, status, method, rounds (done/planned), headline
    metric and its value, epsilon, last modified (local time). The value's column is named by
    the metric (``auc``, ``accuracy``) when every run's headline is that one, else ``value``."""
    names = {str(r["headline"]).split()[1] for r in rows if r["headline"] and len(str(r["headline"]).split()) > 1}
    header = ["path", "status", "method", "rounds", "headline", names.pop() if len(names) == 1 else "value",
              "epsilon", "modified"]
    lines = [[_text(r["path"], "path"), _text(r["status"], "status"), _text(r["method"], "method"),
              f"{_text(r['rounds_done'], '')}/{_text(r['rounds_planned'], '')}", _text(r["headline"], "headline"),
              _text(r["value"], "value"), _text(r["epsilon"], "epsilon"), _text(r["modified"], "modified")]
             for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(header)]
    out = ["  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip()]
    out += ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines]
    return "\n".join(out)


def _iso(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with ``modified`` as an ISO 8601 time (UTC) and NaN/inf as ``None``/``"inf"``."""
    out = dict(row)
    out["modified"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(row["modified"]))
    for key in ("value", "epsilon"):
        v = out[key]
        if isinstance(v, float) and (math.isnan(v) or math.isinf(v)):
            out[key] = None if math.isnan(v) else "inf"
    return out


def runs_json(rows: list[dict[str, Any]]) -> str:
    """The rows as a JSON list (``modified`` in ISO 8601, UTC)."""
    return json.dumps([_iso(r) for r in rows], indent=2)


def runs_csv(rows: list[dict[str, Any]]) -> str:
    """The rows as CSV with a header of :data:`RUN_FIELDS` (``modified`` in ISO 8601, UTC)."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(RUN_FIELDS), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: "" if v is None else v for k, v in _iso(row).items()})
    return buf.getvalue()
