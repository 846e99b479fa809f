"""A run's plan before it starts: the parameters it will remove, its time, its peak memory and the pruned model's
speed-up, from the model's config alone (the model is built on the meta device: no weights are read).

The parameters come from the engine's own accounting: the budget of the run (engine/budget.py's BUDGETS) cuts
hard masks from the scores every unit starts from before the init metric tells them apart (each type at its
share of the budget), and `removal_report` counts them as a finished run's results do. So the total is what the
run removes, up to one unit (a parameter budget keeps the most likely units while they fit, landing under the
budget by less than one unit's weight); the split between unit types is where the run starts, and a method that
learns moves it.

Time is an estimate: forward passes counted in tokens, times the seconds one token's forward takes on this
machine (measured by `probe_seconds_per_token`, or read off the earlier runs of the same model); memory too.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

from .errors import UserError

WIKITEXT2_TEST_TOKENS = 300_000  # WikiText-2 raw test, about 2,370 windows of 128 tokens for SmolLM2's tokenizer
LONG_RUN_SECONDS = 600.0  # the app asks before it starts a run estimated longer than this
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_PROCESS_BYTES = 0.45e9  # python, torch and transformers before any model
_PROBE_FILE = "forward-speed.json"
DATA_AND_EXPORT_SECONDS = 5.0  # reading and tokenising the data, writing the export: about 5 s on this machine


# --- the model, without its weights -------------------------------------------------------------------------
@dataclass(frozen=True)
class Skeleton:
    """A model built on the meta device (shapes, no weights) and what the accounting needs of it."""

    name: str
    adapter: object  # engine.arch.ModelAdapter over the meta model
    params_total: int  # the whole model, tied embeddings once
    head_params: int  # the LM head's matrix: compute per token outside the decoder
    vocab_size: int
    hidden_size: int
    source_kind: str  # "gguf", "folder" or "hub"

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers


def skeleton_of(model, name: str = "", source_kind: str = "folder") -> Skeleton:
    """The skeleton of a model in memory (meta or real: only shapes are read)."""
    from .arch import ModelAdapter
    from .loading import count_parameters

    adapter = ModelAdapter.for_model(model)
    head = adapter.lm_head().weight
    return Skeleton(name=name, adapter=adapter, params_total=count_parameters(model), head_params=head.numel(),
                    vocab_size=head.shape[0], hidden_size=head.shape[1], source_kind=source_kind)


@functools.lru_cache(maxsize=8)
def model_skeleton(model: str) -> Skeleton:
    """The skeleton of a model by name (the packaged default, a folder, a .gguf file): its config read (a GGUF's
    metadata, config.json) and the model built on the meta device. UserError when it cannot be read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from . import register_pruned_classes
    from .loading import check_before_load, resolve_model

    source = resolve_model(model)
    check_before_load(source)
    register_pruned_classes()
    kind = "gguf" if source.gguf_file else ("folder" if Path(source.path).is_dir() else "hub")
    try:
        config = AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file, trust_remote_code=False)
        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(config)
    except Exception as e:  # noqa: BLE001  (a hub id offline, a config transformers refuses: one line)
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        raise UserError(f"cannot read the config of {model}: {first}") from None
    return skeleton_of(meta, model, kind)


# --- what the run removes -----------------------------------------------------------------------------------
@dataclass
class RemovalPlan:
    params_removed: int
    params_decoder: int
    params_total: int
    by_type: dict[str, int]  # where the run starts; a method that learns moves the split (split_learned)
    layers_removed: int
    tolerance: int  # the run may remove up to this many more (one unit: the budget is never exceeded)
    split_learned: bool  # the split between unit types is learned during the run
    exact: bool  # the total is known before the run (False: layers and widths under --budget units overlap)
    split_from_metric: bool = False  # the init metric ranks the unit types together (FLAP) and so sets the split

    @property
    def removed_of_decoder(self) -> float:
        return self.params_removed / self.params_decoder

    @property
    def removed_of_model(self) -> float:
        return self.params_removed / self.params_total


