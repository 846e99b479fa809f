"""The engine from Python: prune a model you already hold, in memory (docs/api.md).

    from engine import PruneConfig, prune
    result = prune(model, tokenizer, PruneConfig(prune_ratio=0.3), calib=texts)
    result.masks, result.model, result.report

`prune` is the same run as `python -m engine prune` (engine.pruner.PruneRun): without `out` it has no run folder,
so it writes nothing (no lock, checkpoint, metrics.jsonl, results.json or export) and cannot be resumed; with `out`
it is the command line's run, folder, checkpoints and export included.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .config import PruneConfig
from .errors import UserError
from .runstate import StepReport


@dataclass
class PruneResult:
    """What a run gives back: the final masks (per unit type, 1 = kept, in the order of the model's layers), the
    sliced model (a physically smaller copy; the model given stays as it was), and the report: results.json's
    content (what was removed, the dense, init and pruned perplexities, the steps, the seconds by phase)."""

    masks: dict[str, torch.Tensor]
    model: torch.nn.Module
    report: dict


def _texts(calib) -> list[str] | None:
    if calib is None:
        return None
    texts = [calib] if isinstance(calib, str) else list(calib)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise UserError("calib must be a list of calibration documents (strings)")
    return texts


def prune(model, tokenizer, config: PruneConfig | None = None, calib=None, *, out: str | Path | None = None,
          observer: Callable[[StepReport], None] | None = None, log: Callable[[str], None] | None = None,
          progress: bool = False) -> PruneResult:
    """Prune `model` (a transformers causal LM held in memory) by `config` (PruneConfig(); its `model` field only
    names the run), calibrating on `calib` (a list of documents; None: the config's --calib data) and evaluating on
    the config's evaluation data. `observer` sees each step's report; `log` each progress line (default: none).
    With `out`, the run also writes its folder there, as `python -m engine prune --out OUT` does."""
    from .export import load_mask_artifact
    from .loading import load_model, resolve_model
    from .pruner import PruneRun
    from .rundir import MODEL_DIR

    config = PruneConfig() if config is None else config
    run = PruneRun(config, out, model=model, tokenizer=tokenizer, log=log or (lambda m: None), calib=_texts(calib))
    report = run.run(observer=observer, progress=progress)
    if out is None:
        masks, sliced = report.pop("masks"), report.pop("model")
    else:  # the run wrote its masks and sliced model; read them back
        _, masks, _ = load_mask_artifact(out)
        sliced, _ = load_model(resolve_model(str(Path(out) / MODEL_DIR)), config.dtype)
    return PruneResult(masks={u: m.bool() for u, m in masks.items()}, model=sliced, report=report)


def perplexity(model, tokenizer, config: PruneConfig | None = None) -> float:
    """The model's perplexity on the config's evaluation data (--eval-data, --eval-seqlen, --max-windows), as a run
    reports it: a sliced model here gives its run's `ppl_pruned`."""
    from .data import eval_windows, load_eval_text
    from .evaluate import perplexity as windows_perplexity

    config = PruneConfig() if config is None else config
    text, _ = load_eval_text(config.eval_data)
    windows = eval_windows(tokenizer, text, config.eval_seqlen, config.max_windows)
    device = next(model.parameters()).device
    return windows_perplexity(model, windows.to(device), config.eval_batch_size)
