"""The own-text calibration source's faults (issue 63, --calib-source self/mix): its cache checks its entries and
makes damaged ones again, is keyed on the content of the model's files, survives a full disk; an interrupted
generation says the command that continues it, and that command does; the plan comes before the generation; lengths
that cannot work are refused before it. Each test failed on the code before the change."""

from __future__ import annotations

import errno
import gzip
import json
import os
import pathlib
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.data import calib_sources
from engine.storage import ppl_cache
from engine.data.calib_sources import CALIB_SOURCES, cache_files, texts_digest
from engine.settings.config import PruneConfig
from engine.errors import UserError
from engine.model.loading import resolve_model

from conftest import REPO, SMALL_CALIB, TINY_MODEL, clean_env, one_error

TEXTS = [f"Story {i}: the cat sat on the mat and looked at the bird in the tree." for i in range(5)]


def self_config(**kw) -> PruneConfig:
    return PruneConfig.of(**{"calib_source": "self", "self_docs": 3, "self_tokens": 20, "seed": 0, **kw})


def write_lines(path: Path, lines: list) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress("".join(json.dumps(x) + "\n" for x in lines).encode()))


def tiny_run(eval_file: Path, out: Path, *extra: str) -> list[str]:
    """A one-step prune of the tiny model on the small calibration file, on its own text (4 documents of 40 tokens)."""
    return ["prune", "--model", str(TINY_MODEL), "--steps", "1", "--batch-size", "2", "--seqlen", "32",
            "--eval-seqlen", "32", "--max-windows", "2", "--init-batches", "1", "--num-mask-samples", "2",
            "--val-every", "0", "--final-mask", "last", "--calib", str(SMALL_CALIB), "--eval-data", str(eval_file),
            "--calib-source", "self", "--self-docs", "4", "--self-tokens", "40", "--out", str(out), *extra]


def run_cli(argv: list[str], capfd) -> tuple[int, str]:
    """The CLI's main in this process, with this test's environment (its caches): (exit status, stderr)."""
    from engine.cli import main

    capfd.readouterr()
    code = main(argv)
    return code, capfd.readouterr().err


# --- the cache's entries --------------------------------------------------------------------------------------------
DAMAGED = {"numbers": [{"text": 123}] * 3, "empty strings": [{"text": ""}] * 3, "nulls": [{"text": None}] * 3,
           "not objects": [["a"], ["b"], ["c"]], "one bad line": [{"text": "a story"}, {"text": 7}, {"text": "b"}]}


@pytest.mark.parametrize("case", list(DAMAGED))
def test_a_damaged_cache_is_made_again_and_written_over(case, tiny, tmp_path, monkeypatch):
    """A cache file whose lines are {"text": 123}, empty strings, nulls or no objects is damaged: a line says so, the
    documents are sampled again (the same as an uncached generation) and written over it (before: the numbers went
    on to a TypeError on every run, the empty strings were trusted and the error blamed the calibration data)."""
    model, tokenizer = tiny
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    config = self_config()
    path = cache_files(config, "model-A", texts_digest(TEXTS))[0]
    write_lines(path, DAMAGED[case])
    want, _ = CALIB_SOURCES["self"](TEXTS, model, tokenizer, config, None, log=lambda m: None)  # (uncached)
    seen = []
    docs, _ = CALIB_SOURCES["self"](TEXTS, model, tokenizer, config, "model-A", log=seen.append)
    assert docs == want and all(isinstance(d, str) and d for d in docs)
    assert any(f"the cache file {path} is damaged" in m and "generating it again" in m for m in seen), seen
    assert calib_sources.read_documents(path) == want  # written over
    seen.clear()
    assert CALIB_SOURCES["self"](TEXTS, model, tokenizer, config, "model-A", log=seen.append)[0] == want
    assert any("from the cache" in m for m in seen) and not any("is damaged" in m for m in seen)


def test_the_cache_check_says_what_is_wrong(tmp_path):
    good, cut = tmp_path / "good.jsonl.gz", tmp_path / "cut.jsonl.gz"
    write_lines(good, [{"text": "one"}, {"text": "two"}])
    cut.write_bytes(good.read_bytes()[:-5])
    assert calib_sources.cache_entries(good) == (["one", "two"], None)
    assert calib_sources.cache_entries(cut)[0] == [] and "does not read" in calib_sources.cache_entries(cut)[1]
    for case, lines in DAMAGED.items():
        write_lines(good, lines)
        docs, problem = calib_sources.cache_entries(good)
        assert docs == [] and problem and "not a document" in problem, (case, problem)


# --- the cache's key: the content of the model's files ---------------------------------------------------------
def _copy_of_tiny(folder: Path) -> Path:
    shutil.copytree(TINY_MODEL, folder)
    for p in folder.iterdir():
        p.chmod(0o644)
    return folder


