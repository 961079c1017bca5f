"""One method run in one directory: :class:`Run` does its rounds (configure, ask the
clients, screen, aggregate, evaluate, checkpoint), every client in this process unless a
backend (:mod:`medfl.backend`) gives it another ``run_factory``. The experiment level
(methods x folds x seeds, resume) is :mod:`medfl.experiment`; what a run directory holds is
listed in :mod:`medfl.rundir` (:class:`~medfl.rundir.RunDir` writes every file of it).

Early stopping and best-round selection (``fl.early_stopping``, the method's ``scored_from``
asked after every round, :meth:`Run.ask_scored_from`) are :mod:`medfl.engine.early_stopping`'s;
the decision is in each round's checkpoint, and the summary's ``selection`` block says it.
"""

from __future__ import annotations

import logging
import math
import shlex
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pandas as pd

from medfl import wire
from medfl.config import (CROSS_TEST_IN_CLEAR, build_method, cross_test_in_clear, method_label,
                          method_train)
from medfl.engine.checkpoints import Checkpoints
from medfl.engine.data import POOLED, FederatedData, client_order
from medfl.engine.early_stopping import EarlyStopping
from medfl.engine.evaluation import Evaluation, metrics_provenance, summarize_metrics
from medfl.engine.exchanges import PLACEHOLDER_ID, Exchanges, RoundBar, rounds_span
from medfl.engine.mechanisms import Mechanisms
from medfl.engine.screening import Screening, _absence_schedule
from medfl.engine.store import ClientStore
from medfl.engine.traffic import Traffic
from medfl.training import compute_settings
from medfl.filters import FilterChain, configured_filters, float_buffer_keys, parameter_keys, trainable_count
from medfl.integrity import full_disk_message
from medfl.messages import Instruction, Reply
from medfl.metrics.fairness import fairness_report
from medfl.metrics.forgetting import forgetting_report
from medfl.method import Federation, Method
from medfl.plugins import get_plugin_manager, lookup
from medfl.privacy.ledger import PrivacyLedger, PrivacyPlan
from medfl.privacy.releases import ReleaseJournal
from medfl.privacy.signal import NoiseShare
from medfl.public import PublicData, check_compatible
from medfl.rundir import RunDir, RunError, _fold_of

__all__ = ["Run", "RunError", "RunFactory", "build_source", "LOSS_DIVERGED"]

logger = logging.getLogger(__name__)

#: A round whose mean training ``loss`` over its replies exceeds this many times ``ln K`` (the
#: cross-entropy of a classifier that says "uniform" over ``K`` classes, where training starts)
#: or, from the second round on, this many times the first round's mean, is diverging: only
#: weights that blew up are that far below chance (:meth:`Run.divergence`).
LOSS_DIVERGED = 100.0
_DIVERGING = "training is diverging"


