"""Honest time (issue 49): the plan a run starts with names the phases the run records (engine/run/phases.py), comes
from one cost model (engine/plan/forecast.py), is kept in results.json beside what the run measured, and a job shows its
phase and the time left by that plan before its first step."""

from __future__ import annotations

import time

import pytest

from engine.settings.config import PRESETS, PruneConfig
from engine.run.phases import PhaseClock
from engine.plan.forecast import (MIX_REFITS, RUN_PHASES, model_skeleton, phase_tokens, plan_time, refit_tokens,
                         statistics_plan, validation_checks)
from engine.run.loop import PruneRun
from engine.run.plan import PLAN_KEY, phase_progress, phase_status, plan_lines, plan_rows, start_plan

from conftest import pg_config
from test_pruner import small_config


def tiny_run(tiny, config, out) -> dict:
    return PruneRun(config, out, model=tiny[0], tokenizer=tiny[1], log=lambda m: None).run(progress=False)


@pytest.mark.parametrize("preset", ["joint", None], ids=["default preset", "heads and channels"])
def test_the_plan_names_the_phases_a_run_records(tiny, tiny_path, small_eval_file, tmp_path, preset):
    """The CLI's default preset (the joint: layers, KV groups and channels, refit on) and the settings' own
    defaults (KV groups and channels): the plan the engine records at the start has exactly the phases the run's
    seconds_by_phase has, and the plan made from the config alone (the app's panel) too."""
    config = small_config(tiny_path, small_eval_file, **{**(PRESETS[preset] if preset else {}), "init_batches": 2})
    results = tiny_run(tiny, config, tmp_path / "r")
    recorded, plan = results["seconds_by_phase"], results[PLAN_KEY]
    assert list(plan) == [k for k in (*RUN_PHASES, "other", "total") if k in plan]  # (the run's order)
    assert set(plan) == set(recorded), (plan, recorded)
    panel = plan_time(config, model_skeleton(str(tiny_path)), 1e-5, "test").by_phase()
    assert set(panel) == set(recorded)
    assert plan["total"] == pytest.approx(sum(v for k, v in plan.items() if k != "total"), abs=0.3)


def test_the_plan_counts_the_refit_and_its_statistics(tiny_path):
    """--reconstruct (on by default) adds its statistics and its solves; without it they are gone, and a refit
    per held-out check (--val-refit) and per joint-mix candidate (--mix-refit) is counted."""
    skeleton = model_skeleton(str(tiny_path))
    on, off = (phase_tokens(pg_config(model=str(tiny_path), reconstruct=r), skeleton) for r in (True, False))
    phase = statistics_plan(pg_config(model=str(tiny_path)))[0]
    assert on[phase] > 0 and on["refit"] > 0 and "refit" not in off
    no_val_refit = phase_tokens(pg_config(model=str(tiny_path), val_refit=False), skeleton)
    checks = validation_checks(pg_config(model=str(tiny_path)))
    one = refit_tokens(pg_config(model=str(tiny_path)), skeleton)
    assert checks == 1 + 50 // 10 and on["refit"] - no_val_refit["refit"] == pytest.approx(checks * one)
    joint = {**PRESETS["joint"], "model": str(tiny_path), "prune_ratio": 0.7}  # (a layer can go: two counts scored)
    joint.pop("mix_refit", None)
    mix_refit, plain = (phase_tokens(PruneConfig(**joint, mix_refit=m), skeleton) for m in (True, False))
    assert mix_refit["refit"] == plain["refit"] and mix_refit["joint mix"] == plain["joint mix"] > 0
    assert mix_refit[MIX_REFITS] == pytest.approx(2 * refit_tokens(PruneConfig(**joint), skeleton))  # (two counts)
    assert (plan_time(PruneConfig(**joint, mix_refit=True), skeleton, 1e-4, "t").phases["joint mix"]
            > plan_time(PruneConfig(**joint), skeleton, 1e-4, "t").phases["joint mix"])
    assert refit_tokens(PruneConfig(model=str(tiny_path), prune_ratio=0.5), skeleton) != one  # (in the widths kept)


def test_a_cached_dense_perplexity_and_a_resumed_session_plan_less(tiny_path):
    skeleton = model_skeleton(str(tiny_path))
    config = pg_config(model=str(tiny_path))
    fresh, cached = phase_tokens(config, skeleton), phase_tokens(config, skeleton, dense_cached=True)
    windows = config.max_windows * config.eval_seqlen
    assert fresh["evaluations"] - cached["evaluations"] == pytest.approx(windows)  # (one dense evaluation)
    resumed = phase_tokens(config, skeleton, done_steps=40)
    assert "init metric" not in resumed and resumed["steps"] == pytest.approx(fresh["steps"] / 5)
    assert validation_checks(config, 40) == 1  # step 50's check only


