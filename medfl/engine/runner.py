"""The in-process engine: every client in this process, one at a time, state on disk.

:func:`run_experiment` runs every method of a resolved ``fl`` config on the same split of
the same data and writes a comparison; :class:`Run` runs one method in one directory and
:func:`resume` continues a stopped one. Output of a run directory::

    config.json        resolved config (and the method entry) - enough to resume
    partition.csv      which sample went to which client and role
    partition_report.json  whether the partition dealt whole subjects (``group_column``), groups
                       per client, and how many groups straddle clients, the global test or a
                       client's splits (:func:`medfl.engine.data.partition_report`)
    metrics.csv        one row per (round, client, split) with every metric; ``reported_by``
                       says whose word it is across sites (:data:`METRICS_PROVENANCE`)
    train_metrics.csv  one row per (round, client) with what the client reported; its
                       (round, client_id) pairs are the record of the sampled clients;
                       ``bytes_to_client``/``bytes_from_client``: that training step's
                       instruction and reply as Flower sends them (one row per step for a
                       method with several steps a round)
    mechanisms.csv     what the method's own mechanisms did each round (``Method.mechanisms``:
                       stop rounds, decay weights, noise-to-signal ratios...), one line per
                       value: round, mechanism, scope, id, name, value (a number) or text
    validation_metrics.csv  one row per (round, client) of a method's validation exchange
                       (``Method.configure_validate``), when it has one
    profile.csv        one row per client of a method's profile exchange before round 1
                       (``Method.configure_profile``: PFedCDP's capability scores), when it has one
    final_metrics.csv  the coordinator's final models (``Method.final_models``: PFedCDP's
                       refined student) on the public test split and every client's splits
    <name>.csv         the method's own tables after its post-hoc stage (``Method.final_tables``:
                       PFedCDP's ``student_metrics.csv``, the student after every epoch)
    groups.csv         the method's client groups (``Method.client_groups``), when it has any
    privacy.csv        per round and client of a differentially private run: mechanism,
                       noise, clip, steps, sampling rate, epsilon spent so far, delta
                       (:mod:`medfl.privacy.ledger`)
    releases.jsonl     every DP reply the coordinator received (round, step, client, the
                       parameters it was released under, a digest), written before the
                       round's checkpoint: a resume re-runs a released round under them
                       (:mod:`medfl.privacy.releases`)
    communication.csv  one row per (round, client, phase: train, validate, evaluate, score)
                       with ``bytes_to_client``, ``bytes_from_client`` and ``messages``: the
                       encoded size of the messages as Flower sends them, measured in process
                       too (:mod:`medfl.engine.traffic`)
    summary.json       final metrics: mean, std, worst and best client per split, their
                       ``reported_by`` provenance, the
                       ``forgetting`` block (:func:`medfl.metrics.forgetting.forgetting_report`)
                       and the ``communication`` block (:meth:`medfl.engine.traffic.Traffic.summary`);
                       with early stopping, ``final`` is the best round's, ``last_round`` the
                       last round's and ``early_stopping`` says what was decided (below)
    forgetting.csv     per evaluated round: global/local/worst accuracy, balance, BwT,
                       negative-flip rates, sampled clients
    checkpoints/       coordinator state per round (last ``keep_checkpoints`` kept, and with
                       early stopping the best round's: the checkpoints kept record it), the
                       client states it goes with, and a manifest of the run's own files
                       (size and SHA-256 at checkpoint time) that a resume checks first
                       (:mod:`medfl.rundir`)
    clients/           each client's persistent state, versioned by round
    eval_state/        each client's evaluation memory (last per-sample correctness, for
                       the negative-flip counts; client-side, never sent), versioned by round
    plots/             PNG curves and per-client heatmaps (the reporting plugin)

Early stopping (``fl.early_stopping``, :mod:`medfl.engine.early_stopping`): after each
evaluated round (``eval_every``: patience counts evaluated rounds) the run reads the mean over
clients of its metric, keeps the best round, and stops once ``patience`` evaluated rounds did
not improve on it; the decision and the state are in that round's checkpoint (``engine``
block), so a resumed run decides the same, and a run resumed after the decision only
finishes. At the end the coordinator state is restored from the best round's checkpoint
before ``finalize`` and ``final_models``, the summary's ``final`` block (and ``fairness``,
``groups``) come from the best round's rows of ``metrics.csv`` (its models' evaluation), and
:func:`predict` uses that round's checkpoint and client states. A run that early stopping
ended is finished: :func:`resume` does not extend it with more ``rounds``.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, NoReturn

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from medfl import wire
from medfl.config import (CROSS_TEST_IN_CLEAR, build_method, cross_test_in_clear, method_label,
                          method_preset, method_train, preset_record)
from medfl.engine.client import (ClientContext, ClientStore, build_eval_model, build_final_model,
                                 evaluate_final_models, evaluate_model, first_non_finite, payload_problem,
                                 release_exemptions, reported_problem, run_client_profile, run_client_update,
                                 run_client_validate)
from medfl.engine.data import POOLED, FederatedData, client_order
from medfl.engine.early_stopping import EarlyStopping, metrics_split
from medfl.rundir import (append_text, check_sum, file_manifest, full_disk_message, interrupted_write,
                               manifest_problems, write_sum, writing)
from medfl.engine.traffic import Traffic
from medfl.training import compute_settings
from medfl.filters import FilterChain, configured_filters
from medfl.messages import RELEASE_FLAG, Instruction, PayloadError, Reply, state_mismatch
from medfl.metrics.fairness import fairness_report
from medfl.metrics.forgetting import LOWER_IS_BETTER, forgetting_report
from medfl.method import Federation, Method, derive_seed
from medfl.plugins import get_plugin_manager, lookup, registry
from medfl.privacy.ledger import PrivacyLedger, PrivacyPlan, planned_releases
from medfl.privacy.feature_release import RELEASE_METRICS
from medfl.privacy.releases import ReleaseJournal, asked_releases

__all__ = ["Run", "RunError", "RunFactory", "client_context", "final_models_of", "build_source",
           "summarize_metrics", "evaluate_metrics", "reported_by", "update_norm", "METRICS_PROVENANCE", "ENGINE_TABLES",
           "LOSS_DIVERGED", "sites_needed", "TooFewSites"]

ROLES = ["train", "val", "test", "global_test"]

#: The run and session ids of an in-process run's control fields: placeholders as long as
#: the ``uuid4().hex`` ids a Flower run sends, so the measured messages have Flower's size.
PLACEHOLDER_ID = "0" * 32


#: A round whose mean training ``loss`` over its replies exceeds this many times ``ln K`` (the
#: cross-entropy of a classifier that says "uniform" over ``K`` classes, where training starts)
#: or, from the second round on, this many times the first round's mean, is diverging: only
#: weights that blew up are that far below chance (:meth:`Run.divergence`).
LOSS_DIVERGED = 100.0
_DIVERGING = "training is diverging"


def update_norm(reply: Reply, instruction: Instruction, reply_state: dict[str, str | None]) -> float | None:
    """The L2 norm of a reply's update: its model state (each ``reply_state`` entry with a
    reference in ``instruction``) minus the state the client was sent, over the floating
    tensors both hold with the same shape; ``None`` when no entry has a reference (nothing
    to measure the update against)."""
    squares: list[torch.Tensor] = []   # summed where they lie, read once (one wait for a GPU)
    for key, ref_key in reply_state.items():
        ref = instruction.payload.get(ref_key) if ref_key else None
        new = reply.payload.get(key)
        if not isinstance(ref, dict) or not isinstance(new, dict):
            continue
        for name, value in new.items():
            old = ref.get(name)
            if (isinstance(value, torch.Tensor) and value.is_floating_point() and isinstance(old, torch.Tensor)
                    and old.shape == value.shape):
                diff = value.detach().double() - old.detach().to(value.device).double()
                squares.append(diff.square().sum())
    if not squares:
        return None
    return math.sqrt(float(torch.stack([q.to(squares[0].device) for q in squares]).sum()))


def _finite_number(value: Any) -> bool:
    """Whether a reported value is a finite number (a one-element tensor counts as its value)."""
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError, RuntimeError):
        return False


class RunError(RuntimeError):
    """A run cannot start or continue (e.g. nothing to resume)."""


#: Whose word a number is, by the split of ``metrics.csv``/``final_metrics.csv`` (its
#: ``reported_by`` column): ``self``, a site scoring its own model on data only it holds
#: (across sites nobody can check it: a hostile site can claim accuracy 1.0); ``peers``,
#: every site scoring the model on its own test split and the coordinator averaging
#: (``cross_test``; the model's own site is one of them); ``coordinator``, computed at the
#: coordinator (``public_test``). In process medfl's own code computes every number; the
#: column says whose word it is when the same run goes across sites.
METRICS_PROVENANCE = {"local_train": "self", "local_val": "self", "local_test": "self", "global_test": "self",
                      "cross_test": "peers", "public_test": "coordinator"}


class TooFewSites(RunError):
    """A round had fewer sites than ``fl.min_sites`` / ``fl.min_fraction`` ask for (fewer
    answered its training or evaluation, or, over Flower, fewer were available after
    ``fl.site_wait_s``): the run fails (status ``failed``, resumable from its last
    checkpoint) rather than go on, or finish, without its sites."""


def sites_needed(addressed: int, cfg: dict[str, Any]) -> int:
    """The fewest sites whose answers an exchange addressed to ``addressed`` sites needs: the
    larger of ``fl.min_sites`` (default 1) and ``fl.min_fraction`` of ``addressed`` (rounded
    up; null: unused), never more than ``addressed`` (0 when none is addressed). The one rule
    of the in-process engine (:meth:`Run.check_quorum`) and of Flower's coordinator, which
    waits for that many sites before it sends and, when fewer answered, for the missing ones
    to come back (:meth:`medfl.flower.server.FlowerRun.exchange`)."""
    fraction = cfg.get("min_fraction")
    want = max(int(cfg.get("min_sites", 1)), math.ceil(float(fraction) * addressed - 1e-9) if fraction else 0)
    return min(int(addressed), want)


def quorum_rule(cfg: dict[str, Any]) -> str:
    """The settings behind :func:`sites_needed`, as an error message names them."""
    rule = f"fl.min_sites {int(cfg.get('min_sites', 1))}"
    return rule + (f", fl.min_fraction {cfg['min_fraction']}" if cfg.get("min_fraction") else "")


def reported_by(split: str) -> str:
    """The ``reported_by`` value of a ``metrics.csv`` split (:data:`METRICS_PROVENANCE`; a
    split it does not name is a site's own evaluation, ``self``)."""
    return METRICS_PROVENANCE.get(split, "self")


def metrics_provenance(metrics: pd.DataFrame, train_metrics: pd.DataFrame) -> dict[str, Any]:
    """The summary's ``reported_by`` block: per split of the run's metrics, whose word it is
    (:data:`METRICS_PROVENANCE`), and the same for ``train_metrics.csv``'s columns."""
    splits = [str(x) for x in dict.fromkeys(metrics["split"])] if "split" in metrics.columns else []
    train: dict[str, str] = {}
    for col in train_metrics.columns:
        if col in ("round", "client_id"):
            continue
        train[str(col)] = ("coordinator" if col.startswith("bytes_") else
                           "self (checked against the training size the site declared)" if col == "num_examples"
                           else "self")
    return {"metrics": {split: reported_by(split) for split in splits}, "train_metrics": train,
            "meaning": {"self": "a site about its own model on its own data: unverifiable across sites",
                        "peers": "every site scored the model on its own test split (its own site included)",
                        "coordinator": "computed at the coordinator"}}


#: The run directory's files (stems of ``<stem>.csv``) the engine writes itself: a method's
#: ``final_tables`` may not take these names.
ENGINE_TABLES = frozenset({"metrics", "train_metrics", "mechanisms", "validation_metrics", "profile",
                           "final_metrics", "groups", "privacy", "communication", "forgetting", "cross_test",
                           "partition", "reply_events", "comparison", "comparison_forgetting", "predictions",
                           "flower_events", "summary", "config", "status"})
_TABLE_NAME = re.compile(r"[a-z][a-z0-9_]*")


def evaluate_metrics(y, probs) -> dict[str, float]:
    """Every registered metric on one client's predictions, plus ``n``."""
    out = {"n": float(len(y))}
    for name, reg in registry()["metric"].items():
        out[name] = float(reg.obj(y, probs)) if len(y) else float("nan")
    return out


def _write_json(path: Path, data: Any) -> None:
    """Write ``data`` to ``path`` as JSON, atomically (a full disk leaves the file before whole:
    :func:`medfl.rundir.writing`)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with writing(path, tmp):
        tmp.write_text(json.dumps(data, indent=2, default=str))
    tmp.replace(path)


def _write_csv(path: Path, df: pd.DataFrame, text: str | None = None) -> None:
    """Write ``df`` (or its CSV ``text``, already formatted) atomically with a checksum
    sidecar (``<name>.sha256``) that a resume checks (:func:`_read_rounds`)."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    with writing(path, tmp):
        if text is None:
            df.to_csv(tmp, index=False)
        else:
            with open(tmp, "w", encoding="utf-8", newline="") as f:   # the text as pandas made it
                f.write(text)
    write_sum(tmp, path)
    tmp.replace(path)


class GrowingCsv:
    """Writes the CSV files a run rewrites every round (``metrics.csv``, ``train_metrics.csv``,
    ``communication.csv``...), formatting only the rows added since the file was last written.

    Every write still writes the whole file atomically with its checksum (:func:`_write_csv`),
    but a frame whose leading rows, columns and dtypes equal what was last written for that
    file has only its new rows formatted; any other frame (a row changed, a column added, a
    dtype widened by a NaN) is formatted whole. Formatting costs about 5 us per row, so
    formatting every row every round made a long run's rounds grow slower and slower (a run
    of 20 clients spent about 0.1 s a round on it by round 500).
    """

    def __init__(self) -> None:
        self._last: dict[Path, tuple[pd.DataFrame, str]] = {}

    def write(self, path: Path, df: pd.DataFrame) -> None:
        """Write ``df`` to ``path`` as :func:`_write_csv` does."""
        last = self._last.get(path)
        text = None
        if last is not None:
            old, old_text = last
            n = len(old)
            if (len(df) >= n and list(df.columns) == list(old.columns) and list(df.dtypes) == list(old.dtypes)
                    and df.iloc[:n].reset_index(drop=True).equals(old)):
                text = old_text + (df.iloc[n:].to_csv(index=False, header=False) if len(df) > n else "")
        if text is None:
            text = df.to_csv(index=False)
        _write_csv(path, df, text)
        # a copy: a caller changing its frame in place must not change what was written
        self._last[path] = (df.reset_index(drop=True).copy(), text)


def summarize_metrics(metrics: pd.DataFrame, round: int | None = None) -> dict[str, Any]:
    """Per split, the mean, std (ddof=0), worst and best client of each metric in ``round``
    (default: the last round of ``metrics``)."""
    if metrics.empty:
        return {}
    last = int(metrics["round"].max()) if round is None else int(round)
    final = metrics[metrics["round"] == last]
    names = [c for c in final.columns
             if c not in ("round", "client_id", "client_name", "split", "reported_by", "n") and not c.startswith("n_")]
    out: dict[str, Any] = {"round": last}
    for split, df in final.groupby("split", sort=False):
        block = {}
        for m in names:
            col = df[m].astype(float)
            valid = col.dropna()
            low = m in LOWER_IS_BETTER
            worst = df.loc[valid.idxmax() if low else valid.idxmin(), "client_id"] if len(valid) else None
            lo, hi = (float(valid.min()), float(valid.max())) if len(valid) else (float("nan"), float("nan"))
            block[m] = {"mean": float(valid.mean()) if len(valid) else float("nan"),
                        "std": float(valid.std(ddof=0)) if len(valid) else float("nan"),
                        "worst": hi if low else lo,
                        "best": lo if low else hi,
                        "worst_client": None if worst is None else str(worst)}
        out[str(split)] = block
    return out


class Run:
    """One method run in ``run_dir``.

    Args:
        cfg: the resolved ``fl`` config (:func:`medfl.config.resolve_config`).
        method_spec: this run's entry of ``cfg["methods"]``.
        run_dir: the run directory (created).
        data: the federated data split (shared by every method of an experiment).
    """

    #: Where the privacy noise of a DP run comes from (``config.json``'s ``privacy.noise_seeds``).
    noise_source = ("the run seed: a reproducible simulation (whoever knows the seed could regenerate the noise; "
                    "over Flower each site mixes in its own secret)")

    #: Whether this transport can hide each client's reply from the coordinator
    #: (``fl.secure_aggregation``): not in one process, where the coordinator and the clients
    #: are one program that holds every update anyway; over Flower it can
    #: (:class:`medfl.flower.server.FlowerRun`).
    hides_replies = False

    def __init__(self, cfg: dict[str, Any], method_spec: dict[str, Any], run_dir: str | Path,
                 data: FederatedData) -> None:
        if cfg.get("secure_aggregation") and not self.hides_replies:
            raise RunError("fl.secure_aggregation runs over Flower only (medfl flower run, or fl.backend \"ray\"): "
                           "in one process the coordinator and every client are the same program, which holds each "
                           "client's update whatever it is sent, so there is no one to hide an update from and "
                           "nothing to protect; run without it in process")
        self.config = cfg
        self.method_spec = dict(method_spec)
        self.run_dir = Path(run_dir)
        self.data = data
        self.label = method_label(method_spec)
        self.coordinator: Method = build_method(method_spec)
        self.client_method: Method = build_method(method_spec)  # the client role: never set up
        cls = type(self.coordinator)
        self.store = ClientStore(self.run_dir / "clients")
        self.eval_store = ClientStore(self.run_dir / "eval_state")
        self.start_round = 1
        real = data.client_ids
        train_ids = [POOLED] if cls.pools_data else real
        sizes = {cid: len(data.rows(cid, "train")) for cid in train_ids}
        from medfl.public import PublicData, check_compatible

        #: the coordinator's public dataset (``fl.public_dataset``), read here only
        self.public = PublicData.from_config(cfg)
        if self.public is not None:
            check_compatible(self.public, data.source.num_classes, tuple(data.source.sample_shape),
                             f"fl.public_dataset of method {self.label!r}")
        self.federation = Federation(
            client_ids=train_ids, eval_client_ids=real, num_examples=sizes,
            num_classes=data.source.num_classes, rounds=int(cfg["rounds"]), seed=int(cfg["seed"]),
            fraction=float(cfg["fraction"]), model=dict(cfg["model"]),
            client_models={str(k): dict(v) for k, v in cfg["client_models"].items()},
            train=method_train(cfg, method_spec, cls), device=str(cfg["device"]),
            in_channels=data.source.in_channels, spatial_dims=data.source.spatial_dims, public=self.public,
        )
        where = f"method {self.label!r}"
        chain, self.filters_skipped = configured_filters(cfg, method_spec, self.coordinator)
        #: the run's differential privacy and filters, resolved (noise derived) before training
        self.privacy = PrivacyPlan(chain, self.federation, self.coordinator, where=where)
        # resolve_config refused it without the opt-in; a reopened older run sent them as well
        if cross_test_in_clear(cfg, self.privacy.private, where, refuse=False):
            self.privacy.send_in_clear(CROSS_TEST_IN_CLEAR)
        self.ledger = PrivacyLedger(self.privacy)
        #: every DP reply received, before the checkpoint (``releases.jsonl``)
        self.journal = ReleaseJournal(self.run_dir)
        #: rounds released before a crash, with their journal records (set by a resume)
        self._released: dict[int, list[dict[str, Any]]] = {}
        self._step = 0
        #: bytes sent to and received from each client (``communication.csv``)
        self.traffic = Traffic()
        # the control fields every message carries (:meth:`_control`); a transport with real
        # ids (Flower) replaces the placeholders when it opens its session
        self.run_id = PLACEHOLDER_ID
        self.session = PLACEHOLDER_ID
        self.resume_round = 0      # the round this session started from
        self._ckpt = 0             # the last checkpointed round
        self._prune_to = 0         # the oldest kept checkpoint: client states before it may go
        #: early stopping and best-round selection (``fl.early_stopping``; ``None``: off)
        self.early = EarlyStopping.from_config(cfg)
        self._pinned: list[int] = []   # older checkpoints kept for early stopping (best rounds)
        self._planned: tuple[int, dict[str, int]] | None = None   # (rounds, planned releases per client)
        self._lock: Any = None     # the run directory's lock while this process writes it
        self._failures: dict[str, int] = {}   # replies of each client that failed the checks
        self._excluded: set[str] = set()      # clients excluded by max_reply_failures
        #: clients kept out of given rounds' exchanges (``fl.absences``): {"<round>": {phase: ids}}
        self.absences = _absence_schedule(cfg.get("absences"), real)
        # the payloads the in-process clients checked for NaN/inf on their way out (no filter
        # after the check): the coordinator's walk of the very same tensors, unmodified since,
        # would find the same
        self._checked_finite: dict[str, wire.ContentSnapshot] = {}
        self.fold = _fold_of(self.run_dir)
        self._csv = GrowingCsv()   # the CSVs rewritten every round, formatted row by row once
        self.metrics = pd.DataFrame()
        self.train_metrics = pd.DataFrame()
        self.validation = pd.DataFrame()
        self.cross = pd.DataFrame()
        self.final_metrics = pd.DataFrame()
        self.mechanism_log = pd.DataFrame()
        #: what the method said its mechanisms could not do (``Method.mechanism_warnings``)
        self.warnings: list[dict[str, Any]] = []
        self._names = data.client_names()

    # ------------------------------------------------------------------ files
    def _checkpoint_path(self, r: int) -> Path:
        return self.run_dir / "checkpoints" / f"round_{r:04d}.pt"

    def last_checkpoint(self) -> int:
        """The last round with a complete checkpoint (0 if none)."""
        d = self.run_dir / "checkpoints"
        rounds = [int(p.stem.split("_")[1]) for p in d.glob("round_*.pt")] if d.is_dir() else []
        return max(rounds, default=0)

    def _write_static(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "checkpoints").mkdir(exist_ok=True)
        privacy = self.privacy.describe()
        if self.privacy.private:
            privacy["noise_seeds"] = self.noise_source
        if self.filters_skipped:
            privacy["filters_not_applied"] = self.filters_skipped
        secure = self.secure_aggregation()
        if secure is not None:
            privacy["secure_aggregation"] = secure
        static = {"fl": self.config, "method": self.method_spec, "method_hparams": self.coordinator.hparams(),
                  "privacy": privacy}
        preset = preset_record(self.method_spec, self.coordinator)
        if preset is not None:
            static["preset"] = preset
        if self.public is not None:
            static["public_dataset"] = self.public.describe()
        _write_json(self.run_dir / "config.json", static)
        if not (self.run_dir / "partition.csv").exists():
            self.data.save(self.run_dir / "partition.csv")

    def _log_preset(self) -> None:
        """Say on stderr which preset the method runs with, and where the run's own settings
        differ from the experiment the preset's source describes (``config.json``'s ``preset``
        has every value and where it came from)."""
        preset = method_preset(self.method_spec)
        if preset is None:
            return
        record = preset_record(self.method_spec, self.coordinator) or {}
        entries = [*record.get("values", {}).values(), *record.get("train", {}).values()]
        opened = sum(1 for e in entries if str(e["from"]).startswith("open"))
        own = sum(1 for e in entries if e["from"] == "config")
        line = (f"preset {self.method_spec['preset']!r} ({preset.source}): {len(entries) - opened - own} value(s) "
                f"from the source, {opened} it leaves open (medfl's choice), {own} from this config")
        differ = [f"{k} {v!r} (this run: {self.config[k]!r})" for k, v in preset.experiment.items()
                  if k in self.config and self.config[k] != v]
        if differ:
            line += "; the source's experiment differs from this run's: " + ", ".join(differ)
        print(f"medfl [{self.label}] {line}; config.json has every value", file=sys.stderr, flush=True)

    def _log_privacy(self) -> None:
        """Say on stderr what the run's differential privacy is (and what Opacus's validator
        changed in the model for DP-SGD); the same is in ``config.json`` under ``privacy``."""
        if self.filters_skipped:
            print(f"medfl [{self.label}] privacy: runs without fl.filters: {self.filters_skipped}", file=sys.stderr,
                  flush=True)
        if self.config["train"].get("dp") and not self.federation.train.get("dp"):
            print(f"medfl [{self.label}] privacy: runs without fl.train.dp: method {self.coordinator.name!r} sends "
                  "no model state (nothing it trains leaves the client)", file=sys.stderr, flush=True)
        if not self.privacy.private:
            return
        plan, lines = self.privacy, []
        for rel in plan.chain.releases():
            lines.append(f"{rel.mechanism}: noise multiplier {rel.noise_multiplier:.4g}, clip {rel.clip:g}, "
                         f"delta {rel.delta:g}, accountant {rel.accountant} (client-level)")
        if plan.dp_sgd is not None:
            p = plan.dp_sgd
            sig = sorted(set(round(v, 4) for v in p.noise.values()))
            lines.append(f"dp_sgd: max_grad_norm {p.settings['max_grad_norm']:g}, delta {p.settings['delta']:g}, "
                         f"accountant {p.settings['accountant']}, noise multiplier per client "
                         f"{', '.join(f'{v:g}' for v in sig)} (sample-level)")
            if p.model_fix:
                lines.append(f"dp_sgd: Opacus's ModuleValidator replaced {len(p.model_fix)} layer(s) of the model "
                             f"for per-sample gradients: {p.model_fix[0]}" + (" ..." if len(p.model_fix) > 1 else ""))
        for line in lines:
            print(f"medfl [{self.label}] privacy: {line}", file=sys.stderr, flush=True)

    def _save_checkpoint(self, r: int) -> None:
        """Write round ``r``'s checkpoint (atomically, with a checksum sidecar) recording the
        client states it goes with, drop checkpoints beyond ``keep_checkpoints``, and prune
        client states that no kept checkpoint needs (each kept one keeps its own, so a resume
        can fall back to it)."""
        path = self._checkpoint_path(r)
        tmp = path.with_suffix(".tmp")
        engine: dict[str, Any] = {"failures": dict(self._failures), "excluded": sorted(self._excluded),
                                  "warnings": list(self.warnings)}
        if self.early is not None:
            engine["early_stopping"] = self.early.state_dict()
        ckpt = {"round": r, "method": self.coordinator.state_dict(), "client_states": self.store.index(r),
                "eval_states": self.eval_store.index(r), "engine": engine, "files": file_manifest(self.run_dir)}
        with writing(path, tmp), open(tmp, "wb") as f:   # a file object: a full disk's OSError stays visible
            torch.save(ckpt, f)
        write_sum(tmp, path)
        tmp.replace(path)
        self._ckpt = r
        kept = self._kept_checkpoints()
        recent = kept[-max(1, int(self.config["keep_checkpoints"])):]
        self._pinned = self._pins(recent)
        for old in kept:
            if old not in recent and old not in self._pinned:
                old_path = self._checkpoint_path(old)
                old_path.unlink()
                old_path.with_name(old_path.name + ".sha256").unlink(missing_ok=True)
        self._prune_to = min(recent, default=r)
        self.store.prune(self._prune_to, self._pinned)
        self.eval_store.prune(self._prune_to, self._pinned)

    def _pins(self, recent: list[int]) -> list[int]:
        """The older checkpoints kept beside the ``recent`` ones (``keep_checkpoints``): with
        early stopping, the best round each of them records, so a resume from any kept
        checkpoint still finds its best round's coordinator state and client states."""
        if self.early is None:
            return []
        return sorted({b for k in recent for b in [self.early.best_at(k)] if b is not None and b < min(recent)})

    def _kept_checkpoints(self) -> list[int]:
        d = self.run_dir / "checkpoints"
        return sorted(int(p.stem.split("_")[1]) for p in d.glob("round_*.pt")) if d.is_dir() else []

    def _read_checkpoint(self, k: int) -> tuple[str, dict[str, Any] | None]:
        """Round ``k``'s checkpoint and what is wrong with it (``""``: nothing): its checksum,
        whether it is a readable medfl checkpoint, the client states it records present and
        unchanged."""
        path = self._checkpoint_path(k)
        if not path.is_file():
            return f"{path} is missing", None
        problem = check_sum(path)
        ckpt = None
        if not problem:
            try:
                ckpt = torch.load(path, map_location="cpu", weights_only=True)
                if not isinstance(ckpt, dict) or "method" not in ckpt:
                    problem = "not a medfl checkpoint"
            except Exception as exc:  # noqa: BLE001 - any unreadable file is reported the same way
                problem = f"unreadable ({type(exc).__name__}: {str(exc)[:120]})"
        if not problem and ckpt is not None:
            lost = (self.store.verify(ckpt.get("client_states", {}))
                    + self.eval_store.verify(ckpt.get("eval_states", {})))
            problem = "; ".join(lost[:3]) + (f" (and {len(lost) - 3} more)" if len(lost) > 3 else "")
        return problem, ckpt

    def _best_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint of early stopping's best round (``None``: early stopping is off or
        no round reported its metric yet).

        Raises:
            RunError: that checkpoint is missing or damaged.
        """
        if self.early is None or self.early.best_round is None:
            return None
        problem, ckpt = self._read_checkpoint(self.early.best_round)
        if problem:
            raise RunError(f"{self.run_dir}: the checkpoint of early stopping's best round {self.early.best_round} "
                           f"cannot be used: {problem}; the best round's models are lost (start a new run)")
        return ckpt

    def _intact_checkpoint(self, read_only: bool) -> tuple[int, dict[str, Any] | None]:
        """The newest checkpoint that is whole (its checksum, readable, the client states it
        records present and unchanged), newest first; a damaged newer one is renamed
        ``*.damaged`` (kept, never deleted) and the run says which round it falls back to.

        Raises:
            RunError: checkpoints exist but none is intact.
        """
        problems = []
        for k in reversed(self._kept_checkpoints()):
            path = self._checkpoint_path(k)
            problem, ckpt = self._read_checkpoint(k)
            if not problem:
                if problems and not read_only:
                    for bad, why in problems:
                        bad.replace(bad.with_name(bad.name + ".damaged"))
                        print(f"medfl [{self.label}]: {bad.name} is damaged ({why}); kept as {bad.name}.damaged",
                              file=sys.stderr, flush=True)
                    print(f"medfl [{self.label}]: resuming from the last intact checkpoint, round {k}",
                          file=sys.stderr, flush=True)
                return k, ckpt
            problems.append((path, problem))
        if problems:
            detail = "; ".join(f"{p.name}: {why}" for p, why in problems)
            raise RunError(f"{self.run_dir}: no intact checkpoint to resume from ({detail}); start a new run "
                           f"(or raise fl.keep_checkpoints, default 2, to keep more to fall back to)")
        return 0, None

    def _status(self, status: str, r: int, reason: str = "") -> None:
        _write_json(self.run_dir / "status.json", {"status": status, "last_round": r,
                                                   "rounds": self.federation.rounds, **({"reason": reason} if reason else {})})

    def check_quorum(self, r: int, phase: str, addressed: list[str], answered: list[str]) -> None:
        """Fail round ``r`` when fewer of the ``addressed`` sites took part in ``phase``
        (``answered``: those whose answers the method received) than :func:`sites_needed`
        asks for (``fl.min_sites``, ``fl.min_fraction``): a site excluded after
        ``max_reply_failures``, refused, timed out or absent does not count.

        Raises:
            TooFewSites: naming the round, how many sites answered and the minimum; the run
                is then marked ``failed`` and resumes from its last checkpoint.
        """
        need = sites_needed(len(addressed), self.config)
        if len(answered) >= need:
            return
        missing = [cid for cid in client_order(addressed) if cid not in answered]
        excluded = [cid for cid in missing if cid in self._excluded]
        raise TooFewSites(
            f"round {r}: {len(answered)} of {len(addressed)} sites answered {phase} (missing: {', '.join(missing)}"
            + (f"; excluded after max_reply_failures: {', '.join(excluded)}" if excluded else "")
            + f"), the round needs at least {need} ({quorum_rule(self.config)}); the run stops here rather than "
            f"go on without its sites; once they are back, continue with: {self.resume_command(self._top())}")

    # ------------------------------------------------------------------ clients
    def context(self, client_id: str, round: int, state_before: int | None = None) -> ClientContext:
        """Build ``client_id``'s context for ``round`` with its persistent state loaded."""
        return client_context(self.data, client_id, round, run_seed=self.federation.seed,
                              model_spec=self.federation.model_spec(client_id),
                              train=self.privacy.client_train(client_id),
                              device=self.federation.device, store=self.store, state_before=state_before)

    # ------------------------------------------------------------------ rounds
    def prepare(self, resume: bool = False, read_only: bool = False) -> None:
        """Create the run directory, or reload a stopped run's state when ``resume``
        (``read_only``: load the last checkpoint and change nothing on disk, for predicting).
        A writing run holds the run directory's lock until :meth:`execute` ends.

        Raises:
            RunError: another process holds the run directory.
        """
        if not read_only:
            if self._lock is None:
                self._lock = _lock(self.run_dir)
            self._write_static()
            self._log_preset()
            self._log_privacy()
            if self.early is not None and self.early.on_test_split:
                print(self.early.leakage_warning(self.label), file=sys.stderr, flush=True)
        self.coordinator.setup(self.federation)
        if not (resume or read_only):
            self.eval_store.rollback(0)  # a fresh run never compares with an older run's memory
            return
        k, ckpt = self._intact_checkpoint(read_only)
        if ckpt is None:
            k = 0
        else:
            lost = [] if read_only else manifest_problems(self.run_dir, ckpt.get("files") or {}, k)
            if lost:
                more = f" (and {len(lost) - 1} more file(s))" if len(lost) > 1 else ""
                self._refuse_resume(f"{lost[0]}{more}; a resume would continue from files that are not the ones "
                                    "the run wrote (rows lost or changed). Restore the file (nothing was changed), "
                                    "or start a new run")
            self._load_checkpoint(k, ckpt, read_only)
        self._released = self.journal.after(k) if not read_only else {}
        beyond = [r for r in self._released if r > self.federation.rounds]
        if beyond:
            self._refuse_resume(f"{self.run_dir}: round {max(beyond)} was released to the coordinator before the run "
                                f"stopped (releases.jsonl), but the resumed run has only {self.federation.rounds} "
                                f"rounds, so that release would never be accounted in privacy.csv; resume with "
                                f"--rounds {max(beyond)} or more")
        if not read_only:
            # what the stopped attempt wrote after round k (all of it when it stopped in round 1,
            # before any checkpoint: FedBN's local layers, a local model, the evaluation memory)
            # is redone, never continued from
            self.store.rollback(k)
            self.eval_store.rollback(k)
        for r, records in sorted(self._released.items()):
            sigma = [rel.noise_multiplier for rel in FilterChain.from_specs(records[0]["filters"]).releases()]
            sigma += [float(x["dp"]["noise_multiplier"]) for x in records[:1] if isinstance(x.get("dp"), dict)]
            print(f"medfl [{self.label}] privacy: round {r} was released to the coordinator before the run stopped "
                  f"({len(records)} DP repl{'y' if len(records) == 1 else 'ies'}, noise multiplier "
                  f"{', '.join(f'{v:.4g}' for v in sigma)}): it runs again under the parameters it was "
                  "released under; a release that comes back different is counted in privacy.csv",
                  file=sys.stderr, flush=True)

    def _refuse_resume(self, message: str) -> NoReturn:
        """Stop a resume that has changed nothing yet, releasing the run directory's lock so it
        can be resumed again at once.

        Raises:
            RunError: always, with ``message``.
        """
        if self._lock is not None:
            _unlock(self._lock)
            self._lock = None
        raise RunError(message)

    def _load_checkpoint(self, k: int, ckpt: dict[str, Any], read_only: bool) -> None:
        """Put the coordinator, the engine's bookkeeping and the per-round tables back as
        round ``k``'s checkpoint ``ckpt`` (:meth:`prepare`)."""
        self.coordinator.load_state_dict(ckpt["method"])
        engine = ckpt.get("engine", {})
        self._failures = {str(c): int(n) for c, n in engine.get("failures", {}).items()}
        self._excluded = {str(c) for c in engine.get("excluded", [])}
        self.warnings = [dict(w) for w in engine.get("warnings", [])]
        if self.early is not None:
            self.early.load_state_dict(engine.get("early_stopping", {}))
        self.start_round = k + 1
        self.resume_round = self._ckpt = k
        recent = [c for c in self._kept_checkpoints() if c <= k][-max(1, int(self.config["keep_checkpoints"])):]
        self._prune_to = min(recent, default=k)
        self._pinned = self._pins(recent) if recent else []
        if not read_only:
            self._best_checkpoint()   # early stopping's best round is still there (else stop now, saying so)
        files = {"metrics": "metrics", "train_metrics": "train_metrics", "cross": "cross_test",
                 "validation": "validation_metrics", "mechanism_log": "mechanisms"}
        for name, stem in files.items():
            df = _read_rounds(self.run_dir / f"{stem}.csv", k)
            if df is not None:
                setattr(self, name, df)
        privacy = _read_rounds(self.run_dir / "privacy.csv", k)
        if privacy is not None:
            self.ledger.load(privacy)
            changed = self.ledger.changed_noise()
            if changed and not read_only:
                print(f"medfl [{self.label}] privacy: the resumed run's noise differs from the noise spent so far "
                      f"(another number of rounds re-derives it for the target epsilon): {changed[0]}"
                      f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}; privacy.csv reports the "
                      "epsilon actually spent, which may end above the target", file=sys.stderr, flush=True)
        traffic = _read_rounds(self.run_dir / "communication.csv", k)
        if traffic is not None:
            self.traffic.load(traffic)

    def run_round(self, r: int, pm: Any) -> list[dict[str, Any]]:
        """Train, aggregate and evaluate round ``r``; return its evaluation rows."""
        train_rows = []
        addressed: dict[str, int] = {}
        dp_steps: dict[str, float] = {}
        own, own_steps = self.privacy.own, {}   # the method's own DP (Method.own_dp) and its reported steps
        # a round released before a crash runs under the parameters it was released under
        restore = self.privacy.released_under(self._released.get(r))
        for step in range(max(1, int(self.coordinator.round_steps(r)))):
            self._step = step
            instructions = self.coordinator.configure_round(r)
            self._addressed(instructions, self.federation.client_ids, r, "configure_round")
            asked = list(instructions)
            instructions = self._without_excluded(instructions, r, "train")
            for cid in instructions:
                addressed[cid] = addressed.get(cid, 0) + 1
            self.traffic.begin()
            replies = self.screen(r, instructions, self.unfilter(r, instructions, self.update_clients(r, instructions)))
            self.check_quorum(r, "train", asked, list(replies))
            sent = self.traffic.tally("train")
            for cid, reply in replies.items():
                if "dp_steps" in reply.metrics:
                    dp_steps[cid] = dp_steps.get(cid, 0.0) + float(reply.metrics["dp_steps"])
                if own is not None and own.steps_metric in reply.metrics:
                    own_steps[cid] = own_steps.get(cid, 0.0) + float(reply.metrics[own.steps_metric])
                to_client, from_client = sent.get(cid, (0, 0))
                train_rows.append({"round": r, "client_id": cid, "num_examples": reply.num_examples,
                                   "bytes_to_client": to_client, "bytes_from_client": from_client,
                                   **{k: float(v) for k, v in reply.metrics.items()}})
                pm.hook.on_client_end(run=self, round=r, client_id=cid, metrics=dict(reply.metrics))
            with compute_settings(self.federation.train, self.federation.device):
                self.coordinator.server_update(r, self.aggregated(r, replies))
            del replies
        if train_rows:
            self.train_metrics = pd.concat([self.train_metrics, pd.DataFrame(train_rows)], ignore_index=True)
            self._csv.write(self.run_dir / "train_metrics.csv", self.train_metrics)
            text = self.divergence(r)
            if text:
                self.warnings.append({"round": r, "warning": text})
                print(f"medfl [{self.label}] round {r}: warning: {text}", file=sys.stderr, flush=True)
        if self.privacy.private:
            released = self.coordinator.round_releases(r) if self.privacy.method_release is not None else []
            self.ledger.record(r, {cid: addressed[cid] for cid in client_order(addressed)},
                               dp_steps if self.privacy.dp_sgd is not None else None, released,
                               own_steps if own is not None else None, extra=self.journal.extra(r, addressed))
            self._csv.write(self.run_dir / "privacy.csv", self.ledger.frame())
        restore()
        checks = self.coordinator.configure_validate(r)
        if checks:
            self._addressed(checks, self.federation.eval_client_ids, r, "configure_validate")
            checks = self._without_excluded(checks, r, "validate")
            scores = self.screen_scores(r, "validate", checks, self.validate_clients(r, checks))
            self.coordinator.server_validate(r, scores)
            if scores:
                rows_v = [{"round": r, "client_id": cid, **{k: float(v) for k, v in m.items()}}
                          for cid, m in scores.items()]
                self.validation = pd.concat([self.validation, pd.DataFrame(rows_v)], ignore_index=True)
                self._csv.write(self.run_dir / "validation_metrics.csv", self.validation)
        every = int(self.config.get("eval_every", 1))
        rows = []
        if r == self.federation.rounds or (every > 0 and r % every == 0):
            rows = self.evaluate(r)
            self.metrics = pd.concat([self.metrics, pd.DataFrame(rows)], ignore_index=True)
            self._csv.write(self.run_dir / "metrics.csv", self.metrics)
            if self.early is not None:   # decided before the checkpoint, which records it
                self.early.observe(r, rows, self.federation.rounds)
        self._csv.write(self.run_dir / "communication.csv", self.traffic.frame())
        self.record_mechanisms(r)
        self._save_checkpoint(r)
        return rows

    def divergence(self, r: int) -> str:
        """Why round ``r``'s training looks diverged, once per run ("" when it does not, or a
        warning was given already): the mean training ``loss`` of the round's replies above
        :data:`LOSS_DIVERGED` times ``ln K`` (a model that far below chance has blown up) or,
        from the second round on, times the first round's mean when that is larger. A loss
        that becomes NaN or infinite stops the run instead
        (:class:`~medfl.engine.training.NonFiniteError`); this catches the run that stays
        finite and would finish with meaningless numbers. Honest jumps stay far below it
        (FedSDC's shuffled heads: 14 times the first round's loss on the tiny job)."""
        tm = self.train_metrics
        if "loss" not in tm.columns or any(str(w.get("warning", "")).startswith(_DIVERGING) for w in self.warnings):
            return ""
        per_round = tm.groupby("round")["loss"].mean()
        if r not in per_round.index:
            return ""
        now, first, first_round = float(per_round[r]), float(per_round.iloc[0]), int(per_round.index[0])
        chance = math.log(max(2, int(self.federation.num_classes)))
        if r > first_round and first > chance:
            ref = f"round {first_round}'s mean {first:.4g}"
            limit = LOSS_DIVERGED * first
        else:
            ref = f"ln({self.federation.num_classes}) = {chance:.3g}, the loss of a model that predicts uniformly"
            limit = LOSS_DIVERGED * chance
        if not now > limit:
            return ""
        return (f"{_DIVERGING}: the mean training loss of round {r} is {now:.4g}, more than {LOSS_DIVERGED:g} x "
                f"{ref}; its numbers mean nothing: lower train.lr or set train.clip_grad_norm")

    def record_mechanisms(self, r: int) -> None:
        """What the method's mechanisms did in round ``r`` (:meth:`Method.mechanisms`) to
        ``mechanisms.csv``, one line per value; what they could not do
        (:meth:`Method.mechanism_warnings`) on stderr and into the summary's ``warnings``."""
        lines = []
        for i, row in enumerate(self.coordinator.mechanisms(r)):
            row = dict(row)
            head = {"round": r, "mechanism": str(row.pop("mechanism", "")), "scope": str(row.pop("scope", "run")),
                    "id": str(row.pop("id", ""))}
            for name, value in row.items():
                if isinstance(value, str):
                    lines.append({**head, "name": str(name), "value": float("nan"), "text": value})
                elif value is None or isinstance(value, (int, float)):
                    lines.append({**head, "name": str(name), "value": float("nan" if value is None else value),
                                  "text": ""})
                else:
                    raise RunError(f"method {self.label!r}: mechanisms({r})[{i}][{name!r}] must be a number or a "
                                   f"short string, got {type(value).__name__}")
        if lines:
            self.mechanism_log = pd.concat([self.mechanism_log, pd.DataFrame(lines)], ignore_index=True)
            self._csv.write(self.run_dir / "mechanisms.csv", self.mechanism_log)
        for text in self.coordinator.mechanism_warnings(r):
            self.warnings.append({"round": r, "warning": str(text)})
            print(f"medfl [{self.label}] round {r}: {text}", file=sys.stderr, flush=True)

    def profile(self) -> None:
        """The method's profile exchange, once before round 1 (:meth:`Method.configure_profile`):
        each addressed client's scalars go to :meth:`Method.server_profile` and ``profile.csv``."""
        instructions = self.coordinator.configure_profile()
        if not instructions:
            return
        self._addressed(instructions, self.federation.eval_client_ids, 1, "configure_profile")
        self._step = 0
        results = self.screen_scores(1, "profile", instructions, self.profile_clients(1, instructions))
        self.coordinator.server_profile(results)
        rows = [{"client_id": cid, **{k: float(v) for k, v in m.items()}} for cid, m in results.items()]
        _write_csv(self.run_dir / "profile.csv", pd.DataFrame(rows))

    def aggregated(self, r: int, replies: dict[str, Reply]) -> dict[str, Reply]:
        """What the method's ``server_update`` receives for the replies of one training step:
        the replies themselves here; under secure aggregation over Flower only their weighted
        mean (:meth:`medfl.flower.server.FlowerRun.aggregated`)."""
        return replies

    def secure_aggregation(self) -> dict[str, Any] | None:
        """The ``secure_aggregation`` entry of the run's privacy blocks (``None``: not used)."""
        return None

    def unfilter(self, r: int, instructions: dict[str, Instruction], replies: dict[str, Reply]
                 ) -> dict[str, Reply]:
        """Undo the run's reply filters on each reply (dequantize, add back the state the
        client was sent...) so the method receives full states, whatever the transport. A
        reply the chain cannot have filtered (tensors outside the method's ``reply_state``
        while a ``reply_state`` key is missing: :meth:`FilterChain.check_covered`) is dropped
        with the client named, as a reply that fails :meth:`screen`; so is a reply the chain
        cannot undo (codes of another width, a NaN where a range was expected: what a
        changed site may send), instead of stopping the run.
        """
        chain = self.privacy.chain
        for cid, reply in list(replies.items()):
            self.privacy.note_reply(reply.payload)
            train = self.privacy.client_train(cid)
            if asked_releases(self.coordinator, chain, train, instructions[cid]):   # a DP release: journaled
                self.journal.note(r, self._step, cid, chain.specs(), train.get("dp"), reply.payload)
            if not chain:
                continue
            try:
                reply.payload = chain.undo(type(self.coordinator), reply.payload, instructions[cid].payload,
                                           client_id=cid, round=r, step=self._step,
                                           seed=derive_seed(self.federation.seed, r, cid),
                                           model_spec=self.federation.model_spec(cid),
                                           where=f"reply of client {cid} in round {r}",
                                           exempt=release_exemptions(self.coordinator, instructions[cid]))
            except PayloadError as exc:   # not what the chain produces: a site's garbage
                self.refuse(r, cid, str(exc))
                del replies[cid]
        return replies

    # ------------------------------------------------------------------ untrusted replies
    def screen(self, r: int, instructions: dict[str, Instruction], replies: dict[str, Reply]) -> dict[str, Reply]:
        """Check every reply against what the coordinator expects before the method sees it;
        drop one that fails from the round (the others go on, as for a client that timed
        out) with a row in ``reply_events.csv`` naming the client and the reason, and exclude
        a client from later rounds once ``max_reply_failures`` of its replies failed."""
        kept: dict[str, Reply] = {}
        for cid, reply in replies.items():
            reason = self.reply_problem(cid, instructions[cid], reply)
            if not reason:
                kept[cid] = reply
                continue
            self.refuse(r, cid, reason)
        for cid, reason in self.norm_outliers(instructions, kept).items():
            self.refuse(r, cid, reason)
            del kept[cid]
        return kept

    def norm_outliers(self, instructions: dict[str, Instruction], replies: dict[str, Reply]) -> dict[str, str]:
        """The replies of one training step whose update (:func:`update_norm`: the model state
        minus the state sent) is longer than ``fl.update_norm_factor`` times the median
        update norm of the step's replies, each with a reason that gives its norm and the
        bound, as robust aggregators bound updates (a site scaling its weights by 1e6 would
        otherwise drag the mean). The median of one reply is its own norm and a median of
        two is their mean, which neither exceeds twice: with a factor >= 2 (the least
        allowed) a step needs three replies before one can be dropped. Nothing is bounded
        when the factor is 0, when the median is 0 (no update to compare with), or under
        secure aggregation (the coordinator never sees a single update)."""
        factor = float(self.config.get("update_norm_factor", 0) or 0)
        if not factor or self.secure_aggregation() is not None:
            return {}
        state = type(self.coordinator).reply_state
        norms = {cid: n for cid, reply in replies.items()
                 for n in [update_norm(reply, instructions[cid], state)] if n is not None}
        if len(norms) < 3:
            return {}
        median = float(np.median(list(norms.values())))
        bound = factor * median
        if not median > 0:
            return {}
        return {cid: (f"update norm {n:.6g} is above the bound {bound:.6g} (fl.update_norm_factor {factor:g} x the "
                      f"median update norm {median:.6g} of the step's {len(norms)} replies)")
                for cid, n in norms.items() if n > bound}

    def screen_scores(self, r: int, exchange: str, instructions: dict[str, Instruction],
                      scores: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
        """The scalars of a validation or profile exchange (``exchange``) whose names the
        method declared (:func:`~medfl.engine.client.reported_problem`); a client's answer
        with another name is dropped as a reply that fails :meth:`screen` (whatever the
        transport: a site may send anything)."""
        kept: dict[str, dict[str, float]] = {}
        for cid, values in scores.items():
            reason = reported_problem(self.coordinator, exchange, instructions[cid], values)
            if reason:
                self.refuse(r, cid, f"{exchange}: {reason}")
            else:
                kept[cid] = values
        return kept

    def refuse(self, r: int, cid: str, reason: str) -> None:
        """Drop a reply of ``cid`` from round ``r`` (a row in ``reply_events.csv``) and exclude
        the client from later rounds once ``max_reply_failures`` of its replies were refused:
        for the engine's checks (:meth:`screen`) and a transport's (a Flower message that
        cannot be decoded)."""
        self._failures[cid] = self._failures.get(cid, 0) + 1
        self._reply_event(r, cid, "dropped", reason)
        limit = int(self.config.get("max_reply_failures", 3))
        if limit and self._failures[cid] >= limit and cid not in self._excluded:
            self._excluded.add(cid)
            self._reply_event(r, cid, "excluded", f"{self._failures[cid]} replies failed the checks "
                                                  f"(max_reply_failures {limit}); no further instructions")

    def reply_problem(self, cid: str, instruction: Instruction, reply: Reply) -> str:
        """Why the coordinator cannot take ``reply`` from ``cid`` ("" when it can): metric
        names the method did not declare or a ``num_examples`` other than the one it declares
        for the client's training split (:func:`~medfl.engine.client.reported_problem`), payload
        keys other than those it declares (:func:`~medfl.engine.client.payload_problem`: a
        reply without its model, an extra tensor), NaN or infinite values in the metrics or
        anywhere in the payload, a model state (the method's ``reply_state``) whose keys,
        shapes or dtypes differ from the state the client was sent, or the method's own
        :meth:`~medfl.method.Method.check_reply`. In process, a payload that the client step
        checked for NaN on its way out and that nothing replaced or changed since
        (:class:`medfl.wire.ContentSnapshot`) is not walked a second time."""
        problem = reported_problem(self.coordinator, "train", instruction, reply.metrics, reply.num_examples,
                                   int(self.federation.num_examples.get(cid, 0)))
        if not problem and self.secure_aggregation() is None:   # under SecAgg+ the payload travels masked
            problem = payload_problem(self.coordinator, instruction, reply.payload)
        if problem:
            return problem
        # medfl's record of a release it performed may say inf (epsilon of a noiseless release)
        record = frozenset(RELEASE_METRICS) if instruction.config.get(RELEASE_FLAG) is True else frozenset()
        bad = [k for k, v in reply.metrics.items() if k not in record and not _finite_number(v)]
        if bad:
            return f"metrics[{bad[0]!r}] holds NaN or infinite values"
        checked = self._checked_finite.pop(cid, None)
        if checked is None or not checked.unchanged(reply.payload):
            bad = first_non_finite(reply.payload)
            if bad:
                return f"payload{bad} holds NaN or infinite values"
        for key, ref_key in type(self.coordinator).reply_state.items():
            ref = instruction.payload.get(ref_key) if ref_key else None
            if isinstance(ref, dict) and key in reply.payload:
                problem = state_mismatch(reply.payload[key], ref, f"payload[{key!r}]")
                if problem:
                    return problem
        return str(self.coordinator.check_reply(cid, instruction, reply) or "")

    def _reply_event(self, r: int, cid: str, status: str, reason: str) -> None:
        print(f"medfl [{self.label}] round {r}: reply of client {cid} {status}: {reason}", file=sys.stderr, flush=True)
        path = self.run_dir / "reply_events.csv"
        row = pd.DataFrame([{"round": r, "step": self._step, "client_id": cid, "status": status, "reason": reason}])
        append_text(path, row.to_csv(header=not path.is_file(), index=False))

    def asked(self, r: int, phase: str, ids: Iterable[str]) -> list[str]:
        """The clients of ``ids`` that exchange ``phase`` (``train``, ``validate``,
        ``evaluate``) of round ``r`` addresses, in the engine's order: not those excluded by
        ``max_reply_failures``, nor those ``fl.absences`` keeps out of it, each of which is
        recorded with :meth:`record_absence`. In process and over Flower alike, who is asked is
        decided here, so a scripted absence is what a site that dropped out of that exchange
        is: not in the round's replies (``server_update`` sees the others) or evaluation rows."""
        absent = set(self.absences.get(str(r), {}).get(phase, ()))
        out = []
        for cid in client_order(ids):
            if cid in self._excluded:
                continue
            if cid in absent:
                self.record_absence(r, phase, cid)
                continue
            out.append(cid)
        return out

    def record_absence(self, r: int, phase: str, cid: str) -> None:
        """Note that ``fl.absences`` kept ``cid`` out of ``phase`` of round ``r``; in process
        the missing rows of ``train_metrics.csv``/``metrics.csv`` are the record (a Flower run
        adds an ``absent (scheduled)`` row to ``flower_events.csv``)."""

    def _without_excluded(self, instructions: dict[str, Instruction], r: int, phase: str) -> dict[str, Instruction]:
        """``instructions`` for the clients :meth:`asked` in ``phase`` of round ``r``."""
        return {cid: instructions[cid] for cid in self.asked(r, phase, instructions)}

    def _addressed(self, instructions: dict[str, Instruction], allowed: list[str], r: int, hook: str) -> None:
        unknown = sorted(set(instructions) - set(allowed))
        if unknown:
            raise RunError(f"method {self.label!r} addressed unknown client(s) {unknown} in {hook} of round {r}")

    # ------------------------------------------------------------------ messages
    def _control(self, r: int, cid: str, **extra: Any) -> dict[str, Any]:
        """The control fields of a message to client ``cid`` in round ``r`` (the ``medfl``
        record of :mod:`medfl.wire`), plus ``extra``. Over Flower they travel with every
        message; in process they are built only to measure the messages a deployment would
        send, with :data:`PLACEHOLDER_ID` for the run and session ids. With early stopping,
        ``pinned`` lists the older checkpoints the run keeps (best rounds, :meth:`_pins`),
        whose client states a site keeps beside those of ``ckpt`` and later."""
        return {"protocol": wire.PROTOCOL, "run": self.run_id, "session": self.session, "resume": self.resume_round,
                "ckpt": self._prune_to, "round": r, "seed": self.federation.seed, "client": cid, "fold": self.fold,
                "method": self.method_spec, "model": self.federation.model_spec(cid),
                "train": self.privacy.client_train(cid), "filters": self.privacy.chain.specs(), "step": self._step,
                **({"pinned": list(self._pinned)} if self.early is not None else {}),
                **({"releases": self._planned_releases().get(cid, 0)} if self.privacy.private else {}), **extra}

    def _planned_releases(self) -> dict[str, int]:
        """How many releases the run plans for each client (:func:`medfl.privacy.ledger.planned_releases`),
        sent with every message of a private run: what a site's policy counts its epsilon over
        (:mod:`medfl.policy`)."""
        key = int(self.federation.rounds)
        if self._planned is None or self._planned[0] != key:
            self._planned = (key, planned_releases(self.federation))
        return self._planned[1]

    def _request_sizes(self, r: int, instructions: dict[str, Instruction], **extra: Any) -> dict[str, int]:
        """Encoded size of the message each client of ``instructions`` would be sent
        (:func:`medfl.wire.instruction_request`), measured without copying a tensor
        (:func:`medfl.wire.instruction_request_size`); a value that several clients are sent
        (the global model) is measured once (:class:`medfl.wire.RecordCache`)."""
        cache = wire.RecordCache()
        return {cid: wire.instruction_request_size(self._control(r, cid, **extra), ins, cache)
                for cid, ins in instructions.items()}

    # ------------------------------------------------------------------ the transport seam
    def update_clients(self, r: int, instructions: dict[str, Instruction]) -> dict[str, Reply]:
        """Run ``client_update`` on each addressed client; return the replies received.

        This method and :meth:`evaluate_clients` are the only places where the coordinator
        reaches clients: here every client runs in this process, one at a time, its state
        loaded from and saved to ``clients/``. The Flower deployment overrides both to send
        the same instructions to sites (a site that does not answer is left out of the
        returned replies; the method's ``server_update`` sees only those that answered).

        Each exchange is recorded in :attr:`traffic` (``train``) with the sizes of the
        instruction and reply as Flower would send them (:mod:`medfl.wire`).
        """
        order = client_order(instructions)
        sent = self._request_sizes(r, {cid: instructions[cid] for cid in order})
        replies: dict[str, Reply] = {}
        self._checked_finite.clear()
        for cid in order:
            reply = run_client_update(self.client_method, self.context(cid, r), instructions[cid],
                                      store=self.store, filters=self.privacy.chain, step=self._step)
            if not self.privacy.chain:   # the payload as run_client_update checked it
                self._checked_finite[cid] = wire.ContentSnapshot(reply.payload)
            back = wire.train_answer_size(cid, reply.payload, reply.metrics, reply.num_examples)
            self.traffic.add(r, cid, "train", sent[cid], back)
            replies[cid] = reply
        return replies

    def validate_clients(self, r: int, instructions: dict[str, Instruction]) -> dict[str, dict[str, float]]:
        """Run ``client_validate`` on each addressed client (the validation exchange of
        :meth:`Method.configure_validate`); return each client's scalars. A transport seam
        like :meth:`update_clients`: over Flower, the sites that answered."""
        return self._scalar_clients(r, instructions, run_client_validate, "validate")

    def profile_clients(self, r: int, instructions: dict[str, Instruction]) -> dict[str, dict[str, float]]:
        """Run ``client_profile`` on each addressed client (the profile exchange of
        :meth:`Method.configure_profile`, before round ``r`` = 1); return each client's
        scalars. A transport seam like :meth:`update_clients`."""
        return self._scalar_clients(r, instructions, run_client_profile, "profile", exchange="profile")

    def _scalar_clients(self, r: int, instructions: dict[str, Instruction], step: Callable[..., dict[str, float]],
                        phase: str, **extra: Any) -> dict[str, dict[str, float]]:
        """Run a scalar exchange's client ``step`` on each addressed client, in process,
        recording its messages under ``phase`` (``extra``: the control fields Flower adds)."""
        order = client_order(instructions)
        sent = self._request_sizes(r, {cid: instructions[cid] for cid in order}, **extra)
        out = {}
        for cid in order:
            out[cid] = step(self.client_method, self.context(cid, r), instructions[cid], store=self.store)
            self.traffic.add(r, cid, phase, sent[cid], wire.encoded_size(wire.validate_answer(cid, out[cid])))
        return out

    def final_evaluate_clients(self, r: int, finals: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]],
                               splits: list[str]) -> dict[str, dict[str, dict[str, dict[str, float]]]]:
        """Every evaluated client scores the coordinator's final models on its own
        ``splits``: ``{client_id: {model name: {split: metrics}}}``. A transport seam like
        :meth:`evaluate_clients`; the models travel as one instruction per client
        (:meth:`final_instruction`), counted as the ``final`` phase of round ``r``."""
        ins = self.final_instruction(finals)
        ids = client_order(self.federation.eval_client_ids)
        sent = self._request_sizes(r, {cid: ins for cid in ids}, splits=splits, final=True)
        out = {}
        cache: dict = {}
        for cid in ids:
            ctx = self.context(cid, r, state_before=r + 1)
            # read back from the instruction, as a site does
            out[cid] = evaluate_final_models(ctx, final_models_of(ins, f"final models sent to client {cid}"), splits,
                                             evaluate_metrics, cache)
            flat = {f"{name}/{split}": m for name, per in out[cid].items() for split, m in per.items()}
            self.traffic.add(r, cid, "final", sent[cid], wire.encoded_size(wire.evaluate_answer(cid, flat)))
        return out

    @staticmethod
    def final_instruction(finals: dict[str, tuple[dict[str, Any], dict[str, torch.Tensor]]]) -> Instruction:
        """The instruction carrying the final models: states in the payload, specs (JSON)
        in the config; :func:`final_models_of` reads it back at the client."""
        return Instruction(payload={name: state for name, (_, state) in finals.items()},
                           config={"final_specs": json.dumps({name: spec for name, (spec, _) in finals.items()})})

    def evaluate_clients(self, r: int, evals: dict[str, Instruction], splits: list[str]
                         ) -> dict[str, dict[str, dict[str, float]]]:
        """Each evaluated client scores its model of round ``r`` on ``splits``, at the client.

        Returns ``{client_id: {split: metrics}}``. ``cross_test`` (the FedSKD paper's Global
        Test) scores the client's model on every client's local test split and averages
        the metrics over those clients with equal weight; each (model, data) pair is also
        returned under ``cross_test@<data client id>``. In a deployment that means the
        client's evaluation model travels to the other sites for scoring; the data never moves.

        The exchanges a deployment would have are recorded in :attr:`traffic`: ``evaluate``
        (the instruction; the metrics and, with ``cross_test``, the model's state) and
        ``score`` (every model and the shared instructions to each site, its scores back).
        """
        out: dict[str, dict[str, dict[str, float]]] = {}
        cache: dict = {}
        own = [s for s in splits if s != "cross_test"]
        cross = "cross_test" in splits
        ids = self.asked(r, "evaluate", self.federation.eval_client_ids)
        peers = None
        if cross:
            peers = {j: self.data.dataset_factories(j, ["test"])["test"] for j in self.federation.eval_client_ids}
        used = {cid: evals.get(cid, Instruction()) for cid in ids}
        sent = self._request_sizes(r, used, splits=own, want_model=cross)
        models: dict[str, dict[str, torch.Tensor]] = {}
        for cid in ids:
            ctx = self.context(cid, r, state_before=r + 1)
            memory = self.eval_store.load(cid, r)
            # the two steps of run_client_evaluate, as a site runs them: the model is at hand
            model = build_eval_model(self.client_method, ctx, used[cid])
            results = evaluate_model(model, ctx, own, evaluate_metrics, cache, memory=memory)
            self.eval_store.save(cid, r, memory)
            state = None
            if cross:
                state = {k: v.detach().cpu() for k, v in model.state_dict().items()}   # as a site sends it
                models[cid] = state
            self.traffic.add(r, cid, "evaluate", sent[cid], wire.encoded_size(wire.evaluate_answer(cid, results, state)))
            if peers is not None:
                results.update(evaluate_model(model, ctx, [], evaluate_metrics, peers=peers))
            out[cid] = results
            del model
        if models:
            self._measure_scores(r, used, models, out)
        return out

    def _measure_scores(self, r: int, used: dict[str, Instruction], models: dict[str, dict[str, torch.Tensor]],
                        out: dict[str, dict[str, dict[str, float]]]) -> None:
        """Record the ``score`` exchange of ``cross_test`` a deployment would have: each site
        is sent every evaluation model and the shared evaluation instructions
        (:func:`medfl.wire.score_request`) and answers one ``MetricRecord`` per model."""
        specs = {cid: self.federation.model_spec(cid) for cid in models}
        shared, ins_of = wire.share_instructions({owner: used[owner] for owner in models})
        cache = wire.RecordCache()
        for cid in client_order(self.federation.eval_client_ids):
            request = wire.score_request(self._control(r, cid, specs=specs, ins_of=ins_of), models, shared, cache)
            scores = {owner: out[owner][f"cross_test@{cid}"] for owner in models}
            self.traffic.add(r, cid, "score", wire.encoded_size(request),
                             wire.encoded_size(wire.score_answer(cid, scores)))

    def evaluate(self, r: int) -> list[dict[str, Any]]:
        """Every client evaluates its model of round ``r`` on each of ``eval_splits``.

        Each client's evaluation memory (its previous per-sample correctness, kept in
        ``eval_state/``) gives the ``neg_flips`` and ``neg_flip_rate`` columns. Pairwise
        ``cross_test`` scores go to ``cross_test.csv`` (one row per model and data client)."""
        evals = self.coordinator.configure_evaluate(r)
        self._addressed(evals, self.federation.eval_client_ids, r, "configure_evaluate")
        results = self.evaluate_clients(r, evals, list(self.config["eval_splits"]))
        self.check_quorum(r, "evaluate", list(self.federation.eval_client_ids), list(results))
        self.coordinator.server_evaluate(r, {cid: {split: dict(m) for split, m in results[cid].items()}
                                             for cid in client_order(results)})
        rows, pairs = [], []
        for cid in self.federation.eval_client_ids:
            for split, m in results.get(cid, {}).items():
                if split.startswith("cross_test@"):
                    data = split.split("@", 1)[1]
                    pairs.append({"round": r, "client_id": cid, "data_client_id": data,
                                  "reported_by": "self" if data == cid else "peer", **m})
                    continue
                name = metrics_split(split)
                rows.append({"round": r, "client_id": cid, "client_name": self._names.get(cid, cid),
                             "split": name, "reported_by": reported_by(name), **m})
        if pairs:
            self.cross = pd.concat([self.cross, pd.DataFrame(pairs)], ignore_index=True)
            self._csv.write(self.run_dir / "cross_test.csv", self.cross)
        return rows

    def evaluate_finals(self, r: int) -> dict[str, Any]:
        """Score the coordinator's final models (:meth:`Method.final_models`) on the public
        test split, here, and on every client's own splits, at the clients; write
        ``final_metrics.csv`` and return the summary's ``final_models`` block: per model,
        per split, the mean/std/worst/best over clients (:func:`summarize_metrics`)."""
        finals = self.coordinator.final_models()
        if not finals:
            return {}
        from medfl.training import predict_proba

        rows: list[dict[str, Any]] = []
        if self.public is not None:
            ctx = ClientContext(client_id="coordinator", round=r, seed=self.federation.seed, datasets={},
                                model_spec=self.federation.model_spec(), train=dict(self.federation.train),
                                device=self.federation.device)
            loader = self.public.loader("test", batch_size=int(self.federation.train.get("eval_batch_size", 64)),
                                        shuffle=False, augment=False)
            for name, (spec, state) in finals.items():
                model = build_final_model(spec, state, ctx, f"final model {name!r}")
                y, p = predict_proba(model, loader, self.federation.device)
                rows.append({"model": name, "round": r, "client_id": "coordinator", "client_name": "coordinator",
                             "split": "public_test", "reported_by": reported_by("public_test"),
                             **evaluate_metrics(y, p)})
        splits = [s for s in self.config["eval_splits"] if s != "cross_test"]
        results = self.final_evaluate_clients(r, finals, splits)
        for cid in client_order(results):
            for name, per in results[cid].items():
                for split, m in per.items():
                    split = "local_" + split if split != "global_test" else split
                    rows.append({"model": name, "round": r, "client_id": cid, "client_name": self._names.get(cid, cid),
                                 "split": split, "reported_by": reported_by(split), **m})
        self.final_metrics = pd.DataFrame(rows)
        _write_csv(self.run_dir / "final_metrics.csv", self.final_metrics)
        self._csv.write(self.run_dir / "communication.csv", self.traffic.frame())
        return {name: summarize_metrics(df.drop(columns=["model"]))
                for name, df in self.final_metrics.groupby("model", sort=False)}

    def write_final_tables(self) -> None:
        """Write the method's own tables (:meth:`Method.final_tables`) as ``<name>.csv``.

        Raises:
            RunError: a bad table name (or one of the engine's own files), or a value that is
                not a number or a string."""
        for name, rows in self.coordinator.final_tables().items():
            if not isinstance(name, str) or not _TABLE_NAME.fullmatch(name) or name in ENGINE_TABLES:
                raise RunError(f"method {self.label!r}: final_tables() names a table {name!r}; use lowercase "
                               f"letters, digits and underscores, not one of the engine's own files "
                               f"({', '.join(sorted(ENGINE_TABLES))})")
            for i, row in enumerate(rows):
                bad = [k for k, v in dict(row).items() if not (v is None or isinstance(v, (int, float, str)))]
                if bad:
                    raise RunError(f"method {self.label!r}: final_tables()[{name!r}][{i}]: {bad} must be numbers "
                                   "or short strings")
            _write_csv(self.run_dir / f"{name}.csv", pd.DataFrame([dict(r) for r in rows]))

    def write_groups(self, groups: dict[str, str], round: int | None = None) -> dict[str, Any]:
        """Write ``groups.csv`` (client, group) and return the summary's ``groups`` block:
        each group's clients and the mean of every metric per split over them in ``round``
        (default: the last round; early stopping's best round at the end of such a run)."""
        frame = pd.DataFrame([{"client_id": cid, "client_name": self._names.get(cid, cid), "group": g}
                              for cid, g in groups.items()])
        _write_csv(self.run_dir / "groups.csv", frame)
        out: dict[str, Any] = {}
        for g, part in frame.groupby("group", sort=False):
            ids = set(part["client_id"])
            sub = self.metrics[self.metrics["client_id"].astype(str).isin(ids)] if len(self.metrics) else self.metrics
            final = summarize_metrics(sub, round) if len(sub) else {}
            out[str(g)] = {"clients": client_order(list(ids)),
                           "final": {split: {m: v["mean"] for m, v in block.items()}
                                     for split, block in final.items() if isinstance(block, dict)}}
        return out

    def execute(self, stop_after_round: int | None = None) -> dict[str, Any]:
        """Run the remaining rounds; return the summary (empty when stopped early). Releases
        the run directory's lock when it returns or fails."""
        try:
            return self._execute(stop_after_round)
        finally:
            _unlock(self._lock)
            self._lock = None

    @property
    def stopped_early(self) -> bool:
        """Whether early stopping ended the run before its planned last round."""
        return self.early is not None and self.early.stopped_at is not None

    @property
    def rounds_run(self) -> int:
        """The run's last round: where early stopping stopped it, else the planned last one."""
        return self.early.stopped_at if self.early is not None and self.early.stopped_at is not None \
            else self.federation.rounds

    def _execute(self, stop_after_round: int | None) -> dict[str, Any]:
        pm = get_plugin_manager()
        pm.hook.on_run_start(run=self)
        rounds = self.federation.rounds
        # a run resumed after early stopping decided to stop has no round left to train
        last = min(self.rounds_run, stop_after_round) if stop_after_round else self.rounds_run
        t0 = time.perf_counter()
        bar = tqdm(self._round_numbers(self.start_round, last), desc=f"{self.label}", unit="round",
                   disable=not self.config.get("progress", True), leave=True,
                   initial=self.start_round - 1, total=rounds)
        try:
            self._rounds(bar, last, pm)
            bar.close()
            if not self.stopped_early and last < rounds:
                self._status("stopped", last)
                return {}
            return self._finish(self.rounds_run, t0)
        except Exception as exc:
            bar.close()
            try:
                self._status("failed", self._ckpt, f"{type(exc).__name__}: {exc}")   # never "running"; resume restarts after _ckpt
            except OSError:   # no room for it either: the status.json before stays, whole
                pass
            full = full_disk_message(exc, self.run_dir)
            if full is not None:   # one line, not the tracebacks of every write that failed after it
                raise RunError(f"{full}; the run stopped: {self._saved()}, with its checkpoint, CSVs and client "
                               "states as they were then; free space on that device, then continue with: "
                               f"{self.resume_command(self._top())}") from exc
            raise
        except (KeyboardInterrupt, SystemExit):
            # Ctrl-C, or a SIGTERM turned into SystemExit (Flower's ServerApp when its
            # SuperLink is stopped or restarted): the saved rounds stay, resumable
            bar.close()
            self._status("interrupted", self._ckpt)
            print(f"\nmedfl [{self.label}]: interrupted; {self._saved()} (status.json says \"interrupted\"); "
                  f"continue with: {self.resume_command(self._top())}", file=sys.stderr, flush=True)
            raise

    def _top(self) -> Path:
        """The experiment directory this run belongs to (what ``medfl resume`` is given)."""
        top = self.run_dir.parent
        while (top.parent / "config.json").is_file():
            top = top.parent
        return top

    def _saved(self) -> str:
        """Which rounds a stopped run has saved, in words (a resume continues after them)."""
        return (f"round 1 is saved in {self.run_dir}" if self._ckpt == 1 else
                f"rounds 1-{self._ckpt} are saved in {self.run_dir}" if self._ckpt else
                f"no round was finished yet in {self.run_dir} (a resume starts at round 1)")

    def resume_command(self, top: Path) -> str:
        """The command that continues this run's experiment ``top`` (told on an interruption)."""
        return f"medfl resume {top}"

    def _round_numbers(self, first: int, last: int) -> Iterator[int]:
        """Rounds ``first`` to ``last``, ending after the round where early stopping decided
        to stop (the progress bar then counts that round and closes cleanly)."""
        for r in range(first, last + 1):
            if self.stopped_early:
                return
            yield r

    def _rounds(self, bar: Any, last: int, pm: Any) -> None:
        """The round loop of :meth:`execute` (the profile exchange first on a fresh run)."""
        if self.start_round == 1 and last >= 1:
            self.profile()
        for r in bar:
            rows = self.run_round(r, pm)
            local = [x.get("accuracy") for x in rows if x["split"] == "local_test"]
            post = {}
            if local:
                post["local_acc"] = f"{sum(local) / len(local):.3f}"
            eps = [float(x["epsilon"]) for x in self.ledger.rows if x["round"] == r]
            if eps:
                post["eps"] = f"{max(eps):.2f}"
            if post:
                bar.set_postfix(post)
            self._status("running", r)
            pm.hook.on_round_end(run=self, round=r, metrics=rows)

    def _restore_best(self) -> int | None:
        """With early stopping, put the coordinator back in the state of the best round's
        checkpoint (before ``finalize``: its post-hoc stages and final models start from
        the best round's models); return the best round (``None``: early stopping is off,
        or no evaluated round reported its metric and the last round's state stays)."""
        ckpt = self._best_checkpoint()
        if ckpt is None:
            return None
        self.coordinator.load_state_dict(ckpt["method"])
        return int(ckpt["round"])

    def _finish(self, rounds: int, t0: float) -> dict[str, Any]:
        """After the last round (``rounds``: the last round run): with early stopping,
        restore the best round's coordinator state; finalize, score the final models, write
        the summary (its ``final`` block: the best round's metrics under early stopping,
        else the last round's)."""
        pm = get_plugin_manager()
        best = self._restore_best()
        if self.early is not None and self.early.stopped_at is not None:
            print(self.early.stop_message(self.label), file=sys.stderr, flush=True)
        self.coordinator.finalize()
        self.write_final_tables()
        finals = self.evaluate_finals(rounds)
        summary = {"method": self.method_spec["name"], "label": self.label,
                   "rounds": rounds, "num_clients": len(self.federation.eval_client_ids),
                   "seed": self.federation.seed, "wall_time_s_last_session": time.perf_counter() - t0,
                   "final": summarize_metrics(self.metrics, best)}
        selected = self.metrics
        if self.early is not None:
            summary["last_round"] = summarize_metrics(self.metrics)
            summary["early_stopping"] = self.early.summary(
                self.federation.rounds, rounds,
                None if best is None else str(self._checkpoint_path(best).relative_to(self.run_dir)))
            if best is not None:
                selected = self.metrics[self.metrics["round"] == best]
        summary["reported_by"] = metrics_provenance(self.metrics, self.train_metrics)
        forgetting, per_round = forgetting_report(self.metrics, self.train_metrics)
        summary["forgetting"] = forgetting
        summary["privacy"] = self.ledger.summary()
        secure = self.secure_aggregation()
        if secure is not None:
            summary["privacy"]["secure_aggregation"] = secure
        summary["communication"] = self.traffic.summary(rounds)
        fairness = fairness_report(selected, "local_test")
        if fairness:
            summary["fairness"] = fairness
        if finals:
            summary["final_models"] = finals
        groups = self.coordinator.client_groups()
        if groups:
            summary["groups"] = self.write_groups(groups, best)
        if self.public is not None:
            summary["public_dataset"] = self.public.describe()
        report = self.coordinator.report()
        if report:
            summary["method_report"] = report
        if self.warnings:
            summary["warnings"] = list(self.warnings)
        _write_csv(self.run_dir / "forgetting.csv", per_round)
        _write_json(self.run_dir / "summary.json", summary)
        pm.hook.on_run_end(run=self, summary=summary)     # plots and reports; then the run is finished
        self._status("finished", rounds)
        return summary


