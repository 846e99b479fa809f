"""Parameter accounting: what each unit weighs and what a set of masks removes, with whole layers nested over
the widths inside them (a removed layer's KV groups and channels are counted once, as part of the layer)."""

from __future__ import annotations

import torch

from .errors import UserError
from .unit_types import UNIT_TYPES, whole_layer_type


def unit_weights(adapter, layout) -> dict[str, torch.Tensor]:
    """unit type -> (units,) the parameters each unit carries, flat in the layout's order."""
    out = {}
    for u in layout.unit_types:
        per_layer = UNIT_TYPES[u].unit_params(adapter)
        out[u] = torch.cat([torch.full((n,), float(w), dtype=torch.float64) for n, w in zip(layout.sizes[u], per_layer)])
    return out


def layer_params(adapter) -> list[int]:
    """The parameters of each decoder layer (what removing it as a whole-layer unit takes away)."""
    return whole_layer_type().unit_params(adapter)


def decoder_params(adapter) -> int:
    return sum(layer_params(adapter))


def removed_parameters(layout, weights: dict[str, torch.Tensor], masks: dict[str, torch.Tensor]) -> dict[str, int]:
    """unit type -> parameters its removed units take away. A width unit inside a removed layer is not counted
    for its type (the layer's count holds it)."""
    kept_layer = None
    for u in layout.unit_types:
        if UNIT_TYPES[u].whole_layer:
            kept_layer = masks[u] > 0.5  # (layers,)
    out = {}
    for u in layout.unit_types:
        removed = masks[u] <= 0.5
        if kept_layer is not None and not UNIT_TYPES[u].whole_layer:
            in_kept = torch.cat([kept_layer[i].expand(n) for i, n in enumerate(layout.sizes[u])])
            removed = removed & in_kept
        out[u] = int(weights[u][removed].sum())
    return out


def removal_report(adapter, layout, masks: dict[str, torch.Tensor], params_dense: int) -> dict:
    """What a run's final masks removed: parameters, as a share of the decoder layers and of the whole model
    (embeddings and the LM head are never pruned), and each unit type's part."""
    by_type = removed_parameters(layout, unit_weights(adapter, layout), masks)
    total, decoder = sum(by_type.values()), decoder_params(adapter)
    return {"params_removed": total, "params_decoder": decoder, "removed_of_decoder": total / decoder,
            "removed_of_model": total / params_dense, "params_removed_by_unit_type": by_type}


# --- budgets: what the projection keeps and the hard mask cuts to ----------------------------------------------
class UnitBudget:
    """--budget units (the paper's): each unit type loses the fraction r of its own count, per pool (one pool
    across layers under global scope, one per layer under uniform; whole layers always one pool)."""

    def __init__(self, layout, scope: str, adapter=None):
        self.layout, self.scope = layout, scope

    def project(self, scores: dict[str, torch.Tensor], keep: float) -> dict[str, torch.Tensor]:
        return {u: self.layout.project(u, s, self.scope, keep) for u, s in scores.items()}

    def initial(self, scores: dict[str, torch.Tensor], keep: float) -> dict[str, torch.Tensor]:
        return scores  # each unit type's initial scores are already on its own budget

    def hard_masks(self, scores: dict[str, torch.Tensor], keep: float) -> dict[str, torch.Tensor]:
        return {u: self.layout.hard_mask(u, s, self.scope, keep) for u, s in scores.items()}


