"""The pure kernels: capped-simplex projection, REINFORCE estimators, baseline, schedule, masks,
and the importance -> initial score maps. No model is involved here."""

from __future__ import annotations

import math

import pytest
import torch

from engine.algo.metrics.probability import (initial_scores, normal_scores, score_const, sigmoid_cut, sigmoid_norm,
                                        standardize, standardize_per_layer)
from engine.algo.policy import (
    cosine_lr,
    fit_control_coefficients,
    keep_count,
    metric_feature,
    policy_gradient,
    project_capped_simplex,
    sample_masks,
    top_k_mask,
    update_baseline,
)
from engine.model.units import UnitLayout

F64 = torch.float64


# --- projection onto C = {0 <= s <= 1, sum s <= budget} ------------------------------------------
def exact_projection(z: torch.Tensor, budget: float) -> torch.Tensor:
    """Reference projection, computed without bisection.

    The projection is clamp(z - v, 0, 1) with v >= 0. f(v) = sum clamp(z - v, 0, 1) is continuous,
    non-increasing and linear between the breakpoints {z_i, z_i - 1}, so the v with f(v) = budget is
    found exactly by locating its segment and interpolating linearly.
    """
    s0 = z.clamp(0, 1)
    if float(s0.sum()) <= budget:
        return s0

    def f(v: float) -> float:
        return float((z - v).clamp(0, 1).sum())

    points = sorted({0.0} | {float(x) for x in z if x > 0} | {float(x) - 1 for x in z if x - 1 > 0})
    for a, b in zip(points, points[1:]):
        fa, fb = f(a), f(b)
        if fa > budget >= fb:
            v = a + (fa - budget) * (b - a) / (fa - fb)
            return (z - v).clamp(0, 1)
    raise AssertionError("f never reaches the budget")  # impossible: f(max z) = 0 <= budget


