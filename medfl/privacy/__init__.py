"""Privacy and communication: differential-privacy accounting (Opacus), update clipping and
noise, quantization.

Re-exported here: :mod:`medfl.privacy.accounting`, :mod:`medfl.privacy.gaussian` and
:mod:`medfl.privacy.quantize`. Import the others from their modules:
:mod:`medfl.privacy.dp_sgd` (DP-SGD in local training with Opacus) and
:mod:`medfl.privacy.ledger` (a run's privacy plan and its per-client epsilon) and
:mod:`medfl.privacy.feature_release` (a per-sample DP release of features, FedTPF's shared
set), :mod:`medfl.privacy.noise` (every Gaussian and Laplace draw, finite by construction) and
:mod:`medfl.privacy.signal` (the noise against the clipped signal in what the coordinator
aggregates, per round). docs/privacy.md
says what each mechanism guarantees."""

from __future__ import annotations

from medfl.privacy.accounting import (
    ACCOUNTANTS,
    PrivacyConfigError,
    check_accountant,
    check_budget,
    check_delta,
    check_positive,
    epsilon_spent,
    noise_for_epsilon,
)
from medfl.privacy.gaussian import add_noise, clip_update, global_norm, noise_generator
from medfl.privacy.quantize import (
    DTYPE_CODES,
    dequantize_tensor,
    pack_codes,
    quantization_step,
    quantize_tensor,
    unpack_codes,
)

__all__ = [
    "ACCOUNTANTS",
    "PrivacyConfigError",
    "check_accountant",
    "check_budget",
    "check_delta",
    "check_positive",
    "epsilon_spent",
    "noise_for_epsilon",
    "add_noise",
    "clip_update",
    "global_norm",
    "noise_generator",
    "DTYPE_CODES",
    "dequantize_tensor",
    "pack_codes",
    "quantization_step",
    "quantize_tensor",
    "unpack_codes",
]
