"""The default model's de-quantised copy, built once (install.sh runs `python -m engine.tools.model_copy`): a first
run then loads the copy (about a second) instead of de-quantising the GGUF (about 25 s on 2 cores). The copy lives
where engine/model_cache.py keeps copies ($PG_PRUNE_CACHE or ~/.cache/pg-prune)."""

from __future__ import annotations

import sys
from pathlib import Path

from .. import model_cache
from ..errors import UserError
from ..loading import DEFAULT_MODEL, load_model, resolve_model


def build_default() -> Path | None:
    """The default model's copy, built now if it is missing; where it is, or None when the cache is off."""
    source = resolve_model(DEFAULT_MODEL)
    folder = model_cache.copy_folder(source.path, source.gguf_file, "float32") if source.gguf_file else None
    if folder is not None and not model_cache.has_copy(folder):
        load_model(source)  # (the first load writes the copy)
    return folder if model_cache.has_copy(folder) else None


def main() -> int:
    try:
        where = build_default()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"the default model's de-quantised copy: {where}" if where else "the model cache is off: no copy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
