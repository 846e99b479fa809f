"""Parameter accounting: what each unit weighs and what a set of masks removes, with whole layers nested over
the widths inside them (a removed layer's KV groups and channels are counted once, as part of the layer)."""

from __future__ import annotations

import torch

from .unit_types import UNIT_TYPES


def unit_weights(adapter, layout) -> dict[str, torch.Tensor]:
    """unit type -> (units,) the parameters each unit carries, flat in the layout's order."""
    out = {}
    for u in layout.unit_types:
        per_layer = UNIT_TYPES[u].unit_params(adapter)
        out[u] = torch.cat([torch.full((n,), float(w), dtype=torch.float64) for n, w in zip(layout.sizes[u], per_layer)])
    return out


def decoder_params(adapter) -> int:
    return sum(p.numel() for i in range(adapter.num_layers) for p in adapter.layer(i).parameters())


def removed_parameters(layout, weights: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]) -> dict[str, int]:
    """unit type -> parameters its removed units take away. A width unit inside a removed layer is not counted
    for its type (the layer's count holds it)."""
    kept_layer = None
    for u in layout.unit_types:
        if UNIT_TYPES[u].whole_layer:
            kept_layer = masks[u] > 0.5  # (layers,)
    out = {}
    for u in layout.unit_types:
        removed = masks[u] <= 0.5
        if kept_layer is not None and not UNIT_TYPES[u].whole_layer:
            in_kept = torch.cat([kept_layer[i].expand(n) for i, n in enumerate(layout.sizes[u])])
            removed = removed & in_kept
        out[u] = int(weights[u][removed].sum())
    return out


def removal_report(adapter, layout, masks: dict[str, torch.Tensor], params_dense: int) -> dict:
    """What a run's final masks removed: parameters, as a share of the decoder layers and of the whole model
    (embeddings and the LM head are never pruned), and each unit type's part."""
    by_type = removed_parameters(layout, unit_weights(adapter, layout), masks)
    total, decoder = sum(by_type.values()), decoder_params(adapter)
    return {"params_removed": total, "params_decoder": decoder, "removed_of_decoder": total / decoder,
            "removed_of_model": total / params_dense, "params_removed_by_unit_type": by_type}
