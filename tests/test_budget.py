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
    sizes = adapter.unit_sizes()
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
    sizes = adapter.unit_sizes()
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
