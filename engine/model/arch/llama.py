"""The LLaMA-like family: LLaMA, Mistral, Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms, which
act on head_dim and so are kept whole). The one place that names their projection modules."""

from __future__ import annotations

from torch import nn

from .registry import register_architecture
from .base import AttentionLinears, MlpLinears, ModelAdapter, base_model_type


@register_architecture("llama", "mistral", "qwen2", "qwen3")
class LlamaLikeAdapter(ModelAdapter):
    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    def attention_linears(self, layer: nn.Module) -> AttentionLinears:
        a = layer.self_attn
        return AttentionLinears(query=a.q_proj, key=a.k_proj, value=a.v_proj, output=a.o_proj)

    def mlp_linears(self, layer: nn.Module) -> MlpLinears:
        m = layer.mlp
        return MlpLinears(inputs=(m.gate_proj, m.up_proj), output=m.down_proj)

    def norms(self, layer: nn.Module) -> tuple[nn.Module, nn.Module]:
        return layer.input_layernorm, layer.post_attention_layernorm

    def embedding(self) -> nn.Embedding:
        return self.model.model.embed_tokens

    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    def pruned_classes(self) -> tuple[type, type]:
        from ..modeling_pruned import PRUNED_CLASSES

        return PRUNED_CLASSES[base_model_type(self.config)]
