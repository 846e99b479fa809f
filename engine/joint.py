"""The joint method's starting mix: how much of a parameter budget goes to whole layers and how much to the
widths (KV groups, channels) of the layers kept, when `--units layers,heads,channels` share one budget.

Layer metrics (SLEB, Layerwise-PPL) and width metrics (Taylor, Wanda-sp) are on different scales, so no z-score
compares a layer with a channel. The scale used instead is the calibration loss itself: a few candidate mixes
(0, 1/4, 1/2, 3/4 and all of the removable layers' share), each a one-shot mask from the two metrics (the k
least important layers, the widths of the others cut to what the budget leaves), are run on held-out batches,
and the run starts from the mix that loses least. PG then learns the mix from there (the projection trades a
layer's probability against its widths' through one multiplier, engine/budget.ParamBudget)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from .metrics.probability import initial_scores

if TYPE_CHECKING:  # annotations only
    from .pruner import PruneRun

FRACTIONS = (0.0, 0.25, 0.5, 0.75, 1.0)  # of the most layers the budget can remove


def layer_counts(layer_params: list[int], removed_target: float, fractions=FRACTIONS) -> list[int]:
    """The candidate numbers of removed layers: fractions of the most (equal-sized layers: the budget's
    removal over one layer's parameters; never every layer)."""
    most = min(int(removed_target // max(layer_params)), len(layer_params) - 1) if layer_params else 0
    return sorted({int(round(f * most)) for f in fractions})


def candidate_scores(budget, z: dict[str, torch.Tensor], layout, k: int, keep: float, config) -> dict[str, torch.Tensor]:
    """Initial probabilities with k layers removed (the k lowest of the layer metric) and the widths of the
    kept layers keeping what the budget leaves them, on the budget."""
    L, n = budget.layer_type, len(budget.layer_params)
    c = config.score_const
    out = {L: initial_scores(z[L], layout, L, "global", (n - k) / n, config.prob_map_for(L), c)}
    kept = torch.ones(n, dtype=torch.bool)
    kept[torch.argsort(z[L].double(), stable=True)[:k]] = False
    widths_kept = sum(float(budget.weights[u][kept[budget.width_layer[u]]].sum()) for u in budget.widths)
    keep_w = (budget.kept_target(keep) - float(budget.fixed[kept].sum())) / widths_kept if widths_kept else 1.0
    keep_w = min(1.0, max(1e-3, keep_w))
    out.update({u: initial_scores(z[u], layout, u, "global", keep_w, config.prob_map_for(u), c) for u in budget.widths})
    return budget.initial(out, keep)


def choose_mix(run: "PruneRun", z: dict[str, torch.Tensor], batches: list[torch.Tensor], keep: float,
               loss: Callable[[dict[str, torch.Tensor], torch.Tensor], float] | None = None) -> tuple[dict[str, torch.Tensor], list[dict]]:
    """(the initial scores of the mix whose hard mask loses least on `batches`, one line per candidate)."""
    c, budget = run.config, run.budget
    if loss is None:
        def loss(masks, batch):
            return float(run.ctx.losses({u: m[None] for u, m in masks.items()}, batch)[0])
    best, lines = None, []
    for k in layer_counts(budget.layer_params, budget.decoder - budget.kept_target(keep)):
        scores = candidate_scores(budget, z, run.layout, k, keep, c)
        masks = run.hard_masks(scores, keep)
        value = sum(loss(masks, b) for b in batches) / len(batches)
        removed = int((masks[budget.layer_type] <= 0.5).sum())
        lines.append({"layers_removed": removed, "loss": value})
        run.log(f"joint mix: {removed} layers removed, the widths of the others cut to the budget: calibration loss {value:.4f}")
        if best is None or value < best[0]:
            best = (value, scores)
    return best[1], lines
