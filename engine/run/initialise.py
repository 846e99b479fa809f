"""A run's starting point: the init metric of every unit type, mapped to keep probabilities, and the dense and
init perplexities."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..storage import ppl_cache
from ..errors import UserError
from ..storage.io import atomic_write_text
from ..algo.metrics import METRICS, MetricContext
from ..algo.metrics.registry import removal_order
from .mix import choose_mix
from ..algo.metrics.probability import initial_scores, standardize
from ..model.precision import run_pass_dtype, run_passes
from ..algo.statistics import STATISTICS, Statistic, StatisticsCache, fork, pass_stream, statistics_pass
from .folder import CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE, check_checkpoint_kept, write_run_marker
from .files import INIT_PROGRESS_DIR
from .state import RunState, check_finite
from ..model.unit_types import UNIT_TYPES

if TYPE_CHECKING:  # annotations only
    from .loop import PruneRun


def metric_names(run: "PruneRun") -> dict[str, str]:
    """unit type -> the init metric it is scored by (run.unit_metric for widths, --layer-init for layers)."""
    return {u: run.config.layer_init if UNIT_TYPES[u].whole_layer else run.unit_metric for u in run.layout.unit_types}


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


def run_metric_cache(run: "PruneRun") -> str | None:
    """The run's metric cache folder (metric_cache_folder), as rank 0 finds it (every rank's answer)."""
    world = run.world
    return world.from_writer(metric_cache_folder(getattr(run, "from_disk", False)) if world.writes else None,
                             "the metric cache's folder")


def cache_entry(run: "PruneRun", name: str, units: list[str], ctx: MetricContext, folder: str, keep) -> Path:
    """The file in `folder` that holds the metric's value for ctx (see cached_metric)."""
    key = [name, units, run.source.path, run.source.gguf_file, keep, ctx.seed, run.config.dtype]
    if getattr(run, "from_disk", False) and (files := ppl_cache.files_key(run.source, run.config.dtype)):
        key.append({"files": files})  # (by content: weights written over at the same path are another model)
    if (passes := run_pass_dtype(run.config, run.model)) != run.config.dtype:  # (float32 passes keep their old keys)
        key.append({"passes": passes})
    if METRICS[name].greedy and ctx.finalists:  # (another order than SLEB's own; entries without finalists keep their key)
        key.append({"finalists": ctx.finalists})
    h = hashlib.sha1(json.dumps(key).encode())
    for b in ctx.batches:
        h.update(b.numpy().tobytes())
    return Path(folder) / f"{name}-{h.hexdigest()[:16]}.pt"


def metric_cached(run: "PruneRun", name: str, units: list[str], ctx: MetricContext) -> bool:
    """Does $PG_PRUNE_METRIC_CACHE hold this metric's value for ctx, so that cached_metric will not compute it? (A
    greedy metric's order is continued, never skipped: False.) Rank 0's folder answers for every rank."""
    world = run.world
    shared = run_metric_cache(run)
    if not shared or METRICS[name].greedy:
        return False
    return bool(world.from_writer(cache_entry(run, name, units, ctx, shared, ctx.keep_ratio).is_file() if world.writes
                                  else None, "the metric cache's answer"))


def cached_metric(run: "PruneRun", name: str, units: list[str], ctx: MetricContext) -> dict[str, list[torch.Tensor]]:
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
    world, metric = run.world, METRICS[name]
    shared = run_metric_cache(run)
    folder = shared or (str(run.out / INIT_PROGRESS_DIR) if metric.greedy and run.out is not None else None)
    if not folder:
        return metric.fn(ctx, units)

    def path(keep) -> Path:
        return cache_entry(run, name, units, ctx, folder, keep)

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
            run.log(f"{name}: {len(ctx.prefix)} removals taken from {where} {found}")
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
        run.log(f"{name}: taken from the metric cache {dest}")
        return read(dest)
    out = metric.fn(ctx, units)
    write(dest, out)
    return out


