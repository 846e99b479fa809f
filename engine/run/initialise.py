"""A run's starting point: the init metric of every unit type, mapped to keep probabilities, and the dense and
init perplexities."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from ..storage import ppl_cache
from ..errors import UserError
from ..algo.metrics import METRICS, MetricContext
from ..algo.metrics.registry import removal_order
from .mix import choose_mix
from ..algo.metrics.probability import initial_scores, standardize
from ..model.precision import run_pass_dtype, run_passes
from ..algo.statistics import STATISTICS, Statistic, StatisticsCache, fork, pass_stream, statistics_pass
from .files import INIT_PROGRESS_DIR
from .state import RunState
from ..model.unit_types import UNIT_TYPES

if TYPE_CHECKING:  # annotations only
    from .resources import RunResources


def metric_names(res: "RunResources") -> dict[str, str]:
    """unit type -> the init metric it is scored by (res.loop.unit_metric for widths, --layer-init for layers)."""
    return {u: res.config.layer_init if UNIT_TYPES[u].whole_layer else res.loop.unit_metric for u in res.layout.unit_types}


def metric_batches(c, units: list[str]) -> int:
    """Calibration batches a metric of these unit types takes: --layer-init-batches for whole layers (their
    metrics run the model once per layer, SLEB once per layer and removal), --init-batches otherwise."""
    return max(c.layer_init_batches if UNIT_TYPES[u].whole_layer else c.init_batches for u in units)


def metric_cache_folder(from_disk: bool = True) -> str | None:
    """$PG_PRUNE_METRIC_CACHE (off, 0, none or empty: no cache), else $PG_PRUNE_CACHE/metrics for a run whose model
    was read from its files (None for one given in memory, or where $PG_PRUNE_CACHE is off): a second run on the
    same batches takes its init metric from there. One that names a file (or anything but a folder) is refused in
    one line (PruneRun checks it before the model's work starts)."""
    value = os.environ.get("PG_PRUNE_METRIC_CACHE")
    if value is None:
        root = ppl_cache.cache_dir() if from_disk else None
        return str(root / "metrics") if root is not None else None
    shared = None if ppl_cache.switched_off(value) else value
    if shared and Path(shared).exists() and not Path(shared).is_dir():
        raise UserError(f"$PG_PRUNE_METRIC_CACHE is {shared}, which is a file, not a folder: point it at a folder "
                        "(it is created if missing), or unset it")
    return shared


def run_metric_cache(res: "RunResources") -> str | None:
    """The run's metric cache folder (metric_cache_folder), as rank 0 finds it (every rank's answer)."""
    world = res.world
    return world.from_writer(metric_cache_folder(getattr(res, "from_disk", False)) if world.writes else None,
                             "the metric cache's folder")


def cache_entry(res: "RunResources", name: str, units: list[str], ctx: MetricContext, folder: str, keep) -> Path:
    """The file in `folder` that holds the metric's value for ctx (see cached_metric)."""
    key = [name, units, res.source.path, res.source.gguf_file, keep, ctx.seed, res.config.dtype]
    if getattr(res, "from_disk", False) and (files := ppl_cache.files_key(res.source, res.config.dtype)):
        key.append({"files": files})  # (by content: weights written over at the same path are another model)
    if (passes := run_pass_dtype(res.config, res.model)) != res.config.dtype:  # (float32 passes keep their old keys)
        key.append({"passes": passes})
    if METRICS[name].greedy and ctx.finalists:  # (another order than SLEB's own; entries without finalists keep their key)
        key.append({"finalists": ctx.finalists})
    h = hashlib.sha1(json.dumps(key).encode())
    for b in ctx.batches:
        h.update(b.numpy().tobytes())
    return Path(folder) / f"{name}-{h.hexdigest()[:16]}.pt"


def metric_cached(res: "RunResources", name: str, units: list[str], ctx: MetricContext) -> bool:
    """Does $PG_PRUNE_METRIC_CACHE hold this metric's value for ctx, so that cached_metric will not compute it? (A
    greedy metric's order is continued, never skipped: False.) Rank 0's folder answers for every rank."""
    world = res.world
    shared = run_metric_cache(res)
    if not shared or METRICS[name].greedy:
        return False
    return bool(world.from_writer(cache_entry(res, name, units, ctx, shared, ctx.keep_ratio).is_file() if world.writes
                                  else None, "the metric cache's answer"))


def cached_metric(res: "RunResources", name: str, units: list[str], ctx: MetricContext) -> dict[str, list[torch.Tensor]]:
    """METRICS[name] on ctx, or its earlier result from the folder $PG_PRUNE_METRIC_CACHE when one is set (a
    bench's cells share SLEB's 30 CPU minutes this way): keyed by the metric, the unit types, the model, the
    keep ratio, the seed and the calibration batches themselves, so a cached value is the same computation's.
    A greedy metric's (SLEB's) entry holds its removal order instead, keyed without the keep ratio: a run to any
    ratio takes the removals cached and makes only those beyond them (the order to 40 % starts with the order to
    30 %, removal for removal), then stores the longer order.
    Under torchrun rank 0's folder counts: rank 0 alone reads and writes it and sends a cached value to the others
    (the ranks need not share a filesystem); a value not cached is computed by every rank together.
    Without a cache folder a greedy metric keeps its order in the run's own folder (INIT_PROGRESS_DIR) until the
    run's first checkpoint, so that --resume after a stop during SLEB continues its removals."""
    world, metric = res.world, METRICS[name]
    shared = run_metric_cache(res)
    folder = shared or (str(res.out / INIT_PROGRESS_DIR) if metric.greedy and res.out is not None else None)
    if not folder:
        return metric.fn(ctx, units)

    def path(keep) -> Path:
        return cache_entry(res, name, units, ctx, folder, keep)

    def read(found: Path | None):
        from ..storage.io import safe_load  # (weights only: an entry naming a Python object is refused, never run)

        value = safe_load(found, "cached metric entry", "Delete it: the metric is computed again") \
            if world.writes and found else None
        return world.from_writer(value, f"the cached {name} metric")

    def write(dest: Path, value) -> None:
        if world.writes:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_suffix(f".tmp{os.getpid()}")
            torch.save(value, tmp)
            os.replace(tmp, dest)

    if metric.greedy:
        order_file, before = path("greedy order"), path(ctx.keep_ratio)  # (before: a cache from before orders)
        found = world.from_writer(next((str(f) for f in (order_file, before) if f.is_file()), None) if world.writes
                                  else None, "the metric cache's answer")
        cached = read(Path(found) if found else None)
        ctx.prefix = cached["order"] if isinstance(cached, dict) and "order" in cached else (
            removal_order(cached) if cached else [])
        if ctx.prefix:
            where = "the metric cache" if shared else "the run's stopped start:"
            res.log(f"{name}: {len(ctx.prefix)} removals taken from {where} {found}")
        longest = len(ctx.prefix)

        def store(order: list[int]) -> None:  # (after each removal, so that a stopped run keeps what it made)
            nonlocal longest
            if len(order) > longest:
                write(order_file, {"order": order})
                longest = len(order)

        ctx.on_removal = store
        out = metric.fn(ctx, units)
        if found != str(order_file):  # (an order cached by ratio, or none: stored in the order's entry)
            write(order_file, {"order": removal_order(out)})
        return out
    dest = path(ctx.keep_ratio)
    if world.from_writer(dest.is_file() if world.writes else None, "the metric cache's answer"):
        res.log(f"{name}: taken from the metric cache {dest}")
        return read(dest)
    out = metric.fn(ctx, units)
    write(dest, out)
    return out


def metric_contexts(res: "RunResources", batches: list[torch.Tensor]) -> list[tuple[str, list[str], MetricContext]]:
    """(metric, the unit types it scores, its context) for each init metric of the res."""
    c, wanted = res.config, metric_names(res)
    out = []
    for name in dict.fromkeys(wanted.values()):
        units = [u for u, m in wanted.items() if m == name]
        out.append((name, units, MetricContext(res.adapter, res.layout, batches[:metric_batches(c, units)],
                                               keep_ratio=c.keep_ratio, seed=c.seed + 2, progress=res.loop.progress,
                                               log=res.log, world=res.world, memo=res.loop.stats_memo,
                                               finalists=c.sleb_finalists)))
    return out


def statistics_readers(res: "RunResources", batches: list[torch.Tensor], planned: bool = False) -> list[Statistic]:
    """The readers of a fresh run's one statistics pass (engine/algo/statistics.py): the statistics each init metric
    reads on its batches (unless the metric cache holds its value) and those each hook wants (planned: the readers
    the plan asks the cache about, which the hooks do not keep)."""
    readers = [STATISTICS[s](len(ctx.batches)) for name, units, ctx in metric_contexts(res, batches)
               for s in METRICS[name].statistics if not metric_cached(res, name, units, ctx)]
    for hook in res.hooks:
        readers += hook.planned_statistics(batches) if planned else hook.statistics_wanted(batches)
    return readers


def initial_metric(res: "RunResources", batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The standardized importance metric of every unit type (flat; higher = keep)."""
    wanted = metric_names(res)
    raw: dict[str, list[torch.Tensor]] = {}
    for name, units, ctx in metric_contexts(res, batches):
        res.log(f"computing the {name} metric for {', '.join(units)}")
        raw.update(cached_metric(res, name, units, ctx))
    return {u: torch.cat(raw[u]).float() if METRICS[wanted[u]].comparable else standardize(u, raw[u])
            for u in res.layout.unit_types}


def init_batch_count(res: "RunResources") -> int:
    """The calibration batches a fresh run draws for its init metric and its hooks (0 where none reads data)."""
    c, names = res.config, metric_names(res)
    if not (any(h.needs_data for h in res.hooks) or any(METRICS[m].needs_data for m in names.values())):
        return 0
    return max([metric_batches(c, [u]) for u in res.layout.unit_types] + [c.init_batches for h in res.hooks if h.needs_data])


def cached_phases(res: "RunResources") -> dict[str, float]:
    """The one-shot phases a fresh run will take in part or whole from its caches, for its plan: {phase: the share
    of it left to compute}. "init metric" (0.0) where the metric cache holds every init metric's value for the
    batches the run will draw; "statistics" where the statistics cache holds readers of the pass, whole or as the
    sums a budget-cut run left (the share: the forwards the pass still runs, of a fresh pass's). Read on a copy of
    the init sampler (the run draws the same batches after). Nothing under torchrun (the answer would be a
    collective; the statistics cache is off there)."""
    n = init_batch_count(res)
    if not n or res.world.size > 1:
        return {}
    peek = fork(res.init_sampler)
    batches = [peek.next_batch() for _ in range(n)]
    out = {}
    if all(metric_cached(res, name, units, ctx) for name, units, ctx in metric_contexts(res, batches)):
        out["init metric"] = 0.0
    readers = statistics_readers(res, batches, planned=True)
    cache = StatisticsCache.for_run(res)
    if readers and cache is not None:
        fresh = max(r.asked for r in readers)
        stream = pass_stream(batches, peek, fresh)
        left = set()  # (the batches some reader still reads: the pass's forwards)
        for r in readers:
            left.update(range(cache.done(r, stream), r.asked))
        if len(left) < fresh:
            out["statistics"] = len(left) / fresh
    return out


def fresh_state(res: "RunResources", call_hooks: Callable[..., None]) -> RunState:
    """Scores from the init metric (each hook's before_scores and on_init run on them, through the loop's
    call_hooks, which applies their changes), then the dense and init perplexities."""
    c, names = res.config, metric_names(res)
    res.loop.stats_memo = memo = {}  # activation statistics the metric and the hooks share (metrics.activations.column_moments)
    res.log(f"initialising scores ({', '.join(dict.fromkeys(names.values()))}, {c.prob_map})")
    batches = [res.init_sampler.next_batch() for _ in range(init_batch_count(res))]
    with run_passes(res):  # (bfloat16 matrix products where the CPU runs them natively: --pass-dtype)
        statistics_pass(res, batches, statistics_readers(res, batches), memo)  # (the dense model's, before any mask)
        with res.phases("init metric"):
            z = initial_metric(res, batches)
        call_hooks("before_scores", batches)
    keep0, mix = res.masks.keep_ratio_at(0), None
    comparable = [u for u in res.layout.unit_types if METRICS[names[u]].comparable]  # (FLAP's adaptive structure)
    if getattr(res.budget, "nested", False):  # layers and widths on one budget: the mix that loses least
        first = [] if c.init_data == "all" else list(res.val_batches or [])  # (all: as a one-shot run chooses it)
        wanted = c.mix_batches + c.mix_refine_batches
        mix_on = (first + batches)[:wanted]
        mix_on += [res.init_sampler.next_batch() for _ in range(wanted - len(mix_on))]  # (metrics without data)
        with res.phases("joint mix"), run_passes(res):
            scores, mix = choose_mix(res, z, mix_on[:c.mix_batches], keep0, comparable=frozenset(comparable),
                                     more=mix_on[c.mix_batches:])
    else:  # each type at its share of the budget (budget.type_keeps), then one projection over them all
        keeps = res.budget.type_keeps(keep0, {u: z[u] for u in comparable} if len(comparable) > 1 else None)
        scores = res.budget.initial({u: initial_scores(z[u], res.layout, u, c.scope, keeps.get(u, keep0), *c.map_for(u))
                                     for u in res.layout.unit_types}, keep0)
    state = RunState(step=0, scores=scores, baseline=None, sampler_state={}, mask_rng_state=res.mask_rng.get_state(),
                     ppl_dense=float("nan"), ppl_init=float("nan"), init_scores={u: s.clone() for u, s in scores.items()},
                     init_metric=z, init_mix=mix, init_mask_scores=res.budget.init_mask_scores(scores))
    call_hooks("on_init", state, batches)
    res.loop.stats_memo = None  # (the model is masked from here on: no statistic of the dense model is reused)
    state.ppl_dense = res.masks.dense_perplexity()
    state.ppl_init = init_perplexity(res, state)  # (the init mask the app shows)
    return state


def init_perplexity(res: "RunResources", state: RunState) -> float | None:
    """The init mask's perplexity, or None when the run does not evaluate it (PruneConfig.evaluates_init: not under
    --time-budget unless --eval-init)."""
    if res.config.evaluates_init:
        return res.masks.masked_perplexity(res.masks.init_masks(state), "init")
    res.log("init perplexity: skipped (--eval-init evaluates it)")
    return None
