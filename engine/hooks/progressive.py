"""random-progressive (`--init random-progressive`): random scores, and the pruning rate raised by
--progressive-increment per stage up to the target; the learning rate's schedule restarts in each stage."""

from __future__ import annotations

from ..algo.policy import progressive_stages
from .base import RunChanges, RunHook


class ProgressiveSchedule(RunHook):
    @staticmethod
    def applies(config) -> bool:
        return config.init == "random-progressive"

    def on_setup(self) -> RunChanges:
        c = self.run.config
        return RunChanges(stages=progressive_stages(c.prune_ratio, c.steps, c.progressive_increment), unit_metric="random")
