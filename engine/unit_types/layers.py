"""Whole decoder layers: one unit per layer, gated as a whole and dropped from the export."""

from __future__ import annotations

from . import register_unit_type
from .base import UnitType


@register_unit_type
class Layers(UnitType):
    name = "layers"
    title = "Whole layers"
    whole_layer = True

    def sizes(self, adapter) -> list[int]:
        return [1] * adapter.num_layers
