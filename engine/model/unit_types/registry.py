"""The unit types registry: the table and its decorator (the package's __init__ imports the entries).

Entries import their decorator from here, never from the package, so that no entry imports the package that
imports it."""

from __future__ import annotations

from .base import LayerUnitType, UnitType
from ...settings.registry import add_entry

class UnitTypeTable(dict):
    """name -> the unit type, in registration order; a name a unit type had before (its `aliases`, read in settings
    and in runs saved under it) finds it too, but iterating gives each unit type once, by its name."""

    aliases: dict[str, str]

    def __init__(self):
        super().__init__()
        self.aliases = {}

    def __getitem__(self, name):
        return super().__getitem__(self.aliases.get(name, name))

    def __contains__(self, name) -> bool:
        return super().__contains__(self.aliases.get(name, name))

    def get(self, name, default=None):
        return super().get(self.aliases.get(name, name), default)


UNIT_TYPES: UnitTypeTable = UnitTypeTable()


def register_unit_type(cls: type[UnitType]) -> type[UnitType]:
    add_entry(UNIT_TYPES, cls.name, cls(), "unit type")
    for old in cls.aliases:
        UNIT_TYPES.aliases[old] = cls.name
    return cls


def unit_name(name):
    """A unit type's name for `name`, which may be an alias of it (an older name); anything else as it is."""
    return UNIT_TYPES.aliases.get(name, name) if isinstance(name, str) else name


def renamed_units(data):
    """`data` (a saved run's dicts and lists: a checkpoint, masks.json, a config) with every unit type named by its
    name: dict keys that are aliases, and the strings of `units` and `unit_types` lists."""
    if isinstance(data, dict):
        return {unit_name(k): ([unit_name(u) for u in v] if k in ("units", "unit_types") and isinstance(v, list)
                               else renamed_units(v)) for k, v in data.items()}
    if isinstance(data, list):
        return [renamed_units(v) for v in data]
    return data


def layer_unit_types() -> list[LayerUnitType]:
    """The unit types inside layers (hooked on an output projection), in registration order."""
    return [t for t in UNIT_TYPES.values() if isinstance(t, LayerUnitType)]


def whole_layer_type() -> UnitType:
    return next(t for t in UNIT_TYPES.values() if t.whole_layer)


def unit_sizes(adapter) -> dict[str, list[int]]:
    """Units per layer of every registered unit type, for this model's adapter."""
    return {name: t.sizes(adapter) for name, t in UNIT_TYPES.items()}
