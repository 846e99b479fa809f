"""The policy-gradient pruning run: init, the forward-only optimisation loop, checkpoints, artifacts.

    run = PruneRun(config, out_dir)          # loads model and data
    result = run.run(observer=print)         # optimises, evaluates, exports; resumable

Everything a run makes goes into its folder: the marker file pg-prune-run, config.json, metrics.jsonl,
checkpoint.pt, masks.safetensors + masks.json, model/ (the sliced export) and results.json. --overwrite
and --resume act only on a folder that carries the marker (or, from before the marker, that holds a run's
own files); --overwrite removes only those files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import resource
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import torch

from .adapter import ModelAdapter
from .config import PruneConfig
from .data import CalibrationSampler, eval_windows, load_calibration_texts, load_eval_text, split_holdout
from .errors import UserError
from .evaluate import batch_loss, perplexity, token_loss
from . import importance
from .io import atomic_file, atomic_write_text, dumps_json
from .loading import count_parameters, load_model, resolve_model
from .executors import EXECUTORS, resolve_executor
from .masking import MaskHooks
from .policy import (cosine_lr, fit_control_coefficients, leave_one_out_baselines, metric_feature, policy_gradient,
                     progressive_stages, relaxed_bernoulli, sample_masks, stage_at, update_baseline)
from .units import UnitLayout

CONFIG_FILE, METRICS_FILE, CHECKPOINT_FILE, RESULTS_FILE = "config.json", "metrics.jsonl", "checkpoint.pt", "results.json"
MODEL_DIR = "model"
# A run folder's own marker: its name and content say what the folder is, so that --overwrite can never
# mistake a model folder (which also holds a config.json) for a run.
RUN_MARKER, RUN_FORMAT_VERSION = "pg-prune-run", 1
_MARKER_TEXT = "pg-prune run, format version {}\n"
_MARKER_RE = re.compile(r"pg-prune run, format version (\d+)")
# Everything a run writes into its folder (--overwrite removes these and nothing else).
RUN_FILES = (CONFIG_FILE, METRICS_FILE, CHECKPOINT_FILE, RESULTS_FILE, "masks.safetensors", "masks.json")


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
    init_metric: dict[str, torch.Tensor] | None = None  # the standardized init metric (method metric ranks it)
    input_means: dict[str, list[torch.Tensor]] | None = None  # bias compensation: mean input of each output column
    control_moments: dict[str, torch.Tensor] | None = None  # control variate: running E[f f^T], E[f a]


Observer = Callable[[StepReport], None]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def write_run_marker(out: Path) -> None:
    atomic_write_text(out / RUN_MARKER, _MARKER_TEXT.format(RUN_FORMAT_VERSION))


def run_marker_version(out: Path) -> int | None:
    """The format version the folder's marker names, or None without a (readable, well-formed) marker."""
    try:
        m = _MARKER_RE.fullmatch((out / RUN_MARKER).read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError):
        return None
    return int(m.group(1)) if m else None


def _is_legacy_run(out: Path) -> bool:
    """A run from before the marker: a config.json that parses as a run config, and the run's own
    metrics.jsonl and checkpoint.pt beside it. A model folder's config.json never parses as one."""
    if not ((out / METRICS_FILE).is_file() and (out / CHECKPOINT_FILE).is_file()):
        return False
    try:
        PruneConfig.load(out / CONFIG_FILE)
    except UserError:
        return False
    return True


def is_run_dir(out: Path, adopt: bool = True) -> bool:
    """Does `out` hold a run? Marked folders do; a pre-marker run is recognised by its content and,
    with adopt, gets the marker. Nothing else counts."""
    out = Path(out)
    if not out.is_dir():
        return False
    if run_marker_version(out) is not None:
        return True
    if _is_legacy_run(out):
        if adopt:
            try:
                write_run_marker(out)
            except OSError:
                pass  # a read-only old run is still a run
        return True
    return False


def remove_leftovers(out: Path) -> None:
    """Remove what interrupted atomic writes of a run left behind (.config.json.x.tmp, .model.x.tmp, .model.old):
    a process killed with SIGKILL cannot clean up after itself."""
    for p in out.iterdir():
        name = p.name
        if name.startswith(".") and any(name.startswith(f".{n}.") for n in (*RUN_FILES, MODEL_DIR, RUN_MARKER)) \
                and (name.endswith(".tmp") or name == f".{MODEL_DIR}.old"):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


