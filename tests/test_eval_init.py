"""No evaluation that nobody asked for (issue 51): under --time-budget the init mask's perplexity is not evaluated
unless --eval-init asks for it (results.json: ppl_init null, the CLI's last lines say it was skipped); the dense
figure stays cached, with the seconds its evaluation took, which the budget reserves for the last evaluation."""

from __future__ import annotations

import json
import re

import pytest

from engine.storage import ppl_cache
from engine.settings.config import PruneConfig
from engine.run.loop import PruneRun
from engine.run.initialise import fresh_state

from conftest import SMALL_CALIB
from test_pruner import small_config
from test_time_budget import FakeClock, budget_run, plan_fits_no_count  # noqa: F401  (autouse: the fake clock plans)


@pytest.mark.parametrize("eval_init, budget, evaluates", [(None, None, True), (None, 10.0, False), (True, 10.0, True),
                                                           (False, None, False), (True, None, True)])
def test_the_init_is_evaluated_unless_a_budget_runs_or_it_is_turned_off(eval_init, budget, evaluates):
    assert PruneConfig(eval_init=eval_init, time_budget=budget).evaluates_init is evaluates


def test_the_flags_set_it_and_neither_leaves_it_to_the_budget():
    from engine.cli import _config_from_args, parse_args

    def config(*flags):
        return _config_from_args(parse_args(["prune", "--out", "x", *flags])).resolved()

    assert config().eval_init is None and config().evaluates_init
    assert config("--time-budget", "5").evaluates_init is False
    assert config("--time-budget", "5", "--eval-init").eval_init is True
    assert config("--no-eval-init").evaluates_init is False


def evaluated(logs: list[str]) -> list[str]:
    return [m.split("evaluating ")[1].split(" perplexity")[0] for m in logs if m.startswith("evaluating ")]


@pytest.mark.parametrize("eval_init", [None, True])
def test_a_budgeted_run_skips_the_init_s_evaluation_unless_asked(eval_init, tiny, tiny_path, small_eval_file, tmp_path):
    logs = []
    run = budget_run(tiny, tiny_path, small_eval_file, tmp_path / "r", FakeClock(), lambda k: 20.0, log=logs.append,
                     eval_init=eval_init)
    results = run.run(progress=False)
    saved = json.loads((tmp_path / "r" / "results.json").read_text())
    if eval_init:
        assert isinstance(results["ppl_init"], float) and saved["ppl_init"] == results["ppl_init"]
        assert evaluated(logs)[:2] == ["dense", "init"]
    else:
        assert results["ppl_init"] is None and saved["ppl_init"] is None
        assert "init perplexity: skipped (--eval-init evaluates it)" in logs
        assert "init" not in evaluated(logs) and evaluated(logs)[0] == "dense"
    assert isinstance(results["ppl_pruned"], float) and results["steps"] >= 1
    from engine.ui.checks import results_problem

    assert results_problem(saved) is None  # (the app lists the run as finished, not damaged)
    assert results_problem({**saved, "ppl_init": "x"}) is not None


def test_the_dense_cache_keeps_its_evaluation_s_seconds(tmp_path, monkeypatch):
    monkeypatch.setenv("PG_PRUNE_CACHE", str(tmp_path))
    ppl_cache.store("k", 12.5, 3.25)
    assert ppl_cache.lookup("k") == 12.5 and ppl_cache.lookup_seconds("k") == 3.25
    (tmp_path / "dense-old.json").write_text(json.dumps({"ppl_dense": 9.0}))  # (an entry from before the seconds)
    assert ppl_cache.lookup("old") == 9.0 and ppl_cache.lookup_seconds("old") is None
    (tmp_path / "dense-bad.json").write_text(json.dumps({"ppl_dense": 9.0, "seconds": "x"}))
    assert ppl_cache.lookup_seconds("bad") is None and ppl_cache.lookup_seconds("missing") is None


def test_a_budgeted_run_reserves_the_cached_dense_evaluation_s_seconds(tiny_path, small_eval_file, tmp_path):
    """From disk (the dense figure cached): the first run measures the dense model and caches its figure and
    seconds; the next takes both (no evaluation before the steps at all), and its budget's reserve is those seconds;
    an entry without seconds is measured again under a budget that evaluates nothing else first."""
    def start(name):
        logs = []
        run = PruneRun(small_config(tiny_path, small_eval_file, time_budget=5.0), tmp_path / name, log=logs.append)
        run.res.loop.progress = False
        state = fresh_state(run.res, run.call_hooks)
        return run, state, logs

    run, state, logs = start("a")
    assert evaluated(logs) == ["dense"] and state.ppl_init is None
    entry = next(ppl_cache.cache_dir().glob("dense-*.json"))
    seconds = json.loads(entry.read_text())["seconds"]
    assert seconds > 0
    run, state, logs = start("b")
    assert evaluated(logs) == [] and any("(cached" in m for m in logs)
    assert run.res.masks.longest_eval == pytest.approx(seconds)
    entry.write_text(json.dumps({"ppl_dense": state.ppl_dense}))
    run, state, logs = start("c")
    assert evaluated(logs) == ["dense"] and json.loads(entry.read_text())["seconds"] > 0


def test_the_cli_says_the_init_was_skipped_and_where_the_time_went(tiny_path, small_eval_file, tmp_path, capsys):
    """The CLI's last lines under --time-budget: the init's perplexity skipped, and the wall time of every phase
    results.json's seconds_by_phase has (those of a second or more: the log's phase line)."""
    from engine.cli import main

    out = tmp_path / "r"
    code = main(["prune", "--model", str(tiny_path), "--units", "heads,channels", "--time-budget", "0.3",
                 "--steps", "2", "--max-windows", "2", "--init-batches", "1", "--batch-size", "2", "--seqlen", "32",
                 "--eval-seqlen", "32", "--reconstruct-batches", "1", "--calib", str(SMALL_CALIB), "--eval-data",
                 str(small_eval_file), "--out", str(out)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["ppl_init"] is None
    assert re.search(r"dense [\d.]+ \| init \(flap\) skipped \(--eval-init\) \| pruned [\d.]+", captured.out), captured.out
    phases = [ln for ln in (captured.out + captured.err).splitlines() if ln.startswith("wall time ")]
    assert phases, captured.err[-2000:]
    for phase, seconds in results["seconds_by_phase"].items():
        if phase != "total" and seconds >= 1:
            assert f"{phase} {seconds:.0f}" in phases[-1] or f"{phase} {round(seconds)}" in phases[-1], (phase, phases)
