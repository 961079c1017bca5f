"""PFedCDP's losses and Shapley tools (paper 000, eqs. 7-11 and 16-19) against hand
computations and plain-loop references."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch
from torch import nn

from medfl.losses.distill import (
    ensemble_logits,
    kd_loss,
    kl_to_teacher,
    sup_mtkd_loss,
    supcon_loss,
    two_views,
)
from medfl.shapley import (
    balanced_subset,
    ensemble_game,
    feature_importance,
    importance_weights,
    mean_importance,
    shapley_values,
    teacher_weights,
)


def _softmax(z: list[float]) -> list[float]:
    e = [math.exp(v) for v in z]
    return [v / sum(e) for v in e]


# ------------------------------------------------------------------------------ kd_loss (eq. 11)

STUDENT = [[1.0, 0.0, -1.0], [0.5, 2.0, 0.0]]
TEACHER = [[2.0, 1.0, 0.0], [0.0, 0.0, 1.0]]
LABELS = [0, 1]


def _kd_by_hand(lam: float, t: float) -> float:
    ce = sum(-math.log(_softmax(s)[y]) for s, y in zip(STUDENT, LABELS)) / 2
    kl = 0.0
    for s, z in zip(STUDENT, TEACHER):
        ps = _softmax([v / t for v in s])
        pt = _softmax([v / t for v in z])
        kl += sum(a * math.log(a / b) for a, b in zip(pt, ps))
    kl /= 2  # batchmean
    return (1 - lam) * ce + lam * t * t * kl


@pytest.mark.parametrize("lam", [0.0, 0.5, 1.0])
def test_kd_loss_matches_hand_computation(lam: float) -> None:
    s = torch.tensor(STUDENT, dtype=torch.float64)
    z = torch.tensor(TEACHER, dtype=torch.float64)
    y = torch.tensor(LABELS)
    got = kd_loss(s, z, y, lam=lam, temperature=2.0)
    assert float(got) == pytest.approx(_kd_by_hand(lam, 2.0), rel=1e-12)


def test_kd_loss_gradient_reaches_only_the_student() -> None:
    s = torch.tensor(STUDENT, dtype=torch.float64, requires_grad=True)
    z = torch.tensor(TEACHER, dtype=torch.float64, requires_grad=True)
    kd_loss(s, z, torch.tensor(LABELS), lam=0.5, temperature=2.0).backward()
    assert s.grad is not None and float(s.grad.abs().sum()) > 0
    assert z.grad is None


def test_kl_to_teacher_is_the_lam_one_loss() -> None:
    s, z = torch.tensor(STUDENT), torch.tensor(TEACHER)
    assert torch.allclose(kl_to_teacher(s, z, 2.0),
                          kd_loss(s, z, torch.tensor(LABELS), lam=1.0, temperature=2.0))


@pytest.mark.parametrize("kwargs, bad", [({"lam": 1.5, "temperature": 1.0}, "1.5"),
                                         ({"lam": -0.1, "temperature": 1.0}, "-0.1"),
                                         ({"lam": 0.5, "temperature": 0.0}, "0.0"),
                                         ({"lam": 0.5, "temperature": -2.0}, "-2.0")])
def test_kd_loss_rejects_bad_parameters(kwargs: dict, bad: str) -> None:
    s, z = torch.tensor(STUDENT), torch.tensor(TEACHER)
    with pytest.raises(ValueError, match=bad):
        kd_loss(s, z, torch.tensor(LABELS), **kwargs)


# -------------------------------------------------------------------------- supcon_loss (eq. 17)

def _supcon_loops(emb: np.ndarray, labels: list[int], tau: float) -> float:
    """Khosla et al.'s L_out, one view per sample, with plain loops (float64)."""
    z = [[v / math.sqrt(sum(u * u for u in row)) for v in row] for row in emb.tolist()]
    n = len(z)
    total, anchors = 0.0, 0
    for i in range(n):
        pos = [p for p in range(n) if p != i and labels[p] == labels[i]]
        if not pos:
            continue
        dot = [sum(a * b for a, b in zip(z[i], z[k])) / tau for k in range(n)]
        denom = sum(math.exp(dot[a]) for a in range(n) if a != i)
        total += -sum(math.log(math.exp(dot[p]) / denom) for p in pos) / len(pos)
        anchors += 1
    return total / anchors


