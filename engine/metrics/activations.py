"""Statistics of the inputs of every unit type's output projection over calibration tokens."""

from __future__ import annotations

import torch

from ..arch import ModelAdapter
from ..evaluate import decoder_forward
from ..unit_types import layer_unit_types


@torch.no_grad()
def column_sums(adapter: ModelAdapter, batches: list[torch.Tensor], stat) -> tuple[dict[tuple[str, int], torch.Tensor], int]:
    """Sum over calibration tokens of stat(x) for every input column x of each unit type's output
    projection, keyed (unit type, layer), and the token count."""
    sums: dict[tuple[str, int], torch.Tensor] = {}
    handles = []

    def recorder(key):
        def hook(module, args):
            s = stat(args[0].detach().float().reshape(-1, args[0].shape[-1])).sum(0)
            sums[key] = s if key not in sums else sums[key] + s

        return hook

    for t in layer_unit_types():
        for i in range(adapter.num_layers):
            handles.append(t.output_proj(adapter, i).register_forward_pre_hook(recorder((t.name, i))))
    tokens = 0
    try:
        for batch in batches:
            decoder_forward(adapter.model, batch)
            tokens += batch.numel()
    finally:
        for h in handles:
            h.remove()
    return sums, tokens


def input_means(adapter: ModelAdapter, batches: list[torch.Tensor]) -> dict[str, list[torch.Tensor]]:
    """Per layer, the mean over calibration tokens of every input column of each unit type's output
    projection, on the unmasked model (FLAP's bias compensation uses the dense means)."""
    sums, tokens = column_sums(adapter, batches, lambda x: x)
    return {t.name: [(sums[(t.name, i)] / tokens).cpu() for i in range(adapter.num_layers)] for t in layer_unit_types()}
