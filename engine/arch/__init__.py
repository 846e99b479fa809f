"""Architecture adapters: one file per model family, one `register_architecture` entry per family.

    adapter = adapter_for(model)   # the family's ModelAdapter, chosen by config.model_type
"""

from __future__ import annotations

from .registry import adapter_for, ARCHITECTURES, AttentionLinears, base_model_type, MlpLinears, ModelAdapter, register_architecture, supported_model_types  # noqa: F401
from . import llama  # noqa: E402,F401  (the families register themselves)

__all__ = ["ARCHITECTURES", "AttentionLinears", "MlpLinears", "ModelAdapter", "adapter_for", "base_model_type",
           "register_architecture", "supported_model_types"]
