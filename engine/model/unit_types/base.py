"""What a unit type is: everything the engine needs to mask, score and slice one kind of unit.

A unit type inside layers (KV groups, MLP channels) owns an output projection whose input columns
are its units: masking scales those columns (a forward pre-hook), the activation metrics read them,
and the export keeps the kept units' rows and columns. A whole-layer type (one unit per layer) is
masked by gating the decoder layer and exported by dropping it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from ..arch import ModelAdapter


def unit_index(kept: torch.Tensor, width: int) -> torch.Tensor:
    """The row or column indices of the kept units when each unit spans `width` consecutive ones."""
    return kept if width == 1 else (kept[:, None] * width + torch.arange(width, device=kept.device)).reshape(-1)


class UnitType(ABC):
    name: str  # the key in configs, masks, scores and metrics
    title: str  # for figures and the app
    aliases: tuple[str, ...] = ()  # older names of it, still read (UNIT_TYPES finds it by them)
    whole_layer: bool = False  # one unit per layer: one pool across layers; a removed unit drops its layer
    pruned_config_key: str | None = None  # the export config's per-layer count of these units
    report_scores: bool = False  # few per layer: every unit's score goes into each step's report (heatmaps)

    @abstractmethod
    def sizes(self, adapter: ModelAdapter) -> list[int]:
        """Units in each layer (read off the weights, so an already pruned model is described right)."""

    @abstractmethod
    def unit_params(self, adapter: ModelAdapter) -> list[int]:
        """The parameters one unit of each layer carries (what removing it removes, its layer kept)."""


class LayerUnitType(UnitType):
    """Units inside a decoder layer: input columns (or groups of them) of one output projection."""

    @abstractmethod
    def output_proj(self, adapter: ModelAdapter, i: int) -> nn.Linear:
        """The projection of layer i whose input columns are this type's units."""

    @abstractmethod
    def column_width(self, adapter: ModelAdapter) -> int:
        """Input columns of the output projection per unit."""

    def sizes(self, adapter: ModelAdapter) -> list[int]:
        w = self.column_width(adapter)
        return [self.output_proj(adapter, i).in_features // w for i in range(adapter.num_layers)]

    def columns(self, adapter: ModelAdapter, mask: torch.Tensor) -> torch.Tensor:
        """A per-unit mask (..., units) expanded to the output projection's input columns."""
        w = self.column_width(adapter)
        return mask if w == 1 else mask.repeat_interleave(w, dim=-1)

    def column_index(self, adapter: ModelAdapter, kept: torch.Tensor) -> torch.Tensor:
        """The output projection's input columns of the kept units (indices)."""
        return unit_index(kept, self.column_width(adapter))

    def removed_contribution(self, adapter: ModelAdapter, weight: torch.Tensor, kept: torch.Tensor | None,
                             comp_means: torch.Tensor) -> torch.Tensor:
        """Bias compensation: W[:, removed] mu[removed], what the removed units' mean inputs add to the output
        projection (weight: its weight; kept: the kept units' indices, None for none kept; comp_means: mu per column)."""
        removed = torch.ones(weight.shape[1], dtype=torch.bool, device=weight.device)
        if kept is not None:
            removed[self.column_index(adapter, kept.to(weight.device))] = False
        return weight[:, removed] @ comp_means.to(weight)[removed]

    def unit_params(self, adapter: ModelAdapter) -> list[int]:
        """Per layer: the rows and columns of every owned linear that one unit narrows (and their biases)."""
        out = []
        for i in range(adapter.num_layers):
            n = 0
            for linear, dim, width in self.owned_weights(adapter, i):
                n += width * linear.weight.shape[1 - dim] + (width if dim == 0 and linear.bias is not None else 0)
            out.append(n)
        return out

    @abstractmethod
    def to_units(self, adapter: ModelAdapter, per_column: torch.Tensor) -> torch.Tensor:
        """A metric over the output projection's input columns reduced to one value per unit."""

    @abstractmethod
    def owned_weights(self, adapter: ModelAdapter, i: int) -> list[tuple[nn.Linear, int, int]]:
        """The linears of layer i that carry these units: (module, dim of the units, width of one unit)."""

    def slices(self, adapter: ModelAdapter, i: int, kept: torch.Tensor) -> dict[str, tuple[int, torch.Tensor]]:
        """State-dict key -> (dim, kept indices) of every tensor of layer i these units narrow."""
        out = {}
        for linear, dim, width in self.owned_weights(adapter, i):
            idx = unit_index(kept, width)
            name = adapter.param_name(linear)
            out[f"{name}.weight"] = (dim, idx)
            if dim == 0:  # a bias follows the output rows; an output projection's bias stays whole
                out[f"{name}.bias"] = (0, idx)
        return out

    @abstractmethod
    def dense_count(self, config) -> int:
        """Units per layer of the unpruned architecture, from its config."""
