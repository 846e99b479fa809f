"""engine.ui.jobs.JobManager, the app's background pruning thread, on the tiny real model (issue 15)."""

from __future__ import annotations

import json
import threading
import time

import pytest

import engine.model.loading
from engine.settings.config import FAST as PG_FAST, PruneConfig
from engine.errors import UserError
from engine.ui.jobs import DONE, FAILED, LOADING, RUNNING, STOPPED, JobBusy, JobManager, delete_run
from engine.run.loop import PruneRun, StepReport

from conftest import SMALL_CALIB, TINY_MODEL, quiet


def config(eval_file, **kw) -> PruneConfig:
    base = dict(model=str(TINY_MODEL), steps=4, batch_size=2, seqlen=32, eval_seqlen=32, max_windows=1, init_batches=1,
                checkpoint_every=2, lr=0.05, calib=str(SMALL_CALIB), eval_data=str(eval_file))
    base.update(kw)
    return PruneConfig(**{**PG_FAST, **base})  # (policy gradient over KV groups and channels)


@pytest.fixture
def loads(tiny, monkeypatch):
    """Every model load the job manager makes, counted; each returns the session's tiny model. `gate`, when
    set, holds the load until released (a slow model load)."""
    calls: list[tuple] = []
    state = {"gate": None}

    def load_model(source, dtype="float32", device="cpu"):
        calls.append((source.name, dtype, device))
        if state["gate"] is not None:
            assert state["gate"].wait(60)
        return tiny

    monkeypatch.setattr(engine.model.loading, "load_model", load_model)
    return calls, state


def wait_until(predicate, timeout: float = 60.0) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(0.01)
    raise AssertionError("timed out")


def test_stop_while_the_model_is_still_loading(loads, eval_file, tmp_path):
    calls, state = loads
    state["gate"] = threading.Event()
    jobs = JobManager()
    out = tmp_path / "run"
    jobs.start(config(eval_file, steps=50), out)
    wait_until(lambda: calls)
    assert jobs.snapshot().status == LOADING
    assert jobs.stop() is True  # while the model loads
    state["gate"].set()
    snap = jobs.wait(120)
    assert snap.status == STOPPED and snap.error is None, (snap.error, snap.error_detail)
    assert snap.history == [] and snap.result == {"status": "stopped", "step": 0}
    assert (out / "checkpoint.pt").is_file() and not (out / "results.json").exists()
    assert jobs.stop() is False  # nothing runs any more
    # and it resumes to the end
    jobs.start(None, out, resume=True)
    snap = jobs.wait(120)
    assert snap.status == DONE and [h["step"] for h in snap.history] == list(range(1, 51))


def test_worker_failures_surface_in_the_snapshot(loads, eval_file, tmp_path, monkeypatch):
    jobs = JobManager()
    short = tmp_path / "short.jsonl"
    short.write_text('{"text": "Once upon a time."}\n')
    jobs.start(config(eval_file, calib=str(short)), tmp_path / "a")  # a bad input found in the worker
    snap = jobs.wait(120)
    assert snap.status == FAILED and "longer than seqlen" in snap.error and snap.error_detail is None

    def boom(self, state):
        raise RuntimeError("boom at a step")

    monkeypatch.setattr(PruneRun, "step", boom)  # a bug: its traceback is kept for the page
    jobs.start(config(eval_file), tmp_path / "b")
    snap = jobs.wait(120)
    assert snap.status == FAILED and snap.error == "RuntimeError: boom at a step"
    assert "Traceback" in snap.error_detail and "boom" in snap.error_detail
    assert snap.phase == "failed" and snap.finished_at is not None
    # the manager is usable again
    monkeypatch.undo()
    jobs.start(config(eval_file, steps=1), tmp_path / "c")
    assert jobs.wait(120).status == DONE


def test_the_cached_model_is_reused(loads, tiny, eval_file, tmp_path):
    calls, _ = loads
    jobs = JobManager()
    for name in ("a", "b"):
        jobs.start(config(eval_file, steps=1), tmp_path / name)
        assert jobs.wait(120).status == DONE
    assert len(calls) == 1  # the second job reused the first one's model
    assert jobs._models.entry[1] is tiny[0]
    jobs.start(config(eval_file, steps=1, dtype="bfloat16"), tmp_path / "c")  # another dtype: loaded anew
    jobs.wait(120)
    assert len(calls) == 2 and calls[-1][1] == "bfloat16"
    uncached = JobManager(keep_model=False)
    for name in ("d", "e"):
        uncached.start(config(eval_file, steps=1), tmp_path / name)
        uncached.wait(120)
    assert len(calls) == 4 and uncached._models.entry is None


def test_delete_run_while_its_job_runs(loads, eval_file, tmp_path):
    calls, state = loads
    state["gate"] = threading.Event()
    jobs = JobManager()
    out = tmp_path / "run"
    jobs.start(config(eval_file, steps=100000, checkpoint_every=1000), out)
    wait_until(lambda: calls)
    with pytest.raises(UserError, match="being pruned"):  # still loading (no folder yet)
        delete_run(out, jobs)
    state["gate"].set()
    wait_until(lambda: len(jobs.snapshot().history) >= 2)
    errors = []

    def delete():
        try:
            delete_run(out, jobs)
        except UserError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=delete) for _ in range(4)]  # several pages at once
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(errors) == 4 and all("being pruned" in e for e in errors)
    assert (out / "config.json").is_file() and jobs.snapshot().status == RUNNING
    jobs.stop()
    assert jobs.wait(120).status == STOPPED
    (out / "notes.txt").write_text("mine")  # a file the user put into the run folder
    delete_run(out, jobs)  # stopped: now it may go
    assert [p.name for p in out.iterdir()] == ["notes.txt"]  # the run's files went, the user's stayed
    (out / "notes.txt").unlink()
    jobs.start(config(eval_file, steps=1), out)
    jobs.wait(120)
    delete_run(out, jobs)
    assert not out.exists()


def test_resume_shows_each_step_once_after_a_crash(tiny, eval_file, tmp_path):
    """A crash after step 3 leaves 3 metric lines and the step-2 checkpoint. Resumed from the Runs page, the
    job's history must hold steps 1..6 once each (it read metrics.jsonl before the run trimmed it)."""
    out = tmp_path / "run"

    def crash(report: StepReport):
        if report.step == 3:
            raise RuntimeError("power cut")

    with pytest.raises(RuntimeError):
        PruneRun(config(eval_file, steps=6), out, model=tiny[0], tokenizer=tiny[1], log=quiet).run(
            progress=False, observer=crash)
    assert [json.loads(ln)["step"] for ln in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3]
    jobs = JobManager()
    jobs._models.entry = ((str(TINY_MODEL), "float32", "cpu"), tiny[0], tiny[1])
    jobs.start(None, out, resume=True)
    snap = jobs.wait(120)
    assert snap.status == DONE, snap.error
    assert [h["step"] for h in snap.history] == [1, 2, 3, 4, 5, 6]
    assert snap.resumed_from == 2


def test_a_second_start_is_refused_while_one_runs(loads, eval_file, tmp_path):
    calls, state = loads
    state["gate"] = threading.Event()
    jobs = JobManager()
    jobs.start(config(eval_file), tmp_path / "a")
    with pytest.raises(JobBusy):
        jobs.start(config(eval_file), tmp_path / "b")
    state["gate"].set()
    assert jobs.wait(120).status == DONE
    assert not (tmp_path / "b").exists()
