"""The adapter interface: how the engine finds the prunable parts of one model family.

An adapter answers structural questions only (which module is decoder layer i, which linears make
its attention and MLP); what a unit is, and how it is masked, scored and sliced, belongs to the unit
types (engine/model/unit_types). A family with other module names, or fused projections, is one more
file in this package with one `register_architecture` line.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from torch import nn

from ...errors import UserError


def base_model_type(config) -> str:
    """The architecture a (possibly already pruned) config is made of."""
    return getattr(config, "base_model_type", None) or config.model_type


ARCHITECTURES: dict[str, type["ModelAdapter"]] = {}  # model_type -> adapter class (filled by engine.model.arch.registry)


@dataclass(frozen=True)
class AttentionLinears:
    query: nn.Linear
    key: nn.Linear
    value: nn.Linear
    output: nn.Linear  # takes the concatenated heads: its input columns are what a KV-group mask scales


@dataclass(frozen=True)
class MlpLinears:
    inputs: tuple[nn.Linear, ...]  # their output rows are the MLP channels (gate, up)
    output: nn.Linear  # takes the channels: its input columns are what a channel mask scales


class ModelAdapter(ABC):
    """A causal LM seen as a stack of decoder layers, each with one attention block and one MLP."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._names: dict[int, str] | None = None

    @classmethod
    def for_model(cls, model: nn.Module) -> "ModelAdapter":
        """The registered adapter of the model's family (engine.model.arch.ARCHITECTURES)."""
        model_type = base_model_type(model.config)
        if model_type not in ARCHITECTURES:
            raise UserError(f"unsupported architecture {model_type!r}; supported model types: "
                            f"{', '.join(sorted(ARCHITECTURES))}")
        return ARCHITECTURES[model_type](model)

    # --- what a family file provides ---------------------------------------------------------
    @property
    @abstractmethod
    def layers(self) -> nn.ModuleList:
        """The decoder layers, in order."""

    @abstractmethod
    def attention_linears(self, layer: nn.Module) -> AttentionLinears:
        """The attention projections of one decoder layer."""

    @abstractmethod
    def mlp_linears(self, layer: nn.Module) -> MlpLinears:
        """The MLP projections of one decoder layer."""

    @abstractmethod
    def norms(self, layer: nn.Module) -> tuple[nn.Module, nn.Module]:
        """(the norm before the attention, the norm before the MLP) of one decoder layer."""

    @abstractmethod
    def embedding(self) -> nn.Embedding:
        """The token embedding."""

    @abstractmethod
    def final_norm(self) -> nn.Module:
        """The norm after the last decoder layer."""

    @abstractmethod
    def lm_head(self) -> nn.Linear:
        """The output projection to the vocabulary."""

    @abstractmethod
    def pruned_classes(self) -> tuple[type, type]:
        """(config class, model class) of this family's export with per-layer sizes."""

    # --- geometry, the same for every family --------------------------------------------------
    @property
    def config(self):
        return self.model.config

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def layer(self, i: int) -> nn.Module:
        """Decoder layer i (itself, also while MaskHooks has it inside a layer gate)."""
        m = self.layers[i]
        return getattr(m, "gated_layer", m)

    def attention(self, i: int) -> AttentionLinears:
        return self.attention_linears(self.layer(i))

    def mlp(self, i: int) -> MlpLinears:
        return self.mlp_linears(self.layer(i))

    @property
    def head_dim(self) -> int:
        c = self.config
        return getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads

    @property
    def queries_per_group(self) -> int:
        """Query heads sharing one KV head (1 for models without GQA)."""
        return self.config.num_attention_heads // self.config.num_key_value_heads

    def projections(self, i: int) -> list[nn.Linear]:
        """Every attention and MLP projection of layer i (the LoRA targets of a fine-tune)."""
        a, m = self.attention(i), self.mlp(i)
        return [a.query, a.key, a.value, a.output, *m.inputs, m.output]

    def param_name(self, module: nn.Module) -> str:
        """The state-dict prefix of a submodule (the gates MaskHooks puts in do not appear in it)."""
        if self._names is None:
            self._names = {id(m): name.replace(".gated_layer", "") for name, m in self.model.named_modules()}
        return self._names[id(module)]

    @property
    def layers_prefix(self) -> str:
        """State-dict prefix of the decoder-layer list, e.g. "model.layers"."""
        return self.param_name(self.layers)
