from __future__ import annotations

import torch

from ..evaluate import token_loss
from ...model.unit_types import UNIT_TYPES
from .registry import MetricContext, register_metric


@register_metric("taylor", scores="units", needs_data=True)
def taylor(ctx: MetricContext, unit_types: list[str]) -> dict[str, list[torch.Tensor]]:
    """First-order Taylor importance (LLM-Pruner): sum |w * dL/dw| over every weight a unit owns.

    A KV group owns its query/key/value rows and output columns, a channel its gate/up rows and down
    column; the gradient of the calibration loss is accumulated over the batches. This is the one
    place that back-propagates through the model (one backward pass per batch); the policy-gradient
    optimisation itself stays forward-only. Under torchrun each rank back-propagates its share of the batches
    and the ranks' gradient sums are added up (World.add_up, in float64): one process's gradient to within
    float rounding (bit for bit on 2 ranks when rank 1 has one batch).
    """
    a = ctx.adapter
    owned = {u: [UNIT_TYPES[u].owned_weights(a, i) for i in range(a.num_layers)] for u in unit_types}
    linears = {id(m): m for parts in owned.values() for layer in parts for m, _, _ in layer}
    for m in linears.values():
        m.weight.requires_grad_(True)
        m.weight.grad = None
    try:
        with torch.enable_grad():
            for j in ctx.world.mine(len(ctx.batches)):
                token_loss(a.model, ctx.batches[j]).mean().backward()
        for m in linears.values():  # (one process: the gradient as it is)
            grad = m.weight.grad if m.weight.grad is not None else torch.zeros_like(m.weight)
            m.weight.grad = ctx.world.add_up(grad, "taylor's gradients")
        out: dict[str, list[torch.Tensor]] = {}
        for u, layers in owned.items():
            out[u] = []
            for parts in layers:
                total = None
                for m, dim, width in parts:
                    contrib = (m.weight.detach() * m.weight.grad).abs().float()
                    per_unit = contrib.transpose(0, dim).reshape(-1, width, contrib.shape[1 - dim]).sum((1, 2)).cpu()
                    total = per_unit if total is None else total + per_unit
                out[u].append(total)
        return out
    finally:
        for m in linears.values():
            m.weight.grad = None
            m.weight.requires_grad_(False)
