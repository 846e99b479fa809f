from __future__ import annotations

import torch

from ...model.unit_types import UNIT_TYPES
from .registry import MetricContext, register_metric
from .activations import column_moments


@register_metric("wanda-sp", scores="units", needs_data=True, statistics=("column-moments",))
@torch.no_grad()
def wanda_sp(ctx: MetricContext, unit_types: list[str]) -> dict[str, list[torch.Tensor]]:
    """Wanda-sp (FLAP's structured Wanda): column j of an output projection W (out x in) with input
    activations X scores mean_rows |W[:, j]| * sqrt(mean_tokens X_j^2), summed over the unit's columns."""
    a = ctx.adapter
    _, sq_sums, tokens = column_moments(a, ctx.batches, ctx.world, ctx.memo, "wanda-sp's statistics")
    out = {}
    for u in unit_types:
        t = UNIT_TYPES[u]
        out[u] = [t.to_units(a, t.output_proj(a, i).weight.detach().float().abs().mean(0).cpu()
                             * torch.sqrt(sq_sums[(u, i)].cpu() / tokens)) for i in range(a.num_layers)]
    return out
