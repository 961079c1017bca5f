"""Forgetting-based measures of a federated run (FedKPer paper, Sec. 3.3 and 4.1).

Pure functions on accuracy trajectories, usable for any method:

* **Consistency** (eqs. 7-9): the accuracy trajectory is cut into *recovery intervals*, each
  from a record-high peak to the first later round that returns to (or exceeds) that peak;
  :func:`ipfr` is the mean relative deviation from the peak over one interval,
  :func:`aipfr` the mean over intervals, :func:`consistency` ``1 - AIPFR``.
* **Backward transfer** on previously sampled clients (eq. 10): :func:`backward_transfer`.
* **Negative flips** between consecutive evaluations: :func:`negative_flips`,
  :func:`negative_flip_rate` (computed *at the client*, see below).
* **Worst client** and **global-local balance** ``(A_g + A_l) / 2``: :func:`worst_client`,
  :func:`balance`.
* :func:`forgetting_report` turns a run's ``metrics.csv`` and ``train_metrics.csv`` into the
  ``forgetting`` block of ``summary.json`` and the per-round table ``forgetting.csv``.

Choices where the paper leaves room (each is tested in ``tests/metrics/test_forgetting.py``):

* The trajectory is the evaluated rounds ``1..T`` in order (the engine does not evaluate the
  initial model, so the paper's index 0 is round 1); rounds whose value is NaN are skipped.
* Ties: a round equal to the running maximum closes the open interval (the paper's "returns
  to (or exceeds)") and is itself the next peak.
* Eq. 7 is taken literally: the sum runs over both ends of the interval and uses the
  absolute deviation, so a recovery that overshoots the peak adds its overshoot.
* Only intervals with at least one round strictly between their ends count (paper).
* A peak that is never regained before the run ends has **no** interval (paper: an interval
  ends at the first later round that returns to the peak), so ``consistency`` and ``aipfr``
  ignore the decline after the last peak: for accuracy ``[.6, .4, .7, .5, .3]`` the only
  interval is ``[0, 2]`` with IPFR ``(0 + .2/.6 + .1/.6) / 2 = .25``, so C = 0.75.
* medfl extension, *open intervals* (``include_unfinished=True``; ``consistency_open_intervals``
  and ``aipfr_open_intervals`` in the report): the unfinished last interval also counts,
  closed at the last round as if the run ended there. The paper's value ignores a final
  decline, so a run that peaks and then only declines scores a perfect consistency; the
  open-interval reading charges that decline. For ``[.6, .4, .7, .5, .3]`` it adds
  ``[2, 4]`` with IPFR ``(0 + .2/.7 + .4/.7) / 2 = 3/7``, so C = 1 - (.25 + 3/7) / 2 = 0.6607.
* No interval at all (a non-decreasing curve, a single round): AIPFR = 0, C = 1. An empty
  trajectory gives NaN.
* BwT at round T uses, for each client sampled in some round before T, the most recent such
  round t; ``A^t`` is the evaluation of round t (after round t's aggregation, i.e. the model
  that includes the client's update) or, when round t was not evaluated (``eval_every > 1``),
  the next evaluated round before T. Clients with no such evaluation are left out; no
  client left gives NaN.

What "global" and "local" accuracy are, for every method (:func:`forgetting_report`):
the engine evaluates, at each client, the model the method's ``client_eval_model`` returns
on the client's test split (``local_test``) and on the shared global test set
(``global_test``). *Global accuracy* of a round is the mean over clients of their
``global_test`` accuracy: for hub-and-spoke methods every client holds the coordinator's
global model, so it is that model's global-test accuracy; for personalised methods (Local,
FedBN: the global model with the client's own normalisation layers) it is the mean of the
clients' models on the global test set. *Local accuracy* is the mean over clients of
``local_test`` accuracy (for FedAvg: the global model on each client's test split; for Local:
each client's own model). The paper's ``A_{g,k}`` of eq. 10 (the global model on client k's
test set) is client k's ``local_test`` accuracy.

Negative flips never expose per-sample results to the coordinator: the client keeps its
last evaluation's correctness vector (one boolean per sample of each split) in a client-side
evaluation memory (:func:`medfl.engine.client_eval.run_client_evaluate`, ``memory``) and reports
only the count of samples correct last evaluation and wrong now (``neg_flips``) and that
count over the split size (``neg_flip_rate``), two scalars per split.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

__all__ = [
    "RecoveryInterval",
    "recovery_intervals",
    "ipfr",
    "aipfr",
    "consistency",
    "backward_transfer_per_client",
    "backward_transfer",
    "negative_flips",
    "negative_flip_rate",
    "balance",
    "worst_client",
    "sampled_by_round",
    "accuracy_table",
    "forgetting_report",
    "LOWER_IS_BETTER",
]

#: Per-client metrics where a lower value is better: their "worst" client has the highest value.
LOWER_IS_BETTER = frozenset({"neg_flips", "neg_flip_rate"})


@dataclass(frozen=True)
class RecoveryInterval:
    """One recovery interval ``[start, end]`` of a trajectory (positions in the sequence).

    Attributes:
        start: position of the record-high peak ``i_m``.
        end: position of the first later value ``>=`` the peak (``i_{m+1}``), or the last
            position when ``recovered`` is False.
        ipfr: the interval's inter-peak forgetting rate (eq. 7).
        recovered: whether the trajectory regained the peak (False: unfinished at the end).
    """

    start: int
    end: int
    ipfr: float
    recovered: bool


def _clean(acc: Sequence[float]) -> np.ndarray:
    a = np.asarray(list(acc), dtype=np.float64)
    return a[~np.isnan(a)]


def ipfr(acc: Sequence[float], start: int, end: int) -> float:
    """Inter-peak forgetting rate of the interval ``[start, end]`` (eq. 7).

    ``1 / (end - start) * sum_{i=start..end} |A_start - A_i| / A_start``.

    Raises:
        ValueError: ``end <= start`` or positions outside the sequence.
    """
    a = np.asarray(list(acc), dtype=np.float64)
    if not 0 <= start < end < len(a):
        raise ValueError(f"ipfr: need 0 <= start < end < {len(a)}, got start={start}, end={end}")
    peak = a[start]
    if peak <= 0:  # a zero peak is regained at once: never an interval with intermediate rounds
        return 0.0
    return float(np.abs(peak - a[start:end + 1]).sum() / peak / (end - start))


def recovery_intervals(acc: Sequence[float], *,
                       include_unfinished: bool = False) -> list[RecoveryInterval]:
    """The recovery intervals of ``acc`` that have at least one intermediate round.

    Scans the values in order; a value ``>=`` the running maximum closes the open interval
    and starts the next one. NaN values are dropped first (positions refer to the cleaned
    sequence). By default only the paper's intervals, which end where the peak is regained.
    ``include_unfinished`` (medfl extension, see the module doc): also return the open
    interval at the end (a peak not regained), closed at the last value, when it has at
    least one value after its peak.
    """
    a = _clean(acc)
    out: list[RecoveryInterval] = []
    if len(a) == 0:
        return out
    peak = 0
    for t in range(1, len(a)):
        if a[t] >= a[peak]:
            if t - peak >= 2:
                out.append(RecoveryInterval(peak, t, ipfr(a, peak, t), True))
            peak = t
    if include_unfinished and peak < len(a) - 1:
        out.append(RecoveryInterval(peak, len(a) - 1, ipfr(a, peak, len(a) - 1), False))
    return out


def aipfr(acc: Sequence[float], *, include_unfinished: bool = False) -> float:
    """Average IPFR over the recovery intervals (eq. 8); 0 with no interval, NaN if empty.

    ``include_unfinished=True`` also averages the unfinished last interval (medfl's
    open-interval reading, see the module doc); the default is the paper's."""
    if len(_clean(acc)) == 0:
        return float("nan")
    intervals = recovery_intervals(acc, include_unfinished=include_unfinished)
    return float(np.mean([iv.ipfr for iv in intervals])) if intervals else 0.0