def final_models_of(instruction: Instruction, where: str) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """The final models an instruction of :meth:`Run.final_instruction` carries:
    ``{name: (spec, state)}``.

    Raises:
        ValueError: the specs are not JSON naming exactly the payload's models.
    """
    try:
        specs = json.loads(str(instruction.config.get("final_specs", "")))
    except ValueError:
        raise ValueError(f"{where}: final_specs is not JSON") from None
    payload = instruction.payload if isinstance(instruction.payload, dict) else {}
    if not isinstance(specs, dict) or set(specs) != set(payload):
        raise ValueError(f"{where}: the final models' specs ({sorted(specs) if isinstance(specs, dict) else specs!r}) "
                         f"do not name the models sent ({sorted(payload)})")
    return {str(name): (dict(specs[name]), payload[name]) for name in specs}


def _fold_of(run_dir: Path) -> int | None:
    """The cross-validation fold of a run: the ``fold`` of the ``config.json`` beside
    ``run_dir``, as :func:`run_experiment` writes it for each fold (``None``: none)."""
    cfg = run_dir.parent / "config.json"
    try:
        fold = json.loads(cfg.read_text()).get("fold") if cfg.is_file() else None
    except (OSError, ValueError, AttributeError):
        return None
    return None if fold is None else int(fold)


