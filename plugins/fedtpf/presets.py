"""FedTPF's settings: what each reading of paper 003 means, the ``"paper"`` preset with the
source of every value, and :class:`Settings`, the method's keywords read and checked.
"""

from __future__ import annotations

import math
from typing import Any

from medfl.losses.feature_distill import CHANGE_READINGS, COSINE_READINGS, DECAY_READINGS
from medfl.method import Federation, MethodConfigError, Preset
from medfl.models.feature_distill import DistillWeights
from medfl.privacy.accounting import PrivacyConfigError, check_budget, noise_for_epsilon
from medfl.privacy.feature_release import MECHANISMS
from medfl_plugins.common import read
from medfl_plugins.fedtpf.models import NetSizes

__all__ = ["STOP_ON", "DISTILL_OPTIMIZERS", "ACCURACY_CI", "STANDARDIZE", "PAPER_SOURCES", "PAPER_PRESET", "RULES",
           "read_standardize", "read_noise", "read_clip", "Settings"]

#: what the stop condition's and eq. 9's accuracy is measured on (``stop_on``): the residual
#: classifier's input as it trains on it (``x_p``) or the unperturbed residual (``x_s``)
STOP_ON = ("x_p", "x_s")
#: the distillation model's optimizers (``distill_optimizer``); the critic always uses Adam
DISTILL_OPTIMIZERS = ("adam", "sgd")
#: what the stop condition's accuracy criterion reads (``accuracy_ci``): the accuracy itself
#: (``"none"``) or the lower end of its 95 % Wilson interval on the validation split (``"wilson"``)
ACCURACY_CI = ("none", "wilson")
#: the scale the distillation model, the noise and the release work on (``standardize``, or a
#: ``{"mean": [...], "std": [...]}`` per-channel normalization given in the config): the
#: engine's input scale (``"none"``) or each client's inputs standardized per channel with the
#: mean and standard deviation of its own training split (``"client"``)
STANDARDIZE = ("none", "client")
#: the keywords read by one rule each (:func:`medfl_plugins.common.read`): the choices, an
#: integer's least value, or a number's range as the message says it
RULES: dict[str, Any] = {
    "distill_rounds": 1, "distill_epochs": 1, "distill_steps": 0, "distill_lr": "> 0",
    "distill_optimizer": DISTILL_OPTIMIZERS, "lambda_vae": ">= 0", "lambda_wgan": ">= 0", "lambda_proto": ">= 0",
    "lambda_ce": "> 0", "gp_weight": ">= 0", "decay_lambda": ">= 0", "decay_reading": DECAY_READINGS,
    "stop_on": STOP_ON, "target_accuracy": "> 0 and <= 1", "tolerance": ">= 0 and <= 1",
    "max_cosine": ">= -1 and <= 1", "window": 1, "max_change": ">= 0", "cosine_reading": COSINE_READINGS,
    "change_reading": CHANGE_READINGS, "accuracy_ci": ACCURACY_CI, "mechanism": MECHANISMS, "epsilon": "> 0",
    "delta": "> 0 and <= 1", "clip_quantile": "> 0 and <= 1", "mix": ">= 0 and < 1", "vae_width": 1,
    "vae_grid": 1, "critic_width": 1,
}


