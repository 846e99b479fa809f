"""Architecture adapters: one file per model family, one `register_architecture` entry per family.

    adapter = ModelAdapter.for_model(model)   # the family's ModelAdapter, chosen by config.model_type

base.py holds the ModelAdapter interface, registry.py the table; llama.py the LLaMA-like family (LLaMA, Mistral,
Qwen2, Qwen3).
"""

from __future__ import annotations

from .base import ARCHITECTURES, AttentionLinears, base_model_type, MlpLinears, ModelAdapter  # noqa: F401
from .registry import register_architecture, supported_model_types  # noqa: F401
from . import llama  # noqa: E402,F401  (the families register themselves)

__all__ = ["ARCHITECTURES", "AttentionLinears", "MlpLinears", "ModelAdapter", "base_model_type",
           "register_architecture", "supported_model_types"]
