"""The pruning run: init, the forward-only optimisation loop, checkpoints, results.

    run = PruneRun(config, out_dir)          # loads model and data
    result = run.run(observer=print)         # optimises, evaluates, exports; resumable

What a method computes lives in engine/methods, what an init metric computes in engine/metrics, and
the run folder's rules in engine/rundir; this file strings them together. The loop is `run`, one
step is `step`.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .arch import ModelAdapter
from .config import PruneConfig
from .data import CalibrationSampler, eval_windows, load_calibration_texts, load_eval_text, split_holdout
from .errors import UserError
from .evaluate import batch_loss, perplexity
from .executors import EXECUTORS, resolve_executor
from .io import atomic_file, atomic_write_text, dumps_json
from .loading import count_parameters, load_model, resolve_model
from .masking import MaskHooks
from .methods import METHODS, method_options
from .metrics import METRICS, MetricContext
from .metrics.activations import input_means
from .metrics.probability import initial_scores, standardize
from .policy import cosine_lr, progressive_stages, stage_at
from .rundir import CHECKPOINT_FILE, CONFIG_FILE, METRICS_FILE, MODEL_DIR, RESULTS_FILE, trim_metrics, write_run_marker
from .unit_types import UNIT_TYPES
from .units import UnitLayout


@dataclass
class StepReport:
    """What one optimisation step did; sent to observers and written to metrics.jsonl."""

    step: int  # 1-based count of steps done
    total_steps: int
    losses: list[float]  # L_j of each mask sample
    baseline: float  # delta after this step's update (0 when the baseline is off)
    lr: float
    mean_score: dict[str, list[float]]  # unit type -> mean s per layer
    kept_fraction: dict[str, list[float]]  # unit type -> fraction kept per layer by the current hard mask
    head_scores: list[list[float]] | None  # s of every KV group, per layer (small; for heatmaps)
    seconds: float  # wall time of this step
    eta_seconds: float
    val_ppl: float | None = None  # held-out perplexity of the current hard mask, on validation steps
    keep_ratio: float | None = None  # the budget this step (rises in stages under random-progressive)

    def to_json(self) -> str:
        return dumps_json(asdict(self), what=f"step {self.step}")


@dataclass
class RunState:
    step: int
    scores: dict[str, torch.Tensor]
    baseline: float | None
    sampler_state: dict
    mask_rng_state: torch.Tensor
    ppl_dense: float
    ppl_init: float
    init_scores: dict[str, torch.Tensor]
    seconds_in_steps: float = 0.0
    best_val_ppl: float | None = None  # best held-out perplexity so far, its step and scores
    best_step: int | None = None
    best_scores: dict[str, torch.Tensor] | None = None
    val_ppl_init: float | None = None  # held-out perplexity of the init mask (step 0, a candidate of best-val)
    init_metric: dict[str, torch.Tensor] | None = None  # the standardized init metric (method metric ranks it)
    input_means: dict[str, list[torch.Tensor]] | None = None  # bias compensation: mean input of each output column
    method_state: dict = field(default_factory=dict)  # what a method carries from step to step (pg: control moments)


Observer = Callable[[StepReport], None]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


@contextlib.contextmanager
def _closing(bar):
    try:
        yield
    finally:
        if bar is not None:
            bar.close()


def _check_finite(where: str, scores: dict[str, torch.Tensor], values: dict[str, float]) -> None:
    """Raise UserError naming `where` and the first non-finite value or score."""
    for name, x in values.items():
        if not math.isfinite(x):
            raise UserError(f"{where}: the {name} is {x}; stopped (the checkpoint holds the last finite state; "
                            "a lower --lr or another --seqlen/--dtype may help)")
    for u, t in scores.items():
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            raise UserError(f"{where}: {int(bad.sum())} {u} scores are not finite (first at index "
                            f"{int(bad.nonzero()[0])}); stopped (a lower --lr may help)")


class PruneRun:
    """One pruning run bound to its output folder. Model and data are loaded once, here."""

    def __init__(self, config: PruneConfig, out_dir: str | Path, model=None, tokenizer=None, log: Callable[[str], None] = print):
        self.config = config.validate()
        self.out = Path(out_dir)
        self.log = log
        self.source = resolve_model(config.model)
        if model is None:
            model, tokenizer = load_model(self.source, config.dtype, config.device)
        self.model, self.tokenizer = model, tokenizer
        self.adapter = ModelAdapter.for_model(model)
        max_pos = getattr(model.config, "max_position_embeddings", None)
        for name in ("seqlen", "eval_seqlen"):
            if max_pos is not None and getattr(config, name) > max_pos:
                raise UserError(f"{name.replace('_', ' ')} {getattr(config, name)} is beyond the model's {max_pos} positions")
        sizes = self.adapter.unit_sizes()
        self.layout = UnitLayout({u: sizes[u] for u in config.units})
        self.stages = (progressive_stages(config.prune_ratio, config.steps, config.progressive_increment)
                       if config.init == "random-progressive" else [(0, config.prune_ratio)])
        texts, self.calib_source = load_calibration_texts(config.calib)
        self.val_batches: list[torch.Tensor] = []
        if config.val_every:
            texts, held_out = split_holdout(texts)
            if not held_out:
                raise UserError("validation needs at least 10 calibration documents (every 10th is held out)")
            val_sampler = CalibrationSampler(tokenizer, held_out, config.seqlen, config.batch_size, config.seed + 3)
            self.val_batches = [val_sampler.next_batch() for _ in range(config.val_batches)]
        self.sampler = CalibrationSampler(tokenizer, texts, config.seqlen, config.batch_size, config.seed)
        text, self.eval_source = load_eval_text(config.eval_data)
        self.windows = eval_windows(tokenizer, text, config.eval_seqlen, config.max_windows)
        self.mask_rng = torch.Generator().manual_seed(config.seed + 1)
        self.sample_losses = EXECUTORS[resolve_executor(config.sample_forward, config.device)]
        self.method = METHODS[config.method](self, method_options(config.method, config.method_options))
        self.fill: dict[str, list[torch.Tensor]] | None = None  # bias compensation means, once known
        self.progress = True  # tqdm bars on stderr; run(progress=False) turns them off

    # --- masks ---------------------------------------------------------------------------
    def keep_ratio_at(self, step: int) -> float:
        """The budget at 0-based `step`: the target, or the current stage's under random-progressive."""
        return 1.0 - stage_at(self.stages, step, self.config.steps)[0]

    def lr_at(self, step: int) -> float:
        """Cosine decay over the run, or over each stage under random-progressive; or constant."""
        c = self.config
        if c.lr_schedule == "constant":
            return c.lr
        _, into, length = stage_at(self.stages, step, c.steps)
        return cosine_lr(c.lr, into, length)

    def hard_masks(self, scores: dict[str, torch.Tensor], keep_ratio: float | None = None) -> dict[str, torch.Tensor]:
        c = self.config
        keep = c.keep_ratio if keep_ratio is None else keep_ratio
        return {u: self.layout.hard_mask(u, s, c.scope, keep, c.unit_multiple.get(u, 1)) for u, s in scores.items()}

    def layer_masks(self, flat: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        return {u: self.layout.split(u, m) for u, m in flat.items()}

    def masked_perplexity(self, flat_masks: dict[str, torch.Tensor] | None, what: str,
                          fill: dict[str, list[torch.Tensor]] | None = None) -> float:
        """WikiText perplexity of the model under one hard mask, computed by the run's executor (the sliced one
        computes only the kept units): exp of the mean over windows of each window's mean token loss."""
        self.log(f"evaluating {what} perplexity on {self.windows.shape[0]} windows of {self.config.eval_seqlen} tokens")
        with MaskHooks(self.adapter) as hooks:
            def masked_loss(model, batch):  # the executor gives the batch's mean; every row counts it once
                samples = {u: m[None] for u, m in flat_masks.items()}
                return self.sample_losses(hooks, self.layout, batch, samples, fill).expand(batch.shape[0])

            ppl = perplexity(self.model, self.windows, self.config.eval_batch_size, self.progress,
                             batch_loss if flat_masks is None else masked_loss)
        self.log(f"{what} perplexity: {ppl:.3f}")
        return ppl

    def validate(self, state: RunState) -> float:
        """Held-out perplexity of the current hard mask; remembers the best scores."""
        with MaskHooks(self.adapter) as hooks:
            hooks.set(self.layer_masks(self.hard_masks(state.scores)), self.fill)
            loss = torch.cat([batch_loss(self.model, b) for b in self.val_batches]).double().mean()
        ppl = float(torch.exp(loss))
        if state.best_val_ppl is None or ppl < state.best_val_ppl:
            state.best_val_ppl, state.best_step = ppl, state.step
            state.best_scores = {u: s.clone() for u, s in state.scores.items()}
        return ppl

    # --- init ------------------------------------------------------------------------------
    def metric_names(self) -> dict[str, str]:
        """unit type -> the init metric it is scored by (random-progressive starts from random scores)."""
        c = self.config
        unit_init = "random" if c.init == "random-progressive" else c.init
        return {u: c.layer_init if UNIT_TYPES[u].whole_layer else unit_init for u in self.layout.unit_types}

    def initial_metric(self, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The standardized importance metric of every unit type (flat; higher = keep)."""
        c = self.config
        wanted = self.metric_names()
        ctx = MetricContext(self.adapter, self.layout, batches, keep_ratio=c.keep_ratio, seed=c.seed + 2,
                            progress=self.progress, log=self.log)
        raw: dict[str, list[torch.Tensor]] = {}
        for name in dict.fromkeys(wanted.values()):
            units = [u for u, m in wanted.items() if m == name]
            self.log(f"computing the {name} metric for {', '.join(units)}")
            raw.update(METRICS[name].fn(ctx, units))
        return {u: standardize(u, raw[u]) for u in self.layout.unit_types}

    def fresh_state(self) -> RunState:
        c = self.config
        names = self.metric_names()
        self.log(f"initialising scores ({', '.join(dict.fromkeys(names.values()))}, {c.prob_map})")
        needs_data = c.bias_compensation or any(METRICS[m].needs_data for m in names.values())
        batches = [self.sampler.next_batch() for _ in range(c.init_batches)] if needs_data else []
        z = self.initial_metric(batches)
        means = None
        if c.bias_compensation:
            self.log("measuring mean inputs of the output projections (bias compensation)")
            means = input_means(self.adapter, batches)
            self.fill = self.compensation_fill(means)
        keep0 = self.keep_ratio_at(0)
        scores = {u: initial_scores(z[u], self.layout, u, c.scope, keep0, c.prob_map, c.score_const)
                  for u in self.layout.unit_types}
        ppl_dense = self.masked_perplexity(None, "dense")
        ppl_init = self.masked_perplexity(self.hard_masks(z), "init", self.fill)
        return RunState(
            step=0, scores=scores, baseline=None, sampler_state=self.sampler.state_dict(),
            mask_rng_state=self.mask_rng.get_state(), ppl_dense=ppl_dense, ppl_init=ppl_init,
            init_scores={u: s.clone() for u, s in scores.items()}, init_metric=z, input_means=means,
        )

    def compensation_fill(self, means: dict[str, list[torch.Tensor]] | None) -> dict[str, list[torch.Tensor]] | None:
        """The fill values of the unit types this run prunes (whole layers have none)."""
        if means is None:
            return None
        return {u: means[u] for u in self.layout.unit_types if u in means}

    # --- checkpoints -----------------------------------------------------------------------
    def save_checkpoint(self, state: RunState) -> None:
        state.sampler_state = self.sampler.state_dict()
        state.mask_rng_state = self.mask_rng.get_state()
        with atomic_file(self.out / CHECKPOINT_FILE) as tmp:
            torch.save(asdict(state), tmp)

    def load_checkpoint(self) -> RunState:
        path = self.out / CHECKPOINT_FILE
        try:
            data = torch.load(path, weights_only=False)
        except Exception as e:  # garbage, truncated or foreign: unpickling raises almost anything
            raise UserError(f"cannot read checkpoint {path} ({type(e).__name__}); it is damaged: "
                            "start again with --overwrite") from e
        try:
            control_moments = data.pop("control_moments", None)  # a checkpoint from before method_state
            if control_moments is not None:
                data.setdefault("method_state", {})["control_moments"] = control_moments
            state = RunState(**data)
            self.fill = self.compensation_fill(state.input_means)
            self.sampler.load_state_dict(state.sampler_state)
            self.mask_rng.set_state(state.mask_rng_state)
            if not isinstance(state.step, int) or not 0 <= state.step <= self.config.steps:
                raise ValueError(f"step {state.step!r}")
            if set(state.scores) != set(self.layout.unit_types) or any(
                    s.shape != (self.layout.total(u),) for u, s in state.scores.items()):
                raise ValueError("scores do not fit this model and these units")
        except Exception as e:
            raise UserError(f"checkpoint {path} does not belong to this run ({type(e).__name__}: {e}); "
                            "start again with --overwrite") from e
        return state

    def _trim_metrics(self, step: int) -> None:
        """After a resume, drop metric lines from steps past the checkpoint (they will be redone), and a
        last line cut short by a crash. Each step stays recorded once (the first record of it)."""
        trim_metrics(self.out / METRICS_FILE, step)

    # --- the loop --------------------------------------------------------------------------
    def step(self, state: RunState) -> StepReport:
        """One optimisation step: the method's gradient estimate on one calibration batch, then
        s <- proj_C(s - lr g) for every unit type."""
        c, t0 = self.config, time.perf_counter()
        batch = self.sampler.next_batch()
        keep, lr = self.keep_ratio_at(state.step), self.lr_at(state.step)
        g = self.method.gradient(state, batch)
        for u, s in state.scores.items():
            state.scores[u] = self.layout.project(u, (s.double() - lr * g.grads[u]).float(), c.scope, keep)
        state.step += 1
        seconds = time.perf_counter() - t0
        state.seconds_in_steps += seconds
        hard = self.hard_masks(state.scores, keep)
        detailed = [u for u in state.scores if UNIT_TYPES[u].report_scores]  # the heatmap's data
        return StepReport(
            step=state.step, total_steps=c.steps, losses=[float(x) for x in g.losses], baseline=float(g.baseline), lr=lr,
            mean_score={u: self.layout.layer_means(u, s) for u, s in state.scores.items()},
            kept_fraction={u: self.layout.layer_means(u, m) for u, m in hard.items()},
            head_scores=[p.tolist() for p in self.layout.split(detailed[0], state.scores[detailed[0]])] if detailed else None,
            seconds=seconds,
            eta_seconds=(state.seconds_in_steps / state.step) * (c.steps - state.step),
            keep_ratio=keep,
        )

    def run(self, resume: bool = False, observer: Observer | None = None, stop: threading.Event | None = None,
            progress: bool = True) -> dict:
        """Optimise to config.steps (or until `stop` is set), then evaluate and export.

        Returns results.json's content, with status "stopped" (state saved, resumable) or "done".
        """
        c = self.config
        self.progress = progress
        self.out.mkdir(parents=True, exist_ok=True)
        if resume and (self.out / CHECKPOINT_FILE).exists():
            state = self.load_checkpoint()
            self._trim_metrics(state.step)
            self.log(f"resuming {self.out} at step {state.step}/{c.steps}")
        else:
            write_run_marker(self.out)  # first: from now on the folder is recognisably a run
            c.save(self.out / CONFIG_FILE)
            state = self.fresh_state()
            _check_finite("the initial scores", state.scores, {"dense perplexity": state.ppl_dense,
                                                               "init perplexity": state.ppl_init})
            if c.val_every:  # the init mask is best-val's first candidate: a run never ends worse than it began
                state.val_ppl_init = self.validate(state)
                self.log(f"held-out perplexity of the init mask: {state.val_ppl_init:.3f}")
            self.save_checkpoint(state)
            (self.out / METRICS_FILE).write_text("")

        bar = None
        if progress and self.method.optimises:
            from tqdm.auto import tqdm

            bar = tqdm(total=c.steps, initial=state.step, desc="pruning", unit="step")
        stopped = False
        with open(self.out / METRICS_FILE, "a") as metrics, _closing(bar):  # an error line starts on a line of its own
            while self.method.optimises and state.step < c.steps:
                if stop is not None and stop.is_set():
                    stopped = True
                    break
                report = self.step(state)
                # stop at the first NaN/inf, before it reaches metrics.jsonl or a checkpoint
                _check_finite(f"step {state.step}", state.scores, {f"loss of mask sample {j + 1}": x
                                                                   for j, x in enumerate(report.losses)})
                if c.val_every and (state.step % c.val_every == 0 or state.step == c.steps):
                    report.val_ppl = self.validate(state)
                    _check_finite(f"step {state.step}", {}, {"held-out perplexity": report.val_ppl})
                metrics.write(report.to_json() + "\n")
                metrics.flush()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{sum(report.losses) / len(report.losses):.3f}", baseline=f"{report.baseline:.3f}")
                if observer is not None:
                    observer(report)
                if state.step % c.checkpoint_every == 0:
                    self.save_checkpoint(state)
        if bar is not None:
            bar.close()
        self.save_checkpoint(state)
        if stopped:
            self.log(f"stopped at step {state.step}/{c.steps}; state saved, resume with --resume")
            return {"status": "stopped", "step": state.step}
        return self.finish(state)

    # --- results ---------------------------------------------------------------------------
    def final_masks(self, scores: dict[str, torch.Tensor], metric: dict[str, torch.Tensor] | None,
                    within_layer_ranking: str | None = None) -> dict[str, torch.Tensor]:
        """The deterministic final masks: top keep ratio of the scores per pool; with within-layer
        ranking init-metric (the config's unless given), each layer keeps as many units as that,
        chosen by the init metric."""
        masks = self.hard_masks(scores)
        ranking = within_layer_ranking or self.config.within_layer_ranking
        if ranking == "init-metric" and metric is not None:
            masks = {u: self.layout.ranked_within_layers(u, m, metric[u]) for u, m in masks.items()}
        return masks

    def finish(self, state: RunState) -> dict:
        from .export import export_pruned, save_mask_artifact

        c = self.config
        scores = self.method.final_scores(state)
        masks = self.final_masks(scores, state.init_metric)
        save_mask_artifact(self.out, self.source.name, self.layout, scores, masks, state.init_scores)
        ppl_pruned = self.masked_perplexity(masks, "pruned", self.fill)
        self.log(f"exporting the sliced model to {self.out / MODEL_DIR}")
        export = export_pruned(self.model, self.tokenizer, self.layout, masks, self.out / MODEL_DIR, self.fill)
        results = {
            "status": "done",
            "model": self.source.name,
            "method": c.method,
            "init": c.init,
            "layer_init": c.layer_init if any(UNIT_TYPES[u].whole_layer for u in c.units) else None,
            "units": c.units,
            "scope": c.scope,
            "prune_ratio": c.prune_ratio,
            "seed": c.seed,
            "ppl_dense": state.ppl_dense,
            "ppl_init": state.ppl_init,
            "ppl_pruned": ppl_pruned,
            "eval_windows": int(self.windows.shape[0]),
            "seqlen": c.eval_seqlen,
            "eval_data": self.eval_source,
            "calib_data": self.calib_source,
            "params_dense": count_parameters(self.model),
            "params_pruned": export["params"],
            "kept_per_layer": {u: [int(m.sum()) for m in self.layout.split(u, mask)] for u, mask in masks.items()},
            "units_per_layer": self.layout.sizes,
            "steps": state.step,
            "final_mask": c.final_mask,
            "mask_step": state.best_step if c.final_mask == "best-val" else state.step,
            "best_val_ppl": state.best_val_ppl,
            "val_ppl_init": state.val_ppl_init,
            "lr": c.lr,
            "seconds_per_step": state.seconds_in_steps / max(state.step, 1),
            "seconds_in_steps": state.seconds_in_steps,
            "peak_rss_mb": peak_rss_mb(),
        }
        atomic_write_text(self.out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
        return results