def _rewrite_in_place_keeping_size_and_mtime(path: Path) -> None:
    """Other weights in the same file: the lowest mantissa byte of its last 16 float32 values changed in place, its
    size and modification time as they were."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - 64)
        data = bytearray(f.read(64))
        data[::4] = bytes(b ^ 0x01 for b in data[::4])
        f.seek(st.st_size - 64)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_the_cache_is_keyed_on_the_content_of_the_models_files(tiny, tmp_path, monkeypatch):
    """Weights written over in place, their size and modification time kept, are another model: the cache's key
    changes and the text is sampled again (before: the key was the files' name, size and mtime, and the old
    model's text was served). The same files give the same key (a copy elsewhere too)."""
    model, tokenizer = tiny
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    folder = _copy_of_tiny(tmp_path / "model")
    key = lambda f: ppl_cache.files_key(resolve_model(str(f)), "float32")  # noqa: E731
    before = key(folder)
    assert key(folder) == before == key(_copy_of_tiny(tmp_path / "elsewhere"))
    config = self_config()
    first, _ = CALIB_SOURCES["self"](TEXTS, model, tokenizer, config, before, log=lambda m: None)
    _rewrite_in_place_keeping_size_and_mtime(folder / "model.safetensors")
    after = key(folder)
    assert after != before
    sampled = []
    real = calib_sources.sample_documents
    monkeypatch.setattr("engine.data.calib_sources.sample_documents", lambda *a, **k: sampled.append(1) or real(*a, **k))
    CALIB_SOURCES["self"](TEXTS, model, tokenizer, config, after, log=lambda m: None)
    assert sampled == [1]  # the changed weights' text is not the old one's cache
    CALIB_SOURCES["self"](TEXTS, model, tokenizer, config, before, log=lambda m: None)
    assert sampled == [1]  # (the old files' key still finds the old text)


def test_a_files_digest_is_computed_once_per_version_of_the_file(tmp_path, monkeypatch):
    """file_digest hashes a file once (memoised in the process and in $PG_PRUNE_CACHE under its stat, change time
    included), and again once it is written over, even with its size and modification time restored."""
    monkeypatch.setattr(ppl_cache, "_digests", {})
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(1000))
    hashed = []
    real = ppl_cache.hashlib.sha256
    monkeypatch.setattr(ppl_cache.hashlib, "sha256", lambda *a: hashed.append(1) or real(*a))
    first = ppl_cache.file_digest(path)
    assert ppl_cache.file_digest(path) == first and hashed == [1]
    monkeypatch.setattr(ppl_cache, "_digests", {})  # (another process: the cache folder's memo)
    assert ppl_cache.file_digest(path) == first and hashed == [1]
    time.sleep(0.01)
    _rewrite_in_place_keeping_size_and_mtime(path)
    assert ppl_cache.file_digest(path) != first and hashed == [1, 1]


# --- a full disk under the cache ---------------------------------------------------------------------------------
def test_a_full_disk_under_the_cache_is_not_cached_and_the_run_goes_on(eval_file, tmp_path, monkeypatch, capfd):
    """Every write under $PG_PRUNE_SELF_CALIB_CACHE fails with ENOSPC (the partial batches' file and the cache):
    the run says "not cached" and finishes, exit 0, as the code's comment promises (before: exit 2 after all the
    documents were generated, atomic_file's full-disk UserError passing write_documents' except OSError)."""
    cache = tmp_path / "self-cache"
    cache.mkdir()
    real = pathlib.Path.write_bytes

    def full(self, data):
        if str(self).startswith(str(cache)):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, data)

    monkeypatch.setattr(pathlib.Path, "write_bytes", full)
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(cache))
    code, err = run_cli(tiny_run(eval_file, tmp_path / "run"), capfd)
    assert code == 0, err[-3000:]
    assert "self-generated calibration: not cached (no space left on the device of" in err, err[-3000:]
    assert (tmp_path / "run" / "results.json").is_file() and not any(cache.rglob("*.gz"))


# --- lengths that cannot work, refused before the generation ------------------------------------------------------
@pytest.mark.parametrize("flag, value, needles", [
    # --self-tokens 600 after the 8-token prompt on the tiny model's 512 positions (before: accepted, and nothing
    # said for minutes)
    ("--self-tokens", "600", ("--self-tokens 600", "512 positions", "504 or fewer")),
    # --self-tokens 40 --seqlen 128: the documents (8 + 40 tokens) are shorter than a calibration window, so none
    # could be used (before: the text was generated, then "no calibration document is longer than seqlen")
    ("--seqlen", "128", ("--self-tokens 40", "--seqlen 128", "--self-tokens 121 or more")),
], ids=["beyond the positions", "no longer than seqlen"])
def test_self_tokens_that_cannot_work_are_refused_before_generating(eval_file, tmp_path, capfd, monkeypatch, flag,
                                                                     value, needles):
    """One line naming the flags and what would work, before anything is sampled, and no run folder."""
    from engine.cli import main

    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr("engine.data.calib_sources.sample_documents", lambda *a, **k: pytest.fail("sampled"))
    argv = tiny_run(eval_file, tmp_path / "run")
    argv[argv.index(flag) + 1] = value
    capfd.readouterr()
    assert main(argv) == 2
    one_error(capfd, *needles)
    assert not (tmp_path / "run").exists()


