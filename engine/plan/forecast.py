"""A run's plan before it starts: the parameters it will remove, its time, its peak memory and the pruned model's
speed-up, from the model's config alone (the model is built on the meta device: no weights are read).

The parameters come from the engine's own accounting: the budget of the run (engine/algo/budget.py's BUDGETS) cuts
hard masks from the scores every unit starts from before the init metric tells them apart (each type at its
share of the budget), and `removal_report` counts them as a finished run's results do. So the total is what the
run removes, up to one unit (a parameter budget keeps the most likely units while they fit, landing under the
budget by less than one unit's weight); the split between unit types is where the run starts, and a method that
learns moves it.

Time is an estimate of every phase a run records in results.json's `seconds_by_phase` (engine/run/phases.py), from
one cost model: each phase's model work counted in forward tokens (a dense forward's tokens, or what costs as
much: the refit's statistics and solves are counted in the layers' widths), times the seconds one token's forward
takes on this machine (measured by `probe_seconds_per_token`, or read off the earlier runs of the same model),
plus what is no forward (loading a GGUF or its cached copy, reading the data, writing the export). A run records
the plan it starts with (`plan_seconds_by_phase`); docs/app.md's "Plan against actual" shows both. Memory is an
estimate too.
"""

from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import dataclass, field, replace
from typing import ClassVar
from pathlib import Path

from ..errors import UserError

WIKITEXT2_TEST_TOKENS = 300_000  # WikiText-2 raw test, about 2,370 windows of 128 tokens for SmolLM2's tokenizer
LONG_RUN_SECONDS = 600.0  # the app asks before it starts a run estimated longer than this
_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_PROCESS_BYTES = 0.45e9  # python, torch and transformers before any model
_PROBE_FILE = "forward-speed.json"


# --- the model, without its weights -------------------------------------------------------------------------
@dataclass(frozen=True)
class Skeleton:
    """A model built on the meta device (shapes, no weights) and what the accounting needs of it."""

    name: str
    adapter: object  # engine.model.arch.ModelAdapter over the meta model
    params_total: int  # the whole model, tied embeddings once
    head_params: int  # the LM head's matrix: compute per token outside the decoder
    vocab_size: int
    hidden_size: int
    source_kind: str  # "gguf", "folder" or "hub"

    @property
    def num_layers(self) -> int:
        return self.adapter.num_layers

    @functools.cached_property
    def forward_macs(self) -> int:
        """Multiply-adds of one token's forward in the matrices: the decoder's and the LM head's."""
        from ..algo.budget import decoder_params

        return decoder_params(self.adapter) + self.head_params

    @property
    def decoder_share(self) -> float:
        """A forward without the LM head (the decoder alone) against a whole one."""
        return 1.0 - self.head_params / self.forward_macs


def skeleton_of(model, name: str = "", source_kind: str = "folder") -> Skeleton:
    """The skeleton of a model in memory (meta or real: only shapes are read)."""
    from ..model.arch import ModelAdapter
    from ..model.loading import count_parameters

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

    from .. import register_pruned_classes
    from ..model.loading import check_before_load, resolve_model

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
    """The parameters a run with these settings removes, counted by engine/algo/budget.py's accounting. Bad settings
    are UserErrors with the run's own messages (the budget's checks run here too). by_type gives each width type
    the same share of its parameters; an init metric whose scores compare across unit types (FLAP's adaptive
    structure) splits them by its ranking instead, which the data decide (split_from_metric)."""
    from ..algo.metrics import METRICS
    from ..algo.budget import BUDGETS, removal_report, unit_weights
    from ..algo.policy import keep_count
    from ..model.unit_types import UNIT_TYPES, unit_sizes
    from ..model.units import SCOPES, UnitLayout

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
    from ..algo.budget import decoder_params

    dense = decoder_params(skeleton.adapter) + skeleton.head_params
    return dense / max(dense - params_removed, 1)


# --- time: one cost model for every phase a run records ---------------------------------------------------
# The phases a run's results.json records (engine/run/phases.py's PhaseClock; "other" and "total" come after them),
# in the order a fresh run first enters them.
RUN_PHASES = ("load", "calibration text", "statistics", "init metric", "refit statistics", "joint mix", "validation", "refit",
              "evaluations", "steps", "export")
