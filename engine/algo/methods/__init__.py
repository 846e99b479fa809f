"""Methods: one file per method, one `@register_method` entry each (see base.Method).

    pg      policy gradient, forward passes only (the default)
    gumbel  Gumbel-softmax masks, back-propagated through the model
    metric  no optimisation: the init metric's ranking
    flap    FLAP, one-shot: its fluctuation metric, adaptive structure and bias compensation
    bonsai  Bonsai: sub-models sampled at the target sparsity, a regression of their losses, pruning in rounds
    alloc   pg-alloc: policy gradient over each layer's allocation, one logit offset per (unit type, layer)

base.py holds the Method interface; registry.py the table and its decorator.
"""

from __future__ import annotations

from .base import Method, StepGradient  # noqa: F401
from .registry import method_options, METHODS, option_fields, register_method  # noqa: F401
from . import pg, gumbel, metric, flap, bonsai, alloc  # noqa: E402,F401  (register in this order)



def optimises(config) -> bool:
    """Whether the config's method takes steps (a method not registered is taken to: it is refused elsewhere)."""
    return METHODS[config.method].optimises if config.method in METHODS else True


__all__ = ["METHODS", "Method", "StepGradient", "method_options", "optimises", "option_fields", "register_method"]
