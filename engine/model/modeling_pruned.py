"""Structurally pruned decoder-only models: per-layer KV-group counts and MLP widths.

This file is self-contained on purpose: an export copies it next to the weights, so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads a pruned model
in a process that has never heard of ``engine``. It imports only torch and transformers.

It keeps only what an export needs: the pruned config and model classes of the LLaMA-like family
(LLaMA, Mistral, Qwen2, Qwen3), which narrow each decoder layer to its per-layer sizes. The engine's
own view of the architectures (engine/model/arch) is not needed to load an export.
"""

from __future__ import annotations

from torch import nn
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)


def _resized_linear(old: nn.Linear, in_features: int, out_features: int, bias: bool | None = None) -> nn.Linear:
    """A fresh linear of the new shape; bias None: as the old one has."""
    w = old.weight
    bias = old.bias is not None if bias is None else bias
    return nn.Linear(in_features, out_features, bias=bias, device=w.device, dtype=w.dtype)


def resize_decoder_layers(model: nn.Module, kv_heads: list[int], intermediate: list[int],
                          output_bias: bool = False) -> None:
    """Give each decoder layer of ``model`` the stated KV-head count and MLP width (fresh weights).
    output_bias: the attention and MLP output projections carry a bias (bias compensation)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_kv = config.num_attention_heads // config.num_key_value_heads
    hidden = config.hidden_size
    for layer, n_kv, width in zip(model.model.layers, kv_heads, intermediate):
        attn, mlp = layer.self_attn, layer.mlp
        q_width, kv_width = n_kv * per_kv * head_dim, n_kv * head_dim
        attn.q_proj = _resized_linear(attn.q_proj, hidden, q_width)
        attn.k_proj = _resized_linear(attn.k_proj, hidden, kv_width)
        attn.v_proj = _resized_linear(attn.v_proj, hidden, kv_width)
        attn.o_proj = _resized_linear(attn.o_proj, q_width, hidden, bias=True if output_bias else None)
        mlp.gate_proj = _resized_linear(mlp.gate_proj, hidden, width)
        mlp.up_proj = _resized_linear(mlp.up_proj, hidden, width)
        mlp.down_proj = _resized_linear(mlp.down_proj, width, hidden, bias=True if output_bias else None)


class _PrunedMixin:
    """Builds the base architecture, then narrows each layer to the config's per-layer sizes."""

    def __init__(self, config):
        super().__init__(config)
        n = config.num_hidden_layers
        kv = config.kv_heads_per_layer or [config.num_key_value_heads] * n
        width = config.intermediate_size_per_layer or [config.intermediate_size] * n
        if len(kv) != n or len(width) != n:
            raise ValueError(f"per-layer lists must have {n} entries, got {len(kv)} and {len(width)}")
        if any(k < 1 or k > config.num_key_value_heads for k in kv) or any(w < 1 for w in width):
            raise ValueError("every layer needs 1..num_key_value_heads KV heads and at least one MLP channel")
        resize_decoder_layers(self, list(kv), list(width),
                              bool(getattr(config, "output_bias", False)))


class PrunedLlamaConfig(LlamaConfig):
    model_type = "pruned_llama"
    kv_heads_per_layer: list[int] | None = None
    intermediate_size_per_layer: list[int] | None = None
    base_model_type: str = "llama"
    output_bias: bool = False  # bias on the attention and MLP output projections (bias compensation)


class PrunedMistralConfig(MistralConfig):
    model_type = "pruned_mistral"
    kv_heads_per_layer: list[int] | None = None
    intermediate_size_per_layer: list[int] | None = None
    base_model_type: str = "mistral"
    output_bias: bool = False  # bias on the attention and MLP output projections (bias compensation)


class PrunedQwen2Config(Qwen2Config):
    model_type = "pruned_qwen2"
    kv_heads_per_layer: list[int] | None = None
    intermediate_size_per_layer: list[int] | None = None
    base_model_type: str = "qwen2"
    output_bias: bool = False  # bias on the attention and MLP output projections (bias compensation)


class PrunedQwen3Config(Qwen3Config):
    model_type = "pruned_qwen3"
    kv_heads_per_layer: list[int] | None = None
    intermediate_size_per_layer: list[int] | None = None
    base_model_type: str = "qwen3"
    output_bias: bool = False  # bias on the attention and MLP output projections (bias compensation)


class PrunedLlamaForCausalLM(_PrunedMixin, LlamaForCausalLM):
    config_class = PrunedLlamaConfig


class PrunedMistralForCausalLM(_PrunedMixin, MistralForCausalLM):
    config_class = PrunedMistralConfig


class PrunedQwen2ForCausalLM(_PrunedMixin, Qwen2ForCausalLM):
    config_class = PrunedQwen2Config


class PrunedQwen3ForCausalLM(_PrunedMixin, Qwen3ForCausalLM):
    config_class = PrunedQwen3Config


# base model_type -> (config class, model class) of its pruned form
PRUNED_CLASSES: dict[str, tuple[type, type]] = {
    "llama": (PrunedLlamaConfig, PrunedLlamaForCausalLM),
    "mistral": (PrunedMistralConfig, PrunedMistralForCausalLM),
    "qwen2": (PrunedQwen2Config, PrunedQwen2ForCausalLM),
    "qwen3": (PrunedQwen3Config, PrunedQwen3ForCausalLM),
}