def metric_contexts(run: "PruneRun", batches: list[torch.Tensor]) -> list[tuple[str, list[str], MetricContext]]:
    """(metric, the unit types it scores, its context) for each init metric of the run."""
    c, wanted = run.config, metric_names(run)
    out = []
    for name in dict.fromkeys(wanted.values()):
        units = [u for u, m in wanted.items() if m == name]
        out.append((name, units, MetricContext(run.adapter, run.layout, batches[:metric_batches(c, units)],
                                               keep_ratio=c.keep_ratio, seed=c.seed + 2, progress=run.progress,
                                               log=run.log, world=run.world, memo=run.stats_memo,
                                               finalists=c.sleb_finalists)))
    return out


def statistics_readers(run: "PruneRun", batches: list[torch.Tensor], planned: bool = False) -> list[Statistic]:
    """The readers of a fresh run's one statistics pass (engine/algo/statistics.py): the statistics each init metric
    reads on its batches (unless the metric cache holds its value) and those each hook wants (planned: the readers
    the plan asks the cache about, which the hooks do not keep)."""
    readers = [STATISTICS[s](len(ctx.batches)) for name, units, ctx in metric_contexts(run, batches)
               for s in METRICS[name].statistics if not metric_cached(run, name, units, ctx)]
    for hook in run.hooks:
        readers += hook.planned_statistics(batches) if planned else hook.statistics_wanted(batches)
    return readers


