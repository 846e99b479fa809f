"""Shared fixtures: the tiny real model, the shared data folder, and a clean subprocess runner."""

from __future__ import annotations

import dataclasses
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
# Under pytest-xdist (`-n 2`, as README command 2 runs the suite) each worker computes on one thread, and so do the
# processes it starts: two workers on two cores, not four threads fighting over them.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = os.environ["MKL_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
# "auto" one-shot passes run in float32 on any CPU (engine/model/precision.py): the same results on an AVX-512 BF16 machine as
# elsewhere; tests/test_precision.py sets it per test
os.environ["PG_PRUNE_NATIVE_BF16"] = "0"
# the caches of a run's dense statistics and init metric ($PG_PRUNE_CACHE/statistics and /metrics by default) are off:
# a test's run computes what it checks; the tests of the caches point them at a folder of their own
os.environ["PG_PRUNE_STATS_CACHE"] = "off"
os.environ["PG_PRUNE_METRIC_CACHE"] = "off"
os.environ.setdefault("PG_PRUNE_APP_FOLDERS", os.pathsep.join([str(REPO.parent / "shared"), tempfile.gettempdir()]))


def clean_env(**extra: str) -> dict[str, str]:
    """Environment for child processes: offline, quiet, and without the repository on PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PG_PRUNE_DATA_DIR")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1",
               PG_PRUNE_NATIVE_BF16="0", PG_PRUNE_STATS_CACHE="off", PG_PRUNE_METRIC_CACHE="off")
    # (engine_in_process builds it from an emptied environment: the caches off there too)
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


@dataclasses.dataclass
class Ran:
    """What a command left: its exit status and its stderr."""
    returncode: int
    stderr: str


def engine_in_process(*args: str, env: dict[str, str] | None = None) -> Ran:
    """`python -m engine ARGS` run in this process through the CLI's own entry point, with clean_env's settings and
    on one thread, as a child of an xdist worker runs: for a test about what a command does or writes, not about its
    process (a fresh interpreter imports torch and transformers again: 5-8 s on 2 shared cores)."""
    import contextlib
    import io

    import torch

    from engine.cli import main

    saved, threads, err = dict(os.environ), torch.get_num_threads(), io.StringIO()
    os.environ.clear()
    os.environ.update(clean_env(**(env or {})))
    torch.set_num_threads(1)
    try:
        with contextlib.redirect_stderr(err):
            code = main(list(args))
    finally:
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(saved)
    return Ran(code, err.getvalue())


def pytest_collection_modifyitems(config, items):
    """The tests of tests/heavy_tests.txt (over 3 s in a measured run; tests/heavy_tests.py writes it) are marked
    `heavy`: the fast tier deselects them (docs/testing.md)."""
    from heavy_tests import listed_seconds

    heavy = listed_seconds()
    for item in items:
        if item.nodeid in heavy:
            item.add_marker(pytest.mark.heavy)
    # the files with the most measured seconds first (a stable sort: each file's own order kept): under --dist
    # loadfile the two workers start on the long files, and the suite ends on short ones that share out evenly,
    # not on one worker's long file while the other waits
    weight = {}
    for item in items:
        path = item.nodeid.split("::")[0]
        weight[path] = weight.get(path, 0.0) + heavy.get(item.nodeid, 0.0)
    items.sort(key=lambda item: -weight[item.nodeid.split("::")[0]])


@pytest.fixture(autouse=True)
def no_earlier_app_job():
    """The app's job manager is one per process (pages/_ui.py, st.cache_resource), as on a server: a test's AppTest
    would show the last job of an earlier test in the same worker (its failure, its run). Each test starts without."""
    yield
    ui = sys.modules.get("_ui")
    if ui is not None and hasattr(ui, "job_manager"):
        ui.job_manager.clear()


@pytest.fixture(autouse=True)
def own_cache(tmp_path_factory, monkeypatch):
    """Every test its own dense-perplexity cache (engine/storage/ppl_cache.py), so no test reads another's figure (child
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
    from engine.model.loading import load_model, resolve_model

    return load_model(resolve_model(str(tiny_path)))