def remove_run_files(out: Path) -> None:
    """Remove what a run wrote (RUN_FILES, model/, leftovers of interrupted atomic writes, the marker);
    anything else in the folder stays."""
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    shutil.rmtree(out / MODEL_DIR, ignore_errors=True)
    remove_leftovers(out)
    (out / RUN_MARKER).unlink(missing_ok=True)


def trim_metrics(path: Path, step: int) -> list[dict]:
    """Keep the metric lines of steps 1..step (the checkpoint's), each once; drop later steps (a resumed run
    redoes them) and a line cut short by a crash. Returns the kept records."""
    path = Path(path)
    if not path.exists():
        return []
    kept: dict[int, str] = {}
    for ln in path.read_text().splitlines():
        try:
            record = json.loads(ln)
            n = record["step"]
        except (ValueError, KeyError, TypeError):
            continue  # blank, or cut short by a crash mid-write
        if isinstance(n, int) and 1 <= n <= step and n not in kept:
            kept[n] = ln
    lines = [kept[n] for n in sorted(kept)]
    atomic_write_text(path, "".join(ln + "\n" for ln in lines))
    return [json.loads(ln) for ln in lines]


def check_out_dir(out: Path, resume: bool, overwrite: bool, clear: bool = True) -> None:
    """Refuse to mix two runs in one folder, and refuse --resume/--overwrite on any folder that is not a
    run (see is_run_dir). With overwrite, remove the old run's files (unless clear=False: check only, so
    that a caller can validate everything else before deleting anything)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} exists and is not a folder")
    if not out.exists() or not any(out.iterdir()):
        if resume:
            raise UserError(f"--resume: {out} holds no run (no {CONFIG_FILE}, no {RUN_MARKER} marker)")
        return
    holds_run = is_run_dir(out)
    if holds_run:
        version = run_marker_version(out)
        if version is not None and version > RUN_FORMAT_VERSION:
            raise UserError(f"{out} holds a run of format version {version}, newer than this program's "
                            f"{RUN_FORMAT_VERSION}; update pg-prune or choose another --out")
    if resume:
        if not holds_run:
            raise UserError(f"--resume refused: {out} holds no run (no {RUN_MARKER} marker and no run's "
                            f"{CONFIG_FILE}, {METRICS_FILE} and {CHECKPOINT_FILE})")
        if clear:
            remove_leftovers(out)
        return
    if overwrite:
        if holds_run:
            if clear:
                remove_run_files(out)
            return
        raise UserError(f"--overwrite refused: {out} is not empty and holds no run (no {RUN_MARKER} marker); "
                        "nothing was touched; choose another folder")
    raise UserError(f"{out} already holds files{' of another run' if holds_run else ''}; use --resume, --overwrite or another --out")


def prepare_out_dir(out: Path) -> list[Path]:
    """Create `out` (and missing parents) and check that files can be written in it, before anything
    slow happens. Returns the folders it created, outermost first, for cleanup_out_dir."""
    out = Path(out)
    created = []
    for d in reversed([out, *out.parents]):
        if not d.exists():
            created.append(d)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"--out {out} exists and is not a folder") from None
    except OSError as e:
        raise UserError(f"cannot create --out {out}: {e.strerror or e}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=out, prefix=".pg-prune-write-test.")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        cleanup_out_dir(created)
        raise UserError(f"--out {out} is not writable: {e.strerror or e}") from None
    return created


def cleanup_out_dir(created: list[Path]) -> None:
    """Remove the folders prepare_out_dir created, innermost first, where they are still empty."""
    for d in reversed(created):
        try:
            d.rmdir()
        except OSError:
            break


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
        return {u: self.layout.hard_mask(u, s, c.scope, keep) for u, s in scores.items()}

    def layer_masks(self, flat: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        return {u: self.layout.split(u, m) for u, m in flat.items()}

    def masked_perplexity(self, flat_masks: dict[str, torch.Tensor] | None, what: str,
                          fill: dict[str, list[torch.Tensor]] | None = None) -> float:
        with MaskHooks(self.adapter) as hooks:
            if flat_masks is not None:
                hooks.set(self.layer_masks(flat_masks), fill)
            self.log(f"evaluating {what} perplexity on {self.windows.shape[0]} windows of {self.config.eval_seqlen} tokens")
            ppl = perplexity(self.model, self.windows, self.config.eval_batch_size, progress=self.progress)
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
        return {u: ("random" if c.init == "random-progressive" else c.init) if u != "layers" else c.layer_init
                for u in self.layout.unit_types}

    def initial_metric(self, batches: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        """The standardized importance metric of every unit type (flat; higher = keep)."""
        c, a = self.config, self.adapter
        wanted = self.metric_names()
        raw: dict[str, list[torch.Tensor]] = {}
        for name in dict.fromkeys(wanted.values()):
            units = [u for u, m in wanted.items() if m == name]
            self.log(f"computing the {name} metric for {', '.join(units)}")
            if name == "wanda-sp":
                metric = importance.wanda_sp(a, batches)
            elif name == "magnitude-sp":
                metric = importance.magnitude_sp(a)
            elif name == "taylor":
                metric = importance.taylor(a, batches)
            elif name == "layerwise-ppl":
                metric = importance.layerwise_ppl(a, batches)
            elif name == "sleb":
                metric = importance.sleb(a, batches, c.keep_ratio)
            else:  # random: a seeded Gaussian metric, mapped like any other
                metric = importance.random_metric(self.layout, units, c.seed + 2)
            raw.update({u: metric[u] for u in units})
        return {u: importance.standardize(u, raw[u]) for u in self.layout.unit_types}

    def fresh_state(self) -> RunState:
        c = self.config
        self.log(f"initialising scores ({c.init if set(c.units) - {'layers'} else c.layer_init}, {c.prob_map})")
        data_metrics = {"wanda-sp", "taylor", "layerwise-ppl", "sleb"}
        needs_data = c.bias_compensation or bool(set(self.metric_names().values()) & data_metrics)
        batches = [self.sampler.next_batch() for _ in range(c.init_batches)] if needs_data else []
        z = self.initial_metric(batches)
        means = None
        if c.bias_compensation:
            self.log("measuring mean inputs of the output projections (bias compensation)")
            means = importance.input_means(self.adapter, batches)
            self.fill = self.compensation_fill(means)
        keep0 = self.keep_ratio_at(0)
        scores = {u: importance.initial_scores(z[u], self.layout, u, c.scope, keep0, c.prob_map, c.score_const)
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
        """One optimisation step: policy gradient (forward passes only) or, for method gumbel,
        one back-propagated step through relaxed masks. Then s <- proj_C(s - lr g)."""
        c, t0 = self.config, time.perf_counter()
        batch = self.sampler.next_batch()
        keep, lr = self.keep_ratio_at(state.step), self.lr_at(state.step)
        if c.method == "gumbel":
            losses, grads, baseline = self._gumbel_gradient(state, batch)
        else:
            losses, grads, baseline = self._policy_gradient(state, batch)
        for u, s in state.scores.items():
            state.scores[u] = self.layout.project(u, (s.double() - lr * grads[u]).float(), c.scope, keep)
        state.step += 1
        seconds = time.perf_counter() - t0
        state.seconds_in_steps += seconds
        hard = self.hard_masks(state.scores, keep)
        return StepReport(
            step=state.step, total_steps=c.steps, losses=[float(x) for x in losses], baseline=float(baseline), lr=lr,
            mean_score={u: self.layout.layer_means(u, s) for u, s in state.scores.items()},
            kept_fraction={u: self.layout.layer_means(u, m) for u, m in hard.items()},
            head_scores=[p.tolist() for p in self.layout.split("heads", state.scores["heads"])] if "heads" in state.scores else None,
            seconds=seconds,
            eta_seconds=(state.seconds_in_steps / state.step) * (c.steps - state.step),
            keep_ratio=keep,
        )

    def _policy_gradient(self, state: RunState, batch: torch.Tensor):
        c = self.config
        antithetic = c.mask_sampling == "antithetic"
        samples = {u: sample_masks(s, c.num_mask_samples, self.mask_rng, antithetic) for u, s in state.scores.items()}
        with MaskHooks(self.adapter) as hooks:
            losses = self.sample_losses(hooks, self.layout, batch, samples, self.fill)
        beta, features = None, None
        if c.control_variate == "init-metric":  # subtract the metric's linear loss model (fitted on past steps)
            features = torch.stack([metric_feature(state.init_metric[u].double(), s.double(), samples[u].double())
                                    for u, s in state.scores.items()], 1)  # (N_s, unit types)
            beta = self._control_coefficients(state)
            target = losses - features @ beta
        else:
            target = losses
        if c.baseline == "moving-average":
            state.baseline = update_baseline(state.baseline, float(target.mean()), c.baseline_window)
            baseline, shown = state.baseline, state.baseline
        elif c.baseline == "leave-one-out":
            baseline, shown = leave_one_out_baselines(target), float(target.mean())
        else:
            baseline, shown = 0.0, 0.0
        grads = {u: policy_gradient(s.double(), samples[u].double(), target, baseline, c.estimator, c.estimator_clamp)
                 for u, s in state.scores.items()}
        if beta is not None:
            for k, u in enumerate(state.scores):  # + beta dE[h]/ds, h(m) = -sum z m: keeps the estimate unbiased
                grads[u] = grads[u] - beta[k] * state.init_metric[u].double()
            self._update_control_moments(state, features, losses)
        return losses, grads, shown

    def _control_coefficients(self, state: RunState) -> torch.Tensor:
        k = len(state.scores)
        m = state.control_moments
        if m is None or m["count"] < 2:
            return torch.zeros(k, dtype=torch.float64)
        return fit_control_coefficients(m["ff"], m["fa"])

    def _update_control_moments(self, state: RunState, features: torch.Tensor, losses: torch.Tensor,
                                decay: float = 0.95) -> None:
        """Running second moments of (feature, loss centred in its batch), for the next step's beta."""
        a = losses - losses.mean()
        ff = features.T @ features / features.shape[0]
        fa = features.T @ a / features.shape[0]
        m = state.control_moments
        if m is None:
            state.control_moments = {"ff": ff, "fa": fa, "count": 1}
        else:
            state.control_moments = {"ff": decay * m["ff"] + (1 - decay) * ff, "fa": decay * m["fa"] + (1 - decay) * fa,
                                     "count": m["count"] + 1}

    def _gumbel_gradient(self, state: RunState, batch: torch.Tensor):
        """d loss / d s through Gumbel-softmax relaxed masks, back-propagated through the model
        (N_s relaxed samples, averaged); the temperature anneals geometrically over the run."""
        c = self.config
        tau = c.gumbel_temperature * (c.gumbel_final_temperature / c.gumbel_temperature) ** (state.step / max(c.steps - 1, 1))
        leaves = {u: s.detach().float().clone().requires_grad_(True) for u, s in state.scores.items()}
        losses = torch.empty(c.num_mask_samples, dtype=torch.float64)
        with MaskHooks(self.adapter) as hooks, torch.enable_grad():
            for j in range(c.num_mask_samples):
                relaxed = {u: relaxed_bernoulli(s, tau, self.mask_rng, c.gumbel_straight_through, c.estimator_clamp)
                           for u, s in leaves.items()}
                hooks.set(self.layer_masks(relaxed), self.fill)
                loss = token_loss(self.model, batch).mean()
                (loss / c.num_mask_samples).backward()
                losses[j] = float(loss.detach())
        return losses, {u: leaves[u].grad.double().cpu() for u in leaves}, 0.0

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
            self.save_checkpoint(state)
            (self.out / METRICS_FILE).write_text("")

        bar = None
        if progress and c.method != "metric":
            from tqdm.auto import tqdm

            bar = tqdm(total=c.steps, initial=state.step, desc="pruning", unit="step")
        stopped = False
        with open(self.out / METRICS_FILE, "a") as metrics, _closing(bar):  # an error line starts on a line of its own
            while c.method != "metric" and state.step < c.steps:
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
        if c.method == "metric":
            scores = state.init_metric  # the metric's own ranking: no optimisation
        else:
            scores = state.best_scores if c.final_mask == "best-val" else state.scores
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
            "layer_init": c.layer_init if "layers" in c.units else None,
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
            "lr": c.lr,
            "seconds_per_step": state.seconds_in_steps / max(state.step, 1),
            "seconds_in_steps": state.seconds_in_steps,
            "peak_rss_mb": peak_rss_mb(),
        }
        atomic_write_text(self.out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
        return results
