"""Type and range checks of a settings dataclass, generic over its annotated fields (so a new field is
covered without being listed anywhere): every value has its declared type, every float is finite,
every int fits in 64 bits."""

from __future__ import annotations

import dataclasses
import math
import types
import typing

from ..errors import UserError

_INT_LIMIT = 2**63  # an int setting beyond int64 fails deep inside torch


def _type_ok(value, annotation) -> bool:
    """Does value match a field annotation: bool, int, float (an int is fine), str, list[T], X | None."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return value is None
    if origin is list:
        (item,) = typing.get_args(annotation) or (object,)
        return isinstance(value, list) and all(_type_ok(v, item) for v in value)
    if annotation is bool:
        return isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(annotation, type):
        return isinstance(value, annotation)
    return True  # an annotation this check does not know: not checked


def _type_name(annotation) -> str:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if typing.get_origin(annotation) is list:
        return f"a list of {_type_name(typing.get_args(annotation)[0]).removeprefix('a ').removeprefix('an ')}s"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string",
            dict: "an object"}.get(annotation, str(annotation))


def check_fields(obj, what: str = "") -> None:
    """Every field of the dataclass obj has its annotated type, every float is finite and every int fits
    in 64 bits. Generic over dataclasses.fields, so a new field is covered without being listed here."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value, annotation = getattr(obj, f.name), hints.get(f.name, object)
        name = (f"{what}: " if what else "") + f.name.replace("_", " ")
        if not _type_ok(value, annotation):
            raise UserError(f"{name} must be {_type_name(annotation)}, got {value!r}")
        for v in (value if isinstance(value, list) else [value]):
            if isinstance(v, float) and not math.isfinite(v):
                raise UserError(f"{name} must be a finite number, got {v}")
            if isinstance(v, int) and not isinstance(v, bool) and not -_INT_LIMIT < v < _INT_LIMIT:
                raise UserError(f"{name} {v} is out of range")


def setting(default=dataclasses.MISSING, *, help: str = "", choices=None, minimum=None, maximum=None,
            exclusive: bool = False, flag: str | None = None, label: str | None = None, default_factory=dataclasses.MISSING):
    """A dataclass field with its one declaration: the CLI flag, its help, its validation and the app's widget
    are all made from this metadata.

    choices: a tuple, or a callable returning one (a registry's names, read when checked); minimum/maximum:
    bounds (exclusive=True: both strict); flag: the CLI flag when it is not --FIELD-NAME; label: the app's."""
    metadata = {"help": help, "choices": choices, "minimum": minimum, "maximum": maximum, "exclusive": exclusive,
                "flag": flag, "label": label}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=metadata)


def choices_of(f: dataclasses.Field) -> tuple | None:
    c = f.metadata.get("choices")
    return tuple(c()) if callable(c) else (tuple(c) if c is not None else None)


def check_settings(obj, what: str = "") -> None:
    """check_fields, then every field's declared choices and bounds (from setting()'s metadata)."""
    check_fields(obj, what)
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), (f"{what}: " if what else "") + f.name.replace("_", " ")
        allowed = choices_of(f)
        if allowed is not None and value not in allowed:
            raise UserError(f"unknown {name} {value!r}; choose from {', '.join(map(str, allowed))}")
        lo, hi, strict = f.metadata.get("minimum"), f.metadata.get("maximum"), f.metadata.get("exclusive")
        if value is None or isinstance(value, (bool, str, list, dict)):
            continue
        if lo is not None and (value <= lo if strict else value < lo):
            raise UserError(f"{name} must be {'above' if strict else 'at least'} {lo}, got {value}")
        if hi is not None and (value >= hi if strict else value > hi):
            raise UserError(f"{name} must be {'below' if strict else 'at most'} {hi}, got {value}")
