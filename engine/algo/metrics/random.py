from __future__ import annotations

import torch

from .registry import MetricContext, register_metric


@register_metric("random", scores="any", needs_data=False)
def random_metric(ctx: MetricContext, unit_types: list[str]) -> dict[str, list[torch.Tensor]]:
    """Random: a seeded Gaussian score per unit, mapped to probabilities like any other metric."""
    g = torch.Generator().manual_seed(ctx.seed)
    return {u: [torch.randn(k, generator=g) for k in ctx.layout.sizes[u]] for u in unit_types}
