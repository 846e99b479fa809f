"""On a CUDA device (marker `gpu`; skipped without one): the same perplexity as on CPU, and a short run."""

from __future__ import annotations

import math

import pytest
import torch

from engine.config import PruneConfig
from engine.data import eval_windows
from engine.evaluate import perplexity
from engine.loading import load_model, resolve_model
from engine.pruner import PruneRun

from conftest import SMALL_CALIB

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")]


def test_cuda_perplexity_matches_cpu(tiny, tiny_path, small_eval_file):
    model, tok = tiny
    windows = eval_windows(tok, small_eval_file.read_text(), 128, 4)
    cpu = perplexity(model, windows, 4, progress=False)
    cuda_model, _ = load_model(resolve_model(str(tiny_path)), "float32", "cuda")
    assert perplexity(cuda_model, windows, 4, progress=False) == pytest.approx(cpu, rel=1e-4)


def test_short_run_on_cuda(tiny_path, small_eval_file, tmp_path):
    config = PruneConfig(model=str(tiny_path), device="cuda", steps=3, batch_size=2, seqlen=64, eval_seqlen=64,
                         max_windows=2, init_batches=1, calib=str(SMALL_CALIB), eval_data=str(small_eval_file))
    results = PruneRun(config, tmp_path / "run", log=lambda m: None).run(progress=False)
    assert results["status"] == "done" and results["steps"] == 3
    assert all(math.isfinite(results[k]) for k in ("ppl_dense", "ppl_init", "ppl_pruned"))
    assert results["params_pruned"] < results["params_dense"]
