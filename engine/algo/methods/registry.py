"""The methods registry: the table and its decorator (the package's __init__ imports the entries).

Entries import their decorator from here, never from the package, so that no entry imports the package that
imports it."""

from __future__ import annotations

import dataclasses

from ...errors import UserError
from .base import Method
from ...settings.registry import add_entry

METHODS: dict[str, type[Method]] = {}


def register_method(name: str):
    def add(cls: type[Method]) -> type[Method]:
        add_entry(METHODS, name, cls, "method")
        cls.name = name
        return cls

    return add


def option_fields(name: str) -> tuple[dataclasses.Field, ...]:
    """The fields of method `name`'s Options dataclass: none for a method without options or an unknown name (a
    config or form that names a method no longer registered)."""
    cls = METHODS[name].Options if name in METHODS else None
    return dataclasses.fields(cls) if cls is not None else ()


def method_options(name: str, values: dict, config=None):
    """The method's Options dataclass filled from a config's method_options (None for a method
    without options), checked against its fields' declarations and its own validate(config) (the run's
    config, for checks that involve run-level settings such as N_s); unknown names and wrong types are
    UserErrors."""
    cls = METHODS[name].Options
    if cls is None:
        if values:
            raise UserError(f"method {name} takes no method options, got {', '.join(sorted(values))}")
        return None
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(values) - known
    if unknown:
        raise UserError(f"unknown {name} options: {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
    from ...settings.fields import check_settings

    options = cls(**values)
    check_settings(options, what=name)
    if hasattr(options, "validate"):
        options.validate(config)
    return options
