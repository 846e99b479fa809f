"""Device handling that a CPU-only machine can still check: token ids follow the model to its device
(the `gpu` tests in test_gpu.py run the real thing on CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn
import pytest
from engine.model.unit_types import unit_sizes


class _RecordingModel(nn.Module):
    """Stands for a model on another device: its one parameter lives on `meta`; it records the device of
    the ids it is fed and answers with CPU logits."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.empty(1, device="meta"))
        self.seen: list[torch.device] = []

    def forward(self, input_ids, use_cache=False):
        self.seen.append(input_ids.device)
        return SimpleNamespace(logits=torch.zeros(input_ids.shape[0], input_ids.shape[1], 3))

    def merge_and_unload(self):
        return self


def test_finetune_merge_feeds_the_ids_on_the_models_device():
    """`finetune --device cuda` used to feed the CPU probe ids to the CUDA model at the merge, after training."""
    from engine.tools.finetune import merge

    model = _RecordingModel()
    merge(model, torch.zeros(2, 5, dtype=torch.long))
    assert model.seen == [torch.device("meta")] * 2  # before and after the merge


def test_zeroshot_of_a_run_loads_the_base_on_the_configured_device(tmp_path, monkeypatch):
    """`zeroshot --run` used to load the base model on the CPU whatever --device said."""
    import engine.tools.chat as chat
    from engine.tools.zeroshot import ZeroshotConfig, load_for_zeroshot

    run = tmp_path / "run"
    run.mkdir()
    (run / "masks.json").write_text('{"base_model": "some-model"}')
    asked = []

    def load_base(name, dtype="float32", device="cpu"):
        asked.append((name, dtype, device))
        raise RuntimeError("stop here")

    monkeypatch.setattr(chat, "load_base", load_base)
    # (the run's masks are read and checked before the base loads: this made-up run has only their metadata)
    monkeypatch.setattr("engine.export.artifacts.load_mask_artifact", lambda folder: ({"base_model": "some-model"}, None, None))
    try:
        load_for_zeroshot(ZeroshotConfig(run=str(run), device="cuda:1"))
    except RuntimeError:
        pass
    assert asked == [("some-model", "float32", "cuda:1")]


def assert_offloaded_losses_equal(model, offloaded, keep: float, num_samples: int, ids: torch.Tensor):
    """The hook executors give the same per-sample PG losses on an accelerate-offloaded copy of `model` as on
    `model` held in memory (the same random masks)."""
    from engine.model.arch import ModelAdapter
    from engine.model.executors import EXECUTORS
    from engine.model.masking import MaskHooks
    from engine.algo.policy import sample_masks
    from engine.model.units import UnitLayout

    layout = UnitLayout(unit_sizes(ModelAdapter.for_model(model)))
    g = torch.Generator().manual_seed(1)
    samples = {u: sample_masks(torch.full((layout.total(u),), keep), num_samples, g) for u in layout.unit_types}
    with MaskHooks(ModelAdapter.for_model(model)) as plain, MaskHooks(ModelAdapter.for_model(offloaded)) as split:
        for name in ("sequential", "batched"):
            torch.testing.assert_close(EXECUTORS[name](split, layout, ids, samples),
                                       EXECUTORS[name](plain, layout, ids, samples), rtol=1e-5, atol=1e-5)
    return layout, samples


def test_masked_steps_on_a_model_that_accelerate_offloads(tmp_path):
    """--device auto: accelerate's device_map may keep some layers on disk (weights on `meta` until their
    forward); the hook executors give the same per-sample losses as the model in memory, and the sliced
    executor, which must gather weights, refuses in one sentence."""
    import pytest
    from transformers import AutoModelForCausalLM

    from engine.model.arch import ModelAdapter
    from engine.errors import UserError
    from engine.model.executors import EXECUTORS
    from engine.model.masking import MaskHooks
    from test_adapters_export import build_model

    model = build_model("llama")
    model.save_pretrained(tmp_path / "m")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.layers.2": "disk", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    offloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "m", device_map=device_map, dtype=torch.float32,
                                                     offload_folder=str(tmp_path / "offload")).eval()
    assert offloaded.model.layers[1].self_attn.o_proj.weight.device.type == "meta"
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    layout, samples = assert_offloaded_losses_equal(model, offloaded, 0.6, 3, ids)
    with MaskHooks(ModelAdapter.for_model(offloaded)) as split, pytest.raises(UserError, match="offloaded"):
        EXECUTORS["sliced"](split, layout, ids, samples)


def test_device_auto_runs_on_a_cpu_only_host(tiny_path, small_eval_file, tmp_path):
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun
    from conftest import SMALL_CALIB

    config = PruneConfig(model=str(tiny_path), device="auto", steps=2, num_mask_samples=2, max_windows=2,
                         init_batches=1, calib=str(SMALL_CALIB), eval_data=str(small_eval_file))
    results = PruneRun(config, tmp_path / "run", log=lambda m: None).run(progress=False)
    assert results["status"] == "done" and results["params_pruned"] < results["params_dense"]


def test_column_index_stays_on_the_device_of_the_kept_units():
    """The sliced executor's bias compensation indexes columns on the weights' device: column_index
    used to add a CPU arange to them (fails on CUDA; `meta` stands in for it here)."""
    from engine.model.arch import ModelAdapter
    from engine.model.unit_types import UNIT_TYPES
    from test_adapters_export import build_model

    a = ModelAdapter.for_model(build_model("llama"))
    for u in ("kv_groups", "channels"):
        kept = torch.tensor([0, 1])
        on_cpu = UNIT_TYPES[u].column_index(a, kept)
        on_meta = UNIT_TYPES[u].column_index(a, kept.to("meta"))
        assert on_meta.device.type == "meta" and on_meta.shape == on_cpu.shape


@pytest.mark.slow
def test_device_auto_splits_a_1b_model_and_its_pg_losses_equal_the_model_in_memory(tiny_path, tmp_path):
    """--device auto on a random LLaMA of about 1 B parameters, capped at 2 GiB of CPU memory: accelerate puts
    the rest on disk (the host here has no GPU; on one, the same cap splits GPU / CPU / disk). The masked
    forwards of a PG step give the same per-sample losses as the model held in memory."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

    from engine.model.loading import load_model, resolve_model

    config = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
                         num_key_value_heads=4, vocab_size=32000, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert 0.95e9 < sum(p.numel() for p in model.parameters()) < 1.1e9
    model.save_pretrained(tmp_path / "m")
    AutoTokenizer.from_pretrained(tiny_path).save_pretrained(tmp_path / "m")  # any tokenizer: ids are given below
    split, _ = load_model(resolve_model(str(tmp_path / "m")), "float32", "auto", max_memory={"cpu": "2GiB"})
    devices = {p.device.type for p in split.parameters()}
    assert "meta" in devices  # some layers live on disk until they run
    ids = torch.randint(0, 32000, (2, 16), generator=torch.Generator().manual_seed(0))
    assert_offloaded_losses_equal(model, split, 0.7, 2, ids)

