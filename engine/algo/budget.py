"""Parameter accounting: what each unit weighs and what a set of masks removes, with whole layers nested over
the widths inside them (a removed layer's KV groups and channels are counted once, as part of the layer), and
the budgets a run's projection and hard masks hold: UnitBudget (the paper's: a fraction of each unit type's
count) and ParamBudget (a fraction of the decoder's parameters).

ParamBudget, widths only: the projection keeps the expected kept parameters sum(w s) at most at the budget
(policy.project_weighted_capped_simplex). Layers with widths (the joint method) nest: a layer kept with
probability p_l holds its fixed parameters c_l (norms, and any module no selected type prunes) and its
widths, so E[kept] = sum_l p_l (c_l + sum_{i in l} w_i s_i), bilinear. `project_nested` solves the
projection's optimality conditions with one multiplier v shared by both sides (s = clamp(z_s - v w p), p =
clamp(z_p - v a(s)), a fixed point per v, v by bisection), then projects p exactly given s, so E[kept] never
exceeds the budget after any step.

Hard masks (`hard_masks`): layers with p < 1/2 are removed (the least likely first, never more than the
budget); the widths of the kept layers then share what the budget leaves. Each width type's share is in
proportion to its expected kept parameters sum(w s) (the mix the scores hold: the init's split, then what
the method learned); inside a type the most
likely units are kept while they fit its share, then the most likely of any type that still fit, so the
mask lands below the budget by less than one unit's weight; every (layer, width type) keeps one unit."""

from __future__ import annotations

import torch

from ..errors import UserError
from .policy import project_weighted_capped_simplex
from ..model.unit_types import UNIT_TYPES, whole_layer_type


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
    kept_layers = torch.ones(adapter.num_layers, dtype=torch.bool)
    for u in layout.unit_types:
        if UNIT_TYPES[u].whole_layer:
            kept_layers = masks[u] > 0.5
    in_kept = sum(p for p, k in zip(layer_params(adapter), kept_layers.tolist()) if k)
    width = sum(n for u, n in by_type.items() if not UNIT_TYPES[u].whole_layer)
    # the mix: whole layers removed, and the width removed inside the layers kept
    return {"params_removed": total, "params_decoder": decoder, "removed_of_decoder": total / decoder,
            "removed_of_model": total / params_dense, "params_removed_by_unit_type": by_type,
            "layers_removed": int((~kept_layers).sum()), "width_removed_of_kept_layers": width / in_kept if in_kept else 0.0}


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

    def type_keeps(self, keep: float, comparable=None) -> dict[str, float]:
        return {u: keep for u in self.layout.unit_types}

    def init_mask_scores(self, scores):
        return None  # the init mask is the init metric's own top units, per pool

    def hard_masks(self, scores: dict[str, torch.Tensor], keep: float) -> dict[str, torch.Tensor]:
        return {u: self.layout.hard_mask(u, s, self.scope, keep) for u, s in scores.items()}


def scope_problem(unit_types: list[str], scope: str) -> str | None:
    """Why --budget params cannot take this scope for these unit types (None: it can): uniform removes the same
    fraction of every layer, and a layer is removed whole, so whole layers and widths together take global."""
    whole = any(UNIT_TYPES[u].whole_layer for u in unit_types)
    if whole and any(not UNIT_TYPES[u].whole_layer for u in unit_types) and scope != "global":
        return ("--budget params with whole layers and widths takes --scope global (uniform removes the same fraction "
                "of every layer, and layers are removed whole)")
    return None


