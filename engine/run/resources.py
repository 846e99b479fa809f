"""What a run is made of, bound once it is loaded (RunResources), and the little the loop sets as it goes
(LoopState). Every module of the run takes these two and the RunState (engine/run/state.py), never the loop
itself (engine/run/loop.py's PruneRun builds them and is the only one that holds all three)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable


@dataclass
class LoopState:
    """What the loop sets while it runs, outside the checkpoint: the budget's stages and the widths' init metric
    (only as a hook's RunChanges says: PruneRun.apply_changes), the progress bars, the time plan and the steps it
    fits under --time-budget, and the dense statistics a fresh run's init shares (a dict during the init, None
    once the model is masked)."""

    stages: list  # [(from step, prune ratio)]: one stage, or random-progressive's
    unit_metric: str  # the init metric of the widths (random-progressive: random)
    progress: bool = True  # tqdm bars
    plan: dict | None = None  # results.json's plan_seconds_by_phase (engine/run/plan.py), once made
    plan_steps: float | None = None  # the steps the plan fits under --time-budget
    stats_memo: dict | None = None  # engine/algo/statistics.py's memo, during a fresh run's init


@dataclass(frozen=True)
class RunResources:
    """The run's model, data and machinery, bound once (no field is reassigned; the objects they hold keep their
    own state: the samplers' positions, the clock's phases, the masks' perplexities measured so far)."""

    config: Any  # the run's PruneConfig, resolved (config.resolved())
    model: Any
    tokenizer: Any
    adapter: Any  # engine/model/arch's ModelAdapter: the model's units
    layout: Any  # engine/model/units.UnitLayout
    budget: Any  # engine/algo/budget's Budget: projection and hard masks
    sampler: Any  # the steps' calibration batches (CalibrationSampler)
    init_sampler: Any  # the init metric's (the steps' sampler unless --init-data all)
    val_batches: list  # the held-out validation batches ([] without validation)
    windows: Any  # the evaluation windows (tensor [n, eval seqlen])
    sources: dict  # where the data came from: calib_data, eval_data, calib_source
    world: Any  # engine/model/distributed.World: this torchrun rank
    log: Callable[[str], None]
    phases: Any  # engine/run/phases.PhaseClock
    out: Path | None  # the run folder (None: a run in memory, engine.api.prune, which writes nothing)
    source: Any  # the model's files (engine/model/loading.resolve_model)
    from_disk: bool  # the model is source's files as read (what is cached per model applies to it)
    started: float  # time.monotonic() the --time-budget counts from
    ctx: Any  # engine/algo/context.StepContext: what a method sees
    method: Any  # the method (engine/algo/methods)
    mask_rng: Any  # torch.Generator of the mask samples
    step_dtype: str  # the steps' forwards' dtype
    masks: Any  # engine/run/masks.RunMasks: the masks taken from scores and their perplexities
    hooks: tuple  # the joined hooks, in RUN_HOOKS' order
    loop: LoopState
