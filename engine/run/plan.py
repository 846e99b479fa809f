"""The plan a run starts with: engine/plan/forecast.py's time plan of this run's phases, computed by the engine when the run
starts (so a CLI run has it as the app's does), logged, kept for results.json (`plan_seconds_by_phase`) and
shown beside what the run measured (`seconds_by_phase`) when it ends.

The rate is the probe's cached for this model, dtype, batch shape and thread count ($PG_PRUNE_CACHE, shared with
the app's plan panel), or a probe of the run's own model, once: a warm-up forward and two timed ones of a
calibration batch (for the default model about 8 s on 2 cores, counted in the run's load). With a cached rate, one
forward of the run's model is timed against it: 1.5 times slower or more, the plan says the machine is busier
than it was and takes today's rate (never cached)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only
    from .resources import RunResources

PLAN_KEY = "plan_seconds_by_phase"  # results.json's key of the plan the run started with


# A rate this process measured or checked against its cached probe, and when: a second plan within RECHECK seconds
# (the command line's --time-budget trades, then the run's own plan) reads it instead of timing forwards again
# (two forwards a dtype: 6 s of a default first run on 2 cores). (probe key, cached rate) -> (rate, source, when)
_CHECKED: dict[tuple[str, float], tuple[float, str, float]] = {}
RECHECK = 300.0


def run_rate(res: "RunResources", skeleton, passes: str | None = None) -> tuple[float, str]:
    """(seconds per token of a dense forward, where it comes from); passes: of one autocast to that dtype (the
    one-shot passes', engine/model/precision.py)."""
    from ..plan.forecast import cached_probe, probe_key, probe_seconds_per_token
    from ..storage.ppl_cache import cache_dir

    c = res.config
    key = probe_key(c.model, c.dtype, c.batch_size, c.seqlen, passes)
    hit = cached_probe(cache_dir(), key)
    if hit is not None:  # (one forward now, against the cached rate: a machine busier than then is said, and planned)
        if (seen := _CHECKED.get((key, hit))) is not None and time.monotonic() - seen[2] < RECHECK:
            return seen[0], seen[1]
        now = probe_seconds_per_token(skeleton, c.dtype, c.batch_size, c.seqlen, cache=None, repeats=1,
                                      model=res.model, min_seconds=0.0, passes=passes)
        if (line := busier_line(now, hit)) is not None:
            res.log(line)
            rate, source = now, "a fresh probe of this machine (busier than its cached one)"
        else:
            rate, source = hit, "a probe of this machine (cached)"
    else:
        rate = probe_seconds_per_token(skeleton, c.dtype, c.batch_size, c.seqlen, cache=cache_dir(), model=res.model,
                                       passes=passes)
        source = "a probe of this machine (one dense forward of a batch)"
        hit = cached_probe(cache_dir(), key)  # (what a second plan will find cached: the rate just measured)
    if hit is not None:
        _CHECKED[(key, hit)] = (rate, source, time.monotonic())
    return rate, source


BUSIER = 1.5  # a fresh forward this many times slower than the cached probe: the machine is busier than it was


def busier_line(now: float, cached: float, factor: float = BUSIER) -> str | None:
    """The plan's warning when a forward now is `factor` times slower or more than the cached probe's (seconds
    per token each): another job shares the cores; None otherwise."""
    if now < factor * cached:
        return None
    return (f"plan: this machine is busier than when it was probed: a forward now takes {now * 1e3:.4f} ms per token, "
            f"{now / cached:.1f}x the cached {cached * 1e3:.4f}; the plan takes today's rate (another job on these "
            "cores slows every phase)")


def start_plan(res: "RunResources", done_steps: int | None = None) -> dict[str, float]:
    """plan_with_steps' plan alone."""
    return plan_with_steps(res, done_steps)[0]


def time_plan(res: "RunResources", done_steps: int | None = None):
    """(the TimePlan of this session of the run, the forward's seconds per token, where that rate came from, the
    one-shot passes' dtype when it is another, their rate): engine/plan/forecast.py's plan_time at this machine's rates, the
    dense perplexity's cache and the calibration text's seconds as the run has them now. The one plan that the
    run's plan line, --time-budget's trades and the steps that fit are read from."""
    from ..data.calib_sources import PHASE as CALIB_PHASE
    from .initialise import cached_phases
    from ..plan.forecast import pass_dtype_of, plan_time, skeleton_of

    c = res.config
    skeleton = skeleton_of(res.model, c.model, "gguf" if res.source.gguf_file else "folder")
    rate, source = run_rate(res, skeleton)
    passes = pass_dtype_of(c)  # (the one-shot passes' own rate, when they run in another dtype)
    pass_rate = run_rate(res, skeleton, passes)[0] if passes else None
    dense_cached = res.masks.cached_dense()[1] is not None
    text = res.phases.seconds.get(CALIB_PHASE)  # (the calibration text: generated or read, before the plan)
    cached = cached_phases(res) if done_steps is None else {}  # (a second run's statistics and metric)
    plan = plan_time(c, skeleton, rate, source, dense_cached=dense_cached, done_steps=done_steps,
                     load=time.monotonic() - res.started - (text or 0.0) if done_steps is None else res.phases.seconds["load"],
                     pass_seconds_per_token=pass_rate, text_cached=True, text_seconds=text, cached=cached)
    return plan, rate, source, passes, pass_rate


def plan_with_steps(res: "RunResources", done_steps: int | None = None) -> tuple[dict[str, float], float | None]:
    """(the plan, the steps that fit under --time-budget: None without one). The plan of this session of the run in
    results.json's form (phase -> seconds, "other", "total"), made once the model and the data are in memory (the probe
    runs the model; the dense perplexity's cache is keyed by the evaluation windows): its "load" is what loading took
    until then (the CLI's imports, the model, the data and the probe), its "calibration text" what the calibration
    source's text took (generated, or read from its cache), the rest is planned. A fresh run (done_steps None) or one
    resumed at done_steps. Logged."""
    from ..hooks.reconstruction import Reconstruction

    plan, rate, source, passes, pass_rate = time_plan(res, done_steps)
    phases = dict(plan.phases)
    if any(isinstance(h, Reconstruction) and h.skipped for h in res.hooks):  # (no statistics, no refit)
        phases.pop("refit statistics", None)
        phases.pop("refit", None)
    if res.out is None:  # (a run in memory writes no export)
        phases.pop("export", None)
    out = {k: round(v, 1) for k, v in phases.items()}
    out.update(other=0.0, total=round(sum(phases.values()), 1))
    res.log(f"plan: about {out['total']:.0f} s (" + ", ".join(f"{k} {v:.0f}" for k, v in out.items()
                                                       if k not in ("other", "total") and v >= 1)
            + f"); {rate * 1e3:.4f} ms per token from {source}"
            + (f" ({pass_rate * 1e3:.4f} in the one-shot passes' {passes})" if pass_rate else "")
            + (f"; about {plan.steps_fit:.1f} steps fit the time budget" if plan.steps_fit is not None else ""))
    return out, plan.steps_fit


def phase_progress(plan: dict[str, float], seconds: dict[str, float], current: str | None
                   ) -> tuple[float | None, float]:
    """(seconds left in the current phase, None when the plan has no such phase; seconds left in the run): the
    plan's phases against the seconds spent so far in each (`seconds`: PhaseClock.so_far's); a phase past its
    plan has 0 left, phases not entered yet count whole."""
    left = {k: max(v - seconds.get(k, 0.0), 0.0) for k, v in plan.items() if k not in ("other", "total")}
    return (left.get(current) if current else None), sum(left.values())


def phase_status(plan: dict[str, float] | None, clock) -> dict:
    """A run in progress as a UI shows it before its steps: the phase open now (its name, "other" between
    phases), its seconds so far and planned, the seconds left in it and in the run by the plan (None without a
    plan)."""
    current, seconds = clock.so_far()
    name = current or "other"
    left, run_left = phase_progress(plan, seconds, current) if plan else (None, None)
    return {"phase": name, "seconds": round(seconds.get(name, 0.0), 1),
            "planned": (plan or {}).get(name), "phase_left": left, "run_left": run_left,
            "after_steps": after_steps(plan, seconds)}


def after_steps(plan: dict[str, float] | None, seconds: dict[str, float]) -> float:
    """The plan's seconds for what is left after the steps: its evaluations not yet spent (the final one) and the
    export (0 without a plan)."""
    plan = plan or {}
    return max(plan.get("evaluations", 0.0) - seconds.get("evaluations", 0.0), 0.0) + plan.get("export", 0.0)


def plan_rows(plan: dict[str, float] | None, actual: dict[str, float]) -> list[tuple[str, float | None, float]]:
    """(phase, planned seconds or None, measured seconds) for every phase either names, in the run's order, with
    "other" and "total" last."""
    plan = plan or {}
    names = [k for k in actual if k not in ("other", "total")]
    names += [k for k in plan if k not in names and k not in ("other", "total")]
    return [(k, plan.get(k), actual.get(k, 0.0)) for k in names + ["other", "total"] if k in plan or k in actual]


def plan_lines(plan: dict[str, float] | None, actual: dict[str, float]) -> list[str]:
    """The CLI's last lines: plan against actual per phase (phases under a second on both sides left out, but
    for the total), with the ratio where the plan has the phase."""
    lines = ["time by phase: planned / measured seconds"]
    for k, p, a in plan_rows(plan, actual):
        if k != "total" and a < 1 and (p or 0) < 1:
            continue
        ratio = f"  ({a / p:.2f}x the plan)" if p and p >= 1 else ""
        lines.append(f"  {k:<17} {'—' if p is None else f'{p:.0f}':>6} / {a:.0f}{ratio}")
    return lines
