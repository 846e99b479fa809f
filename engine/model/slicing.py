"""Sliced forwards: a masked model that computes only its kept units.

While `SlicedLayers(adapter, layer_masks, comp_means)` is active, every decoder layer, just before it runs,
swaps the weights of its unit types' linears for the kept rows and columns (gathered with
index_select) and swaps them back right after; the attention infers its head count from the
projections, so a layer keeping 2 of 3 KV groups computes 2. The output equals the hook-masked
model's (`MaskHooks`), at about the kept fraction of the cost, and at most one layer's gathered
weights exist at a time, so memory stays that of inference.

Bias compensation (`comp_means`) is folded in exactly: the output projection's bias gains
W[:, removed] @ mu[removed], as in the export. A layer that keeps no unit of a type keeps one whose
output columns are zeroed: it contributes nothing, as the masked model's zero mask does.
Whole-layer masks are not this module's business: MaskHooks' layer gates skip those layers.

Each gathered width is padded to a multiple of 8 (`aligned_padding`) by repeating a kept unit whose output
columns are zeroed: the CPU's GEMM is much slower on odd widths, which nearly every sampled mask has.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from .arch import ModelAdapter
from ..errors import UserError
from .unit_types import UNIT_TYPES, LayerUnitType
from .unit_types.base import unit_index


ALIGN = 8  # a gathered width that is a multiple of this keeps the CPU's GEMM on its fast path


def aligned_padding(kept: int, widths: list[int], align: int = ALIGN) -> int:
    """The fewest extra units (0 to align - 1) that make every gathered width (kept units x a unit's width) a
    multiple of `align`. MKL's sgemm on AVX2 (8 floats a vector) took 14.7 ms for a 1024 x 576 by 576 x 1075
    product against 8.3-10.8 ms for 1,024-1,120 columns in multiples of 8 (2 threads here): odd MLP widths,
    which almost every sampled mask has, cost a masked forward more than the units it skips."""
    for pad in range(align):
        if all((kept + pad) * w % align == 0 for w in widths):
            return pad
    return 0


def sliced_linears(adapter: ModelAdapter, t: LayerUnitType, i: int, mask: torch.Tensor,
                   comp_means: torch.Tensor | None = None, buffers: dict | None = None
                   ) -> dict[nn.Linear, tuple[torch.Tensor, torch.Tensor | None]]:
    """linear -> (weight, bias) of layer i's linears of unit type t, narrowed to the units `mask` keeps.

    buffers: storage reused from layer to layer, keyed by (unit type, weight position): the gathered weights
    are written into it instead of fresh memory (the gathered weights of the previous layer must be dead:
    no autograd), which spares the page faults of allocating them anew for every layer and sample."""
    kept = torch.nonzero(mask).flatten()
    empty = len(kept) == 0
    if empty:  # keep one unit and zero its contribution below
        kept = torch.zeros(1, dtype=torch.long, device=mask.device)
    out_proj = t.output_proj(adapter, i)
    owned = t.owned_weights(adapter, i)
    pad = aligned_padding(len(kept), [width for _, _, width in owned])
    pad = pad if len(kept) + pad <= len(mask) else 0  # never wider than the dense layer
    gathered = torch.cat([kept, kept[:1].expand(pad)]) if pad else kept  # the padding repeats a kept unit
    out = {}
    for j, (linear, dim, width) in enumerate(owned):
        w = linear.weight
        idx = unit_index(gathered.to(w.device), width)
        if buffers is None:
            weight = w.index_select(dim, idx)
        else:
            shape = (len(idx), w.shape[1]) if dim == 0 else (w.shape[0], len(idx))
            buf = buffers.get((t.name, j))
            if buf is None or buf.numel() < w.numel() or buf.dtype != w.dtype or buf.device != w.device:
                buf = buffers[(t.name, j)] = torch.empty(w.numel(), dtype=w.dtype, device=w.device)
            weight = torch.index_select(w, dim, idx, out=buf[: shape[0] * shape[1]].view(shape))
        bias = linear.bias
        if dim == 0 and bias is not None:
            bias = bias.index_select(0, idx)
        if linear is out_proj:
            if empty:
                weight = torch.zeros_like(weight)
            elif pad:  # the padding units contribute nothing: their columns of the output projection are zero
                weight.narrow(dim, len(kept) * width, pad * width).zero_()
            if comp_means is not None:  # the removed columns' mean contribution, as a bias
                extra = t.removed_contribution(adapter, w, None if empty else kept, comp_means)
                bias = extra if bias is None else bias + extra
        out[linear] = (weight, bias)
    return out


@contextmanager
def _gather_threads(layer: nn.Module):
    """On the CPU, gather with one thread. A row gather is a memory copy: a second thread does not
    make it faster, and torch's parallel index_select is 10-30x slower than one thread when the cores are
    shared (measured on the 2 cores here: 8-24 ms against 0.9 ms for one 1536 x 576 weight), which made the
    gathers cost a third of a dense forward."""
    on_cpu = next(layer.parameters()).device.type == "cpu"
    before = torch.get_num_threads()
    if not on_cpu or before <= 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class SlicedLayers:
    """Context manager: while active, each decoder layer runs on its kept units only (see the module doc).

    layer_masks: unit type -> per layer, a 0/1 vector of its units (types inside layers; others ignored).
    comp_means: unit type -> per layer, the mean input of each column of its output projection.
    """

    def __init__(self, adapter: ModelAdapter, layer_masks: dict[str, list[torch.Tensor]],
                 comp_means: dict[str, list[torch.Tensor]] | None = None):
        self.adapter = adapter
        self.masks = {u: m for u, m in layer_masks.items() if isinstance(UNIT_TYPES[u], LayerUnitType)}
        self.comp_means = comp_means or {}
        self._handles = []
        self._saved: dict[nn.Linear, tuple[nn.Parameter, nn.Parameter | None]] = {}
        self._buffers: dict = {}

    def _swap_in(self, i: int):
        def hook(module, args, kwargs=None):
            with _gather_threads(self.adapter.layer(i)):
                for u, masks in self.masks.items():
                    comp_means = self.comp_means[u][i] if u in self.comp_means else None
                    buffers = None if torch.is_grad_enabled() else self._buffers
                    for linear, (weight, bias) in sliced_linears(self.adapter, UNIT_TYPES[u], i, masks[i], comp_means,
                                                                 buffers).items():
                        self._saved[linear] = (linear.weight, linear.bias)
                        linear.weight = nn.Parameter(weight, requires_grad=False)
                        if bias is not None:
                            linear.bias = nn.Parameter(bias, requires_grad=False)
        return hook

    def _restore(self, *_):
        for linear, (weight, bias) in self._saved.items():
            linear.weight = weight
            linear.bias = bias
        self._saved = {}

    def __enter__(self) -> "SlicedLayers":
        offloaded = [t.name for u in self.masks for t in [UNIT_TYPES[u]] for i in range(self.adapter.num_layers)
                     if any(lin.weight.device.type == "meta" for lin, _, _ in t.owned_weights(self.adapter, i))]
        if offloaded:
            raise UserError("the sliced executor gathers weights that must be in memory, and this model's are offloaded "
                            "(--device auto); use --sample-forward sequential or batched")
        for i in range(self.adapter.num_layers):
            layer = self.adapter.layer(i)
            self._handles.append(layer.register_forward_pre_hook(self._swap_in(i)))
            self._handles.append(layer.register_forward_hook(self._restore))
        return self

    def __exit__(self, *exc) -> None:
        self._restore()  # also after an exception inside a layer
        for h in self._handles:
            h.remove()
        self._handles = []
