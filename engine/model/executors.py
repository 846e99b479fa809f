"""Executors: how the N_s masked forwards of one policy-gradient step are computed.

Every executor answers one question, the per-sample calibration loss:

    losses = executor(hooks, layout, batch, samples, comp_means, score)   # (N_s,) float64 on the CPU

where `score(model, ids)` gives each row's loss (engine/algo/evaluate.batch_loss, the next-token cross-entropy, or a
reward's scorer, engine/algo/rewards.py), and `samples` maps a unit type to its (N_s, units) 0/1 masks. The run loop
does not know which executor it uses; they must agree to float tolerance (tests/test_executors.py).

- sequential: one forward per mask sample (lowest peak memory).
- batched: the calibration batch repeated N_s times, each copy with its own mask (per-row masks in
  the hooks), in one forward: far fewer kernel launches, so N_s = 4-8 costs little more than 2 on a GPU.
- sliced: one forward per mask sample that computes only the kept KV groups and channels, from weights
  gathered layer by layer (engine/model/slicing.py): about the kept fraction of a dense forward per sample.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..algo.evaluate import batch_loss
from .loading import model_device
from .masking import MaskHooks
from .slicing import SlicedLayers
from .unit_types import UNIT_TYPES
from .units import UnitLayout
from ..settings.registry import add_entry

Executor = Callable[..., torch.Tensor]  # (hooks, layout, batch, samples, comp_means=None, score=batch_loss) -> (N_s,)
EXECUTORS: dict[str, Executor] = {}


def on_accelerator(hooks: MaskHooks, samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The step's masks, moved to a CUDA model's device in one copy per unit type (not one per layer and
    linear when the hooks place them), so that the host synchronises only to read the losses."""
    device = model_device(hooks.adapter.model)
    if device.type != "cuda":
        return samples
    return {u: m.to(device, non_blocking=True) for u, m in samples.items()}


def register_executor(name: str):
    def add(fn: Executor) -> Executor:
        add_entry(EXECUTORS, name, fn, "executor")
        return fn

    return add


@register_executor("sequential")
def sequential_losses(hooks: MaskHooks, layout: UnitLayout, batch: torch.Tensor, samples: dict[str, torch.Tensor],
                      comp_means: dict | None = None, score=batch_loss) -> torch.Tensor:
    n = next(iter(samples.values())).shape[0]
    losses = torch.empty(n, dtype=torch.float64)
    samples = on_accelerator(hooks, samples)
    for j in range(n):
        hooks.set({u: layout.split(u, m[j]) for u, m in samples.items()}, comp_means)
        losses[j] = score(hooks.adapter.model, batch).double().mean()
    return losses


@register_executor("batched")
def batched_losses(hooks: MaskHooks, layout: UnitLayout, batch: torch.Tensor, samples: dict[str, torch.Tensor],
                   comp_means: dict | None = None, score=batch_loss) -> torch.Tensor:
    n, rows = next(iter(samples.values())).shape[0], batch.shape[0]
    samples = on_accelerator(hooks, samples)
    per_row = {u: [part.repeat_interleave(rows, dim=0) for part in layout.split_rows(u, m)] for u, m in samples.items()}
    hooks.set(per_row, comp_means)
    return score(hooks.adapter.model, batch.repeat(n, 1)).double().view(n, rows).mean(1)


@register_executor("sliced")
def sliced_losses(hooks: MaskHooks, layout: UnitLayout, batch: torch.Tensor, samples: dict[str, torch.Tensor],
                  comp_means: dict | None = None, score=batch_loss) -> torch.Tensor:
    n = next(iter(samples.values())).shape[0]
    losses = torch.empty(n, dtype=torch.float64)
    for j in range(n):
        masks = {u: layout.split(u, m[j]) for u, m in samples.items()}
        hooks.set({u: m for u, m in masks.items() if UNIT_TYPES[u].whole_layer})  # layer gates only
        with SlicedLayers(hooks.adapter, masks, comp_means):
            losses[j] = score(hooks.adapter.model, batch).double().mean()
    return losses


def resolve_executor(name: str, device: str) -> str:
    """auto: batched on an accelerator (launch-bound: the copies come almost free); sliced on the CPU
    (compute-bound: computing only the kept units is what saves time; bench/step_cost.py); sequential
    for a model spread by accelerate's device_map (--device auto), whose offloaded weights the sliced
    executor cannot gather and whose memory the batched one would multiply."""
    if name != "auto":
        return name
    return {"cpu": "sliced", "auto": "sequential"}.get(device, "batched")
