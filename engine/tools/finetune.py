"""Recovery fine-tuning of a (pruned) model with LoRA, merged back into a model that reloads like the export.

    python -m engine finetune --model RUN/model --out DIR2 [--samples 128 --seqlen 256 --epochs 1 --lr 5e-4 ...]

LoRA (PEFT) with r = 16, alpha = 10, dropout 0.05 on every projection of the attention and the MLP
(their names come from the architecture adapter, engine/model/arch), causal-LM loss on segments of local
C4 text (the paper uses Alpaca, which is not available offline), AdamW. The adapters are then
merged into the weights and DIR2/model is written atomically with save_pretrained, the tokenizer
and, for a pruned export, the modeling_pruned.py copy its config's auto_map points at: it loads
with `AutoModelForCausalLM.from_pretrained(DIR2/model, trust_remote_code=True)` anywhere, or
through engine.model.loading in this project, exactly like the export it came from.

The defaults are CPU-sized: 128 segments of 256 tokens, 4 a step, lr 5e-4, 32 optimizer steps (a few
minutes on 2 cores for the default model). The paper's recovery is 4,000 segments of 1,024 tokens at lr 1e-4
(`--samples 4000 --seqlen 1024 --lr 1e-4`: hours on a CPU). Distillation from the dense model is `recover`
(engine/tools/recover.py), which shares this module's data segments, LoRA targets, merge and save.

DIR2 also holds finetune_config.json (the FinetuneConfig), finetune_log.jsonl (loss per optimizer
step) and finetune_results.json (training loss and WikiText-2 perplexity before and after).
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data.text import DEFAULT_EVAL_WINDOWS
from ..errors import UserError
from ..storage.outdir import OutputKind, output_folder

CONFIG_FILE, LOG_FILE, RESULTS_FILE, MODEL_DIR = "finetune_config.json", "finetune_log.jsonl", "finetune_results.json", "model"


@dataclass
class FinetuneConfig:
    model: str = ""  # the model folder to fine-tune (a pruned export: RUN/model)
    # CPU-sized (32 steps of 4 x 256 tokens); the paper's: samples 4000, seqlen 1024, lr 1e-4
    samples: int = 128  # training segments; fewer are used if the data holds fewer
    seqlen: int = 256  # tokens per segment
    epochs: int = 1
    lr: float = 5e-4
    batch_size: int = 4  # segments per forward
    grad_accum: int = 1  # forwards per optimizer step
    weight_decay: float = 0.0
    warmup_steps: int = 0  # linear warm-up, then constant
    lora_r: int = 16
    lora_alpha: float = 10.0
    lora_dropout: float = 0.05
    calib: str | None = None  # C4-style JSON lines file/folder (default: the local C4 sample)
    seed: int = 0
    eval_data: str | None = None  # WikiText-2 raw test for perplexity before/after (default: the data dir)
    eval_seqlen: int = 128
    max_windows: int | None = DEFAULT_EVAL_WINDOWS  # perplexity on the first N windows (0 or None: all)
    skip_eval: bool = False  # no perplexity before/after
    loss_probe_segments: int = 16  # training segments whose mean loss is recorded before and after
    dtype: str = "float32"
    device: str = "cpu"

    def validate(self) -> "FinetuneConfig":
        from ..settings.fields import check_fields
        from ..model.loading import DTYPES

        check_fields(self)  # types, finite floats (lr nan/inf, ...), ints within 64 bits
        for name in ("seqlen", "eval_seqlen"):  # one token predicts nothing: a NaN loss
            if getattr(self, name) < 2:
                raise UserError(f"{name.replace('_', ' ')} must be at least 2 tokens, got {getattr(self, name)}")
        for name in ("samples", "seqlen", "epochs", "batch_size", "grad_accum", "lora_r", "eval_seqlen", "loss_probe_segments"):
            if getattr(self, name) < 1:
                raise UserError(f"{name.replace('_', ' ')} must be at least 1, got {getattr(self, name)}")
        if self.max_windows is not None and self.max_windows < 0:
            raise UserError(f"max windows must be 0 (all) or more, got {self.max_windows}")
        if self.lr <= 0 or self.lora_alpha <= 0:
            raise UserError("learning rate and LoRA alpha must be positive")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise UserError(f"LoRA dropout must be in [0, 1), got {self.lora_dropout}")
        if self.warmup_steps < 0 or self.weight_decay < 0:
            raise UserError("warmup steps and weight decay cannot be negative")
        if self.dtype not in DTYPES:
            raise UserError(f"unknown dtype {self.dtype!r}; choose from {', '.join(DTYPES)}")
        return self

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def lora_target_modules(model) -> list[str]:
    """Names of the attention and MLP projections of this architecture (from its adapter)."""
    from ..model.arch import ModelAdapter

    a = ModelAdapter.for_model(model)
    return [a.param_name(linear).rsplit(".", 1)[-1] for linear in a.projections(0)]


def training_segments(tokenizer, texts: list[str], seqlen: int, samples: int, seed: int) -> torch.Tensor:
    """Documents joined with EOS, cut into non-overlapping seqlen-token segments, shuffled (seeded): (n, seqlen)."""
    ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    sep = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    flat = torch.tensor([t for doc in ids for t in doc + sep], dtype=torch.long)
    n = flat.numel() // seqlen
    if n == 0:
        raise UserError(f"the training text has {flat.numel()} tokens, fewer than one segment of {seqlen}")
    segments = flat[: n * seqlen].view(n, seqlen)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    return segments[order[: min(samples, n)]]


def lm_loss(model, batch: torch.Tensor) -> torch.Tensor:
    batch = batch.to(next(model.parameters()).device)
    logits = model(input_ids=batch, use_cache=False).logits[:, :-1].float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


@torch.no_grad()
def mean_loss(model, segments: torch.Tensor, batch_size: int) -> float:
    was_training = model.training
    model.eval()
    losses = [float(lm_loss(model, segments[i : i + batch_size])) * len(segments[i : i + batch_size])
              for i in range(0, len(segments), batch_size)]
    model.train(was_training)
    return sum(losses) / len(segments)


def save_like_export(model, tokenizer, dest: Path) -> None:
    """save_pretrained + tokenizer (+ modeling_pruned.py for a pruned model), atomically: a folder that reloads as
    the export it came from did (engine.model.loading, or from_pretrained with trust_remote_code=True anywhere)."""
    from ..model import modeling_pruned
    from ..export.artifacts import weight_bytes
    from ..storage.io import atomic_dir

    with atomic_dir(dest, weight_bytes(model)) as tmp:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if getattr(model.config, "auto_map", None):
            shutil.copyfile(modeling_pruned.__file__, tmp / Path(modeling_pruned.__file__).name)


def load_local_model(name: str, dtype: str, device: str, lengths: dict[str, int], what: str = "finetune"):
    """(model, tokenizer) of a local model folder (a pruned export RUN/model), refused in one line when it is a
    .gguf file or a hub id, or when `lengths` (see loading.check_positions) exceed its positions."""
    from ..model.loading import check_positions, load_model, resolve_model

    source = resolve_model(name)
    if source.gguf_file is not None or not Path(source.path).is_dir():
        raise UserError(f"{what} takes a local model folder (e.g. a pruned export RUN/model), "
                        "not a .gguf file or a hub id")
    model, tok = load_model(source, dtype, device)
    check_positions(model.config, lengths)  # before any training or perplexity
    return model, tok


def load_trainable(config: FinetuneConfig):
    if not config.model:
        raise UserError("give the model to fine-tune with --model (e.g. RUN/model)")
    lengths = {"seqlen": config.seqlen, **({} if config.skip_eval else {"eval seqlen": config.eval_seqlen})}
    return load_local_model(config.model, config.dtype, config.device, lengths)


def wrap_lora(model, r: int, alpha: float, dropout: float):
    """(PEFT model, target names): LoRA adapters on every attention and MLP projection the architecture adapter
    names, seeded by torch's global generator (seed it first); only the adapters require gradients."""
    import warnings

    from peft import LoraConfig, get_peft_model

    targets = lora_target_modules(model)
    lora = LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets, bias="none",
                      task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # (peft asks transformers' deprecated is_gradient_checkpointing: not ours to fix)
        warnings.simplefilter("ignore", FutureWarning)
        return get_peft_model(model, lora), targets


