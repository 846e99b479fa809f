"""What an export checks before it says "wrote": the copy of a model folder loads as far as its files
go, and a GGUF's tokenizer has the model's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError, shorten

WEIGHTS_SUFFIX = ".safetensors"


def model_folder_problem(folder: Path) -> str | None:
    """Why a transformers model folder would not load, or None: its config.json must parse as a JSON object, and it
    must hold safetensors weights whose every file has a header that parses and covers the file (safetensors'
    own reader checks both: a file cut short fails here, not at the first forward), and whose tensors are the ones,
    of the shapes, that the config's model has (weights_match_problem)."""
    from safetensors import safe_open

    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        return f"config.json cannot be read: {shorten(getattr(e, 'strerror', None) or str(e), 80)}"
    if not isinstance(config, dict):
        return f"config.json holds a {type(config).__name__}, not a model config"
    weights = sorted(folder.glob(f"*{WEIGHTS_SUFFIX}"))
    if not weights:
        return f"it holds no {WEIGHTS_SUFFIX} weights"
    found: dict[str, tuple[tuple[int, ...], str]] = {}  # tensor name -> (shape, file)
    for f in weights:
        try:
            with safe_open(str(f), framework="pt") as st:
                found |= {k: (tuple(st.get_slice(k).get_shape()), f.name) for k in st.keys()}
        except Exception as e:  # (safetensors' own error type: a damaged header, a file cut short)
            return f"{f.name} is damaged: {shorten(str(e), 100)}"
    return weights_match_problem(folder, found)


def expected_weights(folder: Path) -> tuple[dict[str, tuple[int, ...]], list[set[str]]]:
    """The tensors the model that config.json describes holds: {name: shape}, and the groups of names that share
    one tensor (tied embeddings: save_pretrained writes one of them). The model is built on the meta device:
    nothing is allocated."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from .. import register_pruned_classes

    register_pruned_classes()
    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    names: dict[int, set[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), set()).add(name)
    return shapes, [group for group in names.values() if len(group) > 1]


def weights_match_problem(folder: Path, found: dict[str, tuple[tuple[int, ...], str]]) -> str | None:
    """Why the weights `found` ({name: (shape, file)}) are not the model folder's config.json describes, or None:
    a tensor of another shape (transformers refuses to load it), a tensor missing (it would be filled with random
    values), or one the model has no place for (it would be dropped)."""
    try:
        shapes, shared = expected_weights(folder)
    except Exception as e:  # (transformers' own errors for a config it cannot build)
        return f"config.json does not describe a model transformers builds: {shorten(str(e), 100)}"
    for name, shape in shapes.items():
        if name in found and found[name][0] != shape:
            return (f"{found[name][1]} holds {name} of shape {list(found[name][0])}, config.json's model one of "
                    f"shape {list(shape)}")
    tied = {n for group in shared if group & found.keys() for n in group}  # (written once under one of its names)
    missing = [n for n in shapes if n not in found and n not in tied]
    files = ", ".join(sorted({f for _, f in found.values()})) or "its weights"
    if missing:
        return f"{files} lacks {len(missing)} tensor(s) config.json's model has, e.g. {missing[0]}"
    extra = [n for n in found if n not in shapes]
    if extra:
        return f"{files} holds {len(extra)} tensor(s) config.json's model has no place for, e.g. {extra[0]}"
    return None


def gguf_tokenizer_size(path: Path) -> int:
    """The number of tokens in a GGUF file's tokenizer (tokenizer.ggml.tokens); 0 without one."""
    from gguf import GGUFReader

    field = GGUFReader(str(path)).fields.get("tokenizer.ggml.tokens")
    return len(field.data) if field is not None else 0


def json_tokenizer_size(path: Path) -> int:
    """One more than the largest token id of a tokenizer.json (its model's vocabulary and its added tokens)."""
    t = json.loads(Path(path).read_text(encoding="utf-8"))
    ids = list(((t.get("model") or {}).get("vocab") or {}).values()) + [a.get("id", 0) for a in t.get("added_tokens") or []]
    return max(ids, default=-1) + 1


def check_tokenizer_fits(rows: int, tokenizer_gguf: Path | None, tokenizer_json: Path | None) -> None:
    """A GGUF's tokenizer must be the model's: a base GGUF's token list as long as the embedding's rows (llama.cpp
    reads one token per row), a tokenizer.json's ids all below it (the list is padded to the rows). Refused in one
    line otherwise: a config.json whose model was edited to another model would give a file that cannot run."""
    if tokenizer_gguf is not None:
        n, source = gguf_tokenizer_size(tokenizer_gguf), tokenizer_gguf
        fits = n == rows
    elif tokenizer_json is not None:
        n, source = json_tokenizer_size(tokenizer_json), tokenizer_json
        fits = n <= rows
    else:
        return
    if not fits:
        raise UserError(f"the tokenizer of {source} has {n:,} tokens, the model's embedding {rows:,} rows: it is "
                        "another model's tokenizer (was the run's config.json edited?); no GGUF was written")
