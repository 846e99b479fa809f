"""Least-squares reconstruction (`--reconstruct`): after the final mask is cut, each output projection's kept
input columns are refit so that the pruned layer reproduces the dense projection's output on calibration data.

A projection computes W x = W_k x_k + W_r x_r over its kept (k) and removed (r) input columns. Removing r, the
best a linear function of what is left can do (least squares over calibration tokens) is to replace x_r by its
linear regression on x_k: x_r ~ A x_k + f, with A = C_rk (C_kk + lam I)^-1 over the centred second moments C
and f = mu_r - A mu_k. Then W' = W_k + W_r A on the kept columns and W_r f joins the projection's bias. The
minimiser of E||W x - W' x_k - b||^2 is this whatever W_r is, so one regression per projection serves all of its
outputs. FLAP's bias compensation is the case A = 0 (x_r replaced by its mean); without compensation
(--no-bias-compensation) the regression has no intercept: raw second moments and f = 0.

The statistics are the dense model's (one pass over the batches), as the compensation's means are. In the run
the refit is a weight edit held for the final evaluation and the export (`reconstructed`), with the offsets f as
the masked columns' compensation means (comp_means), so the hooks, the sliced forwards and the export need nothing new: the masked model
computes W'_k x_k + W_r f and the export folds W_r f into the bias as it does the compensation's means.

lam (`ridge`) is relative to the mean variance of the kept columns: columns that the calibration data barely
moves, or that are nearly collinear, do not get large weights from noise."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable

import torch

from ..model.arch import ModelAdapter
from ..export.artifacts import kept_indices
from .statistics import Statistic, one_pass
from ..model.unit_types import layer_unit_types
from ..model.units import UnitLayout

Moments = dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor, int]]  # (sum x x^T in float32, sum x, tokens)


def moments_bytes(adapter: ModelAdapter, unit_types: list[str]) -> int:
    """What `input_moments` keeps: a float32 n x n matrix per output projection of the unit types."""
    return sum(4 * t.output_proj(adapter, i).in_features ** 2 for t in layer_unit_types() if t.name in unit_types
               for i in range(adapter.num_layers))


def available_memory() -> int | None:
    """The memory the OS can still give this process (Linux's MemAvailable), in bytes; None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def regression(second: torch.Tensor, mean: torch.Tensor, kept: torch.Tensor, ridge: float,
               centered: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, f): the least-squares x_r ~ A x_k + f of the removed columns on the kept ones (`kept`: the kept
    columns' indices), from the second moments E[x x^T] (`second`) and means E[x] of all columns. centered:
    with an intercept (the centred moments); otherwise through the origin (f = 0). ridge: lam relative to the
    mean of the kept columns' variances (their second moments, not centred)."""
    second, mean = second.double(), mean.double()
    n = second.shape[0]
    removed = torch.ones(n, dtype=torch.bool)
    removed[kept] = False
    m = second - torch.outer(mean, mean) if centered else second
    mkk, mrk = m[kept][:, kept], m[removed][:, kept]
    scale = float(mkk.diagonal().mean()) if len(kept) else 0.0
    lam = ridge * scale if scale > 0 else 1e-12
    a = torch.linalg.solve(mkk + lam * torch.eye(len(kept), dtype=m.dtype), mrk.T).T if len(kept) else mrk
    f = mean[removed] - a @ mean[kept] if centered else torch.zeros(int(removed.sum()), dtype=m.dtype)
    return a, f


def _groups(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive positions packed so that each group's sizes add up to at most max_bytes (one each at least)."""
    out, total = [[]], 0
    for i, s in enumerate(sizes):
        if out[-1] and total + s > max_bytes:
            out.append([])
            total = 0
        out[-1].append(i)
        total += s
    return out


def _gram(x: torch.Tensor) -> torch.Tensor:
    """x^T x as the pass's autocast computes it: under a lower-precision autocast, x is cast once (autocast casts
    x^T and x apart, each a copy of x: 13 % of the product's time at 1024 x 1536 on one thread); the same values."""
    device = x.device.type
    if torch.is_autocast_enabled(device) and (low := torch.get_autocast_dtype(device)) != x.dtype:
        x = x.to(low)
    return x.T @ x


class InputMoments(Statistic):
    """The refit's reader in the one statistics pass (engine/algo/statistics.py): (sum of x x^T, sum of x, tokens) of the
    inputs of `unit_types`' output projections, per (unit type, layer); summed in float64, kept in float32. The
    float64 sums of all layers at once may exceed `max_bytes`: then the layers are read in groups, the first with
    the pass's other readers, each further one in a pass of its own over the same batches. Its float64 sums are
    added batch by batch as one process adds them, so the ranks of a data-parallel run do not deal its batches out
    (every rank runs them: one process's sums, bit for bit)."""

    splits = False
    label = "the refit's input moments"

    def __init__(self, batches: int, unit_types: list[str], max_bytes: int = 2 << 30, stop=None):
        super().__init__(batches, stop)
        self.unit_types, self.max_bytes = list(unit_types), max_bytes
        self.acc: dict = {}

    def groups(self, adapter):
        keys = [(t, i) for i in range(adapter.num_layers) for t in layer_unit_types() if t.name in self.unit_types]
        sizes = [8 * t.output_proj(adapter, i).in_features ** 2 for t, i in keys]
        return [[keys[j] for j in group] for group in _groups(sizes, self.max_bytes)]

    def cache_identity(self):
        return ["input-moments", sorted(self.unit_types)]

    def add(self, key, x) -> None:
        gram, total = _gram(x), x.sum(0).double()
        if key in self.acc:
            self.acc[key][0].add_(gram)  # (a bfloat16 Gram added as float64 without a float64 copy of it)
            self.acc[key][1].add_(total)
        else:
            self.acc[key] = [gram.double(), total]

    def partial_sums(self):
        return self.acc  # (the float64 sums themselves: a later run adds its batches to them as this pass would)

    def continue_sums(self, sums, done) -> None:
        self.acc, self.start = sums, done

    def finish(self, world, split, tokens) -> Moments:
        out = {k: (v[0].float().cpu(), v[1].cpu(), tokens) for k, v in self.acc.items()}  # (float32 kept: half the memory)
        self.acc = {}
        return out


def input_moments(adapter: ModelAdapter, batches: list[torch.Tensor], unit_types: list[str],
                  max_bytes: int = 2 << 30, log=lambda s: None, stop: Callable[[int], bool] | None = None) -> Moments:
    """InputMoments on `batches` alone (a pass of its own): the moments of the inputs of `unit_types`' output
    projections on the model as it is (dense, unmasked). stop(done), asked after each batch, ends the statistics
    there (the batches left are not run; further groups of layers run as many): --time-budget's share of the time
    left."""
    reader = InputMoments(len(batches), unit_types, max_bytes, stop)
    one_pass(adapter, batches, [reader], log=log)
    return reader.result


@contextmanager
def reconstructed(adapter: ModelAdapter, layout: UnitLayout, masks: dict[str, torch.Tensor], moments: Moments,
                  ridge: float, centered: bool = True):
    """While active, the kept columns of every pruned output projection of the kept layers carry W_k + W_r A
    (see the module's docstring); yields the compensation means that go with it (unit type -> per layer, f at the removed
    columns; None when not centred: no offsets). The weights are restored on leaving."""
    saved: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
    comp_means = {t.name: [torch.zeros(t.output_proj(adapter, i).in_features) for i in range(adapter.num_layers)]
            for t in layer_unit_types() if t.name in masks}
    try:
        for i, kept in kept_indices(layout, masks, adapter, empty_ok=True):  # (a sampled mask may empty a layer's type)
            for t in layer_unit_types():
                if t.name not in masks:  # (layer_unit_types: the types inside layers, never whole layers)
                    continue
                w = t.output_proj(adapter, i).weight
                cols = t.column_index(adapter, kept[t.name])
                if len(cols) == w.shape[1]:
                    continue
                second, total, tokens = moments[(t.name, i)]
                a, f = regression(second / tokens, total / tokens, cols, ridge, centered)
                removed = torch.ones(w.shape[1], dtype=torch.bool)
                removed[cols] = False
                wd = w.detach()
                saved.append((w, cols, wd[:, cols.to(w.device)].clone()))
                edit = wd[:, removed.to(w.device)].double().cpu() @ a
                wd[:, cols.to(w.device)] += edit.to(w)
                comp_means[t.name][i][removed] = f.float()
        yield comp_means if centered else None
    finally:
        for w, cols, original in reversed(saved):
            w.detach()[:, cols.to(w.device)] = original