def consistency(acc: Sequence[float], *, include_unfinished: bool = False) -> float:
    """Consistency ``C = 1 - AIPFR`` (eq. 9): 1 for a curve that never drops; NaN if empty.

    The default is the paper's value (a peak never regained has no interval);
    ``include_unfinished=True`` gives medfl's open-interval reading (see the module doc)."""
    return 1.0 - aipfr(acc, include_unfinished=include_unfinished)


def backward_transfer_per_client(
    acc: Mapping[int, Mapping[str, float]],
    sampled: Mapping[int, Iterable[str]],
    final_round: int | None = None,
) -> dict[str, float]:
    """Per client, ``A^T_k - A^t_k`` of eq. 10 for every client sampled before round T.

    Args:
        acc: ``{round: {client_id: accuracy}}`` of the evaluated rounds (``A_{g,k}``: the
            global model on client k's test set).
        sampled: ``{round: client ids sampled that round}``.
        final_round: ``T``; default the last evaluated round.

    Returns:
        ``{client_id: A^T - A^t}`` with t the most recent round before T in which the
        client was sampled (or the next evaluated round before T when t was not
        evaluated); clients without both values are left out.
    """
    rounds = sorted(acc)
    if not rounds:
        return {}
    T = rounds[-1] if final_round is None else int(final_round)
    if T not in acc:
        return {}
    last: dict[str, int] = {}
    for r in sorted(sampled):
        if r < T:
            for cid in sampled[r]:
                last[str(cid)] = r
    out: dict[str, float] = {}
    for cid, t in sorted(last.items()):
        te = min((r for r in rounds if t <= r < T), default=None)   # t, or the next evaluated round
        if te is None:
            continue
        now, then = acc[T].get(cid), acc[te].get(cid)
        if now is None or then is None or np.isnan(now) or np.isnan(then):
            continue
        out[cid] = float(now) - float(then)
    return out


