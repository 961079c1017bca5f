"""A third-party medfl method: FedAvg with coordinate-wise median aggregation.

Yin et al., "Byzantine-Robust Distributed Learning: Towards Optimal Statistical Rates"
(ICML 2018): the global model is the coordinate-wise median of the clients' models, which
tolerates a minority of arbitrary (faulty or malicious) updates. Integer buffers take the
median too (lower median for an even count, so the value is one a client sent).
"""

from __future__ import annotations

import torch

from medfl import hookimpl
from medfl.engine.hub import HubAndSpoke

__all__ = ["FedMedian", "register_methods"]


class FedMedian(HubAndSpoke):
    """Coordinate-wise median of the client models (unweighted)."""

    name = "median"
    description = "Coordinate-wise median aggregation (Yin et al., 2018)"

    def aggregate(self, states, weights):
        """Median of each coordinate over clients; ``weights`` are ignored."""
        out = {}
        for k in states[0]:
            stacked = torch.stack([s[k] for s in states])
            if stacked.is_floating_point():
                out[k] = stacked.quantile(0.5, dim=0) if len(states) % 2 == 0 else stacked.median(dim=0).values
            else:
                out[k] = stacked.median(dim=0).values
        return out


@hookimpl
def register_methods(register):
    """Register ``median``."""
    register(FedMedian)
