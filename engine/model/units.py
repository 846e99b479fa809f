"""The prunable units of a model as flat score vectors, their budget pools, and final hard masks.

Scores of one unit type (e.g. "kv_groups") live in one flat vector, layer after layer.
Scope "global" makes the whole vector one pool with one budget, so the per-layer split is learned;
"uniform" gives every layer its own pool with the same keep ratio. Whole layers ("layers", one unit
per decoder layer) always form one pool across the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..algo.policy import keep_count, project_capped_simplex, top_k_mask
from .unit_types import UNIT_TYPES

SCOPES = ("global", "uniform")


def _whole_layer(unit_type: str) -> bool:
    """One unit per layer: always one pool across layers (a per-layer pool of one unit could never be
    pruned), and a hard mask may drop every unit of a layer (that is the point)."""
    t = UNIT_TYPES.get(unit_type)
    return t is not None and t.whole_layer


@dataclass
class UnitLayout:
    sizes: dict[str, list[int]]  # unit type -> units in each layer

    @property
    def unit_types(self) -> list[str]:
        return list(self.sizes)

    def total(self, unit_type: str) -> int:
        return sum(self.sizes[unit_type])

    def layer_slices(self, unit_type: str) -> list[slice]:
        out, start = [], 0
        for n in self.sizes[unit_type]:
            out.append(slice(start, start + n))
            start += n
        return out

    def split(self, unit_type: str, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[sl] for sl in self.layer_slices(unit_type)]

    def split_rows(self, unit_type: str, rows: torch.Tensor) -> list[torch.Tensor]:
        """(rows, total units) -> per layer (rows, units of the layer)."""
        return [rows[:, sl] for sl in self.layer_slices(unit_type)]

    def pools(self, unit_type: str, scope: str) -> list[slice]:
        if scope == "global" or _whole_layer(unit_type):
            return [slice(0, self.total(unit_type))]
        if scope == "uniform":
            return self.layer_slices(unit_type)
        raise ValueError(f"unknown scope {scope!r}")

    def project(self, unit_type: str, z: torch.Tensor, scope: str, keep_ratio: float) -> torch.Tensor:
        """proj_C per pool, C = {sum s <= keep_ratio * pool size, 0 <= s <= 1}."""
        out = torch.empty_like(z)
        for sl in self.pools(unit_type, scope):
            out[sl] = project_capped_simplex(z[sl], keep_ratio * (sl.stop - sl.start))
        return out

    def hard_mask(self, unit_type: str, scores: torch.Tensor, scope: str, keep_ratio: float,
                  multiple: int = 1) -> torch.Tensor:
        """Deterministic final mask: the top keep_ratio of s in each pool, at least one unit per layer.

        A global pool can rank every unit of some layer below the cut; such a layer keeps its
        best unit instead, and the lowest-ranked unit kept elsewhere (in a layer keeping more than
        one) is dropped, so the total stays on budget. multiple > 1: every layer keeps a multiple of
        that many units (see round_to_multiple).
        """
        mask = torch.zeros_like(scores)
        for sl in self.pools(unit_type, scope):
            mask[sl] = top_k_mask(scores[sl], keep_count(keep_ratio, sl.stop - sl.start))
        if scope == "global" and not _whole_layer(unit_type):
            _repair_empty_layers(mask, scores, self.layer_slices(unit_type))
        if multiple > 1 and not _whole_layer(unit_type):
            mask = round_to_multiple(mask, scores, self.layer_slices(unit_type), self.pools(unit_type, scope), multiple)
        return mask

    def ranked_within_layers(self, unit_type: str, mask: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Keep each layer's count of `mask`, but choose the kept units of every layer by `order`
        (higher first): a learned per-layer allocation with another ranking inside each layer."""
        out = torch.zeros_like(mask)
        for sl in self.layer_slices(unit_type):
            out[sl] = top_k_mask(order[sl], int(mask[sl].sum()))
        return out

    def layer_means(self, unit_type: str, flat: torch.Tensor) -> list[float]:
        return [float(part.float().mean()) for part in self.split(unit_type, flat)]


def round_to_multiple(mask: torch.Tensor, scores: torch.Tensor, layers: list[slice], pools: list[slice],
                      multiple: int) -> torch.Tensor:
    """The mask with every layer keeping a multiple of `multiple` units (at least one multiple; a layer with no
    more than `multiple` units is left as it is), never more units per pool than `mask` keeps (unless every layer's
    one block alone is more).

    Each layer's count is first rounded down (to `multiple` at least); the units that frees in a pool go back
    `multiple` at a time to the layer whose next `multiple` units (by score) have the highest mean score. Inside
    a layer the kept units are the top ones by score. Whole matrices of such widths are what llama.cpp's Q8_0
    blocks (32 values) and GEMM tiles want."""
    out = torch.zeros_like(mask)
    for pool in pools:
        inside = [sl for sl in layers if pool.start <= sl.start and sl.stop <= pool.stop]
        budget = int(mask[pool].sum())
        ranked = {sl.start: torch.sort(scores[sl], descending=True).values for sl in inside}
        counts = {}
        for sl in inside:
            n, k = sl.stop - sl.start, int(mask[sl].sum())
            counts[sl.start] = k if n <= multiple else max(multiple, k // multiple * multiple)
        left = budget - sum(counts.values())
        while left < 0:  # layers raised to one block went over: take back the weakest last blocks
            losses = {sl.start: float(ranked[sl.start][counts[sl.start] - multiple:counts[sl.start]].mean())
                      for sl in inside if sl.stop - sl.start > multiple and counts[sl.start] >= 2 * multiple}
            if not losses:
                break
            worst = min(losses, key=losses.get)
            counts[worst] -= multiple
            left += multiple
        while left >= multiple:
            gains = {sl.start: float(ranked[sl.start][counts[sl.start]:counts[sl.start] + multiple].mean())
                     for sl in inside if sl.stop - sl.start > multiple
                     and counts[sl.start] + multiple <= sl.stop - sl.start}
            if not gains:
                break
            best = max(gains, key=gains.get)
            counts[best] += multiple
            left -= multiple
        for sl in inside:
            small = sl.stop - sl.start <= multiple
            out[sl] = mask[sl] if small else top_k_mask(scores[sl], counts[sl.start])
    return out


def _repair_empty_layers(mask: torch.Tensor, scores: torch.Tensor, layers: list[slice]) -> None:
    for sl in layers:
        if mask[sl].sum() > 0:
            continue
        best = sl.start + int(torch.argmax(scores[sl]))
        donors = torch.zeros_like(mask, dtype=torch.bool)
        for other in layers:
            if other is not sl and mask[other].sum() > 1:
                donors[other] = mask[other] > 0
        if donors.any():
            candidates = torch.where(donors, scores, torch.full_like(scores, float("inf")))
            mask[int(torch.argmin(candidates))] = 0.0
        mask[best] = 1.0