#: Where each value of the ``"paper"`` preset comes from (:attr:`medfl.method.Preset.sources`);
#: docs/fedtpf.md quotes the stop condition's sentence (Sec. III-D) that many of them read.
PAPER_SOURCES: dict[str, str] = {
    "noise": "open: Table VIII (l. 367-369) evaluates sigma_s^2 = 0.15, 0.20 and 0.25 (Gaussian and Laplace) and "
             "Sec. IV-B writes x_p = x_s + n, n ~ N(0, sigma_s^2 I) (l. 315); which variance Tables III-VII use is "
             "not stated: medfl takes 0.15, the least noise, added on the standardized scale (standardize). "
             "Sec. III-E (l. 232) adds that 'the noise level sigma_s applied to x_s is proportional to the "
             "magnitude of x_s' (a smaller x_s, a lower sigma_s), with no rule for it: medfl's sigma_s is fixed, "
             "the same variance per coordinate whatever x_s's magnitude, so it does not fall as the distillation "
             "model shrinks x_s; on the input scale it is sigma_s times each client's per-channel std, "
             "proportional to the inputs' spread, not to x_s. The nearest medfl option is the DP release "
             "(noise=null) with clip='public_quantile': its noise std is z * clip, the clip a quantile of x_s's "
             "norms on public data",
    "epsilon": "reading: Sec. III-E says FedTPF uses differential privacy ('we employ differential privacy (DP) to "
               "protect the generalization-related features before globally sharing them', l. 226; 'privacy "
               "budget', l. 232) but gives no epsilon, delta or clip anywhere; the noise is given only by its "
               "variance (l. 315, Table VIII). medfl reads the release as that variance added to unclipped x_s, "
               "which bounds no sample's contribution: epsilon null, recorded as not private; other reading: a DP "
               "release as the words say, x_s clipped and noised at an epsilon (noise=null with epsilon and clip, "
               "medfl's default epsilon 8, clip 5), whose values the paper does not give",
    "mechanism": "paper: Sec. IV-B, n ~ N(0, sigma_s^2 I) (Gaussian); Table VIII's Laplace rows are the "
                 "mechanism='laplace' option",
    "standardize": "reading: Sec. IV-A, 'All images have been standardized through preprocessing' (PathMNIST; "
                   "LC25000 and CelebA: 'standard normalization'), so x_s and the noise live on standardized "
                   "inputs; which mean and std is not said: medfl reads per-channel statistics of each client's own "
                   "training split (no client holds the dataset's); other reading: one fixed dataset "
                   "normalization, standardize={'mean': [...], 'std': [...]} (public constants)",
    "stop_condition": "paper: Sec. III-D, the threshold condition that freezes a client's distillation model",
    "target_accuracy": "paper: Sec. III-D, 'a classification accuracy of 90% +- 2% on the generalizable features x_s'",
    "tolerance": "paper: Sec. III-D, '90% +- 2%'",
    "accuracy_ci": "reading: Sec. III-D, '90% +- 2% on the generalizable features x_s (with a 95% confidence "
                   "interval)': how the interval enters the test is not said; medfl tests the accuracy itself "
                   "against 90% - 2%; other reading: accuracy_ci='wilson', the lower end of the accuracy's 95% "
                   "Wilson interval on the client's validation split must reach 88% (a third: +- 2% is the "
                   "interval's half-width, which fixes the validation size, not the test)",
    "max_cosine": "paper: Sec. III-D, 'the cosine similarity between ... x_r and ... x_s remains consistently "
                  "below 0.15'",
    "cosine_reading": "reading: Sec. III-D, 'the cosine similarity between the generator's reconstructed features "
                      "x_r and the generalizable features x_s remains consistently below 0.15', the test of "
                      "'separating local features from generalized features' (same section): medfl reads |cos| < "
                      "0.15 (near orthogonal; x_r anti-aligned with x_s at -0.6 is not separated from it); other "
                      "reading: the words taken literally, signed cos < 0.15 (cosine_reading='signed')",
    "window": "reading: Sec. III-D, 'over three consecutive training epochs': medfl tests the aggregated "
              "distillation model once per round (eq. 9's p_k(t) is per round too) and counts three rounds, each "
              "of distill_epochs local epochs; other reading: three consecutive local epochs of the client's own "
              "model, tested after each epoch (not implemented: medfl's test is of the global model)",
    "max_change": "reading: Sec. III-D, 'both indicators fluctuating by no more than 5%': medfl reads 5 points "
                  "(range over the window <= 0.05, change_reading='absolute'); other reading: 5% of the value "
                  "(change_reading='relative')",
    "change_reading": "reading: Sec. III-D, 'fluctuating by no more than 5%': medfl reads an absolute range of 0.05; "
                      "other reading: change_reading='relative', the range over the window's mean size (hard for a "
                      "cosine near 0: 0.01 to 0.02 is a 67% change)",
    "decay": "paper: Sec. III-D, eq. 8 (adaptive weight decay aggregation)",
    "decay_reading": "reading: eq. 8 as printed, alpha_k(t) = exp(-lambda max(0, Delta_perf(t))) (a larger "
                     "accuracy change gives a smaller weight); other reading: Sec. III-D's prose, 'if the accuracy "
                     "difference is large, the aggregation weight ... will increase, slowing down the decay' "
                     "(decay_reading='prose')",
    "stop_on": "reading: Sec. III-D states the accuracy both 'in classifying the input images' (the classifier's "
               "inputs are x_p = x_s + n, Fig. 2) and 'on the generalizable features x_s'; a classifier trained on "
               "x_p scores at chance on clean x_s (its BatchNorm statistics are those of noisy inputs; PathMNIST "
               "fixture: 0.09 on x_s, 0.6 on x_p), so medfl reads x_p; other reading: stop_on='x_s'",
    "mix": "reading: Algorithm 1, ClientTraining(k, phi^r, D^k union D^s): one dataset of both, shuffled together; "
           "other reading: a fixed share of shared samples per batch (mix=s); the paper says nothing of batches",
    "distill_optimizer": "reading: Algorithm 1, LocalDisTraining, 'SGD update use Eq (1)(2)', no learning rate: "
                         "medfl reads a stochastic-gradient step and uses Adam (plain SGD at 0.01 diverged on the "
                         "fixture: the reconstruction term sums over every pixel); other reading: plain SGD "
                         "(distill_optimizer='sgd')",
    "distill_lr": "open: eta_k is not given: Adam's 1e-3",
    "decay_lambda": "open: eq. 8's lambda ('the decay intensity hyperparameter') is not given: medfl's 1; with it "
                    "alpha stays within 1% of 1 on the fixtures (a warning says so; experiments/fedtpf_probe.py "
                    "--decay-lambdas sweeps it)",
    "lambda_vae": "open: eq. 7's l_1 is not given: medfl's 1",
    "lambda_wgan": "open: eq. 7's l_2 is not given: medfl's 0.1",
    "lambda_proto": "open: eq. 7's l_3 is not given: medfl's 0.1",
    "lambda_ce": "open: eq. 7's l_4 is not given: medfl's 1",
    "gp_weight": "open: not given; WGAN-GP's own penalty weight 10 (Gulrajani et al. 2017, the paper's [42])",
    "distill_rounds": "open: T_d (stage 1's rounds) is not given, nor what happens to a client that never meets "
                      "the stop condition: medfl caps stage 1 at 10 rounds",
    "distill_epochs": "open: E_d is not given: medfl's 1 epoch per round",
    "distill_steps": "open: not in the paper: at least 60 steps per client and round, so that the residual "
                     "classifier of a small client gets steps enough to leave chance on x_p. On the standardized "
                     "scale this preset uses, the noise of variance 0.15 is 0.15 of each channel's variance: "
                     "noise-to-signal 0.40 after 5 steps, while x_s is still nearly x, and 0.62-0.71 after 60, "
                     "the VAE shrinking x_s under the fixed noise (PathMNIST fixture, two label-skewed clients, "
                     "one round, vae_width 16); the fixture's validation splits (8-14 tiles a client) are too "
                     "small to say how many steps the accuracy needs on this scale, so the floor of 60, set when "
                     "the noise went on the input scale (2-3x the signal there), is kept",
    "train.optimizer": "paper: Algorithm 1, ClientTraining, 'SGD update with D^k_t'",
}