def _absence_schedule(schedule: dict[str, dict[str, list[str]]] | None, clients: list[str]
                      ) -> dict[str, dict[str, list[str]]]:
    """``fl.absences`` as resolved by :func:`medfl.config.check_absences` (``{}`` without
    one), its client ids checked against the run's partition.

    Raises:
        RunError: a client id that is not one of the partition's, naming where it is listed.
    """
    for r, phases in (schedule or {}).items():
        for phase, ids in phases.items():
            unknown = [c for c in ids if c not in clients]
            if unknown:
                raise RunError(f"fl.absences[{r}].{phase}: client(s) {unknown} are not in this run's partition "
                               f"(clients {', '.join(client_order(clients))})")
    return dict(schedule or {})


def _read_rounds(path: Path, upto: int) -> pd.DataFrame | None:
    """The rows of a per-round CSV of a run up to round ``upto`` (``None``: no such file)."""
    if not path.is_file():
        return None
    tmp = interrupted_write(path)
    if tmp is not None:
        tmp.replace(path)        # killed between the checksum and the rename: finish the write
    problem = check_sum(path)
    if problem:
        raise RunError(f"{path}: {problem}; a resume would continue from rows that are not the ones the run "
                       "wrote (rows lost or changed). Restore the file, or start a new run")
    try:
        df = pd.read_csv(path, dtype={"client_id": str, "client_name": str, "data_client_id": str, "id": str,
                                      "text": str}, keep_default_na=False, na_values=["", "nan", "NaN"])
    except pd.errors.EmptyDataError:   # written with no row yet (a round no site answered): nothing to keep
        return None
    return df[df["round"] <= upto].reset_index(drop=True)


