"""Apply unit masks to an unmodified transformers model through forward pre-hooks.

A KV-group mask scales the input columns of the attention output projection (all query heads
of the group); a channel mask scales the input of the MLP output projection. Multiplying by 1
is exact, so an all-ones mask reproduces the dense model.
"""

from __future__ import annotations

import torch

from .adapter import ModelAdapter


class MaskHooks:
    """Context manager: while active, the model runs with the masks last given to `set`."""

    def __init__(self, adapter: ModelAdapter):
        self.adapter = adapter
        self._columns: dict[str, list[torch.Tensor | None]] = {}
        self._handles = []

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
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._columns = {}
