"""Whole decoder layers: one unit per layer, gated as a whole and dropped from the export."""

from __future__ import annotations

from .registry import register_unit_type
from .base import UnitType


@register_unit_type
class Layers(UnitType):
    name = "layers"
    title = "Whole layers"
    whole_layer = True

    def sizes(self, adapter) -> list[int]:
        return [1] * adapter.num_layers

    def unit_params(self, adapter) -> list[int]:
        """Everything in each decoder layer (attention, MLP, norms)."""
        return [sum(p.numel() for p in adapter.layer(i).parameters()) for i in range(adapter.num_layers)]
