"""What FedSDC's mechanisms did each round, from the validation exchange: each head's score
and the vote's ties on the clients' ``val`` splits, pooled by val size, as ``mechanisms.csv``
rows (docs/plugins.md's FedSDC section has the table), warnings and the ``method_report``."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import torch

from medfl.seeding import round_half_up
from medfl_plugins.common import say_once

from .models import DEFAULT_MIN_HIDDEN, PAPER_EMBED_DIM, ensemble_probabilities, kept_heads, tied, vote_counts

__all__ = ["Mechanisms", "vote_record", "FREQUENT_TIES", "MIN_VOTERS", "NARROW_HIDDEN"]

#: a majority vote tied on more than this fraction of the validation samples is "frequent"
FREQUENT_TIES = 0.10
#: fewer heads than this do not vote: one head decides alone, two tie whenever they disagree
MIN_VOTERS = 3
#: heads whose rho scales fewer units than this are "narrow" (warned): on issue 37's fixture
#: measurement, rho x 16 to rho x 128 gave 20-38 % micro-F1, rho x 256 55 %, rho x 2048 85 %
NARROW_HIDDEN = 256


def vote_record(logits: torch.Tensor, y: np.ndarray, vote: str, tie_break: str) -> dict[str, float]:
    """A client's counts for the vote of heads' logits ``(H, N, K)`` on labels ``y`` ``(N,)``:
    samples whose majority vote is tied, that the heads do not all agree on, whose decision is right."""
    counts = vote_counts(logits)
    decided = ensemble_probabilities(logits, vote, tie_break).argmax(1).numpy()
    return {"vote_ties": float(tied(counts).sum()),
            "vote_disagreements": float((counts.max(1).values < len(logits)).sum()),
            "vote_correct": float((decided == y).sum())}


class Mechanisms:
    """FedSDC's mechanism records, mixed into :class:`medfl_plugins.fedsdc.FedSDC`: they read
    its settings and its ``heads``, ``widths``, ``chosen``, ``val_means`` and ``embed_dim``."""

    def hidden_base(self) -> int:
        """The width rho scales: the embedding's length, or ``min_hidden`` if larger."""
        return max(self.embed_dim, int(self.min_hidden or 0))

    def _records_state(self) -> str:
        """The records as checkpointed (JSON)."""
        return json.dumps({"trained": {str(k): v for k, v in self.trained.items()},
                           "observed": self.observed, "history": self.history, "warned": self.warned})

    def _load_records(self, text: str = "{}") -> None:
        """Restore :meth:`_records_state` (``"{}"``: no round observed yet): ``trained`` (head ->
        the client that trained it this round), ``observed`` (the last validation exchange,
        pooled), ``history`` ([round, tie rate, disagreement rate, accuracy] per round), ``warned``."""
        seen = json.loads(text)
        self.trained = {int(k): str(v) for k, v in seen.get("trained", {}).items()}
        self.observed = dict(seen.get("observed", {}))
        self.history = [list(map(float, h)) for h in seen.get("history", [])]
        self.warned = [str(w) for w in seen.get("warned", [])]

    def _observe(self, round: int, results: dict[str, dict[str, float]]) -> None:
        """Pool the round's validation scalars (:meth:`_pooled`) and add its rates to the history."""
        self.observed = {"round": round, **self._pooled(results)}
        if "tie_rate" in self.observed:
            o = self.observed
            self.history.append([float(round), o["tie_rate"], o["disagreement_rate"], o["accuracy"]])

    def _pooled(self, results: dict[str, dict[str, float]]) -> dict[str, Any]:
        """The clients' validation scalars pooled by val size (a client whose numbers are not
        counts of its own val split is left out)."""
        n_heads, ens = len(self.heads), len(self.chosen)
        tot, heads_acc, heads_f1 = 0.0, [0.0] * n_heads, [0.0] * n_heads
        clients, ties, dis, correct = 0, 0.0, 0.0, 0.0
        for r in results.values():
            n = float(r.get("n_val", math.nan))
            counts = [float(r.get(k, math.nan)) for k in ("vote_ties", "vote_disagreements", "vote_correct")]
            per = [(float(r.get(f"accuracy_{i}", math.nan)), float(r.get(f"micro_f1_{i}", math.nan)))
                   for i in range(n_heads)]
            if (not math.isfinite(n) or n <= 0 or n != int(n) or not all(0 <= c <= n for c in counts)
                    or not all(0 <= a <= 1 and 0 <= f <= 1 for a, f in per)):
                continue
            clients += 1
            tot += n
            ties, dis, correct = ties + counts[0], dis + counts[1], correct + counts[2]
            for i, (a, f) in enumerate(per):
                heads_acc[i] += n * a
                heads_f1[i] += n * f
        out: dict[str, Any] = {"val_samples": tot, "clients": clients, "ensemble": list(self.chosen),
                               "ensemble_size": ens}
        if tot > 0:
            out.update(head_accuracy=[a / tot for a in heads_acc], head_micro_f1=[f / tot for f in heads_f1],
                       tie_rate=ties / tot, disagreement_rate=dis / tot, accuracy=correct / tot)
        return out

    def mechanisms(self, round: int) -> list[dict[str, Any]]:
        """Per head (``head``) and for the vote (``vote``) what the round's validation
        exchange measured, pooled by val size; FedSDC+ adds its selection (``sparse_heads``)."""
        o = self.observed if self.observed.get("round") == round else {}
        rows: list[dict[str, Any]] = []
        for i, w in enumerate(self.widths):
            row: dict[str, Any] = {"mechanism": "head", "scope": "head", "id": str(i), "width": w,
                                   "trained_by": self.trained.get(i, ""),
                                   "accuracy": o["head_accuracy"][i] if "head_accuracy" in o else None,
                                   "micro_f1": o["head_micro_f1"][i] if "head_micro_f1" in o else None,
                                   "kept": float(i in self.chosen)}
            if self.gamma is not None:
                row["rank_score"] = self.val_means[i] if i < len(self.val_means) else None
            rows.append(row)
        if o:
            rows.append({"mechanism": "vote", "scope": "ensemble", "id": "validated",
                         "heads": float(o["ensemble_size"]), "head_ids": " ".join(map(str, o["ensemble"])),
                         "vote": self.vote, "tie_break": self.tie_break, "val_samples": o["val_samples"],
                         "tie_rate": o.get("tie_rate"), "disagreement_rate": o.get("disagreement_rate"),
                         "accuracy": o.get("accuracy")})
        if self.gamma is not None:
            rows.append({"mechanism": "sparse_heads", "scope": "run", "id": "", "kept": float(len(self.chosen)),
                         "of": float(len(self.heads)), "gamma": self.gamma, "keep_rounding": self.keep_rounding,
                         "head_ids": " ".join(map(str, self.chosen))})
        return rows

    def mechanism_warnings(self, round: int) -> list[str]:
        """What cannot act, said once each (the evidence: the configuration, from round 1;
        the round's validation for ties and missing validation data)."""
        out: list[str] = []
        say, n = say_once(self.warned, out), len(self.heads)
        if self.vote == "majority":
            k = kept_heads(self.gamma, n, self.keep_rounding) if self.gamma is not None else n
            if k < MIN_VOTERS:
                what = (f"FedSDC+ keeps {k} of {n} heads ({self.keep_rounding}({self.gamma:g} x {n}))"
                        if self.gamma is not None else f"the ensemble has {k} head(s) (one per client)")
                say("few_voters", f"{what}: a vote of 1-2 heads is not a vote (one head decides alone; two tie "
                                  "whenever they disagree, and the tie rule decides)")
        base = self.hidden_base()
        if self.head == "mlp":
            if base < NARROW_HIDDEN:
                say("narrow", f"the heads are {min(self.widths)}-{max(self.widths)} units wide behind dropout "
                              f"{self.dropout:g} (rho x {base}: embedding {self.embed_dim}, min_hidden "
                              f"{self.min_hidden}); the paper's are {round_half_up(self.rho_min * PAPER_EMBED_DIM)}-"
                              f"{PAPER_EMBED_DIM} (ResNet-50's {PAPER_EMBED_DIM}-d embedding x rho in [0.4, 1]): "
                              f"heads this narrow underfit; set min_hidden (medfl's default {DEFAULT_MIN_HIDDEN}) "
                              "or head 'linear'")
        elif self.diversity:
            say("linear_diversity", "head 'linear' has no hidden layer: Diversity (rho) cannot act, the heads "
                                    "differ only by their initialisation and by who trains them")
        o = self.observed if self.observed.get("round") == round else {}
        if o and o["val_samples"] <= 0:
            say("no_val", "no client has validation data (client_split's val): the heads' accuracy and the vote's "
                          "ties cannot be measured" + (", and FedSDC+ cannot rank its heads (it keeps the lowest "
                                                       "head indices)" if self.gamma is not None else ""))
        if (o.get("tie_rate") is not None and o["tie_rate"] > FREQUENT_TIES and self.vote == "majority"
                and self.tie_break == "lowest"):
            say("ties", f"the vote of heads {' '.join(map(str, o['ensemble']))} is tied on "
                        f"{100 * o['tie_rate']:.1f} % of the validation samples and tie_break 'lowest' gives every "
                        "tie to the lowest tied class index; tie_break 'mean_probability' decides ties by the "
                        "heads' probabilities")
        return out

    def report(self) -> dict[str, Any]:
        """Head widths, the heads in the ensemble, the settings that decide the vote, the last
        validation's observables and the tie/disagreement rates over the rounds."""
        out: dict[str, Any] = {"head_widths": list(self.widths), "ensemble_heads": list(self.chosen),
                               **({"validation_micro_f1": list(self.val_means)} if self.val_means else {}),
                               "head": self.head, "vote": self.vote, "tie_break": self.tie_break}
        if self.head == "mlp":
            out["hidden_base"] = self.hidden_base()
        if self.gamma is not None:
            out["kept_heads"] = (f"{len(self.chosen)} of {len(self.heads)} "
                                 f"({self.keep_rounding}({self.gamma:g} x {len(self.heads)}))")
        o = self.observed
        if o.get("tie_rate") is not None:
            out["last_validation"] = {
                "round": o["round"], "val_samples": o["val_samples"], "ensemble": o["ensemble"],
                "head_accuracy": [round(a, 4) for a in o["head_accuracy"]],
                "tie_rate": round(o["tie_rate"], 4), "disagreement_rate": round(o["disagreement_rate"], 4),
                "ensemble_accuracy": round(o["accuracy"], 4)}
        if self.history:
            h = np.asarray(self.history)
            out["over_rounds"] = {"validated_rounds": len(h), "mean_tie_rate": round(float(h[:, 1].mean()), 4),
                                  "max_tie_rate": round(float(h[:, 1].max()), 4),
                                  "mean_disagreement_rate": round(float(h[:, 2].mean()), 4)}
        return out