@pytest.fixture(scope="session")
def default_model_cache(tmp_path_factory) -> dict:
    """{"root": a $PG_PRUNE_CACHE folder whose models/ holds the default model's de-quantised copy
    (engine/storage/model_cache.py), "dequantised": (model, tokenizer) as this worker read them from the GGUF, or None}.
    The copy is made once for the whole run: the xdist workers share the folder under a lock, so the GGUF is
    de-quantised (about 35 s on 2 shared cores) by the first worker that asks, not by every test that loads it."""
    from filelock import FileLock

    from engine.storage import model_cache
    from engine.model.loading import DEFAULT_MODEL, load_model, resolve_model

    base = tmp_path_factory.getbasetemp()
    root = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "default-model-cache"
    source, made = resolve_model(DEFAULT_MODEL), None
    with FileLock(f"{root}.lock"), pytest.MonkeyPatch.context() as mp:
        mp.setenv("PG_PRUNE_CACHE", str(root))
        copy = model_cache.copy_folder(source.path, source.gguf_file, "float32") if source.gguf_file else None
        if copy is not None and not model_cache.has_copy(copy):
            made = load_model(source)  # (writes the copy)
    return {"root": root, "dequantised": made}


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


@pytest.fixture(scope="module")
def eval_file(tmp_path_factory) -> Path:
    """The first 6,000 characters of WikiText-2's test split: a small evaluation text, one per test module."""
    path = tmp_path_factory.mktemp("eval-data") / "wiki.small.txt"
    path.write_text(WIKI_RAW.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return path


def pg_config(**kw):
    """A PruneConfig of policy gradient over KV groups and channels (the fast preset's settings, FAST: what the
    settings' defaults were before they became the default run's, one-shot), `kw` on top."""
    from engine.settings.config import FAST, PruneConfig

    return PruneConfig(**{**FAST, **kw})


def tiny_config(eval_file: Path, **kw):
    """A 3-step run of the tiny model on the small calibration and evaluation files, checkpointed every step: policy
    gradient over KV groups and channels (the fast preset's settings, FAST)."""
    from engine.settings.config import FAST, PruneConfig

    base = dict(FAST, model=str(TINY_MODEL), steps=3, batch_size=2, seqlen=32, eval_seqlen=32, max_windows=2,
                init_batches=1, num_mask_samples=2, lr=0.05, calib=str(SMALL_CALIB), eval_data=str(eval_file),
                checkpoint_every=1)
    return PruneConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def finished_template(request, tiny, eval_file, tmp_path_factory) -> Path:
    """A finished tiny_config run, one per module (of the module's FINISHED_STEPS steps, 3 unless it says)."""
    from engine.run.loop import PruneRun

    steps = getattr(request.module, "FINISHED_STEPS", 3)
    out = tmp_path_factory.mktemp("finished") / "finished"
    PruneRun(tiny_config(eval_file, steps=steps), out, model=tiny[0], tokenizer=tiny[1], log=quiet).run(progress=False)
    return out


@pytest.fixture
def finished(finished_template, tmp_path) -> Path:
    """A copy of the module's finished run, this test's own."""
    import shutil

    out = tmp_path / "run"
    shutil.copytree(finished_template, out)
    return out


def calib_data_dir(root: Path, docs: list[str]) -> Path:
    """A $PG_PRUNE_DATA_DIR whose c4/ holds these calibration documents, one JSON line each."""
    import json

    (root / "c4").mkdir(parents=True)
    (root / "c4" / "calib.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs), encoding="utf-8")
    return root


def process_alive(pid: int) -> bool:
    """The process runs (a zombie, ended and waiting for its reaper, does not; Linux's /proc)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
