"""The masks a run takes from its scores (its budget schedule, every hook's rounding and ranking) and what a
mask costs in perplexity."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .evaluate import batch_loss, perplexity
from .policy import LR_SCHEDULE_FNS, stage_at

if TYPE_CHECKING:  # annotations only
    from .pruner import PruneRun


class RunMasks:
    def __init__(self, run: "PruneRun"):
        self.run = run

    def keep_ratio_at(self, step: int) -> float:
        """The budget at 0-based `step`: the target, or the current stage's (progressive)."""
        return 1.0 - stage_at(self.run.stages, step, self.run.config.steps)[0]

    def lr_at(self, step: int) -> float:
        """The learning-rate schedule over the run, or over each stage (progressive)."""
        _, into, length = stage_at(self.run.stages, step, self.run.config.steps)
        return LR_SCHEDULE_FNS[self.run.config.lr_schedule](self.run.config.lr, into, length)

    def hard_masks(self, scores: dict[str, torch.Tensor], keep_ratio: float | None = None) -> dict[str, torch.Tensor]:
        keep = self.run.config.keep_ratio if keep_ratio is None else keep_ratio
        masks = self.run.budget.hard_masks(scores, keep)
        for hook in self.run.hooks:
            masks = hook.hard_masks(masks, scores)
        return masks

    def final_masks(self, scores: dict[str, torch.Tensor], metric: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The deterministic final masks: the top keep ratio of the scores per pool (then the hooks')."""
        masks = self.hard_masks(scores)
        for hook in self.run.hooks:
            masks = hook.final_masks(masks, metric)
        return masks

    def layer_masks(self, flat: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        return {u: self.run.layout.split(u, m) for u, m in flat.items()}

    def masked_perplexity(self, flat_masks: dict[str, torch.Tensor] | None, what: str, fill=...) -> float:
        """WikiText perplexity of the dense model (None) or under one hard mask, computed by the run's executor
        (the sliced one computes only the kept units): exp of the mean over windows of each window's mean loss.
        fill: compensation means other than the run's (None: none)."""
        self.run.log(f"evaluating {what} perplexity on {self.run.windows.shape[0]} windows of {self.run.config.eval_seqlen} tokens")

        def masked_loss(model, batch):  # the executor gives the batch's mean; every row counts it once
            return self.run.ctx.losses({u: m[None] for u, m in flat_masks.items()}, batch, fill).expand(batch.shape[0])

        ppl = perplexity(self.run.model, self.run.windows, self.run.config.eval_batch_size, self.run.progress,
                         batch_loss if flat_masks is None else masked_loss)
        self.run.log(f"{what} perplexity: {ppl:.3f}")
        return ppl
