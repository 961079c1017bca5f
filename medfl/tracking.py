"""Experiment tracking: the :class:`Tracker` base class a tracker plugin subclasses, and how a
run's per-round tables become its scalars (:func:`round_scalars`, ``step = round``) and a
finished run's headline figures (:func:`headline_figures`); :mod:`medfl.tracking_feed` feeds
them to the trackers. A tracker sees an experiment as runs keyed by their path under the
experiment directory: ``""`` is the experiment itself (the parent of every method run, folds
and seeds included), ``"fedavg"`` or ``"fold_0/fedavg"`` a method run.
"""

from __future__ import annotations

import math
import os
import re
import time
from pathlib import Path
from typing import Any, ClassVar

import pandas as pd

from medfl.config import ConfigError

__all__ = ["Tracker", "TrackerWarning", "flatten_params", "round_scalars", "headline_figures", "TABLE_SECTIONS",
           "TRACKER_WAIT_S", "WAIT_ENV", "ERROR_CHARS", "tracker_wait_s", "short_error", "missing_package",
           "run_status", "now_ms"]

#: The longest a run waits for one call to a tracker, in seconds, counted from when the call
#: began: a call that has not returned by then (a server down or not answering) has its tracker
#: abandoned and reported as failed, and none of its later calls is made, so a tracker that is
#: down costs a session about this much in all. A tracker that answers is waited for call after
#: call (a run's end waits for its artifacts and models to be logged).
TRACKER_WAIT_S = 10.0
#: The environment variable that sets another bound (seconds), e.g. for large models sent to a
#: slow server, whose upload may need longer than :data:`TRACKER_WAIT_S`.
WAIT_ENV = "MEDFL_TRACKER_WAIT_S"
#: The longest text of a tracker's error in ``log.txt`` and ``summary.json`` (its start and its
#: end are kept: the root cause of an HTTP error is at its end).
ERROR_CHARS = 300


def tracker_wait_s() -> float:
    """The bound in force: :data:`WAIT_ENV` when set (a positive number of seconds), else
    :data:`TRACKER_WAIT_S`.

    Raises:
        ConfigError: :data:`WAIT_ENV` is set to something else.
    """
    text = os.environ.get(WAIT_ENV, "").strip()
    if not text:
        return TRACKER_WAIT_S
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{WAIT_ENV}={text!r}: expected a positive number of seconds (default {TRACKER_WAIT_S:g})")
    return value


def short_error(exc: BaseException | str, limit: int = ERROR_CHARS) -> str:
    """``"<type>: <message>"`` of ``exc`` on one line, at most ``limit`` characters: a longer
    one keeps its start and its end (where an HTTP client's error names the root cause, such as
    ``Connection refused``)."""
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    head = limit // 3
    return f"{text[:head]} ... {text[-(limit - head - 5):]}"


#: Columns of the per-round tables that name a row rather than measure something; their values
#: become parts of a scalar's name (``client_id`` its last part).
NAME_COLUMNS = ("split", "phase", "mechanism", "scope", "name", "id")
#: Columns never logged as scalars (they place a row: round, step, provenance, free text).
NOT_SCALARS = {"round", "step", "client_id", "client_name", "data_client_id", "reported_by", "text", *NAME_COLUMNS}


class TrackerWarning(UserWarning):
    """A finished run's final models could not be rebuilt for the trackers (the run's clients
    ran elsewhere); the run and its tracking go on. A tracker that fails is logged instead
    (``medfl.tracking``, in the run's ``log.txt``) and named in ``summary.json``."""


def missing_package(tracker: str, package: str, exc: ImportError) -> ConfigError:
    """The one error a built-in tracker gives when its package is not installed."""
    return ConfigError(f"fl.tracking: the {tracker!r} tracker needs the {package!r} package, which is not "
                       f"installed ({exc}); install it with: pip install \"medfl[tracking]\"")