MIX_REFITS = "joint mix refits"  # phase_tokens' part of the joint mix that is solves, not passes (--mix-refit)
SCORED = " scoring"  # phase_tokens' "<phase> scoring": that phase's scores over the vocabulary (the loss's or
#                      the reward's softmax; float32 work, at the run's rate even where the passes are bfloat16)
FIXED = " fixed seconds"  # phase_tokens' "<phase> fixed seconds": seconds, not tokens (per batch a statistics
#                           pass reads, per projection a refit solves: what a small model's phases are made of)
PASS_PHASES = ("statistics", "init metric", "refit statistics", "joint mix")  # the one-shot passes (--pass-dtype)
# The constants of the cost model, few and fixed (not fitted per run); calibrated on the default model's
# 10-minute runs (bench/results/must_show/tb10-*) and on the tiny model's default run, 2 CPU cores:
DATA_SECONDS = 5.0  # reading and tokenising the calibration documents and WikiText-2 (about 6.5 M characters)
GENERATE_WEIGHT = 2.2  # a token of --calib-source self's sampling (32 sequences a step, a token each, with their
#                      KV cache) against one of a batched forward: 256 x 264 tokens took about 430 s at one thread
#                      beside another cell, whose forwards ran at 3 ms a token (2026-11-28, Zen 5)
# the sampling's speed-up over that (--self-batch, the resolved --self-dtype), measured on the default model: 128
# documents x 128 tokens, one thread beside another cell, AVX-512 BF16 (bench/self_text_speed.py, 2026-12-02); a
# pair not measured plans at 1 (the default's rate: an upper bound for a larger batch)
GENERATE_SPEEDUP = {(32, "float32"): 1.0, (32, "bfloat16"): 1.79, (128, "float32"): 1.59, (128, "bfloat16"): 3.26}
GRAM_WEIGHT = 1.15  # a multiply-add of the refit's statistics (x x^T and its float64 sums, in the hooks of the
#                    statistics pass) against one of a forward: the tiny model's pass measured 1.17 forwards a batch
STEP_SAMPLE_WEIGHT = 1.1  # a step's masked forward against a dense one, its reward's scoring apart: the default
#                           model's CE steps took 1.23x the probe with their CE (2.75 ms a token against 2.24,
#                           bench/results/must_show/default30), its KL steps 18.7 s for 8 x 1,024 tokens at
#                           1.48 ms (2026-11-28, with 4.0 s of the KL's softmax), the tiny model's 1.05x to 1.2x.
#                           A masked forward is planned at a dense one's cost otherwise: the
#                           sliced executor computes only the kept units but gathers their weights for every
#                           sample, and the LM head, attention and the softmax do not shrink
SOLVE_WEIGHT = 1.4  # ... of a refit's solves (float64), against one of a forward: the default run's 92 refits
#                    (88 of them --step-refit's) took 0.66 s each, 61.8 s (2 idle Zen 5 cores, 2026-11-28)
SOLVE_SECONDS = 0.6e-3  # a projection's solve, besides its multiply-adds: the tiny model's 1,628 took 1.4 s
PASS_BATCH_SECONDS = 5e-3  # a batch of a statistics pass, besides its forward: its hooks' Python (tiny model)
FINAL_MOVES = 0.5  # the chance that a learning run's final mask is not its init mask (best-val kept step 0 in
#                    about half of the measured 50-step runs): the unrefit final mask is evaluated only then
EXPORT_SECONDS, EXPORT_BYTES_PER_SECOND = 0.3, 330e6  # writing the sliced model's safetensors (the default
#                                                        model's 380 MB in 1.2-1.8 s)
GGUF_SECONDS_PER_PARAM, COPY_SECONDS_PER_PARAM = 1.9e-7, 1e-8  # de-quantising a GGUF; reading its cached copy


def _sleb_forwards(b: int, n: int, m: int, config, s: "Skeleton") -> float:
    """Per removal, once per layer left (or, with --sleb-finalists, per finalist on most batches)."""
    from ..algo.metrics.sleb import sleb_runs

    return sleb_runs(n, b, 0, m, config.sleb_finalists)


# Forwards (in whole-model forwards of one batch x seqlen calibration batch) an init metric costs:
# (batches, layers, layers removed, the run's config, the skeleton); `decoder_share` is a forward without the LM head
# (engine/algo/evaluate.py's decoder_forward, which the activation metrics run).
_METRIC_FORWARDS = {
    "taylor": lambda b, n, m, c, s: 3 * b,  # a forward and a backward (about two forwards) per batch
    "wanda-sp": lambda b, n, m, c, s: b * s.decoder_share, "flap": lambda b, n, m, c, s: b * s.decoder_share,
    "magnitude-sp": lambda b, n, m, c, s: 0, "random": lambda b, n, m, c, s: 0,
    "random-progressive": lambda b, n, m, c, s: 0,
    # once the decoder to record each layer's input, then per layer the layers after it and the LM head
    "layerwise-ppl": lambda b, n, m, c, s: b * (s.decoder_share + n * (s.decoder_share / 2 + 1 - s.decoder_share)),
    "block-influence": lambda b, n, m, c, s: b * s.decoder_share,
    "sleb": _sleb_forwards,
}


