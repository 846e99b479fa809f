"""torchrun's safety (issue 48, its torchrun part): the ranks agree on the data they read before any forward, the
death of their launcher ends them, and two runs on one folder stay impossible across launchers. Each test failed
on the code before its change (see the commits); tests/test_security.py holds the first two-rank cases (different
$PG_PRUNE_DATA_DIR, kill -9 of torchrun during the steps)."""

from __future__ import annotations

import gzip
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SMALL_CALIB, TINY_MODEL, calib_data_dir, clean_env, process_alive

LINUX = Path("/proc/1/stat").exists()


def _env(**extra: str) -> dict[str, str]:
    return clean_env(**{"OMP_NUM_THREADS": "1", "PG_PRUNE_DIST_TIMEOUT": "60", **extra})


def _errors(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


def test_token_digest_reads_texts_by_their_bytes():
    """The ranks' first data check digests the texts as read: equal texts agree, a changed character, another split
    into documents or another order do not."""
    from engine.model.distributed import token_digest

    docs = ["Once upon a time", "there was a fox. \u00e9\u20ac"]
    assert token_digest([list(docs), "wiki"]) == token_digest([list(docs), "wiki"])
    assert token_digest(docs) != token_digest(["Once upon a time", "there was a fox. \u00e9\u20ad"])
    assert token_digest(docs) != token_digest(["Once upon a", " time", "there was a fox. \u00e9\u20ac"])
    assert token_digest(docs) != token_digest(docs[::-1])
    assert token_digest("ab") != token_digest(["ab"]) != token_digest([[97, 98]])


# --- the launcher's death ends a rank that SIGTERM does not end ----------------------------------------------------
_STUCK_RANK = """
import os, signal, sys, time
sys.path.insert(0, {repo!r})
import engine.model.distributed as d
d.PARENT_GRACE_SECONDS = 1.0
def terminate(signum, frame):  # (the CLI's)
    raise KeyboardInterrupt
signal.signal(signal.SIGTERM, terminate)
d.end_with_parent(interval=0.1)
signal.pthread_sigmask(signal.SIG_BLOCK, {{signal.SIGTERM}})  # the main thread waits in C code (a NCCL wait whose
sys.stdout.write(f"rank {{os.getpid()}}\\n")                  # peer is gone): the handler never gets to run
sys.stdout.flush()
time.sleep(120)
"""

_LAUNCHER = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c", sys.argv[1]])
time.sleep(120)
"""


@pytest.mark.skipif(not LINUX, reason="needs Linux's /proc")
def test_a_rank_that_sigterm_does_not_end_ends_after_its_launcher_dies(tmp_path):
    """A rank whose main thread cannot act on SIGTERM (it waits in C code: a NCCL wait whose peer is gone) still ends
    within seconds of a kill -9 of its launcher, saying why in one line (before: the watchdog's SIGTERM was its only
    move, and the rank ran on)."""
    launcher = subprocess.Popen([sys.executable, "-c", _LAUNCHER, _STUCK_RANK.format(repo=str(REPO))], cwd=tmp_path,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
    rank = None
    try:
        line = launcher.stdout.readline()  # (the rank's, through the pipe it shares with its launcher)
        assert line.startswith("rank "), (line, launcher.stderr.read() if launcher.poll() is not None else "")
        rank = int(line.split()[1])
        assert process_alive(rank)
        launcher.send_signal(signal.SIGKILL)
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and process_alive(rank):
            time.sleep(0.2)
        assert not process_alive(rank), "the rank outlived its launcher"
        err = launcher.stderr.read()  # (the rank's stderr: the pipe closes as it ends)
        errors = _errors(err)
        assert len(errors) == 1 and "launcher" in errors[0] and "was not acted on" in errors[0], err
    finally:
        if rank is not None and process_alive(rank):
            os.kill(rank, signal.SIGKILL)
        if launcher.poll() is None:
            launcher.kill()


# --- two ranks, started as torchrun starts them (its environment variables) ------------------------------------------

def _tiny(eval_file: Path, out: Path, *extra: str) -> list[str]:
    return ["--model", str(TINY_MODEL), "--steps", "2", "--batch-size", "2", "--seqlen", "32", "--eval-seqlen", "32",
            "--max-windows", "2", "--init-batches", "1", "--num-mask-samples", "2", "--eval-data", str(eval_file),
            "--out", str(out), *extra]


def _two_ranks(argv: list[str], envs: list[dict[str, str]], timeout: float = 600) -> list[tuple[int, str]]:
    """The same command on ranks 0 and 1 (each with its own extra environment): [(exit status, stderr)] by rank."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [subprocess.Popen([sys.executable, "-m", "engine", "prune", *argv], cwd=REPO, text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(r),
                                       LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2", **e))
             for r, e in enumerate(envs)]
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in ranks]
        return [(p.returncode, e) for p, e in zip(ranks, errs)]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_ranks_that_read_different_texts_are_refused_before_any_forward(eval_file, tmp_path):
    """--calib-source self generates its calibration documents with the model, from prompts cut from the documents
    read. Two ranks whose $PG_PRUNE_DATA_DIR differ (no --calib) are refused on the texts they read, naming both
    sources, before that generation: nothing generated, nothing cached (before: each rank generated from its own
    texts, rank 0 cached them, and only then were the ranks refused)."""
    with gzip.open(SMALL_CALIB, "rt", encoding="utf-8") as fh:
        docs = [json.loads(ln)["text"] for ln in fh if ln.strip()][:40]
    dirs = [calib_data_dir(tmp_path / "data0", docs), calib_data_dir(tmp_path / "data1", docs[1:])]  # (one document less)
    cache = tmp_path / "self-cache"
    argv = _tiny(eval_file, tmp_path / "run", "--calib-source", "self", "--self-docs", "4", "--self-tokens", "40",
                 "--val-every", "0", "--final-mask", "last")
    seen = _two_ranks(argv, [{"PG_PRUNE_DATA_DIR": str(d), "PG_PRUNE_SELF_CALIB_CACHE": str(cache)} for d in dirs])
    for code, err in seen:
        errors = _errors(err)
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert "different calibration data" in errors[0] and str(dirs[0]) in errors[0] and str(dirs[1]) in errors[0], errors
        assert "self-generated" not in err, err[-3000:]
    assert not cache.exists() or not any(cache.rglob("*")), sorted(cache.rglob("*"))  # (no forward ran)
    assert not (tmp_path / "run").exists()  # (a folder made for the refused run is gone)


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_ranks_started_on_a_folder_another_process_writes_all_say_who(eval_file, tmp_path):
    """While another process (a one-process prune, the app) holds a folder's lock, two ranks started there are
    refused on every rank with the same line naming that process, before any model is loaded (before: rank 0 said
    so; rank 1 loaded the model and the data, then ended with "another rank died or stopped answering")."""
    from engine.storage.outdir import folder_lock

    out = tmp_path / "run"
    out.mkdir()
    with folder_lock(out, what="prune into"):
        seen = _two_ranks(_tiny(eval_file, out, "--calib", str(SMALL_CALIB)), [{}, {}])
    for code, err in seen:
        errors = _errors(err)
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert f"is in use by process {os.getpid()}" in errors[0], errors
    assert sorted(p.name for p in out.iterdir()) == [".pg-prune.lock"]  # (nothing of a run was written)