class Tracker:
    """Base class of a tracker: where an experiment's params, per-round scalars, artifacts and
    final models go. Register a subclass with ``register_trackers`` (its ``name`` is what
    ``fl.tracking`` and ``--tracking`` choose); :class:`~medfl.tracking_feed.Tracking` builds it
    with the experiment directory and the options of its ``fl.tracking`` entry.

    Every method is called from a background thread of the tracker's own, in order:
    :meth:`start_run` for the experiment (key ``""``) before any method run, then per method run
    :meth:`start_run`, :meth:`log_metrics` once per round, :meth:`log_summary`,
    :meth:`log_artifact` and :meth:`log_model` at its end, :meth:`end_run`; :meth:`close` last. An exception from any of
    them, or a call that has not returned :data:`TRACKER_WAIT_S` after it began, leaves the
    tracker out for the rest of the session (logged once per run, named in ``summary.json``);
    the run goes on.

    Attributes:
        name: the registered name.
        description: one line for ``medfl plugins``.
        options: the keys an ``fl.tracking`` entry may set, with their defaults (anything
            else is refused by name).
        requires: the importable packages it needs: a config naming it is refused before
            anything runs when one is missing (``pip install "medfl[tracking]"``).
    """

    name: ClassVar[str] = ""
    description: ClassVar[str] = ""
    options: ClassVar[dict[str, Any]] = {}
    requires: ClassVar[tuple[str, ...]] = ()

    def __init__(self, root: Path, **options: Any) -> None:
        """Args:
            root: the experiment directory (the tracker's own files may go under it).
            **options: the ``fl.tracking`` entry's keys (checked against :attr:`options`;
                ``per_client``, where a tracker offers it, is true or false:
                :func:`medfl.config.check_tracking`).
        """
        self.root = Path(root)
        self.settings: dict[str, Any] = {**self.options, **options}

    @property
    def per_client(self) -> bool:
        """Whether :meth:`log_metrics` gets each client's value besides the across-client means:
        the entry's ``per_client`` where :attr:`options` has that key (the built-in trackers:
        default ``false``), else ``True`` (a tracker that does not offer the choice gets all)."""
        return bool(self.settings.get("per_client", True))

    def start_run(self, key: str, name: str, params: dict[str, Any], parent: dict[str, Any] | None,
                  saved: dict[str, Any] | None, last_step: int) -> dict[str, Any]:
        """Start (``saved is None``) or continue (``saved``: what this returned before) the run
        ``key`` (``""``: the experiment), named ``name``, under ``parent`` (what this returned
        for the experiment's run; ``None`` for the experiment itself). ``params``: the flattened resolved config (log them on a new run
        only: a continued run has them). ``last_step``: the last round the run logged (0:
        none); a continued run must drop anything it holds after it.

        Returns:
            What :class:`~medfl.tracking_feed.Tracking` stores in ``tracking.json`` to continue
            this run later (JSON-serialisable, e.g. ``{"run_id": ...}``).
        """
        raise NotImplementedError

    def log_metrics(self, key: str, metrics: dict[str, float], step: int) -> None:
        """Log the scalars of round ``step`` of run ``key``."""
        raise NotImplementedError

    def log_summary(self, key: str, figures: dict[str, float], step: int) -> None:
        """Keep the finished method run ``key``'s headline figures (:func:`headline_figures`:
        ``{"<key>/<split>/<metric>": mean, ...}``, ``step``: the round they come from) with the
        experiment's run, so the experiment compares its arms at a glance. Default: nothing."""

    def log_artifact(self, key: str, path: Path, artifact_path: str | None = None) -> None:
        """Keep the file ``path`` (a PNG, ``summary.json``, ``comparison.csv``...) with run
        ``key``, under ``artifact_path`` (``None``: at its top). Default: nothing."""

    def log_model(self, key: str, name: str, model: Any, example: Any = None) -> None:
        """Keep the final model ``model`` (a :class:`torch.nn.Module`) of run ``key`` as
        ``name`` (``"model"``, or ``"model_<client>"`` for a personalised one); ``example``:
        an input batch of one sample (a tensor ``(1, C, H, W[, D])``). Default: nothing."""

    def end_run(self, key: str, status: str) -> None:
        """End run ``key``: ``status`` is ``"finished"``, ``"stopped"`` (resumable),
        ``"interrupted"`` or ``"failed"``. Default: nothing."""

    def close(self) -> None:
        """Release what the tracker holds (files, connections). Default: nothing."""