def backward_transfer(
    acc: Mapping[int, Mapping[str, float]],
    sampled: Mapping[int, Iterable[str]],
    final_round: int | None = None,
) -> float:
    """Forgetting on previously sampled clients (eq. 10): the mean of
    :func:`backward_transfer_per_client`; NaN when no client was sampled before T.
    Negative values mean the global model got worse on clients it had learned from."""
    per = backward_transfer_per_client(acc, sampled, final_round)
    return float(np.mean(list(per.values()))) if per else float("nan")


def negative_flips(prev_correct: Any, correct: Any) -> int:
    """Number of samples correct at the previous evaluation and wrong now.

    Args:
        prev_correct: per-sample correctness (booleans) of the previous evaluation.
        correct: per-sample correctness now, same samples in the same order.

    Raises:
        ValueError: the two vectors differ in length.
    """
    a = np.asarray(prev_correct, dtype=bool).reshape(-1)
    b = np.asarray(correct, dtype=bool).reshape(-1)
    if a.shape != b.shape:
        raise ValueError(f"negative_flips: {a.size} previous vs {b.size} current samples")
    return int(np.count_nonzero(a & ~b))


def negative_flip_rate(prev_correct: Any, correct: Any) -> float:
    """:func:`negative_flips` over the number of samples; NaN for no samples."""
    n = np.asarray(correct).size
    return negative_flips(prev_correct, correct) / n if n else float("nan")


def balance(global_acc: float, local_acc: float) -> float:
    """Global-local balance ``(A_g + A_l) / 2`` (paper Sec. 4.1)."""
    return (float(global_acc) + float(local_acc)) / 2.0


def worst_client(acc: Mapping[str, float]) -> tuple[str | None, float]:
    """``(client_id, accuracy)`` of the lowest non-NaN accuracy; ties go to the first client
    in ``acc``'s order. ``(None, nan)`` when there is none."""
    valid = [(str(cid), float(v)) for cid, v in acc.items() if v is not None and not np.isnan(v)]
    return min(valid, key=lambda cv: cv[1]) if valid else (None, float("nan"))   # min: the first on ties


def sampled_by_round(train_metrics: pd.DataFrame) -> dict[int, list[str]]:
    """``{round: client ids}`` from a run's ``train_metrics.csv`` (one row per client that
    trained in a round: the record of the sampled clients)."""
    if train_metrics is None or train_metrics.empty or "client_id" not in train_metrics:
        return {}
    return {int(r): [str(c) for c in g["client_id"]] for r, g in train_metrics.groupby("round", sort=True)}


