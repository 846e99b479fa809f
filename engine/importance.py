"""Initial scores: unit importance metrics and the maps that turn them into keep probabilities.

Every metric returns, per unit type, one tensor per layer ("higher = more important"):
- Wanda-sp (FLAP's structured Wanda) and magnitude-sp for KV groups and MLP channels;
- first-order Taylor importance (LLM-Pruner style; one backward pass per calibration batch);
- Layerwise-PPL (the calibration loss with each layer removed alone, as Shortened-LLaMA) and
  SLEB (greedy removal of the layer whose absence costs least, one at a time) for whole layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .adapter import ModelAdapter
from .evaluate import batch_loss, token_loss
from .masking import MaskHooks
from .policy import keep_count
from .units import WHOLE_LAYER_TYPES, UnitLayout


def _to_units(adapter: ModelAdapter, unit_type: str, col: torch.Tensor) -> torch.Tensor:
    """Per-column scores of an output projection's input -> per-unit scores. A query head sums its
    head_dim columns, a KV group averages its query heads; an MLP channel is one column."""
    if unit_type == "heads":
        per_head = col.view(-1, adapter.head_dim).sum(1)
        return per_head.view(-1, adapter.queries_per_group).mean(1)
    return col


@torch.no_grad()
def _column_sums(adapter: ModelAdapter, batches: list[torch.Tensor], stat) -> tuple[dict[tuple[str, int], torch.Tensor], int]:
    """Sum over calibration tokens of stat(x) for every input column x of the attention and MLP output
    projections, keyed (unit type, layer), and the token count."""
    sums: dict[tuple[str, int], torch.Tensor] = {}
    handles = []

    def recorder(key):
        def hook(module, args):
            s = stat(args[0].detach().float().reshape(-1, args[0].shape[-1])).sum(0)
            sums[key] = s if key not in sums else sums[key] + s

        return hook

    for i in range(adapter.num_layers):
        for u in ("heads", "channels"):
            handles.append(adapter.output_proj(u, i).register_forward_pre_hook(recorder((u, i))))
    tokens = 0
    try:
        for batch in batches:
            batch_loss(adapter.model, batch)
            tokens += batch.numel()
    finally:
        for h in handles:
            h.remove()
    return sums, tokens


@torch.no_grad()
def wanda_sp(adapter: ModelAdapter, batches: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Wanda-sp: for an output projection W (out x in) and its input activations X, column j
    scores mean_rows |W[:, j]| * sqrt(mean_tokens X_j^2)."""
    sq_sums, tokens = _column_sums(adapter, batches, lambda x: x * x)
    out: dict[str, list[torch.Tensor]] = {"heads": [], "channels": []}
    for i in range(adapter.num_layers):
        for u in out:
            w = adapter.output_proj(u, i).weight.detach().float().abs().mean(0).cpu()
            out[u].append(_to_units(adapter, u, w * torch.sqrt(sq_sums[(u, i)].cpu() / tokens)))
    return out


def input_means(adapter: ModelAdapter, batches: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Per layer, the mean over calibration tokens of every input column of the attention and MLP output
    projections, on the unmasked model (FLAP's bias compensation uses the dense means): "heads" holds
    the attention-output columns (head_dim per query head), "channels" the MLP ones."""
    sums, tokens = _column_sums(adapter, batches, lambda x: x)
    return {u: [(sums[(u, i)] / tokens).cpu() for i in range(adapter.num_layers)] for u in ("heads", "channels")}


@torch.no_grad()
def magnitude_sp(adapter: ModelAdapter) -> dict[str, list[torch.Tensor]]:
    """Magnitude-sp: column j of an output projection scores mean_rows |W[:, j]| (no data)."""
    return {u: [_to_units(adapter, u, adapter.output_proj(u, i).weight.detach().float().abs().mean(0).cpu())
                for i in range(adapter.num_layers)] for u in ("heads", "channels")}


def taylor(adapter: ModelAdapter, batches: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """First-order Taylor importance (LLM-Pruner): a unit scores sum |w * dL/dw| over every weight
    it owns (query/key/value rows and output columns of a KV group; gate/up rows and the down column
    of a channel), with the gradient of the calibration loss accumulated over `batches`.

    This is the one place that back-propagates through the model (one backward pass per batch);
    the policy-gradient optimisation itself stays forward-only.
    """
    n = adapter.num_layers
    linears = {id(m): m for i in range(n) for parts in adapter.unit_weights(i).values() for m, _, _ in parts}
    for m in linears.values():
        m.weight.requires_grad_(True)
        m.weight.grad = None
    try:
        with torch.enable_grad():
            for batch in batches:
                token_loss(adapter.model, batch).mean().backward()
        out: dict[str, list[torch.Tensor]] = {"heads": [], "channels": []}
        for i in range(n):
            for u, parts in adapter.unit_weights(i).items():
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


@torch.no_grad()
def _loss_without(adapter: ModelAdapter, batches: list[torch.Tensor], removed: list[int]) -> float:
    gates = [torch.tensor(0.0 if i in removed else 1.0) for i in range(adapter.num_layers)]
    with MaskHooks(adapter) as hooks:
        hooks.set({"layers": gates})
        return float(torch.cat([batch_loss(adapter.model, b) for b in batches]).double().mean())


def layerwise_ppl(adapter: ModelAdapter, batches: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Layerwise-PPL (Shortened-LLaMA): the calibration log-perplexity with layer i removed alone.
    A layer whose removal hurts more is more important."""
    return {"layers": [torch.tensor([_loss_without(adapter, batches, [i])]) for i in range(adapter.num_layers)]}


def sleb(adapter: ModelAdapter, batches: list[torch.Tensor], keep_ratio: float) -> dict[str, list[torch.Tensor]]:
    """SLEB: remove layers one at a time, each time the one whose removal gives the lowest
    calibration loss given those already removed, until keep_ratio of the layers remain.
    Score: the removal round (0 = removed first); layers never removed score highest."""
    n = adapter.num_layers
    to_remove = n - keep_count(keep_ratio, n)
    removed: list[int] = []
    for _ in range(to_remove):
        losses = {i: _loss_without(adapter, batches, removed + [i]) for i in range(n) if i not in removed}
        removed.append(min(losses, key=losses.get))
    score = {i: float(k) for k, i in enumerate(removed)}
    return {"layers": [torch.tensor([score.get(i, float(to_remove))]) for i in range(n)]}


def random_metric(layout: UnitLayout, unit_types: list[str], seed: int) -> dict[str, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {u: [torch.randn(k, generator=g) for k in layout.sizes[u]] for u in unit_types}


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
    if unit_type in WHOLE_LAYER_TYPES:
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


def initial_scores(z: torch.Tensor, layout: UnitLayout, unit_type: str, scope: str, keep_ratio: float,
                   prob_map: str, c: float) -> torch.Tensor:
    """A standardized metric (flat, see `standardize`) -> feasible keep probabilities for one unit type."""
    if prob_map == "sigmoid-norm":
        s = sigmoid_norm(z, keep_ratio)
    elif prob_map == "score-const":
        s = score_const(layout.hard_mask(unit_type, z, scope, keep_ratio), c)
    else:
        raise ValueError(f"unknown probability map {prob_map!r}")
    return layout.project(unit_type, s, scope, keep_ratio)
