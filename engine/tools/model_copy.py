"""What a first run of the default model would build once, built at install time (install.sh runs `python -m
engine.tools.model_copy`): the model's de-quantised copy (a first run then loads it in about a second instead of
de-quantising the GGUF: 25-40 s on 2 cores), its dense perplexity on the default evaluation windows, in the
dtype a run evaluates in on this CPU (`--eval-dtype auto`; 25-30 s on 2 cores), where engine/storage/ppl_cache.py
keeps it, and this machine's forward-speed probes that a --time-budget plan reads (engine/run/plan.py's run_rate: the
float32 forward's and the one-shot passes' dtype; about 12 s of a first run on 2 cores, which then times one forward
a dtype against them). All live in $PG_PRUNE_CACHE or ~/.cache/pg-prune."""

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


def default_run_of(model: str = DEFAULT_MODEL, **settings):
    """A run of `model` with the settings' defaults (`settings` change them), loaded but not started."""
    from ..settings.config import PruneConfig
    from ..run.loop import PruneRun

    return PruneRun(PruneConfig(model=model, **settings), None, log=lambda m: None)  # (the defaults: not of()'s migration)


def dense_perplexity(model: str = DEFAULT_MODEL, run=None, **settings) -> float | None:
    """The dense perplexity a default run of `model` evaluates (the settings' evaluation defaults: WikiText-2 raw
    test, 256 windows of 128 tokens, --eval-dtype auto; `settings` change them), taken from the cache or computed now
    and stored there with its seconds, as the run would store it; None when the cache is off. run: default_run_of's,
    made already."""
    from ..storage import ppl_cache

    if ppl_cache.cache_dir() is None:
        return None
    run = run or default_run_of(model, **settings)
    key, cached, _ = run.res.masks.cached_dense()
    if key is None:
        return None
    return cached if cached is not None else run.res.masks.dense_perplexity()


def speed_probes(model: str = DEFAULT_MODEL, run=None, **settings) -> dict[str, float]:
    """The forward-speed probes a --time-budget run of `model` plans with (engine/run/plan.py's run_rate: its float32
    forward's and, where they differ, its one-shot passes' dtype), cached now where the run reads them: {dtype:
    seconds per token}; {} when the cache is off. run: default_run_of's, made already."""
    from ..plan.forecast import pass_dtype_of, skeleton_of
    from ..run.plan import run_rate
    from ..storage import ppl_cache

    if ppl_cache.cache_dir() is None:
        return {}
    run = run or default_run_of(model, **settings)
    res, c = run.res, run.res.config
    skeleton = skeleton_of(res.model, c.model, "gguf" if res.source.gguf_file else "folder")
    rates = {c.dtype: run_rate(res, skeleton)[0]}
    if (passes := pass_dtype_of(c)) is not None:
        rates[passes] = run_rate(res, skeleton, passes)[0]
    return rates


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
        run = default_run_of()
        dense = dense_perplexity(run=run)
    except UserError as e:
        print(f"its dense perplexity was not cached ({e}); the first run evaluates it")
        return 0
    print(f"its dense perplexity on the default evaluation windows: {dense:.3f}, cached for the first run")
    rates = speed_probes(run=run)
    print("this machine's forward speed, cached for the first run's plan: " + ", ".join(
        f"{dtype} {seconds * 1e3:.2f} ms a token" for dtype, seconds in rates.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