def train_lora(model, segments: torch.Tensor, config: FinetuneConfig, log=lambda m: None):
    """Wrap `model` with LoRA adapters and train them; returns (peft model in eval mode, per-step log, info)."""
    torch.manual_seed(config.seed)
    peft_model, targets = wrap_lora(model, config.lora_r, config.lora_alpha, config.lora_dropout)
    params = [p for p in peft_model.parameters() if p.requires_grad]
    trainable = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    micro = math.ceil(len(segments) / config.batch_size)
    total_steps = config.epochs * math.ceil(micro / config.grad_accum)
    warm = config.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
    log(f"LoRA r={config.lora_r} alpha={config.lora_alpha} dropout={config.lora_dropout} on {', '.join(targets)}: "
        f"{trainable:,} trainable parameters; {len(segments)} segments x {segments.shape[1]} tokens, "
        f"{config.epochs} epoch(s), {total_steps} optimizer steps")
    records: list[dict] = []
    peft_model.train()
    step, t0 = 0, time.perf_counter()
    gen = torch.Generator().manual_seed(config.seed + 1)
    for epoch in range(config.epochs):
        order = segments[torch.randperm(len(segments), generator=gen)]
        batches = [order[i : i + config.batch_size] for i in range(0, len(order), config.batch_size)]
        for start in range(0, len(batches), config.grad_accum):
            group = batches[start : start + config.grad_accum]
            n_rows = sum(len(b) for b in group)
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for b in group:
                loss = lm_loss(peft_model, b)
                (loss * len(b) / n_rows).backward()
                total += float(loss.detach()) * len(b) / n_rows
            lr = sched.get_last_lr()[0]
            opt.step()
            sched.step()
            step += 1
            records.append({"step": step, "epoch": epoch, "loss": total, "lr": lr, "seconds": time.perf_counter() - t0})
            if step == 1 or step % 10 == 0 or step == total_steps:
                log(f"step {step}/{total_steps} loss {total:.4f} ({records[-1]['seconds']:.0f} s)")
    peft_model.eval()
    info = {"steps": step, "train_seconds": time.perf_counter() - t0, "trainable_params": trainable, "lora_targets": targets}
    return peft_model, records, info


