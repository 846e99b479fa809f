"""Data-parallel pruning's faults and resumes (issue 26; split from test_distributed.py so that the two-rank runs
spread over the xdist workers): the metric cache under two ranks, a rank that dies ends the others with one line and
a checkpoint that resumes with any number of ranks, a mismatched world or a refusal on rank 0 ends every rank."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from test_distributed import assert_same_run, checkpoint, flags, metric_lines, single, start_ranks, torchrun


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_the_metric_cache_under_two_ranks(eval_file, tmp_path):
    """$PG_PRUNE_METRIC_CACHE on 2 ranks: rank 0 alone writes what the ranks computed together, then reads it and
    sends it to the other rank; both runs are the single process's (without a cache), bit for bit."""
    extra = ["--units", "layers,heads,channels", "--layer-init", "sleb", "--init", "wanda-sp", "--num-mask-samples", "2",
             "--init-batches", "3", "--layer-init-batches", "3"]
    cache, ref = tmp_path / "cache", tmp_path / "ref"
    assert single(flags(eval_file, 2, *extra, "--out", str(ref))).returncode == 0
    for name in ("computed", "cached"):
        r = torchrun(flags(eval_file, 2, *extra, "--out", str(tmp_path / name)), PG_PRUNE_METRIC_CACHE=str(cache))
        assert r.returncode == 0, r.stderr[-3000:]
        assert sorted(p.name.split("-")[0] for p in cache.iterdir()) == ["sleb", "wanda"]  # (no scratch files)
        assert r.stderr.count("taken from the metric cache") == (2 if name == "cached" else 0), r.stderr[-2000:]
        assert_same_run(ref, tmp_path / name)


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_a_killed_rank_ends_the_run_with_one_line_and_resumes_on_one(eval_file, tmp_path):
    """kill -9 of rank 1 mid-run: rank 0 exits at once (gloo sees the connection close; a rank that hangs instead
    meets the timeout) with one `error:` line and the last finished step checkpointed; --resume in one process
    finishes the run with each step recorded once, and ends where an uninterrupted run ends, bit for bit."""
    steps, extra = 60, ["--num-mask-samples", "3", "--baseline", "moving-average", "--lr-schedule", "constant"]
    out, ref = tmp_path / "dp", tmp_path / "ref"
    ranks = start_ranks([flags(eval_file, steps, *extra, "--out", str(out))] * 2, timeout="30")
    try:
        deadline = time.monotonic() + 240
        while not ((out / "metrics.jsonl").exists() and len(metric_lines(out)) >= 10):
            assert ranks[0].poll() is None and time.monotonic() < deadline, ranks[0].stderr.read()[-2000:]
            time.sleep(0.05)
        os.kill(ranks[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        _, err = ranks[0].communicate(timeout=60)
        assert time.monotonic() - killed < 30  # within the timeout (at once, in fact)
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
            p.wait()
    assert ranks[0].returncode == 2, err[-2000:]
    lines = err.strip().splitlines()
    errors = [ln for ln in lines if ln.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, lines[-5:]
    assert "another rank died or stopped answering" in errors[0] and "--resume" in errors[0], errors[0]
    step = checkpoint(out)["step"]
    assert step >= 10 and f"the checkpoint holds step {step}/{steps}" in errors[0]
    assert [r["step"] for r in metric_lines(out)] == list(range(1, step + 1))
    assert step < steps
    resumed = single(flags(eval_file, steps, *extra, "--out", str(out), "--resume"))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["step"] for r in metric_lines(out)] == list(range(1, steps + 1))  # each step recorded once
    res = json.loads((out / "results.json").read_text())
    assert res["worlds"] == [{"from_step": 0, "world_size": 2}, {"from_step": step, "world_size": 1}]
    r = single(flags(eval_file, steps, *extra, "--out", str(ref)))
    assert r.returncode == 0, r.stderr[-2000:]
    assert_same_run(ref, out)


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_a_one_process_run_resumes_on_two_ranks(eval_file, tmp_path):
    """--resume with K = 2 of a run started in one process: the same as one uninterrupted process (constant lr and
    no validation, so that the shorter first session's schedules do not differ)."""
    extra = ["--num-mask-samples", "3", "--baseline", "leave-one-out", "--lr-schedule", "constant", "--val-every", "0",
             "--final-mask", "last"]
    out, ref = tmp_path / "run", tmp_path / "ref"
    assert single(flags(eval_file, 3, *extra, "--out", str(out))).returncode == 0
    r = torchrun(flags(eval_file, 6, *extra, "--out", str(out), "--resume"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert single(flags(eval_file, 6, *extra, "--out", str(ref))).returncode == 0
    assert_same_run(ref, out, also=("total_steps",))  # (the first session's lines say 3)
    assert json.loads((out / "results.json").read_text())["worlds"] == [
        {"from_step": 0, "world_size": 1}, {"from_step": 3, "world_size": 2}]


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_a_mismatched_world_is_refused_at_start(eval_file, tmp_path):
    """Rank 1 started with other settings: every rank ends at start-up (before loading the model) with one line."""
    out = tmp_path / "dp"
    ranks = start_ranks([flags(eval_file, 4, "--out", str(out)), flags(eval_file, 5, "--out", str(out))])
    errs = []
    for p in ranks:
        _, err = p.communicate(timeout=120)
        errs.append(err)
        assert p.returncode == 2, err[-2000:]
    for err in errs:
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: a mismatched world: rank 1"), lines
    assert not (out / "config.json").exists()


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_a_refusal_on_rank_0_ends_every_rank(eval_file, tmp_path):
    """--resume of a folder that holds no run: rank 0 refuses, and the other rank says the same and ends."""
    out = tmp_path / "nothing"
    out.mkdir()
    ranks = start_ranks([flags(eval_file, 4, "--out", str(out), "--resume")] * 2)
    for p in ranks:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 2 and err.strip().splitlines() == [err.strip().splitlines()[0]], err[-2000:]
        assert err.startswith("error: --resume") and "holds no run" in err
