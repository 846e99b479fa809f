"""Shared fixtures: the tiny real model, the shared data folder, and a clean subprocess runner."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY_MODEL = REPO.parent / "shared" / "models" / "tinystories-656k"
DATA_DIR = REPO.parent / "shared" / "data"
# The smallest calibration file (300 documents) and the raw WikiText-2 test file, for runs where
# tokenizing the full default data would only cost time.
SMALL_CALIB = DATA_DIR / "c4" / "c4-en.llamafactory-c4_demo.300.text-only.json.gz"
WIKI_RAW = DATA_DIR / "wikitext-2-raw-v1" / "wiki.test.raw"
# The app reads models from and writes exports to the runs folder and $PG_PRUNE_APP_FOLDERS only (engine/ui/paths.py):
# the tests' models and temporary folders are such folders (tests/test_security.py narrows it).
os.environ.setdefault("PG_PRUNE_APP_FOLDERS", os.pathsep.join([str(REPO.parent / "shared"), tempfile.gettempdir()]))


def clean_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: offline, quiet, and without the repository on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PG_PRUNE_DATA_DIR")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def write_llama_gguf(path: Path, hidden: int, tensors: dict, **keys) -> None:
    """A one-block llama GGUF declaring `hidden` (and the extra keys: add_NAME=value), holding `tensors`
    (name -> numpy array): complete, or deliberately inconsistent, for the loader's error tests."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(512)
    w.add_embedding_length(hidden)
    w.add_block_count(1)
    w.add_head_count(8)
    for name, value in keys.items():
        getattr(w, f"add_{name}")(value)
    for name, array in tensors.items():
        w.add_tensor(name, array)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def assert_cli_fails_with_one_line(argv: list[str], message: str, capfd) -> None:
    """In-process `engine.cli.main(argv)`: exit status 2 and exactly one `error: ...` line naming `message`."""
    from engine.cli import main

    assert main(argv) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err


def run_engine(*args: str, cwd: Path = REPO, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m engine ARGS` in a fresh interpreter, run from the repository root."""
    return subprocess.run([sys.executable, "-m", "engine", *args], cwd=cwd, env=clean_env(), capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Every test its own dense-perplexity cache (engine/ppl_cache.py), so no test reads another's figure (child
    processes inherit it through the environment)."""
    monkeypatch.setenv("PG_PRUNE_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="session")
def tiny_path() -> Path:
    assert (TINY_MODEL / "config.json").is_file(), f"the tiny test model is missing at {TINY_MODEL}"
    return TINY_MODEL


@pytest.fixture(scope="session")
def tiny(tiny_path):
    """(model, tokenizer) of TinyStories-656K, loaded once through the engine's own loader.

    Tests share it: anything that changes it (hooks) must undo the change.
    """
    from engine.loading import load_model, resolve_model

    return load_model(resolve_model(str(tiny_path)))


@pytest.fixture(scope="session")
def small_eval_file(tmp_path_factory) -> Path:
    """The first ~40k characters of WikiText-2 raw test (about 20 windows of 128 tiny-model tokens)."""
    text = WIKI_RAW.read_text(encoding="utf-8")[:40_000]
    path = tmp_path_factory.mktemp("data") / "wiki.small.txt"
    path.write_text(text, encoding="utf-8")
    return path


def quiet(_msg: str) -> None:
    """A run's log, dropped."""


def one_error(capfd, *needles: str) -> str:
    """Exactly one `error:` line on stderr, no traceback, under MAX_LINE characters, holding every needle."""
    from engine.errors import MAX_LINE

    err = capfd.readouterr().err.strip().splitlines()
    errors = [ln for ln in err if ln.startswith("error:")]
    assert len(errors) == 1 and not any("Traceback" in ln for ln in err), err
    assert len(errors[0]) < MAX_LINE, (len(errors[0]), errors[0])
    for n in needles:
        assert n in errors[0], errors[0]
    return errors[0]
