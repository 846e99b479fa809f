from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch

from ...model.arch import ModelAdapter
from ...model.distributed import dealt
from ..evaluate import batch_loss, decoder_forward
from ...model.masking import MaskHooks
from ...model.unit_types import whole_layer_type
from .registry import MetricContext, register_metric


def _gates(n: int, removed: set[int]) -> dict[str, list[torch.Tensor]]:
    return {whole_layer_type().name: [torch.tensor(0.0 if i in removed else 1.0) for i in range(n)]}


def _hidden_states(args: tuple, kwargs: dict) -> torch.Tensor:
    return args[0] if args else kwargs["hidden_states"]


@contextmanager
def _pre_hook(module: torch.nn.Module, fn):
    handle = module.register_forward_pre_hook(fn, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


@torch.no_grad()
def loss_without(adapter: ModelAdapter, batches: list[torch.Tensor], removed: list[int]) -> float:
    """Mean calibration loss with the given layers removed."""
    with MaskHooks(adapter) as hooks:
        hooks.set(_gates(adapter.num_layers, set(removed)))
        return float(torch.cat([batch_loss(adapter.model, b) for b in batches]).double().mean())


@torch.no_grad()
def losses_without_each(adapter: ModelAdapter, batches: list[torch.Tensor], removed: list[int],
                        candidates: list[int], tick=lambda: None) -> dict[int, float]:
    """loss_without(removed + [i]) for every candidate layer i, exactly, at about 0.6 of the cost.

    The layers before i compute the same with or without i, so each batch first runs once (decoder only)
    with `removed` gone and records every candidate's input; candidate i's forward then puts that input
    in at the first layer, with layers 0..i gated off (they pass it through uncomputed): only the layers
    after i, the norm and the lm_head run. `tick()` is called after each candidate forward (progress)."""
    n, model, gone = adapter.num_layers, adapter.model, set(removed)
    losses: dict[int, list[torch.Tensor]] = {i: [] for i in candidates}
    with MaskHooks(adapter) as hooks:
        layers = adapter.layers  # the gates while the hooks are active
        for batch in batches:
            inputs: dict[int, torch.Tensor] = {}
            hooks.set(_gates(n, gone))
            with ExitStack() as recording:
                for i in candidates:
                    recording.enter_context(_pre_hook(
                        layers[i], lambda module, args, kwargs, i=i: inputs.__setitem__(i, _hidden_states(args, kwargs))))
                decoder_forward(model, batch)
            for i in candidates:
                def put_in(module, args, kwargs, h=inputs.pop(i)):
                    if args:
                        return (h, *args[1:]), kwargs
                    return args, {**kwargs, "hidden_states": h}

                hooks.set(_gates(n, gone | set(range(i + 1))))
                with _pre_hook(layers[0], put_in):
                    losses[i].append(batch_loss(model, batch))
                tick()
    return {i: float(torch.cat(x).double().mean()) for i, x in losses.items()}


def shared_losses_without_each(ctx: MetricContext, removed: list[int], candidates: list[int], tick=lambda: None,
                               what: str = "the candidate layers' losses") -> dict[int, float]:
    """losses_without_each on ctx's batches, the candidates dealt out over the ranks (every K-th: an early
    candidate costs more) and every candidate's loss gathered on every rank: one process's dict, bit for bit (a
    candidate's loss is the same computation on any rank). One process: losses_without_each itself."""
    losses = ctx.world.map_shares(
        candidates, lambda mine: list(losses_without_each(ctx.adapter, ctx.batches, removed, mine, tick).values()),
        what, split=dealt)
    return dict(zip(candidates, losses))


@register_metric("layerwise-ppl", scores="layers", needs_data=True)
def layerwise_ppl(ctx: MetricContext, unit_types: list[str]) -> dict[str, list[torch.Tensor]]:
    """Layerwise-PPL (Shortened-LLaMA): the calibration log-perplexity with layer i removed alone
    (a layer whose removal hurts more is more important)."""
    a = ctx.adapter
    with ctx.progress_bar("layerwise-ppl", len(ctx.world.mine(a.num_layers, dealt)) * len(ctx.batches)) as tick:
        loss = shared_losses_without_each(ctx, [], list(range(a.num_layers)), tick, "layerwise-ppl's losses")
    return {u: [torch.tensor([loss[i]]) for i in range(a.num_layers)] for u in unit_types}