@torch.no_grad()
def merge(peft_model, check: torch.Tensor):
    """Fold the adapters into the weights; returns (plain model, max |logit difference| on `check` vs unmerged)."""
    peft_model.eval()
    check = check.to(next(peft_model.parameters()).device)  # the ids are on the CPU; the model may not be
    before = peft_model(input_ids=check, use_cache=False).logits
    merged = peft_model.merge_and_unload()
    merged.eval().requires_grad_(False)
    after = merged(input_ids=check, use_cache=False).logits
    return merged, float((before - after).abs().max())


FINETUNE_OUTPUT = OutputKind("finetune", "pg-prune-finetune", (CONFIG_FILE, LOG_FILE, RESULTS_FILE), (MODEL_DIR,))


def finetune(config: FinetuneConfig, out: str | Path, log=lambda m: print(m, file=sys.stderr), overwrite: bool = False) -> dict:
    """Fine-tune config.model into the folder `out`: a new or empty folder, or (overwrite) an earlier
    fine-tune's, never the folder --model lies in (outdir's rule); it is locked while it is written."""
    config.validate()
    out = Path(out)
    model = Path(config.model).expanduser()
    if model.exists() and (out.resolve() == model.resolve() or out.resolve() in model.resolve().parents):
        raise UserError(f"--out {out} holds --model {config.model}: the merged model would replace its own "
                        "source; choose another --out")
    with output_folder(out, FINETUNE_OUTPUT, overwrite):
        return _finetune(config, out, log)


def _finetune(config: FinetuneConfig, out: Path, log) -> dict:
    from ..data.text import eval_windows, load_calibration_texts, load_eval_text
    from ..algo.evaluate import perplexity
    from ..storage.io import atomic_write_text

    texts, calib_src = load_calibration_texts(config.calib)
    eval_text = None if config.skip_eval else load_eval_text(config.eval_data)
    model, tok = load_trainable(config)
    torch.manual_seed(config.seed)
    segments = training_segments(tok, texts, config.seqlen, config.samples, config.seed)
    if len(segments) < config.samples:
        log(f"the training text holds {len(segments)} segments of {config.seqlen} tokens; using all of them "
            f"(asked for {config.samples})")
    probe = segments[: config.loss_probe_segments]
    windows = None
    results: dict = {"model": config.model, "calib": calib_src, "samples_used": int(len(segments)), "seqlen": config.seqlen}
    if eval_text is not None:
        windows = eval_windows(tok, eval_text[0], config.eval_seqlen, config.max_windows)
        log(f"perplexity before fine-tuning on {len(windows)} windows")
        results.update(ppl_before=perplexity(model, windows, 8), eval_windows=int(len(windows)), eval_data=eval_text[1])
    results["train_loss_before"] = mean_loss(model, probe, config.batch_size)

    atomic_write_text(out / CONFIG_FILE, json.dumps(config.to_dict(), indent=2) + "\n")
    peft_model, log_lines, info = train_lora(model, segments, config, log)
    atomic_write_text(out / LOG_FILE, "\n".join(json.dumps(r) for r in log_lines) + "\n")
    merged, merge_diff = merge(peft_model, probe[:2])
    results["merge_max_abs_logit_diff"] = merge_diff
    results["train_loss_after"] = mean_loss(merged, probe, config.batch_size)
    if windows is not None:
        log("perplexity after fine-tuning")
        results["ppl_after"] = perplexity(merged, windows, 8)
    save_like_export(merged, tok, out / MODEL_DIR)
    from ..model.loading import count_parameters

    results.update(info, params=count_parameters(merged), out_model=str(out / MODEL_DIR))
    atomic_write_text(out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    return results
