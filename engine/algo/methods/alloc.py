"""Policy gradient over each layer's allocation (`--method pg-alloc`): forward passes only.

PG over single units estimates a gradient in tens of thousands of dimensions (47k MLP channels, 90 KV groups and
30 layers of SmolLM2-135M) from a few hundred sampled masks; what it can learn there is how much each layer keeps,
not which unit inside it. This method learns only that: one logit offset mu per (unit type, layer), and the
scores are always a view of the scores s0 the first step starts from,

    s(mu)_i = sigmoid(logit(s0_i) + mu[type(i), layer(i)]),

so the order of the units inside a (type, layer) is the start's, never changed. A step draws N_s offset vectors
in antithetic pairs b = mu +- sigma eps (eps ~ N(0, I), from the run's mask generator); each sample's mask is the
run's own budget cut of the shifted scores (ctx.hard_masks(s(b))), so every sample meets the budget as the final
mask does; the losses are the run's rewards of these masks. The gradient of E[L] in mu is estimated as

    g = mean_j (L_j - delta) (b_j - mu) / sigma^2 = mean over pairs of (L_+ - L_-) eps / (2 sigma)

(delta, the step's mean loss, is the baseline reported; within an antithetic pair any baseline that is the same
for both samples cancels exactly, so no other baseline changes the estimate, and a leave-one-out baseline, which
includes the partner's loss, would only scale it by N_s / (N_s - 1), which the scale-free step ignores)

and the step is scale-free, mu <- mu - alpha sigma lr_t g / rms(g), lr_t the run's learning-rate schedule over its
first step's (1 with --lr-schedule constant). The scores the step returns are s(mu), which the run does not project
(Method.projects): their budget cut is the method's mask, and a projection would move it. The final mask is then
ctx.hard_masks(s(mu)) for the last mu (or best-val's step's).

An offset is learned only where it can change a mask: its (type, layer) holds a unit strictly between 0 and 1
(a unit at exactly 0 or 1 stays there, as PG never flips a saturated unit), and for a width type its layer is not
removed whole at the start (a layer at exactly 0: the joint preset's fixed layers). The others stay 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...errors import UserError
from ...settings.fields import setting
from ...model.unit_types import UNIT_TYPES
from .base import Method, StepGradient
from .registry import register_method


# --- the pure parts ---------------------------------------------------------------------------------------------
def learned_layers(scores: dict[str, torch.Tensor], sizes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """unit type -> (layers,) bool: which (type, layer) offsets can change a mask (the module's docstring): the
    group holds a unit strictly between 0 and 1, and for a width type, its layer's whole-layer score is not 0."""
    removed = None
    for u, s in scores.items():
        if UNIT_TYPES[u].whole_layer:
            removed = s.double() == 0.0
    out = {}
    for u, s in scores.items():
        s, n = s.double(), torch.tensor(sizes[u])
        layer = torch.repeat_interleave(torch.arange(len(n)), n)
        free = torch.zeros(len(n), dtype=torch.bool).index_fill_(0, layer[(s > 0) & (s < 1)], True)
        if removed is not None and not UNIT_TYPES[u].whole_layer:
            free &= ~removed
        out[u] = free
    return out


def offset_index(sizes: dict[str, list[int]], learned: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """unit type -> (units,) the index of each unit's offset in the flat mu (the learned (type, layer) pairs, type
    after type, layer after layer), -1 for a unit whose offset is not learned."""
    out, start = {}, 0
    for u, free in learned.items():
        ids = torch.full((len(free),), -1, dtype=torch.long)
        ids[free] = torch.arange(start, start + int(free.sum()))
        start += int(free.sum())
        out[u] = torch.repeat_interleave(ids, torch.tensor(sizes[u], dtype=torch.long))
    return out


def expand_offsets(mu: torch.Tensor, index: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The flat offsets (D,) as one value per unit (0 where index is -1)."""
    padded = torch.cat([mu.double(), torch.zeros(1, dtype=torch.float64)])  # index -1 reads the 0
    return {u: padded[ids] for u, ids in index.items()}


def shifted_scores(base: dict[str, torch.Tensor], index: dict[str, torch.Tensor], mu: torch.Tensor) -> dict[str, torch.Tensor]:
    """s(mu) = sigmoid(base + mu[index]) per unit type, float64 (base: logit(s0), +-inf for a unit at 0 or 1,
    which stays there)."""
    return {u: torch.sigmoid(base[u] + shift) for u, shift in expand_offsets(mu, index).items()}


def antithetic_offsets(mu: torch.Tensor, sigma: float, n: int, generator: torch.Generator) -> torch.Tensor:
    """(n, D) offset samples in antithetic pairs: rows 2k and 2k + 1 are mu + sigma eps_k and mu - sigma eps_k,
    eps_k ~ N(0, I) from `generator`. n must be even."""
    if n % 2:
        raise ValueError("antithetic offsets come in pairs: n must be even")
    eps = torch.randn((n // 2, mu.numel()), generator=generator, dtype=torch.float64)
    return torch.stack([mu + sigma * eps, mu - sigma * eps], dim=1).reshape(n, mu.numel())


def offset_gradient(offsets: torch.Tensor, mu: torch.Tensor, sigma: float, losses: torch.Tensor,
                    baseline: torch.Tensor | float = 0.0) -> torch.Tensor:
    """The Gaussian score-function estimate of d E[L] / d mu: mean_j (L_j - baseline_j) (b_j - mu) / sigma^2 (for
    antithetic offsets, a baseline equal within each pair cancels exactly)."""
    adv = losses.double() - torch.as_tensor(baseline, dtype=torch.float64)
    return (adv[:, None] * (offsets - mu)).mean(0) / sigma ** 2


def scale_free_step(mu: torch.Tensor, g: torch.Tensor, size: float) -> torch.Tensor:
    """mu - size g / rms(g): every step moves the offsets by `size` in root mean square, whatever the losses' scale
    (no move when g is 0)."""
    rms = float(g.pow(2).mean().sqrt()) if g.numel() else 0.0
    return mu if rms == 0.0 else mu - size * g / rms


def within_radius(mu: torch.Tensor, radius: float | None) -> torch.Tensor:
    """The trust region around the init (mu = 0: the start's scores): mu scaled back onto the ball of root mean
    square `radius` when it lies outside (None: no region)."""
    if radius is None or not mu.numel():
        return mu
    rms = float(mu.pow(2).mean().sqrt())
    return mu if rms <= radius else mu * (radius / rms)


# --- the method -------------------------------------------------------------------------------------------------
@dataclass
class AllocOptions:
    """pg-alloc's own settings."""

    sigma: float = setting(0.1, minimum=0.0, exclusive=True, flag="--alloc-sigma", label="Offset noise sigma",
                           help="the standard deviation of the sampled per-(unit type, layer) logit offsets around "
                                "their mean (0.1 moves about a tenth of a layer's channels a sample)")
    step: float = setting(0.25, minimum=0.0, exclusive=True, flag="--alloc-step", label="Offset step alpha",
                          help="each step moves the offsets by alpha * sigma (root mean square over the offsets), "
                               "times the learning-rate schedule's factor")
    radius: float | None = setting(None, minimum=0.0, exclusive=True, flag="--alloc-radius", label="Trust radius",
                                   help="a trust region around the init: the offsets' root mean square is kept at "
                                        "most this (after each step; default: none). 24 steps at the default alpha "
                                        "and sigma move it by at most 0.6")

    def validate(self, config=None) -> None:
        n = getattr(config, "num_mask_samples", None)
        if n is not None and n % 2:
            raise UserError(f"pg-alloc draws its offsets in antithetic pairs: num mask samples must be even, got {n}")
        lr, default_lr = getattr(config, "lr", None), getattr(type(config), "lr", None)  # (a dataclass's default)
        if lr is not None and default_lr is not None and lr != default_lr:  # (next_scores: only lr / lr0 is read)
            raise UserError(f"pg-alloc's step is scale-free: --lr {lr:g} would change nothing (only the schedule's "
                            f"shape counts); set its step with --alloc-step (alpha, default {type(self).step:g}) or "
                            "--alloc-sigma")
        if getattr(config, "init", None) == "random-progressive":
            raise UserError("pg-alloc cuts every sample at the run's target budget: it does not take "
                            "--init random-progressive's rising budget")


@register_method("pg-alloc")
class LayerAllocation(Method):
    Options = AllocOptions
    projects = False  # its scores are a view; their budget cut (ctx.hard_masks) is its mask

    def gradient(self, state, batch):
        ctx, o, m = self.ctx, self.options, self._start(state)
        offsets = antithetic_offsets(m["mu"], o.sigma, ctx.num_samples, ctx.rng)
        cuts = [ctx.hard_masks(shifted_scores(m["base"], m["index"], b)) for b in offsets]
        samples = {u: torch.stack([c[u] for c in cuts]).float() for u in state.scores}  # (0/1, float32 as PG's)
        losses = ctx.rewards(samples, batch)
        shown = float(losses.mean())  # (the baseline: it cancels within each antithetic pair)
        g = offset_gradient(offsets, m["mu"], o.sigma, losses, shown)
        # grads: each unit carries the estimate d E[L] / d mu of its (type, layer) offset (0 where none is learned);
        # next_scores reads them back, the run's reports do not use them
        grads = {u: torch.where(m["index"][u] >= 0, v, 0.0) for u, v in expand_offsets(g, m["index"]).items()}
        return StepGradient(losses, grads, shown)

    def next_scores(self, state, grads, lr):
        m = state.method_state["alloc"]
        g = torch.zeros_like(m["mu"])
        for u, ids in m["index"].items():
            g[ids[ids >= 0]] = grads[u][ids >= 0].double()
        lr0 = m.setdefault("lr0", float(lr))  # the schedule's factor: this step's rate over the first step's
        factor = lr / lr0 if lr0 > 0 else 1.0
        m["mu"] = within_radius(scale_free_step(m["mu"], g, self.options.step * self.options.sigma * factor),
                                self.options.radius)
        return self.scores(state)

    def scores(self, state) -> dict[str, torch.Tensor]:
        """s(mu) for the current mu (float64: the order inside a layer is the start's, no float32 ties)."""
        m = state.method_state["alloc"]
        return shifted_scores(m["base"], m["index"], m["mu"])

    def _start(self, state) -> dict:
        """The method's state, made at the first step from the scores it starts from (kept in the run state,
        checkpointed): the base logits, each unit's offset index, mu = 0."""
        if "alloc" not in state.method_state:
            sizes = self.ctx.layout.sizes
            learned = learned_layers(state.scores, sizes)
            state.method_state["alloc"] = {
                "base": {u: torch.logit(s.double()) for u, s in state.scores.items()},
                "index": offset_index(sizes, learned),
                "mu": torch.zeros(sum(int(x.sum()) for x in learned.values()), dtype=torch.float64)}
        return state.method_state["alloc"]