# Batches of one calibration forward each whose logits an init metric scores by the CE (the rest score nothing
# over the vocabulary, or, as Taylor's backward, are counted in their forwards).
_METRIC_SCORED = {
    "layerwise-ppl": lambda b, n, m, c, s: b * n, "sleb": _sleb_forwards, "taylor": lambda b, n, m, c, s: b,
}


def _reward(name: str):
    from ..algo.rewards import REWARDS

    return REWARDS.get(name) or REWARDS["ce"]


def scoring_tokens(skeleton: "Skeleton", tokens: float, reward: str = "ce", dense: bool = False) -> float:
    """Scoring `tokens` tokens by a reward (the CE: a loss; dense: the reward's dense target), in forward tokens
    at the float32 rate: the reward's score_heads (engine/algo/rewards.py) LM heads' multiply-adds a token."""
    r = _reward(reward)
    return tokens * (r.dense_heads if dense else r.score_heads) * skeleton.head_params / skeleton.forward_macs


@dataclass
class TimePlan:
    phases: dict[str, float]  # phase (RUN_PHASES' names) -> seconds
    seconds_per_token: float
    rate_source: str  # how the rate was measured, for the label
    dense_cached: bool = False
    steps_fit: float | None = None  # under --time-budget: the steps that fit what the rest leaves (fractional)

    @property
    def total(self) -> float:
        return sum(self.phases.values())

    def by_phase(self) -> dict[str, float]:
        """The plan in results.json's `seconds_by_phase` form: the phases, "other" (nothing planned there) and
        "total", in seconds to 0.1."""
        out = {k: round(v, 1) for k, v in self.phases.items()}
        return {**out, "other": 0.0, "total": round(self.total, 1)}


def _refit_applies(config) -> bool:
    from ..hooks.reconstruction import Reconstruction

    return Reconstruction.applies(config)


def _budget(config, skeleton: Skeleton):
    from ..algo.budget import BUDGETS
    from ..model.unit_types import unit_sizes
    from ..model.units import UnitLayout

    sizes = unit_sizes(skeleton.adapter)
    return BUDGETS[config.budget](UnitLayout({u: sizes[u] for u in config.units}), config.scope, skeleton.adapter)


def solve_seconds(config, skeleton: Skeleton, refits: float) -> float:
    """The fixed seconds of `refits` refits: SOLVE_SECONDS for each pruned output projection each solves."""
    return refits * len(_width_projections(config, skeleton)) * SOLVE_SECONDS


def _width_projections(config, skeleton: Skeleton):
    """(in_features, out_features) of the output projection of every width unit type the run prunes, per layer."""
    from ..model.unit_types import layer_unit_types

    a = skeleton.adapter
    return [(p.in_features, p.out_features) for t in layer_unit_types() if t.name in config.units
            for p in (t.output_proj(a, i) for i in range(a.num_layers))]


def refit_tokens(config, skeleton: Skeleton) -> float:
    """One refit's solves (engine/algo/reconstruction.py) in forward tokens: per pruned output projection (n inputs,
    k kept, r = n - k removed, o outputs) a float64 solve, k^3/3 + k^2 r multiply-adds, and the edit W_r A, o r k;
    at the budget's keep ratio in every layer, over a forward's multiply-adds per token, times SOLVE_WEIGHT."""
    keep, macs = 1.0 - config.prune_ratio, 0.0
    for n, o in _width_projections(config, skeleton):
        k = round(keep * n)
        macs += k ** 3 / 3 + k * k * (n - k) + o * (n - k) * k
    return SOLVE_WEIGHT * macs / skeleton.forward_macs


def validation_checks(config, done_steps: int | None = None) -> int:
    """Held-out checks a run makes (engine/hooks/validation.py): the init mask's (a fresh run: done_steps None),
    every --val-every steps and the last step's (a check of the same mask as the last one reuses it: the plan
    counts them all)."""
    if not config.validates:
        return 0
    steps = config.steps
    every = [s for s in range((done_steps or 0) + 1, steps + 1) if s % config.val_every == 0 or s == steps]
    return len(every) + (1 if done_steps is None else 0)


