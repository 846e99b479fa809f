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
import errno
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from ..model.arch import ModelAdapter
from ..algo.budget import BUDGETS
from ..data.calib_sources import (CALIB_SOURCES, PHASE as CALIB_PHASE, check_cache_dir as check_self_calib_cache,
                                  check_generation, source_of)
from .checkpoints import Checkpoints
from ..settings.config import PruneConfig
from ..algo.context import StepContext
from ..model.distributed import World, weights_digest
from ..data.text import CalibrationSampler, eval_windows, load_calibration_texts, load_eval_text, split_holdout
from ..errors import UserError
from ..model.executors import EXECUTORS, resolve_executor
from ..hooks import KEEP, RUN_HOOKS, RunChanges, RunView, joined_transforms
from .initialise import fresh_state, metric_cache_folder, start_state
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
from ..storage.io import append_line
from .folder import METRICS_FILE, MODEL_DIR, check_no_links, check_removable
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
    from {"calib_data", "eval_data"}). With validation on, every 10th calibration document is held out from the
    steps; the init metric (and the joint mix) read every document with --init-data all, as a one-shot run of the
    seed does, so that the run starts from that run's mask; the init sampler is the calibration sampler otherwise.
    check (torchrun: World.check_data) sees the texts as read, before any forward (--calib-source self generates).
    Last, the seconds the calibration source took (a generating one's: the run's "calibration text" phase)."""
    texts, calib_source = load_calibration_texts(config.calib) if calib is None else (calib, "in memory")
    text, eval_source = load_eval_text(config.eval_data)
    if check is not None:
        check({"model weights": (lambda: weights_digest(model), config.model),  # (torchrun: other weights, same size)
               "calibration data": (texts, calib_source), "evaluation data": (text, eval_source)})
    began = time.monotonic()  # (the source's seconds: its own phase, "calibration text", where it generates)
    say = lambda left: say_text_plan(model, config, left, fingerprint is not None, log)  # noqa: E731
    texts, scored_on = CALIB_SOURCES[source_of(config)](texts, model, tokenizer, config, fingerprint, log=log,
                                                        before_sampling=say)
    source_seconds = time.monotonic() - began
    ids = tokenize_documents(tokenizer, texts)  # (once: the samplers below share documents; bounded memory)
    val_batches, init_sampler = [], None
    if config.validates:
        kept, held_out = split_holdout(ids)
        if not held_out:
            CalibrationSampler(tokenizer, None, config.seqlen, config.batch_size, config.seed, ids)  # (its error first)
            raise UserError("held-out validation (--val-every, on by default for --final-mask best-val) needs at least "
                            "10 calibration documents (every 10th is held out); give more, or --val-every 0 "
                            "--final-mask last")
        sampler = CalibrationSampler(tokenizer, None, config.seqlen, config.batch_size, config.seed + 3, held_out)
        val_batches = [sampler.next_batch() for _ in range(config.val_batches)]
        if config.init_data == "all":
            init_sampler = CalibrationSampler(tokenizer, None, config.seqlen, config.batch_size, config.seed, ids)
        ids = kept
    sampler = CalibrationSampler(tokenizer, None, config.seqlen, config.batch_size, config.seed, ids)
    windows = eval_windows(tokenizer, text, config.eval_seqlen, config.max_windows)
    return sampler, init_sampler or sampler, val_batches, windows, {"calib_data": calib_source, "eval_data": eval_source,
                                                                 "calib_source": scored_on}, source_seconds


class PruneRun:
    """One pruning run bound to its output folder. Model and data are loaded once, here."""

    def __init__(self, config: PruneConfig, out_dir: str | Path, model=None, tokenizer=None, log: Callable[[str], None] = print,
                 started: float | None = None, world: World = World(), calib: list[str] | None = None,
                 from_files: bool = False):
        # started: time.monotonic() the --time-budget counts from; calib: calibration documents in memory (or --calib's);
        # from_files: the model given is config.model's files as engine.model.loading read them, unchanged (the app's
        # kept model), so that what is cached per model (dense perplexity, generated text) applies to it
        self.started = time.monotonic() if started is None else started
        self.config = c = config.resolved()  # (the caller's config is left as it was)
        self.out = Path(out_dir) if out_dir is not None else None  # None: a run in memory (engine.api), no files
        self.log, self.progress, self.world = log, True, world  # tqdm bars; this torchrun rank
        self.source = resolve_model(c.model)
        if problem := step_dtype_problem(c, run_device_type(c, model)):
            raise UserError(problem)  # (before the model loads: the CPU decides it)
        self.from_disk = model is None or from_files  # (only a model read from its files is cached)
        if model is None:
            model, tokenizer = load_model(self.source, c.dtype, c.device)
        self.model, self.tokenizer, self.adapter = model, tokenizer, ModelAdapter.for_model(model)
        if slow := emulated_bf16_line(c, model_device(model).type):
            log(slow)
        self.step_dtype = run_step_dtype(c, model)  # (the steps' forwards: step())
        if c.step_dtype == "auto" and self.step_dtype != "bfloat16" and model_device(model).type == "cpu":
            log(f"steps in {self.step_dtype}: --step-dtype auto and this CPU has no native bfloat16")
        check_positions(model.config, {"seqlen": c.seqlen, "eval seqlen": c.eval_seqlen})
        check_run_fits(c, model)  # (before the data: a batch whose logits cannot fit is refused in one line)
        metric_cache_folder()  # (a $PG_PRUNE_METRIC_CACHE that is a file: refused now, not after the model's work)
        ppl_cache.check_cache_dir()  # (and a $PG_PRUNE_CACHE that is one)
        ppl_cache.check_folder(STATS_CACHE_ENV, stats_cache_dir(), f" (or set {STATS_CACHE_ENV}=off)")  # (and its statistics')
        if CALIB_SOURCES[source_of(c)].generates:  # (and the self-generated text's cache)
            check_self_calib_cache()
            check_generation(c, model.config)  # (documents beyond the positions, or no longer than --seqlen)
        sizes = unit_sizes(self.adapter)
        self.layout = UnitLayout({u: sizes[u] for u in c.units})
        self.budget = BUDGETS[c.budget](self.layout, c.scope, self.adapter)
        self.budget.fixed_layers = c.fixed_layers
        self.sampler, self.init_sampler, self.val_batches, self.windows, self.sources, source_seconds = _run_data(
            tokenizer, c, model, self.fingerprint(), log, calib, check=self.world.check_data)
        self.world.check_data({  # (torchrun: every rank read the same token ids, before the steps' first forward)
            "calibration data": ([self.sampler.docs, self.init_sampler.docs, self.val_batches], self.sources["calib_data"]),
            "evaluation data": (self.windows, self.sources["eval_data"])})
        self.mask_rng = torch.Generator().manual_seed(c.seed + 1)
        own = EXECUTORS[resolve_executor(c.sample_forward, c.device)]
        self.sample_losses = self.world.share_executor(own)
        self.ctx = StepContext(model, self.adapter, self.layout, self.sample_losses, self.mask_rng, c.num_mask_samples, c.steps,
                               reward=REWARDS[c.reward]())
        self.method = METHODS[c.method](self.ctx, method_options(c.method, c.method_options, c))
        self.stages, self.unit_metric, self.stats_memo = [(0, c.prune_ratio)], c.init, None  # (stages: progressive)
        self.hooks = [h(RunView(self)) for h in RUN_HOOKS if h.applies(c)]  # (a hook reads its run, never assigns)
        self.call_hooks("on_setup")
        self.checkpoints, self.phases = Checkpoints(self), PhaseClock(self.started)
        if CALIB_SOURCES[source_of(c)].generates:  # (its text read from the cache, or sampled: not "load")
            self.phases.carve(CALIB_PHASE, source_seconds)
        self.masks = RunMasks(self, joined_transforms(self.hooks))
        self.keep_ratio_at, self.lr_at = self.masks.keep_ratio_at, self.masks.lr_at
        self.hard_masks = self.ctx.hard_masks = self.masks.hard_masks  # (a method may cut its scores, as --unit-block)
        if c.step_refit and c.reconstruct:  # (the samples scored as they would be exported: each under its own refit, a rank its share)
            self.ctx.weights, self.ctx.own_executor, self.ctx.spread = self.masks.weights, own, self.world.spread
        self.final_masks, self.layer_masks = self.masks.final_masks, self.masks.layer_masks
        self.masked_perplexity = self.masks.masked_perplexity
        self.write_checkpoint, self.restore_metrics = self.checkpoints.write, self.checkpoints.restore_metrics
        self.plan = None  # results.json's plan_seconds_by_phase: made by run() (engine/run/plan.py)
        self.plan_steps = None  # (under --time-budget: the steps the plan fits, for the hook's minimum)

    def fingerprint(self) -> str | None:
        """The model's files (name, size, content digest: ppl_cache.files_key) as one string, the key of the text its
        calibration source generates; None for a model given in memory, or a source that generates none (its files
        are not hashed for nothing)."""
        generates = CALIB_SOURCES[source_of(self.config)].generates
        return ppl_cache.files_key(self.source, self.config.dtype) if self.from_disk and generates else None

    fill = property(lambda self: self.ctx.fill, doc="Bias compensation's means, once measured (None without it)")

    def load_checkpoint(self) -> RunState:
        """The checkpoint's state, checked against this run (Checkpoints.load reads and checks, nothing more), then
        every joined hook told of it (on_resume: the compensation's means back in the forwards, ...)."""
        state = self.checkpoints.load()
        self.call_hooks("on_resume", state)
        return state

    def call_hooks(self, event: str, *args) -> None:
        """Every joined hook's `event` (engine/hooks/base.py), in RUN_HOOKS' order, each one's changes applied
        before the next is called."""
        for hook in self.hooks:
            self.apply_changes(getattr(hook, event)(*args))

    def apply_changes(self, changes: RunChanges | None) -> None:
        """The one place where a hook's event changes the run: what it returned (None: nothing)."""
        if changes is None:
            return
        if changes.steps is not KEEP:
            self.ctx.steps = changes.steps
        if changes.fill is not KEEP:
            self.ctx.fill = changes.fill
        if changes.stages is not KEEP:
            self.stages = changes.stages
        if changes.unit_metric is not KEEP:
            self.unit_metric = changes.unit_metric

    def fresh_state(self) -> RunState:
        return fresh_state(self)

    # --- the loop --------------------------------------------------------------------------
    def step(self, state: RunState) -> StepReport:
        """One optimisation step: the method's gradient estimate on one calibration batch, then
        s <- proj_C(s - lr g) for every unit type."""
        t0, batch = time.perf_counter(), self.sampler.next_batch()
        keep, lr = self.keep_ratio_at(state.step), self.lr_at(state.step)
        with step_precision(self.step_dtype, model_device(self.model).type):  # (--step-dtype; the head in float32)
            g = self.method.gradient(state, batch)
        proposed = self.method.next_scores(state, g.grads, lr)
        state.scores = self.budget.project(proposed, keep) if self.method.projects else proposed  # (Method.projects)
        state.step += 1
        seconds = time.perf_counter() - t0
        state.seconds_in_steps += seconds
        hard = self.hard_masks(state.scores, keep)
        detailed = [u for u in state.scores if UNIT_TYPES[u].report_scores]  # the heatmap's data
        return StepReport(
            step=state.step, total_steps=self.ctx.steps, losses=[float(x) for x in g.losses], baseline=float(g.baseline), lr=lr,
            mean_score={u: self.layout.layer_means(u, s) for u, s in state.scores.items()},
            kept_fraction={u: self.layout.layer_means(u, m) for u, m in hard.items()},
            head_scores=[p.tolist() for p in self.layout.split(detailed[0], state.scores[detailed[0]])] if detailed else None,
            seconds=seconds, eta_seconds=(state.seconds_in_steps / state.step) * max(self.ctx.steps - state.step, 0), keep_ratio=keep,
            masks=mask_rows(self.layout, hard))

    def run(self, resume: bool = False, observer: Observer | None = None, stop: threading.Event | None = None,
            progress: bool = True) -> dict:
        """Optimise to config.steps (or until `stop` is set), then evaluate and export, holding the run folder's
        lock throughout (a second writer is refused). Returns results.json's content, or {"status": "stopped"}
        (state saved, resumable). An interrupt (Ctrl-C; SIGTERM in the CLI) checkpoints the last finished step."""
        self.progress = progress
        with _held(self.out):
            if self.out is not None:  # (the CLI and the app check this first; the API's PruneRun here)
                check_no_links(self.out)  # no write of the run goes through a link (metrics.jsonl, init_progress/...)
                check_removable(self.out, (MODEL_DIR,), "--resume" if resume else "the run")  # (finish replaces model/)
            # the time plan of a run that writes a folder (one in memory writes nothing, not even a speed probe's
            # cache): a fresh run's before its work, a resumed one's once its checkpoint is read (a bad checkpoint
            # is then the one line a resume prints)
            if not resume and self.out is not None:
                with self.phases("load"):  # (a probe of the forward's speed, when none is cached, is loading too)
                    self.plan, self.plan_steps = plan_with_steps(self)
            state = start_state(self, resume)
            if self.out is not None and "init metric" not in self.phases.seconds:  # (resumed: this session's plan)
                self.plan, self.plan_steps = plan_with_steps(self, done_steps=state.step)
            self.start_masks = self.masks.init_masks(state)  # (what a UI shows as the init mask, with state.init_scores)
            self.init_scores = state.init_scores
            stopped = self._loop(state, observer, stop)
            if stopped:
                self.log(f"stopped at step {state.step}/{self.ctx.steps}; state saved, resume with --resume")
                return {"status": "stopped", "step": state.step}
            return self.finish(state)

    def _loop(self, state: RunState, observer: Observer | None, stop: threading.Event | None) -> bool:
        """The steps, each written to metrics.jsonl; a checkpoint every --checkpoint-every steps or
        --checkpoint-minutes, and of the last finished step on an interrupt. True when `stop` ended it."""
        c, bar = self.config, None
        if self.progress and self.method.optimises:
            from tqdm.auto import tqdm

            bar = tqdm(total=self.ctx.steps, initial=state.step, desc="pruning", unit="step")
        good, saved_at = self.checkpoints.snapshot(state), time.monotonic()  # the last finished step
        self.call_hooks("on_start", state)
        try:
            # (the loop: checkpoints too; unbuffered: a full disk fails once, in append_line)
            with open(self.out / METRICS_FILE if self.out else os.devnull, "ab", buffering=0, opener=_no_follow) as metrics, \
                    self.phases("steps"), (contextlib.closing(bar) if bar else contextlib.nullcontext()):
                while self.method.optimises and state.step < self.ctx.steps:  # (--time-budget re-plans ctx.steps)
                    if stop is not None and stop.is_set():
                        return True
                    report = self.step(state)
                    # stop at the first NaN/inf, before it reaches metrics.jsonl or a checkpoint
                    check_finite(f"step {state.step}", state.scores, {f"loss of mask sample {j + 1}": x
                                                                      for j, x in enumerate(report.losses)})
                    self.call_hooks("on_step", state, report)
                    report.total_steps = self.ctx.steps  # (a hook may have changed it: --time-budget, --early-stop)
                    line = report.to_json()
                    good = self.checkpoints.snapshot(state, line)  # from here an interrupt saves this step
                    append_line(metrics, line, self.out, METRICS_FILE)  # (a full disk: one line)
                    if bar is not None:
                        bar.total = self.ctx.steps
                        bar.update(1)
                        bar.set_postfix(loss=f"{sum(report.losses) / len(report.losses):.3f}", baseline=f"{report.baseline:.3f}")
                    if observer is not None:
                        observer(report)
                    if state.step % c.checkpoint_every == 0 or (
                            c.checkpoint_minutes and time.monotonic() - saved_at >= 60 * c.checkpoint_minutes):
                        if self.out is not None:  # a checkpoint is never ahead of the metric lines on disk
                            os.fsync(metrics.fileno())
                        self.write_checkpoint(good)
                        saved_at = time.monotonic()
            return False
        except KeyboardInterrupt:  # (another error leaves the last checkpoint as it is, as a crash would)
            self.log(f"interrupted: the checkpoint holds step {good.step}/{self.ctx.steps}; continue with --resume")
            raise
        finally:
            if not isinstance(e := sys.exc_info()[1], Exception) or getattr(e, "checkpoint_safe", False):  # (a lost rank)
                self.write_checkpoint(good)

    def finish(self, state: RunState) -> dict:
        return finish(self, state)
