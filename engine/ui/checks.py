"""What the app checks before it trusts its environment and the files on disk (pure; no Streamlit here).

    runs_dir_problem(path)      # None, or one line: the runs folder is a file, cannot be made, is not writable
    results_problem(results)    # None, or why a results.json cannot be shown (the run is listed as damaged)
    config_problem(config)      # the same for a run's config.json
    rate_bounds(value)          # the pruning-rate slider's bounds: never 0 or 1
"""

from __future__ import annotations

import math
import os
import tempfile
from numbers import Real
from pathlib import Path

RATE_MIN, RATE_MAX = 0.05, 0.95  # the slider's range at its step of 0.05 (a rate of 0 or 1 prunes nothing or all)


def runs_dir_problem(path: str | Path) -> str | None:
    """None when the runs folder is a folder the app can write (made when missing), else what is wrong, in one
    line that names the folder and $PG_PRUNE_RUNS_DIR."""
    from .paths import RUNS_DIR_ENV

    p = Path(path)
    fix = f"set ${RUNS_DIR_ENV} to a writable folder and restart the app"
    try:
        p.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        return f"the runs folder {p} is a file, not a folder: {fix}"
    except NotADirectoryError:
        return f"the runs folder {p} cannot be made: a part of its path is a file, not a folder: {fix}"
    except OSError as e:
        return f"the runs folder {p} cannot be made ({e.strerror or e}): {fix}"
    if not p.is_dir():
        return f"the runs folder {p} is a file, not a folder: {fix}"
    try:
        fd, probe = tempfile.mkstemp(dir=p, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return f"the runs folder {p} is not writable ({e.strerror or e}): runs and settings cannot be saved; {fix}"
    return None


def _number(x, nullable: bool = False) -> bool:
    if x is None:
        return nullable
    return isinstance(x, Real) and not isinstance(x, bool)


def _finite(x, nullable: bool = False) -> bool:
    """A number a page turns into an integer or a duration: NaN and infinity cannot be."""
    return _number(x, nullable) and (x is None or math.isfinite(x))


# what the pages read of a results.json, and the types they need
_NUMBERS = ("ppl_dense", "ppl_init", "ppl_pruned", "params_dense", "params_pruned")  # required
_REQUIRED_NULLABLE = ("ppl_init",)  # (null: not evaluated, --time-budget without --eval-init)
_OPTIONAL_NUMBERS = ("params_removed", "removed_of_decoder", "removed_of_model", "layers_removed",
                     "width_removed_of_kept_layers", "peak_rss_mb", "seconds_per_step", "seconds_in_steps", "steps",
                     "prune_ratio", "lr", "eval_windows", "seqlen")
_NULLABLE_NUMBERS = ("mask_step", "val_ppl_init", "time_budget", "stopped_early")
_FINITE = ("params_dense", "params_pruned", "params_removed", "peak_rss_mb")  # (counted, or shown as integers)
_DURATION_MAPS = ("seconds_by_phase", "plan_seconds_by_phase")  # phase -> seconds, with the "total"
_STRING_KEYS = ("final_mask", "model", "method", "init", "scope", "budget")


def results_problem(results) -> str | None:
    """None when a results.json's content is what a finished run writes, as far as the pages read it; else
    why not, in a few words (its key and what it holds)."""
    if not isinstance(results, dict):
        return f"holds a {type(results).__name__}, not an object"
    if results.get("status") != "done":
        return f"status is {results.get('status')!r}, not 'done'"
    for k in _NUMBERS:
        if k not in results:
            return f"no {k}"
        if not _number(results[k], nullable=k in _REQUIRED_NULLABLE):
            return f"{k} is {results[k]!r}, not a number"
    for k in _OPTIONAL_NUMBERS:
        if k in results and not _number(results[k]):
            return f"{k} is {results[k]!r}, not a number"
    for k in _NULLABLE_NUMBERS:
        if k in results and not _number(results[k], nullable=True):
            return f"{k} is {results[k]!r}, not a number"
    best = results.get("best_val")  # {metric, value} or None
    if best is not None and not (isinstance(best, dict) and isinstance(best.get("metric"), str)
                                 and _number(best.get("value"))):
        return f"best_val is {best!r}, not a {{metric, value}} record"
    for k in _FINITE:
        if k in results and not _finite(results[k]):
            return f"{k} is {results[k]!r}, not a finite number"
    for k in _STRING_KEYS:
        if results.get(k) is not None and not isinstance(results[k], str):
            return f"{k} is {results[k]!r}, not a string"
    if results["params_dense"] <= 0:
        return f"params_dense is {results['params_dense']}"
    if "params_removed" in results and not all(_number(results.get(k))
                                               for k in ("removed_of_decoder", "removed_of_model")):
        return "params_removed without removed_of_decoder and removed_of_model"
    v = results.get("params_removed_by_unit_type", {})  # (a run from before it has none; null is not a map)
    if not (isinstance(v, dict) and all(_finite(x) for x in v.values())):
        return "params_removed_by_unit_type is not a map of numbers"
    for k in _DURATION_MAPS:
        v = results.get(k)
        if v is not None and not (isinstance(v, dict) and all(_finite(x) and x >= 0 for x in v.values())
                                  and "total" in v):
            return f"{k} is not a map of seconds with a total"
    if (why := _reduced_problem(results.get("reduced"))) is not None:
        return why
    kept, sizes = results.get("kept_per_layer"), results.get("units_per_layer")
    if kept is not None or sizes is not None:
        if not isinstance(kept, dict) or not isinstance(sizes, dict):
            return "kept_per_layer and units_per_layer are not both maps"
        for u, rows in kept.items():
            n = sizes.get(u)
            if not isinstance(rows, list) or not isinstance(n, list) or len(rows) != len(n):
                return f"kept_per_layer[{u!r}] does not fit units_per_layer"
            if not all(_number(k) and _number(m) and 0 <= k <= m and m > 0 for k, m in zip(rows, n)):
                return f"kept_per_layer[{u!r}] holds counts that are not between 0 and the layer's units"
    refit = results.get("reconstruction")
    if refit is not None:
        if not isinstance(refit, dict):
            return "reconstruction is not an object"
        if refit.get("skipped") is not None:
            if not isinstance(refit["skipped"], str):
                return f"reconstruction.skipped is {refit['skipped']!r}, not a reason"
        elif refit:  # a refit made: shown as "PPL with the mask alone, ... (N batches)"
            for k in ("ppl_before", "batches"):  # (ppl_before: only with --eval-unrefit)
                if (k in refit or k == "batches") and not _number(refit.get(k)):
                    return f"reconstruction.{k} is {refit.get(k)!r}, not a number"
    return None


def _reduced_problem(reduced) -> str | None:
    """results.json's "reduced" ({setting: [asked, used], "why": reason}, engine/run/results.py's reduced_line)."""
    if reduced is None:
        return None
    if not isinstance(reduced, dict):
        return "reduced is not an object"
    if not isinstance(reduced.get("why", ""), str):
        return "reduced.why is not a reason"
    for k, v in reduced.items():
        if k != "why" and not (isinstance(v, list) and len(v) == 2):
            return f"reduced.{k} is {v!r}, not [asked, used]"
    return None


def config_problem(config) -> str | None:
    """None when a config.json holds what the pages read of a run's settings with their types; else why not."""
    if not isinstance(config, dict):
        return f"holds a {type(config).__name__}, not an object"
    # (a key may be missing, as in a run from before it; one that is there has its type: null is not a value)
    for k in ("prune_ratio", "steps"):
        if k in config and not _finite(config[k]):
            return f"{k} is {config[k]!r}, not a number"
    for k in ("model", "scope", "budget", "method", "init", "dtype"):
        if k in config and not isinstance(config[k], str):
            return f"{k} is {config[k]!r}, not a string"
    units = config.get("units", [])
    if not (isinstance(units, list) and all(isinstance(u, str) for u in units)):
        return f"units is {units!r}, not a list of names"
    return None


def rate_bounds(value) -> tuple[float, float, float]:
    """(min, max, value) of the pruning-rate slider: RATE_MIN..RATE_MAX, widened to hold a loaded run's rate
    inside (0, 1); a rate of 0 or 1 (or none) is moved to the nearest bound."""
    v = float(value) if _number(value) and math.isfinite(value) else 0.3
    lo, hi = (min(RATE_MIN, v) if v > 0 else RATE_MIN), (max(RATE_MAX, v) if v < 1 else RATE_MAX)
    return lo, hi, min(max(v, lo), hi)
