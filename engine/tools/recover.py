"""Recovery: a pruned run's export (the student) trained on calibration text, by the text's next-token cross-entropy
(the default: CE-LoRA) or by distillation from the run's dense base model (the teacher).

    python -m engine recover RUN --out OUT [--steps 32 | --time-budget MIN] [--mode lora|full] [--ce-weight W]

The loss of a batch is the mean over rows and positions 0..T-2 of KL(p_teacher || p_student), computed as the kl
reward computes it (engine.algo.rewards.row_kl), optionally mixed with the calibration text's next-token cross-entropy:
loss = (1 - W) KL + W CE (--ce-weight W, default 1: CE alone, what `finetune` trains; 0: KL alone). The teacher's
logits are computed on the fly, one forward per batch under no_grad: nothing of its full log-probabilities is kept.
With W = 1 the teacher is not loaded and its forward not run (the loss does not read it): about a quarter of a
step's time.

Why CE is the default (docs/results.md, "Recovery"): on the default run's exports at 30 %, CE-LoRA recovered more
per CPU minute than KL-LoRA, KL-full and the half-and-half mix on the three tuning seeds, and more than KL-full on
the three confirmation seeds, on every judge (WikiText-2 test and validation, held-out C4) at 2, 5 and 10 minutes.

Modes: lora (PEFT adapters on every attention and MLP projection the architecture adapter names, as `finetune`
puts them, merged into the weights at the end) or full (every weight of the decoder layers; the embeddings, the
final norm and the LM head stay frozen, so tied weights are left alone). AdamW, a constant learning rate after an
optional linear warm-up (the length of a time-budgeted recovery is not known in advance).

Data: segments of --seqlen tokens cut from the run's own calibration documents (its config.json's `calib`, or the
default C4 folder), less the documents its held-out check read; --calib overrides. A text an evaluation reads is
refused. Batch b of step s is a pure function of (seed, s) (seeded permutations of the segments, epoch after
epoch), so the sampler's state is the step itself: a stopped recovery resumed from its checkpoint ends
bit-identical to an uninterrupted one.

OUT holds recover_config.json (the RecoverConfig, resolved), recover_log.jsonl (one line per step: step, loss, kl,
ce, lr, seconds), recover_checkpoint.pt (every --checkpoint-every steps and at the end: trainable weights,
optimizer, RNG and sampler state), recover_results.json (WikiText-2 perplexity before and after with the run's
evaluation settings, the loss first and last, steps, seconds) and model/: the recovered model written as the
run's export is (`finetune`'s save), which from_pretrained(OUT/model, trust_remote_code=True) and engine.model.loading
load, and `python -m engine export OUT --format gguf` converts.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..settings.config import MAX_TIME_BUDGET, SEED_MAX
from ..errors import UserError
from ..settings.fields import setting
from ..storage.outdir import OutputKind
from ..model.precision import PASS_DTYPES
from ..run.files import RECOVER_CONFIG_FILE, RECOVER_MARKER

CONFIG_FILE, LOG_FILE, RESULTS_FILE = RECOVER_CONFIG_FILE, "recover_log.jsonl", "recover_results.json"
CHECKPOINT_FILE, MODEL_DIR = "recover_checkpoint.pt", "model"
RECOVER_OUTPUT = OutputKind("recover", RECOVER_MARKER, (CONFIG_FILE, LOG_FILE, RESULTS_FILE, CHECKPOINT_FILE),
                            (MODEL_DIR,))
# lora with CE (ce weight 1) is the default: the recovery study's winner at 30 % (docs/results.md, "Recovery"); the
# learning rates are the CPU-sized finetune's for LoRA and a tenth for all weights
MODES = ("lora", "full")
DEFAULT_MODE = "lora"
DEFAULT_LR = {"lora": 5e-4, "full": 5e-5}
DEFAULT_STEPS = 32  # without --steps or --time-budget (32 steps of 4 x 256 tokens: the CE-LoRA baseline's length)
# what --resume may change: how far the recovery goes (everything else is the saved recovery's)
RESUME_MAY_CHANGE = ("steps", "time_budget", "budget_clock", "skip_eval")
# what --time-budget counts: wall seconds (what a user waits), or this process's CPU seconds (equal work for every
# cell of a study on a shared machine: at one thread, the seconds an idle core would take)
BUDGET_CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


@dataclass
class RecoverConfig:
    run: str = setting("", flag=False, help="the prune run folder: its model/ is the student")
    mode: str = setting(DEFAULT_MODE, choices=MODES, help=(
        "lora: LoRA adapters on the attention and MLP projections, merged at the end; full: every weight of the "
        "decoder layers (embeddings, final norm and LM head frozen)"))
    steps: int | None = setting(None, minimum=1, help=(
        f"optimizer steps in all (a resumed recovery continues to N) (default: {DEFAULT_STEPS} when no "
        "--time-budget is given; with it, no limit but the time)"))
    time_budget: float | None = setting(None, minimum=0.0, maximum=MAX_TIME_BUDGET, exclusive=True, help=(
        "minutes of the training loop (this session's, a resumed one's too; wall minutes unless --budget-clock "
        "cpu): it stops when the next step, timed as the last one, would not fit (default: off)"))
    budget_clock: str = setting("wall", choices=tuple(BUDGET_CLOCKS), help=(
        "what --time-budget counts: wall (minutes you wait) or cpu (this process's CPU minutes: equal work for "
        "runs side by side on a shared machine, one thread each)"))
    ce_weight: float = setting(1.0, minimum=0.0, maximum=1.0, help=(
        "loss = (1 - W) KL(teacher || student) + W CE of the text (1, the default: CE only, what finetune trains, "
        "no teacher read; 0: KL from the dense model alone)"))
    lr: float | None = setting(None, minimum=0.0, exclusive=True, help=(
        f"AdamW learning rate (default: {DEFAULT_LR['lora']:g} for lora, {DEFAULT_LR['full']:g} for full)"))
    seqlen: int = setting(256, minimum=2, help="tokens per training segment")
    batch_size: int = setting(4, minimum=1, help="segments per step")
    warmup_steps: int = setting(0, minimum=0, help="linear warm-up steps, then a constant learning rate")
    weight_decay: float = setting(0.0, minimum=0.0, help="AdamW weight decay")
    lora_r: int = setting(16, minimum=1, help="LoRA rank (lora mode)")
    lora_alpha: float = setting(10.0, minimum=0.0, exclusive=True, help="LoRA alpha, lora mode (default 10)")
    lora_dropout: float = setting(0.05, minimum=0.0, help="LoRA dropout, below 1 (lora mode)")
    seed: int = setting(0, minimum=0, maximum=SEED_MAX, help="seeds the segments' order and the LoRA init")
    calib: str | None = setting(None, help=(
        "training text: C4-style JSON lines file or folder (default: the run's calibration documents, less the "
        "ones its held-out check read); never an evaluation text"))
    teacher: str | None = setting(None, help=(
        "the dense model a KL recovery (--ce-weight below 1) learns from (default: the run's base model, its "
        "config.json's model)"))
    eval_data: str | None = setting(None, help="WikiText-2 raw test for perplexity before and after (default: the run's)")
    eval_seqlen: int | None = setting(None, minimum=2, help="tokens per evaluation window (default: the run's)")
    max_windows: int | None = setting(None, minimum=0, help="perplexity on the first N windows (default: the run's; 0: all)")
    eval_batch_size: int = setting(8, minimum=1, help="windows per forward of the perplexity")
    skip_eval: bool = setting(False, help="no perplexity before and after")
    checkpoint_every: int = setting(8, minimum=1, help="save the training state every N steps (and at the end)")
    dtype: str = setting("auto", choices=PASS_DTYPES, help=(
        "the training forwards' precision (the weights stay float32): auto is bfloat16 autocast on a CPU that "
        "runs it natively (AVX-512 BF16 or AMX), float32 elsewhere"))
    device: str = setting("cpu", help="cpu, cuda or cuda:N (teacher and student both)")

    def validate(self) -> "RecoverConfig":
        from ..settings.fields import check_settings

        check_settings(self)  # types, finite numbers, choices and bounds: --steps 0, --time-budget 0, --ce-weight 2
        if not self.lora_dropout < 1.0:
            raise UserError(f"lora dropout must be below 1, got {self.lora_dropout}")
        if self.teacher is not None and not self.distils:
            raise UserError("--teacher is read only by a recovery with a KL term: add --ce-weight below 1 (0: KL "
                            "alone), or leave --teacher out")
        return self

    @property
    def distils(self) -> bool:
        """Whether the loss has a KL term, so that the teacher is loaded and run (ce weight below 1)."""
        return self.ce_weight < 1.0

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def learning_rate(self) -> float:
        return self.lr if self.lr is not None else DEFAULT_LR[self.mode]

    @property
    def step_limit(self) -> int | None:
        """The steps in all: --steps, else DEFAULT_STEPS without a time budget, else none (the time decides)."""
        if self.steps is not None:
            return self.steps
        return None if self.time_budget is not None else DEFAULT_STEPS


@dataclass
class RecoverResult:
    """What a recovery gives back: the recovered model's folder (OUT/model) and recover_results.json's content."""

    model: Path
    results: dict
    out: Path


class RecoverInterrupted(KeyboardInterrupt):
    """Ctrl-C or SIGTERM during a recovery whose checkpoint holds `step` steps: --resume continues from there."""

    def __init__(self, out: Path, step: int):
        super().__init__(f"interrupted at step {step}; {out / CHECKPOINT_FILE} holds it")
        self.out, self.step = out, step


# --- the pure parts: loss, schedule, sampler, time ----------------------------------------------------------
class _TokenKL(torch.autograd.Function):
    """row_kl's mean, whose gradient in the student's logits is the exact (q - p_teacher) / positions at positions
    0..T-2, q = exp(log_softmax(logits)): zero where the student's logits are the teacher's. (Autograd's, through
    log_softmax, is float noise there, which AdamW scales up to steps of the learning rate's size.)"""

    @staticmethod
    def forward(ctx, student_logits, teacher_logp):
        from ..algo.rewards import row_kl

        ctx.save_for_backward(student_logits, teacher_logp)
        return row_kl(student_logits, teacher_logp).mean()

    @staticmethod
    def backward(ctx, grad):
        logits, teacher_logp = ctx.saved_tensors
        rows, length, _ = logits.shape
        out = torch.zeros_like(logits)
        q = F.log_softmax(logits[:, :-1], dim=-1).exp_()  # (the forward's log_softmax, bit for bit)
        out[:, :-1] = (q - teacher_logp[:, :-1].exp()).mul_(grad / (rows * (length - 1)))
        return out, None


def kl_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """The mean over rows and positions 0..T-2 of KL(p_teacher || p_student) (a scalar, differentiable in the
    student's logits), as engine.algo.rewards.row_kl scores a mask."""
    wide = lambda t: t if t.dtype == torch.float64 else t.float()  # noqa: E731  (bfloat16 logits: in float32)
    teacher_logp = F.log_softmax(wide(teacher_logits), dim=-1).detach()
    return _TokenKL.apply(wide(student_logits), teacher_logp.to(wide(student_logits).dtype))


def ce_loss(student_logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy of the text over the same positions (0..T-2 predicting 1..T-1)."""
    from ..algo.evaluate import _row_losses

    return _row_losses(student_logits.float(), ids.to(student_logits.device)).mean()


def mixed_loss(kl: torch.Tensor, ce: torch.Tensor, ce_weight: float) -> torch.Tensor:
    """(1 - W) KL + W CE; the pure KL (W = 0) and the pure CE (W = 1) exactly, without a zero-weighted term."""
    if ce_weight == 0:
        return kl
    if ce_weight == 1:
        return ce
    return (1 - ce_weight) * kl + ce_weight * ce


def lr_factor(step: int, warmup_steps: int) -> float:
    """The learning rate's factor at 0-based step `step`: a linear warm-up over `warmup_steps`, then 1."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0


@functools.lru_cache(maxsize=4)
def _epoch_order(n: int, seed: int, epoch: int) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch + 1))


