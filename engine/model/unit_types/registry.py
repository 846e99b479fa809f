"""The unit types registry: the table and its decorator (the package's __init__ imports the entries).

Entries import their decorator from here, never from the package, so that no entry imports the package that
imports it."""

from __future__ import annotations

from .base import LayerUnitType, UnitType
from ...settings.registry import add_entry

UNIT_TYPES: dict[str, UnitType] = {}  # name -> the unit type, in registration order


def register_unit_type(cls: type[UnitType]) -> type[UnitType]:
    add_entry(UNIT_TYPES, cls.name, cls(), "unit type")
    return cls


def layer_unit_types() -> list[LayerUnitType]:
    """The unit types inside layers (hooked on an output projection), in registration order."""
    return [t for t in UNIT_TYPES.values() if isinstance(t, LayerUnitType)]


def whole_layer_type() -> UnitType:
    return next(t for t in UNIT_TYPES.values() if t.whole_layer)


def unit_sizes(adapter) -> dict[str, list[int]]:
    """Units per layer of every registered unit type, for this model's adapter."""
    return {name: t.sizes(adapter) for name, t in UNIT_TYPES.items()}
