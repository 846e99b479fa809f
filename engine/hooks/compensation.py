"""FLAP's bias compensation (`--bias-compensation`): a removed unit's input is replaced by its mean on the
init batches, in the optimisation, the evaluations and the export (as output-projection biases)."""

from __future__ import annotations

from ..algo.metrics.activations import input_means
from ..algo.statistics import ColumnMoments
from ..model.unit_types import UNIT_TYPES
from .base import RunChanges, RunHook


def compensation_means(means, unit_types):
    """The compensation means of the unit types a run prunes (whole layers have none)."""
    if means is None:
        return None
    return {u: means[u] for u in unit_types if u in means}


class BiasCompensation(RunHook):
    needs_data = True

    @staticmethod
    def applies(config) -> bool:  # (whole layers alone have no widths to compensate)
        return config.bias_compensation and any(not UNIT_TYPES[u].whole_layer for u in config.units)

    def statistics_wanted(self, batches) -> list:  # (the means: the column moments of the init batches, in the one pass)
        return [ColumnMoments(len(batches))]

    def before_scores(self, batches) -> RunChanges:  # (so that the joint method's candidate losses are compensated)
        self.run.log("measuring mean inputs of the output projections (bias compensation)")
        self.means = input_means(self.run.adapter, batches, self.run.world, self.run.stats_memo)
        return RunChanges(comp_means=compensation_means(self.means, self.run.layout.unit_types))

    def on_init(self, state, batches) -> RunChanges:
        self.own(state)["input_means"] = self.means
        return self.on_resume(state)

    def on_resume(self, state) -> RunChanges:
        return RunChanges(comp_means=compensation_means(state.input_means, self.run.layout.unit_types))
