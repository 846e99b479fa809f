"""Unit types: one file per kind of prunable unit, one `@register_unit_type` entry each.

Masking (MaskHooks), the activation metrics and the export loop over UNIT_TYPES, so a new kind of
unit (say, single query heads inside a KV group) is one file here.
"""

from __future__ import annotations

from .base import LayerUnitType, UnitType

UNIT_TYPES: dict[str, UnitType] = {}  # name -> the unit type, in registration order


def register_unit_type(cls: type[UnitType]) -> type[UnitType]:
    if cls.name in UNIT_TYPES:
        raise ValueError(f"unit type {cls.name!r} is already registered")
    UNIT_TYPES[cls.name] = cls()
    return cls


def layer_unit_types() -> list[LayerUnitType]:
    """The unit types inside layers (hooked on an output projection), in registration order."""
    return [t for t in UNIT_TYPES.values() if isinstance(t, LayerUnitType)]


def whole_layer_type() -> UnitType:
    return next(t for t in UNIT_TYPES.values() if t.whole_layer)


from . import kv_groups, channels, layers  # noqa: E402,F401  (register in this order)

__all__ = ["LayerUnitType", "UNIT_TYPES", "UnitType", "layer_unit_types", "register_unit_type", "whole_layer_type"]
