"""Initial scores: unit importance metrics and the maps that turn them into keep probabilities."""

from __future__ import annotations

import torch

from .adapter import ModelAdapter
from .evaluate import batch_loss
from .units import UnitLayout


@torch.no_grad()
def wanda_sp(adapter: ModelAdapter, batches: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Wanda-sp (FLAP's structured Wanda) per unit, per layer.

    For an output projection W (out x in) and its input activations X, column j scores
    mean_rows |W[:, j]| * sqrt(mean_tokens X_j^2). A query head sums its head_dim columns, a
    KV group averages its query heads; an MLP channel is one column.
    """
    n = adapter.num_layers
    sq_sums = {("heads", i): None for i in range(n)} | {("channels", i): None for i in range(n)}
    tokens = [0]
    handles = []

    def recorder(key):
        def hook(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            s = (x * x).sum(0)
            sq_sums[key] = s if sq_sums[key] is None else sq_sums[key] + s

        return hook

    for i in range(n):
        handles.append(adapter.attn_out_proj(i).register_forward_pre_hook(recorder(("heads", i))))
        handles.append(adapter.mlp_out_proj(i).register_forward_pre_hook(recorder(("channels", i))))
    try:
        for batch in batches:
            batch_loss(adapter.model, batch)
            tokens[0] += batch.numel()
    finally:
        for h in handles:
            h.remove()

    out: dict[str, list[torch.Tensor]] = {"heads": [], "channels": []}
    for i in range(n):
        for unit_type, proj in (("heads", adapter.attn_out_proj(i)), ("channels", adapter.mlp_out_proj(i))):
            col = proj.weight.detach().float().abs().mean(0).cpu() * torch.sqrt(sq_sums[(unit_type, i)].cpu() / tokens[0])
            if unit_type == "heads":
                per_head = col.view(-1, adapter.head_dim).sum(1)
                col = per_head.view(-1, adapter.queries_per_group).mean(1)
            out[unit_type].append(col)
    return out


def standardize_per_layer(layer_scores: list[torch.Tensor]) -> torch.Tensor:
    """z-score inside each layer, concatenated. Raw activation scales grow with depth, so a metric
    compared across layers without this prunes the early layers first."""
    parts = []
    for s in layer_scores:
        s = s.double()
        std = s.std() if s.numel() > 1 else torch.zeros((), dtype=s.dtype)
        parts.append(((s - s.mean()) / std) if std > 0 else torch.zeros_like(s))
    return torch.cat(parts).float()


def sigmoid_norm(z: torch.Tensor, keep_ratio: float, clamp: float = 0.01) -> torch.Tensor:
    """sigmoid of the standardized metric, shifted so its mean is the keep ratio, clamped.
    (The caller projects the result onto the budget set.)"""
    s = torch.sigmoid(z)
    return (s - s.mean() + keep_ratio).clamp(clamp, 1.0 - clamp)


def score_const(kept: torch.Tensor, c: float) -> torch.Tensor:
    """c for units the metric keeps, 1 - c for the others."""
    return torch.where(kept > 0, torch.full_like(kept, c), torch.full_like(kept, 1.0 - c))


def initial_scores(
    metric: list[torch.Tensor], layout: UnitLayout, unit_type: str, scope: str, keep_ratio: float,
    prob_map: str, c: float,
) -> torch.Tensor:
    """Per-layer metric values -> feasible keep probabilities for one unit type."""
    z = standardize_per_layer(metric)
    if prob_map == "sigmoid-norm":
        s = sigmoid_norm(z, keep_ratio)
    elif prob_map == "score-const":
        s = score_const(layout.hard_mask(unit_type, z, scope, keep_ratio), c)
    else:
        raise ValueError(f"unknown probability map {prob_map!r}")
    return layout.project(unit_type, s, scope, keep_ratio)
