"""Run hooks: the cross-cutting options of a run, each in its own file, called at fixed points of the run's
life (as llm-compressor's modifiers are). A hook joins a run when its `applies(config)` is true; the run loop
calls every joined hook in RUN_HOOKS' order and never branches on an option's name itself.

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
"""

from __future__ import annotations

from .base import RUN_HOOKS, RunHook, register_hook
from . import ranks, progressive, compensation, multiples, time_budget, validation, early_stop, best_val, ranking, reconstruction  # noqa: E402,F401  (in this order)

__all__ = ["RUN_HOOKS", "RunHook", "register_hook"]