#: Paper 003's settings (the ``"paper"`` preset of :class:`FedTPF`).
PAPER_PRESET = Preset(
    source="paper 003 (FedTPF): Algorithm 1, Sec. III-D (stop condition, eqs. 8-9), Sec. III-E and IV-B "
           "(noise x_p = x_s + n, n ~ N(0, sigma_s^2 I)), Sec. IV-A (standardized images), Tables III-VIII",
    description="paper 003's settings: noise of variance 0.15 on unclipped x_s of standardized inputs (not "
                "private), the 90 % +- 2 % stop condition with |cos| < 0.15, eq. 8 as printed, SGD for the task model",
    values={
        "noise": {"variance": 0.15}, "epsilon": None, "mechanism": "gaussian", "standardize": "client",
        "stop_condition": True, "target_accuracy": 0.9, "tolerance": 0.02, "accuracy_ci": "none",
        "max_cosine": 0.15, "cosine_reading": "absolute", "window": 3, "max_change": 0.05,
        "change_reading": "absolute", "decay": True, "decay_reading": "printed", "stop_on": "x_p", "mix": None,
        "distill_optimizer": "adam", "distill_lr": 1e-3, "decay_lambda": 1.0, "lambda_vae": 1.0,
        "lambda_wgan": 0.1, "lambda_proto": 0.1, "lambda_ce": 1.0, "gp_weight": 10.0, "distill_rounds": 10,
        "distill_epochs": 1, "distill_steps": 60,
    },
    train={"optimizer": "sgd"},
    sources=PAPER_SOURCES,
    experiment={
        "datasets": "LC25000 (224 x 224, 5 classes), PathMNIST (28 x 28, 9 classes), CelebA",
        "partitions": "LDA Dirichlet alpha 0.1 / 0.3 / 1.0 (Tables III, VI), #C=2 and #C=3 label skew (Table IV), "
                      "Subset: over 90 % of a client's data from one class (Table V)",
        "client_participation": [0.1, 0.4, 0.8],
        "noise_variances": [0.15, 0.2, 0.25],
        "noise_types": ["gaussian", "laplace"],
        "not_stated": "the number of clients K, the rounds T_r and T_d, the participation of Tables III-V",
    },
)