def _start_scores(budget, layout, unit_types: list[str], keep: float) -> dict:
    """Every unit of a type at that type's share of the budget: the scores before the init metric tells the
    units apart (ties broken by position, as a hard mask breaks them)."""
    import torch

    if hasattr(budget, "widths"):  # the parameter budget: each width type at its share
        widths = budget.widths
        keeps = budget.type_keeps(keep) if widths else {}
        if budget.layer_type:
            keeps[budget.layer_type] = 1.0 if widths else keep
    else:
        keeps = budget.type_keeps(keep)
    return {u: torch.full((layout.total(u),), float(keeps[u]), dtype=torch.float64) for u in unit_types}


def plan_removal(skeleton: Skeleton, units: list[str], prune_ratio: float, budget: str = "params",
                 scope: str = "global", init: str | None = None) -> RemovalPlan:
    """The parameters a run with these settings removes, counted by engine/budget.py's accounting. Bad settings
    are UserErrors with the run's own messages (the budget's checks run here too). by_type gives each width type
    the same share of its parameters; an init metric whose scores compare across unit types (FLAP's adaptive
    structure) splits them by its ranking instead, which the data decide (split_from_metric)."""
    from .metrics import METRICS
    from .budget import BUDGETS, removal_report, unit_weights
    from .policy import keep_count
    from .unit_types import UNIT_TYPES, unit_sizes
    from .units import SCOPES, UnitLayout

    if not 0.0 < prune_ratio < 1.0:
        raise UserError(f"prune ratio must be strictly between 0 and 1, got {prune_ratio}")
    if not units or any(u not in UNIT_TYPES for u in units):
        raise UserError(f"units must be a comma list of {', '.join(UNIT_TYPES)}, got {','.join(units) or 'nothing'}")
    if budget not in BUDGETS or scope not in SCOPES:
        raise UserError(f"unknown budget {budget!r} or scope {scope!r}")
    a, keep = skeleton.adapter, 1.0 - prune_ratio
    sizes = unit_sizes(a)
    layout = UnitLayout({u: sizes[u] for u in units})
    b = BUDGETS[budget](layout, scope, a)
    masks = b.hard_masks(_start_scores(b, layout, units, keep), keep)
    report = removal_report(a, layout, masks, skeleton.params_total)
    whole = [u for u in units if UNIT_TYPES[u].whole_layer]
    widths = [u for u in units if not UNIT_TYPES[u].whole_layer]
    weights = unit_weights(a, layout)
    tolerance = 0 if budget == "units" else int(min(float(w.min()) for w in weights.values()))
    if budget == "params" and whole and not widths:
        tolerance = 0  # equal layers: the count of layers that fit is fixed
    layers_removed = report["layers_removed"]
    if whole and budget == "units":
        layers_removed = a.num_layers - keep_count(keep, a.num_layers)
    return RemovalPlan(params_removed=report["params_removed"], params_decoder=report["params_decoder"],
                       params_total=skeleton.params_total, by_type=report["params_removed_by_unit_type"],
                       layers_removed=layers_removed, tolerance=tolerance,
                       split_learned=budget == "params" and len(units) > 1 and scope == "global",
                       split_from_metric=bool(budget == "params" and len(widths) > 1 and init in METRICS
                                              and METRICS[init].comparable),
                       exact=not (budget == "units" and whole and widths))


def speedup(skeleton: Skeleton, params_removed: int) -> float:
    """The pruned model's expected speed-up per token: the matrix parameters a token's forward multiplies (the
    decoder's and the LM head's; attention over the context is left out), dense over pruned."""
    from .budget import decoder_params

    dense = decoder_params(skeleton.adapter) + skeleton.head_params
    return dense / max(dense - params_removed, 1)


# --- time ---------------------------------------------------------------------------------------------------
def _sleb_forwards(b: int, n: int, m: int, config) -> int:
    """Per removal, once per layer left (or, with --sleb-finalists, per finalist on most batches)."""
    from .metrics.sleb import sleb_runs

    return sleb_runs(n, b, 0, m, config.sleb_finalists)


