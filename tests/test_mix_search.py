"""The joint mix's search over layer counts (issue 51, --mix-search): the grid search scores every other count and
then the neighbours of the best until both are scored; on a unimodal loss (plateaus included) it chooses what the
exhaustive scan chooses, in fewer evaluations. Checked on synthetic losses against the scan itself."""

from __future__ import annotations

import random

import pytest
import torch

from engine.settings.config import PruneConfig
from engine.algo.joint import MIX_SEARCHES, coarse_grid, mix_candidates, search_counts
from engine.run.mix import choose_mix


def counted(values: list[float]):
    """A loss over counts 0..n-1 that records every call."""
    calls: list[int] = []

    def loss(k: int) -> float:
        calls.append(k)
        return values[k]

    return loss, calls


def ranked(scored: dict[int, float], best: int) -> list[int]:
    """The `best` lowest counts, ties to the lower count (choose_mix's order)."""
    return sorted(scored, key=lambda k: (scored[k], k))[:best]


def unimodal(rng: random.Random, n: int) -> list[float]:
    """A random quasi-convex loss over n counts: non-increasing to a valley, non-decreasing after, with plateaus
    (steps of 0), a flat bottom sometimes, and integer values so that ties are exact."""
    valley = rng.randrange(n)
    values, v = [0.0] * n, 0.0
    for k in range(valley - 1, -1, -1):
        v += rng.choice([0, 0, 1, 2, 5])
        values[k] = v
    v = 0.0
    for k in range(valley + 1, n):
        v += rng.choice([0, 0, 1, 3])
        values[k] = v
    return [x + 100 for x in values]


def side_by_side(seed: int, best: int, search: str, against: str) -> list[tuple[int, list[int], list[int]]]:
    """`search` against `against` on 500 random unimodal losses over 1-16 counts: the same `best` lowest counts
    (so the same choice, and the same finalists for --mix-refine-batches), each count scored at most once, and
    the scored values the loss's; returns each loss's (count n, the counts `against` scored, those `search` did)."""
    rng, totals = random.Random(seed), []
    for _ in range(500):
        n = rng.randint(1, 16)
        values = unimodal(rng, n)
        ref_loss, ref_calls = counted(values)
        ref = search_counts(list(range(n)), ref_loss, against, best)
        loss, calls = counted(values)
        got = search_counts(list(range(n)), loss, search, best)
        assert ranked(got, best) == ranked(ref, best), values
        assert len(calls) == len(set(calls)) and all(got[k] == values[k] for k in got)
        totals.append((n, ref_calls, calls))
    return totals


def test_the_grid_leaves_no_two_neighbouring_counts_out():
    for n in range(1, 12):
        counts = list(range(n))
        grid = coarse_grid(counts)
        assert grid[0] == 0 and grid[-1] == n - 1 and grid == sorted(set(grid))
        assert all(k in grid or (k - 1 in grid and k + 1 in grid) for k in counts)
    assert MIX_SEARCHES["exhaustive"]([0, 1, 2]) == [0, 1, 2]


@pytest.mark.parametrize("best", [1, 3])
def test_the_search_chooses_what_the_scan_chooses_on_unimodal_losses_in_fewer_evaluations(best):
    """500 random unimodal losses over 1-16 counts: the grid chooses what the scan chooses (side_by_side), the scan
    scores every count, and the grid never more evaluations than the scan and fewer in all."""
    totals = [(n, len(scan), len(grid)) for n, scan, grid in side_by_side(0, best, "grid", "exhaustive")
              if scan == list(range(n))]
    assert len(totals) == 500  # (the scan scored every count, in order, once)
    assert sum(g for _, _, g in totals) < sum(s for _, s, _ in totals) and all(g <= s for _, s, g in totals)


def test_on_a_strictly_unimodal_loss_the_search_scores_at_most_the_grid_and_two_more_counts():
    """Distinct values (no plateau): after the grid, the best's two neighbours at most; from 7 counts on that is
    fewer than the scan's."""
    rng = random.Random(1)
    for _ in range(300):
        n = rng.randint(1, 20)
        valley = rng.randrange(n)
        values = [abs(k - valley) * (1.0 + rng.random()) + (0.0 if k == valley else rng.random()) for k in range(n)]
        values = [v + i * 1e-9 for i, v in enumerate(values)]  # (distinct)
        loss, calls = counted(values)
        scored = search_counts(list(range(n)), loss, "grid")
        assert ranked(scored, 1) == [min(range(n), key=lambda k: values[k])]
        assert len(calls) <= len(coarse_grid(list(range(n)))) + 2
        if n >= 7:
            assert len(calls) < n


def test_a_plateau_between_the_grid_points_and_the_valley_is_followed():
    """The grid's best (2) sits on a plateau whose end, between two grid points, falls to the minimum (5): every
    count at the lowest loss seen has its neighbours scored, so the search walks the plateau to it."""
    values = [3.0, 2.0, 2.0, 2.0, 2.0, 1.0, 2.0]
    loss, calls = counted(values)
    scored = search_counts(list(range(7)), loss, "grid")
    assert ranked(scored, 1) == [5] and calls[:4] == [0, 2, 4, 6]
    flat = [5.0, 4.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0]  # a flat bottom: the scan's tie-break, the fewest layers out
    loss, calls = counted(flat)
    assert ranked(search_counts(list(range(9)), loss, "grid"), 1) == [2]