def read_standardize(where: str, value: Any) -> str | dict[str, list[float]]:
    """``standardize``: ``"none"``, ``"client"`` or ``{"mean": [...], "std": [...]}`` (one
    finite mean and one std > 0 per channel, as lists of equal length)."""
    if isinstance(value, str) and value in STANDARDIZE:
        return value
    if isinstance(value, dict) and set(value) == {"mean", "std"}:
        mean, std = value["mean"], value["std"]
        ok = (isinstance(mean, (list, tuple)) and isinstance(std, (list, tuple)) and len(mean) == len(std) > 0
              and all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                      for v in (*mean, *std)) and all(v > 0 for v in std))
        if ok:
            return {"mean": [float(v) for v in mean], "std": [float(v) for v in std]}
    raise MethodConfigError(f"{where}: standardize must be one of {', '.join(STANDARDIZE)} or "
                            f"{{'mean': [...], 'std': [...]}} (one finite mean and one std > 0 per channel), "
                            f"got {value!r}")


def read_noise(where: str, noise: Any, epsilon: float | None) -> dict[str, float] | None:
    """``noise``: ``None`` (the DP release at ``epsilon`` and the clip) or ``{"variance": v}``,
    the paper's noise on unclipped ``x_s``, which has no epsilon (``epsilon`` must be ``None``)."""
    if noise is None:
        return None
    if not isinstance(noise, dict) or set(noise) != {"variance"}:
        raise MethodConfigError(f"{where}: noise must be null (the DP release at epsilon and clip) or "
                                f"{{'variance': v}} (the paper's noise on unclipped x_s), got {noise!r}")
    noise = {"variance": read(where, "noise.variance", noise["variance"], "> 0")}
    if epsilon is not None:
        raise MethodConfigError(
            f"{where}: noise={noise!r} adds noise of a fixed variance to unclipped x_s, which is no DP "
            f"release and has no epsilon: set epsilon to null (got {epsilon!r})")
    return noise


def read_clip(where: str, clip: Any, noise: dict[str, float] | None, standardize: Any) -> float | str:
    """``clip``: a number > 0, or ``"public_quantile"`` (the DP release only, and not with
    ``standardize="client"``, which the coordinator cannot reproduce on the public set)."""
    if not isinstance(clip, str):
        return read(where, "clip", clip, "> 0")
    if clip != "public_quantile":
        raise MethodConfigError(f"{where}: clip must be a number > 0 or 'public_quantile', got {clip!r}")
    if noise is not None:
        raise MethodConfigError(f"{where}: clip='public_quantile' is for the DP release; noise={noise!r} "
                                "is added to unclipped x_s")
    if standardize == "client":
        raise MethodConfigError(f"{where}: clip='public_quantile' measures x_s on the public set, which the "
                                "coordinator cannot standardize as each client does (standardize='client'): "
                                "give a numeric clip or a fixed standardize={'mean': [...], 'std': [...]}")
    return clip


