from __future__ import annotations

import torch

from ...model.unit_types import UNIT_TYPES
from .registry import MetricContext, register_metric


@register_metric("magnitude-sp", scores="units", needs_data=False)
@torch.no_grad()
def magnitude_sp(ctx: MetricContext, unit_types: list[str]) -> dict[str, list[torch.Tensor]]:
    """Magnitude-sp: column j of an output projection scores mean_rows |W[:, j]| (no data)."""
    a = ctx.adapter
    return {u: [UNIT_TYPES[u].to_units(a, UNIT_TYPES[u].output_proj(a, i).weight.detach().float().abs().mean(0).cpu())
                for i in range(a.num_layers)] for u in unit_types}