def accuracy_table(metrics: pd.DataFrame, split: str, metric: str = "accuracy") -> pd.DataFrame:
    """Rounds x clients table of ``metric`` on ``split`` (``local_test``, ``global_test``)
    from a run's ``metrics.csv``; empty when absent."""
    df = metrics[metrics["split"] == split] if metrics is not None and metric in metrics.columns else None
    if df is None or df.empty:
        return pd.DataFrame()
    t = df.assign(client_id=df["client_id"].astype(str)).pivot_table(
        index="round", columns="client_id", values=metric, aggfunc="mean", dropna=False)
    return t.astype(float).sort_index()


def _num(x: float) -> float | None:
    """JSON-friendly: NaN becomes None."""
    return None if x is None or (isinstance(x, float) and np.isnan(x)) else float(x)


def _nanmean(values: Iterable[float]) -> float:
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    v = v[~np.isnan(v)]
    return float(v.mean()) if v.size else float("nan")


def _interval_dict(kept: list[int], iv: RecoveryInterval) -> dict[str, Any]:
    return {"start_round": kept[iv.start], "end_round": kept[iv.end], "ipfr": iv.ipfr,
            "recovered": iv.recovered}


def _curve_block(rounds: list[int], curve: pd.Series) -> dict[str, Any]:
    """Accuracy, the paper's consistency / AIPFR / intervals and the open-interval reading
    of one accuracy curve (``rounds`` gives each value's round)."""
    values = curve.to_numpy(dtype=np.float64)
    kept = [r for r, v in zip(rounds, values) if not np.isnan(v)]
    with_open = recovery_intervals(values, include_unfinished=True)
    intervals = [iv for iv in with_open if iv.recovered]
    unfinished = [iv for iv in with_open if not iv.recovered]
    return {
        "acc_final": _num(float(values[-1])) if len(values) else None,
        "acc_mean": _num(_nanmean(values)),
        "consistency": _num(consistency(values)),
        "aipfr": _num(aipfr(values)),
        "n_intervals": len(intervals),
        "intervals": [_interval_dict(kept, iv) for iv in intervals],
        "consistency_open_intervals": _num(consistency(values, include_unfinished=True)),
        "aipfr_open_intervals": _num(aipfr(values, include_unfinished=True)),
        "open_interval": _interval_dict(kept, unfinished[0]) if unfinished else None,
    }


def _per_round(metrics: pd.DataFrame, train_metrics: pd.DataFrame | None, g_tab: pd.DataFrame,
               l_tab: pd.DataFrame, rounds: list[int]) -> pd.DataFrame:
    """:func:`forgetting_report`'s ``per_round`` table from the accuracy tables of the global
    (``g_tab``) and local (``l_tab``) test sets, one row per round of ``rounds``."""
    sampled = sampled_by_round(train_metrics) if train_metrics is not None else {}
    nan = float("nan")

    def row_mean(tab: pd.DataFrame, r: int) -> float:
        return _nanmean(tab.loc[r].tolist()) if r in tab.index else nan

    local_acc = {r: ({str(c): float(v) for c, v in l_tab.loc[r].items()} if r in l_tab.index else {})
                 for r in rounds}
    flips = {s: accuracy_table(metrics, s, "neg_flip_rate") for s in ("global_test", "local_test")}
    rows = []
    for r in rounds:
        g, l = row_mean(g_tab, r), row_mean(l_tab, r)
        wc, wv = worst_client(local_acc[r])
        per = backward_transfer_per_client(local_acc, sampled, r) if local_acc[r] else {}
        rows.append({
            "round": r, "global_acc": g, "local_acc": l, "worst_local_acc": wv,
            "worst_client": wc if wc is not None else "", "balance": balance(g, l),
            "bwt": float(np.mean(list(per.values()))) if per else nan, "bwt_clients": len(per),
            "global_neg_flip_rate": row_mean(flips["global_test"], r),
            "local_neg_flip_rate": row_mean(flips["local_test"], r),
            "sampled": " ".join(sampled.get(r, [])),
        })
    return pd.DataFrame(rows, columns=[
        "round", "global_acc", "local_acc", "worst_local_acc", "worst_client", "balance", "bwt",
        "bwt_clients", "global_neg_flip_rate", "local_neg_flip_rate", "sampled"])


