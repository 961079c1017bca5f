"""Privacy and communication: differential-privacy accounting (Opacus), update clipping and
noise, quantization.

Import each piece from its module: :mod:`medfl.privacy.accounting` (epsilon from Opacus's
accountants), :mod:`medfl.privacy.gaussian` (clipping and Gaussian noise of an update),
:mod:`medfl.privacy.quantize` (bit-packed quantization), :mod:`medfl.privacy.dp_sgd` (DP-SGD
in local training with Opacus), :mod:`medfl.privacy.ledger` (a run's privacy plan and its
per-client epsilon), :mod:`medfl.privacy.feature_release` (a per-sample DP release of
features, FedTPF's shared set), :mod:`medfl.privacy.noise` (every Gaussian and Laplace draw,
finite by construction) and :mod:`medfl.privacy.signal` (the noise against the clipped
signal in what the coordinator aggregates, per round). docs/privacy.md says what each
mechanism guarantees."""
