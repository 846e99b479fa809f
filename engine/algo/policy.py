"""The pure kernels of policy-gradient pruning: projection, estimator, baseline, schedule, final mask.

Everything here works on 1-D float tensors of unit scores s in [0, 1] and has no model in sight.
"""

from __future__ import annotations

import math
from typing import Callable

import torch


def bisect_down(f: Callable[[float], float], target: float, lo: float, hi: float, iters: int = 100) -> float:
    """For f non-increasing on [lo, hi] with f(lo) > target >= f(hi): the v where f crosses the target, from
    above (f(v) <= target), to within (hi - lo) / 2^iters."""
    for _ in range(iters):
        v = 0.5 * (lo + hi)
        if f(v) > target:
            lo = v
        else:
            hi = v
    return hi


def project_capped_simplex(z: torch.Tensor, budget: float, iters: int = 100) -> torch.Tensor:
    """Euclidean projection of z onto C = {s : sum(s) <= budget, 0 <= s <= 1}.

    The KKT conditions give s = clamp(z - v, 0, 1) with v >= 0 the multiplier of the sum
    constraint: v = 0 when clamp(z, 0, 1) already fits the budget, otherwise the v at which the
    sum equals the budget, found by bisection (the sum is non-increasing in v).
    """
    if budget < 0:
        raise ValueError("budget must be non-negative")
    s = z.clamp(0.0, 1.0)
    if s.sum() <= budget:
        return s
    v = bisect_down(lambda v: (z - v).clamp(0.0, 1.0).sum(), budget, 0.0, float(z.max()), iters)  # (all 0 at max z)
    return (z - v).clamp(0.0, 1.0)


def project_weighted_capped_simplex(z: torch.Tensor, weights: torch.Tensor, budget: float, iters: int = 100) -> torch.Tensor:
    """Euclidean projection of z onto C = {s : sum(w s) <= budget, 0 <= s <= 1}, w > 0: a budget on a weighted
    count (a parameter budget, each unit weighing its parameters).

    The KKT conditions give s = clamp(z - v w, 0, 1) with v >= 0: v = 0 when clamp(z, 0, 1) fits the budget,
    otherwise the v at which sum(w s) equals it, found by bisection (sum(w s) is non-increasing in v; at
    v = max(z / w) every entry clamps to 0). With all weights 1 this is project_capped_simplex.
    """
    if budget < 0:
        raise ValueError("budget must be non-negative")
    w = weights.to(z.dtype)
    if bool((w <= 0).any()):
        raise ValueError("weights must be positive")
    s = z.clamp(0.0, 1.0)
    if (w * s).sum() <= budget:
        return s
    v = bisect_down(lambda v: (w * (z - v * w).clamp(0.0, 1.0)).sum(), budget, 0.0, float((z / w).max()), iters)
    return (z - v * w).clamp(0.0, 1.0)


def policy_gradient(
    scores: torch.Tensor,
    masks: torch.Tensor,
    losses: torch.Tensor,
    baseline: torch.Tensor | float,
    estimator: str = "paper",
    clamp: float = 1e-2,
) -> torch.Tensor:
    """REINFORCE estimate of d E[L] / d s for Bernoulli(s) masks.

    masks: (N_s, n) samples, losses: (N_s,), baseline: scalar or (N_s,) per-sample baselines.
    "paper":  g = 1/N_s     sum_j (L_j - b)(m_j - s) / (s(1 - s))
    "sqrt":   g = 1/(N_s-1) sum_j (L_j - b)(m_j - s) / sqrt(s(1 - s))   (the reference code's variant)
    The masks are centred on the unclamped s, so E[m - s] = 0 and the baseline only changes the
    variance, never the mean; a saturated unit (s = 0 or 1) is never flipped, so its estimate is
    exactly 0. s is clamped to [clamp, 1 - clamp] in the denominator only, to keep it finite.
    """
    s = scores.clamp(clamp, 1.0 - clamp)
    adv = (losses - torch.as_tensor(baseline, dtype=losses.dtype)).to(s.dtype)  # (N_s,)
    centred = masks.to(s.dtype) - scores.to(s.dtype)  # (N_s, n)
    n_samples = masks.shape[0]
    if estimator == "paper":
        return (adv[:, None] * centred).sum(0) / (s * (1 - s)) / n_samples
    if estimator == "sqrt":
        if n_samples < 2:
            raise ValueError("the sqrt estimator divides by N_s - 1 and needs at least 2 samples")
        return (adv[:, None] * centred).sum(0) / torch.sqrt(s * (1 - s)) / (n_samples - 1)
    raise ValueError(f"unknown estimator {estimator!r}")