def batch_indices(step: int, n: int, batch_size: int, seed: int) -> list[int]:
    """The segments (indices into n) of 0-based step `step`: seeded permutations of the n segments laid end to end,
    one per epoch, read batch_size at a time. A pure function of its arguments: the sampler's state is the step."""
    out = []
    for position in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(position, n)
        out.append(int(_epoch_order(n, seed, epoch)[i]))
    return out


def next_step_fits(elapsed: float, last_step: float | None, budget: float | None) -> bool:
    """Whether another step, timed as the last one, ends within the budget (seconds; None: no budget). Before the
    first step there is no timing: it runs."""
    if budget is None or last_step is None:
        return True
    return elapsed + last_step <= budget


def segments_digest(segments: torch.Tensor) -> str:
    return hashlib.sha1(segments.contiguous().numpy().tobytes()).hexdigest()


# --- the student -----------------------------------------------------------------------------------------------
def decoder_parameters(model) -> list[tuple[str, torch.nn.Parameter]]:
    """(name, parameter) of every weight inside the decoder layers (the architecture adapter's): full mode trains
    these; the embeddings, the final norm and the LM head (tied or not) are not among them."""
    from ..model.arch import ModelAdapter

    inside = {id(p) for layer in ModelAdapter.for_model(model).layers for p in layer.parameters()}
    return [(name, p) for name, p in model.named_parameters() if id(p) in inside]


