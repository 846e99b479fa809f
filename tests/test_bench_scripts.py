"""Every bench script still runs (issue 51: `python bench/step_cost.py` without --ranks had been passing --ranks=None
to its workers, which died, and nothing noticed). Each script's --help prints its usage; the scripts that take a
model run their plain invocation on the tiny model (one subprocess each, all started at once); those that tabulate
run folders or list their cells do so on an empty folder. The default-model runs themselves are not repeated."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, SMALL_CALIB, TINY_MODEL, WIKI_RAW, clean_env

BENCH = REPO / "bench"


def is_script(path: Path) -> bool:
    """A bench file one runs (a __main__ block, or a script that reads its arguments at the top level); the
    others (cli_common.py, widths_after_layers.py) are modules the scripts import."""
    text = path.read_text(encoding="utf-8")
    return '__name__ == "__main__"' in text or "\nif len(sys.argv)" in text or "\ncell = Path(sys.argv" in text


SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if is_script(p))
TINY = str(TINY_MODEL)
# the plain invocation of each script that takes a model, on the tiny model (small batches: the run, not a measure)
PLAIN_RUNS = {
    # the regression: no --ranks (the workers got --ranks=None); one executor, no Gumbel: three workers, not six
    "step_cost.py": (["--model", TINY, "--repeats", "1", "--batch-size", "2", "--seqlen", "32", "--executors", "sliced",
                      "--no-gumbel"], ["| sliced |", "(floor: N_s forwards"]),
    "layer_metrics.py": (["--model", TINY, "--batch-size", "2", "--seqlen", "32"], ["largest loss difference"]),
    "gumbel_lr.py": (["--model", TINY, "--batches", "1"], ["Gumbel lr matching PG"]),  # (it had rotted: the gumbel
    # method was made from the run, not its step context)
    "plain_copy.py": (["{tmp}/copy", "--model", TINY], ["plain copy in"]),
    "plan_phases.py": (["--model", TINY], ["| measured / planned |", "outside 0.7x-1.3x of the plan"]),
    "eval_dtype.py": ([TINY, "--max-windows", "4", "--seqlen", "32", "--threads", "1"], ["| model |", "largest change"]),
    "self_text_speed.py": (["--model", TINY, "--docs", "4", "--tokens", "8", "--batches", "2,4", "--threads", "1"],
                           ["| batch | dtype | seconds |", "probe", "x |"]),
    "runs_page.py": (["--count", "3"], ["with 3 finished runs on disk", "second render:", "cache emptied:"]),
}


def test_the_script_list_is_complete():
    """Every runnable bench script is covered by the --help test below (a new one joins by being a script)."""
    assert {"step_cost.py", "compare_table.py", "refit_pruned_inputs.py", "layer_metrics.py"} <= set(SCRIPTS)
    assert "cli_common.py" not in SCRIPTS and set(PLAIN_RUNS) <= set(SCRIPTS)


def run_in_process(name: str, argv: list[str], monkeypatch) -> int:
    """`python bench/NAME ARGV` in this process (the engine imported once for all of them): its exit status."""
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [str(BENCH / name), *argv])
    try:
        runpy.run_path(str(BENCH / name), run_name="__main__")
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_bench_script_prints_its_usage(name, monkeypatch, capsys):
    assert run_in_process(name, ["--help"], monkeypatch) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and name in out.splitlines()[0], out[:300]


@pytest.mark.parametrize("name", ["compare_table.py", "paper_tables.py", "cpu_curve.py"])
def test_the_table_benches_list_their_cells(name, monkeypatch, capsys, tmp_path):
    """--list reads the cell definitions (each a run's settings) without running one: every cell to run."""
    assert run_in_process(name, ["--list", "--out", str(tmp_path)], monkeypatch) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) > 3 and all(("todo" in ln or "to run" in ln) and "done" not in ln for ln in lines), lines[:5]


@pytest.mark.parametrize("name", [n for n in SCRIPTS if '"--runs"' in (BENCH / n).read_text(encoding="utf-8")])
def test_the_run_folder_tables_say_what_is_missing(name, monkeypatch, capsys, tmp_path):
    assert run_in_process(name, ["--runs", str(tmp_path)], monkeypatch) == 0
    assert "n/a" in capsys.readouterr().out