class Run(Checkpoints, Exchanges, Screening, Evaluation, Mechanisms):
    """One method run in ``run_dir``: its rounds (:meth:`run_round`, :meth:`execute`).

    Its other parts are mixins, each in its own module: how it starts, checkpoints and
    resumes (:class:`~medfl.engine.checkpoints.Checkpoints`), its exchanges with in-process
    clients (:class:`~medfl.engine.exchanges.Exchanges`), the screening of replies, exclusion
    and quorum (:class:`~medfl.engine.screening.Screening`) and evaluation
    (:class:`~medfl.engine.evaluation.Evaluation`); every file of the run is written through
    :attr:`files` (:class:`medfl.rundir.RunDir`).

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
    #: (:class:`medfl.engine.remote.RemoteRun`).
    hides_replies = False
    #: Where the clients run, in words (messages): ``in process`` here, the sites over Flower.
    where = "in process"

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
        #: every file of the run: atomic writes, checkpoints, the lock, status
        self.files = RunDir(self.run_dir, self.label)
        self.coordinator: Method = build_method(method_spec)
        self.client_method: Method = build_method(method_spec)  # the client role: never set up
        self.store = ClientStore(self.run_dir / "clients")
        self.eval_store = ClientStore(self.run_dir / "eval_state")
        self.start_round = 1
        #: the coordinator's public dataset (``fl.public_dataset``), read here only
        self.public = PublicData.from_config(cfg)
        if self.public is not None:
            check_compatible(self.public, data.source.num_classes, tuple(data.source.sample_shape),
                             f"fl.public_dataset of method {self.label!r}")
        self.federation = self._federation(cfg, method_spec, data)
        chain, self.filters_skipped = configured_filters(cfg, method_spec, self.coordinator)
        #: the run's differential privacy and filters, resolved (noise derived) before training
        self.privacy = self._privacy_plan(cfg, chain)
        #: the DP noise against the clipped signal, per round (``mechanisms.csv``, a warning)
        self.noise_share = NoiseShare(self.privacy, self.federation, type(self.coordinator).reply_state,
                                      parameter_keys, trainable_count, float_buffer_keys)
        self.check_uncovered({"": Instruction(payload={}, config={})}, 0)   # a plain reply's entries, for config.json
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
        #: the method's answer to ``scored_from`` after the last round (``None``: not yet)
        self.scored_from: int | None = None
        self._planned: tuple[int, dict[str, int]] | None = None   # (rounds, planned releases per client)
        self._failures: dict[str, int] = {}   # replies of each client that failed the checks
        self._excluded: set[str] = set()      # clients excluded by max_reply_failures
        #: clients kept out of given rounds' exchanges (``fl.absences``): {"<round>": {phase: ids}}
        self.absences = _absence_schedule(cfg.get("absences"), data.client_ids)
        # the payloads the in-process clients checked for NaN/inf on their way out (no filter
        # after the check): the coordinator's walk of the very same tensors, unmodified since,
        # would find the same
        self._checked_finite: dict[str, wire.ContentSnapshot] = {}
        self.fold = _fold_of(self.run_dir)
        self.metrics = pd.DataFrame()
        self.train_metrics = pd.DataFrame()
        self.validation = pd.DataFrame()
        self.cross = pd.DataFrame()
        self.final_metrics = pd.DataFrame()
        self.mechanism_log = pd.DataFrame()
        #: what the method said its mechanisms could not do (``Method.mechanism_warnings``)
        self.warnings: list[dict[str, Any]] = []
        self._names = data.client_names()

    def _federation(self, cfg: dict[str, Any], method_spec: dict[str, Any], data: FederatedData) -> Federation:
        """What the method is told of the federation: its training clients (one pooled client
        for a method that pools the data) and their sizes, the model and the training settings."""
        cls = type(self.coordinator)
        real = data.client_ids
        train_ids = [POOLED] if cls.pools_data else real
        sizes = {cid: len(data.rows(cid, "train")) for cid in train_ids}
        return Federation(
            client_ids=train_ids, eval_client_ids=real, num_examples=sizes,
            num_classes=data.source.num_classes, rounds=int(cfg["rounds"]), seed=int(cfg["seed"]),
            fraction=float(cfg["fraction"]), model=dict(cfg["model"]),
            client_models={str(k): dict(v) for k, v in cfg["client_models"].items()},
            train=method_train(cfg, method_spec, cls), device=str(cfg["device"]),
            in_channels=data.source.in_channels, spatial_dims=data.source.spatial_dims, public=self.public,
        )

    def _privacy_plan(self, cfg: dict[str, Any], chain: FilterChain) -> PrivacyPlan:
        """The run's privacy plan for the filter ``chain`` (noise derived before training), with
        the cross-tests sent in clear where the config allows it."""
        where = f"method {self.label!r}"
        plan = PrivacyPlan(chain, self.federation, self.coordinator, where=where)
        # resolve_config refused it without the opt-in; a reopened older run sent them as well
        if cross_test_in_clear(cfg, plan.private, where, refuse=False):
            plan.send_in_clear(CROSS_TEST_IN_CLEAR)
        return plan

    def _status(self, status: str, r: int, reason: str = "") -> None:
        """Write ``status.json`` (:meth:`RunDir.status`): ``status`` after round ``r``."""
        self.files.status(status, r, self.federation.rounds, reason)

    # ------------------------------------------------------------------ rounds
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
            self.check_uncovered(instructions, r)
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
                if self.noise_share.active:
                    self.noise_share.observe(step, cid, reply.payload, instructions[cid].payload, reply.metrics)
                to_client, from_client = sent.get(cid, (0, 0))
                train_rows.append({"round": r, "client_id": cid, "step": step, "num_examples": reply.num_examples,
                                   "bytes_to_client": to_client, "bytes_from_client": from_client,
                                   **{k: float(v) for k, v in reply.metrics.items()}})
                pm.hook.on_client_end(run=self, round=r, client_id=cid, metrics=dict(reply.metrics))
            with compute_settings(self.federation.train, self.federation.device):
                self.coordinator.server_update(r, self.aggregated(r, replies))
            del replies
        if train_rows:
            self.train_metrics = pd.concat([self.train_metrics, pd.DataFrame(train_rows)], ignore_index=True)
            self.files.write_rows("train_metrics.csv", self.train_metrics)
            text = self.divergence(r)
            if text:
                self.warnings.append({"round": r, "warning": text})
                logger.warning(f"medfl [{self.label}] round {r}: warning: {text}")
        if self.privacy.private:
            released = self.coordinator.round_releases(r) if self.privacy.method_release is not None else []
            self.ledger.record(r, {cid: addressed[cid] for cid in client_order(addressed)},
                               dp_steps if self.privacy.dp_sgd is not None else None, released,
                               own_steps if own is not None else None, extra=self.journal.extra(r, addressed))
            self.files.write_rows("privacy.csv", self.ledger.frame())
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
                self.files.write_rows("validation_metrics.csv", self.validation)
        every = int(self.config.get("eval_every", 1))
        rows = []
        evaluated = r == self.federation.rounds or (every > 0 and r % every == 0)
        if evaluated:
            rows = self.evaluate(r)
            self.metrics = pd.concat([self.metrics, pd.DataFrame(rows)], ignore_index=True)
            self.files.write_rows("metrics.csv", self.metrics)
        scored_from = self.ask_scored_from(r)
        if evaluated and self.early is not None:   # decided before the checkpoint, which records it
            self.early.observe(r, rows, self.federation.rounds, scored_from)
            self._check_best_kept(r)
        self.files.write_rows("communication.csv", self.traffic.frame())
        self.record_mechanisms(r, dp_steps, own_steps)
        self._save_checkpoint(r)
        return rows

    def divergence(self, r: int) -> str:
        """Why round ``r``'s training looks diverged, once per run ("" when it does not, or a
        warning was given already): the mean training ``loss`` of the round's replies above
        :data:`LOSS_DIVERGED` times ``ln K`` (a model that far below chance has blown up) or,
        from the second round on, times the first round's mean when that is larger. A loss
        that becomes NaN or infinite stops the run instead
        (:class:`~medfl.training.NonFiniteError`); this catches the run that stays
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
        self.files.write_csv("profile.csv", pd.DataFrame(rows))

    def aggregated(self, r: int, replies: dict[str, Reply]) -> dict[str, Reply]:
        """What the method's ``server_update`` receives for the replies of one training step:
        the replies themselves here; under secure aggregation over Flower only their weighted
        mean (:meth:`medfl.engine.remote.RemoteRun.aggregated`)."""
        return replies

    def secure_aggregation(self) -> dict[str, Any] | None:
        """The ``secure_aggregation`` entry of the run's privacy blocks (``None``: not used)."""
        return None

    def execute(self, stop_after_round: int | None = None) -> dict[str, Any]:
        """Run the remaining rounds; return the summary (empty when stopped early). Releases
        the run directory's lock when it returns or fails."""
        try:
            return self._execute(stop_after_round)
        finally:
            self.files.unlock()

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
        if self.start_round <= last:   # "round 3 of 5 in DIR", "rounds 3-5 of 5 in DIR"
            logger.info(f"medfl [{self.label}]: {rounds_span(self.start_round, last)} of {rounds} in {self.run_dir}")
        bar = RoundBar(self._round_numbers(self.start_round, last), self.label, self.start_round - 1, rounds,
                       bool(self.config.get("progress", True)))
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
            logger.warning(f"\nmedfl [{self.label}]: interrupted; {self._saved()} (status.json says \"interrupted\"); "
                           f"continue with: {self.resume_command(self._top())}")
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
        return f"medfl resume {shlex.quote(str(top))}"

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

    def _finish(self, rounds: int, t0: float) -> dict[str, Any]:
        """After the last round (``rounds``: the last round run): with early stopping,
        restore the best round's coordinator state; finalize, score the final models, write
        the summary (its ``final`` block: the best round's metrics under early stopping,
        else the last round's)."""
        pm = get_plugin_manager()
        best = self._restore_best()
        if self.early is not None and self.early.stopped_at is not None:
            logger.info(self.early.stop_message(self.label))
        self.coordinator.finalize()
        self.write_final_tables()
        finals = self.evaluate_finals(rounds)
        summary = {"method": self.method_spec["name"], "label": self.label,
                   "rounds": rounds, "num_clients": len(self.federation.eval_client_ids),
                   "seed": self.federation.seed, "wall_time_s_last_session": time.perf_counter() - t0,
                   "final": summarize_metrics(self.metrics, best)}
        selected = self.metrics
        summary["selection"] = self.selection(best, rounds)
        # the verdict on the DP noise: its worst-case ratio against the score the run reports
        self.judge_noise(rounds, int(summary["selection"]["reported_round"]))
        if self.scored_from is None:
            self.warnings.append({"round": rounds, "warning": summary["selection"]["note"]})
            logger.warning(f"medfl [{self.label}]: warning: {summary['selection']['note']}")
        if self.early is not None:
            summary["last_round"] = summarize_metrics(self.metrics)
            summary["early_stopping"] = self.early.summary(
                self.federation.rounds, rounds,
                None if best is None else str(self.files.checkpoint_path(best).relative_to(self.run_dir)))
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
        from medfl.config import threads_record   # the setting and this process's torch threads
        summary["threads"] = threads_record(self.config.get("threads"))
        groups = self.coordinator.client_groups()
        optional = {"fairness": fairness_report(selected, "local_test"), "final_models": finals,
                    "groups": self.write_groups(groups, best) if groups else None,
                    "public_dataset": self.public.describe() if self.public is not None else None,
                    "method_report": self.coordinator.report(), "warnings": list(self.warnings)}
        summary.update({k: v for k, v in optional.items() if v})   # the blocks this run has, in this order
        self.files.write_csv("forgetting.csv", per_round)
        self.files.write_json("summary.json", summary)
        pm.hook.on_run_end(run=self, summary=summary)     # plots and reports; then the run is finished
        self._status("finished", rounds)
        return summary


#: Builds a method's run: ``(cfg, method_spec, run_dir, data) -> Run`` (:class:`Run` itself,
#: or a transport's subclass such as :class:`medfl.engine.remote.RemoteRun` bound to its transport).
RunFactory = Callable[[dict[str, Any], dict[str, Any], Path, FederatedData], "Run"]


def build_source(spec: dict[str, Any]) -> Any:
    """The dataset a config's ``dataset`` section names, built by its registered plugin."""
    rest = dict(spec)
    return lookup("dataset", rest.pop("name"))(**rest)
