"""Gumbel-softmax masks trained by back-propagation through the model (the paper's comparison:
it needs the backward pass that policy gradient avoids)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import UserError
from ..evaluate import token_loss
from ..policy import relaxed_bernoulli
from .registry import register_method
from .base import Method, StepGradient


@dataclass
class GumbelOptions:
    temperature: float = field(default=1.0, metadata={"help": "relaxation temperature at the first step"})
    final_temperature: float = field(default=0.1, metadata={"help": "temperature at the last step (annealed geometrically)"})
    straight_through: bool = field(default=False, metadata={"help": "hard 0/1 masks forward, relaxed gradient backward"})
    clamp: float = field(default=0.01, metadata={"help": "s clamped to [c, 1-c] in the relaxation's logits"})

    def validate(self, config=None) -> None:
        if not 0.0 < self.clamp < 0.5:
            raise UserError(f"gumbel clamp must be in (0, 0.5), got {self.clamp}")
        if not 0.0 < self.final_temperature <= self.temperature:
            raise UserError("gumbel temperatures must satisfy 0 < final temperature <= temperature")


@register_method("gumbel")
class GumbelSoftmax(Method):
    Options = GumbelOptions

    def gradient(self, state, batch):
        """d loss / d s through N_s relaxed samples (averaged), back-propagated through the model."""
        ctx, o = self.ctx, self.options
        tau = o.temperature * (o.final_temperature / o.temperature) ** (state.step / max(ctx.steps - 1, 1))
        leaves = {u: s.detach().float().clone().requires_grad_(True) for u, s in state.scores.items()}
        losses = torch.empty(ctx.num_samples, dtype=torch.float64)
        with torch.enable_grad():
            for j in range(ctx.num_samples):
                relaxed = {u: relaxed_bernoulli(s, tau, ctx.rng, o.straight_through, o.clamp) for u, s in leaves.items()}
                with ctx.masked(relaxed):
                    loss = token_loss(ctx.model, batch).mean()
                (loss / ctx.num_samples).backward()
                losses[j] = float(loss.detach())
        return StepGradient(losses, {u: leaves[u].grad.double().cpu() for u in leaves}, 0.0)