def initial_metric(run: "PruneRun", batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The standardized importance metric of every unit type (flat; higher = keep)."""
    wanted = metric_names(run)
    raw: dict[str, list[torch.Tensor]] = {}
    for name, units, ctx in metric_contexts(run, batches):
        run.log(f"computing the {name} metric for {', '.join(units)}")
        raw.update(cached_metric(run, name, units, ctx))
    return {u: torch.cat(raw[u]).float() if METRICS[wanted[u]].comparable else standardize(u, raw[u])
            for u in run.layout.unit_types}


def init_batch_count(run: "PruneRun") -> int:
    """The calibration batches a fresh run draws for its init metric and its hooks (0 where none reads data)."""
    c, names = run.config, metric_names(run)
    if not (any(h.needs_data for h in run.hooks) or any(METRICS[m].needs_data for m in names.values())):
        return 0
    return max([metric_batches(c, [u]) for u in run.layout.unit_types] + [c.init_batches for h in run.hooks if h.needs_data])


def cached_phases(run: "PruneRun") -> dict[str, float]:
    """The one-shot phases a fresh run will take in part or whole from its caches, for its plan: {phase: the share
    of it left to compute}. "init metric" (0.0) where the metric cache holds every init metric's value for the
    batches the run will draw; "statistics" where the statistics cache holds readers of the pass, whole or as the
    sums a budget-cut run left (the share: the forwards the pass still runs, of a fresh pass's). Read on a copy of
    the init sampler (the run draws the same batches after). Nothing under torchrun (the answer would be a
    collective; the statistics cache is off there)."""
    n = init_batch_count(run)
    if not n or run.world.size > 1:
        return {}
    peek = fork(run.init_sampler)
    batches = [peek.next_batch() for _ in range(n)]
    out = {}
    if all(metric_cached(run, name, units, ctx) for name, units, ctx in metric_contexts(run, batches)):
        out["init metric"] = 0.0
    readers = statistics_readers(run, batches, planned=True)
    cache = StatisticsCache.for_run(run)
    if readers and cache is not None:
        fresh = max(r.asked for r in readers)
        stream = pass_stream(batches, peek, fresh)
        left = set()  # (the batches some reader still reads: the pass's forwards)
        for r in readers:
            left.update(range(cache.done(r, stream), r.asked))
        if len(left) < fresh:
            out["statistics"] = len(left) / fresh
    return out


def fresh_state(run: "PruneRun") -> RunState:
    """Scores from the init metric (each hook's on_init runs on them), then the dense and init perplexities."""
    c, names = run.config, metric_names(run)
    run.stats_memo = {}  # activation statistics the metric and the hooks share (metrics.activations.column_moments)
    run.log(f"initialising scores ({', '.join(dict.fromkeys(names.values()))}, {c.prob_map})")
    batches = [run.init_sampler.next_batch() for _ in range(init_batch_count(run))]
    with run_passes(run):  # (bfloat16 matrix products where the CPU runs them natively: --pass-dtype)
        statistics_pass(run, batches, statistics_readers(run, batches))  # (the dense model's, before any mask)
        with run.phases("init metric"):
            z = initial_metric(run, batches)
        run.call_hooks("before_scores", batches)
    keep0, mix = run.keep_ratio_at(0), None
    comparable = [u for u in run.layout.unit_types if METRICS[names[u]].comparable]  # (FLAP's adaptive structure)
    if getattr(run.budget, "nested", False):  # layers and widths on one budget: the mix that loses least
        first = [] if c.init_data == "all" else list(run.val_batches or [])  # (all: as a one-shot run chooses it)
        wanted = c.mix_batches + c.mix_refine_batches
        mix_on = (first + batches)[:wanted]
        mix_on += [run.init_sampler.next_batch() for _ in range(wanted - len(mix_on))]  # (metrics without data)
        with run.phases("joint mix"), run_passes(run):
            scores, mix = choose_mix(run, z, mix_on[:c.mix_batches], keep0, comparable=frozenset(comparable),
                                     more=mix_on[c.mix_batches:])
    else:  # each type at its share of the budget (budget.type_keeps), then one projection over them all
        keeps = run.budget.type_keeps(keep0, {u: z[u] for u in comparable} if len(comparable) > 1 else None)
        scores = run.budget.initial({u: initial_scores(z[u], run.layout, u, c.scope, keeps.get(u, keep0), *c.map_for(u))
                                     for u in run.layout.unit_types}, keep0)
    state = RunState(step=0, scores=scores, baseline=None, sampler_state={}, mask_rng_state=run.mask_rng.get_state(),
                     ppl_dense=float("nan"), ppl_init=float("nan"), init_scores={u: s.clone() for u, s in scores.items()},
                     init_metric=z, init_mix=mix, init_mask_scores=run.budget.init_mask_scores(scores))
    run.call_hooks("on_init", state, batches)
    run.stats_memo = None  # (the model is masked from here on: no statistic of the dense model is reused)
    state.ppl_dense = run.masks.dense_perplexity()
    state.ppl_init = init_perplexity(run, state)  # (the init mask the app shows)
    return state


def init_perplexity(run: "PruneRun", state: RunState) -> float | None:
    """The init mask's perplexity, or None when the run does not evaluate it (PruneConfig.evaluates_init: not under
    --time-budget unless --eval-init)."""
    if run.config.evaluates_init:
        return run.masked_perplexity(run.masks.init_masks(state), "init")
    run.log("init perplexity: skipped (--eval-init evaluates it)")
    return None


def start_state(run: "PruneRun", resume: bool) -> RunState:
    """The state a run starts from: its checkpoint (--resume), or a fresh one written as the first checkpoint."""
    if resume:
        check_checkpoint_kept(run.out)  # (the app's resume too: steps recorded and no checkpoint is refused)
    if resume and (run.out / CHECKPOINT_FILE).exists():
        state = run.load_checkpoint()
        run.restore_metrics(state)
        run.log(f"resuming {run.out} at step {state.step}/{run.config.steps}")
        return state
    if run.out is not None:  # (None: a run in memory, engine.api.prune, which writes nothing)
        write_run_marker(run.out)  # first: from now on the folder is recognisably a run
        run.config.save(run.out / CONFIG_FILE)
    state = run.fresh_state()
    check_finite("the initial scores", state.scores, {k: v for k, v in {"dense perplexity": state.ppl_dense,
                                                                        "init perplexity": state.ppl_init}.items() if v is not None})
    if run.out is None:
        return state
    run.checkpoints.save(state)
    if run.world.writes:
        shutil.rmtree(run.out / INIT_PROGRESS_DIR, ignore_errors=True)  # (the checkpoint holds the init from here on)
    atomic_write_text(run.out / METRICS_FILE, "")  # (replaces a link there, never writes its target)
    return state
