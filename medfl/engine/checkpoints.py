"""How a run starts, checkpoints each round and resumes: :meth:`Checkpoints.prepare` takes
the run directory's lock, writes its static files and says on stderr what the run is (preset,
privacy); each round's checkpoint records the coordinator's state, the client states it goes
with and the engine's bookkeeping (:meth:`Checkpoints._save_checkpoint`); a resume puts the
newest intact one back, with the per-round tables up to its round.

:class:`Checkpoints` is a part of the engine's :class:`~medfl.engine.runner.Run` (a mixin):
its methods use the run's ``files`` (:class:`medfl.rundir.RunDir`, where the bytes are
written), ``coordinator``, ``store``, ``eval_store``, ``early`` and tables.
"""

from __future__ import annotations

import json
import logging
from typing import Any, NoReturn

import torch

from medfl.config import method_preset, preset_counts, preset_record
from medfl.filters import FilterChain
from medfl.integrity import file_manifest, manifest_problems
from medfl.method import MethodConfigError
from medfl.models.registry import ModelConfigError, build_model, recorded_builds
from medfl.plugins import PluginError
from medfl.rundir import RunError, with_step_column

__all__ = ["Checkpoints", "REFUSALS"]

logger = logging.getLogger(__name__)

#: What stops a new run as a refusal of its settings before anything ran, its run directory
#: removed (:meth:`Checkpoints.prepare`): a method's ``setup`` refusing them, a model
#: factory refusing its options, or a model name (an inner model a wrapper builds) unknown.
REFUSALS: tuple[type[Exception], ...] = (MethodConfigError, ModelConfigError, PluginError)


