"""Apply unit masks to an unmodified transformers model through hooks, inside a context manager.

A KV-group mask scales the input columns of the attention output projection (all query heads
of the group); a channel mask scales the input of the MLP output projection. A layer mask gates
a whole decoder layer: while the context is active each decoder layer sits inside a thin gate
that returns its input unchanged when the layer's mask is 0 (the layer is not computed at all),
runs it when the mask is 1, and blends h + m (layer(h) - h) for a soft mask. Multiplying by 1 is
exact, so an all-ones mask reproduces the dense model. Leaving the context restores the model.
"""

from __future__ import annotations

import torch
from torch import nn

from .adapter import ModelAdapter


class _LayerGate(nn.Module):
    """Stands in for one decoder layer while masks are active."""

    def __init__(self, layer: nn.Module, hooks: "MaskHooks", index: int):
        super().__init__()
        self.gated_layer = layer
        self._hooks = [hooks]  # a list, so that nn.Module does not register it as a child
        self.index = index

    def forward(self, hidden_states, *args, **kwargs):
        gates = self._hooks[0]._columns.get("layers")
        if gates is None:
            return self.gated_layer(hidden_states, *args, **kwargs)
        m = gates[self.index]
        if not m.requires_grad:
            if float(m) == 0.0:
                return hidden_states
            if float(m) == 1.0:
                return self.gated_layer(hidden_states, *args, **kwargs)
        out = self.gated_layer(hidden_states, *args, **kwargs)
        return hidden_states + m * (out - hidden_states)


class MaskHooks:
    """Context manager: while active, the model runs with the masks last given to `set`."""

    def __init__(self, adapter: ModelAdapter):
        self.adapter = adapter
        self._columns: dict[str, list[torch.Tensor | None]] = {}
        self._handles = []
        self._originals: list[nn.Module] | None = None

    def set(self, layer_masks: dict[str, list[torch.Tensor]]) -> None:
        """layer_masks: unit type -> one 0/1 (or soft) vector per layer. Types not given are unmasked."""
        a = self.adapter
        cols: dict[str, list[torch.Tensor | None]] = {}
        if "heads" in layer_masks:
            cols["heads"] = [
                a.group_columns(m).to(a.attn_out_proj(i).weight) for i, m in enumerate(layer_masks["heads"])
            ]
        if "channels" in layer_masks:
            cols["channels"] = [m.to(a.mlp_out_proj(i).weight) for i, m in enumerate(layer_masks["channels"])]
        if "layers" in layer_masks:
            dtype = a.attn_out_proj(0).weight.dtype
            cols["layers"] = [m.reshape(()).to(dtype) for m in layer_masks["layers"]]
        self._columns = cols

    def clear(self) -> None:
        self._columns = {}

    def _hook(self, unit_type: str, layer: int):
        def scale_input(module, args):
            cols = self._columns.get(unit_type)
            if cols is None:
                return None
            return (args[0] * cols[layer],) + tuple(args[1:])

        return scale_input

    def __enter__(self) -> "MaskHooks":
        a = self.adapter
        for i in range(a.num_layers):
            self._handles.append(a.attn_out_proj(i).register_forward_pre_hook(self._hook("heads", i)))
            self._handles.append(a.mlp_out_proj(i).register_forward_pre_hook(self._hook("channels", i)))
        layers = a.layers
        self._originals = list(layers)
        for i, layer in enumerate(self._originals):
            layers[i] = _LayerGate(layer, self, i)
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._originals is not None:
            layers = self.adapter.layers
            for i, layer in enumerate(self._originals):
                layers[i] = layer
            self._originals = None
        self._columns = {}