def phase_tokens(config, skeleton: Skeleton, dense_cached: bool = False, done_steps: int | None = None,
                 text_cached: bool = False) -> dict[str, float]:
    """Forward tokens (a dense forward's tokens, or what costs as much) of each phase of a run with this
    PruneConfig that is model work, under the names a run records (RUN_PHASES). done_steps: a resumed session,
    which starts from its checkpoint at that step (no init metric, no joint mix, no init evaluations); None: a
    fresh run. text_cached: the calibration source's generated text is in its cache (nothing to sample)."""
    from ..data.calib_sources import PHASE as TEXT_PHASE, generated_tokens
    from ..algo.joint import MIX_FINALISTS, layer_counts, mix_candidates, mix_reward_name
    from ..algo.methods import optimises as method_optimises

    batch = config.batch_size * config.seqlen
    n, keep = skeleton.num_layers, 1.0 - config.prune_ratio
    budget = _budget(config, skeleton)
    removals = n - budget_layers_kept(budget, keep, n)
    refit = _refit_applies(config)
    optimises = method_optimises(config)
    fresh = done_steps is None
    out: dict[str, float] = {}
    sampled = 0 if text_cached else generated_tokens(config)
    if sampled:
        from ..data.calib_sources import generation_dtype

        speedup = GENERATE_SPEEDUP.get((config.self_batch, generation_dtype(config)), 1.0)
        out[TEXT_PHASE] = sampled * GENERATE_WEIGHT / speedup
    phase, passes, metric_reads = statistics_plan(config, fresh)
    widths = any(u != "layers" for u in config.units)
    if fresh:
        cost = _METRIC_FORWARDS.get(config.init, lambda b, n, m, c, s: b)
        none = lambda b, n, m, c, s: 0  # noqa: E731
        forwards = cost(config.init_batches, n, removals, config, skeleton) if widths and not metric_reads else 0
        scored_batches = _METRIC_SCORED.get(config.init, none)(config.init_batches, n, removals, config, skeleton) if (
            widths and not metric_reads) else 0
        if "layers" in config.units:
            layer_cost = _METRIC_FORWARDS.get(config.layer_init, lambda b, n, m, c, s: n * b)
            forwards += layer_cost(config.layer_init_batches, n, removals, config, skeleton)
            scored_batches += _METRIC_SCORED.get(config.layer_init, none)(config.layer_init_batches, n, removals,
                                                                          config, skeleton)
        out["init metric"] = forwards * batch
        out["init metric" + SCORED] = scoring_tokens(skeleton, scored_batches * batch)
    if passes:  # the dense model's decoder per batch read, and x x^T of every pruned projection's input per token
        gram = sum(i * i for i, _ in _width_projections(config, skeleton)) if refit else 0
        out[phase] = batch * (passes * skeleton.decoder_share
                              + config.reconstruct_batches * GRAM_WEIGHT * gram / skeleton.forward_macs)
        out[phase + FIXED] = passes * PASS_BATCH_SECONDS
    refits = 1.0 if refit else 0.0  # the final mask's, for its evaluation and the export
    if fresh and getattr(budget, "nested", False):
        counts = len(layer_counts(budget.layer_params, budget.decoder - budget.kept_target(keep)))
        scored = mix_candidates(counts, config.mix_search, MIX_FINALISTS if config.mix_refine_batches else 1)
        mix_batches = config.mix_batches * scored + config.mix_refine_batches * min(MIX_FINALISTS, counts)
        mix = mix_reward_name(config)
        out["joint mix"] = batch * mix_batches
        out["joint mix" + SCORED] = scoring_tokens(skeleton, batch * mix_batches, mix)
        if _reward(mix).needs_dense:  # (its dense target on each batch it scores on, once)
            dense = batch * (config.mix_batches + config.mix_refine_batches)
            out["joint mix"] += dense
            out["joint mix" + SCORED] += scoring_tokens(skeleton, dense, mix, dense=True)
        if refit and config.mix_refit:  # (a refit per candidate: float64 solves in the mix's phase, at the steps' rate)
            out[MIX_REFITS] = scored * refit_tokens(config, skeleton)
            out["joint mix" + FIXED] = solve_seconds(config, skeleton, scored)
    checks = validation_checks(config, done_steps)
    if config.validates:
        reward = _reward(config.reward)
        held_out = checks * config.val_batches * batch  # (a check: a forward a batch, its CE and its reward)
        out["validation"] = held_out
        out["validation" + SCORED] = scoring_tokens(skeleton, held_out) + (
            scoring_tokens(skeleton, held_out, config.reward) if reward.own_held_out else 0.0)
        if reward.needs_dense and checks:  # (the held-out batches' dense target, once a session)
            out["validation"] += config.val_batches * batch
            out["validation" + SCORED] += scoring_tokens(skeleton, config.val_batches * batch, config.reward, True)
        if refit and config.val_refit:
            refits += checks
    per_step, refit_per_step = step_tokens(config, skeleton)
    left = max(config.steps - (done_steps or 0), 0)
    if refit:
        out["refit"] = refits * refit_tokens(config, skeleton) + left * refit_per_step
        out["refit" + FIXED] = solve_seconds(config, skeleton, refits + left * step_refits(config))
    windows = config.max_windows or WIKITEXT2_TEST_TOKENS // config.eval_seqlen
    moves = FINAL_MOVES if optimises else 0.0
    init = fresh and config.evaluates_init
    unrefit_final = moves if init else 1.0  # (the init mask's figure is reused unless the final mask moved)
    if refit and not config.eval_unrefit:  # (a refit run's final mask is evaluated refit only, unless asked)
        unrefit_final = 0.0
    evaluations = (0 if dense_cached or not fresh else 1) + init + unrefit_final + (1 if refit else 0)
    out["evaluations"] = evaluations * windows * config.eval_seqlen
    out["evaluations" + SCORED] = scoring_tokens(skeleton, out["evaluations"])
    out["steps"] = left * per_step
    return out


