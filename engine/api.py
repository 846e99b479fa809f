"""The engine from Python: prune a model you already hold, in memory (docs/api.md).

    from engine import PruneConfig, prune
    result = prune(model, tokenizer, PruneConfig(prune_ratio=0.3), calib=texts)
    result.masks, result.model, result.report

`prune` is the same run as `python -m engine prune` (engine.run.loop.PruneRun): without `out` it has no run folder,
so it writes nothing (no lock, checkpoint, metrics.jsonl, results.json or export) and cannot be resumed; with `out`
it is the command line's run, folder, checkpoints and export included, and its folder is checked as the command
line checks --out (engine/run/folder.py's check_out_dir: no model folder, no folder of the user's, an earlier run only
with overwrite=True).

Wrong objects (a model that is no causal LM, no tokenizer, a dict for the config, a tokenizer of another model) are
one UserError naming the argument, before any work (check_arguments).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from .settings.config import PruneConfig
from .errors import UserError
from .run.state import StepReport


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


def check_model(model) -> None:
    """A transformers causal LM (a PreTrainedModel with an LM head, as AutoModelForCausalLM gives), else one
    UserError naming `model`."""
    from transformers import PreTrainedModel

    if not isinstance(model, PreTrainedModel) or model.get_output_embeddings() is None:
        raise UserError(f"model must be a transformers causal LM (AutoModelForCausalLM.from_pretrained(...), with "
                        f"its LM head), got {type(model).__name__}")


def check_tokenizer(tokenizer) -> None:
    """A tokenizer (callable on a text, as transformers' are), else one UserError naming `tokenizer`."""
    if tokenizer is None or isinstance(tokenizer, (str, bytes, os.PathLike)) or not callable(tokenizer):
        raise UserError(f"tokenizer must be the model's transformers tokenizer (AutoTokenizer.from_pretrained(...)), "
                        f"got {type(tokenizer).__name__}")


def check_vocabulary(model, tokenizer) -> None:
    """The tokenizer's ids fit the model's input embedding (len(tokenizer) <= its rows; a model may have more rows
    than tokens, padded): a tokenizer of another model is one UserError naming `tokenizer`, not torch's IndexError
    at the first forward."""
    try:
        tokens = len(tokenizer)
    except TypeError:
        return  # (a tokenizer without a length: its ids are checked by the embedding itself)
    rows = model.get_input_embeddings().num_embeddings
    if tokens > rows:
        raise UserError(f"tokenizer has {tokens:,} tokens, more than the {rows:,} rows of the model's input embedding: "
                        "it is another model's tokenizer; pass the one the model was trained with")


def check_config(config) -> PruneConfig:
    """The run's PruneConfig (None: the default run, README command 1's: engine/settings/config.py's default_run), else
    one UserError naming `config`."""
    if config is None:
        from .settings.config import default_run

        return default_run()
    if not isinstance(config, PruneConfig):
        raise UserError(f"config must be an engine.PruneConfig (PruneConfig(prune_ratio=0.3, ...); a dict of settings: "
                        f"PruneConfig(**settings)), got {type(config).__name__}")
    from .algo.methods import METHODS

    method = METHODS.get(config.method)
    if method is not None and not method.optimises and config.steps != PruneConfig.steps:
        raise UserError(f"config: steps={config.steps} under method {config.method!r}, which takes no steps (the "
                        f"default: the one-shot init); give method='pg-alloc' (or another that optimises) to take them")
    return config


def out_path(out) -> Path | None:
    """`out` as a Path (None: a run in memory), else one UserError naming `out`."""
    if out is None:
        return None
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out):
        raise UserError(f"out must be a folder path (a str or pathlib.Path) or None, got {out!r} ({type(out).__name__})")
    return Path(os.fspath(out))


def check_arguments(model, tokenizer, config, calib, out) -> tuple[PruneConfig, list[str] | None, Path | None]:
    """prune's arguments checked, each wrong one a UserError naming it: (the config, the calibration texts, the
    run folder)."""
    check_model(model)
    check_tokenizer(tokenizer)
    check_vocabulary(model, tokenizer)
    return check_config(config), _texts(calib), out_path(out)


@contextlib.contextmanager
def _run_folder(out: Path | None, overwrite: bool):
    """The run folder checked as the command line's --out is (rundir.check_out_dir), created and locked for the
    block; a folder made for it is removed again when the run fails before its start (a refusal, a wrong setting).
    Yields a function that, once the model and the data are read, removes an earlier run's files (overwrite)."""
    from .storage.outdir import folder_lock
    from .run.folder import API_FLAGS, check_out_dir, cleanup_out_dir, prepare_out_dir

    if out is None:
        yield lambda: None
        return
    check_out_dir(out, False, overwrite, clear=False, flags=API_FLAGS)  # (before any work; nothing deleted yet)
    created, started = prepare_out_dir(out, "out"), []
    try:
        with folder_lock(out, what="prune into"):
            check_out_dir(out, False, overwrite, clear=False, flags=API_FLAGS)  # (again, now that nobody else writes)

            def start():
                check_out_dir(out, False, overwrite, flags=API_FLAGS)  # (overwrite: the earlier run's files go now)
                started.append(True)

            yield start
    except BaseException:
        if not started:
            cleanup_out_dir(created)
        raise


def prune(model, tokenizer, config: PruneConfig | None = None, calib=None, *, out: str | Path | None = None,
          overwrite: bool = False, observer: Callable[[StepReport], None] | None = None,
          log: Callable[[str], None] | None = None, progress: bool = False) -> PruneResult:
    """Prune `model` (a transformers causal LM held in memory) by `config` (None: the default run; its `model` field only
    names the run), calibrating on `calib` (a list of documents; None: the config's --calib data) and evaluating on
    the config's evaluation data. `observer` sees each step's report; `log` each progress line (default: none).
    With `out`, the run also writes its folder there, as `python -m engine prune --out OUT` does: a new or empty
    folder, or (overwrite=True, as --overwrite) an earlier run's, whose files it replaces."""
    from .export.artifacts import load_mask_artifact
    from .model.loading import load_model, resolve_model
    from .run.loop import PruneRun
    from .run.folder import MODEL_DIR

    config, texts, out = check_arguments(model, tokenizer, config, calib, out)
    with _run_folder(out, overwrite) as start:
        run = PruneRun(config, out, model=model, tokenizer=tokenizer, log=log or (lambda m: None), calib=texts)
        start()
        report = run.run(observer=observer, progress=progress)
    if out is None:
        masks, sliced = report.pop("masks"), report.pop("model")
    else:  # the run wrote its masks and sliced model; read them back
        _, masks, _ = load_mask_artifact(out)
        sliced, _ = load_model(resolve_model(str(out / MODEL_DIR)), config.dtype)
    return PruneResult(masks={u: m.bool() for u, m in masks.items()}, model=sliced, report=report)


def perplexity(model, tokenizer, config: PruneConfig | None = None) -> float:
    """The model's perplexity on the config's evaluation data (--eval-data, --eval-seqlen, --max-windows), as a run
    reports it: a sliced model here gives its run's `ppl_pruned`."""
    from .data.text import eval_windows, load_eval_text
    from .algo.evaluate import perplexity as windows_perplexity

    check_model(model)
    check_tokenizer(tokenizer)
    check_vocabulary(model, tokenizer)
    config = check_config(config)
    text, _ = load_eval_text(config.eval_data)
    windows = eval_windows(tokenizer, text, config.eval_seqlen, config.max_windows)
    device = next(model.parameters()).device
    return windows_perplexity(model, windows.to(device), config.eval_batch_size)
