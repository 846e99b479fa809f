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
        self.last = self.clock()
        if state.step and self.resumed_per_step:  # a resumed run: planned from the last session's step time
            return RunChanges(steps=self.plan(state, self.resumed_per_step))
        return None

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
        state.time_used = {"seconds": self.elapsed(), "eval_seconds": self.eval_seconds, "per_step": per_step,
                           "limit": self.limit}
        return planned


def share_of_time_left(run, share: float, minimum: int):
    """Under --time-budget, a stop rule for work done in units (batches) that may take `share` of the time left
    when it starts: stop(done) is true once `minimum` units are done and one more (at their mean cost) would pass
    that share; rank 0's clock decides for every rank of a data-parallel run. None without a time budget (the work
    runs to its end)."""
    budget = next((h for h in run.hooks if isinstance(h, TimeBudget)), None)
    if budget is None:
        return None
    start, allowed = budget.clock(), share * max(budget.limit - budget.elapsed(), 0.0)

    def stop(done: int) -> bool:
        spent = budget.clock() - start
        return bool(run.world.from_writer(done >= minimum and spent + spent / done > allowed, "a share of the time left"))

    return stop
