"""`--final-mask best-val`: the final mask is cut from the scores of the step whose hard mask validated best
(the init mask, step 0, included), so a run never ends on a mask that validates worse than its start."""

from __future__ import annotations

from .base import RunHook


class BestValFinal(RunHook):
    @staticmethod
    def applies(config) -> bool:
        return config.final_mask == "best-val" and config.validates

    def final_scores(self, state, scores):
        return state.best_scores
