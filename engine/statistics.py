"""One statistics pass: the inputs of every output projection read once over the calibration stream, for every
reader that wants them.

FLAP's fluctuation metric (and Wanda-sp's norms), the bias compensation's means and the least-squares refit's
moments all read the same activations: the inputs of the output projections (found through the unit types, which
ask the architecture adapter), on the dense, unmasked model, over the first batches of the run's init stream
(the init sampler from its start). Each reader is a `Statistic` that says how many of the stream's first batches
it reads; the pass runs the longest count once, and each reader adds up what it needs from the batches it reads
(FLAP its `--init-batches`, the refit its `--reconstruct-batches`) and stops at its count.

    readers = [ColumnMoments(16), refit_reader]           # who reads, and how many batches each
    one_pass(adapter, stream, readers, world, log)         # one forward per batch of the longest
    readers[0].result                                      # what column_moments(adapter, stream[:16]) returns

Who reads is declared where the reading happens, never listed here: an init metric names the statistics it reads
(`register_metric(..., statistics=("column-moments",))`, built from STATISTICS with the metric's batch count),
and a run hook returns its readers from `statistics_wanted(batches)` (the compensation's column moments, the
refit's input moments). `statistics_pass` (engine/initialise.py calls it at a fresh run's start, before the init
metric) collects them and puts every column-moments result in the run's memo, where
metrics.activations.column_moments finds it without a forward.

A reader may stop early (the refit's under --time-budget: `stop(done)` asked after each batch), but only where the
stream ends for the readers that do not stop: the batches that are run anyway are read. A reader whose sums do not
fit in memory at once (the refit's float64 moments of a large model) reads the stream again for each further
group of projections, alone.

torchrun: when every reader can combine the ranks' work exactly (`splits`: per-batch sums gathered and added in
batch order, as column_moments does), the ranks deal the batches out (rank r runs batches r, r + K, ...);
otherwise (the refit's float64 sums, which one process adds batch by batch) every rank runs every batch, as the
refit always did, and the other readers read them too: each rank's statistics are one process's, bit for bit."""

from __future__ import annotations

import copy
from typing import Any, Callable, ClassVar

import torch

from .arch import ModelAdapter
from .distributed import World
from .evaluate import decoder_forward
from .metrics.activations import Sums, add_in_order, moments_key, release_freed_memory
from .registry import add_entry
from .unit_types import layer_unit_types

Key = tuple[str, int]  # (unit type, layer)


class Statistic:
    """One reader of the pass: sums over the tokens of the stream's first `batches` batches of something of the
    inputs of output projections. Subclasses say which projections (`groups`) and what they add (`add`)."""

    splits: ClassVar[bool] = True  # the ranks may deal its batches out (its finish combines them exactly)
    label: ClassVar[str] = "statistics"  # for the log

    def __init__(self, batches: int, stop: Callable[[int], bool] | None = None):
        self.batches = self.asked = batches  # batches: how many it reads (fewer once stopped); asked: as declared
        self.stop = stop  # asked after each batch once the other readers' batches are done: True ends it there
        self.result: Any = None  # set by the pass
        self.tokens = 0

    def groups(self, adapter: ModelAdapter) -> list[list[tuple[Any, int]]]:
        """The projections it reads, (unit type, layer), in groups: the pass reads the first with the other readers,
        each further group alone over the same batches (sums that do not fit in memory at once)."""
        return [[(t, i) for i in range(adapter.num_layers) for t in layer_unit_types()]]

    def start_batch(self, j: int) -> None:
        """Batch j of the stream is about to run and this reader reads it."""

    def add(self, key: Key, x: torch.Tensor) -> None:
        """The input of projection `key` in the current batch: float32, (tokens, in_features)."""
        raise NotImplementedError

    def finish(self, world: World, split: bool, tokens: int) -> Any:
        """The result, from this rank's sums (split: this rank ran its share of the batches only)."""
        raise NotImplementedError

    def memo_key(self, stream: list[torch.Tensor]):
        """Where its result goes in a run's memo of statistics (None: nowhere; its declarer keeps the reader)."""
        return None

    def identity(self):
        """Readers with the same identity compute the same result (one of them reads for all); None: its own."""
        return None


STATISTICS: dict[str, type[Statistic]] = {}  # the statistics an init metric can name (register_metric's statistics)


def register_statistic(name: str):
    def add(cls: type[Statistic]) -> type[Statistic]:
        add_entry(STATISTICS, name, cls, "statistic")
        return cls

    return add


@register_statistic("column-moments")
class ColumnMoments(Statistic):
    """(sums of x, sums of x^2, tokens) of every input column of every output projection: what
    metrics.activations.column_moments returns for the same batches, bit for bit (each batch's float32 sums,
    added in batch order)."""

    label = "column moments"

    def __init__(self, batches: int, stop=None):
        super().__init__(batches, stop)
        self.parts: dict[int, Sums] = {}  # batch -> its sums
        self.current = -1

    def start_batch(self, j: int) -> None:
        self.parts[j], self.current = {}, j

    def add(self, key, x) -> None:
        part = self.parts[self.current]
        s = torch.cat([x, x * x], dim=-1).sum(0)
        part[key] = s if key not in part else part[key] + s

    def finish(self, world, split, tokens):
        parts = self.parts
        if split and world.size > 1:
            parts = {}
            for got in world.gather_objects({j: p for j, p in self.parts.items()}, "the column moments"):
                parts.update(got)
        sums = add_in_order([parts[j] for j in sorted(parts)])
        first, second = {}, {}
        for k, s in sums.items():
            n = s.numel() // 2
            first[k], second[k] = s[:n], s[n:]
        return first, second, tokens

    def memo_key(self, stream):
        return moments_key(stream[:self.batches])

    def identity(self):
        return ("column-moments", self.asked)


