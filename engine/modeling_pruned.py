"""Structurally pruned decoder-only models: per-layer KV-group counts and MLP widths.

This file is self-contained on purpose: an export copies it next to the weights, so that
``AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)`` loads a pruned model
in a process that has never heard of ``engine``. It imports only torch and transformers.

It is also the one place that names the projection modules of each supported architecture
(``ARCHITECTURES``); the engine's adapter reads the table from here, so the names exist once.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(frozen=True)
class ArchSpec:
    """Where the prunable projections live inside one decoder layer."""

    layers: str  # attribute path from the CausalLM to the list of decoder layers
    attention: str  # attribute of a decoder layer holding the attention block
    query: str
    key: str
    value: str
    attn_out: str  # takes the concatenated heads: its input columns are what a head mask scales
    mlp: str
    mlp_in: tuple[str, ...]  # projections whose output rows are MLP channels (gate, up)
    mlp_out: str  # takes the channels: its input columns are what a channel mask scales


_LLAMA_LIKE = ArchSpec(
    layers="model.layers",
    attention="self_attn",
    query="q_proj",
    key="k_proj",
    value="v_proj",
    attn_out="o_proj",
    mlp="mlp",
    mlp_in=("gate_proj", "up_proj"),
    mlp_out="down_proj",
)

# model_type -> layout. Qwen3's per-head q/k norms act on head_dim, which pruning keeps whole.
ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
}


def get_path(obj, dotted: str):
    for name in dotted.split("."):
        obj = getattr(obj, name)
    return obj


def _resized_linear(old: nn.Linear, in_features: int, out_features: int, bias: bool | None = None) -> nn.Linear:
    """A fresh linear of the new shape; bias None: as the old one has."""
    w = old.weight
    bias = old.bias is not None if bias is None else bias
    return nn.Linear(in_features, out_features, bias=bias, device=w.device, dtype=w.dtype)


def resize_decoder_layers(model: nn.Module, spec: ArchSpec, kv_heads: list[int], intermediate: list[int],
                          output_bias: bool = False) -> None:
    """Give each decoder layer of ``model`` the stated KV-head count and MLP width (fresh weights).
    output_bias: the attention and MLP output projections carry a bias (bias compensation)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_kv = config.num_attention_heads // config.num_key_value_heads
    for layer, n_kv, width in zip(get_path(model, spec.layers), kv_heads, intermediate):
        attn = get_path(layer, spec.attention)
        q_width, kv_width = n_kv * per_kv * head_dim, n_kv * head_dim
        for name, shape in (
            (spec.query, (config.hidden_size, q_width)),
            (spec.key, (config.hidden_size, kv_width)),
            (spec.value, (config.hidden_size, kv_width)),
            (spec.attn_out, (q_width, config.hidden_size)),
        ):
            bias = True if output_bias and name == spec.attn_out else None
            setattr(attn, name, _resized_linear(getattr(attn, name), *shape, bias=bias))
        mlp = get_path(layer, spec.mlp)
        for name in spec.mlp_in:
            setattr(mlp, name, _resized_linear(getattr(mlp, name), config.hidden_size, width))
        setattr(mlp, spec.mlp_out, _resized_linear(getattr(mlp, spec.mlp_out), width, config.hidden_size,
                                                   bias=True if output_bias else None))


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
        resize_decoder_layers(self, ARCHITECTURES[config.base_model_type], list(kv), list(width),
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

