"""What a first run of the default model would build once, built at install time (install.sh runs `python -m
engine.tools.model_copy`): the model's de-quantised copy (a first run then loads it in about a second instead of
de-quantising the GGUF: 25-40 s on 2 cores) and its dense perplexity on the default evaluation windows, in the
dtype a run evaluates in on this CPU (`--eval-dtype auto`; 25-30 s on 2 cores), where engine/storage/ppl_cache.py keeps it.
Both live in $PG_PRUNE_CACHE or ~/.cache/pg-prune."""

from __future__ import annotations

import sys
from pathlib import Path

from ..storage import model_cache
from ..errors import UserError
from ..model.loading import DEFAULT_MODEL, load_model, resolve_model


def build_default() -> Path | None:
    """The default model's copy, built now if it is missing; where it is, or None when the cache is off."""
    source = resolve_model(DEFAULT_MODEL)
    folder = model_cache.copy_folder(source.path, source.gguf_file, "float32") if source.gguf_file else None
    if folder is not None and not model_cache.has_copy(folder):
        load_model(source)  # (the first load writes the copy)
    return folder if model_cache.has_copy(folder) else None


def dense_perplexity(model: str = DEFAULT_MODEL, **settings) -> float | None:
    """The dense perplexity a default run of `model` evaluates (the settings' evaluation defaults: WikiText-2 raw
    test, 256 windows of 128 tokens, --eval-dtype auto; `settings` change them), taken from the cache or computed now
    and stored there with its seconds, as the run would store it; None when the cache is off."""
    from ..storage import ppl_cache
    from ..settings.config import PruneConfig
    from ..run.loop import PruneRun

    if ppl_cache.cache_dir() is None:
        return None
    run = PruneRun(PruneConfig(model=model, **settings), None, log=lambda m: None)  # (the defaults: not of()'s migration)
    key, cached, _ = run.res.masks.cached_dense()
    if key is None:
        return None
    return cached if cached is not None else run.res.masks.dense_perplexity()


def main() -> int:
    try:
        where = build_default()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not where:
        print("the model cache is off: no copy")
        return 0
    print(f"the default model's de-quantised copy: {where}")
    try:  # (a copy without the figure is still a copy: the first run evaluates the dense model itself)
        dense = dense_perplexity()
    except UserError as e:
        print(f"its dense perplexity was not cached ({e}); the first run evaluates it")
        return 0
    print(f"its dense perplexity on the default evaluation windows: {dense:.3f}, cached for the first run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