SUPCON_LABELS = [0, 1, 0, 2, 1, 0, 1]  # label 2 has one sample: that anchor has no positive


@pytest.mark.parametrize("tau", [0.07, 0.5])
def test_supcon_loss_matches_loop_reference(tau: float) -> None:
    gen = torch.Generator().manual_seed(3)
    emb = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    got = supcon_loss(emb, torch.tensor(SUPCON_LABELS), temperature=tau)
    assert float(got) == pytest.approx(_supcon_loops(emb.numpy(), SUPCON_LABELS, tau), rel=1e-10)


def test_supcon_loss_ignores_embedding_scale() -> None:
    gen = torch.Generator().manual_seed(4)
    emb = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    y = torch.tensor(SUPCON_LABELS)
    assert torch.allclose(supcon_loss(emb, y), supcon_loss(emb * 37.5, y), rtol=1e-10)


@pytest.mark.parametrize("n", [1, 4])
def test_supcon_loss_without_positives_is_a_connected_zero(n: int) -> None:
    emb = torch.randn(n, 3, requires_grad=True)
    loss = supcon_loss(emb, torch.arange(n))
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert emb.grad is not None and float(emb.grad.abs().sum()) == 0.0


def test_sup_mtkd_loss_combines_eq_18() -> None:
    gen = torch.Generator().manual_seed(5)
    s, z = torch.randn(7, 3, generator=gen), torch.randn(7, 3, generator=gen)
    emb, y = torch.randn(7, 4, generator=gen), torch.tensor(SUPCON_LABELS) % 3
    want = 0.7 * supcon_loss(emb, y, 0.1) + 0.3 * kl_to_teacher(s, z, 3.0)
    got = sup_mtkd_loss(s, emb, z, y, alpha=0.3, temperature=3.0, tau=0.1)
    assert torch.allclose(got, want)
    with pytest.raises(ValueError, match="alpha"):
        sup_mtkd_loss(s, emb, z, y, alpha=2.0, temperature=3.0, tau=0.1)


def test_supcon_sum_and_mean_by_hand() -> None:
    """z0 = (1, 0), z1 = (0, 1) of class 0, z2 = (1, 1)/sqrt(2) alone in class 1, tau 1: anchors
    0 and 1 are each other's only positive, at similarity 0 against 1/sqrt(2) to z2, so each
    costs log(1 + e^(1/sqrt 2)); z2 has no positive and is left out. Eq. 17 sums them."""
    emb = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    one = math.log(1.0 + math.exp(1.0 / math.sqrt(2.0)))
    assert float(supcon_loss(emb, y, 1.0, reduction="sum")) == pytest.approx(2 * one, rel=1e-12)
    assert float(supcon_loss(emb, y, 1.0, reduction="mean")) == pytest.approx(one, rel=1e-12)
    assert float(supcon_loss(emb, y, 1.0)) == pytest.approx(one, rel=1e-12)        # the function's default
    with pytest.raises(ValueError, match="reduction"):
        supcon_loss(emb, y, 1.0, reduction="max")


