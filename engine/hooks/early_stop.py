"""`--early-stop N`: a run that has stopped moving ends before its last step. Three things must all hold: the
hard mask has been the same for N steps, the scores are saturated (at most 1 % of them strictly between 0.01
and 0.99: sampled masks then rarely differ from the hard mask, so later steps would change little), and, when
the run validates, no held-out check in those N steps improved on the best one. A run still improving on its
validation windows is never stopped. The count starts again after a resume."""

from __future__ import annotations

import torch

from ..algo.context import KEEP
from ..run.masks import mask_key
from .base import RunChanges, RunHook

SATURATED = 0.01  # a score within this of 0 or 1 is saturated
UNSATURATED_SHARE = 0.01  # the share of scores allowed to be unsaturated


def saturated(scores: dict[str, torch.Tensor], eps: float = SATURATED, share: float = UNSATURATED_SHARE) -> bool:
    s = torch.cat([t.detach().double().flatten() for t in scores.values()])
    return float(((s > eps) & (s < 1 - eps)).double().mean()) <= share if s.numel() else True


def still(unchanged: int, patience: int, is_saturated: bool, best_step: int | None, step: int, validates: bool) -> bool:
    """Stop now? The mask unchanged for `patience` steps, the scores saturated, and no validation improvement
    in those steps (the best check, if any, at or before step - patience)."""
    if unchanged < patience or not is_saturated:
        return False
    return not validates or best_step is None or best_step <= step - patience


class EarlyStop(RunHook):
    @staticmethod
    def applies(config) -> bool:
        return config.early_stop > 0

    def on_setup(self) -> None:
        self.digest, self.unchanged = None, 0

    def on_step(self, state, report) -> RunChanges | None:
        run, c = self.run, self.run.config
        digest = mask_key(run.hard_masks(state.scores, run.keep_ratio_at(state.step - 1)), KEEP)
        self.unchanged = self.unchanged + 1 if digest == self.digest else 0
        self.digest = digest
        if state.step < run.ctx.steps and still(self.unchanged, c.early_stop, saturated(state.scores), state.best_step,
                                                state.step, c.validates):
            run.log(f"stopping early at step {state.step}: the hard mask has not changed for {self.unchanged} steps, "
                    f"the scores are saturated and validation stopped improving (--early-stop {c.early_stop})")
            self.own(state)["stopped_early"] = state.step
            return RunChanges(steps=state.step)
        return None
