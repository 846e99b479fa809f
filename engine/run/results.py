"""What a finished run reports: results.json."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from ..algo.context import KEEP
from ..algo.budget import removal_report
from ..data.calib_sources import source_of
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
    from .loop import PruneRun



def best_val_record(state, reward) -> dict | None:
    """results.json's best_val: best-val's best held-out value and what it is ("perplexity" under a reward whose
    held-out figure is the perplexity, ce; else the reward's name, kl: a mean KL in nats a token); None without
    validation."""
    if state.best_val is None:
        return None
    return {"metric": reward.name if reward.own_held_out else "perplexity", "value": state.best_val}

def planned_memory_mb(run: "PruneRun") -> float | None:
    """The plan's estimate of the run's peak memory (MB), beside the measured peak; None where it cannot be made."""
    from ..plan.forecast import plan_memory, skeleton_of

    try:
        skeleton = skeleton_of(run.model, run.config.model, "gguf" if run.source.gguf_file else "folder")
        return round(plan_memory(run.config, skeleton).total / 2**20, 1)
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


def run_results(run: "PruneRun", state: RunState, scores: dict, masks: dict, ppl_pruned: float, params_pruned: int) -> dict:
    c = run.config
    return {
        "status": "done",
        "model": run.source.name,
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
        "eval_windows": int(run.windows.shape[0]),
        "seqlen": c.eval_seqlen,
        "eval_data": run.sources["eval_data"],
        "calib_data": run.sources["calib_data"],
        "calib_source": source_of(c),  # what the masks were scored on (--calib-source, auto resolved), in words below
        "scored_on": run.sources.get("calib_source"),
        "reward": c.reward,
        "params_dense": count_parameters(run.model),
        "params_pruned": params_pruned,
        **removal_report(run.adapter, run.layout, masks, count_parameters(run.model)),
        "init_mix": state.init_mix,
        "kept_per_layer": {u: [int(m.sum()) for m in run.layout.split(u, mask)] for u, mask in masks.items()},
        "units_per_layer": run.layout.sizes,
        "steps": state.step,
        "final_mask": c.final_mask,
        "mask_step": exported_step(state, scores),
        "best_val": best_val_record(state, run.ctx.reward),  # {metric, value}: under --reward kl a mean KL
        "val_ppl_init": state.val_ppl_init,
        "lr": c.lr,
        "seconds_per_step": state.seconds_in_steps / max(state.step, 1),
        "seconds_in_steps": state.seconds_in_steps,
        "stopped_early": state.stopped_early,  # --early-stop: the step it stopped at, or None
        "time_budget": c.time_budget,  # minutes, or None
        "time_used": state.time_used,  # --time-budget: the wall seconds at the last step, all sessions
        "peak_rss_mb": peak_rss_mb(),  # (of rank 0 in a data-parallel run)
        "plan_memory_mb": planned_memory_mb(run),  # (the plan's estimate of that peak, engine/plan/forecast.py's plan_memory)
        "pass_dtype": run_pass_dtype(c, run.model),  # the one-shot passes' matrix products (--pass-dtype)
        "eval_dtype": run_eval_dtype(c, run.model),  # the evaluations' (--eval-dtype)
        "step_dtype": run_step_dtype(c, run.model),  # the steps' forwards' (--step-dtype)
        "world_size": run.world.size,  # torchrun's ranks in the session that finished the run
        "mask_samples_by_rank": shares(c.num_mask_samples, run.world.size),  # which rank ran which of the N_s samples
        "worlds": state.worlds,  # each session's ranks from the step it started at
        PLAN_KEY: getattr(run, "plan", None),  # the time plan this session started with (engine/run/plan.py)
    }


def finish(run: "PruneRun", state: RunState) -> dict:
    """The final mask from the method's (or a hook's) scores: evaluated, saved, exported as a sliced model."""
    from ..export.artifacts import build_pruned_model, export_pruned, save_mask_artifact

    scores = run.masks.final_scores(state, run.method.final_scores(state))
    masks = run.final_masks(scores, state.init_metric)
    with run.masks.weights(masks) as fill:  # the model as the hooks finish it (--reconstruct refits the kept columns)
        ppl_pruned = run.masked_perplexity(masks, "pruned", fill)  # (every rank: a data-parallel run shares its forwards)
        if not run.world.writes:  # rank 0 alone writes the masks, the export and results.json
            return {"status": "done", "rank": run.world.rank, "ppl_pruned": ppl_pruned}
        if run.out is None:  # a run in memory (engine.api.prune) writes nothing: its caller takes masks and model
            model = build_pruned_model(run.model, run.layout, masks, run.fill if fill is KEEP else fill)
            return {**report(run, state, scores, masks, ppl_pruned, count_parameters(model)), "masks": masks, "model": model}
        save_mask_artifact(run.out, run.source.name, run.layout, scores, masks, state.init_scores,
                           run.masks.init_masks(state))
        run.log(f"exporting the sliced model to {run.out / MODEL_DIR}")
        with run.phases("export"):
            export = export_pruned(run.model, run.tokenizer, run.layout, masks, run.out / MODEL_DIR, run.fill if fill is KEEP else fill)
    results = report(run, state, scores, masks, ppl_pruned, export["params"])
    atomic_write_text(run.out / RESULTS_FILE, json.dumps(results, indent=2) + "\n")
    return results


def report(run: "PruneRun", state: RunState, scores: dict, masks: dict, ppl_pruned: float, params_pruned: int) -> dict:
    """results.json's content: run_results, each hook's results and the seconds by phase (logged)."""
    results = run_results(run, state, scores, masks, ppl_pruned, params_pruned)
    for hook in run.hooks:
        results.update(hook.results())
    results["seconds_by_phase"] = run.phases.report()  # (this session's; a resumed run's earlier ones are in time_used)
    results["peak_rss_mb_by_phase"] = run.phases.peak_report()  # (which phase set the peak: this session's)
    if results.get("reduced"):  # (what the run traded for time, said again where a user reads last)
        run.log(reduced_line(results["reduced"]))
    run.log(phase_line(results["seconds_by_phase"]))
    if results["peak_rss_mb_by_phase"]:
        run.log(peak_line(results["peak_rss_mb_by_phase"]))
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