def step_refits(config) -> int:
    """Refits a step makes: one per mask sample under --step-refit (where the run refits at all), else none."""
    from ..algo.methods import optimises as method_optimises

    if not method_optimises(config):
        return 0
    return config.num_mask_samples if config.step_refit and _refit_applies(config) else 0


def step_tokens(config, skeleton: Skeleton) -> tuple[float, float]:
    """One step's forward tokens: (its N_s masked forwards, and the dense forward a reward that reads the dense
    model needs for the step's batch; its N_s refits under --step-refit, which a run records as refit). (0, 0) for
    a method that takes no steps."""
    from ..algo.methods import optimises as method_optimises

    if not method_optimises(config):
        return 0.0, 0.0
    batch = config.batch_size * config.seqlen
    samples = config.num_mask_samples * batch
    dense = batch if _reward(config.reward).needs_dense else 0.0
    scoring = scoring_tokens(skeleton, samples, config.reward) + (
        scoring_tokens(skeleton, dense, config.reward, dense=True) if dense else 0.0)
    return samples * STEP_SAMPLE_WEIGHT + dense + scoring, step_refits(config) * refit_tokens(config, skeleton)


def statistics_plan(config, fresh: bool = True) -> tuple[str, int, bool]:
    """(the phase the dense model's activation statistics are read in, the batches read there, whether the init
    metric's statistics are among them). With engine/algo/statistics.py's one pass (a metric that declares its
    `statistics`), a fresh run reads the init metric's (--init-batches), the bias compensation's means (the init
    batches) and the refit's moments (--reconstruct-batches, with --refit-stream init) in one pass over the
    longest, in "statistics"; a refit on a stream of its own, or a resumed run's, passes again. Before it, the
    refit read its moments alone, in "refit statistics"."""
    from ..hooks.compensation import BiasCompensation
    from ..algo.metrics import METRICS
    from ..algo.metrics.registry import Metric

    refit = _refit_applies(config)
    if not hasattr(Metric, "statistics"):  # (the refit's own pass)
        return "refit statistics", config.reconstruct_batches if refit else 0, False
    widths = any(u != "layers" for u in config.units)
    metric = METRICS.get(config.init)
    metric_reads = fresh and widths and bool(metric and metric.statistics)
    own = refit and (not fresh or getattr(config, "refit_stream", "own") != "init")
    reads = [config.init_batches] if metric_reads else []
    if fresh and BiasCompensation.applies(config):  # (the init batches the run draws: the longest metric's)
        reads.append(max([config.init_batches] + [config.layer_init_batches] * ("layers" in config.units)))
    if refit and not own:
        reads.append(config.reconstruct_batches)
    return "statistics", max(reads, default=0) + (config.reconstruct_batches if own else 0), metric_reads


def budget_layers_kept(budget, keep: float, n: int) -> int:
    """Layers the budget keeps at the start (all of them unless it removes whole layers)."""
    from ..algo.policy import keep_count

    return keep_count(keep, n) if getattr(budget, "layer_type", None) else n


def load_seconds(skeleton: Skeleton, dtype: str = "float32", in_memory: bool = False,
                 dequantise: bool | None = None) -> float:
    """The run's "load": reading the weights (none for a model given in memory, as the app's kept model) and the
    data (DATA_SECONDS). A GGUF is dequantised by transformers (about 25 s for SmolLM2-135M's 135 M parameters
    on this machine's cores) unless the cache holds its de-quantised copy (engine/storage/model_cache.py; dequantise
    None: look); a safetensors folder reads at disk speed."""
    if in_memory:
        return DATA_SECONDS
    if dequantise is None:
        dequantise = skeleton.source_kind == "gguf" and not gguf_copied(skeleton.name, dtype)
    per_param = GGUF_SECONDS_PER_PARAM if dequantise else COPY_SECONDS_PER_PARAM
    return 1.0 + skeleton.params_total * per_param + DATA_SECONDS


def gguf_copied(model: str, dtype: str) -> bool:
    """Does the cache hold the de-quantised copy of this GGUF model in this dtype?"""
    from ..storage import model_cache
    from ..model.loading import resolve_model

    try:
        source = resolve_model(model)
    except UserError:
        return False
    return bool(source.gguf_file) and model_cache.has_copy(model_cache.copy_folder(source.path, source.gguf_file, dtype))


