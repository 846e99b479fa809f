"""On a CUDA device (marker `gpu`; skipped without one): the same perplexity as on CPU, and a short run."""

from __future__ import annotations

import math

import pytest
import torch

from engine.settings.config import PruneConfig
from engine.data.text import eval_windows
from engine.algo.evaluate import perplexity
from engine.model.loading import load_model, resolve_model
from engine.run.loop import PruneRun

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


def test_export_reloads_on_cuda_with_equal_logits(tiny_path, small_eval_file, tmp_path):
    config = PruneConfig(model=str(tiny_path), device="cuda", steps=2, batch_size=2, seqlen=64, eval_seqlen=64,
                         max_windows=2, init_batches=1, calib=str(SMALL_CALIB), eval_data=str(small_eval_file),
                         units=["kv_groups", "channels", "layers"], prune_ratio=0.5)
    run = PruneRun(config, tmp_path / "run", log=lambda m: None)
    run.run(progress=False)
    ids = torch.randint(0, run.res.model.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    from engine.export.artifacts import load_mask_artifact

    _, masks, _ = load_mask_artifact(tmp_path / "run")
    # the masked base model on CUDA as the run evaluated it: its compensation means and least-squares refit included
    with run.res.masks.weights(masks) as comp_means, run.res.ctx.masked(masks, comp_means), torch.no_grad():
        masked = run.res.model(input_ids=ids.cuda()).logits.float().cpu()
    exported, _ = load_model(resolve_model(str(tmp_path / "run" / "model")), "float32", "cuda")
    with torch.no_grad():
        sliced = exported(input_ids=ids.cuda()).logits.float().cpu()
    torch.testing.assert_close(sliced, masked, rtol=1e-3, atol=1e-3)


def test_one_finetune_step_on_cuda(tiny_path, tmp_path):
    from engine.tools.finetune import FinetuneConfig, finetune

    config = FinetuneConfig(model=str(tiny_path), samples=2, seqlen=32, batch_size=2, device="cuda", skip_eval=True,
                            calib=str(SMALL_CALIB))
    results = finetune(config, tmp_path / "ft")
    assert results["steps"] == 1 and math.isfinite(results["train_loss_after"])
    assert (tmp_path / "ft" / "model" / "config.json").is_file()


def test_zeroshot_of_a_run_on_cuda(tiny_path, small_eval_file, tmp_path):
    from engine.tools.zeroshot import ZeroshotConfig, run_zeroshot

    config = PruneConfig(model=str(tiny_path), device="cuda", steps=2, batch_size=2, seqlen=64, eval_seqlen=64,
                         max_windows=2, init_batches=1, calib=str(SMALL_CALIB), eval_data=str(small_eval_file))
    PruneRun(config, tmp_path / "run", log=lambda m: None).run(progress=False)
    summary = run_zeroshot(ZeroshotConfig(run=str(tmp_path / "run"), tasks=["piqa"], limit=5, device="cuda"),
                           tmp_path / "zs", log=lambda m: None)
    assert summary["table"]