class ParamBudget:
    """--budget params: the fraction r of the decoder layers' parameters is removed (embeddings and the LM head
    are never pruned). Each unit weighs its parameters (unit_weights). Global scope: one pool over every
    selected unit type and layer, so the method also learns how to split the cut between KV groups and
    channels; uniform: one pool per layer over its KV groups and channels, each layer losing the fraction r of
    its own parameters (its channels make up what its few KV groups round off).

    The projection keeps the expected kept parameters sum(w s) at the budget (policy.project_weighted_capped_
    simplex); the hard mask keeps the best-scored units while their parameters fit, then the best of the rest
    that still fit, so it lands below the budget by less than the lightest unit's weight; every layer keeps at
    least one unit of each width type."""

    def __init__(self, layout, scope: str, adapter):
        if any(UNIT_TYPES[u].whole_layer for u in layout.unit_types) and len(layout.unit_types) > 1:
            raise UserError("--budget params with whole layers and widths together is not supported yet (a removed "
                            "layer's widths nest inside it); prune layers alone, or heads and channels, or use --budget units")
        self.layout, self.scope = layout, scope
        self.weights = unit_weights(adapter, layout)
        self.layer_params = layer_params(adapter)
        self.types = layout.unit_types
        self.pools = self._pools()

    def _pools(self) -> list[tuple[dict[str, slice], int]]:
        """[(unit type -> slice of its flat vector, decoder parameters the pool's layers hold)]."""
        whole = any(UNIT_TYPES[u].whole_layer for u in self.types)
        if self.scope == "global" or whole:
            return [({u: slice(0, self.layout.total(u)) for u in self.types}, sum(self.layer_params))]
        per_type = {u: self.layout.layer_slices(u) for u in self.types}
        return [({u: per_type[u][i] for u in self.types}, self.layer_params[i]) for i in range(len(self.layer_params))]

    def _kept_target(self, pool, decoder: int, keep: float) -> float:
        prunable = sum(float(self.weights[u][sl].sum()) for u, sl in pool.items())
        target = prunable - (1.0 - keep) * decoder
        if target <= 0:
            raise UserError(f"--budget params: removing {1 - keep:.0%} of the decoder's parameters takes more than "
                            f"the {', '.join(self.types)} hold ({prunable / decoder:.0%} of them); lower --prune-ratio")
        return target

    def project(self, scores: dict[str, torch.Tensor], keep: float) -> dict[str, torch.Tensor]:
        from .policy import project_weighted_capped_simplex

        out = {u: torch.empty_like(s) for u, s in scores.items()}
        for pool, decoder in self.pools:
            z, w = self._flat(pool, scores)
            _unflatten(project_weighted_capped_simplex(z, w, self._kept_target(pool, decoder, keep)), pool, out)
        return out

    def _flat(self, pool, scores) -> tuple[torch.Tensor, torch.Tensor]:
        """A pool's scores and weights as one vector each (its unit types one after the other)."""
        return (torch.cat([scores[u][sl].double() for u, sl in pool.items()]),
                torch.cat([self.weights[u][sl] for u, sl in pool.items()]))

    def initial(self, scores: dict[str, torch.Tensor], keep: float) -> dict[str, torch.Tensor]:
        return self.project(scores, keep)  # each type's initial scores, brought onto the one parameter budget

    def hard_masks(self, scores: dict[str, torch.Tensor], keep: float) -> dict[str, torch.Tensor]:
        masks = {u: torch.zeros_like(s) for u, s in scores.items()}
        for pool, decoder in self.pools:
            target = self._kept_target(pool, decoder, keep)
            s, w = self._flat(pool, scores)
            group = self._groups(pool)  # (units,) one id per (unit type, layer): each keeps at least one unit
            flat = _keep_best_that_fit(s, w, target, torch.zeros_like(s))
            _unflatten(flat if group is None else _keep_one_per_group(s, w, target, flat, group), pool, masks)
        return masks

    def _groups(self, pool) -> torch.Tensor | None:
        """The (unit type, layer) group of every unit of a pool of widths; None for whole layers."""
        if any(UNIT_TYPES[u].whole_layer for u in pool):
            return None
        ids, k = [], 0
        for u, sl in pool.items():
            for layer in self.layout.layer_slices(u):
                lo, hi = max(layer.start, sl.start), min(layer.stop, sl.stop)
                if hi > lo:
                    ids.append(torch.full((hi - lo,), k, dtype=torch.long))
                    k += 1
        return torch.cat(ids)


def _unflatten(flat: torch.Tensor, pool: dict[str, slice], out: dict[str, torch.Tensor]) -> None:
    """Write a pool's vector back into each unit type's flat vector."""
    start = 0
    for u, sl in pool.items():
        n = sl.stop - sl.start
        out[u][sl] = flat[start:start + n].to(out[u].dtype)
        start += n


def _keep_best_that_fit(s: torch.Tensor, w: torch.Tensor, target: float, flat: torch.Tensor) -> torch.Tensor:
    """Add to the kept units `flat` the best-scored others while their weights fit under target: the longest
    prefix by score, then the best of the rest that still fit (a channel fills what a KV group leaves)."""
    flat = flat.clone()
    left = target - float((w * flat).sum())
    rest = torch.sort(torch.where(flat > 0, torch.full_like(s, -float("inf")), s), descending=True, stable=True).indices
    rest = rest[flat[rest] == 0]
    fits = torch.cumsum(w[rest], 0) <= left + 1e-6
    flat[rest[fits]] = 1.0
    left -= float(w[rest[fits]].sum())
    rest = rest[~fits]
    while rest.numel():
        ok = torch.nonzero(w[rest] <= left + 1e-6)
        if not ok.numel():
            break
        i = rest[int(ok[0])]
        flat[i], left = 1.0, left - float(w[i])
        rest = rest[int(ok[0]) + 1:]
    return flat


def _keep_one_per_group(s, w, target, flat, group) -> torch.Tensor:
    """Every group (a layer's KV groups, a layer's channels) keeps at least its best unit; the lowest-scored kept
    units of groups that keep more than one make room, then the best of the rest that fit fill up again."""
    flat = flat.clone()
    for g in range(int(group.max()) + 1):
        members = torch.nonzero(group == g).flatten()
        if float(flat[members].sum()) == 0:
            flat[members[int(torch.argmax(s[members]))]] = 1.0
    while float((w * flat).sum()) > target + 1e-6:
        counts = torch.bincount(group, weights=flat, minlength=int(group.max()) + 1)
        removable = (flat > 0) & (counts[group] > 1)
        if not bool(removable.any()):
            break  # one unit per group is more than the budget: keep that floor
        flat[int(torch.argmin(torch.where(removable, s, torch.full_like(s, float("inf")))))] = 0.0
    return _keep_best_that_fit(s, w, target, flat)


BUDGETS = {"units": UnitBudget, "params": ParamBudget}
