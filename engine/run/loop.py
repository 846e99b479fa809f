"""The pruning run: the forward-only optimisation loop, read top to bottom in `run`; one step is `step`.

    run = PruneRun(config, out_dir)          # loads model and data
    result = run.run(observer=print)         # optimises, evaluates, exports; resumable

What a method computes lives in engine/algo/methods (it sees a StepContext, never the run), an init metric in
engine/algo/metrics, the start in engine/run/initialise.py, the checkpoint in engine/run/checkpoints.py, results.json
in engine/run/results.py, the run folder's rules in engine/run/folder.py, and every cross-cutting option (progressive
schedule, bias compensation, unit multiples, validation, best-val, within-layer ranking) is a hook in
engine/hooks that joins the run when its config asks for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from ..model.arch import ModelAdapter
from ..algo.budget import BUDGETS
from ..data.calib_sources import (CALIB_SOURCES, PHASE as CALIB_PHASE, check_cache_dir as check_self_calib_cache,
                                  check_generation, run_generates, source_of, step_source_of)
from .checkpoints import Checkpoints
from ..settings.config import PruneConfig
from ..algo.context import StepContext
from ..model.distributed import World, weights_digest
from ..data.text import CalibrationSampler, eval_windows, load_calibration_texts, load_eval_text, split_holdout
from ..errors import UserError
from ..model.executors import EXECUTORS, resolve_executor
from ..hooks import KEEP, RUN_HOOKS, RunChanges, RunView, joined_transforms
from .initialise import fresh_state, metric_cache_folder
from ..algo.statistics import STATS_CACHE_ENV, stats_cache_dir
from ..model.loading import check_positions, load_model, model_device, resolve_model
from ..algo.methods import METHODS, method_options
from ..storage.outdir import folder_lock
from .phases import PhaseClock
from ..plan.forecast import say_text_plan
from ..model.precision import emulated_bf16_line, run_device_type, run_step_dtype, step_dtype_problem, step_precision
from .plan import plan_with_steps
from .results import finish
from ..model.memory_check import check_run_fits
from ..data.tokenize_docs import tokenize_documents
from ..algo.rewards import REWARDS
from ..storage import ppl_cache
from .masks import RunMasks
from .resources import LoopState, RunResources
from ..storage.io import append_line, atomic_write_text
from .files import INIT_PROGRESS_DIR
from .folder import (CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE, MODEL_DIR, check_checkpoint_kept, check_no_links,
                     check_removable, write_run_marker)
from .state import RunState, StepReport, check_finite, mask_rows  # noqa: F401  (StepReport: part of the run's API)
from ..model.unit_types import UNIT_TYPES
from ..model.units import UnitLayout
from ..model.unit_types import unit_sizes

Observer = Callable[[StepReport], None]


@contextlib.contextmanager
def _held(out: Path | None):
    """The run folder, created and locked for the whole run (a second writer is refused); nothing for a run in
    memory (out None: engine.api.prune), which writes no file."""
    if out is None:
        yield
        return
    out.mkdir(parents=True, exist_ok=True)
    with folder_lock(out, what="prune into"):
        yield


def _no_follow(path: str, flags: int) -> int:
    """open()'s opener for metrics.jsonl: never appends through a symbolic link (rundir.check_no_links names one)."""
    try:
        return os.open(path, flags | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{path} is a symbolic link; a run never writes through one: replace it with the file "
                            "itself, or remove it") from None
        raise


