"""--time-budget MIN (issue 28): the step count planned from the measured step time, the schedules stretched to
it, the run ending within one step of its limit, and a resumed run planning what is left. The steps' cost is
a fake clock (each step advances it), so the figures are exact and the tests fast."""

from __future__ import annotations

import json
import math
import threading
from types import SimpleNamespace

import pytest
import torch

from engine.errors import UserError
from engine.model.distributed import World
from engine.hooks.time_budget import EXPORT_SECONDS, RESERVE_FACTOR, TimeBudget, planned_steps, share_of_time_left
from engine.algo.policy import LR_SCHEDULE_FNS
from engine.run.loop import PruneRun

from test_pruner import small_config


@pytest.fixture(autouse=True)
def plan_fits_no_count(monkeypatch):
    """The steps the real plan fits (from this machine's probe) are not these tests' subject, whose step costs are a
    fake clock: the plan's count is left out (None, as a run in memory has), unless a test sets one."""
    import engine.run.loop as pruner

    real = pruner.plan_with_steps
    monkeypatch.setattr(pruner, "plan_with_steps", lambda run, done_steps=None: (real(run, done_steps)[0], None))


def test_planned_steps_fit_what_is_left():
    assert planned_steps(done=3, elapsed=10.0, limit=60.0, per_step=2.0, reserve=5.0) == 3 + 22
    assert planned_steps(done=3, elapsed=58.0, limit=60.0, per_step=2.0, reserve=5.0) == 3  # no room: stop now
    assert planned_steps(done=0, elapsed=0.0, limit=60.0, per_step=0.0, reserve=0.0) == 0


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def budget_run(tiny, tiny_path, eval_file, out, clock, costs, minutes=1.0, log=lambda m: None, **kw):
    """A PG run under a time budget whose k-th step (0-based, over sessions) costs costs(k) fake seconds."""
    config = small_config(tiny_path, eval_file, time_budget=minutes, steps=4, val_every=5, checkpoint_every=1000, **kw)
    run = PruneRun(config, out, model=tiny[0], tokenizer=tiny[1], log=log, started=clock.t)
    hook = next(h for h in run.res.hooks if isinstance(h, TimeBudget))
    hook.clock = clock
    gradient = run.res.method.gradient

    def timed(state, batch):
        clock.t += costs(state.step)
        return gradient(state, batch)

    run.res.method.gradient = timed
    return run


