"""The dense perplexity remembered across runs (engine/storage/ppl_cache.py): reused only for the same model files,
dtype, device and windows; never for a model handed in memory; off with PG_PRUNE_CACHE=off."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from engine.storage import ppl_cache
from engine.run.loop import PruneRun

from test_pruner import small_config


def dense(config, out, logs, **kw) -> float:
    run = PruneRun(config, out, log=logs.append, **kw)
    return run.res.masks.dense_perplexity()


def passes(logs) -> int:
    return len([m for m in logs if m.startswith("evaluating dense")])


@pytest.fixture
def model_copy(tiny_path, tmp_path):
    dst = tmp_path / "model"
    shutil.copytree(tiny_path, dst)
    return dst


def test_the_second_run_reads_the_first_runs_dense_perplexity(model_copy, small_eval_file, tmp_path):
    logs = []
    config = small_config(model_copy, small_eval_file, max_windows=3)
    first = dense(config, tmp_path / "a", logs)
    assert passes(logs) == 1 and len(list(ppl_cache.cache_dir().iterdir())) == 1
    assert dense(config, tmp_path / "b", logs) == first and passes(logs) == 1
    assert "cached" in logs[-1]
    # other windows (a count, a length), or a model file changed since: measured again
    dense(small_config(model_copy, small_eval_file, max_windows=2), tmp_path / "c", logs)
    assert passes(logs) == 2
    weights = next(f for f in model_copy.iterdir() if f.suffix in (".safetensors", ".bin"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert dense(config, tmp_path / "d", logs) == pytest.approx(first) and passes(logs) == 3


def test_a_model_in_memory_is_never_cached(tiny, tiny_path, small_eval_file, tmp_path):
    logs = []
    config = small_config(tiny_path, small_eval_file)
    dense(config, tmp_path / "a", logs, model=tiny[0], tokenizer=tiny[1])
    dense(config, tmp_path / "b", logs, model=tiny[0], tokenizer=tiny[1])
    assert passes(logs) == 2 and not list(ppl_cache.cache_dir().glob("dense-*"))


def test_off_and_damaged_entries(model_copy, small_eval_file, tmp_path, monkeypatch):
    logs = []
    config = small_config(model_copy, small_eval_file)
    first = dense(config, tmp_path / "a", logs)
    (entry,) = ppl_cache.cache_dir().glob("dense-*.json")
    entry.write_text("{not json")
    assert dense(config, tmp_path / "b", logs) == pytest.approx(first) and passes(logs) == 2  # measured, rewritten
    assert dense(config, tmp_path / "c", logs) == pytest.approx(first) and passes(logs) == 2
    monkeypatch.setenv("PG_PRUNE_CACHE", "off")
    assert ppl_cache.cache_dir() is None
    dense(config, tmp_path / "d", logs)
    assert passes(logs) == 3


def test_the_key_holds_the_windows_and_the_dtype():
    fp = [["/m/model.safetensors", 10, 1]]
    w = torch.arange(12).view(3, 4)
    assert ppl_cache.dense_key(fp, "float32", "cpu", w) == ppl_cache.dense_key(fp, "float32", "cpu", w.clone())
    w2 = w.clone()
    w2[2, 3] = 0
    keys = {ppl_cache.dense_key(fp, "float32", "cpu", w), ppl_cache.dense_key(fp, "float32", "cpu", w2),
            ppl_cache.dense_key(fp, "bfloat16", "cpu", w), ppl_cache.dense_key(fp, "float32", "cpu", w.view(4, 3))}
    assert len(keys) == 4