def test_the_generation_check_itself():
    from engine.data.calib_sources import check_generation

    class Positions:
        max_position_embeddings = 512

    check_generation(self_config(self_tokens=504, seqlen=128), Positions())
    check_generation(self_config(self_tokens=121, seqlen=128), object())  # (no positions known: not checked)
    with pytest.raises(UserError, match="beyond the model's 512 positions"):
        check_generation(self_config(self_tokens=505, seqlen=128), Positions())
    with pytest.raises(UserError, match="--self-tokens 120 makes documents of 128 tokens"):
        check_generation(self_config(self_tokens=120, seqlen=128), Positions())


# --- the plan before the generation ------------------------------------------------------------------------------
def test_the_plan_is_said_before_the_text_is_generated(eval_file, tmp_path, monkeypatch, capfd):
    """The first thing a run that samples its text says is what it samples and how long that and the whole run
    will take, from a probe of the model, before the first batch (before: the plan came once the text was made)."""
    monkeypatch.setenv("PG_PRUNE_SELF_CALIB_CACHE", str(tmp_path / "cache"))
    code, err = run_cli(tiny_run(eval_file, tmp_path / "run"), capfd)
    assert code == 0, err[-3000:]
    lines = err.splitlines()
    planned = next(i for i, ln in enumerate(lines) if ln.startswith("self-generated calibration: sampling 4 documents"))
    sampled = next(i for i, ln in enumerate(lines) if ln == "self-generated calibration: 4/4 documents")
    assert planned < sampled, lines
    assert " s at " in lines[planned] and "ms per token" in lines[planned] and "plan: about " in lines[planned]


# --- an interrupted generation --------------------------------------------------------------------------------
def _partial(cache: Path) -> list[Path]:
    return list(cache.glob("*.partial.jsonl.gz")) if cache.is_dir() else []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_generation_says_the_command_that_continues_it(sig, eval_file, tmp_path):
    """Ctrl-C (or SIGTERM) once the first batch of the text is saved: the last line says how many documents are
    saved and that the same command continues from them, and shows it; that command, run again, takes them up (its
    log says so) and finishes (before: a bare "interrupted", and --resume was refused: the folder held no run)."""
    cache = tmp_path / "self-cache"
    argv = tiny_run(eval_file, tmp_path / "run")
    argv[argv.index("--self-docs") + 1], argv[argv.index("--self-tokens") + 1] = "192", "150"  # (6 batches of 32)
    env = clean_env(OMP_NUM_THREADS="1", PG_PRUNE_SELF_CALIB_CACHE=str(cache))
    # (Ctrl-C's default in the child: an xdist worker ignores SIGINT, and a child would inherit that, as a program
    # started in the background does, and Python then leaves SIGINT ignored)
    proc = subprocess.Popen([sys.executable, "-m", "engine", *argv], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not _partial(cache) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _partial(cache), "no batch was saved"
        proc.send_signal(sig)
        err = proc.communicate(timeout=120)[1]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("interrupted while generating the calibration text: "), last
    saved = int(last.split(": ")[1].split(" of ")[0])
    assert saved and saved % 32 == 0 and f"{saved} of 192 documents are saved" in last, last
    said, command = last.split("; run the same command again to continue from them: ")
    command = command.removesuffix(" (--resume needs a run that reached its first step)")
    assert shlex.split(command) == ["python", "-m", "engine", *argv], command
    if sig == signal.SIGTERM:
        return  # (the same path as Ctrl-C: the CLI's SIGTERM handler raises KeyboardInterrupt; taken up below once)
    again = subprocess.run([sys.executable, *shlex.split(command)[1:]], cwd=REPO, env=env, text=True,
                           capture_output=True, timeout=600)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"self-generated calibration: {saved} documents from an interrupted generation, going on" in again.stderr
    assert f"sampling {192 - saved} documents" in again.stderr
    assert json.loads((tmp_path / "run" / "results.json").read_text())["status"] == "done"
    assert not _partial(cache)


def test_an_interrupt_before_any_batch_is_saved_says_the_same_command_starts_again():
    from engine.data.calib_sources import GenerationInterrupted
    from engine.cli import interrupted_line

    line = interrupted_line(GenerationInterrupted(0, 256, True), ["prune", "--out", "my run"])
    assert line.startswith("interrupted while generating the calibration text: 0 of 256 documents are saved")
    assert line.endswith("the same command starts it again: python -m engine prune --out 'my run'"), line
    assert interrupted_line(KeyboardInterrupt(), ["prune"]) == "interrupted"
