"""What a hook is handed of its run: a read-only view of the names in READS, not the PruneRun itself.
A read goes to the run as it is at that moment; an assignment is refused, since a hook's event returns what it
changes (a RunChanges, applied by PruneRun.apply_changes). tests/test_hook_state.py checks that every name a
hook's source reads of its run is in READS, and that no hook's source assigns to it."""

from __future__ import annotations

READS = frozenset({
    "config", "log", "world", "started", "phases",  # the settings, the log, the ranks, the clock and its phases
    "model", "adapter", "layout", "stats_memo",  # the model, its units, the dense statistics the init shares
    "sampler", "init_sampler", "val_batches", "mask_rng",  # the data streams and the held-out batches
    "ctx", "masks", "hard_masks", "keep_ratio_at", "masked_perplexity",  # masking, the masks and their perplexity
    "hooks",  # the other hooks (--time-budget reserves time for their final evaluations)
    "plan_steps",  # the steps the run's plan fits under --time-budget (its minimum of steps)
    "plan",  # the run's time plan, phase -> seconds (--time-budget: what a one-shot run's later phases need)
})


class RunView:
    __slots__ = ("_run",)

    def __init__(self, run):
        object.__setattr__(self, "_run", run)

    def __getattr__(self, name: str):
        if name in READS:
            return getattr(self._run, name)
        raise AttributeError(f"a hook reads run.{name}, which its view does not hand out (engine/hooks/view.py's READS)")

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a hook never assigns to its run (run.{name}): its event returns a RunChanges")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a hook never deletes from its run (run.{name})")
