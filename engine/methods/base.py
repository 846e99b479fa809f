"""The method interface. A method turns one calibration batch into a gradient of the loss with
respect to the keep probabilities s; the run loop then takes s <- proj_C(s - lr g) for every method.

    class MyMethod(Method):
        Options = MyOptions            # optional: the method's own settings (a dataclass)
        def gradient(self, state, batch) -> StepGradient: ...

A method that does not optimise (optimises = False) runs no steps; its final scores say which
units stay.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

if TYPE_CHECKING:  # the run loop hands itself in; methods never import it
    from ..pruner import PruneRun, RunState


@dataclass
class StepGradient:
    losses: torch.Tensor  # (N_s,) the calibration loss of each mask sample
    grads: dict[str, torch.Tensor]  # unit type -> d loss / d s (flat, float64)
    baseline: float  # the baseline to report (0 when there is none)


class Method:
    name: ClassVar[str]
    optimises: ClassVar[bool] = True
    Options: ClassVar[type | None] = None  # the dataclass of this method's own settings, if any

    def __init__(self, run: "PruneRun", options: Any = None):
        self.run = run
        self.options = options

    def gradient(self, state: "RunState", batch: torch.Tensor) -> StepGradient:
        raise NotImplementedError(f"method {self.name} does not optimise")

    def final_scores(self, state: "RunState") -> dict[str, torch.Tensor]:
        """The scores the final masks are cut from."""
        c = self.run.config
        return state.best_scores if c.final_mask == "best-val" else state.scores