def test_a_resumed_session_plans_the_steps_left(tiny, tiny_path, small_eval_file, tmp_path):
    """A run stopped after step 2 of 6 and resumed: the second session plans what it does (no init metric, no
    joint mix, 4 steps), under the names it records."""
    import threading

    config = small_config(tiny_path, small_eval_file, reconstruct=True, reconstruct_batches=2, val_every=2)
    stop = threading.Event()
    PruneRun(config, tmp_path / "r", model=tiny[0], tokenizer=tiny[1], log=lambda m: None).run(
        progress=False, stop=stop, observer=lambda r: stop.set() if r.step == 2 else None)
    run = PruneRun(config, tmp_path / "r", model=tiny[0], tokenizer=tiny[1], log=lambda m: None)
    fresh = start_plan(run.res)  # (what a fresh run of these settings plans: run() makes it before a fresh run's work)
    assert run.res.loop.plan is None  # (a run plans when it runs: a resumed one once its checkpoint is read)
    results = run.run(resume=True, progress=False)
    plan, recorded = results[PLAN_KEY], results["seconds_by_phase"]
    assert "init metric" in fresh and "init metric" not in plan and set(plan) == set(recorded)
    skeleton = model_skeleton(str(tiny_path))
    # (4 of the 6 steps' forwards; the seconds are tokens times a probe's rate, and two probes on a busy machine
    # differ, so the tokens are compared, and the plan's steps are some)
    assert phase_tokens(config, skeleton, done_steps=2)["steps"] == pytest.approx(
        phase_tokens(config, skeleton)["steps"] * 4 / 6) and plan["steps"] > 0
    tokens = phase_tokens(config, skeleton, done_steps=2)
    assert tokens["validation"] == 2 * config.val_batches * config.batch_size * config.seqlen  # (steps 4 and 6)


def test_loading_a_gguf_costs_more_than_its_copy_and_a_model_in_memory_less(tiny_path):
    skeleton = model_skeleton(str(tiny_path))
    config = PruneConfig(model=str(tiny_path))
    read, dequantised, given = (plan_time(config, skeleton, 1e-5, "t", in_memory=m, dequantise=d).phases["load"]
                                for m, d in ((False, False), (False, True), (True, None)))
    assert given < read < dequantised


def test_phase_progress_counts_what_is_left_by_the_plan():
    plan = {"load": 10.0, "statistics": 20.0, "steps": 30.0, "other": 0.0, "total": 60.0}
    left, run_left = phase_progress(plan, {"load": 12.0, "statistics": 5.0}, "statistics")
    assert left == 15.0 and run_left == 45.0  # (load past its plan: nothing left there)
    t = [100.0]
    clock = PhaseClock(started=90.0, clock=lambda: t[0])
    with clock("statistics"):
        t[0] += 4
        status = phase_status(plan, clock)
    assert status == {"phase": "statistics", "seconds": 4.0, "planned": 20.0, "phase_left": 16.0, "run_left": 46.0,
                      "after_steps": 0.0}
    plan = {**plan, "evaluations": 9.0, "export": 2.0}  # (the final evaluation's share left, and the export)
    assert phase_status(plan, clock)["after_steps"] == 11.0


def test_plan_and_actual_side_by_side():
    plan = {"load": 10.0, "statistics": 20.0, "steps": 30.0, "export": 0.4, "other": 0.0, "total": 60.4}
    actual = {"load": 12.0, "statistics": 25.0, "evaluations": 3.0, "steps": 33.0, "export": 0.2, "other": 0.1,
              "total": 73.3}
    rows = plan_rows(plan, actual)
    assert [r[0] for r in rows] == ["load", "statistics", "evaluations", "steps", "export", "other", "total"]
    assert rows[2] == ("evaluations", None, 3.0) and rows[-1] == ("total", 60.4, 73.3)
    lines = plan_lines(plan, actual)
    assert any(ln.split()[:3] == ["statistics", "20", "/"] and "1.25x" in ln for ln in lines)
    assert not any(ln.split()[0] == "export" for ln in lines[1:])  # (under a second on both sides)


def test_a_job_shows_its_phase_and_eta_before_the_first_step(tiny_path, small_eval_file, tmp_path):
    """The app's job (engine/ui/jobs.py): before the first step its snapshot carries the run's plan and the phase
    open now, with its seconds so far and the time left by the plan."""
    from engine.ui.jobs import DONE, JobManager

    jobs = JobManager(keep_model=False)
    jobs.start(small_config(tiny_path, small_eval_file, reconstruct=True, reconstruct_batches=4, steps=3),
               tmp_path / "job")
    seen = []
    while (snap := jobs.snapshot()).active:
        if snap.clock is not None and not snap.history:
            seen.append(snap)
        time.sleep(0.01)
    assert jobs.wait().status == DONE
    assert seen, "the job never showed a phase before its first step"
    c, plan = seen[-1].clock, seen[-1].plan
    assert c["phase"] in plan and c["planned"] == plan[c["phase"]] and c["run_left"] is not None
    assert jobs.snapshot().result[PLAN_KEY] == plan


