"""FLAP's fluctuation metric (An et al., 2024, "Fluctuation-based adaptive structured pruning"), written from
the paper.

An output projection's input column j (a channel of the MLP, a head-dim column of a query head) whose input
barely fluctuates over the calibration tokens can be replaced by its mean (the bias compensation) at little
cost: its score is the sample variance of X_j over the tokens times the squared norm of the weight column,
S_j = var(X_j) ||W[:, j]||^2. FLAP's adaptive structure compares units across layers and modules: the column
scores are standardized inside each (layer, module), a KV group takes the mean of its columns' standardized
scores, and one ranking over every layer, KV group and channel, each weighing its parameters, fills the budget
(engine/algo/budget.ParamBudget.type_keeps with a metric whose scores compare across types). The official code
also squares the attention scores before standardizing; the paper's formula does not, and neither does this.
"""

from __future__ import annotations

import torch

from ...model.unit_types import UNIT_TYPES
from .activations import column_moments
from .registry import MetricContext, register_metric


def fluctuation(sum_x: torch.Tensor, sum_x2: torch.Tensor, tokens: int, weight: torch.Tensor) -> torch.Tensor:
    """S_j = var(X_j) ||W[:, j]||^2 per input column j of W (out x in), from the column sums of x and x^2 over
    `tokens` tokens (the sample variance, n - 1 in the denominator)."""
    mean = sum_x / tokens
    var = (sum_x2 - tokens * mean * mean).clamp_min(0) / max(tokens - 1, 1)
    return var * weight.float().pow(2).sum(0)


def standardized_units(per_column: torch.Tensor, columns_per_unit: int) -> torch.Tensor:
    """Standardize the column scores of one (layer, module), then average each unit's columns."""
    z = per_column.double()
    std = z.std() if z.numel() > 1 else torch.zeros((), dtype=z.dtype)
    z = (z - z.mean()) / std if std > 0 else torch.zeros_like(z)
    return z.view(-1, columns_per_unit).mean(1).float()


@register_metric("flap", scores="units", needs_data=True, comparable=True, statistics=("column-moments",))
@torch.no_grad()
def flap(ctx: MetricContext, unit_types: list[str]) -> dict[str, list[torch.Tensor]]:
    """FLAP's fluctuation metric: var(X_j) ||W[:, j]||^2 of every output-projection input column, standardized
    per layer and module, averaged over a unit's columns (comparable across layers and unit types)."""
    a = ctx.adapter
    sum_x, sum_x2, tokens = column_moments(a, ctx.batches, ctx.world, ctx.memo, "flap's statistics")
    out = {}
    for u in unit_types:
        t = UNIT_TYPES[u]
        per_layer = []
        for i in range(a.num_layers):
            w = t.output_proj(a, i).weight.detach().cpu()
            s1, s2 = sum_x[(u, i)].double().cpu(), sum_x2[(u, i)].double().cpu()
            per_layer.append(standardized_units(fluctuation(s1, s2, tokens, w.double()), t.column_width(a)))
        out[u] = per_layer
    return out
