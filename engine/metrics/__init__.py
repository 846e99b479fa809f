"""Init metrics: one file per metric, one `@register_metric` entry each, all with one signature:

    metric(ctx: MetricContext, unit_types: list[str]) -> {unit type: [one tensor per layer]}   # higher = keep

`scores` says which unit types a metric can score: "units" (KV groups and channels, inside layers),
"layers" (whole layers) or "any". `needs_data` metrics get calibration batches in ctx.batches.
"""

from __future__ import annotations

from .registry import layer_metrics, Metric, MetricContext, METRICS, register_metric, unit_metrics  # noqa: F401
from . import wanda_sp, magnitude_sp, taylor, flap, layerwise_ppl, sleb, block_influence, random  # noqa: E402,F401  (register)

__all__ = ["METRICS", "Metric", "MetricContext", "layer_metrics", "register_metric", "unit_metrics"]