def client_context(data: FederatedData, client_id: str, round: int, *, run_seed: int, model_spec: dict[str, Any],
                   train: dict[str, Any], device: str, store: ClientStore, state_before: int | None = None,
                   noise_key: str = "", deployed: bool = False, coordinator: str = "") -> ClientContext:
    """``client_id``'s context for ``round`` on the split ``data``, its persistent state
    loaded from ``store``: the newest state saved before round ``state_before`` (default
    ``round + 1``: the latest, including what an earlier step of this round saved).

    Every transport builds contexts here (:meth:`Run.context` in process, a Flower site at
    the site), so the same run seed gives the same numbers. ``noise_key`` is the site's
    secret for privacy noise (:attr:`medfl.context.ClientContext.noise_key`; empty in process);
    ``deployed`` and ``coordinator`` say whether the client runs on its own machine and
    where the coordinator is (a Flower site)."""
    roles = ROLES if client_id != POOLED else ["train", "val", "test"]
    return ClientContext(
        client_id=client_id, round=round, seed=derive_seed(run_seed, round, client_id),
        datasets=data.dataset_factories(client_id, roles), model_spec=dict(model_spec),
        train=dict(train), device=device,
        state=store.load(client_id, round + 1 if state_before is None else state_before),
        sample_shape=tuple(data.source.sample_shape),
        split_sizes=data.sizes(client_id, [r for r in roles if r != "global_test"]),
        noise_key=noise_key, deployed=deployed, coordinator=coordinator,
    )