class Settings:
    """FedTPF's keywords, each read and checked (a bad one raises a MethodConfigError naming
    the method and the keyword); docs/fedtpf.md says what each does."""

    def __init__(self, distill_rounds: int = 10, distill_epochs: int = 1, distill_steps: int = 60,
                 distill_lr: float = 1e-3, distill_optimizer: str = "adam",
                 lambda_vae: float = 1.0, lambda_wgan: float = 0.1, lambda_proto: float = 0.1,
                 lambda_ce: float = 1.0, gp_weight: float = 10.0, decay: bool = True, decay_lambda: float = 1.0,
                 decay_reading: str = "printed", stop_condition: bool = True, stop_on: str = "x_p",
                 target_accuracy: float = 0.9,
                 tolerance: float = 0.02, max_cosine: float = 0.15, window: int = 3, max_change: float = 0.05,
                 noise: dict[str, float] | None = None, epsilon: float | None = 8.0, delta: float = 1e-5,
                 clip: float | str = 5.0, clip_quantile: float = 0.5, mechanism: str = "gaussian",
                 accountant: str = "rdp", mix: float | None = None, vae_width: int = 16, vae_grid: int = 4,
                 critic_width: int = 16, cosine_reading: str = "absolute", change_reading: str = "absolute",
                 accuracy_ci: str = "none", standardize: str | dict[str, list[float]] = "none") -> None:
        where, given = f"method {self.name!r}", locals()
        for k, rule in RULES.items():
            setattr(self, k, read(where, k, given[k], rule, none=k in ("epsilon", "mix")))
        self.decay, self.stop_condition, self.accountant = bool(decay), bool(stop_condition), accountant
        self.standardize = read_standardize(where, standardize)
        self.noise = read_noise(where, noise, self.epsilon)
        self.clip = read_clip(where, clip, self.noise, standardize)
        try:
            #: the Gaussian release's noise multiplier (noise std over the clip); 0 without a DP release
            self.noise_multiplier = (noise_for_epsilon(self.epsilon, self.delta, 1.0, 1, accountant)
                                     if self.mechanism == "gaussian" and self.epsilon is not None
                                     and self.noise is None else 0.0)
        except PrivacyConfigError as e:
            raise MethodConfigError(f"{where}: {e}") from None
        #: the clip the release uses (set at the coordinator for ``"public_quantile"``)
        self.clip_now: float = self.clip if isinstance(self.clip, float) and self.noise is None else math.nan

    @property
    def net_sizes(self) -> NetSizes:
        """The VAE's width and grid and the critic's width."""
        return self.vae_width, self.vae_grid, self.critic_width

    def weights(self) -> DistillWeights:
        """Eq. 7's coefficients."""
        return DistillWeights(vae=self.lambda_vae, wgan=self.lambda_wgan, proto=self.lambda_proto,
                              ce=self.lambda_ce, gp=self.gp_weight)

    def _check_federation(self, federation: Federation) -> None:
        """The settings against the federation: rounds beyond stage 1, each client's budget for
        the Gaussian release, the channels of a fixed normalization, the public set of
        ``"public_quantile"``, a local sample in every ``mix`` batch."""
        where = f"method {self.name!r}"
        if federation.rounds <= self.distill_rounds:
            raise MethodConfigError(
                f"{where}: fl.rounds ({federation.rounds}) must exceed distill_rounds ({self.distill_rounds}): "
                "stage 1 may last distill_rounds rounds and stage 2 needs at least one")
        if self.mechanism == "gaussian" and self.epsilon is not None:
            for cid in federation.client_ids:
                try:
                    check_budget(self.epsilon, self.delta, max(int(federation.num_examples.get(cid, 0)), 1),
                                 f"{where} (client {cid})")
                except PrivacyConfigError as e:
                    raise MethodConfigError(str(e)) from None
        if isinstance(self.standardize, dict) and len(self.standardize["mean"]) != federation.in_channels:
            raise MethodConfigError(f"{where}: standardize gives {len(self.standardize['mean'])} channel(s), the "
                                    f"data has {federation.in_channels}")
        if self.clip == "public_quantile" and federation.public is None:
            raise MethodConfigError(f"{where}: clip='public_quantile' needs fl.public_dataset (the coordinator "
                                    "measures the norms of x_s on its train split)")
        if self.mix is not None:
            bs = int(federation.train.get("batch_size", 16))
            if bs - round(self.mix * bs) < 1:
                raise MethodConfigError(f"{where}: mix={self.mix:g} leaves no local sample in a batch of {bs} "
                                        "(fl.train.batch_size): lower mix or raise the batch size")