class ParamBudget:
    """--budget params: the fraction r of the decoder layers' parameters is removed (embeddings and LM head never
    are), each unit weighing its parameters. Global scope: one pool over every selected unit type and layer (the
    method learns the mix of KV groups, channels and whole layers); uniform: one pool per layer over its widths,
    each layer losing the fraction r of its own parameters (its channels make up what its few KV groups round
    off); whole layers take global scope only. Projection and hard masks: the module's docstring."""

    def __init__(self, layout, scope: str, adapter):
        self.layout, self.scope, self.types = layout, scope, layout.unit_types
        whole = [u for u in self.types if UNIT_TYPES[u].whole_layer]
        self.layer_type = whole[0] if whole else None
        self.widths = [u for u in self.types if not UNIT_TYPES[u].whole_layer]
        if (problem := scope_problem(self.types, scope)) is not None:
            raise UserError(problem)
        self.weights = unit_weights(adapter, layout)
        self.layer_params = layer_params(adapter)
        self.decoder = sum(self.layer_params)
        self.width_layer = {u: torch.cat([torch.full((n,), i, dtype=torch.long) for i, n in enumerate(layout.sizes[u])])
                            for u in self.widths}
        # c_l: each layer's parameters outside the selected width units (what a kept layer holds whatever its widths)
        self.fixed = torch.tensor(self.layer_params, dtype=torch.float64) - layer_sizes(
            torch.zeros(len(self.layer_params), dtype=torch.float64), self.weights, self.width_layer,
            {u: torch.ones_like(self.weights[u]) for u in self.widths})
        self.nested, self.fixed_layers = bool(self.layer_type and self.widths), False  # (fixed: --layer-score-const 1)

    def kept_target(self, keep: float) -> float:
        """The kept decoder parameters a keep ratio allows, checked against what the selected units can remove."""
        removable = self.decoder if self.layer_type else float(sum(w.sum() for w in self.weights.values()))
        target = self.decoder * keep
        if self.decoder - target > removable + 1e-6:
            raise UserError(f"--budget params: removing {1 - keep:.0%} of the decoder's parameters takes more than "
                            f"the {', '.join(self.types)} hold ({removable / self.decoder:.0%} of them); lower --prune-ratio")
        return target

    def expected_kept(self, scores: dict[str, torch.Tensor]) -> float:
        """E[kept decoder parameters] under independent Bernoulli masks with these probabilities (nesting
        included): what the projection holds at the budget."""
        p = scores[self.layer_type].double() if self.layer_type else torch.ones(len(self.layer_params), dtype=torch.float64)
        return float((p * layer_sizes(self.fixed, self.weights, self.width_layer,
                                      {u: scores[u].double() for u in self.widths})).sum())

    def kept_params(self, masks: dict[str, torch.Tensor]) -> float:  # (a removed layer's widths not counted)
        return self.expected_kept({u: (m > 0.5).double() for u, m in masks.items()})

    def type_keeps(self, keep: float, comparable: dict[str, torch.Tensor] | None = None) -> dict[str, float]:
        """Each width type's keep ratio for its init map: the same share of every type's parameters, or given
        metrics that compare across types, the split of one ranking of them all (ranked_split). Layers: joint.py."""
        kept_w = self.kept_target(keep) - float(self.fixed.sum())
        if comparable:
            return ranked_split(comparable, self.weights, kept_w)
        removable = float(sum(self.weights[u].sum() for u in self.widths))
        return {u: min(1.0, max(0.0, kept_w / removable)) for u in self.widths}

    def project(self, scores: dict[str, torch.Tensor], keep: float) -> dict[str, torch.Tensor]:
        if self.nested and not self.fixed_layers:
            L = self.layer_type
            p, widths = project_nested(scores[L].double(), {u: scores[u].double() for u in self.widths}, self.weights,
                                       self.width_layer, self.fixed, self.kept_target(keep))
            return {L: p.to(scores[L].dtype), **{u: widths[u].to(scores[u].dtype) for u in self.widths}}
        if self.nested:  # fixed layers (--layer-score-const 1)
            return project_widths_given_layers(self, scores, self.kept_target(keep))
        target = self.kept_target(keep)
        out = {u: torch.empty_like(s) for u, s in scores.items()}
        for i, pool in enumerate(self._pools()):
            z, w = self._flat(pool, scores)
            if self.layer_type:  # layers alone: each weighs all its parameters
                budget = target
            elif self.scope == "global":
                budget = target - float(self.fixed.sum())
            else:
                budget = self._layer_target(i, keep)
            _unflatten(project_weighted_capped_simplex(z, w, max(budget, 0.0)), pool, out)
        return out

    def _layer_target(self, i: int, keep: float) -> float:
        """Uniform scope: the kept width parameters of layer i, so that it loses the fraction r of all of its."""
        target = self.layer_params[i] * keep - float(self.fixed[i])
        if target < 0:
            raise UserError(f"--budget params: removing {1 - keep:.0%} of layer {i}'s parameters takes more than its "
                            f"{', '.join(self.widths)} hold; lower --prune-ratio")
        return target

    def _pools(self) -> list[dict[str, slice]]:
        """[unit type -> slice of its flat vector]: one pool (global), or one per layer (uniform, widths only)."""
        if self.scope == "global" or self.layer_type:
            return [{u: slice(0, self.layout.total(u)) for u in self.types}]
        per_type = {u: self.layout.layer_slices(u) for u in self.types}
        return [{u: per_type[u][i] for u in self.types} for i in range(len(self.layer_params))]

    def _flat(self, pool, scores) -> tuple[torch.Tensor, torch.Tensor]:
        """A pool's scores and weights as one vector each (its unit types one after the other)."""
        return (torch.cat([scores[u][sl].double() for u, sl in pool.items()]),
                torch.cat([self.weights[u][sl] for u, sl in pool.items()]))

    def initial(self, scores: dict[str, torch.Tensor], keep: float) -> dict[str, torch.Tensor]:
        return self.project(scores, keep)  # each type's initial scores, brought onto the one parameter budget

    def init_mask_scores(self, scores):
        return {u: s.clone() for u, s in scores.items()}  # the initial probabilities hold each type's share

    def hard_masks(self, scores: dict[str, torch.Tensor], keep: float) -> dict[str, torch.Tensor]:
        target = self.kept_target(keep)
        masks = {u: torch.ones_like(s) for u, s in scores.items()}
        kept_layer = torch.ones(len(self.layer_params), dtype=torch.bool)
        if self.layer_type:
            kept_layer = layer_mask(scores[self.layer_type].double(), torch.tensor(self.layer_params, dtype=torch.float64),
                                    target, nested=bool(self.widths))
            masks[self.layer_type] = kept_layer.to(scores[self.layer_type].dtype)
        if not self.widths:
            return masks
        widths = {u: slice(0, self.layout.total(u)) for u in self.widths}
        pools = [widths] if self.scope == "global" else [{u: self.layout.layer_slices(u)[i] for u in self.widths}
                                                         for i in range(len(self.layer_params))]
        for i, pool in enumerate(pools):
            budget = target - float(self.fixed[kept_layer].sum()) if self.scope == "global" else self._layer_target(i, keep)
            s, w = self._flat(pool, scores)
            layer = torch.cat([self.width_layer[u][sl] for u, sl in pool.items()])
            _unflatten(_width_pool_mask(s, w, layer, kept_layer, [sl.stop - sl.start for sl in pool.values()], budget), pool, masks)
        return masks