def export_seconds(config, skeleton: Skeleton) -> float:
    """Writing the sliced model: its kept parameters at disk speed."""
    removal = plan_removal(skeleton, list(config.units), config.prune_ratio, config.budget, config.scope, config.init)
    kept = skeleton.params_total - removal.params_removed
    return EXPORT_SECONDS + kept * _BYTES.get(config.dtype, 4) / EXPORT_BYTES_PER_SECOND


def plan_time(config, skeleton: Skeleton, seconds_per_token: float, rate_source: str,
              dense_cached: bool = False, in_memory: bool = False, dequantise: bool | None = None,
              load: float | None = None, done_steps: int | None = None,
              pass_seconds_per_token: float | None = None, text_cached: bool = False,
              text_seconds: float | None = None, cached: dict[str, float] | None = None) -> TimePlan:
    """Seconds of each phase a run records (RUN_PHASES): its forward tokens (phase_tokens) times the measured
    seconds per token (the one-shot passes' own rate where their --pass-dtype was measured apart:
    `pass_seconds_per_token`), plus what is no forward: loading (load_seconds; `load`: the seconds it took, where
    the plan is made once the model and the data are in memory, as a run makes it) and the export. The
    calibration text a source generates: planned from its tokens unless `text_cached`, or the seconds it took
    (`text_seconds`, with `load`). `cached`: {phase: the share left to compute} for the one-shot phases the run's
    caches hold in part or whole (the statistics, the init metric: initialise.cached_phases); a whole one is
    planned at 0 s. Under --time-budget the steps fill what the budget leaves."""
    from ..data.calib_sources import PHASE as TEXT_PHASE
    from ..model.precision import run_eval_dtype, run_pass_dtype, run_step_dtype

    cached = cached or {}

    # (the evaluations and the steps at the passes' rate where they run in the passes' dtype)
    passes = PASS_PHASES + tuple(phase for phase, dtype in (("evaluations", run_eval_dtype(config)),
                                                            ("steps", run_step_dtype(config)))
                                 if dtype == run_pass_dtype(config) != config.dtype)

    def seconds(config) -> dict[str, float]:
        tokens = phase_tokens(config, skeleton, dense_cached, done_steps, text_cached or text_seconds is not None)
        phases = {"load": load_seconds(skeleton, config.dtype, in_memory, dequantise) if load is None else load}
        if text_seconds:
            phases[TEXT_PHASE] = text_seconds
        for phase in RUN_PHASES:
            if phase in tokens:
                rate = pass_seconds_per_token if phase in passes and pass_seconds_per_token else seconds_per_token
                phases[phase] = tokens[phase] * rate
        for key, value in tokens.items():  # (the scoring at the float32 rate; fixed seconds as they are)
            if key == MIX_REFITS or key.endswith(SCORED):
                phase = "joint mix" if key == MIX_REFITS else key[:-len(SCORED)]
                phases[phase] = phases.get(phase, 0.0) + value * seconds_per_token
            elif key.endswith(FIXED):
                phases[key[:-len(FIXED)]] = phases.get(key[:-len(FIXED)], 0.0) + value
        phases["export"] = export_seconds(config, skeleton)
        for phase, left in cached.items():  # (read from a cache: the share still computed)
            if phase in phases:
                phases[phase] *= left
        return phases

    phases = seconds(config)
    if config.time_budget and "steps" in phases:  # (the steps, with their refits, fill what the rest leaves)
        per_step, refit_per_step = (t * seconds_per_token for t in step_tokens(config, skeleton))
        refit_per_step += solve_seconds(config, skeleton, step_refits(config))
        done = done_steps or 0
        left = max(config.steps - done, 0)
        fit, fitted = float(left), config
        for _ in range(4):  # (the held-out checks are the ones the steps that fit make: fitted again, until stable)
            phases = seconds(fitted)
            steps_in = max(fitted.steps - done, 0)
            phases["refit"] = phases.get("refit", 0.0) - steps_in * refit_per_step
            rest = sum(v for k, v in phases.items() if k != "steps")
            fit = min(float(left), max(60 * config.time_budget - rest, 0.0) / (per_step + refit_per_step)) if (
                per_step + refit_per_step) > 0 else 0.0
            if done + max(math.ceil(fit), 1) == fitted.steps:
                break
            fitted = replace(config, steps=done + max(math.ceil(fit), 1))
        phases["steps"] = fit * per_step
        if refit_per_step:
            phases["refit"] += fit * refit_per_step
        if not phases.get("refit"):
            phases.pop("refit", None)
        return TimePlan(phases, seconds_per_token, rate_source, dense_cached, steps_fit=done + fit)
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


