"""MLP channels: one intermediate channel (a gate row, an up row and a down column)."""

from __future__ import annotations

import torch

from .registry import register_unit_type
from .base import LayerUnitType


@register_unit_type
class Channels(LayerUnitType):
    name = "channels"
    title = "MLP channels"
    pruned_config_key = "intermediate_size_per_layer"

    def output_proj(self, adapter, i):
        return adapter.mlp(i).output

    def column_width(self, adapter) -> int:
        return 1

    def to_units(self, adapter, per_column: torch.Tensor) -> torch.Tensor:
        return per_column

    def owned_weights(self, adapter, i):
        m = adapter.mlp(i)
        return [(lin, 0, 1) for lin in m.inputs] + [(m.output, 1, 1)]

    def dense_count(self, config) -> int:
        return config.intermediate_size
