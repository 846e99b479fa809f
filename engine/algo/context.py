"""What a method sees of a run: the narrow context of one optimisation step.

A method never holds the run. It gets the model's adapter and unit layout, an executor that turns
mask samples into calibration losses, a way to run the model under (soft) masks for methods that
back-propagate, the mask rng, and the compensation means once the run has measured them (comp_means).

    ctx.losses(samples, batch)      # {unit type: (N_s, units) 0/1} -> (N_s,) mean token losses
    ctx.rewards(samples, batch)     # the same samples scored by the run's reward (--reward), as the steps are
                                    # (--step-refit: each under its own least-squares refit)
    with ctx.masked(masks): ...     # {unit type: (units,) float} applied as hooks for the block
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from ..model.masking import MaskHooks
from .rewards import CrossEntropy, Reward

if TYPE_CHECKING:  # annotations only
    from ..model.arch import ModelAdapter
    from ..model.units import UnitLayout

# The one sentinel: a value not given, so the run's own stays (a comp_means argument: the run's compensation means; a
# RunChanges field: the run's value unchanged). Distinct from None, which is a value (no compensation, no limit).
KEEP: Any = type("Keep", (), {"__repr__": lambda self: "KEEP"})()


@dataclass
class StepContext:
    model: torch.nn.Module  # the unmodified transformers model (hooks apply the masks)
    adapter: "ModelAdapter"
    layout: "UnitLayout"  # of the pruned unit types
    executor: Callable  # (hooks, layout, batch, samples, comp_means) -> (N_s,) losses: sequential, batched or sliced
    rng: torch.Generator  # the mask samples' generator (part of every checkpoint)
    num_samples: int  # N_s masks per step
    steps: int  # the steps of the whole run (schedules inside a method, e.g. Gumbel's temperature)
    comp_means: dict[str, list[torch.Tensor]] | None = None  # bias compensation's means, once measured
    hard_masks: Callable | None = None  # {unit type: scores} -> the run's hard masks of them at its budget
    reward: Reward = field(default_factory=CrossEntropy)  # --reward: what a sample's score is (engine/algo/rewards.py)
    # --step-refit: {unit type: (units,) hard mask} -> a context manager under which the model carries that mask's
    # refit weights, yielding its compensation means (RunMasks.weights); None: samples are scored with the compensation only
    weights: Callable | None = None
    # with weights: the executor of this process's own samples, and (n, value) -> (n,) value(j) of every sample j,
    # each rank of a torchrun computing its share (World.spread); one process: the executor, and all of them
    own_executor: Callable | None = None
    spread: Callable | None = None

    def losses(self, samples: dict[str, torch.Tensor], batch: torch.Tensor, comp_means=KEEP) -> torch.Tensor:
        """Each sample's mean token cross-entropy on the batch (the evaluations' loss, whatever the reward).
        comp_means: the compensation means to use instead of the run's (None: none)."""
        with MaskHooks(self.adapter) as hooks:
            return self.executor(hooks, self.layout, batch, samples, self.comp_means if comp_means is KEEP else comp_means)

    def rewards(self, samples: dict[str, torch.Tensor], batch: torch.Tensor, comp_means=KEEP, refit: bool = True,
                reward=None) -> torch.Tensor:
        """Each sample's score under the run's reward (--reward: ce is `losses`; kl compares with the dense model,
        whose forward on this batch runs first, without the masks, and is shared by the samples), or under `reward`.
        refit=False: the model as it is (no refit, or a caller that holds the sample's refit), never a refit per
        sample."""
        score = (reward or self.reward).scorer(self.model, batch)
        if self.weights is None or not refit:
            with MaskHooks(self.adapter) as hooks:
                return self.executor(hooks, self.layout, batch, samples, self.comp_means if comp_means is KEEP else comp_means, score)
        executor = self.own_executor or self.executor

        def one(j: int) -> torch.Tensor:  # (--step-refit: each sample scored under its own refit, a solve and a forward)
            with self.weights({u: m[j] for u, m in samples.items()}) as refit, MaskHooks(self.adapter) as hooks:
                return executor(hooks, self.layout, batch, {u: m[j:j + 1] for u, m in samples.items()},
                                self.comp_means if refit is KEEP else refit, score)

        n = next(iter(samples.values())).shape[0]
        return self.spread(n, one) if self.spread else torch.cat([one(j) for j in range(n)])

    @contextmanager
    def masked(self, masks: dict[str, torch.Tensor], comp_means=KEEP):
        """comp_means: as for `losses`."""
        with MaskHooks(self.adapter) as hooks:
            hooks.set({u: self.layout.split(u, m) for u, m in masks.items()}, self.comp_means if comp_means is KEEP else comp_means)
            yield