def lines(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_the_run_ends_within_one_step_of_its_limit_and_the_schedule_stretches(tiny, tiny_path, small_eval_file, tmp_path):
    clock = FakeClock()
    run = budget_run(tiny, tiny_path, small_eval_file, tmp_path / "r", clock, lambda k: 2.0)
    results = run.run(progress=False)
    reserve = RESERVE_FACTOR * run.res.masks.longest_eval + EXPORT_SECONDS
    steps = results["steps"]
    assert steps == math.floor((60.0 - reserve) / 2.0)  # every step costs 2 s; the end is reserved
    assert steps * 2.0 + reserve <= 60.0 < (steps + 1) * 2.0 + reserve  # within one step of the limit
    assert results["time_used"]["seconds"] == pytest.approx(steps * 2.0)
    got = lines(tmp_path / "r")
    assert [ln["step"] for ln in got] == list(range(1, steps + 1))
    cosine = LR_SCHEDULE_FNS["cosine"]
    # from step 1 on, the plan is the whole run: the lr follows a cosine over `steps`, not over --steps 4
    assert [ln["lr"] for ln in got] == pytest.approx([cosine(0.05, k, steps) for k in range(steps)])
    assert all(ln["total_steps"] == steps for ln in got)
    assert got[-1]["val_ppl"] is not None  # the last planned step is validated


def test_a_slower_step_shrinks_the_plan(tiny, tiny_path, small_eval_file, tmp_path):
    clock = FakeClock()
    run = budget_run(tiny, tiny_path, small_eval_file, tmp_path / "r", clock, lambda k: 1.0 if k < 10 else 3.0)
    results = run.run(progress=False)
    got = lines(tmp_path / "r")
    assert got[5]["total_steps"] > results["steps"]  # planned at 1 s a step, then re-planned
    reserve = RESERVE_FACTOR * run.res.masks.longest_eval + EXPORT_SECONDS
    assert abs(results["time_used"]["seconds"] + reserve - 60.0) <= 3.0  # within one (slow) step of the limit


def test_a_resumed_run_plans_what_is_left(tiny, tiny_path, small_eval_file, tmp_path):
    clock = FakeClock()
    whole = budget_run(tiny, tiny_path, small_eval_file, tmp_path / "a", clock, lambda k: 2.0).run(progress=False)
    clock = FakeClock()
    stop = threading.Event()
    run = budget_run(tiny, tiny_path, small_eval_file, tmp_path / "b", clock, lambda k: 2.0)
    run.run(progress=False, observer=lambda report: report.step == 7 and stop.set(), stop=stop)
    assert json.loads(lines(tmp_path / "b")[-1]["step"].__str__()) == 7
    clock.t += 100.0  # the time between the sessions is not the run's
    resumed = budget_run(tiny, tiny_path, small_eval_file, tmp_path / "b", clock, lambda k: 2.0).run(resume=True, progress=False)
    assert resumed["steps"] == whole["steps"]
    assert resumed["time_used"]["seconds"] == pytest.approx(whole["time_used"]["seconds"])


def test_a_budget_the_first_step_exhausts_ends_there_and_says_so(tiny, tiny_path, small_eval_file, tmp_path):
    clock, logged = FakeClock(), []
    results = budget_run(tiny, tiny_path, small_eval_file, tmp_path / "r", clock, lambda k: 70.0,
                         log=logged.append).run(progress=False)
    assert results["steps"] == 1  # (a first step is always taken: its time is what the plan is made from)
    said = [m for m in logged if m.startswith("time budget: ") and "no more steps" in m]
    assert len(said) == 1 and "at step 1" in said[0]


def exported_is_init_mask(out) -> bool:
    from safetensors.torch import load_file

    tensors = load_file(str(out / "masks.safetensors"))
    units = [k.split(".", 1)[1] for k in tensors if k.startswith("masks.")]
    return bool(units) and all(torch.equal(tensors[f"masks.{u}"], tensors[f"init_masks.{u}"]) for u in units)


def test_a_budget_whose_plan_fits_fewer_steps_than_pay_takes_none_and_exports_the_init(tiny, tiny_path, small_eval_file,
                                                                                      tmp_path, monkeypatch):
    """Issue 65: a plan that fits fewer than MIN_STEPS steps (a first run on a slower machine fitted 0, took 1, and
    ended 5 % above its init) buys no step, where the budget is what binds (here 2.5 of --steps 4): the run says so
    before the steps, takes none and exports its init mask."""
    import engine.run.loop as pruner
    from engine.hooks.time_budget import MIN_STEPS
    from engine.run.plan import plan_with_steps

    monkeypatch.setattr(pruner, "plan_with_steps",
                        lambda run, done_steps=None: (plan_with_steps(run, done_steps)[0], 2.5))
    clock, logged = FakeClock(), []
    results = budget_run(tiny, tiny_path, small_eval_file, tmp_path / "r", clock, lambda k: 1.0,
                         log=logged.append).run(progress=False)
    assert results["steps"] == 0 and not (tmp_path / "r" / "metrics.jsonl").read_text().strip()
    said = [m for m in logged if "fewer than the" in m]
    assert len(said) == 1 and "about 2.5 steps fit" in said[0] and f"the {MIN_STEPS} measured" in said[0]
    assert exported_is_init_mask(tmp_path / "r")


def test_a_budget_that_fitted_fewer_steps_than_pay_exports_the_init_mask(tiny, tiny_path, small_eval_file, tmp_path):
    """The plan fitted enough, the machine was slower (the first step took the whole budget): the one step is not
    exported; the init mask is, and the run says why. With MIN_STEPS or more, the steps' mask is kept."""
    from engine.hooks.time_budget import MIN_STEPS

    clock, logged = FakeClock(), []
    results = budget_run(tiny, tiny_path, small_eval_file, tmp_path / "r", clock, lambda k: 70.0,
                         log=logged.append).run(progress=False)
    assert results["steps"] == 1 and exported_is_init_mask(tmp_path / "r")
    assert results["mask_step"] == 0  # (results.json names the step whose mask was exported: the init's)
    assert any("1 step fitted" in m and "init mask is exported" in m for m in logged)
    clock = FakeClock()
    results = budget_run(tiny, tiny_path, small_eval_file, tmp_path / "long", clock, lambda k: 2.0,
                         log=logged.append).run(progress=False)
    assert results["steps"] >= MIN_STEPS and not any("init mask is exported" in m for m in logged[-5:])


def test_time_budget_is_checked(tiny_path, small_eval_file):
    for bad in (0.0, -1.0):
        with pytest.raises(UserError, match="time budget must be above 0"):
            small_config(tiny_path, small_eval_file, time_budget=bad).validate()
    with pytest.raises(UserError, match="random-progressive"):
        small_config(tiny_path, small_eval_file, time_budget=1.0, init="random-progressive").validate()


def test_work_in_batches_takes_its_share_of_the_time_left_and_never_fewer_than_the_minimum():
    assert share_of_time_left(SimpleNamespace(hooks=[]), 1 / 3, 8) is None  # no budget: the work runs to its end
    clock = FakeClock()
    hook = TimeBudget(SimpleNamespace(started=0.0))
    hook.limit, hook.before, hook.clock = 600.0, 0.0, clock
    clock.t = 100.0  # 500 s left: a third is 166.7 s

    def batches_done(minimum, cost=20.0):
        clock.t = 100.0
        stop = share_of_time_left(SimpleNamespace(hooks=[hook], world=World()), 1 / 3, minimum)
        done = 0
        while True:
            clock.t += cost
            done += 1
            if stop(done):
                return done, clock.t - 100.0

    done, spent = batches_done(minimum=2)
    assert (done, spent) == (8, 160.0)  # a 9th batch would pass 166.7 s
    assert batches_done(minimum=12) == (12, 240.0)  # the minimum wins over the share


def test_the_time_budgets_help_states_the_minimum_the_hook_applies():
    """--time-budget's help names the fewest steps a budget buys: the hook's MIN_STEPS, not a copy that drifts."""
    import dataclasses

    from engine.settings.config import PruneConfig
    from engine.hooks.time_budget import MIN_STEPS

    field = next(f for f in dataclasses.fields(PruneConfig) if f.name == "time_budget")
    assert f"fewer than {MIN_STEPS} steps" in " ".join(str(v) for v in field.metadata.values())


def test_a_short_schedule_never_steps_further_than_a_24_step_runs_first_step():
    """Issue 65: with few steps left the schedule is safe: every learning rate of an 8-step (or 2-step) schedule is
    at most the 24-step schedule's first, which is the same learning rate (the schedules start at --lr)."""
    from engine.algo.policy import LR_SCHEDULE_FNS

    for name, fn in LR_SCHEDULE_FNS.items():
        first = fn(0.1, 0, 24)
        for length in (2, 8):
            assert fn(0.1, 0, length) == pytest.approx(first), name
            assert all(fn(0.1, i, length) <= first + 1e-12 for i in range(length)), name