@pytest.fixture(scope="module")
def plain_runs(tmp_path_factory):
    """Every PLAIN_RUNS invocation started at once, each in its own process (as a user runs it), one thread each."""
    tmp = tmp_path_factory.mktemp("bench")
    data = tmp / "data"  # (the default data folder's layout, small: tokenizing the full files would be most of a run)
    (data / "c4").mkdir(parents=True)
    (data / "c4" / SMALL_CALIB.name).symlink_to(SMALL_CALIB)
    (data / "wikitext-2-raw-v1").mkdir()
    (data / "wikitext-2-raw-v1" / "wiki.test.raw").write_text(WIKI_RAW.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    env = clean_env(OMP_NUM_THREADS="1", PG_PRUNE_CACHE=str(tmp / "cache"), PG_PRUNE_DATA_DIR=str(data))
    procs = {}
    for name, (argv, _) in PLAIN_RUNS.items():
        procs[name] = subprocess.Popen([sys.executable, str(BENCH / name), *(a.replace("{tmp}", str(tmp)) for a in argv)],
                                       cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.mark.parametrize("name", list(PLAIN_RUNS))
def test_each_bench_runs_its_plain_invocation_on_the_tiny_model(name, plain_runs):
    out, err = plain_runs[name].communicate(timeout=600)
    assert plain_runs[name].returncode == 0, err[-3000:]
    for expected in PLAIN_RUNS[name][1]:
        assert expected in out, out


def test_step_cost_passes_its_settings_to_its_workers_as_they_parse_them(monkeypatch):
    """The flags a worker gets parse back to the parent's settings, and an unset one (None) is never passed."""
    monkeypatch.syspath_prepend(str(BENCH))
    import step_cost

    parser = step_cost.build_parser()
    for argv in ([], ["--ranks", "1,2", "--executors", "sliced,batched", "--threads-per-rank", "2"],
                 ["--random-config", "1b", "--no-gumbel", "--device", "auto"],
                 ["--reward", "kl", "--step-dtypes", "float32,bfloat16", "--executors", "sliced"]):
        parent = parser.parse_args(argv)
        flags = step_cost.worker_flags(parent)
        assert not any(f.endswith("=None") for f in flags), flags
        worker = parser.parse_args(["--worker", "time", *flags])
        for key, value in vars(parent).items():
            if key not in step_cost.PARENT_ONLY:
                assert getattr(worker, key) == value, key


def test_the_reward_study_report_puts_a_pg_cells_refit_init_beside_its_final_mask(monkeypatch, tmp_path, capsys):
    """bench/reward_study.py report: a PG cell's row has its init refit (the curve stage's step 0) where the curve ran,
    and an empty cell there where it did not."""
    import json

    monkeypatch.syspath_prepend(str(BENCH))
    import reward_study

    monkeypatch.setattr(reward_study, "OUT", tmp_path)
    for name, curve in (("r30-s0-kl-data-24-alloc", {"points": {"0": {"wikitext": 143.96, "c4": 97.39}}}),
                        ("r30-s0-ce-data-40", None)):
        cell = tmp_path / "pg" / name
        cell.mkdir(parents=True)
        (cell / "heldout.json").write_text(json.dumps({"wikitext": 132.74, "c4": 90.21, "cpu_seconds_run": 1878.0}))
        (cell / "results.json").write_text(json.dumps({"steps": 24, "ppl_init": 177.09}))
        if curve:
            (cell / "curve.json").write_text(json.dumps(curve))
    reward_study.report(None)
    rows = {ln.split(" | ")[0].strip("| "): ln for ln in (tmp_path / "table.md").read_text().splitlines()
            if ln.startswith("| r30")}
    assert "| 143.96 / 97.39 | 132.74 | 90.21 |" in rows["r30-s0-kl-data-24-alloc"]
    assert "| 177.09 |  | 132.74 |" in rows["r30-s0-ce-data-40"]


def test_the_reward_study_figure_draws_each_cells_change_from_its_init_against_cpu_minutes(monkeypatch, tmp_path):
    """bench/reward_study.py report writes curve.svg: one polyline a cell and measure, each point the change (%) of a
    step's mask from the cell's step 0, at the CPU minutes that step was reached; seeds of a group share a colour."""
    import json
    import re

    monkeypatch.syspath_prepend(str(BENCH))
    import reward_study

    monkeypatch.setattr(reward_study, "OUT", tmp_path)
    for seed, end in ((0, 90.0), (1, 110.0)):
        cell = tmp_path / "pg" / f"r30-s{seed}-kl-data-24-alloc"
        cell.mkdir(parents=True)
        (cell / "heldout.json").write_text(json.dumps({"wikitext": end, "c4": 80.0, "cpu_seconds_run": 600.0}))
        (cell / "results.json").write_text(json.dumps({"steps": 24, "ppl_init": 150.0}))
        (cell / "curve.json").write_text(json.dumps({"points": {
            "0": {"wikitext": 100.0, "c4": 80.0, "cpu_minutes": 10.0},
            "24": {"wikitext": end, "c4": 76.0, "cpu_minutes": 30.0}}}))
    reward_study.report(None)
    svg = (tmp_path / "curve.svg").read_text()
    lines = re.findall(r'<polyline points="([^"]+)" fill="none" stroke="([^"]+)"', svg)
    assert len(lines) == 4  # 2 cells x (WikiText, held-out C4)
    assert len({color for _, color in lines}) == 1  # one group: the two seeds share its colour
    assert svg.count("30 %, kl, data, alloc") == 1  # its legend entry, once
    # seed 0's WikiText line: step 0 on the zero line, step 24 (-10 %) below it and to its right
    (x0, y0), (x1, y1) = [tuple(map(float, p.split(","))) for p in lines[0][0].split()]
    zero = [float(m) for m in re.findall(r'y1="([0-9.]+)" y2="[0-9.]+" stroke="#888"/>\n<text x="48" y="[0-9.]+" '
                                         r'text-anchor="end">0</text>', svg)]
    assert y0 == zero[0] and y1 > y0 and x1 > x0


def test_a_stopped_reward_study_run_keeps_its_minutes_for_the_run_that_resumes_it(monkeypatch, tmp_path):
    """bench/reward_study.py pg: a run stopped before its end (SIGTERM, its checkpoint saved) adds its CPU seconds to
    heldout.json's cpu_seconds_run and its wall seconds to wall_seconds_earlier, twice over for two stops; the
    finished run's export then adds its own CPU seconds to the same count."""
    import json

    monkeypatch.syspath_prepend(str(BENCH))
    import reward_study

    cell = tmp_path / "cell"
    cell.mkdir()
    reward_study.record_session(cell, 600.0, 620.0)
    reward_study.record_session(cell, 300.0, 310.0)
    ev = json.loads((cell / "heldout.json").read_text())
    assert ev == {"cpu_seconds_run": 900.0, "wall_seconds_earlier": 930.0}


def test_the_reward_studys_heldout_stage_measures_any_finished_run_and_refuses_the_rest(monkeypatch, tmp_path):
    """bench/reward_study.py heldout RUN...: a run made outside the study (the default command's) gets the cells'
    held-out measures in RUN/heldout.json (WikiText from its results.json, held-out C4 of its export) without a
    CPU count it does not know; a folder that is not a finished run with its export is refused with one error line
    before any run is measured."""
    import argparse
    import json

    import engine.model.loading

    monkeypatch.syspath_prepend(str(BENCH))
    import reward_study

    loaded = []
    monkeypatch.setattr(engine.model.loading, "resolve_model", lambda path: path)
    monkeypatch.setattr(engine.model.loading, "load_model", lambda path: (loaded.append(path) or "model", "tok"))
    monkeypatch.setattr(reward_study, "heldout_c4_windows", lambda tok: ["w"] if tok == "tok" else None)
    monkeypatch.setattr(reward_study, "windows_ppl", lambda model, windows, loss: 7.25 if windows == ["w"] else 0.0)
    runs = []
    for name, ppl in (("a", 12.5), ("b", 20.0)):
        (tmp_path / name / "model").mkdir(parents=True)
        (tmp_path / name / "results.json").write_text(json.dumps({"ppl_pruned": ppl}))
        runs.append(tmp_path / name)
    with pytest.raises(SystemExit, match="^error: not a finished run .*nowhere"):
        reward_study.heldout(argparse.Namespace(runs=[*runs, tmp_path / "nowhere"], zeroshot=False))
    assert loaded == [] and not (runs[0] / "heldout.json").exists()
    reward_study.heldout(argparse.Namespace(runs=runs, zeroshot=False))
    assert loaded == [str(r / "model") for r in runs]
    for run_, ppl in zip(runs, (12.5, 20.0)):
        ev = json.loads((run_ / "heldout.json").read_text())
        assert (ev["wikitext"], ev["c4"]) == (ppl, 7.25) and "cpu_seconds_run" not in ev and "zeroshot" not in ev


def test_a_reward_study_cell_runs_for_its_steps_or_its_time_budget(monkeypatch, tmp_path):
    """bench/reward_study.py pg --budget M: the run gets --time-budget M in place of --steps and the cell's name
    holds b<M> where the steps were, so a budget column and a step count of the same row are different cells; the
    engine's parser takes the cell's command line, and the figure draws both on their row's line."""
    import argparse

    monkeypatch.syspath_prepend(str(BENCH))
    import reward_study

    monkeypatch.setattr(reward_study, "OUT", tmp_path)  # (cell_argv links the calibration files there)

    def args(**kw):
        return argparse.Namespace(**{"rate": 0.3, "seed": 1, "reward": "kl", "source": "data", "steps": 24,
                                     "variant": "alloc-s0.1-step-refit", "budget": None, **kw})

    steps, budget = args(), args(budget=30.0)
    assert reward_study.pg_name(steps) == "r30-s1-kl-data-24-alloc-s0.1-step-refit"
    assert reward_study.pg_name(budget) == "r30-s1-kl-data-b30-alloc-s0.1-step-refit"
    assert reward_study.length_argv(steps) == ["--steps", "24"]
    assert reward_study.length_argv(budget) == ["--time-budget", "30"]
    config = reward_study.cell_config(reward_study.cell_argv(0.3, 1, "data", "kl", [*reward_study.length_argv(budget),
                                                                                    "--out", "unused"]))
    assert config.time_budget == 30.0
    assert reward_study.cell_group(reward_study.pg_name(budget)) == reward_study.cell_group(reward_study.pg_name(steps))


def test_the_svg_charts_ticks_are_round_and_cover_the_range():
    import sys

    sys.path.insert(0, str(BENCH))
    from svg_chart import nice_ticks

    assert nice_ticks(0, 10) == [0, 2.5, 5, 7.5, 10] or nice_ticks(0, 10) == [0, 5, 10]
    ticks = nice_ticks(-17.6, 15.8)
    assert ticks[0] <= -17.6 and ticks[-1] >= 15.8
    steps = {round(b - a, 9) for a, b in zip(ticks, ticks[1:])}
    assert len(steps) == 1 and steps.pop() in (1, 2, 5, 10, 20, 50)
    with pytest.raises(ValueError):
        nice_ticks(0, float("nan"))


def test_the_paired_zero_shot_change_is_the_mean_over_tasks_with_an_interval_around_it(monkeypatch):
    """bench/reward_study.py paired_change: the change of the mean over tasks of each task's accuracy, in points,
    with a paired bootstrap interval that holds it; no change on identical scores gives a zero-width interval."""
    monkeypatch.syspath_prepend(str(BENCH))
    import reward_study

    before = {"a": "01" * 50, "b": "1" * 40}
    after = {"a": "1" * 100, "b": "0" * 10 + "1" * 30}
    c = reward_study.paired_change(before, after, draws=500)
    # task a: 0.5 -> 1.0 (+50 points); task b: 1.0 -> 0.75 (-25 points); the mean over the two tasks: +12.5
    assert abs(c["points"] - 12.5) < 1e-9
    assert c["low"] < c["points"] < c["high"] and c["documents"] == {"a": 100, "b": 40}
    same = reward_study.paired_change(before, before, draws=200)
    assert same["points"] == same["low"] == same["high"] == 0.0


def test_the_reward_study_report_lists_the_paired_zero_shot_change_where_it_was_measured(monkeypatch, tmp_path):
    import json

    monkeypatch.syspath_prepend(str(BENCH))
    import reward_study

    monkeypatch.setattr(reward_study, "OUT", tmp_path)
    cell = tmp_path / "pg" / "r50-s0-kl-data-24-alloc"
    cell.mkdir(parents=True)
    (cell / "heldout.json").write_text(json.dumps({"wikitext": 494.6, "c4": 223.1, "cpu_seconds_run": 1643.0}))
    (cell / "results.json").write_text(json.dumps({"steps": 24, "ppl_init": 825.8}))
    before, after = {"piqa": "0110", "winogrande": "10"}, {"piqa": "1110", "winogrande": "00"}
    (cell / "zeroshot_more.json").write_text(json.dumps({
        "init_wikitext": 504.31, "change": reward_study.paired_change(before, after, draws=100),
        "pooled": {"init": 0.45, "export": 0.4445, "change_points": -0.55}}))
    reward_study.report(None)
    row = [ln for ln in (tmp_path / "table.md").read_text().splitlines() if ln.startswith("| r50-s0")][-1]
    # piqa +25 points, winogrande -50: the mean over the two tasks -12.5
    assert "| 6 | 504.31 | -12.50 [" in row and "0.4500 → 0.4445 (-0.55) |" in row


def test_the_confirmation_sets_paired_changes_are_the_point_change_with_an_interval_around_it(monkeypatch):
    """bench/confirm.py: a perplexity's change (%) from each window's loss, an accuracy's (points) from each
    example's 0/1, each with a paired bootstrap that holds the point; identical runs change nothing; runs measured on
    other windows or examples are refused, not compared."""
    import math

    monkeypatch.syspath_prepend(str(BENCH))
    import confirm
    import reward_study

    before = [math.log(100.0) + 0.01 * (i % 7) for i in range(64)]
    after = [b - math.log(1.25) for b in before]  # every window's loss lower by log 1.25: perplexity / 1.25
    p, lo, hi = confirm.interval(confirm.ppl_change_draws(before, after, draws=300))
    assert abs(p - (100.0 / 1.25 - 100.0)) < 1e-9 and abs(lo - p) < 1e-9 and abs(hi - p) < 1e-9  # (no spread)
    noisy = [a + (0.2 if i % 2 else -0.2) for i, a in enumerate(after)]
    p, lo, hi = confirm.interval(confirm.ppl_change_draws(before, noisy, draws=300))
    assert lo < p < hi and lo < -20.0 < hi
    assert confirm.interval(confirm.ppl_change_draws(before, before, draws=50)) == (0.0, 0.0, 0.0)
    with pytest.raises(ValueError):
        confirm.ppl_change_draws(before, after[:-1])
    # blocks of neighbouring windows that move together: a block bootstrap sees that spread, single windows less of it
    runs = [a + (0.3 if (i // 16) % 2 else -0.3) for i, a in enumerate(after)]  # (4 runs of 16 windows, alternating)
    _, lo1, hi1 = confirm.interval(confirm.ppl_change_draws(before, runs, draws=400))
    _, lo16, hi16 = confirm.interval(confirm.ppl_change_draws(before, runs, draws=400, block=16))
    assert hi16 - lo16 > hi1 - lo1 > 0
    whole = confirm.ppl_change_draws(before, runs, draws=50, block=len(before))  # (one block: every draw the point)
    assert all(abs(x - whole[0]) < 1e-9 for x in whole)
    assert confirm.ppl_change_draws(before, noisy, draws=300) == confirm.ppl_change_draws(before, noisy, draws=300,
                                                                                           block=1)
    with pytest.raises(ValueError):
        confirm.ppl_change_draws(before, after, block=0)
    scores_a, scores_b = {"a": "01" * 50, "b": "1" * 40}, {"a": "1" * 100, "b": "0" * 10 + "1" * 30}
    draws = confirm.acc_change_draws(scores_a, scores_b, draws=400)
    assert abs(draws[0] - reward_study.paired_change(scores_a, scores_b)["points"]) < 1e-9  # (+12.5 points)
    with pytest.raises(ValueError):
        confirm.acc_change_draws(scores_a, {"a": "1" * 99, "b": "1" * 40})
    # the mean over seeds: draw by draw
    assert confirm.mean_draws([[1.0, 2.0, 3.0], [3.0, 4.0, 5.0]]) == [2.0, 3.0, 4.0]


def test_the_confirmation_report_pairs_each_seeds_steps_with_its_init_and_applies_the_rule(monkeypatch, tmp_path, capsys):
    """The report reads the cells on disk (running nothing): per seed init → pg24 on every measure with the change,
    'not finished' where a cell lacks a measure, and the default's rule (mean gain ≥ 5 %, no seed worse by > 1 %)
    judged on the confirmation seeds once all three are in; a (set, rate) with no finished pair is left out."""
    import json
    import math
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCH))
    import confirm

    monkeypatch.setattr(confirm, "OUT", tmp_path)
    (tmp_path / "confirm").mkdir()

    def write(name, scale, right):
        m = {k: {"losses": [math.log(100.0 * scale)] * 8} for k in confirm.PERPLEXITIES}
        m["zeroshot"] = {"scores": {t: "1" * right + "0" * (10 - right) for t in confirm.ZEROSHOT_TASKS}}
        m["lambada"] = {"scores": {"lambada_openai": "1" * right + "0" * (10 - right)}}
        (tmp_path / "confirm" / f"{name}.measures.json").write_text(json.dumps(m))

    for seed, gain in ((3, 0.9), (4, 0.8), (5, 1.02)):  # seed 5: 2 % worse than its init
        write(f"r30-s{seed}-init", 1.0, 5)
        write(f"r30-s{seed}-pg24", gain, 6)
    write("r50-s3-init", 1.0, 5)  # (r50: seed 3's init only)
    confirm.report(SimpleNamespace(all=False))
    out = capsys.readouterr().out
    assert "## confirm, 30 %" in out and "100.00 → 90.00 (-10.0 % [-10.0, -10.0])" in out
    assert "50.0 % → 60.0 % (+10.0" in out and "## confirm, 50 %" not in out  # (r50: no finished pair yet)
    assert "- 30 %: fails" in out and "worst seed +2.0 % / +2.0 %" in out  # (mean −9.3 %, but seed 5 is +2 %)
    assert (tmp_path / "table.md").read_text().strip() == out.strip()
    assert "## Rule `agree`" not in out  # (no cell checked yet)

    # a rule: seed 3 keeps the exported step 24, seed 4 chooses step 10 (measured apart), seed 5 the init (its mask
    # the init run's): the rule's table pairs each with the init, and the rule passes where the steps did not
    for seed, step, pair in ((3, 24, True), (4, 10, True), (5, 0, True)):
        (tmp_path / "confirm" / f"r30-s{seed}-pg24.checks.json").write_text(json.dumps(
            {"chosen": {"agree": step, "calib": 24, "other": 24}, "exported_step": 24}))
        (tmp_path / "confirm" / f"r30-s{seed}-pg24.cell.json").write_text(json.dumps({"init_is_the_init_runs_mask": pair}))
    write("r30-s4-pg24-step10", 0.85, 6)
    confirm.report(SimpleNamespace(all=False))
    out = capsys.readouterr().out
    agree = out[out.index("## Rule `agree`: confirm, 30 %"):]
    assert "| 3 (step 24) | 100.00 → 90.00" in agree and "| 4 (step 10) | 100.00 → 85.00" in agree
    assert "| 5 (step 0) | 100.00 → 100.00 (+0.0 %" in agree
    assert "- rule `agree`, 30 %: passes: mean change WikiText valid -8.3 %" in out
    assert "- rule `calib`, 30 %: fails" in out


def test_the_first_run_protocol_lists_each_seeds_first_and_second_run_and_reads_their_figures(tmp_path):
    """bench/first_run.sh --dry-run: README command 1 per seed (--seed S beside seed 0's plain command), a first run
    and a second; a bad seed is one error line. first_run_report.py reads a run's wall time, fixed costs (all but the
    steps and their checks) and the probe's rate off the files a run leaves."""
    out = subprocess.run(["bash", str(BENCH / "first_run.sh"), "--dry-run"], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()  # (each seed: install.sh's builds in its empty cache, then its two runs)
    assert len(lines) == 9 and "python -m engine.tools.model_copy" in lines[0]
    assert lines[1].startswith("first run, seed 0:") and lines[2].startswith("second run, seed 0:")
    assert "--prune-ratio 0.3 --time-budget 10 --out runs/quickstart --overwrite  ->" in lines[1]
    assert lines[4].rstrip().split(" -> ")[0].endswith("--overwrite --seed 1")
    cold = subprocess.run(["bash", str(BENCH / "first_run.sh"), "--dry-run"], cwd=REPO, capture_output=True,
                          text=True, env={**os.environ, "COLD": "1"})  # (every cache empty when the run starts)
    assert len(cold.stdout.splitlines()) == 6 and "model_copy" not in cold.stdout and "-cold/" in cold.stdout
    bad = subprocess.run(["bash", str(BENCH / "first_run.sh"), "x"], cwd=REPO, capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error:") and len(bad.stderr.strip().splitlines()) == 1

    sys.path.insert(0, str(BENCH))
    try:
        import first_run_report as report
    finally:
        sys.path.remove(str(BENCH))
    assert report.wall_seconds("\tElapsed (wall clock) time (h:mm:ss or m:ss): 9:43.21\n") == pytest.approx(583.21)
    assert report.wall_seconds("\tElapsed (wall clock) time (h:mm:ss or m:ss): 1:02:03\n") == pytest.approx(3723.0)
    assert report.probe_ms("plan: about 620 s (load 40); 2.1100 ms per token from a probe") == pytest.approx(2.11)
    assert report.fixed_seconds({"load": 40.0, "steps": 23.0, "validation": 33.0, "evaluations": 175.0,
                                 "total": 271.0}) == pytest.approx(215.0)
    run = tmp_path / "abc-r0.3" / "s0-first"
    run.mkdir(parents=True)
    import json

    (run / "results.json").write_text(json.dumps({"steps": 0, "ppl_pruned": 151.46, "seconds_by_phase": {
        "load": 40.0, "evaluations": 120.0, "total": 160.0}, "reconstruction": {"batches": 82}}))
    (run / "plan.txt").write_text("plan: about 160 s; 2.1100 ms per token from a probe of this machine\n")
    (run / "time.txt").write_text("\tElapsed (wall clock) time (h:mm:ss or m:ss): 2:41.00\n")
    assert report.row(run) == ("| abc-r0.3 | s0-first | 2.7 min | 2.67 min | 0 | 82 | 151.46 | 2.110 | "
                               "load 40, evaluations 120 |")  # (82: the refit's statistics the budget left)


def test_the_final_choice_rules_leave_the_init_only_on_the_evidence_each_asks_for(monkeypatch):
    """bench/confirm.py choose: `calib` is best-val as the engine runs it (a later step wins only past the margin);
    `other` the same on the other text; `agree` leaves the init only for a step below it on both texts, and takes the
    lowest product of the two ratios."""
    monkeypatch.syspath_prepend(str(BENCH))
    import confirm

    checks = {0: {"calib": 1.00, "other": 1.00}, 10: {"calib": 0.90, "other": 1.02},  # (step 10: the drift)
              20: {"calib": 0.95, "other": 0.97}, 24: {"calib": 0.895, "other": 0.965}}
    assert confirm.choose(checks, "calib") == 10  # (24 is within 1 % of 10's 0.90: not taken)
    assert confirm.choose(checks, "calib", margin=0.0) == 24
    assert confirm.choose(checks, "other") == 20 and confirm.choose(checks, "other", margin=0.0) == 24
    assert confirm.choose(checks, "agree") == 24  # (20: 0.95 x 0.97 = 0.9215; 24: 0.895 x 0.965 = 0.8637)
    drift = {0: {"calib": 1.0, "other": 1.0}, 10: {"calib": 0.8, "other": 1.005}, 20: {"calib": 0.7, "other": 1.2}}
    assert confirm.choose(drift, "agree") == 0 and confirm.choose(drift, "calib") == 20
    with pytest.raises(ValueError):
        confirm.choose(checks, "best")


def test_the_final_choice_checks_score_each_validated_mask_on_both_texts_on_the_tiny_model(
        monkeypatch, tmp_path, tiny, tiny_path, small_eval_file):
    """bench/confirm.py checks, end to end on a small joint pg-alloc run of the tiny model (a stand-in for a pg24
    cell): the init and every validated step's mask are scored, refit, on the run's held-out calibration batches and
    on the dense model's own text (the run calibrated on C4); each rule's choice and the run's exported step are
    recorded. The calibration value of each mask is what the run's own best-val read (metrics.jsonl's val_reward)."""
    import json
    from types import SimpleNamespace

    from engine.settings.config import PRESETS
    from engine.run.loop import PruneRun

    from test_pruner import quiet, small_config

    monkeypatch.syspath_prepend(str(BENCH))
    import confirm

    monkeypatch.setattr(confirm, "OUT", tmp_path)
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "self"))
    folder = confirm.cell_dir(0.3, 3, "pg24")
    joint = {k: v for k, v in PRESETS["joint"].items() if k not in ("init_batches", "calib_source")}
    config = small_config(tiny_path, small_eval_file, **joint, steps=3, val_every=2, mix_batches=1,
                          layer_init_batches=1, reconstruct_batches=2, val_batches=2, calib_source="data")
    PruneRun(config, folder, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    confirm.checks(SimpleNamespace(rate=0.3, seed=3))
    got = json.loads((folder.parent / "r30-s3-pg24.checks.json").read_text())
    lines = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]
    validated = {ln["step"]: ln["val_reward"] for ln in lines if ln.get("val_ppl") is not None}
    assert sorted(int(s) for s in got["checks"]) == [0, *sorted(validated)] and got["other_text"] == "own text"
    for s, value in validated.items():  # (the same mask, refit, on the same held-out batches: best-val's figure)
        assert got["checks"][str(s)]["calib"] == pytest.approx(value, rel=1e-6)
    assert all(v["other"] > 0 for v in got["checks"].values()) and set(got["chosen"]) == set(confirm.RULES)
    assert got["exported_step"] == json.loads((folder / "results.json").read_text())["mask_step"]


def test_the_recovery_study_lists_its_rungs_and_reports_each_rows_mean_beside_the_export(monkeypatch, tmp_path, capsys):
    """bench/recover_study.py: `list` names every (set, rate, seed, row, text) cell's rungs, done or to run; `report`
    puts each row and text at each rung (the mean over the seeds measured) under the export before recovery."""
    import json
    import math
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCH))
    import confirm
    import recover_study as rs

    monkeypatch.setattr(confirm, "OUT", tmp_path / "confirm")
    monkeypatch.setattr(rs, "OUT", tmp_path / "study")

    def measures(scale, zeroshot=True):
        m = {k: {"losses": [math.log(100.0 * scale)] * 4} for k in confirm.PERPLEXITIES}
        if zeroshot:  # (the lanes leave the zero-shot mean for a later pass)
            m["zeroshot"] = {"scores": {t: "1100" for t in confirm.ZEROSHOT_TASKS}}
        m["lambada"] = {"scores": {"lambada_openai": "1000"}}
        return json.dumps(m)

    (tmp_path / "confirm" / "tune").mkdir(parents=True)
    for seed in (0, 1):
        (tmp_path / "confirm" / "tune" / f"r30-s{seed}-{rs.STUDENT}.measures.json").write_text(measures(1.0))
        cell = rs.cell_dir(0.3, seed, "kl-lora", "c4")
        cell.mkdir(parents=True)
        (cell / "measures-2min.json").write_text(measures(0.8 if seed == 0 else 0.6, zeroshot=seed == 0))
        (cell.parent / f"{cell.name}.cell.json").write_text(json.dumps({"minutes": 2.0}))
    rs.listing(SimpleNamespace())
    listed = capsys.readouterr().out
    assert "tune/r30-s0-kl-lora-c4: 2 min done, 5 min to run, 10 min to run, 30 min to run" in listed
    assert "confirm/r50-s5-mix-lora-own: 2 min to run" in listed
    rs.report(SimpleNamespace(all=False))
    out = capsys.readouterr().out
    assert "| before recovery (init) | | 0 | 2 | 100.00 | 100.00 | 50.0 % |" in out
    # (the mean of 80 and 60, and of their changes from 100 on the same seeds; zero-shot: seed 0's alone)
    assert "| kl-lora | c4 | 2 | 2 | 70.00 (-30.0 %) | 70.00 (-30.0 %) | 50.0 % (+0.0 pt, of 1) |" in out
    assert "## confirm" not in out and (tmp_path / "study" / "table.md").read_text().strip() == out.strip()
    # the figure: a line from the export (0 minutes) to the rung, for each perplexity judge; no confirmation figure
    svg = (tmp_path / "study" / "figure-tune.svg").read_text()
    assert svg.count("<polyline") == 2 and "30 %, kl-lora, c4" in svg and "held-out C4 perplexity" in svg
    assert not (tmp_path / "study" / "figure-confirm.svg").exists()
    import svg_chart

    drawn = []
    monkeypatch.setattr(svg_chart, "line_chart", lambda panels, *a, **k: drawn.extend(panels) or "svg")
    assert rs.figure("tune") == "svg"  # (the points: both seeds' exports at 0 minutes, their mean at 2)
    for panel in drawn:
        assert [(s.label, [(x, round(y, 6)) for x, y in s.points]) for s in panel.series] == [
            ("30 %, kl-lora, c4", [(0.0, 100.0), (2.0, 70.0)])]


def test_a_recovery_cell_trains_its_rungs_by_resuming_and_measures_each(monkeypatch, tmp_path, finished_template):
    """A cell's ladder on a finished tiny run: the first rung a fresh recovery, the next one resumed from its
    checkpoint for the minutes between them, each rung's export measured once; a rerun trains nothing."""
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCH))
    import confirm
    import recover_study as rs

    monkeypatch.setattr(rs, "OUT", tmp_path / "study")
    monkeypatch.setattr(rs, "student", lambda rate, seed: finished_template)
    monkeypatch.setattr(rs, "training_text", lambda rate, seed, text, run_dir: str(SMALL_CALIB))
    measured = []
    monkeypatch.setattr(confirm, "measure", lambda model, dest, wanted: measured.append((Path(dest).name, model)) or
                        confirm.save(Path(dest), {m: {} for m in wanted}))
    args = SimpleNamespace(rate=0.3, seed=0, row="kl-lora", text="c4", minutes=[0.01, 0.02], without=[],
                           drop_model=False)
    rs.cell(args)
    folder = rs.cell_dir(0.3, 0, "kl-lora", "c4")
    book = json.loads((folder.parent / f"{folder.name}.cell.json").read_text())
    assert book["minutes"] == 0.02 and list(book["rungs"]) == ["0.01", "0.02"]
    assert book["rungs"]["0.02"]["steps"] > book["rungs"]["0.01"]["steps"] >= 1  # (resumed: the steps go on)
    assert [m[0] for m in measured] == ["measures-0.01min.json", "measures-0.02min.json"]
    rs.cell(args)  # (everything done: nothing trained, nothing measured again)
    assert len(measured) == 2
    # a later session's checkout: the measures and the book, not the checkpoint (git ignores it); a longer rung
    # cannot resume the trained one, so the cell trains again from its start and measures every rung anew
    from engine.tools.recover import CHECKPOINT_FILE

    (folder / CHECKPOINT_FILE).unlink()
    rs.cell(SimpleNamespace(**{**vars(args), "minutes": [0.01, 0.02, 0.03]}))
    assert [m[0] for m in measured[2:]] == ["measures-0.01min.json", "measures-0.02min.json", "measures-0.03min.json"]
    book = json.loads((folder.parent / f"{folder.name}.cell.json").read_text())
    assert list(book["rungs"]) == ["0.01", "0.02", "0.03"] and book["minutes"] == 0.03
    # a start over stopped in its first rung: the book no longer says the old rungs are trained, so the next run
    # trains them (it once looked for the export of a rung the start over had dropped)
    (folder / CHECKPOINT_FILE).unlink()
    import engine.tools.recover as rec

    real = rec.recover

    def stopped(*a, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(rec, "recover", stopped)
    with pytest.raises(KeyboardInterrupt):
        rs.cell(SimpleNamespace(**{**vars(args), "minutes": [0.01, 0.02, 0.03, 0.04]}))
    assert "minutes" not in confirm.load(folder.parent / f"{folder.name}.cell.json")
    monkeypatch.setattr(rec, "recover", real)
    rs.cell(SimpleNamespace(**{**vars(args), "minutes": [0.01, 0.04]}))
    assert [m[0] for m in measured[5:]] == ["measures-0.01min.json", "measures-0.04min.json"]


@pytest.mark.parametrize("script", ["confirm_lanes.sh", "recover_lanes.sh"])
def test_the_lanes_say_what_ran_and_start_nothing_when_asked_their_status(script):
    proc = subprocess.run(["bash", str(BENCH / script), "status"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr
    assert "two lanes started" not in proc.stdout  # (a status, never a launch)


def test_the_confirmation_report_shows_the_measures_in_and_marks_the_rest_pending(monkeypatch, tmp_path, capsys):
    """A cell measured but for its zero-shot mean (the lanes' first pass): its perplexities and LAMBADA are in the
    table with their intervals, the zero-shot mean reads 'pending', and each mean says of how many seeds."""
    import math
    from types import SimpleNamespace

    monkeypatch.syspath_prepend(str(BENCH))
    import confirm

    monkeypatch.setattr(confirm, "OUT", tmp_path)
    (tmp_path / "confirm").mkdir()
    for name, scale in (("r30-s3-init", 1.0), ("r30-s3-pg24", 0.9)):
        m = {k: {"losses": [math.log(100.0 * scale)] * 8} for k in confirm.PERPLEXITIES}
        m["lambada"] = {"scores": {"lambada_openai": "1" * 5 + "0" * 5}}
        (tmp_path / "confirm" / f"{name}.measures.json").write_text(json.dumps(m))
    confirm.report(SimpleNamespace(all=False))
    out = capsys.readouterr().out
    row = next(ln for ln in out.splitlines() if ln.startswith("| 3 |"))
    assert "100.00 → 90.00 (-10.0 % [-10.0, -10.0])" in row and row.count("pending") == 1
    assert "| mean | -10.0 % [-10.0, -10.0] (of 1) |" in out and "| 4 | not finished |" in out
    assert "## The rule" not in out  # (one confirmation seed of three: no verdict yet)
