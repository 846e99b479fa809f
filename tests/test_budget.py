"""Parameter accounting (issue 27): what each unit weighs, and what masks remove, layers nested over widths.
Checked against the sliced export's own parameter count on tiny random LLaMA (biases, tied), Mistral, Qwen2
(q/k/v biases) and Qwen3 (q/k norms) models."""

from __future__ import annotations

import pytest
import torch

from engine.model.arch import ModelAdapter
from engine.algo.budget import decoder_params, removal_report, removed_parameters, unit_weights
from engine.export.artifacts import build_pruned_model
from engine.model.loading import count_parameters
from engine.model.units import UnitLayout

from test_adapters_export import ARCHS, build_model
from engine.model.unit_types import unit_sizes

UNIT_SETS = [("kv_groups",), ("channels",), ("layers",), ("kv_groups", "channels"), ("kv_groups", "channels", "layers"),
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
    layout = UnitLayout({u: sizes[u] for u in ("kv_groups", "channels", "layers")})
    weights = unit_weights(adapter, layout)
    masks = {u: torch.ones(layout.total(u)) for u in layout.unit_types}
    masks["layers"][1] = 0
    masks["kv_groups"][:] = 0  # every KV group marked removed, those of layer 1 included
    by_type = removed_parameters(layout, weights, masks)
    per_layer_heads = weights["kv_groups"][: sizes["kv_groups"][0]].sum()
    assert by_type["kv_groups"] == int(per_layer_heads) * (adapter.num_layers - 1)  # layer 1's are the layer's
    assert by_type["layers"] == sum(p.numel() for p in adapter.layer(1).parameters())
    assert by_type["channels"] == 0
    assert decoder_params(adapter) == sum(p.numel() for i in range(adapter.num_layers) for p in adapter.layer(i).parameters())


# --- the parameter budget ----------------------------------------------------------------------------------------
def param_budget(arch: str, units: tuple[str, ...], scope: str):
    from engine.algo.budget import ParamBudget

    model = build_model(arch)
    adapter = ModelAdapter.for_model(model)
    sizes = unit_sizes(adapter)
    layout = UnitLayout({u: sizes[u] for u in units})
    return ParamBudget(layout, scope, adapter), adapter, layout


def one_unit(budget, units) -> float:
    """The weight of the heaviest unit the hard mask fills with (a layer only when layers are pruned alone)."""
    return max(float(budget.weights[u].max()) for u in units if u != "layers" or len(units) == 1)


COMBOS = [("kv_groups",), ("channels",), ("kv_groups", "channels"), ("layers",), ("kv_groups", "channels", "layers"),
          ("channels", "layers"), ("kv_groups", "layers")]


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("scope", ["global", "uniform"])
@pytest.mark.parametrize("units", COMBOS)
def test_param_budget_projection_and_hard_mask(units, scope, arch):
    """The projection keeps E[kept parameters] at the budget (on it when the scores were over it), and the hard
    mask lands within one unit's weight below it, for every unit-type combination (layers nested over widths
    included) under global and uniform scope."""
    from engine.settings.config import PruneConfig
    from engine.errors import UserError

    if "layers" in units and len(units) > 1 and scope == "uniform":
        with pytest.raises(UserError, match="--scope global"):
            param_budget(arch, units, scope)
        with pytest.raises(UserError, match="--scope global"):  # and the config says so before a model is loaded
            PruneConfig(units=list(units), scope=scope, budget="params").validate()
        return
    PruneConfig(units=list(units), scope=scope, budget="params").validate()
    budget, adapter, layout = param_budget(arch, units, scope)
    g = torch.Generator().manual_seed(0)
    tried = 0
    for keep in (0.5, 0.7, 0.8, 0.9):
        try:
            target = budget.kept_target(keep)
            if scope == "uniform" and "layers" not in units:
                [budget._layer_target(i, keep) for i in range(adapter.num_layers)]
        except UserError:  # these unit types hold less than that share of the decoder
            continue
        tried += 1
        for shift in (0.0, 0.5):  # under, then over the budget
            z = {u: torch.rand(layout.total(u), generator=g) * 1.6 - 0.3 + shift for u in units}
            s = budget.project(z, keep)
            before = budget.expected_kept({u: v.clamp(0, 1) for u, v in z.items()})
            got = budget.expected_kept(s)
            assert all(float(v.min()) >= 0 and float(v.max()) <= 1 for v in s.values())
            assert got <= target * (1 + 1e-6)
            if before > target and (scope == "global" or "layers" in units):  # over it: projected onto it
                assert got == pytest.approx(target, rel=1e-6)
            masks = budget.hard_masks(s, keep)
            kept = budget.kept_params(masks)
            floor = sum(float(budget.fixed.sum()) for _ in [0]) + sum(
                float(w.min()) for u in units if u != "layers" for w in layout.split(u, budget.weights[u]))
            assert kept <= max(target, floor) + 1e-6  # never over the budget, unless one unit per layer is
            slack = one_unit(budget, units) * (adapter.num_layers if scope == "uniform" else 1)
            assert kept > target - slack - 1e-6, (kept, target, slack)  # short of it by less than one unit
            for u in units:
                if u != "layers":  # every kept layer keeps one unit of each width type
                    assert all(float(m.sum()) >= 1 for m in layout.split(u, masks[u]))
    assert tried >= 1


def test_nested_budget_holds_at_every_step_of_a_run():
    """Layers over widths: the expected kept parameters, sum_l p_l (c_l + sum w s), stay at the budget after
    every step of a noisy descent (the exact expectation, not a per-type approximation)."""
    budget, adapter, layout = param_budget("llama", ("layers", "kv_groups", "channels"), "global")
    g = torch.Generator().manual_seed(3)
    for keep in (0.6, 0.75):
        target = budget.kept_target(keep)
        s, over = budget.project({u: torch.full((layout.total(u),), 0.9) for u in layout.unit_types}, keep), 0
        for step in range(25):
            z = {u: v - 0.05 * torch.randn(v.shape, generator=g) + 0.02 for u, v in s.items()}  # a noisy step
            before = budget.expected_kept({u: v.clamp(0, 1) for u, v in z.items()})
            s = budget.project(z, keep)
            p = s["layers"].double()
            exact = float(sum(p[i] * (budget.fixed[i] + sum(float((budget.weights[u] * s[u].double())[sl].sum())
                                                                 for u in ("kv_groups", "channels")
                                                                 for sl in [layout.layer_slices(u)[i]]))
                                  for i in range(adapter.num_layers)))
            assert exact == pytest.approx(budget.expected_kept(s), rel=1e-9)
            assert exact <= target * (1 + 1e-6), step
            if before > target:  # pushed over the budget: projected back onto it
                assert exact == pytest.approx(target, rel=1e-6), step
                over += 1
        assert over >= 5  # the check ran


def test_nested_projection_is_the_plain_one_when_layers_are_sure():
    """With every layer at 1 the nested projection is the weighted projection of the widths alone."""
    from engine.algo.policy import project_weighted_capped_simplex

    budget, adapter, layout = param_budget("llama", ("layers", "kv_groups", "channels"), "global")
    g = torch.Generator().manual_seed(4)
    z = {u: torch.rand(layout.total(u), generator=g) + 0.3 for u in layout.unit_types}
    z["layers"] = torch.full((adapter.num_layers,), 5.0)  # far above 1: stays kept
    s = budget.project(z, 0.7)
    flat = project_weighted_capped_simplex(torch.cat([z["kv_groups"], z["channels"]]).double(),
                                           torch.cat([budget.weights["kv_groups"], budget.weights["channels"]]),
                                           budget.kept_target(0.7) - float(budget.fixed.sum()))
    assert torch.allclose(torch.cat([s["kv_groups"], s["channels"]]).double(), flat, atol=1e-5)
    assert torch.equal(s["layers"], torch.ones(adapter.num_layers))


def test_nested_hard_mask_removes_unlikely_layers_and_fills_with_width():
    budget, adapter, layout = param_budget("llama", ("layers", "kv_groups", "channels"), "global")
    s = {u: torch.full((layout.total(u),), 0.9) for u in ("kv_groups", "channels")}
    s["layers"] = torch.ones(adapter.num_layers)
    s["layers"][1] = 0.2  # layer 1 is unlikely: removed whole; the others' width makes up the rest
    keep = 0.6
    masks = budget.hard_masks(s, keep)
    assert masks["layers"].tolist() == [1.0 if i != 1 else 0.0 for i in range(adapter.num_layers)]
    kept = budget.kept_params(masks)
    assert budget.kept_target(keep) - one_unit(budget, ("kv_groups", "channels")) < kept <= budget.kept_target(keep)


def test_uniform_and_global_remove_the_same_parameters():
    """At the same ratio, a uniform run removes what a global one does, to within one unit (each layer's pool
    lands below its own target by less than one of its channels: together less than a KV group here)."""
    g_budget, adapter, layout = param_budget("llama", ("kv_groups", "channels"), "global")
    u_budget, _, _ = param_budget("llama", ("kv_groups", "channels"), "uniform")
    gen = torch.Generator().manual_seed(1)
    heaviest = max(float(w.max()) for w in g_budget.weights.values())
    for keep in (0.6, 0.7, 0.8):
        z = {u: torch.rand(layout.total(u), generator=gen) for u in layout.unit_types}
        a = g_budget.kept_params(g_budget.hard_masks(g_budget.project(z, keep), keep))
        b = u_budget.kept_params(u_budget.hard_masks(u_budget.project(z, keep), keep))
        assert abs(a - b) <= heaviest, (keep, a, b)


def test_param_budget_refuses_impossible_ratios():
    from engine.errors import UserError

    budget, _, layout = param_budget("llama", ("kv_groups",), "global")
    with pytest.raises(UserError, match="lower --prune-ratio"):
        budget.project({"kv_groups": torch.ones(layout.total("kv_groups"))}, 0.2)


def test_configs_without_a_budget_count_units(tmp_path):
    """Every run from before --budget counted units: its config.json loads (and resumes) as --budget units."""
    import json

    from engine.settings.config import PruneConfig

    data = PruneConfig().to_dict()
    del data["budget"]
    (tmp_path / "config.json").write_text(json.dumps(data))
    assert PruneConfig.load(tmp_path / "config.json").budget == "units"
