"""FLAP (An et al., 2024) as a one-shot method: the fluctuation metric (engine/algo/metrics/flap.py), the adaptive
structure (one ranking of every KV group and channel across layers, each weighing its parameters, under
--budget params; per unit type under --budget units) and the bias compensation of the removed units' means,
carried into the export as output-projection biases. `--method flap` is `--method metric --init flap
--bias-compensation`; `--init flap` alone starts policy gradient from FLAP's metric."""

from __future__ import annotations

from .metric import MetricOnly
from .registry import register_method


@register_method("flap")
class Flap(MetricOnly):
    implies = {"init": "flap", "bias_compensation": True}  # the settings this method is (PruneConfig.resolved)
