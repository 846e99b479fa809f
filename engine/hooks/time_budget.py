"""`--time-budget MIN`: the run takes as many steps as fit in MIN minutes of wall time, all of it counted:
loading, the init metric and evaluations, the steps (with their validations and checkpoints), and the final
evaluation and export, for which a reserve is kept.

After every step the plan is made again from what this session measured: the wall time per step, the larger
of its mean since the first step (validations and checkpoints included, spread over the steps) and its mean
over the last 5 (a slowdown shows there first), and the reserve for the end (the longest evaluation this
run measured, 15 % more, for each final evaluation, plus 5 s for the export). The planned count is the run's
step count (`run.ctx.steps`), so the learning-rate schedule and a method's own schedules (Gumbel's
temperature, Bonsai's rounds) stretch to it. A resumed run counts the minutes its earlier sessions used (kept in the
checkpoint) and plans what is left."""

from __future__ import annotations

import math
import time

from .base import RunChanges, RunHook

EXPORT_SECONDS = 5.0
RESERVE_FACTOR = 1.15
RECENT = 5  # steps in the recent mean
# The fewest steps a budgeted run takes: below it the run takes none and exports its init mask. Measured:
# the 10-minute default at 30 % took 7, 8 and 9 steps and ended every seed below its init (docs/results.md); a
# first run on a slower machine fitted 0, took 1, and ended 5 % above its init. Fewer than 7 were not measured
# to pay, so they are not bought.
MIN_STEPS = 7


def planned_steps(done: int, elapsed: float, limit: float, per_step: float, reserve: float) -> int:
    """The total step count when `done` steps took the run to `elapsed` seconds of a `limit`, one more step
    costs `per_step` and the end costs `reserve`: done plus the whole steps that still fit (never fewer than
    done)."""
    room = limit - elapsed - reserve
    return done + max(0, math.floor(room / per_step)) if per_step > 0 else done


class TimeBudget(RunHook):
    @staticmethod
    def applies(config) -> bool:
        return config.time_budget is not None

    def on_setup(self) -> None:
        self.limit, self.before, self.eval_seconds = 60.0 * self.run.config.time_budget, 0.0, 0.0
        self.resumed_per_step = 0.0
        self.clock = time.monotonic
        self.step_times: list[float] = []  # wall seconds from one step's end to the next's, this session
        self.last, self.said_full = 0.0, False

    def elapsed(self) -> float:
        """The run's wall seconds so far: earlier sessions' and this one's since the run object was made."""
        return self.before + self.clock() - self.run.started

    def on_resume(self, state) -> None:
        used = state.time_used or {}
        self.before, self.eval_seconds = float(used.get("seconds", 0.0)), float(used.get("eval_seconds", 0.0))
        self.resumed_per_step = float(used.get("per_step", 0.0))

    def on_start(self, state) -> RunChanges | None:
        from ..algo.methods import METHODS

        self.last = self.clock()
        if not METHODS[self.run.config.method].optimises:  # (a one-shot run: its budget bounds the refit alone)
            return None
        if state.step and self.resumed_per_step:  # a resumed run: planned from the last session's step time
            return RunChanges(steps=self.plan(state, self.resumed_per_step))
        fit = self.run.plan_steps
        cap = min(MIN_STEPS, self.run.config.steps)  # (a --steps below the minimum is the user's own count)
        if not state.step and fit is not None and fit < cap:  # (the plan made before the run's work)
            self.run.log(too_few_line(fit, self.limit))
            return RunChanges(steps=0)
        return None

    def final_scores(self, state, scores):
        """The init mask's scores when the budget left fewer than MIN_STEPS steps (none, or a machine slower than
        planned) and fewer than --steps: steps not measured to pay are not exported."""
        from ..algo.methods import METHODS

        if state.step >= min(MIN_STEPS, self.run.config.steps) or not METHODS[self.run.config.method].optimises:
            return scores
        init = state.init_mask_scores or state.init_metric
        if init is None:
            return scores
        if state.step:
            self.run.log(f"time budget: {state.step} step{'s' if state.step > 1 else ''} fitted, fewer than the "
                         f"{MIN_STEPS} measured to pay: the init mask is exported")
        return init

    def on_step(self, state, report) -> RunChanges:
        now = self.clock()
        self.step_times.append(now - self.last)
        self.last = now
        recent = self.step_times[-RECENT:]  # a slowdown shows here first; the whole mean spreads validations
        per_step = max(sum(self.step_times) / len(self.step_times), sum(recent) / len(recent))
        planned = self.plan(state, per_step)
        report.eta_seconds = per_step * (planned - state.step)
        return RunChanges(steps=planned)

    def plan(self, state, per_step: float) -> int:
        """The run's step count from here (its new ctx.steps), and what a checkpoint keeps of the time used."""
        self.eval_seconds = max(self.eval_seconds, self.run.masks.longest_eval)
        evaluations = 1 + sum(h.final_evaluations for h in self.run.hooks)  # (--reconstruct: the mask before its refit)
        reserve = RESERVE_FACTOR * evaluations * self.eval_seconds + EXPORT_SECONDS
        planned = planned_steps(state.step, self.elapsed(), self.limit, per_step, reserve)
        if planned == state.step and not self.said_full:  # (the budget is spent: said once, at a run's natural end too)
            self.said_full = True
            self.run.log(f"time budget: {self.elapsed() / 60:.1f} of {self.limit / 60:g} min used at step {state.step}, "
                         f"the end needs about {reserve:.0f} s: no more steps (results.json's seconds_by_phase says where "
                         f"the time went)")
        planned = self.run.world.from_writer(planned, "the time budget's step count")  # (rank 0's clock)
        self.own(state)["time_used"] = {"seconds": self.elapsed(), "eval_seconds": self.eval_seconds, "per_step": per_step,
                           "limit": self.limit}
        return planned


def allowed_seconds(seconds_left: float, share: float, reserve: float = 0.0, at_least: float = 0.0) -> float:
    """The seconds a piece of work may take when `seconds_left` remain as it starts: `share` of them less `reserve`,
    and never less than `at_least` of them."""
    left = max(seconds_left, 0.0)
    return max(at_least * left, share * max(left - reserve, 0.0))


def share_of_time_left(run, share: float, minimum: int, reserve: float = 0.0, at_least: float = 0.0):
    """Under --time-budget, a stop rule for work done in units (batches) that may take `share` of the time left
    when it starts, less `reserve` seconds, and at least `at_least` of it (allowed_seconds): stop(done) is true once
    `minimum` units are done and one more (at their mean cost) would pass that; rank 0's clock decides for every
    rank of a data-parallel run. None without a time budget (the work runs to its end)."""
    budget = next((h for h in run.hooks if isinstance(h, TimeBudget)), None)
    if budget is None:
        return None
    start, allowed = budget.clock(), allowed_seconds(budget.limit - budget.elapsed(), share, reserve, at_least)

    def stop(done: int) -> bool:
        spent = budget.clock() - start
        return bool(run.world.from_writer(done >= minimum and spent + spent / done > allowed, "a share of the time left"))

    return stop


def too_few_line(fit: float, limit: float) -> str:
    """What a budgeted run says when its plan fits fewer than MIN_STEPS steps."""
    return (f"time budget: about {fit:.1f} steps fit in {limit / 60:g} min, fewer than the {MIN_STEPS} measured to pay "
            f"(docs/results.md): no steps; the init mask (the one-shot joint mix, refit) is exported. A budget that "
            f"fits {MIN_STEPS} or more buys them")