def ranked_split(scores: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], kept: float) -> dict[str, float]:
    """Each type's kept share of its parameters when one ranking of all the units by score keeps the best while
    their weights fit in `kept` (FLAP's adaptive structure, on scores comparable across types)."""
    types = list(scores)
    s, w = torch.cat([scores[u].double() for u in types]), torch.cat([weights[u] for u in types])
    mask = torch.split(_keep_best_that_fit(s, w, kept, torch.zeros_like(s)), [scores[u].numel() for u in types])
    return {u: float((weights[u] * m).sum() / weights[u].sum()) for u, m in zip(types, mask)}


def layer_sizes(fixed: torch.Tensor, weights: dict[str, torch.Tensor], width_layer: dict[str, torch.Tensor],
                s: dict[str, torch.Tensor]) -> torch.Tensor:
    """a_l = c_l + sum_{i in l} w_i s_i: each layer's expected parameters if it is kept (c_l: its fixed ones)."""
    a = fixed.clone()
    for u, su in s.items():
        a.index_add_(0, width_layer[u], weights[u] * su)
    return a


def project_nested(zp: torch.Tensor, zs: dict[str, torch.Tensor], weights: dict[str, torch.Tensor],
                   width_layer: dict[str, torch.Tensor], fixed: torch.Tensor, target: float, bisections: int = 60,
                   inner: int = 3) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Layers p over widths s on one parameter budget: E[kept] = sum_l p_l a_l(s) <= target, a_l(s) = c_l +
    sum_{i in l} w_i s_i (bilinear). The projection's optimality conditions with one multiplier v for both:
    s = clamp(z_s - v w p_l(i), 0, 1), p = clamp(z_p - v a(s), 0, 1); for each v a few alternations reach
    their fixed point, v is found by bisection; then p is projected exactly given s
    (project_weighted_capped_simplex), so E[kept] never ends over the target."""
    def at(v: float):
        p = zp.clamp(0.0, 1.0)
        for _ in range(inner):
            s = {u: (zs[u] - v * weights[u] * p[width_layer[u]]).clamp(0.0, 1.0) for u in zs}
            p = (zp - v * layer_sizes(fixed, weights, width_layer, s)).clamp(0.0, 1.0)
        return p, s

    def kept(v: float) -> float:
        p, s = at(v)
        return float((p * layer_sizes(fixed, weights, width_layer, s)).sum())

    p, s = at(0.0)
    if kept(0.0) > target:
        lo, hi = 0.0, 1.0
        while kept(hi) > target and hi < 1e6:
            hi *= 4.0
        for _ in range(bisections):
            v = 0.5 * (lo + hi)
            lo, hi = (v, hi) if kept(v) > target else (lo, v)
        p, s = at(hi)
    a = layer_sizes(fixed, weights, width_layer, s)
    p, positive = p.clone(), a > 0  # (a layer of no parameters at all does not count)
    p[positive] = project_weighted_capped_simplex(zp[positive], a[positive], target)
    return p, s


def project_widths_given_layers(b: "ParamBudget", scores: dict[str, torch.Tensor], target: float) -> dict[str, torch.Tensor]:
    """Fixed layers (probabilities 0 or 1, kept as they are): the widths of the kept layers projected onto what
    `target` leaves after the kept layers' fixed parameters (E[kept] is then linear in the widths); the widths
    of removed layers are moot and left as they are."""
    L, out = b.layer_type, {u: s.clone() for u, s in scores.items()}
    kept = scores[L].double() >= 0.5
    out[L] = kept.to(scores[L].dtype)
    pool = {u: kept[b.width_layer[u]] for u in b.widths}
    z = torch.cat([scores[u].double()[pool[u]] for u in b.widths])
    w = torch.cat([b.weights[u][pool[u]] for u in b.widths])
    flat = project_weighted_capped_simplex(z, w, max(target - float(b.fixed[kept].sum()), 0.0))
    for u, part in zip(b.widths, torch.split(flat, [int(pool[u].sum()) for u in b.widths])):
        out[u][pool[u]] = part.to(out[u].dtype)
    return out


def layer_mask(p: torch.Tensor, params: torch.Tensor, target: float, nested: bool) -> torch.Tensor:
    """The kept layers of a hard mask. Layers alone: the most likely while their parameters fit the target.
    With widths (nested): those with p >= 1/2, the most likely of the others coming back while the removed ones
    would take more than the budget allows; at least one kept."""
    if not nested:
        return _keep_best_that_fit(p, params, target, torch.zeros_like(p)) > 0
    kept = p >= 0.5
    order = torch.argsort(p, descending=True, stable=True)
    if not bool(kept.any()):
        kept[order[0]] = True
    for i in order.tolist():
        if float(params[kept].sum()) >= target - 1e-6:
            break
        kept[i] = True
    return kept


def _width_pool_mask(s: torch.Tensor, w: torch.Tensor, layer: torch.Tensor, kept_layer: torch.Tensor,
                     type_sizes: list[int], target: float) -> torch.Tensor:
    """The hard mask of one pool of widths (its types' units one after the other, `type_sizes` of each; `layer`:
    each unit's layer): the units of removed layers are moot (the layer goes whole) and left kept; among the
    others each type's share of `target` is in proportion to its expected kept parameters sum(w s);
    inside a type the most likely units while they fit its share; then the most likely of any type that still
    fit; every (type, layer) keeps at least one unit."""
    kind = torch.cat([torch.full((n,), k, dtype=torch.long) for k, n in enumerate(type_sizes)])
    avail, out = kept_layer[layer], torch.ones_like(s)
    out[avail] = _pool_mask(s[avail], w[avail], kind[avail], kind[avail] * len(kept_layer) + layer[avail], max(target, 0.0))
    return out


def _pool_mask(s, w, kind, group, target) -> torch.Tensor:
    if not s.numel():
        return s.clone()
    types = int(kind.max()) + 1
    expected = torch.stack([(w * s * (kind == k)).sum() for k in range(types)])  # E[kept] of each type
    share = expected * (target / float(expected.sum())) if float(expected.sum()) > 0 else expected
    flat = torch.zeros_like(s)
    for k in range(types):
        idx = torch.nonzero(kind == k).flatten()
        order = idx[torch.argsort(s[idx], descending=True, stable=True)]
        flat[order[torch.cumsum(w[order], 0) <= float(share[k]) + 1e-6]] = 1.0
    flat = _keep_best_that_fit(s, w, target, flat)
    _, group = torch.unique(group, return_inverse=True)
    return _keep_one_per_group(s, w, target, flat, group)


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
