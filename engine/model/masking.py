"""Apply unit masks to an unmodified transformers model through hooks, inside a context manager.

A KV-group mask scales the input columns of the attention output projection (all query heads
of the group); a channel mask scales the input of the MLP output projection. A layer mask gates
a whole decoder layer: while the context is active each decoder layer sits inside a thin gate
that returns its input unchanged when the layer's mask is 0 (the layer is not computed at all),
runs it when the mask is 1, and blends h + m (layer(h) - h) for a soft mask. Multiplying by 1 is
exact, so an all-ones mask reproduces the dense model. Leaving the context restores the model.

Per-row masks: a mask of shape (rows, units) gives every row of the batch its own mask, so N_s
mask samples run as one forward over the calibration batch repeated N_s times.

Compensation (FLAP's bias compensation): with `comp_means`, a masked input column is replaced by its
mean over calibration data instead of 0, x' = m x + (1 - m) mu, which is exactly what an export
gets by adding W[:, removed] mu[removed] to the output projection's bias.
"""

from __future__ import annotations

import torch
from torch import nn

from .arch import ModelAdapter
from .unit_types import UNIT_TYPES, layer_unit_types, whole_layer_type


class _LayerGate(nn.Module):
    """Stands in for one decoder layer while masks are active."""

    def __init__(self, layer: nn.Module, hooks: "MaskHooks", index: int):
        super().__init__()
        self.gated_layer = layer
        self._hooks = [hooks]  # a list, so that nn.Module does not register it as a child
        self.index = index

    def forward(self, hidden_states, *args, **kwargs):
        hooks = self._hooks[0]
        gates = hooks._columns.get(whole_layer_type().name)
        if gates is None:
            return self.gated_layer(hidden_states, *args, **kwargs)
        m = gates[self.index]
        if not m.requires_grad:
            decided = hooks._layer_decisions[self.index]  # from the CPU copy: no device sync
            if decided == 0.0:
                return hidden_states
            if decided == 1.0:
                return self.gated_layer(hidden_states, *args, **kwargs)
        out = self.gated_layer(hidden_states, *args, **kwargs)
        m = m.to(hidden_states.device)
        if m.dim() == 1:  # one gate per row
            m = m.view(-1, *([1] * (hidden_states.dim() - 1)))
        return hidden_states + m * (out - hidden_states)


def _placed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x in the weight's dtype and on its device, unless the weight is offloaded (on `meta`: accelerate's
    device_map loads it only for its forward); the hook then moves x to where the input is."""
    return x.to(dtype=weight.dtype) if weight.device.type == "meta" else x.to(weight)


def _all_equal(m: torch.Tensor) -> float | None:
    """0.0 or 1.0 when every entry of a (hard, CPU) gate is that value, else None."""
    if bool((m == 0).all()):
        return 0.0
    if bool((m == 1).all()):
        return 1.0
    return None


class MaskHooks:
    """Context manager: while active, the model runs with the masks last given to `set`."""

    def __init__(self, adapter: ModelAdapter):
        self.adapter = adapter
        self._columns: dict[str, list[torch.Tensor | None]] = {}
        self._comp_means: dict[str, list[torch.Tensor]] = {}
        self._layer_decisions: list[float | None] = []
        self._handles = []
        self._originals: list[nn.Module] | None = None

    def set(self, layer_masks: dict[str, list[torch.Tensor]],
            comp_means: dict[str, list[torch.Tensor]] | None = None) -> None:
        """layer_masks: unit type -> one vector per layer, 0/1 (or soft), of shape (units,) for the
        whole batch or (rows, units) for one mask per row. Types not given are unmasked.
        comp_means: unit type -> per layer, the mean input of each column of its output projection
        (see `input_means`): masked columns take that value instead of 0."""
        a = self.adapter
        unknown = set(layer_masks) - set(UNIT_TYPES)
        if unknown:
            raise ValueError(f"unknown unit types {sorted(unknown)}")
        cols: dict[str, list[torch.Tensor | None]] = {}
        for t in layer_unit_types():
            if t.name in layer_masks:
                cols[t.name] = [_placed(t.columns(a, m), t.output_proj(a, i).weight) for i, m in enumerate(layer_masks[t.name])]
        whole = whole_layer_type().name
        if whole in layer_masks:
            ref = a.attention(0).output.weight
            gates = [m.reshape(-1) if m.numel() > 1 else m.reshape(()) for m in layer_masks[whole]]
            host = torch.stack([g.detach() for g in gates]).cpu()  # one transfer for all layers, not one each
            self._layer_decisions = [None if g.requires_grad else _all_equal(h) for g, h in zip(gates, host)]
            cols[whole] = [_placed(g, ref) for g in gates]
        self._comp_means = {}
        for u, means in (comp_means or {}).items():
            if u in cols and not UNIT_TYPES[u].whole_layer:
                self._comp_means[u] = [_placed(mu, UNIT_TYPES[u].output_proj(a, i).weight) for i, mu in enumerate(means)]
        self._columns = cols

    def clear(self) -> None:
        self._columns = {}
        self._comp_means = {}

    def _hook(self, unit_type: str, layer: int):
        def scale_input(module, args):
            cols = self._columns.get(unit_type)
            if cols is None:
                return None
            m = cols[layer]
            x = args[0]
            if m.device != x.device:  # an offloaded layer (see _placed)
                m = m.to(x.device)
            if m.dim() == 2:  # (rows, columns): one mask per row of the batch
                m = m.view(m.shape[0], *([1] * (x.dim() - 2)), m.shape[1])
            comp_means = self._comp_means.get(unit_type)
            if comp_means is None:
                out = x * m
            else:
                mu = comp_means[layer] if comp_means[layer].device == x.device else comp_means[layer].to(x.device)
                out = x * m + (1 - m) * mu
            return (out,) + tuple(args[1:])

        return scale_input

    def __enter__(self) -> "MaskHooks":
        a = self.adapter
        for t in layer_unit_types():
            for i in range(a.num_layers):
                self._handles.append(t.output_proj(a, i).register_forward_pre_hook(self._hook(t.name, i)))
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
        self._comp_means = {}

