"""The loss terms and aggregation weights of FedTPF's feature-distillation model (paper 003),
reusable by FedFed-style methods: a VAE generator, a WGAN-GP critic, a classifier on the
residual ``x_s = x - x_hat``, and the class prototypes that anchor the VAE's latent codes.

* eq. 5: :func:`class_prototypes`, the class means of the task model's embeddings;
* eq. 6: :func:`prototype_loss`, each sample's latent ``z`` pulled to its class prototype;
* eq. 7's VAE term: :func:`vae_loss` (reconstruction + KL to N(0, I));
* eq. 7's WGAN-GP term: :func:`critic_loss` (with :func:`gradient_penalty`) and
  :func:`generator_adversarial_loss`;
* eqs. 8-9: :func:`performance_change` and :func:`decay_weights` (eq. 8 as printed, or as its
  prose reads), the adaptive decay of the aggregation weight of clients that stopped distilling;
* section III-D's stop condition: :func:`residual_cosine`, :func:`stop_condition_check` and
  :func:`distillation_converged`.

Every function works on tensors of any spatial rank (2D images, 3D volumes): per-sample sums
run over all non-batch dimensions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import torch

__all__ = ["class_prototypes", "prototype_loss", "vae_loss", "gradient_penalty", "critic_loss",
           "generator_adversarial_loss", "performance_change", "DECAY_READINGS", "decay_weights", "residual_cosine",
           "STOP_CRITERIA", "COSINE_READINGS", "CHANGE_READINGS", "wilson_lower", "stop_condition_check",
           "distillation_converged"]


def class_prototypes(embeddings: torch.Tensor, labels: torch.Tensor, num_classes: int
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Eq. 5: ``omega^m = mean of the embeddings of class m``.

    Args:
        embeddings: ``(N, d)`` task-model embeddings of a client's samples.
        labels: ``(N,)`` integer labels.
        num_classes: K.

    Returns:
        ``(prototypes, present)``: ``(K, d)`` class means (zeros for a class the client does
        not hold) and a ``(K,)`` bool mask of the classes it holds.
    """
    labels = labels.long()
    sums = torch.zeros(num_classes, embeddings.shape[1], dtype=embeddings.dtype, device=embeddings.device)
    sums.index_add_(0, labels, embeddings)
    counts = torch.bincount(labels, minlength=num_classes).to(embeddings.dtype)
    present = counts > 0
    protos = sums / counts.clamp_min(1).unsqueeze(1)
    return protos, present


def prototype_loss(z: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor,
                   present: torch.Tensor | None = None) -> torch.Tensor:
    """Eq. 6: the mean over the batch of ``||z_i - omega^{y_i}||_2^2``, ``z_i = mu_i + sigma_i *
    eps`` (the reparameterised latent). Samples of a class without a prototype (``present``
    false) are left out; a batch with none left gives 0.

    Args:
        z: ``(B, d)`` latent codes (same d as the prototypes).
        labels: ``(B,)`` labels.
        prototypes: ``(K, d)``, from :func:`class_prototypes` (no gradient flows into them).
        present: ``(K,)`` mask; default every class.
    """
    labels = labels.long()
    keep = torch.ones_like(labels, dtype=torch.bool) if present is None else present[labels]
    if not keep.any():
        return z.sum() * 0.0
    diff = z[keep] - prototypes.detach()[labels[keep]]
    return diff.pow(2).sum(dim=1).mean()


def vae_loss(x: torch.Tensor, x_hat: torch.Tensor, mu: torch.Tensor, logvar: torch.Tensor,
             beta: float = 1.0) -> torch.Tensor:
    """Eq. 7's VAE term: per-sample squared reconstruction error ``||x - x_hat||^2`` (eq. 1)
    plus ``beta`` times the KL divergence of ``N(mu, exp(logvar))`` from ``N(0, I)``
    (``-1/2 sum(1 + logvar - mu^2 - exp(logvar))``), averaged over the batch."""
    recon = (x - x_hat).pow(2).flatten(1).sum(dim=1)
    kl = -0.5 * (1 + logvar - mu.pow(2) - logvar.exp()).flatten(1).sum(dim=1)
    return (recon + beta * kl).mean()