def forgetting_report(
    metrics: pd.DataFrame,
    train_metrics: pd.DataFrame | None = None,
    *,
    metric: str = "accuracy",
) -> tuple[dict[str, Any], pd.DataFrame]:
    """The forgetting measures of one run, for any method.

    Args:
        metrics: the run's ``metrics.csv`` (round, client_id, split, metric columns; the
            ``neg_flip_rate`` column when the engine's evaluation memory was on).
        train_metrics: the run's ``train_metrics.csv``: which clients trained in each round.
        metric: the accuracy column the measures are computed on.

    Returns:
        ``(block, per_round)``. ``block`` (for ``summary.json``) has ``global`` (global-test
        accuracy: final, mean over rounds, ``consistency`` and ``aipfr`` as in the paper,
        its recovery ``intervals``; BwT at the last round and its mean over rounds;
        negative-flip rate on the global test set, final and mean over round pairs),
        ``local`` (the same for the mean local accuracy, plus the worst client's final
        accuracy and its mean over rounds, ``client_consistency_mean``: the mean of the
        clients' own consistencies, the local negative-flip rate) and ``balance`` (final and
        from the means over rounds, as in the paper's Table 1). Beside each consistency,
        AIPFR and client-consistency mean, the ``*_open_intervals`` key is medfl's
        open-interval reading (the unfinished last interval counted too, see the module
        doc), and ``open_interval`` is that unfinished interval (None when the last peak
        was regained or is the last round). NaN values are ``None``.
        ``per_round`` has one row per evaluated round: ``global_acc``, ``local_acc``,
        ``worst_local_acc``, ``worst_client``, ``balance``, ``bwt``, ``bwt_clients``,
        ``global_neg_flip_rate``, ``local_neg_flip_rate``, ``sampled``.
    """
    g_tab = accuracy_table(metrics, "global_test", metric)
    l_tab = accuracy_table(metrics, "local_test", metric)
    rounds = [int(r) for r in sorted(set(g_tab.index) | set(l_tab.index))]
    per_round = _per_round(metrics, train_metrics, g_tab, l_tab, rounds)
    if per_round.empty:
        return {"metric": metric, "rounds": []}, per_round
    last = per_round.iloc[-1]
    glob = _curve_block(rounds, per_round["global_acc"])
    glob.update({
        "bwt_final": _num(float(last["bwt"])), "bwt_clients": int(last["bwt_clients"]),
        "bwt_mean": _num(_nanmean(per_round["bwt"])),
        "neg_flip_rate_final": _num(float(last["global_neg_flip_rate"])),
        "neg_flip_rate_mean": _num(_nanmean(per_round["global_neg_flip_rate"])),
    })
    loc = _curve_block(rounds, per_round["local_acc"])
    client_c = [consistency(l_tab[c].to_numpy()) for c in l_tab.columns]
    client_c_open = [consistency(l_tab[c].to_numpy(), include_unfinished=True)
                     for c in l_tab.columns]
    loc.update({
        "client_consistency_mean": _num(_nanmean(client_c)),
        "client_consistency_mean_open_intervals": _num(_nanmean(client_c_open)),
        "worst_client_acc_final": _num(float(last["worst_local_acc"])),
        "worst_client_final": last["worst_client"] or None,
        "worst_client_acc_mean": _num(_nanmean(per_round["worst_local_acc"])),
        "neg_flip_rate_final": _num(float(last["local_neg_flip_rate"])),
        "neg_flip_rate_mean": _num(_nanmean(per_round["local_neg_flip_rate"])),
    })
    g_mean, l_mean = _nanmean(per_round["global_acc"]), _nanmean(per_round["local_acc"])
    block = {
        "metric": metric, "rounds": rounds, "global": glob, "local": loc,
        "balance": {"final": _num(float(last["balance"])), "mean": _num(balance(g_mean, l_mean))},
    }
    return block, per_round
