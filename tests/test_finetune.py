"""LoRA recovery fine-tuning on a tiny pruned export made here: loss falls, the merged model reloads exactly."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from engine.model.arch import ModelAdapter
from engine.export.artifacts import export_pruned
from engine.tools.finetune import FinetuneConfig, finetune, lora_target_modules, merge, train_lora, training_segments
from engine.model.loading import load_model, resolve_model
from engine.model.units import UnitLayout

from conftest import SMALL_CALIB, assert_cli_fails_with_one_line, clean_env
from engine.model.unit_types import unit_sizes


@pytest.fixture(scope="module")
def pruned_export(tiny, tmp_path_factory):
    """TinyStories-656K with a KV group dropped in layer 0 and a third of the channels in each layer."""
    model, tok = tiny
    a = ModelAdapter.for_model(model)
    layout = UnitLayout({"kv_groups": unit_sizes(a)["kv_groups"], "channels": unit_sizes(a)["channels"]})
    heads = torch.ones(layout.total("kv_groups"))
    heads[1] = 0
    g = torch.Generator().manual_seed(0)
    channels = (torch.rand(layout.total("channels"), generator=g) > 0.33).float()
    dest = tmp_path_factory.mktemp("export") / "model"
    export_pruned(model, tok, layout, {"kv_groups": heads, "channels": channels}, dest)
    return dest


def test_lora_targets_come_from_the_architecture_table(pruned_export):
    model, _ = load_model(resolve_model(str(pruned_export)))
    targets = lora_target_modules(model)
    assert targets == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # LLaMA's names
    config = FinetuneConfig(model=str(pruned_export), samples=4, seqlen=32, batch_size=2, lr=1e-3)
    seg = torch.randint(model.config.vocab_size, (4, 32), generator=torch.Generator().manual_seed(0))
    peft_model, records, info = train_lora(model, seg, config)
    wrapped = {n.rsplit(".", 1)[-1] for n, m in peft_model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == set(targets)
    n_layers = model.config.num_hidden_layers
    assert sum(1 for _, m in peft_model.named_modules() if hasattr(m, "lora_A")) == n_layers * len(targets)
    assert info["steps"] == len(records) == 2
    # r=16 adapters on every projection: A (r x in) + B (out x r)
    assert info["trainable_params"] == sum(16 * (m.in_features + m.out_features)
                                           for _, m in peft_model.named_modules() if hasattr(m, "lora_A"))
    # merging folds the adapters in without changing the function
    merged, diff = merge(peft_model, seg[:2])
    assert diff < 1e-4
    assert not any(hasattr(m, "lora_A") for m in merged.modules())


def test_finetune_lowers_training_loss_and_reloads_like_the_export(pruned_export, tmp_path):
    out = tmp_path / "ft"
    config = FinetuneConfig(model=str(pruned_export), samples=24, seqlen=64, epochs=3, lr=3e-3, batch_size=4,
                            calib=str(SMALL_CALIB), skip_eval=True, loss_probe_segments=8, seed=1)
    r = finetune(config, out, log=lambda m: None)
    assert r["samples_used"] == 24 and r["steps"] == 3 * 6
    assert r["train_loss_after"] < r["train_loss_before"] - 0.05
    assert r["merge_max_abs_logit_diff"] < 1e-4
    saved = json.loads((out / "finetune_config.json").read_text())
    assert saved["lora_r"] == 16 and saved["lora_alpha"] == 10.0 and saved["samples"] == 24
    assert len((out / "finetune_log.jsonl").read_text().splitlines()) == r["steps"]
    assert json.loads((out / "finetune_results.json").read_text())["train_loss_after"] == r["train_loss_after"]
    model_dir = out / "model"
    assert (model_dir / "modeling_pruned.py").is_file()
    cfg = json.loads((model_dir / "config.json").read_text())
    original = json.loads((pruned_export / "config.json").read_text())
    assert cfg["model_type"] == "pruned_llama"
    assert cfg["kv_heads_per_layer"] == original["kv_heads_per_layer"]
    assert cfg["intermediate_size_per_layer"] == original["intermediate_size_per_layer"]

    # the merged model through the engine's loader, and in a fresh interpreter that cannot import engine
    merged, tok = load_model(resolve_model(str(model_dir)))
    texts = ["Once upon a time there was a little dog.", "The sun was hot and the girl ran home."]
    ids = tok(texts[0], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        ours = merged(input_ids=ids).logits
    base, _ = load_model(resolve_model(str(pruned_export)))
    with torch.no_grad():
        assert (base(input_ids=ids).logits - ours).abs().max() > 1e-3  # fine-tuning changed the weights
    torch.save({"ids": ids, "logits": ours}, tmp_path / "ref.pt")
    script = textwrap.dedent(f"""
        import sys, torch
        from transformers import AutoModelForCausalLM
        ref = torch.load({str(tmp_path / 'ref.pt')!r})
        m = AutoModelForCausalLM.from_pretrained({str(model_dir)!r}, trust_remote_code=True).eval()
        assert "engine" not in sys.modules
        with torch.no_grad():
            print(float((m(input_ids=ref["ids"]).logits - ref["logits"]).abs().max()))
    """)
    res = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert float(res.stdout.strip().splitlines()[-1]) < 1e-5


def test_training_segments_are_disjoint_and_capped(tiny):
    _, tok = tiny
    texts = ["one two three four five six seven eight nine ten " * 20] * 3
    seg = training_segments(tok, texts, 32, 10_000, seed=0)
    total = sum(len(t) + 1 for t in tok(texts, add_special_tokens=False)["input_ids"])
    assert seg.shape == (total // 32, 32)  # all non-overlapping segments, no more
    assert training_segments(tok, texts, 32, 5, seed=0).shape == (5, 32)


@pytest.mark.parametrize("args,message", [
    (["--model", "/no/such/model"], "model not found"),
    (["--samples", "0"], "samples must be at least 1"),
    (["--lora-dropout", "1.5"], "LoRA dropout"),
    (["--max-windows", "-1"], "max windows"),
])
def test_bad_input_is_one_error_line(args, message, pruned_export, tmp_path, capfd):
    argv = ["finetune", "--model", str(pruned_export), "--out", str(tmp_path / "o"), *args]
    assert_cli_fails_with_one_line(argv, message, capfd)