def gradient_penalty(critic: Callable[[torch.Tensor], torch.Tensor], real: torch.Tensor, fake: torch.Tensor,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """WGAN-GP's penalty (Gulrajani et al. 2017): ``E[(||grad_x D(x_tilde)||_2 - 1)^2]`` at
    ``x_tilde = e * real + (1 - e) * fake``, ``e ~ U[0, 1]`` per sample (seeded by
    ``generator``). Differentiable in the critic's parameters."""
    where = generator.device if generator is not None else real.device
    e = torch.rand((real.shape[0],) + (1,) * (real.dim() - 1), generator=generator, device=where,
                   dtype=real.dtype).to(real.device)
    mixed = (e * real.detach() + (1 - e) * fake.detach()).requires_grad_(True)
    out = critic(mixed)
    (grad,) = torch.autograd.grad(out.sum(), mixed, create_graph=True)
    return (grad.flatten(1).norm(2, dim=1) - 1).pow(2).mean()


def critic_loss(critic: Callable[[torch.Tensor], torch.Tensor], real: torch.Tensor, fake: torch.Tensor,
                gp_weight: float = 10.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """The critic's WGAN-GP loss: ``E[D(fake)] - E[D(real)] + gp_weight * penalty`` (the
    critic learns to score real images above reconstructions; ``fake`` is detached)."""
    return (critic(fake.detach()).mean() - critic(real).mean()
            + gp_weight * gradient_penalty(critic, real, fake, generator))


def generator_adversarial_loss(critic: Callable[[torch.Tensor], torch.Tensor], fake: torch.Tensor) -> torch.Tensor:
    """The generator's WGAN term: ``-E[D(x_hat)]`` (reconstructions the critic scores as real)."""
    return -critic(fake).mean()


def performance_change(now: Mapping[str, float], before: Mapping[str, float],
                       distilling: set[str] | list[str]) -> float:
    """Eq. 9: ``Delta_perf(t) = mean over the still-distilling clients k of p_k(t) - p_k(t-1)``,
    ``p_k`` the global distillation model's accuracy on client k's test set. Clients without
    both values are left out; none left gives 0."""
    deltas = [float(now[k]) - float(before[k]) for k in distilling if k in now and k in before
              and math.isfinite(float(now[k])) and math.isfinite(float(before[k]))]
    return sum(deltas) / len(deltas) if deltas else 0.0


#: The readings of eq. 8 :func:`decay_weights` knows: the equation as printed, or its prose.
DECAY_READINGS = ("printed", "prose")


def decay_weights(stopped_at: Mapping[str, int | None], round: int, delta_perf: float, lam: float,
                  reading: str = "printed", history: Mapping[int, float] | None = None) -> dict[str, float]:
    """Eq. 8: each client's decay coefficient ``alpha_k(t)``, 1 before it stops distilling
    (``stopped_at[k]`` is ``None`` or later than ``round``); from its stop round ``t_s(k)`` on:

    * ``reading="printed"``: ``exp(-lam * max(0, delta_perf))``, the equation as printed. It
      is not cumulative (``alpha_k(t)`` depends on this round's ``Delta_perf`` only), and a
      larger accuracy change gives a *smaller* weight.
    * ``reading="prose"``: section III-D's prose, which says the opposite of the printed
      equation: "the influence of this client ... gradually decays. The rate of decay depends
      on the accuracy difference ...: if the accuracy difference is large, the aggregation
      weight ... will increase, slowing down the decay; if the global model's accuracy
      stabilizes and continues to improve, the decay will accelerate". Our reading: a decay
      that accumulates over the rounds since the stop, at a rate that falls as the accuracy
      change grows, ``alpha_k(t) = exp(-lam * sum over tau = t_s(k) .. t of
      (1 - min(1, |Delta_perf(tau)|)))``; ``history`` maps each round tau to the
      ``Delta_perf`` used in it (a round missing from it adds nothing).

    Args:
        stopped_at: each client's stop round (the first round its weight decays) or ``None``.
        round: t.
        delta_perf: the ``Delta_perf`` used in round t (eq. 9; the printed reading).
        lam: the decay intensity lambda (>= 0).
        reading: ``"printed"`` or ``"prose"``.
        history: ``{tau: Delta_perf used in round tau}`` (the prose reading).

    Raises:
        ValueError: an unknown ``reading``.
    """
    if reading not in DECAY_READINGS:
        raise ValueError(f"decay_weights: reading must be one of {', '.join(DECAY_READINGS)}, got {reading!r}")
    lam = float(lam)
    if reading == "printed":
        factor = math.exp(-lam * max(0.0, float(delta_perf)))
        return {k: (1.0 if t is None or round < int(t) else factor) for k, t in stopped_at.items()}
    past = {int(tau): float(d) for tau, d in (history or {}).items()}
    out = {}
    for k, t in stopped_at.items():
        if t is None or round < int(t):
            out[k] = 1.0
            continue
        rate = sum(1.0 - min(1.0, abs(d)) for tau, d in past.items() if int(t) <= tau <= round)
        out[k] = math.exp(-lam * rate)
    return out


def residual_cosine(x_r: torch.Tensor, x_s: torch.Tensor, absolute: bool = False) -> float:
    """The mean over samples of the cosine similarity between the reconstruction ``x_r`` and
    the residual ``x_s = x - x_r`` (flattened per sample): low when the two carry different
    content, the paper's sign of a converged generator. ``absolute``: the mean of each
    sample's ``|cos|`` (samples anti-aligned at -0.6 and aligned at +0.6 do not average to 0)."""
    a, b = x_r.detach().flatten(1), x_s.detach().flatten(1)
    cos = torch.nn.functional.cosine_similarity(a, b, dim=1, eps=1e-12)
    return float((cos.abs() if absolute else cos).mean())


#: What :func:`stop_condition_check` reports, by code: 0 met, then the first criterion not met.
STOP_CRITERIA = ("met", "too few evaluations", "residual accuracy below target - tolerance",
                 "cosine(x_r, x_s) not below max_cosine", "residual accuracy moved more than max_change",
                 "cosine moved more than max_change")


#: How the stop condition reads the paper's cosine test (``cosine_reading``): "the cosine
#: similarity between ... x_r and ... x_s remains consistently below 0.15" (Sec. III-D).
#: ``"absolute"``: ``|cos| < max_cosine`` (x_r and x_s near orthogonal, the separation the
#: sentence's purpose names: x_r anti-aligned with x_s is not separated from it);
#: ``"signed"``: the sentence's words taken literally, ``cos < max_cosine`` (a cosine of -0.6
#: passes).
COSINE_READINGS = ("absolute", "signed")
#: How the stop condition reads "fluctuating by no more than 5 %" (``change_reading``):
#: ``"absolute"``: each series' range (max - min) over the window is at most ``max_change``
#: (0.05 = 5 percentage points of accuracy); ``"relative"``: the range over the mean of the
#: window's absolute values is at most ``max_change`` (5 % of the value's size; for a
#: cosine near 0 this is hard to meet: 0.01 to 0.02 is a 67 % change).
CHANGE_READINGS = ("absolute", "relative")
#: The two-sided 95 % normal quantile the Wilson interval of :func:`wilson_lower` uses.
Z95 = 1.959963984540054


def wilson_lower(accuracy: float, n: int, z: float = Z95) -> float:
    """The lower end of the Wilson score interval (95 % by default) of an accuracy measured
    on ``n`` samples: what the stop condition's accuracy criterion reads under
    ``accuracy_ci="wilson"`` (the paper's "90 % +- 2 % ... (with a 95 % confidence
    interval)", read as: the interval's lower end reaches 90 % - 2 %). NaN without samples."""
    if n <= 0 or not math.isfinite(accuracy):
        return math.nan
    z2 = z * z
    centre = accuracy + z2 / (2 * n)
    spread = z * math.sqrt(max(accuracy * (1 - accuracy), 0.0) / n + z2 / (4 * n * n))
    return (centre - spread) / (1 + z2 / n)


def _moved(values: list[float], reading: str) -> float:
    """A window's fluctuation under ``reading`` (:data:`CHANGE_READINGS`)."""
    spread = max(values) - min(values)
    if reading == "absolute":
        return spread
    size = sum(abs(v) for v in values) / len(values)
    return spread / size if size > 0 else (0.0 if spread == 0 else math.inf)


def stop_condition_check(accuracy: list[float], cosine: list[float], *, target: float = 0.9, tol: float = 0.02,
                         max_cosine: float = 0.15, window: int = 3, max_change: float = 0.05,
                         cosine_reading: str = "absolute", change_reading: str = "absolute",
                         support: int | None = None) -> tuple[int, str]:
    """Section III-D's stop condition for one client's distillation model, made precise.

    The paper: "When local testing indicates that the classifier achieves a classification
    accuracy of 90% +- 2% on the generalizable features x_s (with a 95% confidence interval),
    and the cosine similarity between the generator's reconstructed features x_r and the
    generalizable features x_s remains consistently below 0.15, with both indicators
    fluctuating by no more than 5% over three consecutive training epochs". We read it as:
    over the last ``window`` evaluations (``accuracy`` and ``cosine``, oldest first, on the
    client's own held-out data) every accuracy is at least ``target - tol``, every cosine
    below ``max_cosine`` (``|cos|`` or ``cos``: ``cosine_reading``, :data:`COSINE_READINGS`),
    and each series' fluctuation at most ``max_change`` (``change_reading``,
    :data:`CHANGE_READINGS`). ``support``: the number of samples behind each accuracy; when
    given, the accuracy criterion reads the lower end of each accuracy's 95 % Wilson interval
    (:func:`wilson_lower`) instead of the accuracy itself (the "95 % confidence interval").

    Returns:
        ``(code, reason)``: ``code`` 0 when the condition is met, else the index in
        :data:`STOP_CRITERIA` of the first criterion not met; ``reason`` says it in numbers.
    """
    if cosine_reading not in COSINE_READINGS:
        raise ValueError(f"cosine_reading must be one of {', '.join(COSINE_READINGS)}, got {cosine_reading!r}")
    if change_reading not in CHANGE_READINGS:
        raise ValueError(f"change_reading must be one of {', '.join(CHANGE_READINGS)}, got {change_reading!r}")
    if len(accuracy) < window or len(cosine) < window:
        return 1, f"fewer than {window} evaluations"
    acc, cos = [float(a) for a in accuracy[-window:]], [float(c) for c in cosine[-window:]]
    if cosine_reading == "absolute":
        cos = [abs(c) for c in cos]
    low = [wilson_lower(a, support) for a in acc] if support is not None else acc
    if min(low) < target - tol:
        what = "lower 95 % Wilson bound of the residual accuracy" if support is not None else "residual accuracy"
        return 2, f"{what} {min(low):.3f} < {target - tol:.3f}"
    name = "|cosine(x_r, x_s)|" if cosine_reading == "absolute" else "cosine(x_r, x_s)"
    if max(cos) >= max_cosine:
        return 3, f"{name} {max(cos):.3f} >= {max_cosine}"
    unit = "" if change_reading == "absolute" else " (relative)"
    if _moved(acc, change_reading) > max_change:
        return 4, f"accuracy moved {_moved(acc, change_reading):.3f}{unit} > {max_change} over {window} evaluations"
    if _moved(cos, change_reading) > max_change:
        return 5, f"cosine moved {_moved(cos, change_reading):.3f}{unit} > {max_change} over {window} evaluations"
    return 0, "met"


def distillation_converged(accuracy: list[float], cosine: list[float], *, target: float = 0.9, tol: float = 0.02,
                           max_cosine: float = 0.15, window: int = 3, max_change: float = 0.05
                           ) -> tuple[bool, str]:
    """Whether :func:`stop_condition_check` finds the stop condition met: ``(converged,
    reason)``, the reason naming the first criterion not met (or "met")."""
    code, reason = stop_condition_check(accuracy, cosine, target=target, tol=tol, max_cosine=max_cosine,
                                        window=window, max_change=max_change)
    return code == 0, reason
