"""The arch registry: the table and its decorator (the package's __init__ imports the entries).

Entries import their decorator from here, never from the package, so that no entry imports the package that
imports it."""

from __future__ import annotations

from .base import ARCHITECTURES, ModelAdapter


def register_architecture(*model_types: str):
    """Class decorator: the adapter serves these model types (a type may be registered once)."""

    def add(cls: type[ModelAdapter]) -> type[ModelAdapter]:
        for t in model_types:
            if t in ARCHITECTURES:
                raise ValueError(f"model type {t!r} already has an adapter ({ARCHITECTURES[t].__name__})")
            ARCHITECTURES[t] = cls
        return cls

    return add


def supported_model_types() -> tuple[str, ...]:
    return tuple(sorted(ARCHITECTURES))
