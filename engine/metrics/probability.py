"""From a metric to initial keep probabilities: standardize, then map (one `PROB_MAPS` entry per map)."""

from __future__ import annotations

from typing import Callable

import torch

from ..unit_types import UNIT_TYPES
from ..units import UnitLayout


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


def score_const(kept: torch.Tensor, c: float) -> torch.Tensor:
    """c for units the metric keeps, 1 - c for the others."""
    return torch.where(kept > 0, torch.full_like(kept, c), torch.full_like(kept, 1.0 - c))


# name -> (standardized metric, layout, unit type, scope, keep ratio, score const) -> probabilities
ProbMap = Callable[[torch.Tensor, UnitLayout, str, str, float, float], torch.Tensor]
PROB_MAPS: dict[str, ProbMap] = {
    "sigmoid-norm": lambda z, layout, u, scope, keep, c: sigmoid_norm(z, keep),
    "score-const": lambda z, layout, u, scope, keep, c: score_const(layout.hard_mask(u, z, scope, keep), c),
}


def initial_scores(z: torch.Tensor, layout: UnitLayout, unit_type: str, scope: str, keep_ratio: float,
                   prob_map: str, c: float) -> torch.Tensor:
    """A standardized metric (flat, see `standardize`) -> feasible keep probabilities for one unit type."""
    if prob_map not in PROB_MAPS:
        raise ValueError(f"unknown probability map {prob_map!r}; known: {', '.join(PROB_MAPS)}")
    s = PROB_MAPS[prob_map](z, layout, unit_type, scope, keep_ratio, c)
    return layout.project(unit_type, s, scope, keep_ratio)
