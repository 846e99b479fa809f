"""The method interface. A method turns one calibration batch into a gradient of the loss with
respect to the keep probabilities s; the run loop then takes s <- proj_C(s - lr g) for every method.

    class MyMethod(Method):
        Options = MyOptions            # optional: the method's own settings (a dataclass)
        def gradient(self, state, batch) -> StepGradient: ...   # self.ctx: the StepContext, self.options

A method that does not optimise (optimises = False) runs no steps; its final scores say which
units stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:  # annotations only: methods never import the run
    from ..context import StepContext
    from ...run.state import RunState


@dataclass
class StepGradient:
    losses: torch.Tensor  # (N_s,) the calibration loss of each mask sample
    grads: dict[str, torch.Tensor]  # unit type -> d loss / d s (flat, float64)
    baseline: float  # the baseline to report (0 when there is none)


class Method:
    """A method is built once per run from the step context and its own options (its Options dataclass,
    filled from the config's method_options), and never sees the run itself."""

    name: ClassVar[str]
    optimises: ClassVar[bool] = True
    Options: ClassVar[type | None] = None  # the dataclass of this method's own settings, if any
    implies: ClassVar[dict] = {}  # run settings this method fixes (FLAP: its metric and compensation)
    # False: the run keeps next_scores' scores as they are, unprojected (pg-alloc: they are a view whose budget cut,
    # ctx.hard_masks, is the method's mask; a projection would move that cut)
    projects: ClassVar[bool] = True

    def __init__(self, ctx: "StepContext", options: Any = None):
        self.ctx = ctx
        self.options = options

    def gradient(self, state: "RunState", batch: torch.Tensor) -> StepGradient:
        raise NotImplementedError(f"method {self.name} does not optimise")

    @classmethod
    def progress(cls, config: dict, step: int) -> str | None:
        """A line on where the method is after `step` steps, for the app (None: the step count says it all)."""
        return None

    def next_scores(self, state: "RunState", grads: dict[str, torch.Tensor], lr: float) -> dict[str, torch.Tensor]:
        """The scores this step proposes, before the run projects them onto the budget: s - lr g (a method that
        sets its scores itself, as Bonsai's rounds do, overrides this)."""
        return {u: (s.double() - lr * grads[u]).float() for u, s in state.scores.items()}

    def final_scores(self, state: "RunState") -> dict[str, torch.Tensor]:
        """The scores the final masks are cut from (the best-val hook may take another step's instead)."""
        return state.scores
