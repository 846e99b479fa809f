"""Maps a transformers causal LM onto prunable units: per layer, KV groups and MLP channels.

Unit counts are read from the weights, not the config, so an already pruned model (fewer heads
in some layers) is described correctly too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .errors import UserError
from .modeling_pruned import ARCHITECTURES, PRUNED_CLASSES, ArchSpec, get_path

SUPPORTED_MODEL_TYPES = tuple(sorted(ARCHITECTURES))


def base_model_type(config) -> str:
    """The architecture a (possibly already pruned) config is made of."""
    return getattr(config, "base_model_type", None) or config.model_type


@dataclass
class ModelAdapter:
    model: nn.Module
    spec: ArchSpec

    @classmethod
    def for_model(cls, model: nn.Module) -> "ModelAdapter":
        model_type = base_model_type(model.config)
        if model_type not in ARCHITECTURES:
            raise UserError(
                f"unsupported architecture {model_type!r}; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        return cls(model, ARCHITECTURES[model_type])

    # --- geometry -------------------------------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def layers(self) -> nn.ModuleList:
        return get_path(self.model, self.spec.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, i: int) -> nn.Module:
        """Decoder layer i (itself, also while MaskHooks has it inside a layer gate)."""
        m = self.layers[i]
        return getattr(m, "gated_layer", m)

    @property
    def head_dim(self) -> int:
        c = self.config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def queries_per_group(self) -> int:
        """Query heads sharing one KV head (1 for models without GQA)."""
        return self.config.num_attention_heads // self.config.num_key_value_heads

    def attention(self, i: int) -> nn.Module:
        return get_path(self.layer(i), self.spec.attention)

    def mlp(self, i: int) -> nn.Module:
        return get_path(self.layer(i), self.spec.mlp)

    def attn_out_proj(self, i: int) -> nn.Linear:
        return getattr(self.attention(i), self.spec.attn_out)

    def mlp_out_proj(self, i: int) -> nn.Linear:
        return getattr(self.mlp(i), self.spec.mlp_out)

    def output_proj(self, unit_type: str, i: int) -> nn.Linear:
        """The projection whose input columns are layer i's units of this type (KV groups or channels)."""
        return self.attn_out_proj(i) if unit_type == "heads" else self.mlp_out_proj(i)

    def kv_groups_per_layer(self) -> list[int]:
        g = self.queries_per_group * self.head_dim
        return [self.attn_out_proj(i).in_features // g for i in range(self.num_layers)]

    def channels_per_layer(self) -> list[int]:
        return [self.mlp_out_proj(i).in_features for i in range(self.num_layers)]

    def unit_sizes(self) -> dict[str, list[int]]:
        """Units per layer of every unit type: KV groups, MLP channels, and the layer itself."""
        return {"heads": self.kv_groups_per_layer(), "channels": self.channels_per_layer(),
                "layers": [1] * self.num_layers}

    def unit_weights(self, i: int) -> dict[str, list[tuple[nn.Linear, int, int]]]:
        """Per unit type, the linears of layer i that carry its units: (module, dim of the units, width of one unit)."""
        s, hd = self.spec, self.head_dim
        attn, mlp, g = self.attention(i), self.mlp(i), self.queries_per_group * hd
        return {
            "heads": [(getattr(attn, s.query), 0, g), (getattr(attn, s.key), 0, hd), (getattr(attn, s.value), 0, hd),
                      (getattr(attn, s.attn_out), 1, g)],
            "channels": [(getattr(mlp, n), 0, 1) for n in s.mlp_in] + [(getattr(mlp, s.mlp_out), 1, 1)],
        }

    def group_columns(self, group_mask: torch.Tensor) -> torch.Tensor:
        """Expand a per-KV-group mask (..., groups) to the attention-output input columns."""
        return group_mask.repeat_interleave(self.queries_per_group * self.head_dim, dim=-1)

    # --- physical slicing -----------------------------------------------------------------
    def group_columns_index(self, keep_groups: torch.Tensor) -> torch.Tensor:
        """Attention-output input columns (= query-projection rows) of the given KV groups."""
        width = self.queries_per_group * self.head_dim
        return (keep_groups[:, None] * width + torch.arange(width)).reshape(-1)

    def layer_slices(self, i: int, keep_groups: torch.Tensor, keep_channels: torch.Tensor) -> dict[str, tuple[int, torch.Tensor]]:
        """State-dict key -> (dim, kept indices) for every tensor of layer i that pruning narrows."""
        s, hd = self.spec, self.head_dim
        kv_idx = (keep_groups[:, None] * hd + torch.arange(hd)).reshape(-1)
        q_idx = self.group_columns_index(keep_groups)
        attn = f"{s.layers}.{i}.{s.attention}."
        mlp = f"{s.layers}.{i}.{s.mlp}."
        out = {}
        for name, idx in ((s.query, q_idx), (s.key, kv_idx), (s.value, kv_idx)):
            out[attn + name + ".weight"] = (0, idx)
            out[attn + name + ".bias"] = (0, idx)
        out[attn + s.attn_out + ".weight"] = (1, q_idx)
        for name in s.mlp_in:
            out[mlp + name + ".weight"] = (0, keep_channels)
            out[mlp + name + ".bias"] = (0, keep_channels)
        out[mlp + s.mlp_out + ".weight"] = (1, keep_channels)
        return out

    def output_bias_key(self, i: int, unit_type: str) -> str:
        """State-dict key of the bias of the projection that takes layer i's units of this type."""
        s = self.spec
        if unit_type == "heads":
            return f"{s.layers}.{i}.{s.attention}.{s.attn_out}.bias"
        return f"{s.layers}.{i}.{s.mlp}.{s.mlp_out}.bias"

    def pruned_classes(self) -> tuple[type, type]:
        return PRUNED_CLASSES[base_model_type(self.config)]