def prepare_student(model, config: RecoverConfig, log=lambda m: None):
    """(the module to train, [(name, parameter)] it trains): the model wrapped with LoRA adapters (lora), or the
    model itself with its decoder weights trainable (full). torch's generator is seeded with the seed first."""
    torch.manual_seed(config.seed)
    if config.mode == "lora":
        from .finetune import wrap_lora

        trained, targets = wrap_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout)
        params = [(n, p) for n, p in trained.named_parameters() if p.requires_grad]
        what = f"LoRA r={config.lora_r} alpha={config.lora_alpha:g} dropout={config.lora_dropout:g} on {', '.join(targets)}"
    else:
        trained, params = model, decoder_parameters(model)
        for _, p in params:
            p.requires_grad_(True)
        what = "every decoder-layer weight (embeddings, final norm and LM head frozen)"
    log(f"{config.mode}: {what}: {sum(p.numel() for _, p in params):,} trainable parameters")
    trained.train()
    return trained, params


def make_optimizer(params: list[tuple[str, torch.nn.Parameter]], config: RecoverConfig) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for _, p in params], lr=config.learning_rate, weight_decay=config.weight_decay)


@torch.no_grad()
def finished_model(trained, config: RecoverConfig, check: torch.Tensor):
    """(the plain recovered model in eval mode, the largest |logit| change of merging on `check`: 0 for full)."""
    if config.mode == "lora":
        from .finetune import merge

        return merge(trained, check)
    trained.eval().requires_grad_(False)
    return trained, 0.0


