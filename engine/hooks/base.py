"""The hook interface. Each method is a no-op here; a hook overrides the points it needs."""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, ClassVar

import torch

if TYPE_CHECKING:  # annotations only
    from ..pruner import PruneRun
    from ..runstate import RunState, StepReport

RUN_HOOKS: list[type["RunHook"]] = []


def register_hook(cls: type["RunHook"]) -> type["RunHook"]:
    if cls in RUN_HOOKS:
        raise ValueError(f"run hook {cls.__name__} is already registered")
    RUN_HOOKS.append(cls)
    return cls


class RunHook:
    needs_data: ClassVar[bool] = False  # needs the init batches even when no init metric does
    final_evaluations: ClassVar[int] = 0  # evaluations it adds at the end (--time-budget keeps time for them)

    def __init__(self, run: "PruneRun"):
        self.run = run

    @staticmethod
    def applies(config) -> bool:
        """Does this run's config ask for the hook?"""
        raise NotImplementedError

    def on_setup(self) -> None:
        """The run is built (model, layout and data loaded): check the config against the model, set schedules."""

    def before_scores(self, batches: list[torch.Tensor]) -> None:
        """A fresh run: the init metric is computed on `batches`, the initial scores are not yet chosen (the
        joint method's mix is chosen on masked losses that this hook's masking already applies to)."""

    def on_init(self, state: "RunState", batches: list[torch.Tensor]) -> None:
        """A fresh state: scores initialised, the init perplexities not yet measured."""

    def on_resume(self, state: "RunState") -> None:
        """A state read back from the checkpoint."""

    def on_start(self, state: "RunState") -> None:
        """The steps are about to begin (after the init evaluations, or the checkpoint read back)."""

    def on_step(self, state: "RunState", report: "StepReport") -> None:
        """A step is done; its report is not yet written."""

    def hard_masks(self, masks: dict[str, torch.Tensor], scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every hard mask the run takes from scores (reports, validation, the final mask)."""
        return masks

    def final_scores(self, state: "RunState", scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The scores the final mask is cut from."""
        return scores

    def final_masks(self, masks: dict[str, torch.Tensor], metric: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The final masks, before the evaluation and the export."""
        return masks

    @contextmanager
    def weights_for(self, masks: dict[str, torch.Tensor], fill):
        """Around an evaluation of one hard mask whose model the run would export (the joint mix's candidates, the
        final mask, its export): the model as it should be for that mask, and the compensation fill to use (`fill`
        as given; ... is the run's own)."""
        yield fill

    def results(self) -> dict:
        """What this hook adds to results.json."""
        return {}