# forward passes of a (batch x seqlen) calibration batch an init metric costs: (batches, layers, layers removed,
# the run's config)
_METRIC_FORWARDS = {
    "taylor": lambda b, n, m, c: 3 * b,  # a forward and a backward (about two forwards) per batch
    "wanda-sp": lambda b, n, m, c: b, "flap": lambda b, n, m, c: b,
    "magnitude-sp": lambda b, n, m, c: 0, "random": lambda b, n, m, c: 0, "random-progressive": lambda b, n, m, c: 0,
    "layerwise-ppl": lambda b, n, m, c: n * b,  # the model once per layer removed alone
    "block-influence": lambda b, n, m, c: b,  # one decoder forward per batch
    "sleb": _sleb_forwards,
}


@dataclass
class TimePlan:
    phases: dict[str, float]  # phase -> seconds
    seconds_per_token: float
    rate_source: str  # how the rate was measured, for the label
    dense_cached: bool = False

    @property
    def total(self) -> float:
        return sum(self.phases.values())


def phase_tokens(config, skeleton: Skeleton) -> dict[str, float]:
    """Tokens put through the model (forward-equivalent) by each phase of a run with this PruneConfig."""
    from .joint import MIX_FINALISTS, mix_candidates
    from .methods import METHODS
    from .policy import keep_count

    batch = config.batch_size * config.seqlen
    n, keep = skeleton.num_layers, 1.0 - config.prune_ratio
    removals = n - keep_count(keep, n)
    windows = config.max_windows or WIKITEXT2_TEST_TOKENS // config.eval_seqlen
    evaluation = windows * config.eval_seqlen
    cost = _METRIC_FORWARDS.get(config.init, lambda b, n, m, c: b)
    out = {"init metric": cost(config.init_batches, n, removals, config) * batch}
    if "layers" in config.units:
        layer_cost = _METRIC_FORWARDS.get(config.layer_init, lambda b, n, m, c: n * b)
        out["layer metric"] = layer_cost(config.layer_init_batches, n, removals, config) * batch
        if len(config.units) > 1:
            scored = mix_candidates(removals + 1, config.mix_search, MIX_FINALISTS if config.mix_refine_batches else 1)
            out["joint mix"] = config.mix_batches * scored * batch
            out["joint mix"] += config.mix_refine_batches * min(MIX_FINALISTS, removals + 1) * batch
    out["dense perplexity"] = evaluation
    if config.evaluates_init:
        out["init perplexity"] = evaluation
    optimises = METHODS[config.method].optimises if config.method in METHODS else True
    if optimises:
        out["steps"] = config.steps * config.num_mask_samples * batch
        if config.val_every > 0:
            out["validation"] = (config.steps // config.val_every + 1) * config.val_batches * batch
    out["pruned perplexity"] = evaluation
    return out


def load_seconds(skeleton: Skeleton, dtype: str = "float32") -> float:
    """Loading the weights: a GGUF is dequantised by transformers (about 25 s for SmolLM2-135M's 135 M
    parameters on this machine's cores) unless the cache holds its de-quantised copy (engine/model_cache.py);
    a safetensors folder reads at disk speed."""
    per_param = 1.9e-7 if skeleton.source_kind == "gguf" and not gguf_copied(skeleton.name, dtype) else 1e-8
    return 1.0 + skeleton.params_total * per_param


def gguf_copied(model: str, dtype: str) -> bool:
    """Does the cache hold the de-quantised copy of this GGUF model in this dtype?"""
    from . import model_cache
    from .loading import resolve_model

    try:
        source = resolve_model(model)
    except UserError:
        return False
    return bool(source.gguf_file) and model_cache.has_copy(model_cache.copy_folder(source.path, source.gguf_file, dtype))


def plan_time(config, skeleton: Skeleton, seconds_per_token: float, rate_source: str,
              dense_cached: bool = False) -> TimePlan:
    """Seconds of each phase: its tokens (phase_tokens) times the measured seconds per token, plus loading."""
    phases = {"loading": load_seconds(skeleton, config.dtype), "data and export": DATA_AND_EXPORT_SECONDS}
    for phase, tokens in phase_tokens(config, skeleton).items():
        if phase == "dense perplexity" and dense_cached:
            continue
        phases[phase] = tokens * seconds_per_token
    return TimePlan(phases, seconds_per_token, rate_source, dense_cached)


def rate_from_runs(runs: list[tuple[dict, dict]], model: str, dtype: str) -> tuple[float, int] | None:
    """(seconds per token of a masked forward, runs it is read from) off earlier finished runs of the same model
    and dtype: each run's seconds per step over the tokens one step forwards (N_s x batch x seqlen); the median.
    runs: (config, results) pairs. None when there are none."""
    rates = []
    for cfg, res in runs:
        if cfg.get("model") != model or cfg.get("dtype", "float32") != dtype or not res:
            continue
        sps, ns = res.get("seconds_per_step"), cfg.get("num_mask_samples")
        if not sps or not ns or not res.get("steps"):
            continue
        rates.append(sps / (ns * cfg.get("batch_size", 8) * cfg.get("seqlen", 128)))
    if not rates:
        return None
    rates.sort()
    return rates[len(rates) // 2], len(rates)


def probe_key(model: str, dtype: str, batch_size: int, seqlen: int) -> str:
    import torch

    return f"{model}|{dtype}|{batch_size}x{seqlen}|{torch.get_num_threads()} threads"


def cached_probe(cache: Path | None, key: str) -> float | None:
    """A probe's seconds per token from the cache file in folder `cache`, or None."""
    if cache is None:
        return None
    try:
        value = json.loads((cache / _PROBE_FILE).read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) and value > 0 else None


def probe_seconds_per_token(skeleton: Skeleton, dtype: str, batch_size: int, seqlen: int, cache: Path | None = None,
                            repeats: int = 2) -> float:
    """Seconds per token of a dense forward on this machine: the model built from its config with random
    weights (no file is read), one (batch x seqlen) forward to warm up, then the best of `repeats`. Cached in
    `cache` (a folder) under the model, dtype, batch shape and thread count."""
    import torch
    from transformers import AutoModelForCausalLM

    from .loading import DTYPES

    key = probe_key(skeleton.name, dtype, batch_size, seqlen)
    if (hit := cached_probe(cache, key)) is not None:
        return hit
    model = AutoModelForCausalLM.from_config(skeleton.adapter.config, dtype=DTYPES[dtype]).eval()
    ids = torch.randint(0, skeleton.vocab_size, (batch_size, seqlen))
    best = math.inf
    with torch.no_grad():
        for i in range(repeats + 1):
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            if i:
                best = min(best, time.perf_counter() - t)
    del model
    rate = best / (batch_size * seqlen)
    if cache is not None:
        from .io import atomic_write_text

        cache.mkdir(parents=True, exist_ok=True)
        try:
            table = json.loads((cache / _PROBE_FILE).read_text())
        except (OSError, ValueError):
            table = {}
        table = table if isinstance(table, dict) else {}
        table[key] = rate
        atomic_write_text(cache / _PROBE_FILE, json.dumps(table, indent=1) + "\n")
    return rate


# --- memory -------------------------------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    parts: dict[str, float] = field(default_factory=dict)  # bytes

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def plan_memory(config, skeleton: Skeleton) -> MemoryPlan:
    """Peak memory of a run, roughly: the process, the weights (a GGUF's quantised file is read beside them
    while it is dequantised), Taylor's gradients, and the largest activations of one forward (the logits of a
    batch, float32, with their log-softmax; the MLP's widest activations)."""
    weights = skeleton.params_total * _BYTES.get(config.dtype, 4)
    parts = {"process": _PROCESS_BYTES, "weights": weights}
    if skeleton.source_kind == "gguf":
        parts["loading a GGUF"] = weights
    if config.init == "taylor":
        parts["gradients (Taylor init)"] = weights
    tokens = max(config.batch_size * config.seqlen, config.eval_batch_size * config.eval_seqlen)
    inter = getattr(skeleton.adapter.config, "intermediate_size", 4 * skeleton.hidden_size)
    parts["activations"] = tokens * (2 * skeleton.vocab_size + 3 * inter) * 4
    return MemoryPlan(parts)