def test_off_plan_names_the_phases_outside_the_band():
    """bench/plan_phases.py's verdict (the plan within 30 % per phase is a speed figure, so it is printed by the
    bench script, not asserted here): phases under a second or 5 % of the run are left out, and a phase the plan
    lacks is off."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from plan_phases import off_plan

    plan = {"load": 2.0, "steps": 10.0, "evaluations": 5.0, "mix": 0.5, "total": 17.5}
    actual = {"load": 2.5, "steps": 14.0, "evaluations": 5.1, "mix": 0.9, "refit": 3.0, "other": 9.0, "total": 34.5}
    assert off_plan(plan, actual) == {"steps": (10.0, 14.0), "refit": (0.0, 3.0), "total": (17.5, 34.5)}


def test_the_finished_run_shows_plan_and_actual_per_phase(tiny, tiny_path, small_eval_file, tmp_path, monkeypatch):
    """The app's finished-run view (pages/_ui.py) shows the engine's plan beside the measured seconds, per phase,
    as results.json holds them (no figure computed in the page)."""
    from pathlib import Path

    from streamlit.testing.v1 import AppTest

    runs = tmp_path / "runs"
    monkeypatch.setenv("PG_PRUNE_RUNS_DIR", str(runs))
    results = tiny_run(tiny, small_config(tiny_path, small_eval_file, reconstruct=True, reconstruct_batches=2),
                       runs / "done")
    at = AppTest.from_file(str(Path(__file__).resolve().parent.parent / "app.py"), default_timeout=120)
    at.run()
    at.session_state["selected_run"] = str(runs / "done")
    at.switch_page("pages/prune.py").run()
    assert not at.exception, at.exception
    plan, actual = results[PLAN_KEY], results["seconds_by_phase"]
    from pages._ui import fmt_seconds

    label = next(e.label for e in at.expander if e.label.startswith("Time: planned"))
    assert label == f"Time: planned {fmt_seconds(plan['total'])}, measured {fmt_seconds(actual['total'])}"
    table = next(d.value for d in at.dataframe)
    assert list(table["phase"]) == [k for k, _, _ in plan_rows(plan, actual)]
    assert list(table["planned"]) == [fmt_seconds(plan.get(k)) for k in table["phase"]]


def test_a_machine_busier_than_its_cached_probe_is_said_and_planned_at_todays_rate(tiny, tiny_path, small_eval_file,
                                                                                   tmp_path, monkeypatch):
    """A cached probe 10 times faster than a forward now: the run's plan says the machine is busier, and plans at
    the rate measured now (the cache keeps its own); a cached rate near today's is used as it is."""
    from engine.run import plan as runplan
    from engine.plan.forecast import cached_probe, probe_key
    from engine.storage.ppl_cache import cache_dir
    from engine.run.loop import PruneRun

    from conftest import tiny_config

    assert runplan.busier_line(1.4e-5, 1e-5) is None
    assert "busier than when it was probed" in runplan.busier_line(3e-5, 1e-5) and "3.0x the cached" in \
        runplan.busier_line(3e-5, 1e-5)
    monkeypatch.setenv("PG_PRUNE_CACHE", str(tmp_path / "cache"))
    config = tiny_config(small_eval_file, steps=1)
    logged = []
    run = PruneRun(config, tmp_path / "r", model=tiny[0], tokenizer=tiny[1], log=logged.append)
    rate, _ = runplan.run_rate(run.res, run_skeleton(run))  # (the first: probed and cached)
    key = probe_key(config.model, config.dtype, config.batch_size, config.seqlen, None)
    cached = cached_probe(cache_dir(), key)
    assert cached == rate
    from engine.plan.forecast import _PROBE_FILE

    table = tmp_path / "cache" / _PROBE_FILE
    import json

    data = json.loads(table.read_text())
    data[key] = rate / 10  # (as if probed on an idle machine ten times faster)
    table.write_text(json.dumps(data))
    now, source = runplan.run_rate(run.res, run_skeleton(run))
    assert "busier" in source and now > rate / 10 * 1.5 and any("busier than when it was probed" in m for m in logged)
    assert cached_probe(cache_dir(), key) == rate / 10  # (today's rate is never cached)


def run_skeleton(run):
    from engine.plan.forecast import skeleton_of

    return skeleton_of(run.res.model, run.res.config.model, "folder")