def flatten_params(data: Any, prefix: str = "") -> dict[str, str]:
    """A nested config as ``{"train.lr": "0.01", "methods.0.name": "fedavg", ...}``: dotted
    keys, values as text (lists of scalars as JSON-like text)."""
    out: dict[str, str] = {}
    if isinstance(data, dict):
        for k, v in data.items():
            out.update(flatten_params(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(data, list) and any(isinstance(v, (dict, list)) for v in data):
        for i, v in enumerate(data):
            out.update(flatten_params(v, f"{prefix}.{i}" if prefix else str(i)))
    else:
        out[prefix or "value"] = "null" if data is None else str(data)
    return out


_BAD = re.compile(r"[^\w\-. /:]")


def _part(value: Any) -> str:
    return _BAD.sub("_", str(value)) or "_"


#: The first part of a scalar's name for the per-round tables not named by their stem: the
#: evaluation's come first where names are sorted (MLflow's and TensorBoard's charts), before
#: the run's bookkeeping (``traffic/...``: the bytes and messages of ``communication.csv``).
TABLE_SECTIONS = {"metrics": "eval", "cross_test": "eval_cross_test", "communication": "traffic"}


def round_scalars(table: str, rows: pd.DataFrame, per_client: bool = True) -> dict[int, dict[str, float]]:
    """The scalars of a per-round table's ``rows``, per round: ``{round: {name: value}}``.

    A scalar is named ``<section>/<name columns...>/<column>/<client>`` (``section``: the
    file's stem without ``_metrics``, or :data:`TABLE_SECTIONS`' name: ``metrics.csv`` is
    ``eval``, ``communication.csv`` ``traffic``), and for every column measured per client
    also ``.../mean`` over the round's clients; with ``per_client`` false only the means (and
    the columns not measured per client). A table with several rows of one client a round (a
    method with several training steps a round) names the later steps ``<section>/step<k>/...``
    (its ``step`` column when it has one, else the rows' order)."""
    stem = table[:-4] if table.endswith(".csv") else table
    prefix = TABLE_SECTIONS.get(stem, stem.removesuffix("_metrics"))
    if rows.empty or "round" not in rows:
        return {}
    rows = rows.reset_index(drop=True)
    names = [c for c in NAME_COLUMNS if c in rows]
    keys = ["round", *names, *(["client_id"] if "client_id" in rows else [])]
    step = rows["step"].astype(int) if "step" in rows else rows.groupby(keys, sort=False).cumcount()
    values = [c for c in rows if c not in NOT_SCALARS and pd.api.types.is_numeric_dtype(rows[c])
              and not pd.api.types.is_bool_dtype(rows[c])]
    out: dict[int, dict[str, float]] = {}
    sums: dict[tuple[int, str], list[float]] = {}
    for i, rec in enumerate(rows.to_dict("records")):
        r = int(rec["round"])
        base = [prefix, *([f"step{int(step.iloc[i])}"] if int(step.iloc[i]) else []),
                *(_part(rec[c]) for c in names if not pd.isna(rec[c]))]
        client = _part(rec["client_id"]) if "client_id" in rec and not pd.isna(rec["client_id"]) else None
        for col in values:
            v = rec[col]
            if v is None or pd.isna(v) or not math.isfinite(float(v)):
                continue
            stat = "/".join([*base, _part(col)])
            if client:
                sums.setdefault((r, stat), []).append(float(v))
            if per_client or not client:
                out.setdefault(r, {})[f"{stat}/{client}" if client else stat] = float(v)
    for (r, stat), vs in sums.items():
        out.setdefault(r, {})[f"{stat}/mean"] = sum(vs) / len(vs)
    return out


def headline_figures(key: str, summary: dict[str, Any]) -> tuple[dict[str, float], int]:
    """A finished method run's headline figures, as its ``summary.json`` has them and
    ``comparison.csv`` shows them, named for the experiment's run: ``<key>/<split>/<metric>``,
    the mean over the clients of each metric of the summary's ``final`` block (the best round
    under early stopping, else the last round), ``<key>/mb_to_clients_per_round`` and
    ``<key>/mb_from_clients_per_round`` (megabytes, 1e6 bytes) and, with differential
    privacy, ``<key>/epsilon`` (the worst client's). Non-finite values are left out.

    Returns:
        ``(figures, round)``: ``round`` is the ``final`` block's round (0 when it has none).
    """
    final = summary.get("final") if isinstance(summary.get("final"), dict) else {}
    out: dict[str, float] = {}

    def put(name: str, value: Any) -> None:
        if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(float(value)):
            out["/".join(_part(p) for p in (*key.split("/"), *name.split("/")))] = float(value)

    for split, block in final.items():
        if isinstance(block, dict):
            for metric, stats in block.items():
                if isinstance(stats, dict):
                    put(f"{split}/{metric}", stats.get("mean"))
    per_round = (summary.get("communication") or {}).get("per_round") or {}
    for side in ("to", "from"):
        value = per_round.get(f"bytes_{side}_clients")
        put(f"mb_{side}_clients_per_round", float(value) / 1e6 if isinstance(value, (int, float)) else None)
    put("epsilon", (summary.get("privacy") or {}).get("epsilon"))
    return out, int(final.get("round") or 0)


def run_status(status: str) -> str:
    """MLflow's word for a medfl run status."""
    return {"finished": "FINISHED", "failed": "FAILED"}.get(status, "KILLED")


def now_ms() -> int:
    """The time now in milliseconds (MLflow's timestamps)."""
    return int(time.time() * 1000)
