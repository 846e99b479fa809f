"""Statistics of the inputs of every unit type's output projection over calibration tokens."""

from __future__ import annotations

import hashlib

import torch

from ...model.arch import ModelAdapter
from ...model.distributed import World
from ..evaluate import decoder_forward
from ...model.unit_types import layer_unit_types

Sums = dict[tuple[str, int], torch.Tensor]


def release_freed_memory() -> None:
    """Hand the memory freed by the last forward back to the OS (glibc's malloc_trim; nothing elsewhere). glibc
    serves a forward's activation-sized temporaries from its heap once one was freed, and the heap does not shrink
    while small tensors kept between batches pin it: over 64 init batches of the default model the process grew
    to 14-18 GB, of which about 0.5 GB was live tensors; trimmed after each batch it stays under 1.4 GB."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc if hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _libc()


@torch.no_grad()
def sums_per_batch(adapter: ModelAdapter, batches: list[torch.Tensor], stat) -> list[Sums]:
    """For each batch, the sum over its tokens of stat(x) for every input column x of each unit type's output
    projection, keyed (unit type, layer)."""
    parts: list[Sums] = []
    handles = []

    def recorder(key):
        def hook(module, args):
            s, part = stat(args[0].detach().float().reshape(-1, args[0].shape[-1])).sum(0), parts[-1]
            part[key] = s if key not in part else part[key] + s

        return hook

    for t in layer_unit_types():
        for i in range(adapter.num_layers):
            handles.append(t.output_proj(adapter, i).register_forward_pre_hook(recorder((t.name, i))))
    try:
        for batch in batches:
            parts.append({})
            decoder_forward(adapter.model, batch)
            release_freed_memory()
    finally:
        for h in handles:
            h.remove()
    return parts


def add_in_order(parts: list[Sums]) -> Sums:
    """The batches' sums added up in batch order (the same bits wherever each batch's sum was computed)."""
    total: Sums = {}
    for part in parts:
        for key, s in part.items():
            total[key] = s if key not in total else total[key] + s
    return total


@torch.no_grad()
def column_sums(adapter: ModelAdapter, batches: list[torch.Tensor], stat, world: World = World(),
                what: str = "the activation statistics") -> tuple[Sums, int]:
    """Sum over calibration tokens of stat(x) for every input column x of each unit type's output
    projection, keyed (unit type, layer), and the token count. Under torchrun each rank runs its share of the
    batches and every rank adds up every batch's sums in batch order: one process's sums, bit for bit."""
    parts = world.map_shares(batches, lambda mine: sums_per_batch(adapter, mine, stat), what)
    return add_in_order(parts), sum(b.numel() for b in batches)


def batches_digest(batches: list[torch.Tensor]) -> str:
    """A key for a list of token batches (their shapes and ids)."""
    h = hashlib.sha1()
    for b in batches:
        h.update(str(tuple(b.shape)).encode())
        h.update(b.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def moments_key(batches: list[torch.Tensor]) -> tuple[str, str]:
    """Where column_moments' result for these batches is kept in a memo (engine/algo/statistics.py's one pass puts it
    there)."""
    return ("moments", batches_digest(batches))


def column_moments(adapter: ModelAdapter, batches: list[torch.Tensor], world: World = World(),
                   memo: dict | None = None, what: str = "the activation statistics") -> tuple[Sums, Sums, int]:
    """(sums of x, sums of x^2, tokens) for every input column x of each unit type's output projection, keyed
    (unit type, layer): one pass over the batches serves FLAP's fluctuation, Wanda-sp's norms and the bias
    compensation's means. `memo` (a dict the caller owns, e.g. a run's during its start, when the model is dense
    and unmasked and its weights do not change) keeps the result for the same batches, so a compensated FLAP
    run forwards its init batches once, not twice; a run's one statistics pass (engine/algo/statistics.py) fills it
    before the metric asks."""
    key = moments_key(batches)
    if memo is not None and key in memo:
        return memo[key]
    sums, tokens = column_sums(adapter, batches, lambda x: torch.cat([x, x * x], dim=-1), world, what)
    first, second = {}, {}
    for k, s in sums.items():
        n = s.numel() // 2
        first[k], second[k] = s[:n], s[n:]
    out = (first, second, tokens)
    if memo is not None:
        memo[key] = out
    return out


def input_means(adapter: ModelAdapter, batches: list[torch.Tensor], world: World = World(),
                memo: dict | None = None) -> dict[str, list[torch.Tensor]]:
    """Per layer, the mean over calibration tokens of every input column of each unit type's output
    projection, on the unmasked model (FLAP's bias compensation uses the dense means)."""
    sums, _, tokens = column_moments(adapter, batches, world, memo, "the mean inputs (bias compensation)")
    return {t.name: [(sums[(t.name, i)] / tokens).cpu() for i in range(adapter.num_layers)] for t in layer_unit_types()}