def _run_data(tokenizer, config: PruneConfig, model=None, fingerprint: str | None = None, log=print,
              calib: list[str] | None = None, check: Callable[[dict], None] | None = None):
    """(calibration sampler, init sampler, held-out validation batches, evaluation windows, where the data came
    from {"calib_data", "eval_data", "calib_source"}, the seconds the calibration sources took). The steps' sampler
    and the held-out batches read the steps' source (--step-calib-source; the init's unless it names another),
    the init sampler the init's. With validation on, every 10th document of the steps' text is held out from the
    steps; the init metric (and the joint mix) read every document with --init-data all, as a one-shot run of the
    seed does, so that the run starts from that run's mask, and always where the steps read another source (the
    check reads that source, not the init's); the init sampler is the calibration sampler otherwise.
    check (torchrun: World.check_data) sees the texts as read, before any forward (--calib-source self generates).
    The seconds: the run's "calibration text" phase, where a source generates."""
    texts, calib_source = load_calibration_texts(config.calib) if calib is None else (calib, "in memory")
    text, eval_source = load_eval_text(config.eval_data)
    if check is not None:
        check({"model weights": (lambda: weights_digest(model), config.model),  # (torchrun: other weights, same size)
               "calibration data": (texts, calib_source), "evaluation data": (text, eval_source)})
    began = time.monotonic()  # (the sources' seconds: their own phase, "calibration text", where they generate)
    say = lambda left: say_text_plan(model, config, left, fingerprint is not None, log)  # noqa: E731
    init_texts, scored_on = CALIB_SOURCES[source_of(config)](texts, model, tokenizer, config, fingerprint, log=log,
                                                             before_sampling=say)
    step_texts = init_texts
    if (steps_read := step_source_of(config)) != source_of(config):  # (self and mix share one own text, cached)
        step_texts, steps_on = CALIB_SOURCES[steps_read](texts, model, tokenizer, config, fingerprint, log=log,
                                                         before_sampling=say)
        scored_on = f"{scored_on}; the steps and their check: {steps_on}"
    source_seconds = time.monotonic() - began
    ids = tokenize_documents(tokenizer, init_texts)  # (once: the samplers below share documents; bounded memory)
    step_ids = ids if step_texts is init_texts else tokenize_documents(tokenizer, step_texts)
    val_batches, init_sampler = [], None
    if step_ids is not ids:
        init_sampler = CalibrationSampler(tokenizer, None, config.seqlen, config.batch_size, config.seed, ids)
    if config.validates:
        kept, held_out = split_holdout(step_ids)
        if not held_out:
            CalibrationSampler(tokenizer, None, config.seqlen, config.batch_size, config.seed, step_ids)  # (its error first)
            raise UserError("held-out validation (--val-every, on by default for --final-mask best-val) needs at least "
                            "10 calibration documents (every 10th is held out); give more, or --val-every 0 "
                            "--final-mask last")
        sampler = CalibrationSampler(tokenizer, None, config.seqlen, config.batch_size, config.seed + 3, held_out)
        val_batches = [sampler.next_batch() for _ in range(config.val_batches)]
        if config.init_data == "all" and init_sampler is None:
            init_sampler = CalibrationSampler(tokenizer, None, config.seqlen, config.batch_size, config.seed, ids)
        step_ids = kept
    sampler = CalibrationSampler(tokenizer, None, config.seqlen, config.batch_size, config.seed, step_ids)
    windows = eval_windows(tokenizer, text, config.eval_seqlen, config.max_windows)
    return sampler, init_sampler or sampler, val_batches, windows, {"calib_data": calib_source, "eval_data": eval_source,
                                                                 "calib_source": scored_on}, source_seconds


