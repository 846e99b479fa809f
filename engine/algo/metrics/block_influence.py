from __future__ import annotations

import torch

from ...model.arch import ModelAdapter
from ..evaluate import decoder_forward
from .activations import release_freed_memory
from .registry import MetricContext, register_metric


def _layer_output(output) -> torch.Tensor:
    """A decoder layer's hidden states from its forward's return (a tensor, or a tuple starting with it)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def token_cosines(x_in: torch.Tensor, x_out: torch.Tensor) -> torch.Tensor:
    """The cosine similarity of every token's hidden state before and after a layer: (batch, seq) in float64."""
    return torch.nn.functional.cosine_similarity(x_in.double(), x_out.double(), dim=-1)


@torch.no_grad()
def cosine_sums(adapter: ModelAdapter, batches: list[torch.Tensor]) -> list[torch.Tensor]:
    """For each batch, per decoder layer, the sum over its tokens of cos(layer input, layer output): one forward of
    the decoder per batch, with a pre-hook and a hook on every layer (the adapter's layers; the input is held only
    until that layer's output arrives)."""
    n = adapter.num_layers
    parts: list[torch.Tensor] = []
    inputs: dict[int, torch.Tensor] = {}
    handles = []

    def before(i):
        def hook(module, args, kwargs):
            inputs[i] = (args[0] if args else kwargs["hidden_states"]).detach()
        return hook

    def after(i):
        def hook(module, args, output):
            parts[-1][i] += token_cosines(inputs.pop(i), _layer_output(output).detach()).sum()
        return hook

    for i, layer in enumerate(adapter.layers):
        handles.append(layer.register_forward_pre_hook(before(i), with_kwargs=True))
        handles.append(layer.register_forward_hook(after(i)))
    try:
        for batch in batches:
            parts.append(torch.zeros(n, dtype=torch.float64))
            decoder_forward(adapter.model, batch)
            release_freed_memory()
    finally:
        for h in handles:
            h.remove()
    return parts


def block_influence_of(cosine_sum: torch.Tensor, tokens: int) -> torch.Tensor:
    """ShortGPT's Block Influence of each layer: 1 - the mean over tokens of cos(input, output)."""
    return 1.0 - cosine_sum / tokens


@register_metric("block-influence", scores="layers", needs_data=True)
def block_influence(ctx: MetricContext, unit_types: list[str]) -> dict[str, list[torch.Tensor]]:
    """Block Influence (ShortGPT): 1 - the mean cosine between a layer's input and output hidden states, from one
    forward per batch (a layer that changes its input least is removed first).

    Under torchrun each rank runs its share of the batches and every rank adds up every batch's sums in batch
    order: one process's scores, bit for bit."""
    a = ctx.adapter
    parts = ctx.world.map_shares(ctx.batches, lambda mine: cosine_sums(a, mine), "block influence's cosines")
    total = torch.zeros(a.num_layers, dtype=torch.float64)
    for part in parts:  # (in batch order)
        total += part
    tokens = sum(int(b.numel()) for b in ctx.batches)
    bi = block_influence_of(total, tokens)
    return {u: [bi[i : i + 1].float() for i in range(a.num_layers)] for u in unit_types}