class Checkpoints:
    """The run's start, checkpoints and resume (a mixin of :class:`~medfl.engine.runner.Run`,
    whose ``__init__`` sets the bookkeeping a checkpoint records: ``_ckpt``, ``_prune_to``,
    ``_pinned``, ``_failures``, ``_excluded``, ``warnings``)."""

    def prepare(self, resume: bool = False, read_only: bool = False) -> None:
        """Create the run directory, or reload a stopped run's state when ``resume``
        (``read_only``: load the last checkpoint and change nothing on disk, for predicting).
        A writing run holds the run directory's lock until :meth:`execute` ends.

        A refusal of the run's settings (:data:`REFUSALS`, below: in the method's
        :meth:`~medfl.method.Method.setup`, or by a model, every one of which is built here,
        :meth:`_check_models`) stops a new run before anything ran: the run directory this
        call created goes with it (:meth:`medfl.rundir.RunDir.discard`), so the refusal is one
        ``medfl: error:`` line and no run is left behind. Any other exception keeps the
        directory (a bug: its traceback, and a run ``medfl runs`` lists as crashed).

        Raises:
            RunError: another process holds the run directory.
            MethodConfigError: the method refused its settings in ``setup``.
            ModelConfigError: a model refused its options.
            PluginError: a model builds an unknown model.
        """
        created = not (resume or read_only or self.run_dir.exists())
        try:
            self._prepare(resume, read_only)
        except BaseException as exc:   # nothing was run: the lock and the run's log.txt go with the failure
            if created and isinstance(exc, REFUSALS):
                self.files.discard()
            elif not read_only:
                self.files.unlock()
            raise

    def _prepare(self, resume: bool, read_only: bool) -> None:
        """:meth:`prepare`, holding the lock (and the run's ``log.txt``) once it returns."""
        if not read_only:
            self.files.lock()
            if not resume:
                self._announce()
        with recorded_builds() as built:
            self.coordinator.setup(self.federation)
        if not (resume or read_only):
            self._check_models(built)
            self.eval_store.rollback(0)  # a fresh run never compares with an older run's memory
            return
        k, ckpt = self.files.intact_checkpoint(read_only, self._lost_states)
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
            # config.json (with a new --rounds) only once the resume is accepted: a refused one changes nothing
            self._announce()
            logger.info(f"medfl [{self.label}]: resumed at round {k + 1} (after the checkpoint of round {k})"
                        if k else f"medfl [{self.label}]: resumed at round 1 (no round was checkpointed)")
            # what the stopped attempt wrote after round k (all of it when it stopped in round 1,
            # before any checkpoint: FedBN's local layers, a local model, the evaluation memory)
            # is redone, never continued from
            self.store.rollback(k)
            self.eval_store.rollback(k)
        for r, records in sorted(self._released.items()):
            sigma = [rel.noise_multiplier for rel in FilterChain.from_specs(records[0]["filters"]).releases()]
            sigma += [float(x["dp"]["noise_multiplier"]) for x in records[:1] if isinstance(x.get("dp"), dict)]
            logger.info(f"medfl [{self.label}] privacy: round {r} was released to the coordinator before the run stopped "
                        f"({len(records)} DP repl{'y' if len(records) == 1 else 'ies'}, noise multiplier "
                        f"{', '.join(f'{v:.4g}' for v in sigma)}): it runs again under the parameters it was "
                        "released under; a release that comes back different is counted in privacy.csv")

    def _check_models(self, built: list[dict[str, Any]]) -> None:
        """Build once each distinct model spec of the run (the global one and each client's,
        ``fl.client_models``) that the method's ``setup`` did not build (``built``), on the
        CPU with the random state untouched, so that a model refusing its options, or naming
        an unknown inner model, stops the run in :meth:`prepare` rather than in round 1 at
        the client that builds it. Only those refusals count here: any other failure is left
        to the run, where it happened before.

        Raises:
            ModelConfigError: a factory refused its options.
            PluginError: a model builds an unknown model.
        """
        def key(spec: dict[str, Any]) -> str:   # dp_compatible (Opacus's fixer) is the privacy checks' part
            return json.dumps({k: v for k, v in spec.items() if k != "dp_compatible"}, sort_keys=True, default=str)

        fed = self.federation
        done = {key(spec) for spec in built}
        todo = {key(spec): spec for spec in (fed.model_spec(cid) for cid in
                                             [None, *sorted(set(fed.client_ids) | set(fed.eval_client_ids))])}
        for k, spec in todo.items():
            if k in done:
                continue
            try:
                with torch.random.fork_rng(devices=[]):
                    build_model({name: v for name, v in spec.items() if name != "dp_compatible"})
            except (ModelConfigError, PluginError):
                raise
            except Exception:   # noqa: BLE001 - not a refusal: the run builds it later, failing there as before
                pass

    def _announce(self) -> None:
        """Write ``config.json`` and ``partition.csv`` (:meth:`_write_static`) and say which
        preset and privacy the run applies: for a resume, only once it is accepted."""
        self._write_static()
        self._log_preset()
        self._log_privacy()
        if self.early is not None and self.early.on_test_split:
            logger.warning(self.early.leakage_warning(self.label))

    def _refuse_resume(self, message: str) -> NoReturn:
        """Stop a resume that has changed nothing yet, releasing the run directory's lock so it
        can be resumed again at once.

        Raises:
            RunError: always, with ``message``.
        """
        self.files.unlock()
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
        self.scored_from = None if engine.get("scored_from") is None else int(engine["scored_from"])
        self.start_round = k + 1
        self.resume_round = self._ckpt = k
        recent = [c for c in self.files.kept_checkpoints() if c <= k][-max(1, int(self.config["keep_checkpoints"])):]
        self._prune_to = min(recent, default=k)
        self._pinned = self._pins(recent) if recent else []
        if not read_only:
            self._best_checkpoint()   # early stopping's best round is still there (else stop now, saying so)
        files = {"metrics": "metrics", "train_metrics": "train_metrics", "cross": "cross_test",
                 "validation": "validation_metrics", "mechanism_log": "mechanisms"}
        for name, stem in files.items():
            df = self.files.read_rows(f"{stem}.csv", k)
            if df is not None:
                setattr(self, name, with_step_column(df) if stem == "train_metrics" else df)
        privacy = self.files.read_rows("privacy.csv", k)
        if privacy is not None:
            self.ledger.load(privacy)
            changed = self.ledger.changed_noise()
            if changed and not read_only:
                logger.warning(f"medfl [{self.label}] privacy: the resumed run's noise differs from the noise spent so far "
                               f"(another number of rounds re-derives it for the target epsilon): {changed[0]}"
                               f"{f' (and {len(changed) - 1} more)' if len(changed) > 1 else ''}; privacy.csv reports the "
                               "epsilon actually spent, which may end above the target")
        traffic = self.files.read_rows("communication.csv", k)
        if traffic is not None:
            self.traffic.load(traffic)

    def _write_static(self) -> None:
        """Create the run directory and write ``config.json`` (the resolved config, the method,
        its hyperparameters, preset and privacy) and ``partition.csv`` (once)."""
        self.files.create()
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
        self.files.write_json("config.json", static)
        if not (self.run_dir / "partition.csv").exists():
            self.data.save(self.run_dir / "partition.csv")

    def _log_preset(self) -> None:
        """Say on stderr, in one short line, which preset the method runs with, how many values
        it sets, how many settings of its source's experiment this run does not share, every
        value it cites no source for (a warning), and where the full table is (``config.json``'s
        ``preset`` block: every value and where it came from); the run's ``log.txt`` gets the
        source, the counts by kind and each differing setting (DEBUG)."""
        preset = method_preset(self.method_spec)
        if preset is None:
            return
        name = self.method_spec["preset"]
        record = preset_record(self.method_spec, self.coordinator) or {}
        entries = [*record.get("values", {}).values(), *record.get("train", {}).values()]
        line = f"preset {name!r} ({preset.source}): " + preset_counts(entries)
        differ = [f"{k} {v!r} (this run: {self.config[k]!r})" for k, v in preset.experiment.items()
                  if k in self.config and self.config[k] != v]
        if differ:
            line += "; the source's experiment differs from this run's: " + ", ".join(differ)
        unstated = sorted(f"train.{k}" if part == "train" else k for part in ("values", "train")
                          for k, e in record.get(part, {}).items() if e["from"] == "unstated")
        if unstated:
            line += f"; no source for {', '.join(unstated)} (the plugin's preset cites none)"
        logger.debug(f"medfl [{self.label}] {line}; config.json has every value and its source")
        short = [f"{len(entries)} value{'' if len(entries) == 1 else 's'}"]
        if differ:
            short.append(f"{len(differ)} setting{' differs' if len(differ) == 1 else 's differ'} from its source's "
                         "experiment")
        if unstated:
            short.append(f"no source for {', '.join(unstated)} (the plugin's preset cites none)")
        (logger.warning if unstated else logger.info)(
            f"medfl [{self.label}] preset {name!r} ({'; '.join(short)}): every value, its source and the source's "
            f"experiment: \"preset\" in {self.run_dir / 'config.json'}")

    def _log_privacy(self) -> None:
        """Say on stderr what the run's differential privacy is (and what Opacus's validator
        changed in the model for DP-SGD); the same is in ``config.json`` under ``privacy``."""
        if self.filters_skipped:
            logger.warning(f"medfl [{self.label}] privacy: runs without fl.filters: {self.filters_skipped}")
        if self.config["train"].get("dp") and not self.federation.train.get("dp"):
            logger.warning(f"medfl [{self.label}] privacy: runs without fl.train.dp: method {self.coordinator.name!r} sends "
                           "no model state (nothing it trains leaves the client)")
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
            logger.info(f"medfl [{self.label}] privacy: {line}")

    def _save_checkpoint(self, r: int) -> None:
        """Write round ``r``'s checkpoint (atomically, with a checksum sidecar) recording the
        client states it goes with, drop checkpoints beyond ``keep_checkpoints``, and prune
        client states that no kept checkpoint needs (each kept one keeps its own, so a resume
        can fall back to it)."""
        engine: dict[str, Any] = {"failures": dict(self._failures), "excluded": sorted(self._excluded),
                                  "warnings": list(self.warnings), "scored_from": self.scored_from}
        if self.early is not None:
            engine["early_stopping"] = self.early.state_dict()
        ckpt = {"round": r, "method": self.coordinator.state_dict(), "client_states": self.store.index(r),
                "eval_states": self.eval_store.index(r), "engine": engine, "files": file_manifest(self.run_dir)}
        self.files.save_checkpoint(r, ckpt)
        self._ckpt = r
        kept = self.files.kept_checkpoints()
        recent = kept[-max(1, int(self.config["keep_checkpoints"])):]
        self._pinned = self._pins(recent)
        self.files.drop_checkpoints(recent + self._pinned)
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

    def _best_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint of early stopping's best round (``None``: early stopping is off or
        no round reported its metric yet).

        Raises:
            RunError: that checkpoint is missing or damaged.
        """
        if self.early is None or self.early.best_round is None:
            return None
        problem, ckpt = self.files.read_checkpoint(self.early.best_round, self._lost_states)
        if problem:
            raise RunError(f"{self.run_dir}: the checkpoint of early stopping's best round {self.early.best_round} "
                           f"cannot be used: {problem}; the best round's models are lost (start a new run)")
        return ckpt

    def _lost_states(self, ckpt: dict[str, Any]) -> list[str]:
        """The client and evaluation states checkpoint ``ckpt`` records that are missing or changed."""
        return (self.store.verify(ckpt.get("client_states", {}))
                + self.eval_store.verify(ckpt.get("eval_states", {})))

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