def backward_losses(trained, teacher, batch: torch.Tensor, opt: torch.optim.Optimizer, ce_weight: float,
                    precision=None) -> dict:
    """The gradients of one batch's loss in the trainable weights: the teacher's logits under no_grad, the
    student's with gradients, the mixed loss, backward. precision: the forwards' context (autocast), or none.
    The weights are not changed. Returns {loss, kl, ce}; with ce_weight 1 the teacher is not run (it may be None)
    and there is no kl."""
    import contextlib

    from ..model.loading import model_device

    precision = precision or contextlib.nullcontext
    ids = batch.to(model_device(trained))
    kl = None
    if ce_weight < 1:
        with torch.no_grad(), precision():
            teacher_logits = teacher(input_ids=ids.to(model_device(teacher)), use_cache=False).logits.float()
    with precision():
        student_logits = trained(input_ids=ids, use_cache=False).logits.float()
    if ce_weight < 1:
        kl = kl_loss(student_logits, teacher_logits.to(student_logits.device))
    ce = ce_loss(student_logits, ids)
    loss = mixed_loss(kl, ce, ce_weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    return {"loss": float(loss.detach()), **({} if kl is None else {"kl": float(kl.detach())}),
            "ce": float(ce.detach())}


def apply_update(opt: torch.optim.Optimizer, lr: float) -> None:
    """AdamW's step at learning rate `lr` on the gradients backward_losses left."""
    for group in opt.param_groups:
        group["lr"] = lr
    opt.step()


def distil_step(trained, teacher, batch: torch.Tensor, opt: torch.optim.Optimizer, lr: float, ce_weight: float,
                precision=None) -> dict:
    """One optimizer step on `batch` (backward_losses, then apply_update); returns {loss, kl, ce}."""
    losses = backward_losses(trained, teacher, batch, opt, ce_weight, precision)
    apply_update(opt, lr)
    return losses


# --- the training loop -----------------------------------------------------------------------------------------
@dataclass
class TrainState:
    """Where a recovery stands: steps done, training seconds so far (wall, and this process's CPU seconds summed
    over every session: None when a checkpoint from before they were kept holds the steps), the per-step records,
    and the step its last checkpoint holds."""

    step: int = 0
    seconds: float = 0.0
    cpu_seconds: float | None = 0.0
    records: list = dataclasses.field(default_factory=list)
    saved_step: int | None = None


def checkpoint_state(state: TrainState, params, opt, config: RecoverConfig, segments: torch.Tensor) -> dict:
    """What --resume needs to continue bit for bit: the trainable weights, the optimizer, torch's generator (LoRA
    dropout), the sampler's state (the step, and which segments it reads) and the seconds so far."""
    return {"step": state.step, "seconds": state.seconds, "cpu_seconds": state.cpu_seconds, "mode": config.mode,
            "trainable": {n: p.detach().clone() for n, p in params}, "optimizer": opt.state_dict(),
            "rng": torch.get_rng_state(),
            "sampler": {"seed": config.seed, "batch_size": config.batch_size, "segments": int(len(segments)),
                        "digest": segments_digest(segments)}}


def restore_state(ckpt: dict, params, opt, config: RecoverConfig, segments: torch.Tensor, where: Path) -> TrainState:
    """Load a checkpoint_state into the trainable weights and the optimizer (and torch's generator); refused in
    one line when it is another recovery's (mode, parameters, segments)."""
    sampler = ckpt.get("sampler", {})
    same = (ckpt.get("mode") == config.mode and sampler.get("seed") == config.seed
            and sampler.get("batch_size") == config.batch_size and sampler.get("segments") == len(segments)
            and sampler.get("digest") == segments_digest(segments))
    if not same:
        raise UserError(f"{where} is another recovery's (its mode, seed, batch size or training text differ from "
                        "these); --overwrite starts again")
    saved = ckpt["trainable"]
    if sorted(saved) != sorted(n for n, _ in params) or any(saved[n].shape != p.shape for n, p in params):
        raise UserError(f"{where} holds other trainable weights than this student's; --overwrite starts again")
    with torch.no_grad():
        for n, p in params:
            p.copy_(saved[n])
    opt.load_state_dict(ckpt["optimizer"])
    torch.set_rng_state(ckpt["rng"])
    step = int(ckpt["step"])
    cpu = ckpt.get("cpu_seconds")
    return TrainState(step=step, seconds=float(ckpt["seconds"]), cpu_seconds=None if cpu is None else float(cpu),
                      saved_step=step)


def trained_so_far(out: Path) -> tuple[int, float | None]:
    """(steps, CPU seconds of training) the recovery in `out` holds in its checkpoint, every session's: (0, 0.0)
    without a checkpoint, CPU None for a checkpoint from before they were kept. What a ladder of CPU budgets that
    resumes (bench/recover_study.py) subtracts, since --time-budget counts one session's minutes."""
    path = Path(out) / CHECKPOINT_FILE
    if not path.is_file():
        return 0, 0.0
    ckpt = torch.load(path, weights_only=True, mmap=True)  # (two numbers: the weights and the optimizer stay on disk)
    cpu = ckpt.get("cpu_seconds")
    return int(ckpt["step"]), None if cpu is None else float(cpu)


def train(trained, teacher, params, opt, segments: torch.Tensor, config: RecoverConfig, state: TrainState, *,
          precision=None, save: Callable[[TrainState], None] = lambda s: None,
          on_step: Callable[[dict], None] = lambda r: None, stop: threading.Event | None = None,
          log=lambda m: None) -> str:
    """Steps state.step+1 ... until config.step_limit, the time budget (this call's wall seconds) or `stop` ends
    them; save(state) every config.checkpoint_every steps and at the end. Returns what ended it: "steps", "time
    budget" or "stop". A KeyboardInterrupt saves the last finished step (unless it came while the weights were
    being updated: then the last checkpoint stays), then propagates."""
    limit, n = config.step_limit, len(segments)
    budget = config.time_budget * 60 if config.time_budget is not None else None
    clock = BUDGET_CLOCKS[config.budget_clock]
    began, last, updating = clock(), None, False

    def checkpoint():
        save(state)
        state.saved_step = state.step

    ended = "steps"
    try:
        while limit is None or state.step < limit:
            if stop is not None and stop.is_set():
                ended = "stop"
                break
            if not next_step_fits(clock() - began, last, budget):
                ended = "time budget"
                break
            t0, c0, p0 = time.perf_counter(), clock(), time.process_time()
            batch = segments[batch_indices(state.step, n, config.batch_size, config.seed)]
            lr = config.learning_rate * lr_factor(state.step, config.warmup_steps)
            losses = backward_losses(trained, teacher, batch, opt, config.ce_weight, precision)
            if not all(math.isfinite(v) for v in losses.values()):
                raise UserError(f"the loss is not finite at step {state.step + 1} ({losses['loss']}): lower --lr, or "
                                "--dtype float32")
            updating = True
            apply_update(opt, lr)
            wall, last = time.perf_counter() - t0, clock() - c0
            state.step += 1
            state.seconds += wall
            if state.cpu_seconds is not None:
                state.cpu_seconds += time.process_time() - p0
            updating = False
            record = {"step": state.step, **losses, "lr": lr, "seconds": state.seconds, "step_seconds": wall}
            state.records.append(record)
            on_step(record)
            if state.step == 1 or state.step % 10 == 0 or state.step == limit:
                parts = ", ".join(f"{k} {losses[k]:.4f}" for k in ("kl", "ce") if k in losses)
                log(f"step {state.step}{f'/{limit}' if limit else ''} loss {losses['loss']:.4f} ({parts}; "
                    f"{state.seconds:.0f} s)")
            if state.step % config.checkpoint_every == 0:
                checkpoint()
    except KeyboardInterrupt:
        if not updating and state.step > 0 and state.step != state.saved_step:
            checkpoint()
        raise
    if state.step != state.saved_step:
        checkpoint()
    return ended


def recovery_words(ce_weight: float | None = None, mode: str | None = None) -> str:
    """How a recovery trained, in a few words for a label: its loss and what it trained (None: recover's default,
    RecoverConfig's)."""
    if ce_weight is None or mode is None:
        defaults = RecoverConfig()
        ce_weight = defaults.ce_weight if ce_weight is None else ce_weight
        mode = defaults.mode if mode is None else mode
    loss = ("fine-tuned on the text (CE)" if ce_weight >= 1 else "distilled from the dense model (KL)" if ce_weight <= 0
            else f"distilled from the dense model (KL + {ce_weight:g} CE)")
    return f"{loss}, {'LoRA' if mode == 'lora' else 'all decoder weights'}"


def recovery_words_of(out: str | Path) -> str:
    """recovery_words of the recovery in `out` (its recover_config.json); 'recovered' where that is unreadable."""
    try:
        saved = json.loads((Path(out) / CONFIG_FILE).read_text(encoding="utf-8"))
        return recovery_words(float(saved["ce_weight"]), str(saved["mode"]))
    except (OSError, ValueError, KeyError, TypeError):
        return "recovered"


# --- the run folder: student, teacher, text ----------------------------------------------------------------
def run_settings(run_dir: Path):
    """The finished run's saved config (a PruneConfig), refused in one line when RUN is no finished run (no
    model/, no results.json)."""
    from ..settings.config import PruneConfig
    from ..run.folder import is_run_dir
    from ..run.files import CONFIG_FILE as RUN_CONFIG, MODEL_DIR as RUN_MODEL, RESULTS_FILE as RUN_RESULTS

    if not run_dir.is_dir():
        raise UserError(f"run folder not found: {run_dir}")
    if not is_run_dir(run_dir, adopt=False):
        raise UserError(f"{run_dir} is not a prune run folder (no pg-prune-run marker); recover takes a finished "
                        "run, RUN of `python -m engine prune --out RUN`")
    missing = [name for name, ok in ((f"{RUN_MODEL}/", (run_dir / RUN_MODEL / "config.json").is_file()),
                                     (RUN_RESULTS, (run_dir / RUN_RESULTS).is_file())) if not ok]
    if missing:
        raise UserError(f"{run_dir} holds no finished run (no {' and no '.join(missing)}): finish it first "
                        f"(python -m engine prune --out {run_dir} --resume)")
    return PruneConfig.load(run_dir / RUN_CONFIG)


def resolve_config(config: RecoverConfig, run) -> RecoverConfig:
    """The config with what it leaves to the run filled in from the run's own settings: the teacher, the
    evaluation text, window length and count, and the learning rate of its mode (the teacher only where the loss
    reads it: a KL term)."""
    return dataclasses.replace(
        config, teacher=(config.teacher or run.model) if config.distils else None, lr=config.learning_rate,
        eval_data=config.eval_data if config.eval_data is not None else run.eval_data,
        eval_seqlen=config.eval_seqlen if config.eval_seqlen is not None else run.eval_seqlen,
        max_windows=config.max_windows if config.max_windows is not None else (run.max_windows or 0))


def check_not_evaluation_text(calib: str | None, eval_source: str | None) -> None:
    """A --calib that is (or holds) the evaluation file is refused: recovery never trains on what it is judged on."""
    from ..data.text import _TEXT_SUFFIXES, _files_in

    if calib is None or eval_source is None or not Path(eval_source).exists():
        return
    target = Path(eval_source).resolve()
    path = Path(calib).expanduser()
    files = [path] if path.is_file() else (_files_in(path, _TEXT_SUFFIXES) if path.is_dir() else [])
    if path.resolve() == target or any(f.resolve() == target for f in files) or target.parent == path.resolve():
        raise UserError(f"--calib {calib} is the evaluation text ({eval_source}): recovery never trains on a "
                        "document an evaluation reads; give C4-style calibration text")


def training_texts(config: RecoverConfig, run) -> tuple[list[str], str]:
    """(documents, where they came from): --calib as given, else the run's calibration documents less every 10th,
    the ones its held-out check read (when it had one)."""
    from ..data.text import load_calibration_texts, split_holdout

    if config.calib is not None:
        return load_calibration_texts(config.calib)
    texts, source = load_calibration_texts(run.calib)
    if run.validates:
        texts = split_holdout(texts)[0]
        source += " (less its held-out documents)"
    return texts, source


def check_same_vocabulary(student, student_tok, teacher, teacher_tok, names: tuple[str, str]) -> None:
    """Teacher and student must score the same tokens: the same tokenizer vocabulary and embedding rows."""
    rows = (student.get_input_embeddings().num_embeddings, teacher.get_input_embeddings().num_embeddings)
    vocab = (student_tok.get_vocab(), teacher_tok.get_vocab())
    if rows[0] != rows[1] or vocab[0] != vocab[1]:
        raise UserError(f"the teacher {names[1]} has another vocabulary than the student {names[0]} ({len(vocab[1]):,} "
                        f"tokens and {rows[1]:,} embedding rows against {len(vocab[0]):,} and {rows[0]:,}): "
                        "distillation compares next-token distributions token by token; give the run's base model")


# --- the command -----------------------------------------------------------------------------------------------
def recover(run_dir: str | Path, out: str | Path, *, resume: bool = False, overwrite: bool = False,
            log=lambda m: print(m, file=sys.stderr), on_step: Callable[[dict], None] = lambda r: None,
            stop: threading.Event | None = None, **options) -> RecoverResult:
    """Recover the run's export RUN/model (by the text's CE, or distilled from its dense base model) into the folder
    `out` (outdir's rule: a new or empty folder, or with overwrite an earlier recovery's); options are
    RecoverConfig's fields. resume: continue the recovery in `out` from its checkpoint (its saved settings; only
    RESUME_MAY_CHANGE's may be given anew). on_step(record) after every step; `stop` (an Event) ends the training
    after the current step, as the time budget does. Ctrl-C saves the last finished step and raises
    RecoverInterrupted."""
    from ..storage.outdir import check_not_in_run_files, folder_lock, output_folder

    run_dir, out = Path(run_dir).expanduser(), Path(out)
    unknown = set(options) - {f.name for f in dataclasses.fields(RecoverConfig)} | ({"run"} & set(options))
    if unknown:
        raise UserError(f"recover() has no option {', '.join(sorted(unknown))}")
    if resume and overwrite:
        raise UserError("--resume continues the recovery in --out, --overwrite starts it again: give one")
    config = RecoverConfig(run=str(run_dir), **options).validate()
    if out.exists() and run_dir.exists() and out.resolve() == run_dir.resolve():
        raise UserError(f"--out {out} is the run folder itself; choose a folder of its own (RUN/recover is fine)")
    run_settings(run_dir)  # (a folder that holds no finished run: one line, before --out is touched)
    if resume:
        check_not_in_run_files(out)
        config = resumed_config(out, config)
    # the run is read under its shared lock (a run being written is refused, naming its process), --out written
    # under its own: a new or empty folder, an earlier recovery's with overwrite, or this one's to resume
    with folder_lock(run_dir, exclusive=False, what="recover from"), \
            (folder_lock(out, what="resume the recovery in") if resume else output_folder(out, RECOVER_OUTPUT, overwrite)):
        outcome = _recover(config, out, log, on_step, stop, resume=resume)
    if isinstance(outcome, RecoverInterrupted):
        raise outcome
    return outcome


def resumed_config(out: Path, given: RecoverConfig) -> RecoverConfig:
    """The saved config of the recovery in `out`, with steps and time_budget as given anew; another setting given
    (not its default) that differs from the saved one is refused in one line."""
    if not RECOVER_OUTPUT.owns(out) or not (out / CHECKPOINT_FILE).is_file():
        raise UserError(f"--resume: {out} holds no recovery to continue (no {CHECKPOINT_FILE}); start one without "
                        "--resume")
    try:
        saved = RecoverConfig(**json.loads((out / CONFIG_FILE).read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError) as e:
        raise UserError(f"cannot read {out / CONFIG_FILE} ({type(e).__name__}); --overwrite starts again") from None
    defaults = RecoverConfig()
    for f in dataclasses.fields(RecoverConfig):
        value = getattr(given, f.name)
        if f.name in RESUME_MAY_CHANGE or f.name == "run" or value == getattr(defaults, f.name):
            continue
        if value != getattr(saved, f.name):
            raise UserError(f"--resume continues the recovery with its saved settings; {f.name.replace('_', ' ')} "
                            f"{value!r} differs from its {getattr(saved, f.name)!r} (--overwrite starts again)")
    if Path(saved.run).resolve() != Path(given.run).resolve():
        raise UserError(f"--resume: the recovery in {out} is of the run {saved.run}, not {given.run}")
    changed = {"skip_eval": True} if given.skip_eval else {}
    if given.steps is not None or given.time_budget is not None:  # how far this session goes: as given, both
        changed.update(steps=given.steps, time_budget=given.time_budget, budget_clock=given.budget_clock)
    return dataclasses.replace(saved, **changed).validate()


def precision_of(config: RecoverConfig, model) -> tuple[str, Callable]:
    """(the training forwards' dtype, its context factory): --dtype resolved on the student's device."""
    from ..model.loading import model_device
    from ..model.precision import pass_precision, resolve_pass_dtype

    device = model_device(model).type
    dtype = resolve_pass_dtype(config.dtype, "float32", device)
    return dtype, lambda: pass_precision(dtype, device)


def _recover(config: RecoverConfig, out: Path, log, on_step, stop, resume: bool):
    from ..data.text import eval_windows, load_eval_text
    from ..algo.evaluate import perplexity
    from ..storage.io import atomic_write_text
    from ..model.loading import count_parameters, load_model, resolve_model
    from ..run.files import MODEL_DIR as RUN_MODEL, RESULTS_FILE as RUN_RESULTS
    from .finetune import load_local_model, save_like_export, training_segments

    started = time.perf_counter()
    run_dir = Path(config.run)
    run = run_settings(run_dir)
    config = resolve_config(config, run)
    eval_text = None if config.skip_eval else load_eval_text(config.eval_data)
    check_not_evaluation_text(config.calib, eval_text[1] if eval_text else config.eval_data)
    texts, calib_source = training_texts(config, run)
    lengths = {"seqlen": config.seqlen, **({} if config.skip_eval else {"eval seqlen": config.eval_seqlen})}
    student, tok = load_local_model(str(run_dir / RUN_MODEL), "float32", config.device, lengths, what="recover")
    teacher = None
    if config.distils:
        teacher, teacher_tok = load_model(resolve_model(config.teacher), "float32", config.device)
        check_same_vocabulary(student, tok, teacher, teacher_tok, (str(run_dir / RUN_MODEL), config.teacher))
    segments = training_segments(tok, texts, config.seqlen, sys.maxsize, config.seed)
    dtype, precision = precision_of(config, student)
    native = "bfloat16 autocast (the CPU runs it natively)" if dtype == "bfloat16" else "float32"
    source = f"from {config.teacher}" if config.distils else "by the text's cross-entropy (no teacher)"
    log(f"recover {run_dir} {source}: {len(segments)} segments x {config.seqlen} tokens of {calib_source}, "
        f"batch {config.batch_size}, lr {config.learning_rate:g}, ce weight {config.ce_weight:g}; precision {native}")
    if not resume:
        atomic_write_text(out / CONFIG_FILE, json.dumps(config.to_dict(), indent=2) + "\n")
        atomic_write_text(out / LOG_FILE, "")

    results: dict = {"run": str(run_dir), "teacher": config.teacher, "mode": config.mode, "ce_weight": config.ce_weight,
                     "calib": calib_source, "segments": int(len(segments)), "seqlen": config.seqlen,
                     "batch_size": config.batch_size, "lr": config.learning_rate, "precision": dtype}
    windows = None
    if eval_text is not None:
        windows = eval_windows(tok, eval_text[0], config.eval_seqlen, config.max_windows)
        log(f"perplexity before recovery on {len(windows)} windows")
        results.update(ppl_before=perplexity(student, windows, config.eval_batch_size), eval_windows=int(len(windows)),
                       eval_seqlen=config.eval_seqlen, eval_data=eval_text[1])
        results.update(run_reference(run_dir / RUN_RESULTS, run, config, eval_text[1]))

    trained, params = prepare_student(student, config, log)
    opt = make_optimizer(params, config)
    state = TrainState()
    if resume:
        ckpt = torch.load(out / CHECKPOINT_FILE, weights_only=True)
        state = restore_state(ckpt, params, opt, config, segments, out / CHECKPOINT_FILE)
        state.records = read_log(out / LOG_FILE, state.step)
        atomic_write_text(out / LOG_FILE, "".join(json.dumps(r) + "\n" for r in state.records))
        log(f"resumed at step {state.step}")
        if config.step_limit is not None and state.step >= config.step_limit:
            raise UserError(f"the recovery in {out} has run its {state.step} steps; --resume --steps N (more) or "
                            "--time-budget MIN continues it, --overwrite starts again")
    try:
        with open(out / LOG_FILE, "ab", buffering=0) as fh:
            def step_done(record):
                from ..storage.io import append_line

                append_line(fh, json.dumps(record), out, LOG_FILE)
                on_step(record)

            def save(s: TrainState):
                save_checkpoint(out / CHECKPOINT_FILE, checkpoint_state(s, params, opt, config, segments))

            ended = train(trained, teacher, params, opt, segments, config, state, precision=precision, save=save,
                          on_step=step_done, stop=stop, log=log)
    except KeyboardInterrupt:
        if state.saved_step is None:  # (nothing to resume: a new folder is removed as output_folder does)
            raise
        return RecoverInterrupted(out, state.saved_step)
    del teacher
    model, merge_diff = finished_model(trained, config, segments[:2])
    if windows is not None:
        log("perplexity after recovery")
        results["ppl_after"] = perplexity(model, windows, config.eval_batch_size)
    save_like_export(model, tok, out / MODEL_DIR)
    records = state.records
    results.update(steps=state.step, ended_by=ended, train_seconds=state.seconds, train_cpu_seconds=state.cpu_seconds,
                   seconds=time.perf_counter() - started, loss_first=records[0]["loss"] if records else None,
                   loss_last=records[-1]["loss"] if records else None, kl_first=records[0].get("kl") if records else None,
                   kl_last=records[-1].get("kl") if records else None, trainable_params=sum(p.numel() for _, p in params),
                   merge_max_abs_logit_diff=merge_diff, params=count_parameters(model), out_model=str(out / MODEL_DIR))
    atomic_write_text(out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    return RecoverResult(model=out / MODEL_DIR, results=results, out=out)


def run_reference(run_results: Path, run, config: RecoverConfig, eval_source: str) -> dict:
    """The run's own dense and pruned perplexities, when this recovery evaluates as the run did (same windows)."""
    try:
        saved = json.loads(run_results.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    same = (config.eval_seqlen == run.eval_seqlen and config.max_windows == (run.max_windows or 0)
            and saved.get("eval_data") in (None, eval_source))
    if not same or not isinstance(saved, dict):
        return {}
    return {k: saved[k] for k in ("ppl_dense", "ppl_pruned") if isinstance(saved.get(k), (int, float))}


def save_checkpoint(path: Path, state: dict) -> None:
    """torch.save of the state, atomically (a checkpoint is whole or the previous one stays)."""
    from ..storage.io import atomic_file

    needed = sum(t.numel() * t.element_size() for t in state["trainable"].values())
    with atomic_file(path, needed) as tmp:
        torch.save(state, tmp)


def read_log(path: Path, steps: int) -> list[dict]:
    """The log's records of steps 1..steps (a line after the checkpoint's step, or cut short, is dropped)."""
    records = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return records
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= steps:
            records.append(record)
    return records