# --- the ranks' weights (issue 63) ---------------------------------------------------------------------------------
def test_the_weights_digest_sees_one_changed_weight(tiny):
    """weights_digest: the same weights give the same digest (a copy too), one weight moved by one float step
    another; a tied embedding is read once."""
    import copy

    import torch

    from engine.model.distributed import weights_digest

    model = tiny[0]
    twin = copy.deepcopy(model)
    assert weights_digest(model) == weights_digest(twin)
    with torch.no_grad():
        w = twin.model.layers[1].mlp.down_proj.weight
        w[3, 7] = torch.nextafter(w[3, 7], torch.tensor(float("inf")))
    assert weights_digest(model) != weights_digest(twin)


def test_ranks_that_hold_other_weights_are_refused_in_one_line(tiny, monkeypatch):
    """World.check_data with the model's weights among the data (as a run checks them before its first forward):
    two ranks whose weights differ are refused in one line naming the weights and where each rank read them; the
    digest is computed only with several ranks (one process: nothing to do)."""
    import copy

    import torch

    from engine.model.distributed import World, token_digest, weights_digest
    from engine.errors import UserError

    model, other = tiny[0], copy.deepcopy(tiny[0])
    with torch.no_grad():
        other.model.layers[0].self_attn.q_proj.weight[0, 0] += 1e-3
    World().check_data({"model weights": (lambda: pytest.fail("digested in one process"), "m")})

    def gathered(self, mine, what):  # rank 1 sends the digest of its own weights
        return [mine, {**mine, "model weights": (token_digest(weights_digest(other)), "m")}]

    monkeypatch.setattr(World, "gather_objects", gathered)
    with pytest.raises(UserError) as e:
        World(rank=0, size=2).check_data({"model weights": (lambda: weights_digest(model), "m"),
                                          "calibration data": (["a text"], "c4")})
    assert str(e.value).startswith("the ranks read different model weights: rank 0 m, rank 1 m (the same path, other "
                                   "content); stopped before the first forward"), e.value


@pytest.mark.torchrun  # (launches ranks: deselected by the fast tier, docs/testing.md)
def test_ranks_whose_model_files_hold_other_weights_of_the_same_size_are_refused(eval_file, tmp_path):
    """Two ranks started with the same command, `--model model` read from each one's working folder: the files have
    the same names, sizes and configs (the start-up check passes), but rank 1's weights differ. Every rank is refused
    in one line naming the model weights, before any forward (before: the ranks compared their texts and token ids
    only, and ran on)."""
    import shutil

    folders = []
    for r in range(2):
        folders.append(tmp_path / f"rank{r}")
        shutil.copytree(TINY_MODEL, folders[-1] / "model")
        for p in (folders[-1] / "model").iterdir():
            p.chmod(0o644)
    weights = folders[1] / "model" / "model.safetensors"
    with open(weights, "r+b") as f:  # (the lowest mantissa byte of the last 16 float32 weights, in place: the same
        f.seek(-64, os.SEEK_END)     # size, and weights a float step or so from the old: a model that runs)
        data = bytearray(f.read(64))
        data[::4] = bytes(b ^ 0x01 for b in data[::4])
        f.seek(-64, os.SEEK_END)
        f.write(data)
    argv = _tiny(eval_file, tmp_path / "run", "--calib", str(SMALL_CALIB))
    argv[argv.index("--model") + 1] = "model"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    ranks = [subprocess.Popen([sys.executable, "-m", "engine", "prune", *argv], cwd=folders[r], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=port, WORLD_SIZE="2", RANK=str(r),
                                       LOCAL_RANK=str(r), LOCAL_WORLD_SIZE="2"))
             for r in range(2)]
    try:
        seen = [(p.communicate(timeout=600)[1], p.returncode) for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
    for err, code in seen:
        errors = _errors(err)
        assert code == 2 and len(errors) == 1 and "Traceback" not in err, err[-3000:]
        assert errors[0].startswith("error: the ranks read different model weights: rank 0 model, rank 1 model (the "
                                    "same path, other content)"), errors
    assert not (tmp_path / "run").exists()