def fork(sampler):
    """A copy of a calibration sampler at its position: drawing from it leaves the sampler where it is."""
    other = copy.copy(sampler)
    other.generator = torch.Generator()
    other.generator.set_state(sampler.generator.get_state())
    return other


def longest(readers: list[Statistic]) -> int:
    return max((r.batches for r in readers), default=0)


@torch.no_grad()
def one_pass(adapter: ModelAdapter, stream: list[torch.Tensor], readers: list[Statistic], world: World = World(),
             log: Callable[[str], None] = lambda s: None) -> int:
    """Every reader's statistics from one stream of forwards over the stream's first batches (as many as the
    longest reader reads; see the module's docstring); each reader's `result` is set. Returns the forwards run
    (this rank's: the batches of every pass)."""
    readers = [r for r in readers if r.batches > 0]
    for r in readers:
        if r.batches > len(stream):
            raise ValueError(f"a reader of {r.batches} batches on a stream of {len(stream)}")
    split = world.size > 1 and all(r.splits for r in readers)
    forwards = 0
    groups = {id(r): r.groups(adapter) for r in readers}
    extra = max((len(g) for g in groups.values()), default=1)
    for g in range(extra):
        active = [r for r in readers if len(groups[id(r)]) > g and (g == 0 or r.batches > 0)]
        if not active:
            continue
        if g:
            log(f"statistics: pass {g + 1} of {extra} (the projections whose sums did not fit in memory with the first)")
        forwards += _run(adapter, stream, active, {id(r): groups[id(r)][g] for r in active}, world, split, g == 0, log)
    for r in readers:
        r.tokens = sum(b.numel() for b in stream[:r.batches])
        r.result = r.finish(world, split, r.tokens)
    return forwards


def _run(adapter, stream, readers, keys, world, split, first, log) -> int:
    """One stream of forwards over the batches `readers` read, each reader reading its projections `keys`."""
    wanted: dict[Key, tuple[torch.nn.Module, list[Statistic]]] = {}
    for r in readers:
        for t, i in keys[id(r)]:
            wanted.setdefault((t.name, i), (t.output_proj(adapter, i), []))[1].append(r)
    reading: list[Statistic] = []

    def recorder(key, who):
        def hook(module, args):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1])
            for r in who:
                if r in reading:
                    r.add(key, x)

        return hook

    handles = [proj.register_forward_pre_hook(recorder(key, who)) for key, (proj, who) in wanted.items()]
    k, rank = (world.size, world.rank) if split else (1, 0)
    forwards, done = 0, 0
    try:
        while done < longest(readers):
            j = done + rank  # (this rank's batch of the round; split: every K-th)
            reading[:] = [r for r in readers if j < r.batches]
            if reading:
                for r in reading:
                    r.start_batch(j)
                decoder_forward(adapter.model, stream[j])
                release_freed_memory()
                forwards += 1
            done = min(done + k, longest(readers))
            if first:  # a reader that may stop is asked once the batches run anyway are done
                anyway = max((r.batches for r in readers if r.stop is None), default=0)
                for r in readers:
                    if r.stop is not None and done >= anyway and done < r.batches and r.stop(done):
                        log(f"statistics: a reader stopped at {done} of {r.batches} batches (the time budget's share)")
                        r.batches = done
    finally:
        for h in handles:
            h.remove()
    return forwards


def init_stream(run, batches: int) -> list[torch.Tensor]:
    """The first `batches` batches of the run's init stream, from its start (the init sampler seeded as the run
    seeds it; a resumed run's statistics read the batches a fresh run's pass read)."""
    sampler = run.init_sampler.reseeded(run.config.seed)
    return [sampler.next_batch() for _ in range(batches)]


def statistics_pass(run, batches: list[torch.Tensor], readers: list[Statistic]) -> None:
    """A fresh run's one statistics pass: `readers` over the init stream, whose first batches are `batches` (the
    init batches the run drew; the stream goes on from there, the init sampler left where it is), in the phase
    "statistics"; the results with a memo key go into the run's memo (run.stats_memo), the others stay with
    their readers. Readers of the same statistic on the same batches read once."""
    twins: dict = {}
    for r in readers:
        twins.setdefault(r.identity() or id(r), r)
    unique = list(twins.values())
    m = longest(unique)
    if not m:
        return
    more = fork(run.init_sampler)
    stream = batches[:m] + [more.next_batch() for _ in range(m - len(batches))]
    run.log(f"statistics: one pass over {m} calibration batches for " + ", ".join(
        f"{r.label} ({r.batches})" for r in unique))
    with run.phases("statistics"):
        one_pass(run.adapter, stream, unique, run.world, run.log)
    for r in readers:
        twin = twins[r.identity() or id(r)]
        r.result, r.tokens, r.batches = twin.result, twin.tokens, twin.batches
        if (key := r.memo_key(stream)) is not None:
            run.stats_memo[key] = r.result