class PruneRun:
    """One pruning run bound to its output folder: the loop. Model and data are loaded once, here, into the run's
    resources (self.res: engine/run/resources.py); every other module of the run takes those and the state."""

    def __init__(self, config: PruneConfig, out_dir: str | Path, model=None, tokenizer=None, log: Callable[[str], None] = print,
                 started: float | None = None, world: World = World(), calib: list[str] | None = None,
                 from_files: bool = False):
        # started: time.monotonic() the --time-budget counts from; calib: calibration documents in memory (or --calib's);
        # from_files: the model given is config.model's files as engine.model.loading read them, unchanged (the app's
        # kept model), so that what is cached per model (dense perplexity, generated text) applies to it
        started = time.monotonic() if started is None else started
        c = config.resolved()  # (the caller's config is left as it was)
        out = Path(out_dir) if out_dir is not None else None  # None: a run in memory (engine.api), no files
        source = resolve_model(c.model)
        if problem := step_dtype_problem(c, run_device_type(c, model)):
            raise UserError(problem)  # (before the model loads: the CPU decides it)
        from_disk = model is None or from_files  # (only a model read from its files is cached)
        if model is None:
            model, tokenizer = load_model(source, c.dtype, c.device)
        adapter = ModelAdapter.for_model(model)
        if slow := emulated_bf16_line(c, model_device(model).type):
            log(slow)
        step_dtype = run_step_dtype(c, model)  # (the steps' forwards: step())
        if c.step_dtype == "auto" and step_dtype != "bfloat16" and model_device(model).type == "cpu":
            log(f"steps in {step_dtype}: --step-dtype auto and this CPU has no native bfloat16")
        check_positions(model.config, {"seqlen": c.seqlen, "eval seqlen": c.eval_seqlen})
        check_run_fits(c, model)  # (before the data: a batch whose logits cannot fit is refused in one line)
        metric_cache_folder()  # (a $PG_PRUNE_METRIC_CACHE that is a file: refused now, not after the model's work)
        ppl_cache.check_cache_dir()  # (and a $PG_PRUNE_CACHE that is one)
        ppl_cache.check_folder(STATS_CACHE_ENV, stats_cache_dir(), f" (or set {STATS_CACHE_ENV}=off)")  # (and its statistics')
        generates = run_generates(c)
        if generates:  # (and the self-generated text's cache)
            check_self_calib_cache()
            check_generation(c, model.config)  # (documents beyond the positions, or no longer than --seqlen)
        sizes = unit_sizes(adapter)
        layout = UnitLayout({u: sizes[u] for u in c.units})
        budget = BUDGETS[c.budget](layout, c.scope, adapter)
        budget.fixed_layers = c.fixed_layers
        # the key of the text a generating source makes: the model's files (None for a model in memory, or a source
        # that generates none: its files are not hashed for nothing)
        fingerprint = ppl_cache.files_key(source, c.dtype) if from_disk and generates else None
        sampler, init_sampler, val_batches, windows, sources, source_seconds = _run_data(
            tokenizer, c, model, fingerprint, log, calib, check=world.check_data)
        world.check_data({  # (torchrun: every rank read the same token ids, before the steps' first forward)
            "calibration data": ([sampler.docs, init_sampler.docs, val_batches], sources["calib_data"]),
            "evaluation data": (windows, sources["eval_data"])})
        mask_rng = torch.Generator().manual_seed(c.seed + 1)
        own = EXECUTORS[resolve_executor(c.sample_forward, c.device)]
        ctx = StepContext(model, adapter, layout, world.share_executor(own), mask_rng, c.num_mask_samples, c.steps,
                          reward=REWARDS[c.reward]())
        method = METHODS[c.method](ctx, method_options(c.method, c.method_options, c))
        joined = [h for h in RUN_HOOKS if h.applies(c)]
        views = [RunView() for _ in joined]  # (a hook reads its run, never assigns: bound once the resources are)
        hooks = tuple(h(view) for h, view in zip(joined, views))
        masks = RunMasks(joined_transforms(hooks))
        self.res = RunResources(
            config=c, model=model, tokenizer=tokenizer, adapter=adapter, layout=layout, budget=budget,
            sampler=sampler, init_sampler=init_sampler, val_batches=val_batches, windows=windows, sources=sources,
            world=world, log=log, phases=PhaseClock(started), out=out, source=source, from_disk=from_disk,
            started=started, ctx=ctx, method=method, mask_rng=mask_rng, step_dtype=step_dtype, masks=masks,
            hooks=hooks, loop=LoopState(stages=[(0, c.prune_ratio)], unit_metric=c.init))  # (stages: progressive)
        masks.bind(self.res)
        for view in views:
            view.bind(self.res)
        ctx.hard_masks = masks.hard_masks  # (a method may cut its scores, as --unit-block)
        if c.step_refit and c.reconstruct:  # (the samples scored as they would be exported: each under its own refit, a rank its share)
            ctx.weights, ctx.own_executor, ctx.spread = masks.weights, own, world.spread
        self.call_hooks("on_setup")
        self.checkpoints = Checkpoints(self.res)
        if generates:  # (its text read from the cache, or sampled: not "load")
            self.res.phases.carve(CALIB_PHASE, source_seconds)
        self.start_masks = self.init_scores = None  # (what a UI shows as the init mask, once run() has them)

    def replace_resources(self, **changes) -> RunResources:
        """The run's resources with `changes` (a bench's other evaluation windows, data streams or step dtype),
        bound to the masks, the hooks' views and the checkpoints as the originals were; nothing else holds them."""
        self.res = dataclasses.replace(self.res, **changes)
        self.res.masks.bind(self.res)
        for hook in self.res.hooks:
            hook.run.bind(self.res)
        self.checkpoints.res = self.res
        return self.res

    def load_checkpoint(self) -> RunState:
        """The checkpoint's state, checked against this run (Checkpoints.load reads and checks, nothing more), then
        every joined hook told of it (on_resume: the compensation's means back in the forwards, ...)."""
        state = self.checkpoints.load()
        self.call_hooks("on_resume", state)
        return state

    def call_hooks(self, event: str, *args) -> None:
        """Every joined hook's `event` (engine/hooks/base.py), in RUN_HOOKS' order, each one's changes applied
        before the next is called."""
        for hook in self.res.hooks:
            self.apply_changes(getattr(hook, event)(*args))

    def apply_changes(self, changes: RunChanges | None) -> None:
        """The one place where a hook's event changes the run: what it returned (None: nothing)."""
        if changes is None:
            return
        ctx, loop = self.res.ctx, self.res.loop
        if changes.steps is not KEEP:
            ctx.steps = changes.steps
        if changes.comp_means is not KEEP:
            ctx.comp_means = changes.comp_means
        if changes.stages is not KEEP:
            loop.stages = changes.stages
        if changes.unit_metric is not KEEP:
            loop.unit_metric = changes.unit_metric

    def start_state(self, resume: bool) -> RunState:
        """The state the run starts from: its checkpoint (--resume), or a fresh one written as the first checkpoint."""
        res = self.res
        if resume:
            check_checkpoint_kept(res.out)  # (the app's resume too: steps recorded and no checkpoint is refused)
        if resume and (res.out / CHECKPOINT_FILE).exists():
            state = self.load_checkpoint()
            self.checkpoints.restore_metrics(state)
            res.log(f"resuming {res.out} at step {state.step}/{res.config.steps}")
            return state
        if res.out is not None:  # (None: a run in memory, engine.api.prune, which writes nothing)
            write_run_marker(res.out)  # first: from now on the folder is recognisably a run
            res.config.save(res.out / CONFIG_FILE)
        state = fresh_state(res, self.call_hooks)
        check_finite("the initial scores", state.scores, {k: v for k, v in {"dense perplexity": state.ppl_dense,
                                                                            "init perplexity": state.ppl_init}.items() if v is not None})
        if res.out is None:
            return state
        self.checkpoints.save(state)
        if res.world.writes:
            shutil.rmtree(res.out / INIT_PROGRESS_DIR, ignore_errors=True)  # (the checkpoint holds the init from here on)
        atomic_write_text(res.out / METRICS_FILE, "")  # (replaces a link there, never writes its target)
        return state

    # --- the loop --------------------------------------------------------------------------
    def step(self, state: RunState) -> StepReport:
        """One optimisation step: the method's gradient estimate on one calibration batch, then
        s <- proj_C(s - lr g) for every unit type."""
        res = self.res
        t0, batch = time.perf_counter(), res.sampler.next_batch()
        keep, lr = res.masks.keep_ratio_at(state.step), res.masks.lr_at(state.step)
        with step_precision(res.step_dtype, model_device(res.model).type):  # (--step-dtype; the head in float32)
            g = res.method.gradient(state, batch)
        proposed = res.method.next_scores(state, g.grads, lr)
        state.scores = res.budget.project(proposed, keep) if res.method.projects else proposed  # (Method.projects)
        state.step += 1
        seconds = time.perf_counter() - t0
        state.seconds_in_steps += seconds
        hard = res.masks.hard_masks(state.scores, keep)
        detailed = [u for u in state.scores if UNIT_TYPES[u].report_scores]  # the heatmap's data
        layout, steps = res.layout, res.ctx.steps
        return StepReport(
            step=state.step, total_steps=steps, losses=[float(x) for x in g.losses], baseline=float(g.baseline), lr=lr,
            mean_score={u: layout.layer_means(u, s) for u, s in state.scores.items()},
            kept_fraction={u: layout.layer_means(u, m) for u, m in hard.items()},
            head_scores=[p.tolist() for p in layout.split(detailed[0], state.scores[detailed[0]])] if detailed else None,
            seconds=seconds, eta_seconds=(state.seconds_in_steps / state.step) * max(steps - state.step, 0), keep_ratio=keep,
            masks=mask_rows(layout, hard), reward=res.ctx.reward.name)

    def run(self, resume: bool = False, observer: Observer | None = None, stop: threading.Event | None = None,
            progress: bool = True) -> dict:
        """Optimise to config.steps (or until `stop` is set), then evaluate and export, holding the run folder's
        lock throughout (a second writer is refused). Returns results.json's content, or {"status": "stopped"}
        (state saved, resumable). An interrupt (Ctrl-C; SIGTERM in the CLI) checkpoints the last finished step."""
        res, loop = self.res, self.res.loop
        loop.progress = progress
        with _held(res.out):
            if res.out is not None:  # (the CLI and the app check this first; the API's PruneRun here)
                check_no_links(res.out)  # no write of the run goes through a link (metrics.jsonl, init_progress/...)
                check_removable(res.out, (MODEL_DIR,), "--resume" if resume else "the run")  # (finish replaces model/)
            # the time plan of a run that writes a folder (one in memory writes nothing, not even a speed probe's
            # cache): a fresh run's before its work, a resumed one's once its checkpoint is read (a bad checkpoint
            # is then the one line a resume prints)
            if not resume and res.out is not None:
                with res.phases("load"):  # (a probe of the forward's speed, when none is cached, is loading too)
                    loop.plan, loop.plan_steps = plan_with_steps(res)
            state = self.start_state(resume)
            if res.out is not None and "init metric" not in res.phases.seconds:  # (resumed: this session's plan)
                loop.plan, loop.plan_steps = plan_with_steps(res, done_steps=state.step)
            self.start_masks = res.masks.init_masks(state)  # (what a UI shows as the init mask, with state.init_scores)
            self.init_scores = state.init_scores
            stopped = self._loop(state, observer, stop)
            if stopped:
                res.log(f"stopped at step {state.step}/{res.ctx.steps}; state saved, resume with --resume")
                return {"status": "stopped", "step": state.step}
            return finish(res, state)

    def _loop(self, state: RunState, observer: Observer | None, stop: threading.Event | None) -> bool:
        """The steps, each written to metrics.jsonl; a checkpoint every --checkpoint-every steps or
        --checkpoint-minutes, and of the last finished step on an interrupt. True when `stop` ended it."""
        res, bar = self.res, None
        c, ctx, method, out = res.config, res.ctx, res.method, res.out
        if res.loop.progress and method.optimises:
            from tqdm.auto import tqdm

            bar = tqdm(total=ctx.steps, initial=state.step, desc="pruning", unit="step")
        good, saved_at = self.checkpoints.snapshot(state), time.monotonic()  # the last finished step
        self.call_hooks("on_start", state)
        try:
            # (the loop: checkpoints too; unbuffered: a full disk fails once, in append_line)
            with open(out / METRICS_FILE if out else os.devnull, "ab", buffering=0, opener=_no_follow) as metrics, \
                    res.phases("steps"), (contextlib.closing(bar) if bar else contextlib.nullcontext()):
                while method.optimises and state.step < ctx.steps:  # (--time-budget re-plans ctx.steps)
                    if stop is not None and stop.is_set():
                        return True
                    report = self.step(state)
                    # stop at the first NaN/inf, before it reaches metrics.jsonl or a checkpoint
                    check_finite(f"step {state.step}", state.scores, {f"loss of mask sample {j + 1}": x
                                                                      for j, x in enumerate(report.losses)})
                    self.call_hooks("on_step", state, report)
                    report.total_steps = ctx.steps  # (a hook may have changed it: --time-budget, --early-stop)
                    line = report.to_json()
                    good = self.checkpoints.snapshot(state, line)  # from here an interrupt saves this step
                    append_line(metrics, line, out, METRICS_FILE)  # (a full disk: one line)
                    if bar is not None:
                        bar.total = ctx.steps
                        bar.update(1)
                        bar.set_postfix(loss=f"{sum(report.losses) / len(report.losses):.3f}", baseline=f"{report.baseline:.3f}")
                    if observer is not None:
                        observer(report)
                    if state.step % c.checkpoint_every == 0 or (
                            c.checkpoint_minutes and time.monotonic() - saved_at >= 60 * c.checkpoint_minutes):
                        if out is not None:  # a checkpoint is never ahead of the metric lines on disk
                            os.fsync(metrics.fileno())
                        self.checkpoints.write(good)
                        saved_at = time.monotonic()
            return False
        except KeyboardInterrupt:  # (another error leaves the last checkpoint as it is, as a crash would)
            res.log(f"interrupted: the checkpoint holds step {good.step}/{ctx.steps}; continue with --resume")
            raise
        finally:
            if not isinstance(e := sys.exc_info()[1], Exception) or getattr(e, "checkpoint_safe", False):  # (a lost rank)
                self.checkpoints.write(good)
