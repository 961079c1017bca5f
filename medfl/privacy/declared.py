"""The differential privacy a run accounts besides DP-SGD, as the code that applies it
declares it: a reply filter's :class:`Release` (:meth:`medfl.filters.Filter.release`) and a
method's own :class:`OwnDp` (:meth:`medfl.method.Method.own_dp`); the ledger
(:mod:`medfl.privacy.ledger`) accounts both with Opacus's accountant.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Release", "OwnDp"]


@dataclass(frozen=True)
class Release:
    """One differential-privacy release a filter makes at each client it runs on: the
    Gaussian mechanism with this noise multiplier, accounted by Opacus's ``accountant``.

    Attributes:
        mechanism: name in ``privacy.csv`` (e.g. ``"dp_gaussian"``).
        noise_multiplier: sigma (noise std over the sensitivity ``clip``).
        clip: the sensitivity (L2 clipping norm).
        sample_rate: probability that one application touches the protected unit
            (1.0 when the party the guarantee is against sees every release).
        delta: the delta the epsilon is reported at.
        accountant: Opacus accountant (``rdp``, ``prv``, ``gdp``).
        unit: what one record protects (``"client"``: a client's whole dataset).
        not_covered: what this release's epsilon does not cover beyond what the run lists
            itself (e.g. a model the released values depend on, sent without noise): added
            to ``summary.json``'s ``privacy.not_covered``.
    """

    mechanism: str
    noise_multiplier: float
    clip: float
    sample_rate: float
    delta: float
    accountant: str
    unit: str = "client"
    not_covered: tuple[str, ...] = ()


@dataclass(frozen=True)
class OwnDp:
    """Differential privacy a method applies in its own client step (Opacus's DP-SGD inside
    an outside DP-FedAvg plugin's local training, say), declared with
    :meth:`Method.own_dp` so that the run accounts it with Opacus's accountant like medfl's own
    mechanisms (``privacy.csv``, ``summary.json``) instead of reporting no privacy.

    medfl does not apply this noise and cannot see it: the guarantee rests on the method's
    code, which each site approves (``medfl approve``), and on the step counts each client
    reports (``steps_metric``), which the coordinator checks against the declaration every
    round (a mismatch stops the run, as for ``train.dp``). The summary says the mechanism is
    the method's own (``"performed_by": "method"``).

    Attributes:
        mechanism: its name in ``privacy.csv`` (not one of medfl's: ``dp_gaussian``,
            ``dp_sgd``...).
        unit: what one record protects: ``"sample"`` (one training sample of one client) or
            ``"client"`` (a client's whole dataset).
        noise_multiplier: sigma per noise application, one for every client or
            ``{client id: sigma}``.
        sample_rate: the Poisson sampling rate of each application (1.0 without sampling),
            one for every client or per client.
        steps: noise applications in one local update (DP-SGD: optimizer steps), one for
            every client or per client.
        clip: the sensitivity (the per-sample or per-client clipping norm).
        delta: the delta the epsilon is reported at.
        accountant: Opacus accountant (``rdp``, ``prv``, ``gdp``).
        steps_metric: the training metric in which a client reports the applications it
            made in one local update (checked against ``steps``).
        statement: one sentence on how the method applies the noise (for ``config.json``).
        noised_values: how many values one application's noise covers, one for every client
            or ``{client id: count}`` (``None``, the default: the trainable parameters of the
            client's model). The run's noise-to-signal rows (``mechanisms.csv``) use it; a
            method that noises part of its model (PFedCDP's extractor) declares it.
    """

    mechanism: str
    unit: str
    noise_multiplier: float | dict[str, float]
    sample_rate: float | dict[str, float]
    steps: int | dict[str, int]
    clip: float
    delta: float
    accountant: str = "rdp"
    steps_metric: str = "dp_steps"
    statement: str = ""
    noised_values: int | dict[str, int] | None = None

    def per_client(self, field_name: str, client_id: str) -> Any:
        """``noise_multiplier``, ``sample_rate``, ``steps`` or ``noised_values`` for one client.

        Raises:
            KeyError: a per-client mapping lacks the client.
        """
        value = getattr(self, field_name)
        return value[client_id] if isinstance(value, dict) else value
