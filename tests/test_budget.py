"""Parameter accounting (issue 27): what each unit weighs, and what masks remove, layers nested over widths.
Checked against the sliced export's own parameter count on tiny random LLaMA (biases, tied), Mistral, Qwen2
(q/k/v biases) and Qwen3 (q/k norms) models."""

from __future__ import annotations

import pytest
import torch

from engine.arch import ModelAdapter
from engine.budget import decoder_params, removal_report, removed_parameters, unit_weights
from engine.export import build_pruned_model
from engine.loading import count_parameters
from engine.units import UnitLayout

from test_adapters_export import ARCHS, build_model
from engine.unit_types import unit_sizes

UNIT_SETS = [("heads",), ("channels",), ("layers",), ("heads", "channels"), ("heads", "channels", "layers"),
             ("channels", "layers")]


def masks_for(layout: UnitLayout, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {u: layout.hard_mask(u, torch.rand(layout.total(u), generator=g), "global", 0.6) for u in layout.unit_types}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("units", UNIT_SETS)
def test_removed_parameters_equal_the_exports(arch, units):
    model = build_model(arch)
    adapter = ModelAdapter.for_model(model)
    sizes = unit_sizes(adapter)
    layout = UnitLayout({u: sizes[u] for u in units})
    dense = count_parameters(model)
    for seed in range(3):
        masks = masks_for(layout, seed)
        report = removal_report(adapter, layout, masks, dense)
        pruned = count_parameters(build_pruned_model(model, layout, masks))
        assert report["params_removed"] == dense - pruned, (seed, report)
        assert sum(report["params_removed_by_unit_type"].values()) == report["params_removed"]
        assert report["removed_of_model"] == pytest.approx((dense - pruned) / dense)


def test_a_removed_layers_width_counts_once():
    model = build_model("llama")
    adapter = ModelAdapter.for_model(model)
    sizes = unit_sizes(adapter)
    layout = UnitLayout({u: sizes[u] for u in ("heads", "channels", "layers")})
    weights = unit_weights(adapter, layout)
    masks = {u: torch.ones(layout.total(u)) for u in layout.unit_types}
    masks["layers"][1] = 0
    masks["heads"][:] = 0  # every KV group marked removed, those of layer 1 included
    by_type = removed_parameters(layout, weights, masks)
    per_layer_heads = weights["heads"][: sizes["heads"][0]].sum()
    assert by_type["heads"] == int(per_layer_heads) * (adapter.num_layers - 1)  # layer 1's are the layer's
    assert by_type["layers"] == sum(p.numel() for p in adapter.layer(1).parameters())
    assert by_type["channels"] == 0
    assert decoder_params(adapter) == sum(p.numel() for i in range(adapter.num_layers) for p in adapter.layer(i).parameters())


# --- the parameter budget ----------------------------------------------------------------------------------------
def param_budget(arch: str, units: tuple[str, ...], scope: str):
    from engine.budget import ParamBudget

    model = build_model(arch)
    adapter = ModelAdapter.for_model(model)
    sizes = unit_sizes(adapter)
    layout = UnitLayout({u: sizes[u] for u in units})
    return ParamBudget(layout, scope, adapter), adapter, layout


def kept_params(budget, masks_or_scores) -> float:
    return sum(float((budget.weights[u] * m.double()).sum()) for u, m in masks_or_scores.items())


@pytest.mark.parametrize("scope", ["global", "uniform"])
@pytest.mark.parametrize("units", [("heads",), ("channels",), ("heads", "channels"), ("layers",)])
def test_param_budget_projection_and_hard_mask(units, scope):
    budget, adapter, layout = param_budget("llama", units, scope)
    g = torch.Generator().manual_seed(0)
    heaviest = max(float(w.max()) for w in budget.weights.values())
    from engine.errors import UserError

    tried = 0
    for keep in (0.5, 0.7, 0.8, 0.9):
        try:
            targets = [budget._kept_target(pool, decoder, keep) for pool, decoder in budget.pools]
        except UserError:  # these unit types hold less than that share of the decoder
            continue
        tried += 1
        for _ in range(3):
            z = {u: torch.rand(layout.total(u), generator=g) * 1.6 - 0.3 for u in units}
            s = budget.project(z, keep)
            # the expected kept parameters stay at the budget (every pool: over it before the projection)
            for (pool, _), target in zip(budget.pools, targets):
                got = sum(float((budget.weights[u][sl] * s[u][sl].double()).sum()) for u, sl in pool.items())
                before = sum(float((budget.weights[u][sl] * z[u][sl].clamp(0, 1).double()).sum()) for u, sl in pool.items())
                if before > target:  # over the budget: projected onto it
                    assert got == pytest.approx(target, rel=1e-6)
                else:  # within it: only clamped
                    assert all(torch.equal(s[u][sl], z[u][sl].clamp(0, 1)) for u, sl in pool.items())
            masks = budget.hard_masks(s, keep)
            for (pool, _), target in zip(budget.pools, targets):
                got = sum(float((budget.weights[u][sl] * masks[u][sl].double()).sum()) for u, sl in pool.items())
                floor = sum(float(w.min()) for u, sl in pool.items() if u != "layers"
                            for w in layout.split(u, budget.weights[u][sl]) if len(w))  # one unit per layer and type
                assert got <= max(target, floor) + 1e-6  # never over the budget, unless one unit per layer is
                assert got > target - heaviest  # and short of it by less than one unit's weight
            for u in units:
                if u != "layers":
                    assert all(float(m.sum()) >= 1 for m in layout.split(u, masks[u]))  # every layer keeps one
    assert tried >= 1


def test_uniform_and_global_remove_the_same_parameters():
    """At the same ratio, a uniform run removes what a global one does, to within one lightest unit per layer
    (each layer's pool lands below its own target by less than that)."""
    g_budget, adapter, layout = param_budget("llama", ("heads", "channels"), "global")
    u_budget, _, _ = param_budget("llama", ("heads", "channels"), "uniform")
    gen = torch.Generator().manual_seed(1)
    lightest = min(float(w.min()) for w in g_budget.weights.values())
    for keep in (0.6, 0.7, 0.8):
        z = {u: torch.rand(layout.total(u), generator=gen) for u in layout.unit_types}
        a = kept_params(g_budget, g_budget.hard_masks(g_budget.project(z, keep), keep))
        b = kept_params(u_budget, u_budget.hard_masks(u_budget.project(z, keep), keep))
        assert abs(a - b) <= adapter.num_layers * lightest + 1e-6, (keep, a, b)


def test_param_budget_refuses_layers_with_widths_and_impossible_ratios():
    from engine.errors import UserError

    with pytest.raises(UserError, match="not supported yet"):
        param_budget("llama", ("heads", "layers"), "global")
    budget, _, layout = param_budget("llama", ("heads",), "global")
    with pytest.raises(UserError, match="lower --prune-ratio"):
        budget.project({"heads": torch.ones(layout.total("heads"))}, 0.2)


def test_configs_without_a_budget_count_units(tmp_path):
    """Every run from before --budget counted units: its config.json loads (and resumes) as --budget units."""
    import json

    from engine.config import PruneConfig

    data = PruneConfig().to_dict()
    del data["budget"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert PruneConfig.load(tmp_path / "config.json").budget == "units"
