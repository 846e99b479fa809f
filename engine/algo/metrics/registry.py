"""The metrics registry: the table and its decorator (the package's __init__ imports the entries).

Entries import their decorator from here, never from the package, so that no entry imports the package that
imports it."""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from ...model.arch import ModelAdapter
from ...model.distributed import World
from ...model.units import UnitLayout
from ...settings.registry import add_entry


@dataclass
class MetricContext:
    adapter: ModelAdapter
    layout: UnitLayout
    batches: list[torch.Tensor] = field(default_factory=list)  # calibration batches (needs_data metrics)
    keep_ratio: float = 1.0  # the run's target (SLEB removes layers down to it)
    seed: int = 0
    progress: bool = False  # a tqdm bar on stderr for the metrics that run the model many times
    log: Callable[[str], None] | None = None  # else their progress as log lines (the app shows the last one)
    # this torchrun rank (engine/model/distributed.py): the metrics that run the model share their batches or candidate
    # layers out over the ranks through it (World.map_shares, World.add_up); World() is one process
    world: World = World()
    # the run's memo of activation statistics (activations.column_moments): a metric and the bias compensation
    # that read the same batches share one pass over them
    memo: dict | None = None
    # a greedy metric's removals already made on these batches, in order (the metric cache's, from a run that went
    # further or not as far): it continues from them instead of repeating them (Metric.greedy)
    prefix: list[int] = field(default_factory=list)
    # called with the order so far after each greedy removal (the metric cache stores it: a run stopped during
    # SLEB's hour loses one removal's work, not the removals made)
    on_removal: Callable[[list[int]], None] | None = None
    # SLEB's finalists (--sleb-finalists): each round, only the K candidates that lose least on the first quarter of
    # the batches run on the rest (0: every candidate on every batch)
    finalists: int = 0

    def with_batches(self, batches: list[torch.Tensor]) -> "MetricContext":
        """This context on other batches (a part of its own)."""
        return replace(self, batches=batches)

    @contextmanager
    def progress_bar(self, name: str, forwards: int, every_seconds: float = 5.0) -> Iterator[Callable[[], None]]:
        """Progress over a metric's `forwards` model runs (SLEB's take hours on a CPU); yields the tick to call
        after each. A tqdm bar, or a log line at most every `every_seconds` and after the last run."""
        if self.progress and forwards > 0:  # (no bar for no model runs: a cached order's "0forward")
            from tqdm.auto import tqdm

            with tqdm(total=forwards, desc=name, unit="forward", leave=False) as bar:
                yield lambda: bar.update(1)
            return
        if self.log is None:
            yield lambda: None
            return
        start = time.monotonic()
        state = {"done": 0, "logged": start}

        def tick() -> None:
            state["done"] += 1
            now, done = time.monotonic(), state["done"]
            if done == forwards or now - state["logged"] >= every_seconds:
                state["logged"] = now
                left = (now - start) / done * (forwards - done)
                self.log(f"{name}: {done}/{forwards} model runs" + (f", about {left / 60:.0f} min left" if done < forwards else ""))

        yield tick


MetricFn = Callable[[MetricContext, list[str]], dict[str, list[torch.Tensor]]]


@dataclass(frozen=True)
class Metric:
    name: str
    fn: MetricFn
    scores: str  # "units", "layers" or "any"
    needs_data: bool
    summary: str
    # its scores are already standardized so that they compare across layers and unit types (FLAP's): they are
    # not standardized again, and under --budget params they split the budget between the unit types
    comparable: bool = False
    # its scores are the rounds of a greedy removal (SLEB's: 0 = removed first; never removed = the highest): the
    # removals to a lower keep ratio extend those to a higher one, so the metric cache keeps one order per batches
    # and a metric run continues it (MetricContext.prefix)
    greedy: bool = False
    # the activation statistics it reads on its batches (engine/algo/statistics.py's STATISTICS names): the run's one
    # statistics pass takes them with the other readers' before the metric runs
    statistics: tuple[str, ...] = ()

    def scores_units(self) -> bool:
        return self.scores in ("units", "any")

    def scores_layers(self) -> bool:
        return self.scores in ("layers", "any")


METRICS: dict[str, Metric] = {}


def register_metric(name: str, scores: str, needs_data: bool, comparable: bool = False, greedy: bool = False,
                    statistics: tuple[str, ...] = ()):
    if scores not in ("units", "layers", "any"):
        raise ValueError(f"scores must be units, layers or any, got {scores!r}")

    def add(fn: MetricFn) -> MetricFn:
        add_entry(METRICS, name, Metric(name, fn, scores, needs_data, (fn.__doc__ or "").strip().split("\n")[0], comparable,
                                        greedy, tuple(statistics)), "metric")
        return fn

    return add


def removal_order(scores: dict[str, list[torch.Tensor]]) -> list[int]:
    """A greedy metric's removals in order, from its scores (the round of each; never removed = the highest)."""
    values = torch.cat(next(iter(scores.values()))).double()
    top = float(values.max()) if values.numel() else 0.0
    return [int(i) for i in torch.argsort(values, stable=True) if float(values[i]) < top]


def unit_metrics() -> tuple[str, ...]:
    """Metrics that can initialise KV groups and channels."""
    return tuple(n for n, m in METRICS.items() if m.scores_units())


def layer_metrics() -> tuple[str, ...]:
    """Metrics that can initialise whole layers."""
    return tuple(n for n, m in METRICS.items() if m.scores_layers())
