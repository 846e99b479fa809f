"""What an export checks before it says "wrote" (issue 48): the copy of a model folder loads as far as its files
go, and a GGUF's tokenizer has the model's vocabulary."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import UserError, shorten

WEIGHTS_SUFFIX = ".safetensors"


def model_folder_problem(folder: Path) -> str | None:
    """Why a transformers model folder would not load, or None: its config.json must parse as a JSON object, and it
    must hold safetensors weights whose every file has a header that parses and covers the file (safetensors'
    own reader checks both: a file cut short fails here, not at the first forward)."""
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
    for f in weights:
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except Exception as e:  # (safetensors' own error type: a damaged header, a file cut short)
            return f"{f.name} is damaged: {shorten(str(e), 100)}"
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
