"""Init metrics: one file per metric, one `@register_metric` entry each, all with one signature:

    metric(ctx: MetricContext, unit_types: list[str]) -> {unit type: [one tensor per layer]}   # higher = keep

`scores` says which unit types a metric can score: "units" (KV groups and channels, inside layers),
"layers" (whole layers) or "any". `needs_data` metrics get calibration batches in ctx.batches.

    wanda_sp, magnitude_sp, taylor, flap   unit metrics (activations: the input statistics they read)
    layerwise_ppl, block_influence, sleb   layer metrics
    random                                 the no-information baseline
    probability                            from a metric to keep probabilities (PROB_MAPS)
    registry                               the table and its decorator
"""

from __future__ import annotations

from .registry import layer_metrics, Metric, MetricContext, METRICS, register_metric, unit_metrics  # noqa: F401
from . import (wanda_sp, magnitude_sp, taylor, flap, layerwise_ppl, sleb, block_influence, random)  # noqa: E402,F401  (register)

__all__ = ["METRICS", "Metric", "MetricContext", "layer_metrics", "register_metric", "unit_metrics"]