def random_cases(n_cases: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    kinds = ["normal", "wide", "above_one", "negative", "ties"]
    for i in range(n_cases):
        n = [1, 2, 3, 7, 20, 101][i % 6]
        kind = kinds[i % len(kinds)]
        if kind == "normal":
            z = torch.randn(n, generator=g, dtype=F64)
        elif kind == "wide":
            z = torch.rand(n, generator=g, dtype=F64) * 4 - 1.5  # in [-1.5, 2.5]
        elif kind == "above_one":
            z = 1 + torch.rand(n, generator=g, dtype=F64)
        elif kind == "negative":
            z = -torch.rand(n, generator=g, dtype=F64) + torch.rand(n, generator=g, dtype=F64) * 0.8
        else:
            z = torch.randint(-2, 5, (n,), generator=g).to(F64) / 3  # many repeated values
        budget = float(torch.rand((), generator=g, dtype=F64)) * n * 1.2  # sometimes above n: no constraint
        yield z, budget


def test_projection_is_feasible():
    for z, budget in random_cases(300, seed=0):
        s = project_capped_simplex(z, budget)
        assert s.dtype == F64 and s.shape == z.shape
        assert float(s.min()) >= 0.0 and float(s.max()) <= 1.0
        assert float(s.sum()) <= budget + 1e-6


def test_projection_is_clamp_when_clamp_fits():
    z = torch.tensor([-0.5, 0.2, 0.4, 1.7, 0.9], dtype=F64)  # clamp -> [0, .2, .4, 1, .9], sum 2.5
    assert torch.equal(project_capped_simplex(z, 2.5), z.clamp(0, 1))
    assert torch.equal(project_capped_simplex(z, 10.0), z.clamp(0, 1))
    for z, budget in random_cases(100, seed=1):
        if float(z.clamp(0, 1).sum()) <= budget:
            assert torch.equal(project_capped_simplex(z, budget), z.clamp(0, 1))


def test_projection_matches_exact_breakpoint_solution():
    active = 0
    for z, budget in random_cases(400, seed=2):
        expected = exact_projection(z, budget)
        got = project_capped_simplex(z, budget)
        torch.testing.assert_close(got, expected, atol=1e-12, rtol=0)
        if float(z.clamp(0, 1).sum()) > budget:
            active += 1
            assert float(got.sum()) == pytest.approx(budget, abs=1e-9)  # the constraint binds
    assert active > 100  # the sum constraint was really exercised


def test_projection_is_closest_feasible_point():
    """Variational characterisation of a projection onto a convex set: (z - s) . (y - s) <= 0 for all
    feasible y, which also makes s closer to z than any feasible y."""
    g = torch.Generator().manual_seed(3)
    for z, budget in random_cases(120, seed=4):
        s = project_capped_simplex(z, budget)
        n = z.numel()
        ys = torch.rand((200, n), generator=g, dtype=F64)
        sums = ys.sum(1, keepdim=True)
        ys = torch.where(sums > budget, ys * budget / sums.clamp_min(1e-300), ys)  # scaling keeps 0 <= y <= 1
        k = int(math.floor(budget + 1e-12))
        if 0 < k <= n:  # vertices of C: 0/1 vectors with k ones
            idx = torch.argsort(torch.rand((50, n), generator=g), dim=1)[:, :k]
            ys = torch.cat([ys, torch.zeros((50, n), dtype=F64).scatter_(1, idx, 1.0)])
        ys = torch.cat([ys, torch.zeros((1, n), dtype=F64)])
        assert float(((z - s) * (ys - s)).sum(1).max()) <= 1e-9
        assert float(((ys - z) ** 2).sum(1).min()) >= float(((s - z) ** 2).sum()) - 1e-9


def test_projection_edge_budgets():
    z = torch.tensor([0.3, 2.0, -1.0, 0.8], dtype=F64)
    assert torch.equal(project_capped_simplex(z, 0.0), torch.zeros(4, dtype=F64))
    with pytest.raises(ValueError):
        project_capped_simplex(z, -0.1)


# --- policy gradient ---------------------------------------------------------------------------
def mc_check(scores, loss_fn, exact, *, n_groups, n_s, baseline, seed, estimator="paper"):
    """Mean of n_groups independent estimates (each from n_s masks) against the exact gradient.

    The tolerance is 5 standard errors of that mean; the test also requires the standard error to
    be small next to the gradient so that a wrong scale or sign cannot pass.
    """
    g = torch.Generator().manual_seed(seed)
    n = scores.numel()
    masks = (torch.rand((n_groups, n_s, n), generator=g, dtype=F64) < scores).to(F64)
    losses = loss_fn(masks)  # (n_groups, n_s)
    est = torch.stack([
        policy_gradient(scores, masks[i], losses[i], baseline, estimator=estimator) for i in range(n_groups)
    ])
    mean, se = est.mean(0), est.std(0) / math.sqrt(n_groups)
    assert torch.all(5 * se < 0.5 * exact.abs()), f"test too noisy to be meaningful: se {se}, exact {exact}"
    assert torch.all((mean - exact).abs() <= 5 * se), f"mean {mean} vs exact {exact} (se {se})"


S = torch.tensor([0.25, 0.5, 0.7, 0.4, 0.6], dtype=F64)
W = torch.tensor([1.0, -2.0, 0.5, 3.0, -1.5], dtype=F64)


@pytest.mark.parametrize("baseline", [0.0, 1.3])
@pytest.mark.parametrize("n_s, n_groups", [(2, 12_000), (500, 400)])
def test_paper_estimator_unbiased_linear_loss(baseline, n_s, n_groups):
    # L(m) = w.m + 2 -> E[L] = w.s + 2, dE/ds = w. A constant baseline must not bias the estimate.
    mc_check(S, lambda m: m @ W + 2.0, W, n_groups=n_groups, n_s=n_s, baseline=baseline, seed=10 + n_s)


def test_paper_estimator_unbiased_quadratic_loss():
    # L(m) = (a.m)^2; E[L] = sum a_i^2 s_i (1 - s_i) + (a.s)^2, so dE/ds_k = a_k^2 (1 - 2 s_k) + 2 a_k (a.s).
    a = torch.tensor([1.0, -2.0, 1.5, 2.5, -1.0], dtype=F64)
    exact = a**2 * (1 - 2 * S) + 2 * a * (a @ S)
    mc_check(S, lambda m: (m @ a) ** 2, exact, n_groups=400, n_s=500, baseline=float((a @ S) ** 2), seed=20)


def test_paper_estimator_unbiased_product_loss():
    # L(m) = 4 m_0 m_1 - 3 m_2 m_3 m_4: E[L] = 4 s0 s1 - 3 s2 s3 s4 (independent masks).
    s = S
    exact = torch.stack([4 * s[1], 4 * s[0], -3 * s[3] * s[4], -3 * s[2] * s[4], -3 * s[2] * s[3]])
    mc_check(s, lambda m: 4 * m[..., 0] * m[..., 1] - 3 * m[..., 2] * m[..., 3] * m[..., 4], exact,
             n_groups=400, n_s=500, baseline=0.0, seed=30)


def test_per_sample_baseline_vector_equals_scalar():
    g = torch.Generator().manual_seed(5)
    masks = (torch.rand((4, 5), generator=g, dtype=F64) < S).to(F64)
    losses = torch.rand(4, generator=g, dtype=F64) * 3
    for est in ("paper", "sqrt"):
        torch.testing.assert_close(
            policy_gradient(S, masks, losses, torch.full((4,), 0.7, dtype=F64), est),
            policy_gradient(S, masks, losses, 0.7, est), atol=0, rtol=0)
    # per-sample baselines enter sample by sample: b_j = L_j gives a zero estimate
    assert torch.equal(policy_gradient(S, masks, losses, losses.clone()), torch.zeros(5, dtype=F64))


@pytest.mark.parametrize("n_s", [2, 3, 8])
def test_sqrt_estimator_defining_relation(n_s):
    g = torch.Generator().manual_seed(n_s)
    s = torch.tensor([0.0, 0.003, 0.2, 0.5, 0.9, 0.999, 1.0], dtype=F64)
    masks = (torch.rand((n_s, s.numel()), generator=g, dtype=F64) < 0.5).to(F64)
    losses = torch.randn(n_s, generator=g, dtype=F64) + 4
    for baseline in (0.0, 3.5, torch.randn(n_s, generator=g, dtype=F64)):
        paper = policy_gradient(s, masks, losses, baseline, "paper", clamp=0.01)
        sqrt = policy_gradient(s, masks, losses, baseline, "sqrt", clamp=0.01)
        sc = s.clamp(0.01, 0.99)  # both estimators see the clamped scores
        torch.testing.assert_close(sqrt, paper * torch.sqrt(sc * (1 - sc)) * n_s / (n_s - 1), rtol=1e-12, atol=1e-12)


def test_sqrt_estimator_needs_two_samples():
    s = torch.tensor([0.5, 0.5], dtype=F64)
    with pytest.raises(ValueError):
        policy_gradient(s, torch.ones((1, 2), dtype=F64), torch.ones(1, dtype=F64), 0.0, "sqrt")
    with pytest.raises(ValueError):
        policy_gradient(s, torch.ones((2, 2), dtype=F64), torch.ones(2, dtype=F64), 0.0, "nonsense")


def all_masks(n: int) -> torch.Tensor:
    """Every 0/1 mask over n units, (2^n, n)."""
    return torch.tensor([[(k >> i) & 1 for i in range(n)] for k in range(2**n)], dtype=F64)


def mask_probs(masks: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """P(m) under independent Bernoulli(s), for each row of `masks`."""
    return torch.where(masks > 0, s, 1 - s).prod(1)


def exact_expectation(s, loss_fn, baseline, estimator="paper", clamp=1e-2):
    """E over Bernoulli(s) masks of the estimate, by enumerating every mask (no sampling noise): one
    sample for the paper's estimator (an average of per-sample terms), every pair for sqrt (N_s >= 2)."""
    masks = all_masks(s.numel())
    probs = mask_probs(masks, s)
    if estimator == "paper":
        est = torch.stack([policy_gradient(s, m[None], loss_fn(m)[None], baseline, estimator, clamp) for m in masks])
        return (probs[:, None] * est).sum(0)
    total = torch.zeros_like(s)
    for a, pa in zip(masks, probs):
        for b, pb in zip(masks, probs):
            pair = torch.stack([a, b])
            total += pa * pb * policy_gradient(s, pair, loss_fn(pair), baseline, estimator, clamp)
    return total


BOUNDARY_S = torch.tensor([0.0, 1.0, 0.005, 0.995, 0.3], dtype=F64)
BOUNDARY_W = torch.tensor([1.5, -2.0, 3.0, -1.0, 0.5], dtype=F64)


@pytest.mark.parametrize("estimator", ["paper", "sqrt"])
def test_estimate_is_zero_at_saturated_scores(estimator):
    # s = 0 is never kept and s = 1 never dropped: whatever the losses and the baseline, nothing is
    # learned about them. (Centring on the clamped score gave them a drift of about L - delta.)
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        masks = sample_masks(BOUNDARY_S, 4, g)
        losses = torch.randn(4, generator=g, dtype=F64) * 3 + 5
        for baseline in (0.0, 2.0, float(losses.mean()) + 1.7, torch.randn(4, generator=g, dtype=F64)):
            est = policy_gradient(BOUNDARY_S, masks, losses, baseline, estimator, clamp=0.01)
            assert torch.isfinite(est).all()
            assert est[0] == 0.0 and est[1] == 0.0, est


@pytest.mark.parametrize("estimator", ["paper", "sqrt"])
@pytest.mark.parametrize("clamp", [1e-2, 1e-4])
def test_expected_estimate_does_not_depend_on_the_baseline(estimator, clamp):
    # E[m - s] = 0 makes any constant baseline drop out of the mean, also for scores inside the
    # clamp (0.005, 0.995 with clamp 1e-2), where the denominator is clamped.
    def loss(m):
        return m @ BOUNDARY_W + 4.0
    ref = exact_expectation(BOUNDARY_S, loss, 0.0, estimator, clamp)
    for baseline in (4.0, 50.0, -30.0):
        torch.testing.assert_close(exact_expectation(BOUNDARY_S, loss, baseline, estimator, clamp), ref,
                                   rtol=1e-10, atol=1e-10)
    assert ref[0] == 0.0 and ref[1] == 0.0


def test_estimate_is_unbiased_where_the_clamp_does_not_act():
    # with the clamp below min(s, 1 - s), the expected estimate is exactly dE[L]/ds for any baseline
    s = BOUNDARY_S[2:]
    for baseline in (0.0, 9.0):
        torch.testing.assert_close(exact_expectation(s, lambda m: m @ BOUNDARY_W[2:] + 4.0, baseline, clamp=1e-3),
                                   BOUNDARY_W[2:], rtol=1e-10, atol=1e-10)


def test_antithetic_masks_are_bernoulli_pairs():
    s = torch.tensor([0.0, 0.1, 0.5, 0.83, 1.0, 0.3])
    n = 40_000
    m = sample_masks(s, n, torch.Generator().manual_seed(7), antithetic=True).double()
    se = torch.sqrt(s.double() * (1 - s.double()) / n)
    assert torch.all((m.mean(0) - s.double()).abs() <= 5 * se + 1e-12)  # each sample is still Bernoulli(s)
    first, second = m[0::2], m[1::2]
    # from u and 1 - u: for s <= 0.5 the pair never keeps a unit twice, for s >= 0.5 never drops it twice
    assert torch.all((first + second)[:, s <= 0.5] <= 1) and torch.all((first + second)[:, s >= 0.5] >= 1)
    assert torch.equal(m, sample_masks(s, n, torch.Generator().manual_seed(7), antithetic=True).double())
    with pytest.raises(ValueError):
        sample_masks(s, 3, torch.Generator(), antithetic=True)


def test_metric_control_variate_is_unbiased_and_cuts_variance():
    # L(m) = 2 - beta z.m + small interactions: the metric explains most of it. Subtracting beta f
    # from the losses and adding back -beta z keeps the expected estimate at the true gradient.
    z = torch.tensor([1.0, -0.5, 2.0, 0.3, -1.2], dtype=F64)
    s = torch.tensor([0.6, 0.3, 0.8, 0.5, 0.45], dtype=F64)
    beta = 0.7
    def loss(m):
        return 2.0 - beta * (m @ z) + 0.2 * m[..., 0] * m[..., 1]
    masks = all_masks(5)
    p = mask_probs(masks, s)
    exact = -beta * z + torch.tensor([0.2 * s[1], 0.2 * s[0], 0, 0, 0], dtype=F64)
    f = metric_feature(z, s, masks)
    assert float((p * f).sum()) == pytest.approx(0.0, abs=1e-12)  # E[f] = 0
    b = float((p * loss(masks)).sum())  # the best constant baseline, E[L] (= E[L - beta f])
    plain = torch.stack([policy_gradient(s, m[None], loss(m)[None], b) for m in masks])
    with_cv = torch.stack([policy_gradient(s, m[None], (loss(m) - beta * fj)[None], b) for m, fj in zip(masks, f)]) - beta * z
    for est in (plain, with_cv):
        torch.testing.assert_close((p[:, None] * est).sum(0), exact, rtol=1e-10, atol=1e-10)
    def var(est):
        return (p[:, None] * (est - exact) ** 2).sum(0)
    assert torch.all(var(with_cv) < 0.2 * var(plain))


def test_fit_control_coefficients_recovers_a_linear_model():
    g = torch.Generator().manual_seed(1)
    f = torch.randn(500, 3, generator=g, dtype=F64) * torch.tensor([1.0, 30.0, 0.01], dtype=F64)
    true = torch.tensor([0.5, -0.02, 40.0], dtype=F64)
    a = f @ true + 0.001 * torch.randn(500, generator=g, dtype=F64)
    beta = fit_control_coefficients(f.T @ f / 500, f.T @ a / 500)
    torch.testing.assert_close(beta, true, rtol=1e-3, atol=1e-6)


# --- baseline, schedule ----------------------------------------------------------------------------
def test_update_baseline_starts_at_first_loss():
    assert update_baseline(None, 3.25, window=5) == 3.25


def test_update_baseline_moving_average():
    T = 4
    b = update_baseline(None, 2.0, T)
    for loss in (6.0, 1.0, 3.0):
        expected = (1 - 1 / T) * b + loss / T
        b = update_baseline(b, loss, T)
        assert b == pytest.approx(expected, rel=1e-15)
    assert update_baseline(5.0, 1.0, window=1) == pytest.approx(1.0)  # T = 1: just the latest mean
    # constant losses: the gap to them shrinks by (1 - 1/T) per step
    b = 10.0
    for k in range(1, 6):
        b = update_baseline(b, 2.0, T)
        assert b == pytest.approx(2.0 + 8.0 * (1 - 1 / T) ** k, rel=1e-12)


def test_cosine_lr_endpoints_and_monotone():
    base, total = 0.02, 100
    assert cosine_lr(base, 0, total) == pytest.approx(base)
    assert cosine_lr(base, total, total) == pytest.approx(0.0, abs=1e-15)
    assert cosine_lr(base, total // 2, total) == pytest.approx(base / 2)
    assert cosine_lr(base, 3 * total, total) == pytest.approx(0.0, abs=1e-15)  # no restart past the end
    lrs = [cosine_lr(base, t, total) for t in range(total + 1)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert all(0.0 <= x <= base for x in lrs)


# --- masks -------------------------------------------------------------------------------------------
def test_sample_masks_mean_and_determinism():
    s = torch.tensor([0.0, 0.1, 0.5, 0.83, 1.0, 0.3])
    n = 40_000
    m = sample_masks(s, n, torch.Generator().manual_seed(7))
    assert m.shape == (n, 6) and m.dtype == s.dtype
    assert set(m.unique().tolist()) <= {0.0, 1.0}
    assert torch.all(m[:, 0] == 0) and torch.all(m[:, 4] == 1)
    se = torch.sqrt(s.double() * (1 - s.double()) / n)
    assert torch.all((m.double().mean(0) - s.double()).abs() <= 5 * se + 1e-12)
    again = sample_masks(s, n, torch.Generator().manual_seed(7))
    assert torch.equal(m, again)
    assert not torch.equal(m, sample_masks(s, n, torch.Generator().manual_seed(8)))


def test_sample_masks_consumes_generator_state():
    s = torch.full((5,), 0.5)
    g = torch.Generator().manual_seed(0)
    first, second = sample_masks(s, 3, g), sample_masks(s, 3, g)
    assert not torch.equal(first, second)
    g.manual_seed(0)
    assert torch.equal(sample_masks(s, 3, g), first)


def test_top_k_mask_keeps_largest():
    g = torch.Generator().manual_seed(9)
    for n in (1, 5, 33):
        scores = torch.rand(n, generator=g)
        for k in range(n + 1):
            m = top_k_mask(scores, k)
            assert int(m.sum()) == k and set(m.unique().tolist()) <= {0.0, 1.0}
            kept = set(torch.nonzero(m).flatten().tolist())
            expected = set(sorted(range(n), key=lambda i: -float(scores[i]))[:k])
            assert kept == expected


def test_top_k_mask_ties_go_to_lower_index():
    scores = torch.tensor([0.5, 0.9, 0.5, 0.5, 0.1])
    assert top_k_mask(scores, 3).tolist() == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert top_k_mask(torch.zeros(4), 2).tolist() == [1.0, 1.0, 0.0, 0.0]
    assert torch.equal(top_k_mask(scores, 3), top_k_mask(scores.clone(), 3))


def test_keep_count():
    assert keep_count(0.7, 10) == 7
    assert keep_count(0.7, 4) == 3  # 2.8 rounds to 3
    assert keep_count(0.01, 4) == 1  # at least one
    assert keep_count(0.0, 4) == 1
    assert keep_count(1.0, 4) == 4
    for size in range(1, 40):
        for r in (0.05, 0.3, 0.62, 0.9, 0.99):
            k = keep_count(r, size)
            assert 1 <= k <= size
            assert abs(k - r * size) <= 0.5 or k == 1


# --- importance maps ----------------------------------------------------------------------------
def test_standardize_per_layer():
    g = torch.Generator().manual_seed(11)
    layers = [torch.randn(6, generator=g) * 5 + 3, torch.full((4,), 2.5), torch.tensor([7.0]),
              torch.rand(9, generator=g) * 1e3]
    z = standardize_per_layer(layers)
    assert z.dtype == torch.float32 and z.shape == (20,)
    parts = torch.split(z, [6, 4, 1, 9])
    for i in (0, 3):
        assert float(parts[i].double().mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(parts[i].double().std()) == pytest.approx(1.0, abs=1e-6)
        assert torch.equal(torch.argsort(parts[i]), torch.argsort(layers[i]))  # order within a layer kept
    assert torch.equal(parts[1], torch.zeros(4)) and torch.equal(parts[2], torch.zeros(1))


@pytest.mark.parametrize("keep", [0.3, 0.5, 0.75])
def test_sigmoid_norm_mean_is_keep_ratio(keep):
    z = torch.randn(50, generator=torch.Generator().manual_seed(12)) * 0.4
    s = sigmoid_norm(z, keep)
    assert float(s.min()) > 0.01 and float(s.max()) < 0.99  # no clamping happened here
    assert float(s.double().mean()) == pytest.approx(keep, abs=1e-6)
    assert torch.equal(torch.argsort(s), torch.argsort(z))


def test_sigmoid_norm_reaches_zero_and_one_after_projection():
    # no cap: a unit the metric is sure of starts at exactly 1 (or 0) and is never flipped
    z = torch.tensor([-20.0, -10.0, 0.0, 10.0, 20.0])
    layout = UnitLayout({"kv_groups": [5]})
    hi = initial_scores(z, layout, "kv_groups", "global", 0.95, "sigmoid-norm", 0.8)
    assert float(hi.max()) == 1.0 and float(hi.sum()) <= 0.95 * 5 + 1e-5
    lo = initial_scores(z, layout, "kv_groups", "global", 0.2, "sigmoid-norm", 0.8)
    assert float(lo.min()) == 0.0 and float(lo.sum()) <= 0.2 * 5 + 1e-5
    assert float(sigmoid_norm(z, 0.95).max()) > 1.0  # the map itself is not clamped; the projection clips


def test_score_const():
    kept = torch.tensor([1.0, 0.0, 0.0, 1.0])
    assert score_const(kept, 0.8).tolist() == pytest.approx([0.8, 0.2, 0.2, 0.8])
    assert score_const(kept, 0.6).tolist() == pytest.approx([0.6, 0.4, 0.4, 0.6])


def test_normal_scores_keep_the_order_and_drop_the_scale():
    z = torch.tensor([5.0, -1.0, 1e6, 0.5, 0.5])  # an outlier, and a tie (ranked in index order)
    x = normal_scores(z)
    assert torch.equal(torch.argsort(x), torch.argsort(z, stable=True))
    assert float(x.mean()) == pytest.approx(0.0, abs=1e-12) and float(x[2]) == pytest.approx(-float(x[1]))
    assert torch.allclose(normal_scores(z * 1e-3 + 7), x)


def test_sigmoid_cut_sits_at_the_metrics_cut_and_narrows_with_the_temperature():
    g = torch.Generator().manual_seed(3)
    z = torch.randn(2000, generator=g) * 0.05 + 3
    z[:20] = 1e4  # heavy tails do not squeeze the rest together (the ranks are what counts)
    kept = top_k_mask(z, keep_count(0.7, 2000))
    uncertain = []
    for t in (1.0, 0.1, 0.01):
        s = sigmoid_cut(z, 0.7, t)
        assert float(s.double().mean()) == pytest.approx(0.7, abs=1e-5)
        order = torch.argsort(z, stable=True)
        assert torch.all(s[order][1:] >= s[order][:-1])  # monotone in the metric
        assert torch.equal(top_k_mask(s, keep_count(0.7, 2000)), kept)  # its hard mask is the metric's
        uncertain.append(int(((s > 0.05) & (s < 0.95)).sum()))
        flips = float(torch.minimum(s, 1 - s).double().mean())  # a sample's expected share of units off the mask
        if t < 1:  # about 1.4 T phi(cut), as documented: 0.5 T at a keep ratio of 0.7
            assert flips == pytest.approx(2 * math.log(2) * t * math.exp(-0.5 * 0.5244 ** 2) / math.sqrt(2 * math.pi),
                                          rel=0.1)
    assert uncertain[0] > 4 * uncertain[1] > 0 and uncertain[1] > 4 * uncertain[2]


def test_sigmoid_cut_per_pool_and_on_the_budget():
    g = torch.Generator().manual_seed(5)
    layout = UnitLayout({"channels": [40, 60, 50]})
    z = standardize("channels", [torch.rand(n, generator=g) * 10 ** i for i, n in enumerate(layout.sizes["channels"])])
    for scope in ("global", "uniform"):
        s = initial_scores(z, layout, "channels", scope, 0.6, "sigmoid-cut", 0.8, 0.2)
        for sl in layout.pools("channels", scope):
            assert float(s[sl].sum()) == pytest.approx(0.6 * (sl.stop - sl.start), abs=1e-3)
    assert torch.equal(initial_scores(z, layout, "channels", "global", 0.6, "sigmoid-cut", 0.8, 0.2),
                       initial_scores(z, layout, "channels", "global", 0.6, "sigmoid-cut", 0.5, 0.2))  # c is not its


@pytest.mark.parametrize("prob_map", ["sigmoid-norm", "score-const", "sigmoid-cut"])
@pytest.mark.parametrize("scope", ["global", "uniform"])
@pytest.mark.parametrize("keep", [0.3, 0.7])
def test_initial_scores_feasible(prob_map, scope, keep):
    g = torch.Generator().manual_seed(13)
    layout = UnitLayout({"kv_groups": [4, 4, 3], "channels": [30, 17, 25]})
    for unit_type in layout.unit_types:
        # depth-growing scales, as raw activation metrics have
        metric = [torch.rand(n, generator=g) * (10**i) for i, n in enumerate(layout.sizes[unit_type])]
        s = initial_scores(standardize(unit_type, metric), layout, unit_type, scope, keep, prob_map, 0.8)
        assert s.shape == (layout.total(unit_type),)
        assert float(s.min()) >= 0.0 and float(s.max()) <= 1.0
        for sl in layout.pools(unit_type, scope):
            assert float(s[sl].sum()) <= keep * (sl.stop - sl.start) + 1e-5
        if prob_map == "score-const":
            # units the metric keeps start strictly above the others (per pool)
            kept = layout.hard_mask(unit_type, standardize_per_layer(metric), scope, keep)
            for sl in layout.pools(unit_type, scope):
                k, d = s[sl][kept[sl] > 0], s[sl][kept[sl] == 0]
                if len(k) and len(d):
                    assert float(k.min()) > float(d.max())
        else:
            # within a layer, a higher metric means a higher (or equal after clamping) keep probability
            for part, m in zip(layout.split(unit_type, s), metric):
                order = torch.argsort(m)
                assert torch.all(part[order][1:] >= part[order][:-1] - 1e-7)


def test_initial_scores_unknown_map():
    layout = UnitLayout({"kv_groups": [2, 2]})
    with pytest.raises(ValueError):
        initial_scores(torch.rand(4), layout, "kv_groups", "global", 0.5, "nope", 0.8)


# --- the weighted projection (a parameter budget: each unit weighs its parameters) --------------------------
def _brute_force_weighted_projection(z: list[float], w: list[float], budget: float) -> list[float]:
    """The projection by enumeration: every assignment of each coordinate to 0, 1 or free, with the budget
    active or not; the feasible stationary point nearest to z is the optimum of this convex problem."""
    import itertools

    best, best_d = None, float("inf")
    n = len(z)
    for sides in itertools.product((0, 1, 2), repeat=n):  # 0: at 0, 1: at 1, 2: free
        for active in (False, True):
            free = [i for i in range(n) if sides[i] == 2]
            if active:
                wf2 = sum(w[i] ** 2 for i in free)
                if wf2 == 0:
                    continue
                v = (sum(w[i] * z[i] for i in free) + sum(w[i] for i in range(n) if sides[i] == 1) - budget) / wf2
            else:
                v = 0.0
            s = [0.0 if sides[i] == 0 else 1.0 if sides[i] == 1 else z[i] - v * w[i] for i in range(n)]
            if v < -1e-12 or any(x < -1e-9 or x > 1 + 1e-9 for x in s) or sum(a * b for a, b in zip(w, s)) > budget + 1e-9:
                continue
            d = sum((a - b) ** 2 for a, b in zip(s, z))
            if d < best_d - 1e-12:
                best, best_d = s, d
    return best


@pytest.mark.parametrize("seed", range(12))
def test_weighted_projection_equals_brute_force(seed):
    from engine.algo.policy import project_weighted_capped_simplex

    g = torch.Generator().manual_seed(seed)
    n = 2 + seed % 4
    z = (torch.rand(n, generator=g, dtype=torch.float64) * 2.4 - 0.7)
    w = torch.rand(n, generator=g, dtype=torch.float64) * 5 + 0.1
    budget = float(torch.rand(1, generator=g, dtype=torch.float64)) * float(w.sum())
    got = project_weighted_capped_simplex(z, w, budget)
    want = torch.tensor(_brute_force_weighted_projection(z.tolist(), w.tolist(), budget), dtype=torch.float64)
    assert torch.allclose(got, want, atol=1e-7), (got, want)
    assert float((w * got).sum()) <= budget + 1e-7 and bool(((got >= 0) & (got <= 1)).all())


def test_weighted_projection_with_unit_weights_is_the_plain_one():
    from engine.algo.policy import project_capped_simplex, project_weighted_capped_simplex

    z = torch.linspace(-0.5, 1.5, 17, dtype=torch.float64)
    for budget in (0.0, 3.3, 8.0, 20.0):
        assert torch.allclose(project_weighted_capped_simplex(z, torch.ones_like(z), budget),
                              project_capped_simplex(z, budget), atol=1e-9)
    with pytest.raises(ValueError, match="positive"):
        project_weighted_capped_simplex(z, torch.zeros_like(z), 1.0)


def test_rank_blocks_keep_kept_and_dropped_apart_and_neighbours_together():
    from engine.algo.policy import block_means, rank_blocks

    g = torch.Generator().manual_seed(0)
    for n_layers, width, block in ((3, 20, 4), (2, 7, 3), (4, 5, 3)):
        s = torch.rand(n_layers * width, generator=g, dtype=torch.float64)
        kept = torch.zeros_like(s)
        for i in range(n_layers):  # each layer keeps its top k
            k = int(torch.randint(0, width + 1, (1,), generator=g))
            kept[i * width + torch.sort(s[i * width:(i + 1) * width], descending=True).indices[:k]] = 1.0
        ids = rank_blocks(s, kept, [width] * n_layers, block)
        assert sorted(set(ids.tolist())) == list(range(int(ids.max()) + 1))
        for k in range(int(ids.max()) + 1):
            members = torch.nonzero(ids == k).flatten()
            assert len({int(i) // width for i in members}) == 1  # one layer
            assert len(set(kept[members].tolist())) == 1  # all kept or all dropped
            if width < 2 * block:
                assert members.numel() == 1
                continue
            assert 1 <= members.numel() <= block
            layer = slice(int(members[0]) // width * width, int(members[0]) // width * width + width)
            same = (kept[layer] == kept[members[0]]).nonzero().flatten() + layer.start
            inside = s[members]  # neighbours: no unit of the same side between the block's lowest and highest
            between = ((s[same] > inside.min()) & (s[same] < inside.max())).sum()
            assert int(between) == members.numel() - 2 if members.numel() >= 2 else int(between) == 0
            if members.numel() < block:  # a short block sits at the end away from the cut
                side = s[same]
                assert inside.max() == side.max() if kept[members[0]] > 0 else inside.min() == side.min()
        torch.testing.assert_close(block_means(s, ids)[ids[0]], s[ids == ids[0]].mean())
