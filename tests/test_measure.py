"""Deployment figures: the tiny model beside a pruned export of it, in one invocation."""

from __future__ import annotations

import json

import pytest
import torch

from engine.model.arch import ModelAdapter
from engine.export.artifacts import export_pruned
from engine.model.loading import count_parameters, load_model, resolve_model
from engine.tools.measure import MeasureConfig, generate, markdown, run_measure, weights_bytes
from engine.model.units import UnitLayout

from conftest import assert_cli_fails_with_one_line
from engine.model.unit_types import unit_sizes


@pytest.fixture(scope="module")
def half_export(tiny, tmp_path_factory):
    """Half the KV groups and half the channels of every layer of TinyStories-656K."""
    model, tok = tiny
    a = ModelAdapter.for_model(model)
    layout = UnitLayout({"kv_groups": unit_sizes(a)["kv_groups"], "channels": unit_sizes(a)["channels"]})
    masks = {u: torch.cat([(torch.arange(n) % 2 == 0).float() for n in layout.sizes[u]]) for u in layout.unit_types}
    dest = tmp_path_factory.mktemp("export") / "model"
    export_pruned(model, tok, layout, masks, dest)
    return dest


def test_weights_bytes_counts_parameters_and_buffers_once(tiny):
    model, _ = tiny
    params = {id(p): p for p in model.parameters()}
    buffers = {id(b): b for b in model.buffers()}
    expected = sum(t.numel() * t.element_size() for t in {**params, **buffers}.values())
    assert weights_bytes(model) == expected
    # tied embeddings: counted once, so float32 weights are 4 bytes per distinct parameter plus buffers
    assert weights_bytes(model) == 4 * count_parameters(model) + sum(b.numel() * b.element_size() for b in buffers.values())


def test_generation_is_forced_to_the_token_count(tiny):
    model, tok = tiny
    ids = tok(["Once upon a time"], return_tensors="pt")["input_ids"]
    # min_new_tokens = max_new_tokens: end-of-story cannot stop it early
    assert generate(model, ids.repeat(2, 1), 40, tok.pad_token_id) == 2 * 40


def test_dense_and_pruned_side_by_side(tiny_path, half_export, tmp_path):
    config = MeasureConfig(models=[str(tiny_path), str(half_export)], batch_size=2, seqlen=16, new_tokens=4, repeats=2)
    result = run_measure(config, tmp_path / "m", log=lambda m: None)
    dense, pruned = result["rows"]
    assert dense["model"] == str(tiny_path) and pruned["model"] == str(half_export)
    assert pruned["config_type"] == "pruned_llama"
    assert pruned["params"] < dense["params"] and pruned["weights_mb"] < dense["weights_mb"]
    ref_model, _ = load_model(resolve_model(str(half_export)))
    assert pruned["params"] == count_parameters(ref_model)
    assert pruned["weights_mb"] * 2**20 == weights_bytes(ref_model)
    assert dense["params_ratio"] == 1.0 and dense["speedup_prefill"] == 1.0
    for row in (dense, pruned):
        assert row["prefill_s"] > 0 and row["generate_s"] > 0
        assert row["gen_tokens_per_s"] == pytest.approx(2 * 4 / row["generate_s"])
        assert row["prefill_tokens_per_s"] == pytest.approx(2 * 16 / row["prefill_s"])
        assert row["kind"] == "cpu VmHWM" and row["peak_mb"] > 0 and row["peak_delta_mb"] >= 0
    saved = json.loads((tmp_path / "m" / "measure.json").read_text())
    assert saved["rows"] == result["rows"]
    assert json.loads((tmp_path / "m" / "measure_config.json").read_text())["models"] == config.models
    table = (tmp_path / "m" / "measure.md").read_text().splitlines()
    assert len(table) == 4 and "prefill s (2x16)" in table[0]


def test_cli_prints_one_table_row_per_model(tiny_path, half_export, capfd):
    from engine.cli import main

    argv = ["measure", "--model", str(tiny_path), "--compare", str(half_export), "--seqlen", "8", "--new-tokens", "2",
            "--repeats", "1", "--no-memory"]
    assert main(argv) == 0
    out = capfd.readouterr().out.strip().splitlines()
    rows = [ln for ln in out if ln.startswith("| ") and "params" not in ln]
    assert len(rows) == 2 and rows[0].startswith(f"| {tiny_path}") and rows[1].startswith(f"| {half_export}")


def test_markdown_without_memory_has_no_memory_column():
    result = {"config": MeasureConfig(models=["a"], memory=False).to_dict(),
              "rows": [{"model": "a", "params": 10, "params_ratio": 1.0, "weights_mb": 1.0, "prefill_s": 0.5,
                        "speedup_prefill": 1.0, "gen_tokens_per_s": 3.0, "speedup_gen": 1.0}]}
    assert "peak" not in markdown(result)


def test_llama_cpp_speeds_beside_transformers(tiny_path, half_export):
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (install.sh installs it)")
    config = MeasureConfig(models=[str(tiny_path), str(half_export)], batch_size=1, seqlen=16, new_tokens=8, repeats=2,
                           memory=False, llama_cpp="f32")
    result = run_measure(config, log=lambda m: None)
    dense, pruned = result["rows"]
    for row in (dense, pruned):
        assert row["llama_cpp_prompt_tokens_per_s"] > 0 and row["llama_cpp_gen_tokens_per_s"] > 0
    assert pruned["llama_cpp_file_mb"] < dense["llama_cpp_file_mb"]  # the pruned GGUF is smaller
    assert dense["llama_cpp_speedup_gen"] == 1.0
    assert pruned["llama_cpp_speedup_gen"] == pytest.approx(pruned["llama_cpp_gen_tokens_per_s"] / dense["llama_cpp_gen_tokens_per_s"])
    table = result["table"].splitlines()
    assert "llama.cpp f32 MB" in table[0] and len(table) == 4


@pytest.mark.parametrize("args,message", [
    (["--llama-cpp", "q4_k"], "invalid choice"),
    (["--compare", "/no/such/model"], "model not found"),
    (["--repeats", "0"], "repeats must be at least 1"),
    (["--new-tokens", "0"], "new tokens must be at least 1"),
    (["--device", "tpu"], "unknown device"),
])
def test_bad_input_is_one_error_line(args, message, tiny_path, capfd):
    assert_cli_fails_with_one_line(["measure", "--model", str(tiny_path), *args], message, capfd)
