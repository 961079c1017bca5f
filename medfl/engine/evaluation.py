"""Evaluation in a run: each client scores its model of a round on its splits (at the
client), the coordinator's final models are scored on the public test split and every
client's splits, and the numbers are summarised (``metrics.csv``, ``cross_test.csv``,
``final_metrics.csv``, the method's own tables, ``groups.csv``, and the summary's blocks).

:class:`Evaluation` is a part of the engine's :class:`~medfl.engine.runner.Run` (a mixin):
its methods use the run's ``config``, ``coordinator``, ``federation``, ``data``, ``files``
and tables; :meth:`Evaluation.evaluate_clients` and :meth:`Evaluation.final_evaluate_clients`
are transport seams a transport's run (:class:`medfl.engine.remote.RemoteRun`) overrides.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pandas as pd
import torch

from medfl import wire
from medfl.context import ClientContext
from medfl.engine.client_eval import build_eval_model, build_final_model, evaluate_final_models, evaluate_model
from medfl.engine.data import client_order
from medfl.engine.early_stopping import metrics_split
from medfl.messages import Instruction
from medfl.metrics.forgetting import LOWER_IS_BETTER
from medfl.plugins import registry
from medfl.rundir import RunError

__all__ = ["Evaluation", "METRICS_PROVENANCE", "reported_by", "metrics_provenance", "ENGINE_TABLES",
           "evaluate_metrics", "summarize_metrics", "final_models_of"]


#: Whose word a number is, by the split of ``metrics.csv``/``final_metrics.csv`` (its
#: ``reported_by`` column): ``self``, a site scoring its own model on data only it holds
#: (across sites nobody can check it: a hostile site can claim accuracy 1.0); ``peers``,
#: every site scoring the model on its own test split and the coordinator averaging
#: (``cross_test``; the model's own site is one of them); ``coordinator``, computed at the
#: coordinator (``public_test``). In process medfl's own code computes every number; the
#: column says whose word it is when the same run goes across sites.
METRICS_PROVENANCE = {"local_train": "self", "local_val": "self", "local_test": "self", "global_test": "self",
                      "cross_test": "peers", "public_test": "coordinator"}


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
        if col in ("round", "client_id", "step"):   # the row's key: (round, client, step)
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


def summarize_metrics(metrics: pd.DataFrame, round: int | None = None) -> dict[str, Any]:
    """Per split, the mean, std (ddof=0), worst and best client of each metric in ``round``
    (default: the last round of ``metrics``), and what they cover: ``clients``, the clients
    with a value of the metric, ``of``, the clients evaluated on the split."""
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
                        "worst_client": None if worst is None else str(worst),
                        "clients": int(len(valid)), "of": int(len(df))}
        out[str(split)] = block
    return out


def final_models_of(instruction: Instruction, where: str) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """The final models an instruction of :meth:`Evaluation.final_instruction` carries:
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


class Evaluation:
    """The run's evaluation rounds and final models (a mixin of :class:`~medfl.engine.runner.Run`,
    whose ``__init__`` sets the tables it keeps: ``metrics``, ``cross``, ``final_metrics``)."""

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
        peers = ({j: self.data.dataset_factories(j, ["test"])["test"] for j in self.federation.eval_client_ids}
                 if cross else None)
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
        (:func:`medfl.wire.score_request`) and answers one metrics record per model."""
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
            self.files.write_rows("cross_test.csv", self.cross)
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
        self.files.write_csv("final_metrics.csv", self.final_metrics)
        self.files.write_rows("communication.csv", self.traffic.frame())
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
            self.files.write_csv(f"{name}.csv", pd.DataFrame([dict(r) for r in rows]))

    def write_groups(self, groups: dict[str, str], round: int | None = None) -> dict[str, Any]:
        """Write ``groups.csv`` (client, group) and return the summary's ``groups`` block:
        each group's clients and the mean of every metric per split over them in ``round``
        (default: the last round; early stopping's best round at the end of such a run)."""
        frame = pd.DataFrame([{"client_id": cid, "client_name": self._names.get(cid, cid), "group": g}
                              for cid, g in groups.items()])
        self.files.write_csv("groups.csv", frame)
        out: dict[str, Any] = {}
        for g, part in frame.groupby("group", sort=False):
            ids = set(part["client_id"])
            sub = self.metrics[self.metrics["client_id"].astype(str).isin(ids)] if len(self.metrics) else self.metrics
            final = summarize_metrics(sub, round) if len(sub) else {}
            out[str(g)] = {"clients": client_order(list(ids)),
                           "final": {split: {m: v["mean"] for m, v in block.items()}
                                     for split, block in final.items() if isinstance(block, dict)}}
        return out