def test_two_view_supcon_by_hand() -> None:
    """Two samples of different classes, two (here equal) views each: every anchor's only
    positive is its own other view (eq. 17's 2 N_y - 1 = 1), at similarity 1, against the two
    views of the other sample at 0: each anchor costs log(1 + 2/e)."""
    first = torch.tensor([[1.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    emb, y = two_views(first, first.clone(), torch.tensor([0, 1]))
    assert y.tolist() == [0, 1, 0, 1] and torch.equal(emb[2:], first)
    one = math.log(1.0 + 2.0 / math.e)
    assert float(supcon_loss(emb, y, 1.0, reduction="sum")) == pytest.approx(4 * one, rel=1e-12)
    assert float(supcon_loss(emb, y, 1.0, reduction="mean")) == pytest.approx(one, rel=1e-12)
    # random views against the loop reference (it counts 2 N_y - 1 positives by itself)
    gen = torch.Generator().manual_seed(6)
    a, b = torch.randn(7, 5, generator=gen, dtype=torch.float64), torch.randn(7, 5, generator=gen, dtype=torch.float64)
    emb, y = two_views(a, b, torch.tensor(SUPCON_LABELS))
    want = _supcon_loops(emb.numpy(), y.tolist(), 0.5)
    assert float(supcon_loss(emb, y, 0.5)) == pytest.approx(want, rel=1e-10)
    assert float(supcon_loss(emb, y, 0.5, reduction="sum")) == pytest.approx(14 * want, rel=1e-10)  # all 14 anchors
    with pytest.raises(ValueError, match="differ in shape"):
        two_views(a, b[:3], torch.tensor(SUPCON_LABELS))


def test_sup_mtkd_loss_sum_parts_and_the_alpha_relation() -> None:
    gen = torch.Generator().manual_seed(7)
    s, z = torch.randn(7, 3, generator=gen, dtype=torch.float64), torch.randn(7, 3, generator=gen, dtype=torch.float64)
    emb, y = torch.randn(7, 4, generator=gen, dtype=torch.float64), torch.tensor(SUPCON_LABELS) % 3
    loss, scl, kd = sup_mtkd_loss(s, emb, z, y, alpha=0.3, temperature=3.0, tau=0.1, reduction="sum", parts=True)
    assert torch.allclose(scl, supcon_loss(emb, y, 0.1, reduction="sum"))
    assert torch.allclose(kd, kl_to_teacher(s, z, 3.0))
    assert torch.allclose(loss, 0.7 * scl + 0.3 * kd)
    # alpha' of the mean form is alpha = A alpha' / (1 - alpha' + A alpha') of the sum form (A anchors):
    # the two losses are then proportional, whatever the batch (here A = 6: label 2 has no positive)
    anchors, a_mean = 6, 0.5
    a_sum = anchors * a_mean / (1 - a_mean + anchors * a_mean)
    ratios = []
    for seed in (8, 9):
        g = torch.Generator().manual_seed(seed)
        s, z, emb = (torch.randn(7, k, generator=g, dtype=torch.float64) for k in (3, 3, 4))
        total_sum = sup_mtkd_loss(s, emb, z, y, alpha=a_sum, temperature=3.0, tau=0.1, reduction="sum")
        total_mean = sup_mtkd_loss(s, emb, z, y, alpha=a_mean, temperature=3.0, tau=0.1, reduction="mean")
        ratios.append(float(total_sum / total_mean))
    assert ratios[0] == pytest.approx(ratios[1], rel=1e-10)


def test_ensemble_logits_normalises_weights() -> None:
    a, b = torch.tensor([[1.0, 2.0]]), torch.tensor([[3.0, -1.0]])
    assert torch.allclose(ensemble_logits([a, b]), torch.tensor([[2.0, 0.5]]))
    assert torch.allclose(ensemble_logits([a, b], [1.0, 3.0]), 0.25 * a + 0.75 * b)
    with pytest.raises(ValueError, match="non-negative"):
        ensemble_logits([a, b], [1.0, -1.0])
    with pytest.raises(ValueError, match="sum"):
        ensemble_logits([a, b], [0.0, 0.0])


# ---------------------------------------------------------------------------- shapley_values

def test_shapley_values_three_players_by_hand() -> None:
    table = {(): 0.5, (0,): 0.6, (1,): 0.7, (2,): 0.5,
             (0, 1): 0.8, (0, 2): 0.7, (1, 2): 0.75, (0, 1, 2): 0.9}
    calls: list[frozenset[int]] = []

    def v(s: frozenset[int]) -> float:
        calls.append(s)
        return table[tuple(sorted(s))]

    # weights |S|!(n-|S|-1)!/n! for n = 3: 1/3 for |S| = 0 and 2, 1/6 for |S| = 1
    # phi_0 = 1/3 (0.6-0.5) + 1/6 (0.8-0.7) + 1/6 (0.7-0.5) + 1/3 (0.9-0.75)
    #       = (0.2 + 0.1 + 0.2 + 0.3) / 6 = 0.8 / 6
    # phi_1 = 1/3 (0.7-0.5) + 1/6 (0.8-0.6) + 1/6 (0.75-0.5) + 1/3 (0.9-0.7)
    #       = (0.4 + 0.2 + 0.25 + 0.4) / 6 = 1.25 / 6
    # phi_2 = 1/3 (0.5-0.5) + 1/6 (0.7-0.6) + 1/6 (0.75-0.7) + 1/3 (0.9-0.8)
    #       = (0 + 0.1 + 0.05 + 0.2) / 6 = 0.35 / 6
    phi = shapley_values(3, v)
    assert phi == pytest.approx([0.8 / 6, 1.25 / 6, 0.35 / 6], abs=1e-12)
    assert sum(phi) == pytest.approx(0.9 - 0.5)
    assert len(calls) == 8 and len(set(calls)) == 8  # every coalition exactly once


@pytest.mark.parametrize("n", [4, 5])
def test_shapley_values_efficiency_on_random_games(n: int) -> None:
    rng = np.random.default_rng(n)
    table = {frozenset(c): float(rng.normal())
             for r in range(n + 1) for c in itertools.combinations(range(n), r)}
    phi = shapley_values(n, table.__getitem__)
    assert sum(phi) == pytest.approx(table[frozenset(range(n))] - table[frozenset()], abs=1e-12)


def test_shapley_values_symmetry_and_null_player() -> None:
    def v(s: frozenset[int]) -> float:  # 0 and 1 interchangeable, 3 never matters
        return (0.3 * len(s & {0, 1}) + 0.1 * (2 in s) + 0.2 * ({0, 1} <= s)
                + 0.05 * (({0, 2} <= s) + ({1, 2} <= s)))

    phi = shapley_values(4, v)
    assert phi[0] == pytest.approx(phi[1], abs=1e-12)
    assert phi[3] == pytest.approx(0.0, abs=1e-12)
    assert phi[2] != pytest.approx(phi[0])


def test_shapley_values_limits() -> None:
    assert shapley_values(0, lambda s: 1.0) == []
    with pytest.raises(ValueError, match="2\\^n"):
        shapley_values(13, lambda s: 0.0)


# ---------------------------------------------------------------------------- ensemble_game

# three teachers, 3 classes, 4 samples with labels [0, 1, 2, 1]
GAME_LABELS = [0, 1, 2, 1]
GAME_LOGITS = [
    [[3, 0, 0], [0, 2, 0], [1, 0, 0], [0, 0, 1]],  # A predicts 0 1 0 2: right on 0, 1
    [[2, 0, 0], [0, 0, 1], [0, 0, 2], [0, 3, 0]],  # B predicts 0 2 2 1: right on 0, 2, 3
    [[0, 1, 0], [0, 3, 0], [0, 0, 3], [2, 0, 0]],  # C predicts 1 1 2 0: right on 1, 2
]
# the argmax of a mean is the argmax of the sum:
# A+B   = [5,0,0] [0,2,1] [1,0,2] [0,3,1]        -> 0 1 2 1: 4/4
# A+C   = [3,1,0] [0,5,0] [1,0,3] [2,0,1]        -> 0 1 2 0: 3/4
# B+C   = [2,1,0] [0,3,1] [0,0,5] [2,3,0]        -> 0 1 2 1: 4/4
# A+B+C = [5,1,0] [0,5,1] [1,0,5] [2,3,1]        -> 0 1 2 1: 4/4
GAME_ACCURACY = {(): 1 / 3, (0,): 0.5, (1,): 0.75, (2,): 0.5,
                 (0, 1): 1.0, (0, 2): 0.75, (1, 2): 1.0, (0, 1, 2): 1.0}


def test_ensemble_game_accuracy_by_hand() -> None:
    teachers = [torch.tensor(z, dtype=torch.float32) for z in GAME_LOGITS]
    v = ensemble_game(teachers, torch.tensor(GAME_LABELS))
    for coalition, want in GAME_ACCURACY.items():
        assert v(frozenset(coalition)) == pytest.approx(want), coalition


def test_ensemble_game_balanced_accuracy_and_ties() -> None:
    v = ensemble_game([np.array(z, dtype=float) for z in GAME_LOGITS], GAME_LABELS,
                      score="balanced_accuracy")
    # teacher A: class 0 recall 1/1, class 1 recall 1/2 (sample 1 right, 3 wrong), class 2 0/1
    assert v(frozenset({0})) == pytest.approx((1 + 0.5 + 0) / 3)
    assert v(frozenset()) == pytest.approx(1 / 3)
    # a tie between two classes including the label counts 1/2
    tie = ensemble_game([np.array([[1.0, 0, 0]]), np.array([[0, 1.0, 0]])], [0])
    assert tie(frozenset({0, 1})) == pytest.approx(0.5)


AUC_LABELS = [0, 0, 1, 1, 0, 1]
AUC_MARGINS = [0.1, 0.8, 0.5, 0.9, -0.3, 0.8]  # z1 - z0, monotone in softmax(z)[1]


def test_ensemble_game_binary_auc_by_hand() -> None:
    logits = np.array([[0.0, m] for m in AUC_MARGINS])
    v = ensemble_game([logits], AUC_LABELS, score="auc")
    # positives 0.5, 0.9, 0.8 against negatives 0.1, 0.8, -0.3 (a tie counts 1/2):
    # 0.5 beats 2, 0.9 beats 3, 0.8 beats 2 and ties 1 -> 7.5 of 9 pairs
    assert v(frozenset({0})) == pytest.approx(7.5 / 9)
    assert v(frozenset()) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="single class"):
        ensemble_game([logits], [1] * 6, score="auc")


def test_ensemble_game_multiclass_auc_is_mean_one_vs_rest() -> None:
    metrics = pytest.importorskip("sklearn.metrics", reason="scikit-learn is a test dependency")
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(12, 3)), rng.normal(size=(12, 3))
    y = np.array([0, 1, 2] * 4)
    mean = (a + b) / 2
    prob = np.exp(mean) / np.exp(mean).sum(axis=1, keepdims=True)
    want = metrics.roc_auc_score(y, prob, multi_class="ovr", average="macro")
    assert ensemble_game([a, b], y, score="auc")(frozenset({0, 1})) == pytest.approx(want)


# ------------------------------------------------------------------ balanced_subset, weights

def test_balanced_subset_equal_counts_and_seeded() -> None:
    labels = np.array([0] * 5 + [1] * 3 + [2] * 7)
    rng = np.random.default_rng(1)
    labels = labels[rng.permutation(len(labels))]
    for per_class, each in [(None, 3), (2, 2), (10, 3)]:
        idx = balanced_subset(labels, per_class, seed=0)
        assert list(idx) == sorted(set(idx.tolist()))
        assert np.bincount(labels[idx]).tolist() == [each] * 3
    assert np.array_equal(balanced_subset(labels, 2, seed=7), balanced_subset(labels, 2, seed=7))
    big = np.repeat([0, 1], 50)
    assert not np.array_equal(balanced_subset(big, 10, seed=0), balanced_subset(big, 10, seed=1))
    with pytest.raises(ValueError, match="per_class"):
        balanced_subset(labels, 0, seed=0)


def test_teacher_weights_clip_and_normalise() -> None:
    assert teacher_weights([0.2, -0.1, 0.6]) == pytest.approx([0.25, 0.0, 0.75])
    assert teacher_weights([-1.0, 0.0, -0.5]) == pytest.approx([1 / 3] * 3)
    with pytest.raises(ValueError):
        teacher_weights([])


# ------------------------------------------------------------------ feature importance (eq. 16)

PIXEL = (0, 2, 1)
CLASS_WEIGHTS = [1.0, -2.0, 0.5]


def _one_pixel_model() -> nn.Module:
    """Logits depend on input pixel PIXEL of a 1x4x4 image only."""
    lin = nn.Linear(16, 3)
    with torch.no_grad():
        lin.weight.zero_()
        lin.bias.copy_(torch.tensor([0.1, -0.2, 0.3]))
        lin.weight[:, PIXEL[1] * 4 + PIXEL[2]] = torch.tensor(CLASS_WEIGHTS)
    return nn.Sequential(nn.Flatten(), lin)


def test_feature_importance_finds_the_only_pixel_that_matters() -> None:
    pytest.importorskip("shap", reason="shap is optional (pip install shap)")
    model = _one_pixel_model()
    gen = torch.Generator().manual_seed(0)
    samples = torch.randn(4, 1, 4, 4, generator=gen)
    # one all-zero background image: expected gradients of a linear model are exactly
    # w_c * (x - 0), so psi at the pixel = mean_c |w_c| * mean_n |x_n|
    psi = feature_importance(model, torch.zeros(1, 1, 4, 4), samples, nsamples=8)
    assert psi.shape == (1, 4, 4)
    want = np.mean(np.abs(CLASS_WEIGHTS)) * float(samples[:, 0, 2, 1].abs().mean())
    assert psi[PIXEL] == pytest.approx(want, rel=1e-5)
    others = np.delete(psi.reshape(-1), PIXEL[1] * 4 + PIXEL[2])
    assert np.abs(others).max() < 1e-8


def test_feature_importance_is_seeded_and_leaves_no_trace() -> None:
    pytest.importorskip("shap", reason="shap is optional (pip install shap)")
    model = _one_pixel_model().train()
    for p in model.parameters():
        p.grad = torch.full_like(p, 7.0)
    gen = torch.Generator().manual_seed(1)
    background = torch.randn(6, 1, 4, 4, generator=gen)
    samples = torch.randn(3, 1, 4, 4, generator=gen)
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()[1].copy()
    first = feature_importance(model, background, samples, nsamples=8, seed=3, batch_size=4)
    assert np.unravel_index(first.argmax(), first.shape) == PIXEL
    assert np.array_equal(first, feature_importance(model, background, samples, nsamples=8, seed=3))
    assert torch.equal(torch_state, torch.get_rng_state())
    assert np.array_equal(np_state, np.random.get_state()[1])
    assert model.training and all(m.training for m in model.modules())
    assert all(p.grad is not None and bool((p.grad == 7.0).all()) for p in model.parameters())


def test_mean_and_importance_weights() -> None:
    a, b = np.array([[0.0, 1.0], [2.0, 3.0]]), np.array([[0.0, 3.0], [2.0, 1.0]])
    psi = mean_importance([a, b])
    assert np.array_equal(psi, [[0.0, 2.0], [2.0, 2.0]])
    w = importance_weights(psi, floor=0.2)
    assert w.mean() == pytest.approx(1.0, abs=1e-12)
    assert (w >= 0).all()
    assert w[0, 0] == pytest.approx(0.2)  # no importance keeps the floor
    assert w[0, 1] == pytest.approx(0.2 + 0.8 * 2.0 / 1.5)
    assert np.array_equal(importance_weights(np.zeros((2, 3))), np.ones((2, 3)))
    with pytest.raises(ValueError, match="floor"):
        importance_weights(psi, floor=1.5)
    with pytest.raises(ValueError, match="non-negative"):
        importance_weights(-psi - 1)
