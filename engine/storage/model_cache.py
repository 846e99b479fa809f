"""A de-quantised copy of a GGUF model, kept in the cache (loading the default model's Q4_1
GGUF de-quantises it in Python, about 25 s a run on 2 cores; the copy loads in about a second).

The first load of a GGUF file writes the loaded model and its tokenizer as plain safetensors into
$PG_PRUNE_CACHE (or ~/.cache/pg-prune)/models/<key>, where the key is the file's fingerprint (path, size,
modification time) and the dtype: a changed file is a new key. Only models up to MAX_BYTES are copied, and
only while the disk keeps twice their size free. The copy is written to a temporary folder and renamed into
place, so a reader never sees half of one; a copy that cannot be read is ignored (the GGUF is loaded again and
the copy written anew). PG_PRUNE_CACHE=off turns it off, with the dense-perplexity cache."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from .ppl_cache import cache_dir, model_fingerprint

MAX_BYTES = 2 * 1024 ** 3  # a larger model's copy would cost more disk than its de-quantisation costs time
DONE = "pg-prune-copy.json"  # written last: a folder without it is not a copy


def copy_folder(path: str, gguf_file: str, dtype: str) -> Path | None:
    """Where the copy of this GGUF (loaded in this dtype) lives; None when the cache is off or the file is
    not on this disk."""
    folder, fingerprint = cache_dir(), model_fingerprint(path, gguf_file)
    if folder is None or fingerprint is None:
        return None
    key = hashlib.sha1(json.dumps([fingerprint, dtype]).encode()).hexdigest()[:20]
    return folder / "models" / key


def has_copy(folder: Path | None) -> bool:
    return folder is not None and (folder / DONE).is_file() and (folder / "config.json").is_file()


def drop(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def write_copy(folder: Path, model, tokenizer, source_name: str) -> bool:
    """Save model and tokenizer as the copy in `folder`; False (nothing left behind) when it is too large,
    the disk too full, or the folder not writable."""
    size = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    tmp = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        if size > MAX_BYTES or shutil.disk_usage(folder.parent).free < 2 * size:
            return False
        drop(tmp)
        save_plain(model, tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / DONE).write_text(json.dumps({"source": source_name, "bytes": size}) + "\n")
        if folder.exists():
            drop(folder)  # an unreadable copy: replaced
        os.replace(tmp, folder)
        return True
    except (OSError, ValueError, RuntimeError, TypeError):  # (a cache that cannot be written never stops a load)
        drop(tmp)
        return False


def save_plain(model, folder: Path) -> None:
    """config.json, generation_config.json and model.safetensors of a model that transformers loaded from a GGUF
    (its save_pretrained refuses a GGUF-loaded model; the weights are plain tensors by then). A tied LM head
    is saved once and tied again on load, as the config says."""
    import copy

    from safetensors.torch import save_model

    folder.mkdir(parents=True)
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(folder)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(folder)
    save_model(model, str(folder / "model.safetensors"), metadata={"format": "pt"})

