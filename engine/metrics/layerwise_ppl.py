from __future__ import annotations

import torch

from ..arch import ModelAdapter
from ..evaluate import batch_loss
from ..masking import MaskHooks
from ..unit_types import whole_layer_type
from . import MetricContext, register_metric


@torch.no_grad()
def loss_without(adapter: ModelAdapter, batches: list[torch.Tensor], removed: list[int]) -> float:
    """Mean calibration loss with the given layers removed."""
    gates = [torch.tensor(0.0 if i in removed else 1.0) for i in range(adapter.num_layers)]
    with MaskHooks(adapter) as hooks:
        hooks.set({whole_layer_type().name: gates})
        return float(torch.cat([batch_loss(adapter.model, b) for b in batches]).double().mean())


@register_metric("layerwise-ppl", scores="layers", needs_data=True)
def layerwise_ppl(ctx: MetricContext, unit_types: list[str]) -> dict[str, list[torch.Tensor]]:
    """Layerwise-PPL (Shortened-LLaMA): the calibration log-perplexity with layer i removed alone
    (a layer whose removal hurts more is more important)."""
    a = ctx.adapter
    return {u: [torch.tensor([loss_without(a, ctx.batches, [i])]) for i in range(a.num_layers)] for u in unit_types}
