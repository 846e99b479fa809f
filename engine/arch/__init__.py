"""Architecture adapters: one file per model family, one `register_architecture` entry per family.

    adapter = adapter_for(model)   # the family's ModelAdapter, chosen by config.model_type
"""

from __future__ import annotations

from torch import nn

from ..errors import UserError
from .base import AttentionLinears, MlpLinears, ModelAdapter, base_model_type

ARCHITECTURES: dict[str, type[ModelAdapter]] = {}  # model_type -> adapter class


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


def adapter_for(model: nn.Module) -> ModelAdapter:
    model_type = base_model_type(model.config)
    if model_type not in ARCHITECTURES:
        raise UserError(f"unsupported architecture {model_type!r}; supported model types: "
                        f"{', '.join(supported_model_types())}")
    return ARCHITECTURES[model_type](model)


from . import llama  # noqa: E402,F401  (the families register themselves)

__all__ = ["ARCHITECTURES", "AttentionLinears", "MlpLinears", "ModelAdapter", "adapter_for", "base_model_type",
           "register_architecture", "supported_model_types"]
