"""random-progressive (`--init random-progressive`): random scores, and the pruning rate raised by
--progressive-increment per stage up to the target; the learning rate's schedule restarts in each stage."""

from __future__ import annotations

from ..policy import progressive_stages
from .base import RunHook, register_hook


@register_hook
class ProgressiveSchedule(RunHook):
    @staticmethod
    def applies(config) -> bool:
        return config.init == "random-progressive"

    def on_setup(self) -> None:
        c = self.run.config
        self.run.stages = progressive_stages(c.prune_ratio, c.steps, c.progressive_increment)
        self.run.unit_metric = "random"
