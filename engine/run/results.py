"""What a finished run reports: results.json."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ..algo.context import KEEP
from ..algo.budget import removal_report
from ..data.calib_sources import source_of, step_source_of
from ..model.distributed import shares
from ..storage.io import atomic_write_text
from ..model.loading import count_parameters
from .phases import phase_line
from ..model.precision import run_eval_dtype, run_pass_dtype, run_step_dtype
from .folder import MODEL_DIR, RESULTS_FILE
from .plan import PLAN_KEY
from .state import RunState, peak_rss_mb
from ..model.unit_types import UNIT_TYPES

if TYPE_CHECKING:  # annotations only
    from .resources import RunResources



def best_val_record(state, reward) -> dict | None:
    """results.json's best_val: best-val's best held-out value and what it is ("perplexity" under a reward whose
    held-out figure is the perplexity, ce; else the reward's name, kl: a mean KL in nats a token); None without
    validation."""
    if state.best_val is None:
        return None
    return {"metric": reward.name if reward.own_held_out else "perplexity", "value": state.best_val}

def planned_memory_mb(res: "RunResources") -> float | None:
    """The plan's estimate of the run's peak memory (MB), beside the measured peak; None where it cannot be made."""
    from ..plan.forecast import plan_memory, skeleton_of

    try:
        skeleton = skeleton_of(res.model, res.config.model, "gguf" if res.source.gguf_file else "folder")
        return round(plan_memory(res.config, skeleton).total / 2**20, 1)
    except Exception:  # (an estimate: never a failed run for it)
        return None


def exported_step(state: RunState, scores: dict) -> int:
    """The step whose mask the final scores are: best-val's best step, the init's (0: a transform exported the init
    mask, as a time budget that fitted fewer steps than pay does), or the last step."""
    if state.best_scores is not None and scores is state.best_scores:
        return state.best_step
    if scores is not state.scores and any(scores is s for s in (state.init_mask_scores, state.init_metric) if s):
        return 0
    return state.step


def run_results(res: "RunResources", state: RunState, scores: dict, masks: dict, ppl_pruned: float, params_pruned: int) -> dict:
    c = res.config
    return {
        "status": "done",
        "model": res.source.name,
        "method": c.method,
        "init": c.init,
        "layer_init": c.layer_init if any(UNIT_TYPES[u].whole_layer for u in c.units) else None,
        "units": c.units,
        "scope": c.scope,
        "budget": c.budget,
        "prune_ratio": c.prune_ratio,
        "seed": c.seed,
        "ppl_dense": state.ppl_dense,
        "ppl_init": state.ppl_init,
        "ppl_pruned": ppl_pruned,
        "eval_windows": int(res.windows.shape[0]),
        "seqlen": c.eval_seqlen,
        "eval_data": res.sources["eval_data"],
        "calib_data": res.sources["calib_data"],
        "calib_source": source_of(c),  # what the masks were scored on (--calib-source, auto resolved), in words below
        "scored_on": res.sources.get("calib_source"),
        "step_calib_source": step_source_of(c),  # what the steps and their check read (--step-calib-source)
        "reward": c.reward,
        "params_dense": count_parameters(res.model),
        "params_pruned": params_pruned,
        **removal_report(res.adapter, res.layout, masks, count_parameters(res.model)),
        "init_mix": state.init_mix,
        "kept_per_layer": {u: [int(m.sum()) for m in res.layout.split(u, mask)] for u, mask in masks.items()},
        "units_per_layer": res.layout.sizes,
        "steps": state.step,
        "final_mask": c.final_mask,
        "mask_step": exported_step(state, scores),
        "best_val": best_val_record(state, res.ctx.reward),  # {metric, value}: under --reward kl a mean KL
        "val_ppl_init": state.val_ppl_init,
        "lr": c.lr,
        "seconds_per_step": state.seconds_in_steps / max(state.step, 1),
        "seconds_in_steps": state.seconds_in_steps,
        "stopped_early": state.stopped_early,  # --early-stop: the step it stopped at, or None
        "time_budget": c.time_budget,  # minutes, or None
        "time_used": state.time_used,  # --time-budget: the wall seconds at the last step, all sessions
        "peak_rss_mb": peak_rss_mb(),  # (of rank 0 in a data-parallel run)
        "plan_memory_mb": planned_memory_mb(res),  # (the plan's estimate of that peak, engine/plan/forecast.py's plan_memory)
        "pass_dtype": run_pass_dtype(c, res.model),  # the one-shot passes' matrix products (--pass-dtype)
        "eval_dtype": run_eval_dtype(c, res.model),  # the evaluations' (--eval-dtype)
        "step_dtype": run_step_dtype(c, res.model),  # the steps' forwards' (--step-dtype)
        "world_size": res.world.size,  # torchrun's ranks in the session that finished the run
        "mask_samples_by_rank": shares(c.num_mask_samples, res.world.size),  # which rank ran which of the N_s samples
        "worlds": state.worlds,  # each session's ranks from the step it started at
        PLAN_KEY: res.loop.plan,  # the time plan this session started with (engine/run/plan.py)
    }


def finish(res: "RunResources", state: RunState) -> dict:
    """The final mask from the method's (or a hook's) scores: evaluated, saved, exported as a sliced model."""
    from ..export.artifacts import build_pruned_model, export_pruned, save_mask_artifact

    scores = res.masks.final_scores(state, res.method.final_scores(state))
    masks = res.masks.final_masks(scores, state.init_metric)
    with res.masks.weights(masks) as comp_means:  # the model as the hooks finish it (--reconstruct refits the kept columns)
        ppl_pruned = res.masks.masked_perplexity(masks, "pruned", comp_means)  # (every rank: a data-parallel run shares its forwards)
        if not res.world.writes:  # rank 0 alone writes the masks, the export and results.json
            return {"status": "done", "rank": res.world.rank, "ppl_pruned": ppl_pruned}
        if res.out is None:  # a run in memory (engine.api.prune) writes nothing: its caller takes masks and model
            model = build_pruned_model(res.model, res.layout, masks, res.ctx.comp_means if comp_means is KEEP else comp_means)
            return {**report(res, state, scores, masks, ppl_pruned, count_parameters(model)), "masks": masks, "model": model}
        save_mask_artifact(res.out, res.source.name, res.layout, scores, masks, state.init_scores,
                           res.masks.init_masks(state))
        res.log(f"exporting the sliced model to {res.out / MODEL_DIR}")
        with res.phases("export"):
            export = export_pruned(res.model, res.tokenizer, res.layout, masks, res.out / MODEL_DIR,
                                   res.ctx.comp_means if comp_means is KEEP else comp_means)
    results = report(res, state, scores, masks, ppl_pruned, export["params"])
    atomic_write_text(res.out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    return results


def report(res: "RunResources", state: RunState, scores: dict, masks: dict, ppl_pruned: float, params_pruned: int) -> dict:
    """results.json's content: run_results, each hook's results and the seconds by phase (logged)."""
    results = run_results(res, state, scores, masks, ppl_pruned, params_pruned)
    for hook in res.hooks:
        results.update(hook.results())
    results["seconds_by_phase"] = res.phases.report()  # (this session's; a resumed run's earlier ones are in time_used)
    results["peak_rss_mb_by_phase"] = res.phases.peak_report()  # (which phase set the peak: this session's)
    if results.get("reduced"):  # (what the run traded for time, said again where a user reads last)
        res.log(reduced_line(results["reduced"]))
    res.log(phase_line(results["seconds_by_phase"]))
    if results["peak_rss_mb_by_phase"]:
        res.log(peak_line(results["peak_rss_mb_by_phase"]))
    return results


def peak_line(raised: dict[str, float]) -> str:
    """The log's memory line: "memory: peak 3802 MiB, reached in steps (before: load 610, statistics 2410)"."""
    (last, peak), before = list(raised.items())[-1], list(raised.items())[:-1]
    earlier = f" (before: {', '.join(f'{k} {v:.0f}' for k, v in before)})" if before else ""
    return f"memory: peak {peak:.0f} MiB, reached in {last}{earlier}"


def reduced_line(reduced: dict) -> str:
    """results.json's "reduced" ({setting: [asked, used], "why": ...}) as the log's line."""
    parts = [f"{k.replace('_', '-')} {v[0]} -> {v[1]}" for k, v in reduced.items() if k != "why"]
    return f"reduced under the time budget: {', '.join(parts)} ({reduced.get('why', '')})"