def _lock(run_dir: Path) -> Any:
    """Hold ``run_dir/.lock`` exclusively for this process (``fcntl.flock``: released when the
    process dies, so a crash never leaves a stale lock); the file names the holder's pid.

    Raises:
        RunError: another process holds it (two resumes of one run would corrupt it).
    """
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX: no locking
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    f = open(run_dir / ".lock", "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.seek(0)
        holder = f.read().strip() or "unknown"
        f.close()
        raise RunError(f"{run_dir} is in use by another medfl process (pid {holder}); wait for it to finish or "
                       "stop it, then resume") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


def _unlock(handle: Any) -> None:
    if handle is not None:
        handle.close()


#: Builds a method's run: ``(cfg, method_spec, run_dir, data) -> Run`` (:class:`Run` itself,
#: or a transport's subclass such as :class:`medfl.flower.server.FlowerRun` bound to its grid).
RunFactory = Callable[[dict[str, Any], dict[str, Any], Path, FederatedData], "Run"]


def build_source(spec: dict[str, Any]) -> Any:
    """The dataset a config's ``dataset`` section names, built by its registered plugin."""
    rest = dict(spec)
    return lookup("dataset", rest.pop("name"))(**rest)


#: The experiment level's names that left this module, and their new homes.
_MOVED = {"run_experiment": "medfl.experiment", "resume": "medfl.experiment", "predict": "medfl.predict"}


def __getattr__(name: str) -> Any:
    """``run_experiment``, ``resume`` and ``predict`` at their old path: imported from their new
    module (:mod:`medfl.experiment`, :mod:`medfl.predict`) on first use, with a
    ``DeprecationWarning`` (the engine itself never imports the levels above it)."""
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(f"medfl.engine.runner.{name} is deprecated: import it from {_MOVED[name]} "
                      "(the old path goes away in a later release)", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module(_MOVED[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
