"""KV groups: one KV head and the query heads that share it (GQA-aware attention heads; "heads" before)."""

from __future__ import annotations

import torch

from .registry import register_unit_type
from .base import LayerUnitType


@register_unit_type
class KVGroups(LayerUnitType):
    name = "kv_groups"
    aliases = ("heads",)  # its older name: settings and saved runs that say it still read
    title = "KV groups (attention heads)"
    pruned_config_key = "kv_heads_per_layer"
    report_scores = True

    def output_proj(self, adapter, i):
        return adapter.attention(i).output

    def column_width(self, adapter) -> int:
        return adapter.queries_per_group * adapter.head_dim

    def to_units(self, adapter, per_column: torch.Tensor) -> torch.Tensor:
        """A query head sums its head_dim columns; a KV group averages its query heads."""
        per_head = per_column.view(-1, adapter.head_dim).sum(1)
        return per_head.view(-1, adapter.queries_per_group).mean(1)

    def owned_weights(self, adapter, i):
        a, hd = adapter.attention(i), adapter.head_dim
        g = adapter.queries_per_group * hd
        return [(a.query, 0, g), (a.key, 0, hd), (a.value, 0, hd), (a.output, 1, g)]

    def dense_count(self, config) -> int:
        return config.num_key_value_heads
