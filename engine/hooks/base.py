"""The hook interface. Each method is a no-op here; a hook overrides the points it needs.

A hook reads its run but never assigns to it, nor to the run's state but its own data, `self.own(state)`
(RunState.hooks[its name]; tests/test_hook_state.py reads every hook's source for that): an event that changes the
run returns a RunChanges, which the run applies in one place (the loop's apply_changes, engine/run/loop.py)
before it calls the next hook. The order of the events' hooks is engine.hooks.RUN_HOOKS; the order of the mask
transforms (hard_masks, final_scores, final_masks, weights_for) is engine.hooks.MASK_TRANSFORMS."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from ..algo.context import KEEP  # noqa: F401  (a RunChanges field left KEEP changes nothing)
if TYPE_CHECKING:  # annotations only
    from ..run.state import RunState, StepReport
    from .view import RunView



@dataclass(frozen=True)
class RunChanges:
    """What a hook's event changes in its run (a field left KEEP changes nothing); the loop's apply_changes applies it."""

    steps: Any = KEEP  # the run's planned step count, ctx.steps (--time-budget re-plans it, --early-stop ends it)
    stages: Any = KEEP  # the budget's stages [(from step, prune ratio)] (random-progressive)
    unit_metric: Any = KEEP  # the init metric of the widths (random-progressive: random)
    comp_means: Any = KEEP  # the compensation means every masked forward uses, ctx.comp_means (None: none)


class RunHook:
    needs_data: ClassVar[bool] = False  # needs the init batches even when no init metric does
    final_evaluations: ClassVar[int] = 0  # evaluations it adds at the end (--time-budget keeps time for them)

    def __init__(self, run: "RunView"):
        self.run = run  # the read-only view of the run (engine/hooks/view.py)

    @property
    def name(self) -> str:
        """The hook's name: its module's (validation, time_budget, ...), the key of its data in RunState.hooks."""
        return type(self).__module__.rsplit(".", 1)[-1]

    def own(self, state: "RunState") -> dict:
        """This hook's own data in the run's state (state.hooks[its name], made on first use): the one part of the
        state a hook writes; the checkpoint keeps it."""
        return state.hooks.setdefault(self.name, {})

    @staticmethod
    def applies(config) -> bool:
        """Does this run's config ask for the hook?"""
        raise NotImplementedError

    # --- events: each may return a RunChanges (None: the run is unchanged) ------------------------------------
    def on_setup(self) -> RunChanges | None:
        """The run is built (model, layout and data loaded): check the config against the model, set schedules."""

    def before_scores(self, batches: list[torch.Tensor]) -> RunChanges | None:
        """A fresh run: the init metric is computed on `batches`, the initial scores are not yet chosen (the
        joint method's mix is chosen on masked losses that this hook's masking already applies to)."""

    def statistics_wanted(self, batches: list[torch.Tensor]) -> list:
        """A fresh run, before the init metric: the readers (engine/algo/statistics.py's Statistic) this hook wants in
        the run's one statistics pass over the init stream, whose first batches are `batches` (each reader says
        how many of the stream's batches it reads); the pass fills them before before_scores."""
        return []

    def planned_statistics(self, batches: list[torch.Tensor]) -> list:
        """What statistics_wanted would return, for the plan's look into the statistics cache before the run's
        work: readers that are only asked who they are (nothing of the hook is kept or changed by the call)."""
        return self.statistics_wanted(batches)

    def on_init(self, state: "RunState", batches: list[torch.Tensor]) -> RunChanges | None:
        """A fresh state: scores initialised, the init perplexities not yet measured."""

    def on_resume(self, state: "RunState") -> RunChanges | None:
        """A state read back from the checkpoint."""

    def on_start(self, state: "RunState") -> RunChanges | None:
        """The steps are about to begin (after the init evaluations, or the checkpoint read back)."""

    def on_step(self, state: "RunState", report: "StepReport") -> RunChanges | None:
        """A step is done; its report is not yet written (the run sets its total_steps after every hook's changes)."""

    # --- mask transforms: applied in engine.hooks.MASK_TRANSFORMS' order ------------------------------------------

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
    def weights_for(self, masks: dict[str, torch.Tensor], comp_means):
        """Around an evaluation of one hard mask whose model the run would export (the joint mix's candidates, the
        final mask, its export): the model as it should be for that mask, and the compensation means to use (`comp_means`
        as given; ... is the run's own)."""
        yield comp_means

    edits_weights: bool = False  # weights_for edits the model's weights (RunMasks sets its perplexities aside)

    def results(self) -> dict:
        """What this hook adds to results.json."""
        return {}
