"""The joint method's starting mix: how much of a parameter budget goes to whole layers and how much to the
widths (KV groups, channels) of the layers kept, when `--units layers,kv_groups,channels` share one budget.

Layer metrics (SLEB, Layerwise-PPL) and width metrics (Taylor, Wanda-sp, FLAP) are on different scales, so no
z-score compares a layer with a channel. The scale used instead is the calibration loss itself: every candidate
mix (k = 0, 1, ... up to the most layers the budget can remove), each a one-shot mask from the two metrics (the
k least important layers, the widths of the others cut to what the budget leaves: the same share of each width
type, or with a metric that compares across types, such as FLAP's, one ranking of the kept layers' units), is
run on held-out batches (with the bias compensation when the run has it, and refit when it reconstructs), and the
run starts from the mix that loses least. A candidate costs a forward pass per batch: --mix-search grid scores every
other count and then the neighbours of the best until they are scored, the choice of the full scan (--mix-search
exhaustive) whenever the loss over the counts is unimodal (search_counts), in fewer forwards; grid-stop (the default)
stops the grid, from none up, once its loss has risen twice in a row above the best so far, the same choice on such
losses in fewer forwards still. PG then
learns the mix from there (the projection trades a layer's probability against its widths' through one multiplier,
engine/algo/budget.ParamBudget).

The pure parts are here (the candidate counts, their scores, the search); scoring the candidates on the run's
model is engine/run/mix.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .budget import ranked_split
from .metrics.probability import initial_scores


def layer_counts(layer_params: list[int], removed_target: float) -> list[int]:
    """The candidate numbers of removed layers: every count from none to the most (equal-sized layers: the
    budget's removal over one layer's parameters; never every layer)."""
    most = min(int(removed_target // max(layer_params)), len(layer_params) - 1) if layer_params else 0
    return list(range(most + 1))


def candidate_scores(budget, z: dict[str, torch.Tensor], layout, k: int, keep: float, config,
                     comparable: frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Initial probabilities with k layers removed (the k lowest of the layer metric) and the widths of the
    kept layers keeping what the budget leaves them, on the budget: each width type the same share, or, when
    more than one width type's metric is `comparable`, each type the share one ranking of the kept layers'
    units gives it (FLAP's adaptive structure, budget.ranked_split)."""
    L, n = budget.layer_type, len(budget.layer_params)
    out = {L: initial_scores(z[L], layout, L, "global", (n - k) / n, *config.map_for(L))}
    kept = torch.ones(n, dtype=torch.bool)
    kept[torch.argsort(z[L].double(), stable=True)[:k]] = False
    widths_kept = sum(float(budget.weights[u][kept[budget.width_layer[u]]].sum()) for u in budget.widths)
    keep_w = (budget.kept_target(keep) - float(budget.fixed[kept].sum())) / widths_kept if widths_kept else 1.0
    keeps = {u: min(1.0, max(1e-3, keep_w)) for u in budget.widths}
    if len(comparable & set(budget.widths)) > 1 and widths_kept:
        in_kept = {u: kept[budget.width_layer[u]] for u in budget.widths}
        split = ranked_split({u: z[u][in_kept[u]] for u in budget.widths},
                             {u: budget.weights[u][in_kept[u]] for u in budget.widths}, keep_w * widths_kept)
        keeps = {u: min(1.0, max(1e-3, split[u])) for u in budget.widths}
    out.update({u: initial_scores(z[u], layout, u, "global", keeps[u], *config.map_for(u))
                for u in budget.widths})
    return budget.initial(out, keep)


MIX_FINALISTS = 3  # the mixes the refinement compares again


def coarse_grid(counts: list[int]) -> list[int]:
    """Every other layer count, and the last: a count left out has both its neighbours in."""
    return list(counts[::2]) + ([counts[-1]] if len(counts) % 2 == 0 and counts else [])


@dataclass(frozen=True)
class MixSearch:
    """A --mix-search: the layer counts it scores first, in that order (called on the counts); with `rises`, it stops
    scoring them once the loss has risen that many times in a row, each rise above the level of the counts a run
    keeps (search_counts). Each search then scores the neighbours of its best until they are in."""

    first: Callable[[list[int]], list[int]]
    rises: int | None = None

    def __call__(self, counts: list[int]) -> list[int]:
        return self.first(counts)


# --mix-search. grid-stop's two rises (one would do on a unimodal loss): replayed on the 206 joint mixes recorded in
# bench/results whose scores allow it (2026-12-06), it chooses the grid's count on every one and scores 1.2 counts
# fewer a run with the default's layer order (124 runs); one rise scored 2.4 fewer but chose otherwise on 10
MIX_SEARCHES: dict[str, MixSearch] = {"grid-stop": MixSearch(coarse_grid, rises=2), "grid": MixSearch(coarse_grid),
                                      "exhaustive": MixSearch(list)}


def search_counts(counts: list[int], loss: Callable[[int], float], search: str = "grid", best: int = 1) -> dict[int, float]:
    """{count: loss(count)} for the counts scored, in the order scored: MIX_SEARCHES[search]'s counts first, then, as
    long as one of the `best` lowest losses so far (every count at or below the `best`-th lowest value: ties too)
    has an unscored neighbour in `counts`, those neighbours.

    When the loss over `counts` is unimodal (quasi-convex: loss(j) <= max(loss(i), loss(k)) for i < j < k, plateaus
    allowed), every count the exhaustive scan would rank among its `best` lowest (ties broken by the lower count) is
    scored, so the choice is the scan's: an unscored count x with loss(x) <= V (V: the `best`-th lowest scored value)
    has both neighbours scored (the grid leaves no two neighbours out); between x and a scored count p at or below V
    every loss is <= V, so the scored count at or below V nearest x would have an unscored neighbour: the search
    would not have stopped. On other losses it may choose otherwise (the scan is --mix-search exhaustive).

    A search with `rises` (grid-stop) stops scoring its first counts once the loss has risen that many times in a
    row, each time to a value above the level V of the `best` lowest so far: on a unimodal loss every count after
    a rise from a lower one loses at least as much as the rise's, so none beyond can be among the `best`."""
    scored: dict[int, float] = {}
    plan = MIX_SEARCHES[search]
    rises, previous = 0, None
    for k in plan(list(counts)):
        scored[k] = loss(k)
        level = sorted(scored.values())[min(best, len(scored)) - 1]
        rises = rises + 1 if previous is not None and level < scored[k] > scored[previous] else 0
        previous = k
        if plan.rises is not None and rises >= plan.rises:
            break
    position = {k: i for i, k in enumerate(counts)}
    while scored:
        level = sorted(scored.values())[min(best, len(scored)) - 1]
        near = {counts[j] for k, v in scored.items() if v <= level
                for j in (position[k] - 1, position[k] + 1) if 0 <= j < len(counts)}
        todo = sorted(near - set(scored))
        if not todo:
            break
        for k in todo:
            scored[k] = loss(k)
    return scored


def mix_candidates(n: int, search: str, best: int = 1) -> int:
    """About how many of n layer counts a search scores (the plan's figure): its first counts and, in the usual case,
    the two neighbours of each of the `best` that were not among them (every count at most). A search that stops
    early is planned as if it did not (the plan's upper end)."""
    first = len(MIX_SEARCHES[search](list(range(n))))
    return n if first >= n else min(n, first + 2 * best)


def mix_reward_name(config) -> str:
    """The reward's name the joint mix scores its candidates by (--mix-reward: run, the run's own, or a name)."""
    return config.reward if config.mix_reward == "run" else config.mix_reward
