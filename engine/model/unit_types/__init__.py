"""Unit types: one file per kind of prunable unit, one `@register_unit_type` entry each.

Masking (MaskHooks), the activation metrics and the export loop over UNIT_TYPES, so a new kind of
unit (say, single query heads inside a KV group) is one file here.

    kv_groups   one KV head and the query heads that share it (named "heads" before: still read so)
    channels    one MLP intermediate channel
    layers      a whole decoder layer

base.py holds the UnitType interface, registry.py the table and its decorator.
"""

from __future__ import annotations

from .registry import (layer_unit_types, LayerUnitType, register_unit_type, renamed_units, unit_name,  # noqa: F401
                       UNIT_TYPES, unit_sizes, UnitType, whole_layer_type)
from . import kv_groups, channels, layers  # noqa: E402,F401  (register in this order)

__all__ = ["LayerUnitType", "UNIT_TYPES", "UnitType", "layer_unit_types", "register_unit_type", "renamed_units",
           "unit_name", "unit_sizes", "whole_layer_type"]
