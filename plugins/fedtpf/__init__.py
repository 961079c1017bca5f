"""FedTPF (paper 003) and its baseline FedFed (Yang et al., NeurIPS 2023): a feature-distillation
model trained in federation, then a shared set of distilled, noised features that every client
trains on beside its own data.

:class:`FedTPF` (:mod:`~medfl_plugins.fedtpf.method`) is Algorithm 1, its ``"paper"`` preset
(:mod:`~medfl_plugins.fedtpf.presets`) the paper's settings, each with its source;
:class:`FedFed` is the same code with FedTPF's additions switched off. docs/fedtpf.md gives
the algorithm, every choice the paper leaves open and every deviation.
"""

from __future__ import annotations

from typing import Callable

from medfl import hookimpl
from medfl.method import Preset
from medfl_plugins.fedtpf.method import FedTPF
from medfl_plugins.fedtpf.models import MixedBatches, SharedSet
from medfl_plugins.fedtpf.presets import PAPER_PRESET, PAPER_SOURCES
from medfl_plugins.fedtpf.records import CHANCE_MARGIN, CHANCE_ROUNDS

__all__ = ["FedTPF", "FedFed", "SharedSet", "MixedBatches", "PAPER_PRESET", "CHANCE_MARGIN", "CHANCE_ROUNDS",
           "PAPER_SOURCES", "register_methods"]


class FedFed(FedTPF):
    """FedFed (Yang et al., NeurIPS 2023), the method FedTPF extends, on FedTPF's code.

    Stage 1 runs exactly ``distill_rounds`` rounds of a VAE generator and a classifier on
    ``x_s + n`` (VAE + CE terms: no critic, prototypes, stop condition, decay or validation),
    by plain FedAvg; then FedTPF's release and stage 2. Deviation: FedFed's generator is a
    ResNet-style beta-VAE, ours FedTPF's small conv VAE, so the comparison isolates FedTPF's
    additions. No preset: paper 003 does not state FedFed's settings (docs/fedtpf.md).
    """

    name = "fedfed"
    description = "FedFed: federated feature distillation (VAE + noised-residual classifier), DP shared set"
    presets: dict[str, Preset] = {}

    def __init__(self, distill_rounds: int = 10, distill_epochs: int = 1, distill_steps: int = 60,
                 distill_lr: float = 1e-3, distill_optimizer: str = "adam", lambda_vae: float = 1.0,
                 lambda_ce: float = 1.0, noise: dict[str, float] | None = None, epsilon: float | None = 8.0,
                 delta: float = 1e-5, clip: float | str = 5.0, clip_quantile: float = 0.5,
                 mechanism: str = "gaussian", accountant: str = "rdp", mix: float | None = None,
                 vae_width: int = 16, vae_grid: int = 4) -> None:
        given = {k: v for k, v in locals().items() if k not in ("self", "__class__")}
        super().__init__(**given, lambda_wgan=0.0, lambda_proto=0.0, decay=False, stop_condition=False)

    def scored_from(self, round: int) -> int | None:
        """The release round: its second step is the first training of phi on local plus
        shared data (stage 2, where FedFed's shared set can shape the evaluated model; before
        it phi is trained by plain FedAvg on local data). ``None`` while in stage 1, and when
        the release brought no shared sample (no round is then FedFed's own)."""
        if self.stage != "train" or not self.transition.get("shared_samples"):
            return None
        return int(self.transition["release_round"])


@hookimpl
def register_methods(register: Callable[..., None]) -> None:
    """Register FedTPF and FedFed."""
    register(FedTPF)
    register(FedFed)
