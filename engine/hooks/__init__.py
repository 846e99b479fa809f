"""Run hooks: the cross-cutting options of a run, each in its own file, called at fixed points of the run's
life (as llm-compressor's modifiers are). A hook joins a run when its `applies(config)` is true; the run loop
calls every joined hook's events in RUN_HOOKS' order and never branches on an option's name itself. A hook reads
the run through a read-only RunView (engine/hooks/view.py) and never assigns to it, nor to the run's state but
its own data (self.own(state): RunState.hooks[its name]): an event returns what it changes (a RunChanges), which
the run applies before it calls the next hook (the loop's apply_changes). The masks pass through the hooks'
transforms in MASK_TRANSFORMS' order.

    ranks          data-parallel runs (torchrun): every rank's state compared after every step
    progressive    random-progressive: the budget raised in stages (a schedule, not an init metric)
    compensation   FLAP's bias compensation: removed inputs replaced by their calibration means
    multiples      every layer keeps a multiple of N units (llama.cpp blocks)
    time_budget    --time-budget MIN: the step count planned from the measured step time (before validation,
                   so the last planned step is validated)
    validation     held-out perplexity of the hard mask every --val-every steps (and of the init mask)
    early_stop     --early-stop N: a run whose hard mask and saturated scores stopped moving ends (after validation,
                   so it sees the latest check)
    best_val       --final-mask best-val: the best-validated step's scores are the final ones
    ranking        --within-layer-ranking init-metric: per-layer counts from the scores, units by the metric
    reconstruction --reconstruct: the final mask's kept columns refit by least squares for the evaluation and export

base.py holds the RunHook interface, view.py the read-only RunView.
"""

from __future__ import annotations

from .base import KEEP, RunChanges, RunHook
from .best_val import BestValFinal
from .compensation import BiasCompensation
from .early_stop import EarlyStop
from .multiples import UnitMultiples
from .progressive import ProgressiveSchedule
from .ranking import WithinLayerRanking
from .ranks import SameStateOnEveryRank
from .reconstruction import Reconstruction
from .time_budget import TimeBudget
from .validation import Validation
from .view import RunView

# every hook, in the order the run calls their events (each hook's RunChanges applied before the next is called)
RUN_HOOKS: list[type[RunHook]] = [SameStateOnEveryRank, ProgressiveSchedule, BiasCompensation, UnitMultiples, TimeBudget,
                                  Validation, EarlyStop, BestValFinal, WithinLayerRanking, Reconstruction]

# the mask transforms in the order they apply, at the end of a run: (transform, hook) read top to bottom is the
# way from the method's final scores to the weights evaluated and exported. Every hard mask the run takes from
# scores (its steps' reports, validation, early stopping, the init mask) is the budget's cut followed by the
# "hard_masks" rows alone.
MASK_TRANSFORMS: list[tuple[str, type[RunHook]]] = [
    ("final_scores", BestValFinal),  # --final-mask best-val: the best-validated step's scores
    ("final_scores", TimeBudget),  # --time-budget: the init mask's, when fewer steps fitted than pay
    ("hard_masks", UnitMultiples),  # (the budget's cut, then) each layer keeps a multiple of N units
    ("final_masks", WithinLayerRanking),  # --within-layer-ranking init-metric: each layer's units by the init metric
    ("final_masks", Reconstruction),  # --reconstruct: the final mask measured before its refit (results.json)
    ("weights_for", Reconstruction),  # --reconstruct: the kept columns refit for the evaluation and the export
]


def joined_transforms(hooks: list[RunHook]) -> list[tuple[str, RunHook]]:
    """(transform, hook) of a run's joined hooks, in MASK_TRANSFORMS' order (engine/run/masks.py applies them)."""
    return [(name, hook) for name, cls in MASK_TRANSFORMS for hook in hooks if type(hook) is cls]


__all__ = ["KEEP", "MASK_TRANSFORMS", "RUN_HOOKS", "RunChanges", "RunHook", "RunView", "joined_transforms"]
