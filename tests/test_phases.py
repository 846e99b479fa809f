"""Where a run's wall time goes (engine/run/phases.py): nested phases counted once, in the inner one; the rest is
"other"; a run's results.json carries its phases."""

from __future__ import annotations

import pytest

from engine.run.phases import PhaseClock, phase_line, resident_peak_mb
from engine.run.results import peak_line
from engine.run.loop import PruneRun

from test_pruner import small_config


class Clock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def test_nested_phases_count_once_and_the_rest_is_other():
    clock = Clock(5.0)
    phases = PhaseClock(started=0.0, clock=clock)  # 5 s of loading before the clock was made
    with phases("steps"):
        clock.t += 10
        with phases("evaluations"):  # the outer phase pauses
            clock.t += 3
        clock.t += 2  # ... and resumes
    clock.t += 4  # in no phase
    with phases("evaluations"):
        clock.t += 1
    report = phases.report()
    assert report == {"load": 5.0, "steps": 12.0, "evaluations": 4.0, "other": 4.0, "total": 25.0}
    assert phase_line(report) == "wall time 25 s: load 5, steps 12, evaluations 4, other 4"


def test_work_timed_before_the_clock_is_carved_out_of_load():
    """The calibration text, sampled while the data is read (before the clock is made), is counted under its own
    name, never more than the load had; a few milliseconds (text read from its cache) are left in load."""
    phases = PhaseClock(started=0.0, clock=Clock(9.0))
    phases.carve("calibration text", 6.5)
    phases.carve("calibration text", 0.01)
    assert phases.report() == {"load": 2.5, "calibration text": 6.5, "other": 0.0, "total": 9.0}
    capped = PhaseClock(started=0.0, clock=Clock(2.0))
    capped.carve("calibration text", 5.0)
    assert capped.report() == {"load": 0.0, "calibration text": 2.0, "other": 0.0, "total": 2.0}


def test_a_phase_that_raises_is_still_counted():
    clock = Clock()
    phases = PhaseClock(started=0.0, clock=clock)
    with pytest.raises(RuntimeError):
        with phases("steps"):
            clock.t += 2
            raise RuntimeError
    assert phases.report()["steps"] == 2.0 and phases.stack == []


def test_the_phase_that_raised_the_resident_peak_is_named():
    """Each phase during which the process's peak rose keeps the peak it reached; an inner phase's rise is its own,
    not its outer phase's; a rise between phases is "other"'s; a phase that never raised it is not listed; the last
    entry set the run's peak."""
    level = [600.0]
    phases = PhaseClock(started=0.0, clock=Clock(), peak=lambda: level[0])  # loading reached 600
    with phases("statistics"):
        level[0] = 900.0
    level[0] = 1000.0  # (between phases)
    with phases("steps"):
        level[0] = 2400.0
        with phases("refit"):  # (its outer phase's rise is read as it pauses: 2400 is the steps')
            pass
        level[0] = 3800.0  # (the steps again)
    with phases("evaluations"):
        level[0] = 3000.0  # (a reading below the peak: a peak never falls, but a fake may)
    report = phases.peak_report()
    assert report == {"load": 600.0, "statistics": 900.0, "other": 1000.0, "steps": 3800.0}
    assert peak_line(report) == "memory: peak 3800 MiB, reached in steps (before: load 600, statistics 900, other 1000)"


def test_the_resident_peak_is_read_from_proc_status():
    assert resident_peak_mb("Name:\tpython\nVmPeak:\t 9000 kB\nVmHWM:\t  2048 kB\nVmRSS:\t 1024 kB\n") == 2.0
    assert resident_peak_mb("Name:\tpython\n") is None
    here = resident_peak_mb()
    assert here is None or here > 1.0  # (this process's own, where /proc exists)


def test_a_run_reports_its_phases(tiny, tiny_path, small_eval_file, tmp_path):
    logged = []
    config = small_config(tiny_path, small_eval_file, reconstruct=True, reconstruct_batches=2)
    results = PruneRun(config, tmp_path / "r", model=tiny[0], tokenizer=tiny[1], log=logged.append).run(progress=False)
    phases = results["seconds_by_phase"]
    assert {"load", "statistics", "init metric", "evaluations", "steps", "validation", "refit", "export",
            "other", "total"} <= set(phases)
    names = list(phases)
    assert names.index("statistics") < names.index("steps")  # taken before the steps: never in a step's time
    assert sum(v for k, v in phases.items() if k != "total") == pytest.approx(phases["total"], abs=0.5)
    assert any(line.startswith("wall time ") for line in logged)
    peaks = results["peak_rss_mb_by_phase"]  # (the process's peak: some phase reached it, and it is results' peak)
    assert peaks and max(peaks.values()) <= results["peak_rss_mb"] + 1.0
