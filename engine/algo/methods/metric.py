"""No optimisation: the init metric's own ranking is the mask (the one-shot baselines: Wanda-sp,
magnitude-sp, Taylor, random, Layerwise-PPL, SLEB)."""

from __future__ import annotations

from .registry import register_method
from .base import Method


@register_method("metric")
class MetricOnly(Method):
    optimises = False

    def final_scores(self, state):
        return state.init_mask_scores or state.init_metric