def metric_feature(metric: torch.Tensor, scores: torch.Tensor, masks: torch.Tensor) -> torch.Tensor:
    """The control variate of a linear loss model: f_j = sum_i z_i (s_i - m_ji), (N_s,).

    If dropping unit i costs about beta * z_i, the loss of mask m_j is about const + beta f_j.
    E[f_j] = 0 and f_j = h(m_j) - E[h] for h(m) = -sum_i z_i m_i, so subtracting beta f_j from
    the losses leaves the REINFORCE estimate unbiased once -beta z (= beta dE[h]/ds) is added back, as
    engine/algo/methods/pg.py does.
    """
    return (metric.to(masks.dtype)[None, :] * (scores.to(masks.dtype)[None, :] - masks)).sum(1)


def fit_control_coefficients(cov_ff: torch.Tensor, cov_fa: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """beta minimising E[(a - beta . f)^2] from running second moments, (C_ff + ridge) beta = C_fa,
    with the ridge relative to each feature's own scale (features differ by orders of magnitude)."""
    d = torch.sqrt(torch.diagonal(cov_ff)).clamp_min(1e-30)
    normed = cov_ff / (d[:, None] * d[None, :])
    k = cov_ff.shape[0]
    return torch.linalg.solve(normed + ridge * torch.eye(k, dtype=cov_ff.dtype), cov_fa / d) / d


def update_baseline(baseline: float | None, mean_loss: float, window: int) -> float:
    """Moving average with window T: delta <- (1 - 1/T) delta + (1/T) mean_j L_j; starts at the first loss."""
    if baseline is None:
        return float(mean_loss)
    return (1.0 - 1.0 / window) * baseline + mean_loss / window


def leave_one_out_baselines(losses: torch.Tensor) -> torch.Tensor:
    """Per-sample baselines b_j = mean of the other N_s - 1 losses of the same batch (no stale losses)."""
    n = losses.numel()
    if n < 2:
        raise ValueError("a leave-one-out baseline needs at least 2 samples")
    return (losses.sum() - losses) / (n - 1)


def progressive_stages(target_prune_ratio: float, steps: int, increment: float = 0.05) -> list[tuple[int, float]]:
    """Random-progressive schedule: [(first step, prune ratio)] per stage.

    The prune ratio starts at `increment` and rises by `increment` per stage up to the target;
    the step budget is split evenly across stages (the last stage takes the remainder).
    """
    n = max(1, math.ceil(round(target_prune_ratio / increment, 6)))
    ratios = [min(target_prune_ratio, increment * (k + 1)) for k in range(n)]
    per = steps // n
    if per == 0:  # fewer steps than stages: spend them on the last stages
        ratios, per = ratios[-steps:], 1
    return [(k * per, r) for k, r in enumerate(ratios)]


def stage_at(stages: list[tuple[int, float]], step: int, total_steps: int) -> tuple[float, int, int]:
    """(prune ratio, steps into the stage, stage length) of 0-based `step`."""
    k = 0
    for i, (start, _) in enumerate(stages):
        if start <= step:
            k = i
    start = stages[k][0]
    end = stages[k + 1][0] if k + 1 < len(stages) else total_steps
    return stages[k][1], step - start, max(end - start, 1)


def relaxed_bernoulli(scores: torch.Tensor, temperature: float, generator: torch.Generator,
                      straight_through: bool = False, clamp: float = 1e-2) -> torch.Tensor:
    """Gumbel-softmax (binary concrete) sample of Bernoulli(s) masks, differentiable in s.

    m = sigmoid((logit(s) + logit(u)) / tau), u ~ U(0, 1). Straight-through: the forward value is
    the hard 0/1 mask (m > 0.5), the gradient that of the relaxed m.
    """
    s = scores.clamp(clamp, 1.0 - clamp)
    u = torch.rand(s.shape, generator=generator, dtype=torch.float64).clamp(1e-6, 1 - 1e-6).to(s)
    soft = torch.sigmoid((torch.log(s) - torch.log1p(-s) + torch.log(u) - torch.log1p(-u)) / temperature)
    if not straight_through:
        return soft
    hard = (soft > 0.5).to(soft)
    return hard + soft - soft.detach()


def cosine_lr(base_lr: float, step: int, total_steps: int) -> float:
    """Cosine decay from base_lr at step 0 to 0 at total_steps."""
    return 0.5 * base_lr * (1.0 + math.cos(math.pi * min(step, total_steps) / max(total_steps, 1)))


# the learning-rate schedules by name: (base lr, steps into the stage, stage length) -> lr
LR_SCHEDULE_FNS = {
    "cosine": cosine_lr,
    "constant": lambda base_lr, step, total_steps: base_lr,
}


def sample_masks(scores: torch.Tensor, n_samples: int, generator: torch.Generator, antithetic: bool = False) -> torch.Tensor:
    """(n_samples, n) Bernoulli(s) draws as 0/1 floats.

    Antithetic: the samples come in pairs drawn from u and 1 - u, so each is still Bernoulli(s)
    but the two are negatively correlated (a unit dropped in one is likelier kept in the other).
    """
    if not antithetic:
        u = torch.rand((n_samples, scores.numel()), generator=generator, dtype=torch.float64)
    else:
        if n_samples % 2:
            raise ValueError("antithetic sampling needs an even number of samples")
        half = torch.rand((n_samples // 2, scores.numel()), generator=generator, dtype=torch.float64)
        u = torch.stack([half, 1.0 - half], dim=1).reshape(n_samples, -1)
    return (u < scores.double()).to(scores.dtype)


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """0/1 mask keeping the k largest scores (ties broken by lower index, deterministically)."""
    mask = torch.zeros_like(scores)
    if k > 0:
        order = torch.sort(scores, descending=True, stable=True).indices
        mask[order[:k]] = 1.0
    return mask


def keep_count(keep_ratio: float, size: int) -> int:
    """Units kept out of `size` at `keep_ratio`, at least one."""
    return max(1, min(size, round(keep_ratio * size)))


def rank_blocks(scores: torch.Tensor, kept: torch.Tensor, sizes: list[int], block: int) -> torch.Tensor:
    """(n,) block ids: within each layer, the kept units (kept > 0.5) ranked by score and cut into blocks of `block`
    from the cut upwards, the dropped ones from the cut downwards (a short block sits at either end, never at the
    cut), so that a block is all kept or all dropped and holds neighbours in the ranking. A layer with fewer than
    2 * block units is one block per unit. Ids run 0.. over the layers in order."""
    ids, start, nxt = torch.empty(scores.numel(), dtype=torch.long), 0, 0
    for n in sizes:
        s, k = scores[start:start + n], kept[start:start + n] > 0.5
        if n < 2 * block:
            ids[start:start + n] = torch.arange(nxt, nxt + n)
            nxt, start = nxt + n, start + n
            continue
        for side, descending in ((k, False), (~k, True)):  # kept: lowest score first; dropped: highest first
            idx = torch.nonzero(side).flatten()
            order = idx[torch.sort(s[idx], descending=descending, stable=True).indices]  # nearest the cut first
            for j in range(0, order.numel(), block):
                ids[start + order[j:j + block]] = nxt
                nxt += 1
        start += n
    return ids


def block_means(values: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """(blocks,) the mean of `values` over each block id."""
    n = int(ids.max()) + 1 if ids.numel() else 0
    total = torch.zeros(n, dtype=values.dtype).index_add_(0, ids, values)
    return total / torch.bincount(ids, minlength=n).to(values.dtype)
