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
refit's input moments). `statistics_pass` (engine/run/initialise.py calls it at a fresh run's start, before the init
metric) collects them and puts every column-moments result in the run's memo, where
metrics.activations.column_moments finds it without a forward.

A reader may stop early (the refit's under --time-budget: `stop(done)` asked after each batch), but only where the
stream ends for the readers that do not stop: the batches that are run anyway are read. A reader whose sums do not
fit in memory at once (the refit's float64 moments of a large model) reads the stream again for each further
group of projections, alone.

torchrun: when every reader can combine the ranks' work exactly (`splits`: per-batch sums gathered and added in
batch order, as column_moments does), the ranks deal the batches out (rank r runs batches r, r + K, ...);
otherwise (the refit's float64 sums, which one process adds batch by batch) every rank runs every batch, as the
refit always did, and the other readers read them too: each rank's statistics are one process's, bit for bit.

The dense model's statistics depend only on the model, the batches and the precision of the pass, not on the rate
or the method: a second run on the same calibration batches (the same command again, or another --prune-ratio from
the same seed and source) reads them from $PG_PRUNE_STATS_CACHE (default: $PG_PRUNE_CACHE/statistics; off: none),
keyed by the model files' content, the reader, the dtypes, the device and the batches' token ids themselves
(StatisticsCache). Half of a one-shot run's minutes on a CPU were this pass. A model given in memory, and torchrun,
are not cached; the folder keeps its newest entries within STATS_CACHE_BYTES."""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from ..model.arch import ModelAdapter
from ..model.distributed import World
from .evaluate import decoder_forward
from .metrics.activations import Sums, add_in_order, moments_key, release_freed_memory
from ..settings.registry import add_entry
from ..model.unit_types import layer_unit_types

Key = tuple[str, int]  # (unit type, layer)


class Statistic:
    """One reader of the pass: sums over the tokens of the stream's first `batches` batches of something of the
    inputs of output projections. Subclasses say which projections (`groups`) and what they add (`add`)."""

    splits: ClassVar[bool] = True  # the ranks may deal its batches out (its finish combines them exactly)
    label: ClassVar[str] = "statistics"  # for the log

    def __init__(self, batches: int, stop: Callable[[int], bool] | None = None):
        self.batches = self.asked = batches  # batches: how many it reads (fewer once stopped); asked: as declared
        self.stop = stop  # asked after each batch once the other readers' batches are done, with the batches this
        # pass read for it (past `start`): True ends it there
        self.result: Any = None  # set by the pass
        self.tokens = 0
        self.start = 0  # the batches its sums already hold (continued from a cached partial: see StatisticsCache)
        self.partial: Any = None  # a stopped reader's sums as the pass left them (partial_sums), until cached

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

    def partial_sums(self) -> Any:
        """The sums so far, exactly as the pass holds them, for a stopped reader's entry in the statistics cache
        (a later run continues them: continue_sums); None: it cannot be continued. Asked before finish."""
        return None

    def continue_sums(self, sums: Any, done: int) -> None:
        """Take up `sums` of the stream's first `done` batches (partial_sums' of an earlier run on the same
        stream): the pass then reads its batches from `done` on, and the result is the uninterrupted pass's."""
        raise NotImplementedError

    def memo_key(self, stream: list[torch.Tensor]):
        """Where its result goes in a run's memo of statistics (None: nowhere; its declarer keeps the reader)."""
        return None

    def identity(self):
        """Readers with the same identity compute the same result (one of them reads for all); None: its own."""
        return None

    def cache_identity(self) -> list | None:
        """What, beside the batches it reads, the model and the pass's precision, its result depends on, for the
        statistics cache (StatisticsCache); None: never cached."""
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

    def partial_sums(self):
        return self.parts

    def continue_sums(self, sums, done) -> None:
        self.parts, self.start = dict(sums), done

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

    def cache_identity(self):
        return ["column-moments"]


def pass_stream(batches: list[torch.Tensor], more, m: int) -> list[torch.Tensor]:
    """The statistics pass's m batches: the init batches the run drew, then as many more as it needs from `more`
    (a fork of the init sampler where those batches left it)."""
    return batches[:m] + [more.next_batch() for _ in range(m - len(batches))]


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
        if r.batches < r.asked and not split:  # (stopped: its sums as they are, for the cache to keep)
            r.partial = r.partial_sums()
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
            reading[:] = [r for r in readers if r.start <= j < r.batches]  # (start: summed by an earlier run)
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
                    # (asked with the batches this pass read: a continued reader's cached ones are neither time
                    # spent nor a count it may stop below)
                    if r.stop is not None and done >= anyway and r.start < done < r.batches and r.stop(done - r.start):
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


STATS_CACHE_ENV = "PG_PRUNE_STATS_CACHE"
STATS_CACHE_BYTES = 4 << 30  # the statistics cache's folder at most (the least recently used entries go first)
STATS_CACHE_VERSION = 1  # in every key: a change to what a reader sums is a new version


def stats_cache_dir() -> Path | None:
    """$PG_PRUNE_STATS_CACHE (off, 0, none or empty: no cache), else $PG_PRUNE_CACHE/statistics (None where that is
    off)."""
    from ..storage.ppl_cache import cache_dir, switched_off

    value = os.environ.get(STATS_CACHE_ENV)
    if value is not None:
        return None if switched_off(value) else Path(value).expanduser()
    root = cache_dir()
    return root / "statistics" if root is not None else None


def tensors_bytes(value) -> int:
    """The bytes of the tensors in a nest of dicts, lists and tuples."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensors_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensors_bytes(v) for v in value)
    return 0


class StatisticsCache:
    """A folder of readers' results (torch.save of {"result", "tokens"}), one file per key: the reader's cache
    identity, the model (`model_key`: its files by content), the weights' and the pass's dtypes, the device type,
    and the token ids of the batches it reads. Entries are written whole (a temporary file renamed), read by the
    weights-only loader, and an entry that cannot be read is computed again and written over, said in one line."""

    def __init__(self, folder: Path, model_key: str, log: Callable[[str], None] = lambda s: None,
                 max_bytes: int = STATS_CACHE_BYTES):
        self.folder, self.model_key, self.log, self.max_bytes = Path(folder), model_key, log, max_bytes

    @classmethod
    def for_run(cls, run) -> "StatisticsCache | None":
        """The run's cache: None without a folder, for a model given in memory (its files say nothing of its weights)
        and under torchrun (the ranks need not share a folder)."""
        from ..storage.ppl_cache import files_key
        from ..model.precision import run_device_type, run_pass_dtype

        folder = stats_cache_dir()
        if folder is None or not run.from_disk or run.world.size > 1:
            return None
        model = files_key(run.source, run.config.dtype)
        if model is None:
            return None
        return cls(folder, json.dumps([model, run_pass_dtype(run.config, run.model),
                                       run_device_type(run.config, run.model)]), run.log)

    def path(self, reader: Statistic, stream: list[torch.Tensor]) -> Path | None:
        who = reader.cache_identity()
        if who is None:
            return None
        h = hashlib.sha256(json.dumps([STATS_CACHE_VERSION, who, self.model_key]).encode())
        for b in stream[:reader.asked]:
            h.update(str(tuple(b.shape)).encode())
            h.update(b.numpy().tobytes())
        return self.folder / f"{who[0]}-{h.hexdigest()[:20]}.pt"

    @staticmethod
    def partial_path(path: Path) -> Path:
        """Where a stopped reader's sums wait for a run that continues them (beside the whole entry's path)."""
        return path.with_name(path.name.replace(".pt", ".partial.pt"))

    def read(self, reader: Statistic, stream: list[torch.Tensor]) -> bool:
        """The reader's result from the cache (result, tokens and batches set): True; False where it has none. A
        reader an earlier run's time budget stopped left its sums: the reader continues them (its start set; still
        False: the pass reads the batches after them)."""
        path = self.path(reader, stream)
        if path is None:
            return False
        if path.is_file() and (got := self._load(path, reader, ("result", "tokens"))) is not None:
            reader.result, reader.tokens, reader.batches = got["result"], got["tokens"], reader.asked
            self.log(f"statistics: {reader.label} ({reader.asked} batches) from the cache {path}")
            return True
        partial = self.partial_path(path)
        if (got := self._partial(partial, reader)) is not None:
            reader.continue_sums(got["sums"], got["done"])
            self.log(f"statistics: {reader.label}: {got['done']} of {reader.asked} batches from the cache {partial} "
                     "(an earlier run's time budget stopped them there), the rest read now")
        return False

    def done(self, reader: Statistic, stream: list[torch.Tensor]) -> int:
        """How many of the reader's batches the cache holds for this stream, for a plan: all it asks (a whole
        entry), the batches a stopped run summed (a partial entry, as read() would continue it), or 0."""
        path = self.path(reader, stream)
        if path is None:
            return 0
        if path.is_file():
            return reader.asked
        got = self._partial(self.partial_path(path), reader, peek=True)
        return got["done"] if got is not None else 0

    def _partial(self, partial: Path, reader: Statistic, peek: bool = False) -> dict | None:
        """A stopped reader's entry ({sums, done}) where it holds 0 < done < asked batches, else None. peek: its
        sums mapped, not read, and the entry not marked as used (a plan looks at it)."""
        if not partial.is_file():
            return None
        got = self._load(partial, reader, ("sums", "done"), mmap=peek, touch=not peek)
        return got if got is not None and 0 < got["done"] < reader.asked else None

    def _load(self, path: Path, reader: Statistic, keys: tuple[str, ...], mmap: bool = False,
              touch: bool = True) -> dict | None:
        from ..storage.io import safe_load

        try:
            got = safe_load(path, "statistics cache entry", "", mmap=mmap)
            if not isinstance(got, dict) or any(k not in got for k in keys) or not isinstance(got[keys[1]], int):
                raise ValueError("not an entry this cache writes")
        except Exception as e:  # (an unreadable entry is computed again: the cache only saves time)
            self.log(f"statistics: the cache's entry {path} cannot be read ({str(e).splitlines()[0][:160]}): "
                     f"{reader.label} computed again")
            return None
        try:
            if touch:
                os.utime(path)  # (recently used: kept before the others)
        except OSError:
            pass
        return got

    def write(self, reader: Statistic, stream: list[torch.Tensor]) -> None:
        """The reader's finished result into the cache, or a stopped reader's sums (partial_path: a later run on the
        same stream continues them), then the oldest entries out until the folder is within max_bytes. A write that
        fails (a full disk, a folder it may not write) costs the run nothing but the line that says so."""
        path = self.path(reader, stream)
        if path is None:
            return
        if reader.batches != reader.asked:  # (stopped by the time budget)
            sums, reader.partial = reader.partial, None  # (the float64 sums: released once written)
            if sums is None or reader.batches <= reader.start:
                return
            entry, path = {"sums": sums, "done": reader.batches}, self.partial_path(path)
        else:
            entry = {"result": reader.result, "tokens": reader.tokens}
            self.partial_path(path).unlink(missing_ok=True)  # (continued to the end: the whole entry replaces it)
        self._save(entry, path, reader)

    def _save(self, entry: dict, path: Path, reader: Statistic) -> None:
        size = tensors_bytes(entry)
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            if size > self.max_bytes // 2 or shutil.disk_usage(self.folder).free < 2 * size + (1 << 30):
                self.log(f"statistics: {reader.label} not cached ({size / 2**30:.1f} GiB: over half the cache's "
                         f"{self.max_bytes / 2**30:.0f} GiB, or more than the disk has free)")
                return
            tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
            try:
                torch.save(entry, tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            self.trim(keep=path)
        except OSError as e:
            self.log(f"statistics: {reader.label} not cached ({e})")

    def trim(self, keep: Path) -> None:
        entries = sorted((p for p in self.folder.glob("*.pt") if p.is_file()), key=lambda p: p.stat().st_mtime,
                         reverse=True)
        total = 0
        for p in entries:
            total += p.stat().st_size
            if total > self.max_bytes and p != keep:
                p.unlink(missing_ok=True)


def statistics_pass(run, batches: list[torch.Tensor], readers: list[Statistic], memo: dict) -> None:
    """A fresh run's one statistics pass: `readers` over the init stream, whose first batches are `batches` (the
    init batches the run drew; the stream goes on from there, the init sampler left where it is), in the phase
    "statistics"; the results with a memo key go into `memo` (the run's, which the init metric and the hooks
    share), the others stay with their readers (run: the run's resources, engine/run/resources.py). Readers of
    the same statistic on the same batches read once."""
    twins: dict = {}
    for r in readers:
        twins.setdefault(r.identity() or id(r), r)
    unique = list(twins.values())
    m = longest(unique)
    if not m:
        return
    stream = pass_stream(batches, fork(run.init_sampler), m)
    cache = StatisticsCache.for_run(run)
    with run.phases("statistics"):
        todo = [r for r in unique if cache is None or not cache.read(r, stream)]
        if todo:
            run.log(f"statistics: one pass over {longest(todo)} calibration batches for " + ", ".join(
                f"{r.label} ({r.batches})" for r in todo))
            one_pass(run.adapter, stream, todo, run.world, run.log)
            for r in todo:
                if cache is not None:
                    cache.write(r, stream)
                r.partial = None  # (a stopped reader's sums, kept for the cache alone)
    for r in readers:
        twin = twins[r.identity() or id(r)]
        r.result, r.tokens, r.batches = twin.result, twin.tokens, twin.batches
        if (key := r.memo_key(stream)) is not None:
            memo[key] = r.result