def test_the_search_on_a_strictly_unimodal_loss_scores_the_grid_and_two_more():
    values = [(k - 7.4) ** 2 for k in range(15)]  # the valley at 7, between grid points 6 and 8 (8 the lower)
    loss, calls = counted(values)
    assert ranked(search_counts(list(range(15)), loss, "grid"), 1) == [7]
    assert len(calls) == len(coarse_grid(list(range(15)))) + 2 == 10  # (8's neighbours, 7 and 9)
    assert mix_candidates(15, "grid") == 10 and mix_candidates(15, "exhaustive") == 15
    assert mix_candidates(3, "grid") == 3


def joint_run(layers: int, keep: float, search: str):
    """A joint run's parts that choose_mix reads, on a tiny random LLaMA of `layers` layers (its loss given)."""
    from types import SimpleNamespace

    from engine.model.arch import ModelAdapter
    from engine.algo.budget import ParamBudget
    from engine.model.unit_types import unit_sizes
    from engine.model.units import UnitLayout

    from test_block_influence import tiny_random

    units = ["layers", "kv_groups", "channels"]
    adapter = ModelAdapter.for_model(tiny_random("llama", layers))
    sizes = unit_sizes(adapter)
    layout = UnitLayout({u: sizes[u] for u in units})
    budget = ParamBudget(layout, "global", adapter)
    config = PruneConfig(units=units, prune_ratio=1 - keep, budget="params", mix_search=search)
    logs: list[str] = []
    run = SimpleNamespace(config=config, budget=budget, layout=layout, log=logs.append,
                          masks=SimpleNamespace(hard_masks=lambda scores, k=keep: budget.hard_masks(scores, k)))
    g = torch.Generator().manual_seed(0)
    z = {u: torch.randn(layout.total(u), generator=g) for u in units}
    return run, z, logs


def test_the_joint_mix_chooses_the_scan_s_mix_from_fewer_counts_and_says_how_many():
    """choose_mix on 9 layers at 30 % kept (0..6 layers out), a unimodal loss lowest at 4 out: --mix-search grid
    chooses the exhaustive scan's mix (the same scores) from 6 of the 7 counts, and its log line says so."""
    chosen = {}
    for search in ("exhaustive", "grid"):
        run, z, logs = joint_run(9, 0.3, search)
        seen = []

        def loss(masks, batch):
            k = int((masks["layers"] <= 0.5).sum())
            seen.append(k)
            return (k - 4.2) ** 2

        scores, lines = choose_mix(run, z, [torch.tensor(0.0)], 0.3, loss=loss)
        chosen[search] = scores
        assert [line["layers_removed"] for line in lines] == sorted(set(seen))  # one line per count scored
        assert logs[-1].startswith(f"joint mix: {len(lines)} of 7 layer counts scored (--mix-search {search})")
        assert len(lines) == {"exhaustive": 7, "grid": 6}[search]
    assert all(torch.equal(chosen["grid"][u], chosen["exhaustive"][u]) for u in chosen["grid"])
    assert int((joint_run(9, 0.3, "grid")[0].budget.hard_masks(chosen["grid"], 0.3)["layers"] <= 0.5).sum()) == 4


@pytest.mark.parametrize("best", [1, 3])
def test_grid_stop_chooses_what_the_grid_chooses_on_unimodal_losses_and_scores_no_more(best):
    """grid-stop (the default): on 500 random unimodal losses the same `best` lowest counts as the grid
    (side_by_side), never more evaluations than the grid, fewer in all; a valley at the first counts leaves the
    grid's tail out."""
    totals = [(len(grid), len(stop)) for _, grid, stop in side_by_side(2, best, "grid-stop", "grid")]
    assert all(stop <= grid for grid, stop in totals) and sum(grid - stop for grid, stop in totals) > 0
    values = [3.0, 2.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0]  # the valley at 2: the grid's 4 and 6 rise
    loss, calls = counted(values)
    assert ranked(search_counts(list(range(11)), loss, "grid-stop"), 1) == [2]
    assert calls == [0, 2, 4, 6, 1, 3]  # (8 and 10 never scored)


def test_grid_stop_needs_two_rises_in_a_row_above_the_best():
    """One rise and a fall again (a bump) does not stop it: a second valley after a single bump is still found."""
    values = [5.0, 4.0, 3.0, 4.0, 3.5, 3.0, 1.0, 2.0, 3.0]  # grid 0, 2, 4, 6, 8: 4 rises from 2, 6 falls: no stop
    loss, calls = counted(values)
    assert ranked(search_counts(list(range(9)), loss, "grid-stop"), 1) == [6]
    assert MIX_SEARCHES["grid-stop"].rises == 2 and MIX_SEARCHES["grid"].rises is None
