"""What a hook is handed of its run: a read-only view of the names in READS, over the run's resources
(engine/run/resources.py), never the loop. A read goes to the resources as they are at that moment (the loop's
state for the plan, the steps it fits and the init's statistics; the masks for the hard masks and their
perplexity); an assignment is refused, since a hook's event returns what it changes (a RunChanges, applied by the
loop). tests/test_hook_state.py checks that every name a hook's source reads of its run is in READS, and that no
hook's source assigns to it, nor to anything reached through it (masks, ctx)."""

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
LOOP = frozenset({"stats_memo", "plan_steps", "plan"})  # read from the resources' loop state
MASKS = frozenset({"hard_masks", "keep_ratio_at", "masked_perplexity"})  # read from the resources' masks


class RunView:
    __slots__ = ("_res",)

    def __init__(self, res=None):
        object.__setattr__(self, "_res", res)

    def bind(self, res) -> None:
        """The resources read (once: the view is made before them, as the hooks are, and bound as they are)."""
        object.__setattr__(self, "_res", res)

    def __getattr__(self, name: str):
        if name not in READS:
            raise AttributeError(f"a hook reads run.{name}, which its view does not hand out (engine/hooks/view.py's "
                                 "READS)")
        res = self._res
        if name in LOOP:
            return getattr(res.loop, name)
        if name in MASKS:
            return getattr(res.masks, name)
        return getattr(res, name)

    def __setattr__(self, name: str, value) -> None:
        raise AttributeError(f"a hook never assigns to its run (run.{name}): its event returns a RunChanges")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"a hook never deletes from its run (run.{name})")