def probe_key(model: str, dtype: str, batch_size: int, seqlen: int, passes: str | None = None) -> str:
    """The probe cache's key; `passes`: a forward autocast to that dtype (the one-shot passes', when not `dtype`)."""
    import torch

    return (f"{model}|{dtype}|{batch_size}x{seqlen}|{torch.get_num_threads()} threads"
            + (f"|passes {passes}" if passes and passes != dtype else ""))


def pass_dtype_of(config) -> str | None:
    """The dtype a config's one-shot passes run in where it is not its weights' (their rate is probed apart), else
    None."""
    from ..model.precision import run_pass_dtype

    passes = run_pass_dtype(config)
    return passes if passes != config.dtype else None


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
                            repeats: int = 3, model=None, min_seconds: float = 1.0, passes: str | None = None) -> float:
    """Seconds per token of a dense forward on this machine: the model built from its config with random
    weights (no file is read), or `model` itself (a run's, on its device), one (batch x seqlen) forward to warm
    up, then the median of `repeats` or more, until they took `min_seconds` (a small model's forwards are many
    and short: the median of a few would catch a moment of the other work on shared cores, not the typical
    forward a run gets). Cached in `cache` (a folder) under the model, dtype, batch shape and thread count.
    passes: the forwards autocast to that dtype (the one-shot passes' rate, engine/model/precision.py)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..model.loading import DTYPES
    from ..model.precision import pass_precision

    key = probe_key(skeleton.name, dtype, batch_size, seqlen, passes)
    if (hit := cached_probe(cache, key)) is not None:
        return hit
    own = model is None
    if own:
        model = AutoModelForCausalLM.from_config(skeleton.adapter.config, dtype=DTYPES[dtype]).eval()
    device = next(model.parameters()).device
    ids = torch.randint(0, skeleton.vocab_size, (batch_size, seqlen), device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = []
    with torch.no_grad(), pass_precision(passes or dtype, device.type):
        for i in range(10_000):
            sync()
            t = time.perf_counter()
            model(input_ids=ids, use_cache=False)
            sync()
            if i:
                times.append(time.perf_counter() - t)
            if len(times) >= repeats and sum(times) >= min_seconds:
                break
    if own:
        del model
    rate = sorted(times)[len(times) // 2] / (batch_size * seqlen)
    if cache is not None:
        from ..storage.io import atomic_write_text

        try:
            cache.mkdir(parents=True, exist_ok=True)
            try:
                table = json.loads((cache / _PROBE_FILE).read_text())
            except (OSError, ValueError):
                table = {}
            table = table if isinstance(table, dict) else {}
            table[key] = rate
            atomic_write_text(cache / _PROBE_FILE, json.dumps(table, indent=1) + "\n")
        except OSError:  # (an unwritable cache: the rate is measured again next time)
            pass
    return rate


# --- memory -------------------------------------------------------------------------------------------------
@dataclass
class MemoryPlan:
    parts: dict[str, float] = field(default_factory=dict)  # bytes

    LOAD_ONLY: ClassVar[tuple[str, ...]] = ("loading a GGUF",)  # freed before the run's own buffers are made
    KEPT: ClassVar[tuple[str, ...]] = ("process", "weights")

    @property
    def total(self) -> float:
        """The peak: the process and the weights, then the larger of what loading holds for a moment and what the
        run holds together (activations, gradients, the refit's moments, the dense targets)."""
        kept = sum(v for k, v in self.parts.items() if k in self.KEPT)
        loading = sum(v for k, v in self.parts.items() if k in self.LOAD_ONLY)
        running = sum(v for k, v in self.parts.items() if k not in self.KEPT and k not in self.LOAD_ONLY)
        return kept + max(loading, running)


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
    # (a score without gradients runs the head on HEAD_TOKENS positions at a time: their logits, log-softmax and
    # KL terms; Taylor's backward needs the whole batch's logits and log-softmax)
    from ..algo.evaluate import HEAD_TOKENS

    logits = 2 * tokens if "gradients (Taylor init)" in parts else 3 * min(tokens, HEAD_TOKENS)
    parts["activations"] = (logits * skeleton.vocab_size + tokens * 3 * inter) * 4
    moments = refit_moment_bytes(config, skeleton)
    if moments:
        parts["refit moments (float64)"] = moments
        parts["refit: the columns it edits, kept to restore"] = refit_edit_bytes(config, skeleton)
    from ..model.executors import resolve_executor

    if resolve_executor(config.sample_forward, config.device) == "sliced":  # (a masked forward's own smaller copy)
        from ..algo.budget import decoder_params

        parts["a masked forward's sliced weights"] = ((1.0 - config.prune_ratio) * decoder_params(skeleton.adapter)
                                                     * _BYTES.get(config.dtype, 4))
    if _reward(config.reward).needs_dense:  # (the KL reward's dense targets: bounded, engine/algo/rewards.py)
        from ..algo.rewards import DENSE_HIDDEN_BATCHES, DENSE_LOGP_BYTES

        batch = config.batch_size * config.seqlen
        parts["dense targets (KL)"] = (max(DENSE_LOGP_BYTES, batch * skeleton.vocab_size * 4)  # (>= the batch in use)
                                       + DENSE_HIDDEN_BATCHES * batch * skeleton.hidden_size * 4)
    return MemoryPlan(parts)


def refit_edit_bytes(config, skeleton: Skeleton) -> int:
    """What a refit keeps of the weights it edits, to restore them: each width unit type's output projection in
    every layer (engine/algo/reconstruction.py's reconstructed)."""
    from ..model.unit_types import layer_unit_types

    projections = [t.output_proj(skeleton.adapter, i) for t in layer_unit_types() if t.name in config.units
                   for i in range(skeleton.num_layers)]
    return sum(p.in_features * p.out_features for p in projections) * _BYTES.get(config.dtype, 4)


def refit_moment_bytes(config, skeleton: Skeleton) -> int:
    """The least-squares refit's input moments, kept for the run (--reconstruct with width units): per layer and
    unit type, the float64 X^T X and column sums of its output projection's inputs."""
    from ..model.unit_types import layer_unit_types

    if not config.reconstruct:
        return 0
    sizes = [t.output_proj(skeleton.adapter, i).in_features for t in layer_unit_types() if t.name in config.units
             for i in range(skeleton.num_layers)]
    return sum(8 * (n * n + n) for n in sizes)


# --- what a time budget trades ------------------------------------------------------------------------------
def budget_trades(config, plan: TimePlan) -> list[str]:
    """What --time-budget would trade for time, said before Start (a run that does it says so again in its last
    lines and in results.json's "reduced"): the refit's statistics stop at a third of the time left when they
    start (engine/hooks/reconstruction.py), which the one statistics pass reaches after loading and the data."""
    from ..hooks.reconstruction import batches_within_share, statistics_allowance
    from ..algo.methods import optimises
    from ..algo.metrics import METRICS
    from ..model.unit_types import UNIT_TYPES

    widths = any(u in UNIT_TYPES and not UNIT_TYPES[u].whole_layer for u in config.units)
    if config.time_budget is None or not config.reconstruct or not widths:
        return []
    reads = config.bias_compensation or bool(getattr(METRICS.get(config.init), "statistics", ()))
    anyway = config.init_batches if reads and config.refit_stream == "init" else 0
    before = sum(plan.phases.get(k, 0.0) for k in ("load", "calibration text", "loading", "data and export"))
    per_batch = config.batch_size * config.seqlen * plan.seconds_per_token
    n = config.reconstruct_batches
    share, reserve = statistics_allowance(optimises(config), plan.phases)
    kept = batches_within_share(n, per_batch, 60.0 * config.time_budget - before, anyway, share, reserve)
    if kept >= n:
        return []
    rule = "a third of the time left when they start" if share < 1.0 else (
        f"the time left when they start but the {reserve:.0f} s kept for the phases after them")
    return [f"the time budget would cut the refit's statistics (--reconstruct-batches {n}) to about {kept} batches "
            f"(they may take {rule}): a less exact refit, and the pruned perplexity moves with it; a budget of about "
            f"{(before + reserve + n * per_batch / share) / 60:.1f} min or more keeps all {n}"]


def say_text_plan(model, config, left: int, probe: bool, log) -> None:
    """The plan, said before `left` documents are sampled (minutes on the default model; the run's own plan, phase
    by phase, comes once the text is read): the sampling's seconds and the whole run's, at a dense forward's rate,
    a probe's (cached in $PG_PRUNE_CACHE; probe False, for a model in memory: only a rate cached before)."""
    from ..storage import ppl_cache
    from ..data.calib_sources import PHASE, PROMPT_TOKENS

    what = (f"self-generated calibration: sampling {left} documents of {PROMPT_TOKENS} + {config.self_tokens} tokens "
            "with the dense model")
    skeleton, cache = skeleton_of(model, config.model), ppl_cache.cache_dir()
    rate = cached_probe(cache, probe_key(config.model, config.dtype, config.batch_size, config.seqlen))
    if rate is None and probe:
        rate = probe_seconds_per_token(skeleton, config.dtype, config.batch_size, config.seqlen, cache=cache, model=model)
    if rate is None:
        log(f"{what} (no estimate: no forward of this model was timed yet)")
        return
    plan = plan_time(config, skeleton, rate, "a probe")
    text = plan.phases.get(PHASE, 0.0) * left / config.self_docs
    log(f"{what}: about {text:.0f} s at {rate * 1e3:.4f} ms per token (a probe of this machine); plan: about "
        f"{plan.total - plan.phases.get(PHASE, 0.0) + text:.0f} s in all, said phase by phase once the text is read")
