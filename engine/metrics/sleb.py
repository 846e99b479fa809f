from __future__ import annotations

import torch

from ..distributed import dealt
from ..policy import keep_count
from .registry import MetricContext, register_metric
from .layerwise_ppl import shared_losses_without_each


@register_metric("sleb", scores="layers", needs_data=True, greedy=True)
def sleb(ctx: MetricContext, unit_types: list[str]) -> dict[str, list[torch.Tensor]]:
    """SLEB: greedy removal, each time of the layer whose absence costs least given those removed.

    Layers are removed one at a time until the keep ratio of them remain (under torchrun each round's candidates
    are dealt out over the ranks). Score: the removal round (0 = removed first); layers never removed score
    highest. The removals in ctx.prefix (the same batches' order from the metric cache) are taken, not repeated.
    """
    a = ctx.adapter
    n = a.num_layers
    to_remove = n - keep_count(ctx.keep_ratio, n)
    removed: list[int] = list(ctx.prefix[:to_remove])
    forwards = sum(len(ctx.world.mine(n - k, dealt)) for k in range(len(removed), to_remove)) * len(ctx.batches)
    with ctx.progress_bar("sleb", forwards) as tick:  # (this rank's forwards)
        for k in range(len(removed), to_remove):  # (every rank gets every candidate's loss, so takes the same layer)
            losses = shared_losses_without_each(ctx, removed, [i for i in range(n) if i not in removed], tick,
                                                f"sleb's losses (removal {k + 1}/{to_remove})")
            removed.append(min(losses, key=losses.get))
            if ctx.on_removal:
                ctx.on_removal(list(removed))
    score = {i: float(k) for k, i in enumerate(removed)}
    return {u: [torch.tensor([score.get(i, float(to_remove))]) for i in range(n)] for u in unit_types}
