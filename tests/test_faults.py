"""Faults (issue 15): kill -9 and --resume, interrupted exports, NaN that must stop a run,
and a user's model folder that --overwrite must leave untouched."""

from __future__ import annotations

import json
import math
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from engine.cli import main
from engine.settings.config import PruneConfig
from engine.errors import UserError
from engine.run.loop import PruneRun, StepReport
from engine.run.results import finish
from engine.storage.outdir import LOCK_FILE
from engine.run.folder import RUN_MARKER

from conftest import REPO, SMALL_CALIB, TINY_MODEL, clean_env, engine_in_process, quiet

TIMING = ("seconds", "eta_seconds")
STEPS = 30
METHODS = {  # name -> CLI arguments beyond the shared ones
    "pg": ["--method", "pg"],  # (named: the default preset's method is pg-alloc)
    "gumbel": ["--method", "gumbel", "--lr", "0.5"],
    "random-progressive": ["--method", "pg", "--init", "random-progressive", "--progressive-increment", "0.1"],
}


def metric_lines(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def no_timing(lines: list[dict]) -> list[dict]:
    return [{k: v for k, v in ln.items() if k not in TIMING} for ln in lines]


def snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    """Every file under folder: its bytes and its modification time (ns)."""
    return {str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*")) if p.is_file()}


def cli_args(out: Path, eval_file: Path, method: str) -> list[str]:
    return ["prune", "--model", str(TINY_MODEL), "--out", str(out), "--steps", str(STEPS), "--batch-size", "4",
            "--seqlen", "64", "--eval-seqlen", "64", "--max-windows", "2", "--init-batches", "1", "--lr", "0.05",
            "--checkpoint-every", "1", "--calib", str(SMALL_CALIB), "--eval-data", str(eval_file), *METHODS[method]]


def popen(args: list[str]) -> subprocess.Popen:
    # (one thread, as the resume (engine_in_process) and the reference run below compute: a sum over threads in
    # another order moves a Gumbel run's backward, so the three parts must compute alike outside pytest-xdist too)
    return subprocess.Popen([sys.executable, "-m", "engine", *args], cwd=REPO,
                            env=clean_env(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# --- kill -9, then --resume in a new process ------------------------------------------------------------
@pytest.fixture(scope="module")
def killed_and_resumed(eval_file, tmp_path_factory) -> dict[str, dict]:
    """For each method, in parallel: `python -m engine prune` killed with SIGKILL once a few steps are in
    metrics.jsonl; then `--resume` (of what the killed process left on disk)."""
    base = tmp_path_factory.mktemp("killed")
    runs = {m: {"out": base / m} for m in METHODS}
    for m, r in runs.items():
        r["proc"] = popen(cli_args(r["out"], eval_file, m))
    pending = set(runs)
    deadline = time.time() + 240
    while pending and time.time() < deadline:
        for m in list(pending):
            r = runs[m]
            metrics = r["out"] / "metrics.jsonl"
            lines = metrics.read_text().count("\n") if metrics.exists() else 0
            if lines >= 3 or r["proc"].poll() is not None:
                r["proc"].send_signal(signal.SIGKILL)
                r["proc"].communicate()
                r["killed_at"] = len(metric_lines(r["out"])) if metrics.exists() else 0
                r["killed_rc"] = r["proc"].returncode
                r["finished_before_kill"] = (r["out"] / "results.json").exists()
                pending.discard(m)
        time.sleep(0.005)
    for m in pending:
        runs[m]["proc"].kill()
    assert not pending, f"no steps within 240 s: {pending}"
    for r in runs.values():  # the resumes, through the CLI in this process (a fresh interpreter: its imports again)
        resumed = engine_in_process("prune", "--out", str(r["out"]), "--resume")
        r["resume_rc"], r["resume_err"] = resumed.returncode, resumed.stderr
    return runs


@pytest.mark.parametrize("method", list(METHODS))
def test_kill_9_and_resume_equals_an_uninterrupted_run(method, killed_and_resumed, tiny, eval_file, tmp_path):
    r = killed_and_resumed[method]
    out = r["out"]
    assert r["killed_rc"] == -signal.SIGKILL and not r["finished_before_kill"]
    assert 1 <= r["killed_at"] < STEPS, "the kill came after the steps: not part-way"
    assert r["resume_rc"] == 0, r["resume_err"][-3000:]
    assert f"resuming {out}" in r["resume_err"]

    # the same settings, uninterrupted, in this process
    config = PruneConfig.load(out / "config.json")
    ref = tmp_path / "ref"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = PruneRun(config, ref, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    finally:
        torch.set_num_threads(threads)

    lines = metric_lines(out)
    assert [ln["step"] for ln in lines] == list(range(1, STEPS + 1))  # each step recorded exactly once
    assert no_timing(lines) == no_timing(metric_lines(ref))
    got = json.loads((out / "results.json").read_text())
    for k in ("ppl_dense", "ppl_init", "ppl_pruned", "params_pruned", "kept_per_layer", "steps"):
        assert got[k] == expected[k], k
    ta, tb = load_file(str(ref / "masks.safetensors")), load_file(str(out / "masks.safetensors"))
    assert set(ta) == set(tb)
    for key in ta:
        assert torch.equal(ta[key], tb[key]), key
    assert (out / "model" / "model.safetensors").is_file() and (out / RUN_MARKER).is_file()
    if method == "random-progressive":
        assert len({ln["keep_ratio"] for ln in lines}) == 3  # 0.1, 0.2, 0.3 pruned: the stages survived the kill


# --- an interrupted export ----------------------------------------------------------------------------
def test_interrupted_export_leaves_no_half_written_model(tiny, eval_file, tmp_path, monkeypatch):
    """Ctrl-C while the sliced model is written: no model/ appears, no temporary folder stays; a model/
    from before stays whole; and the run finishes on --resume."""
    model, tok = tiny
    config = PruneConfig.of(model=str(TINY_MODEL), steps=2, batch_size=2, seqlen=32, eval_seqlen=32, max_windows=1,
                         init_batches=1, calib=str(SMALL_CALIB), eval_data=str(eval_file))
    out = tmp_path / "run"
    original = type(tok).save_pretrained
    calls = []

    def interrupted(self, folder, *a, **kw):  # the weights are written already; the tokenizer is not
        calls.append(Path(folder))
        assert (Path(folder) / "model.safetensors").is_file()
        raise KeyboardInterrupt

    monkeypatch.setattr(type(tok), "save_pretrained", interrupted)
    with pytest.raises(KeyboardInterrupt):
        PruneRun(config, out, model=model, tokenizer=tok, log=quiet).run(progress=False)
    assert calls and calls[0].parent == out and calls[0].name.startswith(".model.")
    assert not (out / "model").exists() and not (out / "results.json").exists()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".") and p.name != LOCK_FILE) == []  # no half-written folder left

    monkeypatch.setattr(type(tok), "save_pretrained", original)
    PruneRun(config, out, model=model, tokenizer=tok, log=quiet).run(resume=True, progress=False)
    before = snapshot(out / "model")
    assert "model.safetensors" in before and "tokenizer.json" in before

    # a second interrupted export over a finished one keeps the finished one whole
    monkeypatch.setattr(type(tok), "save_pretrained", interrupted)
    run = PruneRun(config, out, model=model, tokenizer=tok, log=quiet)
    with pytest.raises(KeyboardInterrupt):
        finish(run.res, run.load_checkpoint())  # the export again, over the finished one
    assert snapshot(out / "model") == before
    assert sorted(p.name for p in out.iterdir() if p.name.startswith(".") and p.name != LOCK_FILE) == []


def test_kill_9_during_export_leaves_no_model_and_resume_cleans_up(tiny, eval_file, tmp_path):
    """SIGKILL while the sliced model is written (no cleanup can run): model/ never appears half-written;
    --resume removes the temporary folder and exports the model."""
    out = tmp_path / "run"
    args = ["prune", "--model", str(TINY_MODEL), "--out", str(out), "--steps", "2", "--batch-size", "2", "--seqlen",
            "32", "--eval-seqlen", "32", "--max-windows", "1", "--init-batches", "1", "--calib", str(SMALL_CALIB),
            "--eval-data", str(eval_file)]
    code = ("import os, signal, sys, transformers\n"  # SIGKILL right after the weights of the export are written
            "orig = transformers.PreTrainedModel.save_pretrained\n"
            "def killed(self, folder, *a, **kw):\n"
            "    orig(self, folder, *a, **kw)\n"
            "    os.kill(os.getpid(), signal.SIGKILL)\n"
            "transformers.PreTrainedModel.save_pretrained = killed\n"
            "from engine.cli import main\n"
            f"sys.exit(main({args!r}))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=clean_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert not (out / "model").exists() and not (out / "results.json").exists()
    leftovers = [p for p in out.iterdir() if p.name.startswith(".model.")]
    assert len(leftovers) == 1 and (leftovers[0] / "model.safetensors").is_file()  # the half-written export

    assert main(["prune", "--out", str(out), "--resume"]) == 0
    assert (out / "model" / "tokenizer.json").is_file() and (out / "results.json").is_file()
    assert not [p for p in out.iterdir() if p.name.startswith(".") and p.name != LOCK_FILE]  # the lock file stays


# --- NaN stops a run ------------------------------------------------------------------------------------
@pytest.mark.parametrize("poison", ["loss", "score"])
def test_first_non_finite_value_stops_the_run(poison, tiny, eval_file, tmp_path, monkeypatch):
    """A NaN loss or score (here injected at step 3) ends the run with a UserError naming the step; nothing
    non-finite reaches metrics.jsonl, the checkpoint or results.json."""
    model, tok = tiny
    config = PruneConfig.of(model=str(TINY_MODEL), steps=5, batch_size=2, seqlen=32, eval_seqlen=32, max_windows=1,
                         init_batches=1, checkpoint_every=1, calib=str(SMALL_CALIB), eval_data=str(eval_file))
    original = PruneRun.step

    def step(self, state) -> StepReport:
        report = original(self, state)
        if report.step == 3:
            if poison == "loss":
                report.losses[0] = float("nan")
            else:
                state.scores["kv_groups"][1] = float("inf")
        return report

    monkeypatch.setattr(PruneRun, "step", step)
    out = tmp_path / "run"
    with pytest.raises(UserError, match="step 3") as e:
        PruneRun(config, out, model=model, tokenizer=tok, log=quiet).run(progress=False)
    assert ("loss of mask sample 1 is nan" if poison == "loss" else "kv_groups scores are not finite") in str(e.value)
    assert [ln["step"] for ln in metric_lines(out)] == [1, 2]
    state = torch.load(out / "checkpoint.pt", weights_only=False)
    assert state["step"] == 2 and all(torch.isfinite(s).all() for s in state["scores"].values())
    assert not (out / "results.json").exists() and not (out / "model").exists()


def test_cli_nan_stop_is_one_error_line(tiny, eval_file, tmp_path, monkeypatch, capfd):
    original = PruneRun.step

    def step(self, state):
        report = original(self, state)
        report.losses[-1] = float("inf")
        return report

    monkeypatch.setattr(PruneRun, "step", step)
    argv = ["prune", "--model", str(TINY_MODEL), "--out", str(tmp_path / "run"), "--steps", "3", "--batch-size", "2",
            "--seqlen", "32", "--eval-seqlen", "32", "--max-windows", "1", "--init-batches", "1", "--calib",
            str(SMALL_CALIB), "--eval-data", str(eval_file)]
    capfd.readouterr()
    assert main(argv) == 2
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("error:")]
    assert len(err) == 1 and "step 1" in err[0] and "inf" in err[0], err


def test_json_writers_refuse_nan(tmp_path):
    from engine.storage.io import atomic_write_text, dumps_json

    with pytest.raises(UserError, match="ppl"):
        dumps_json({"ppl": float("nan")})
    with pytest.raises(UserError, match=r"losses\[1\]"):
        StepReport(step=1, total_steps=1, losses=[1.0, float("inf")], baseline=0.0, lr=0.1, mean_score={},
                   kept_fraction={}, head_scores=None, seconds=0.0, eta_seconds=0.0).to_json()
    for name, text in (("results.json", '{"ppl": NaN}'), ("metrics.jsonl", '{"step": 1}\n{"loss": -Infinity}\n')):
        with pytest.raises(UserError, match="finite"):
            atomic_write_text(tmp_path / name, text)
        assert not (tmp_path / name).exists()
    atomic_write_text(tmp_path / "ok.json", '{"ppl": 1.5, "best": null}')
    assert json.loads((tmp_path / "ok.json").read_text())["ppl"] == 1.5
    assert math.isfinite(json.loads((tmp_path / "ok.json").read_text())["ppl"])


# --- nothing the user made is deleted ---------------------------------------------------------------------
def test_overwrite_never_touches_a_model_folder(tiny_path, tmp_path, capfd):
    """`--overwrite --out MODEL_DIR` on a Hugging Face model folder (config.json, weights, tokenizer) and the
    user's files beside it: refused, every file keeps its bytes and modification time."""
    import shutil

    user = tmp_path / "my-model"
    shutil.copytree(tiny_path, user)
    (user / "notes.md").write_text("my notes")
    (user / "metrics.jsonl").write_text("{}\n")  # even with run-like file names beside it
    (user / "checkpoint.pt").write_bytes(b"mine")
    before = snapshot(user)
    capfd.readouterr()
    assert main(["prune", "--model", str(tiny_path), "--out", str(user), "--overwrite", "--steps", "1"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --overwrite refused"), err
    assert main(["prune", "--out", str(user), "--resume"]) == 2
    assert snapshot(user) == before
    assert not (user / RUN_MARKER).exists()


def test_out_is_created_and_checked_before_the_model_loads(tiny_path, tmp_path, monkeypatch, capfd):
    import engine.run.loop

    out = tmp_path / "a" / "b" / "run"
    seen = []

    def load_model(*a, **kw):
        seen.append(out.is_dir())
        raise UserError("stopped at the model load")

    monkeypatch.setattr(engine.run.loop, "load_model", load_model)
    capfd.readouterr()
    assert main(["prune", "--model", str(tiny_path), "--out", str(out), "--steps", "1"]) == 2
    assert seen == [True]  # the folder existed when the model began to load
    assert not (tmp_path / "a").exists()  # and a failed start removed the folders it had made
    assert "stopped at the model load" in capfd.readouterr().err

    # an unwritable --out fails without loading anything (as root, mkstemp is made to fail)
    import engine.storage.outdir as pr

    def no_write(*a, **kw):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(pr.tempfile, "mkstemp", no_write)
    seen.clear()
    assert main(["prune", "--model", str(tiny_path), "--out", str(out), "--steps", "1"]) == 2
    assert seen == [] and "not writable" in capfd.readouterr().err
    assert not (tmp_path / "a").exists()
