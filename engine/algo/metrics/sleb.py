from __future__ import annotations

import torch

from ...model.distributed import dealt
from ..policy import keep_count
from .registry import MetricContext, register_metric
from .layerwise_ppl import shared_losses_without_each


def first_round_batches(batches: int) -> int:
    """With finalists, the batches every candidate runs on: a quarter of them, at least 1."""
    return max(1, batches // 4)


def shortlists(candidates: int, batches: int, finalists: int) -> bool:
    """Does a round with these counts run finalists? Only with fewer finalists than candidates and more batches
    than the first quarter (else every candidate runs on every batch)."""
    return 0 < finalists < candidates and first_round_batches(batches) < batches


def round_runs(candidates: int, batches: int, finalists: int = 0, mine=lambda m: m) -> int:
    """Model runs of one SLEB removal round: every candidate on every batch, or with `finalists` K (shortlists):
    every candidate on the first quarter of the batches and the K finalists on the rest. mine(m): this rank's
    share of m candidates (one process: m)."""
    if not shortlists(candidates, batches, finalists):
        return mine(candidates) * batches
    first = first_round_batches(batches)
    return mine(candidates) * first + mine(finalists) * (batches - first)


def sleb_runs(layers: int, batches: int, done: int, removals: int, finalists: int = 0, mine=lambda m: m) -> int:
    """Model runs of SLEB's removals done + 1 .. removals on a model of `layers` layers (round_runs each)."""
    return sum(round_runs(layers - k, batches, finalists, mine) for k in range(done, removals))


def round_losses(ctx: MetricContext, removed: list[int], candidates: list[int], tick, what: str) -> dict[int, float]:
    """Each candidate's calibration loss with it and `removed` gone, on every batch; with ctx.finalists K (fewer
    than the candidates) only the K candidates that lose least on the first quarter of the batches are measured on
    the rest, and only theirs are returned (the mean over all batches, each batch weighing its rows)."""
    k, batches = ctx.finalists, ctx.batches
    if not shortlists(len(candidates), len(batches), k):
        return shared_losses_without_each(ctx, removed, candidates, tick, what)
    first = first_round_batches(len(batches))
    head, tail = ctx.with_batches(batches[:first]), ctx.with_batches(batches[first:])
    early = shared_losses_without_each(head, removed, candidates, tick, f"{what}, first {first} batches")
    chosen = sorted(candidates, key=lambda i: (early[i], i))[:k]
    late = shared_losses_without_each(tail, removed, chosen, tick, f"{what}, {k} finalists")
    rows_head, rows_tail = (sum(b.shape[0] for b in part) for part in (head.batches, tail.batches))
    return {i: (early[i] * rows_head + late[i] * rows_tail) / (rows_head + rows_tail) for i in chosen}


@register_metric("sleb", scores="layers", needs_data=True, greedy=True)
def sleb(ctx: MetricContext, unit_types: list[str]) -> dict[str, list[torch.Tensor]]:
    """SLEB: greedy removal, each time of the layer whose absence costs least given those removed.

    Layers are removed one at a time until the keep ratio of them remain (under torchrun each round's candidates
    are dealt out over the ranks). Score: the removal round (0 = removed first); layers never removed score
    highest. The removals in ctx.prefix (the same batches' order from the metric cache) are taken, not repeated.
    With ctx.finalists K each round measures every candidate on the first quarter of the batches and only the K
    best there on all of them (round_losses): fewer model runs, the same removals whenever the round's best is
    among the K.
    """
    a = ctx.adapter
    n = a.num_layers
    to_remove = n - keep_count(ctx.keep_ratio, n)
    removed: list[int] = list(ctx.prefix[:to_remove])
    forwards = sleb_runs(n, len(ctx.batches), len(removed), to_remove, ctx.finalists,
                         lambda m: len(ctx.world.mine(m, dealt)))  # (this rank's)
    with ctx.progress_bar("sleb", forwards) as tick:
        for k in range(len(removed), to_remove):  # (every rank gets every candidate's loss, so takes the same layer)
            losses = round_losses(ctx, removed, [i for i in range(n) if i not in removed], tick,
                                  f"sleb's losses (removal {k + 1}/{to_remove})")
            removed.append(min(losses, key=lambda i: (losses[i], i)))
            if ctx.on_removal:
                ctx.on_removal(list(removed))
    score = {i: float(k) for k, i in enumerate(removed)}
    return {u: [torch.tensor([score.get(i, float(to_remove))]) for i in range(n)] for u in unit_types}
