"""From a metric to initial keep probabilities: standardize, then map (one `PROB_MAPS` entry per map)."""

from __future__ import annotations

from typing import Callable

import torch

from ..policy import bisect_down
from ...model.unit_types import UNIT_TYPES
from ...model.units import UnitLayout


def _zscore(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    std = x.std() if x.numel() > 1 else torch.zeros((), dtype=x.dtype)
    return (x - x.mean()) / std if std > 0 else torch.zeros_like(x)


def standardize_per_layer(layer_scores: list[torch.Tensor]) -> torch.Tensor:
    """z-score inside each layer, concatenated. Raw activation scales grow with depth, so a metric
    compared across layers without this prunes the early layers first."""
    return torch.cat([_zscore(s) for s in layer_scores]).float()


def standardize(unit_type: str, layer_scores: list[torch.Tensor]) -> torch.Tensor:
    """The flat, standardized metric of one unit type: per layer for units inside layers, over the
    whole model for whole layers (one unit per layer)."""
    if UNIT_TYPES[unit_type].whole_layer:
        return _zscore(torch.cat(layer_scores)).float()
    return standardize_per_layer(layer_scores)


def sigmoid_norm(z: torch.Tensor, keep_ratio: float) -> torch.Tensor:
    """sigmoid of the standardized metric, shifted so its mean is the keep ratio. Not capped: the
    caller projects the result onto the budget set, which clips it to [0, 1], so a unit the metric
    is sure of starts at exactly 1 (or 0) and is never flipped by a sampled mask. (A cap such as
    [0.01, 0.99] drops a sure unit in 1 % of the samples, and each such drop kicks its score by
    about lr |L - delta| / 0.01.)"""
    s = torch.sigmoid(z)
    return s - s.mean() + keep_ratio


def normal_scores(z: torch.Tensor) -> torch.Tensor:
    """The metric's ranks as standard-normal quantiles, Phi^-1((rank + 1/2) / n): its order, none of its scale
    (a metric's tails, such as FLAP's few channels of huge fluctuation, would squeeze a z-score's bulk together).
    Ties are ranked in index order."""
    n = z.numel()
    ranks = torch.empty(n, dtype=torch.float64)
    ranks[torch.argsort(z.double(), stable=True)] = torch.arange(n, dtype=torch.float64)
    return torch.special.ndtri((ranks + 0.5) / n)


def sigmoid_cut(z: torch.Tensor, keep_ratio: float, temperature: float, iters: int = 100) -> torch.Tensor:
    """sigmoid((x - theta) / T), x the metric's normal scores over the pool (`normal_scores`: its order, so T is
    in the same units for any metric and unit type), theta found by bisection so that the mean is the keep
    ratio. The cut sits where the metric's top units end, and only the units within a few T of it are uncertain:
    a sample flips about 1.4 T phi(theta) of the units (0.5 T at a keep ratio of 0.7). A small T keeps the
    sampled masks near the metric's own mask, so the few samples a CPU budget affords compare swaps at the
    margin instead of masks that differ in a third of their units; T -> 0 is the metric's mask, never flipped."""
    if z.numel() == 0:
        return z.float()
    x = normal_scores(z)
    theta = bisect_down(lambda v: float(torch.sigmoid((x - v) / temperature).mean()), keep_ratio,
                        float(x.min()) - 40 * temperature, float(x.max()) + 40 * temperature, iters)
    return torch.sigmoid((x - theta) / temperature).float()


def score_const(kept: torch.Tensor, c: float) -> torch.Tensor:
    """c for units the metric keeps, 1 - c for the others."""
    return torch.where(kept > 0, torch.full_like(kept, c), torch.full_like(kept, 1.0 - c))


def _per_pool(fn: Callable[[torch.Tensor], torch.Tensor], z: torch.Tensor, pools: list[slice]) -> torch.Tensor:
    out = torch.empty_like(z)
    for sl in pools:
        out[sl] = fn(z[sl])
    return out


# name -> (standardized metric, layout, unit type, scope, keep ratio, score const, temperature) -> probabilities
ProbMap = Callable[[torch.Tensor, UnitLayout, str, str, float, float, float], torch.Tensor]
PROB_MAPS: dict[str, ProbMap] = {
    "sigmoid-norm": lambda z, layout, u, scope, keep, c, t: sigmoid_norm(z, keep),
    "score-const": lambda z, layout, u, scope, keep, c, t: score_const(layout.hard_mask(u, z, scope, keep), c),
    "sigmoid-cut": lambda z, layout, u, scope, keep, c, t: _per_pool(lambda x: sigmoid_cut(x, keep, t), z,
                                                                     layout.pools(u, scope)),
}


def initial_scores(z: torch.Tensor, layout: UnitLayout, unit_type: str, scope: str, keep_ratio: float,
                   prob_map: str, c: float, temperature: float = 1.0) -> torch.Tensor:
    """A standardized metric (flat, see `standardize`) -> feasible keep probabilities for one unit type."""
    if prob_map not in PROB_MAPS:
        raise ValueError(f"unknown probability map {prob_map!r}; known: {', '.join(PROB_MAPS)}")
    s = PROB_MAPS[prob_map](z, layout, unit_type, scope, keep_ratio, c, temperature)
    return layout.project(unit_type, s, scope, keep_ratio)
