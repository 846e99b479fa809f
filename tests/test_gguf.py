"""GGUF export: heterogeneous pruned models load in llama.cpp (llama-cpp-python) and give the logits of the
transformers export, within a tolerance relative to the logit scale (1e-3 for f32, 2e-2 for f16)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from engine.model.arch import ModelAdapter
from engine.errors import UserError
from engine.export.artifacts import build_pruned_model
from engine.export.gguf import check_exportable, permute_rows, write_gguf
from engine.model.units import UnitLayout

from conftest import TINY_MODEL
from engine.model.unit_types import unit_sizes

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (install.sh installs it)")

TOKENIZER_JSON = TINY_MODEL / "tokenizer.json"  # a real BPE tokenizer with byte fallback, vocabulary 2048
COMMON = dict(vocab_size=2048, hidden_size=64, intermediate_size=96, num_hidden_layers=4, max_position_embeddings=128,
              initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama": lambda: LlamaConfig(**COMMON, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                 tie_word_embeddings=False, rope_theta=10000.0),
    # 4 query heads per KV group, head_dim 20 (hidden / heads would be 8), every projection with a bias
    "llama-biases": lambda: LlamaConfig(**COMMON, num_attention_heads=8, num_key_value_heads=2, head_dim=20,
                                        attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    # llama3 RoPE scaling: its frequency factors go into the file as rope_freqs.weight
    "llama3-rope": lambda: LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=4, head_dim=16,
                                       rope_parameters=dict(rope_type="llama3", rope_theta=10000.0, factor=8.0,
                                                            low_freq_factor=1.0, high_freq_factor=4.0,
                                                            original_max_position_embeddings=16)),
    "mistral": lambda: MistralConfig(**COMMON, num_attention_heads=6, num_key_value_heads=2, head_dim=16,
                                     sliding_window=None, tie_word_embeddings=True),
    # a sliding window wider than the test sequence: the file's context is capped at it
    "mistral-window": lambda: MistralConfig(**COMMON, num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                            sliding_window=48, tie_word_embeddings=False),
    "qwen2": lambda: Qwen2Config(**COMMON, num_attention_heads=4, num_key_value_heads=2),  # q/k/v biases
}


def random_model(arch: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS[arch]()).eval().requires_grad_(False)
    with torch.no_grad():  # non-trivial norms and biases, so that writing them wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model


def heterogeneous_masks(model, seed: int = 0) -> tuple[UnitLayout, dict[str, torch.Tensor]]:
    """Different KV groups and widths per layer, one layer removed."""
    a = ModelAdapter.for_model(model)
    layout = UnitLayout(unit_sizes(a))
    g = torch.Generator().manual_seed(seed)
    masks = {u: layout.hard_mask(u, torch.rand(layout.total(u), generator=g), "global", 0.6)
             for u in ("kv_groups", "channels")}
    layers = torch.ones(a.num_layers)
    layers[1] = 0
    masks["layers"] = layers
    return layout, masks


def llama_cpp_model(path: Path, n_ctx: int = 64):
    """llama.cpp with an f32 KV cache (its default f16 cache alone moves logits by ~1e-3 of their scale)."""
    f32 = llama_cpp.GGML_TYPE_F32
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, verbose=False, n_threads=2,
                           type_k=f32, type_v=f32)


def llama_cpp_logits(path: Path, ids: list[int]) -> torch.Tensor:
    llm = llama_cpp_model(path)
    llm.eval(ids)
    return torch.tensor(llm.scores[: len(ids)]).float()


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("arch", sorted(CONFIGS))
@pytest.mark.parametrize("outtype, tol", [("f32", 1e-3), ("f16", 2e-2)])
def test_heterogeneous_export_matches_transformers(arch, outtype, tol, tmp_path):
    model = random_model(arch)
    layout, masks = heterogeneous_masks(model)
    pruned = build_pruned_model(model, layout, masks)
    sizes = unit_sizes(ModelAdapter.for_model(pruned))
    assert len(set(sizes["kv_groups"])) > 1 and len(set(sizes["channels"])) > 1  # really heterogeneous
    info = write_gguf(pruned, tmp_path / "m.gguf", outtype, tokenizer_json=TOKENIZER_JSON)
    assert len(info["layers"]) == 3  # the removed layer is not written
    ids = torch.randint(3, 2048, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = pruned(input_ids=ids).logits[0].float()
    got = llama_cpp_logits(tmp_path / "m.gguf", ids[0].tolist())
    assert relative_error(got, want) <= tol, relative_error(got, want)


def test_tiny_real_model_tokenizes_and_scores_like_transformers(tiny, tmp_path):
    model, tok = tiny
    layout, masks = heterogeneous_masks(model)
    masks.pop("layers")  # two layers: keep both
    pruned = build_pruned_model(model, layout, masks)
    write_gguf(pruned, tmp_path / "tiny.gguf", "f32", tokenizer_json=TOKENIZER_JSON)
    llm = llama_cpp_model(tmp_path / "tiny.gguf", n_ctx=128)
    text = "Once upon a time, there was a little cat named Tom. He liked to play!"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert llm.tokenize(text.encode(), add_bos=False) == ids
    llm.eval(ids)
    with torch.no_grad():
        want = pruned(input_ids=torch.tensor([ids])).logits[0].float()
    assert relative_error(torch.tensor(llm.scores[: len(ids)]).float(), want) <= 1e-3


def test_q8_0_is_close_and_smaller(tiny, tmp_path):
    """On trained weights (a random model's logits amplify quantization far more than a real one's)."""
    model, tok = tiny
    layout, masks = heterogeneous_masks(model)
    masks.pop("layers")
    pruned = build_pruned_model(model, layout, masks)
    write_gguf(pruned, tmp_path / "f16.gguf", "f16", tokenizer_json=TOKENIZER_JSON)
    write_gguf(pruned, tmp_path / "q8.gguf", "q8_0", tokenizer_json=TOKENIZER_JSON)
    assert (tmp_path / "q8.gguf").stat().st_size < 0.75 * (tmp_path / "f16.gguf").stat().st_size
    ids = tok("Once upon a time, there was a little cat named Tom. He liked to play in the park.",
              add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        want = pruned(input_ids=torch.tensor([ids])).logits[0].float()
    assert relative_error(llama_cpp_logits(tmp_path / "q8.gguf", ids), want) <= 5e-2


def test_permute_rows_is_a_per_head_permutation():
    w = torch.arange(2 * 8 * 3, dtype=torch.float32).view(16, 3).numpy()
    p = permute_rows(w, 2)
    assert sorted(map(tuple, p.tolist())) == sorted(map(tuple, w.tolist()))
    assert p[:8].min() == w[:8].min() and p[8:].min() == w[8:].min()  # rows stay inside their head
    assert p[1].tolist() == w[4].tolist()  # the first half's second row follows the second half's first row


@pytest.mark.parametrize("config, what", [
    (lambda: Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2, head_dim=16), "q_norm"),
    (lambda: LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu"), "'gelu' MLP"),
    (lambda: LlamaConfig(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                         rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                              original_max_position_embeddings=32)), "RoPE scaling 'yarn'"),
])
def test_what_deci_cannot_hold_is_refused_before_writing(config, what, tmp_path):
    model = AutoModelForCausalLM.from_config(config()).eval()
    with pytest.raises(UserError, match=what):
        write_gguf(model, tmp_path / "x.gguf", "f16", tokenizer_json=TOKENIZER_JSON)
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    with pytest.raises(UserError):
        check_exportable(model)


def test_sliding_window_caps_the_context_length(tmp_path):
    from gguf import GGUFReader

    write_gguf(random_model("mistral-window"), tmp_path / "w.gguf", "f32", tokenizer_json=TOKENIZER_JSON)
    write_gguf(random_model("mistral"), tmp_path / "full.gguf", "f32", tokenizer_json=TOKENIZER_JSON)
    ctx = {f: GGUFReader(str(tmp_path / f)).fields["deci.context_length"].contents() for f in ("w.gguf", "full.gguf")}
    assert ctx == {"w.gguf": 48, "full.gguf": COMMON["max_position_embeddings"]}


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_bias_compensation_exports_match_transformers(arch, tmp_path):
    """Bias compensation folds the pruned units' mean contribution into the output projections' biases
    (attn_output.bias, ffn_down.bias), which deci reads."""
    model = random_model(arch)
    layout, masks = heterogeneous_masks(model)
    a = ModelAdapter.for_model(model)
    g = torch.Generator().manual_seed(3)
    comp_means = {"kv_groups": [0.3 * torch.randn(a.attention(i).output.in_features, generator=g) for i in range(a.num_layers)],
            "channels": [0.3 * torch.randn(a.mlp(i).output.in_features, generator=g) for i in range(a.num_layers)]}
    pruned = build_pruned_model(model, layout, masks, comp_means)
    assert ModelAdapter.for_model(pruned).attention(0).output.bias is not None
    write_gguf(pruned, tmp_path / "b.gguf", "f32", tokenizer_json=TOKENIZER_JSON)
    ids = torch.randint(3, 2048, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = pruned(input_ids=ids).logits[0].float()
    assert relative_error(llama_cpp_logits(tmp_path / "b.gguf", ids[0].tolist()), want) <= 1e-3


def test_llama3_rope_factors_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from engine.export.gguf import llama3_rope_factors

    config = CONFIGS["llama3-rope"]()
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    plain = 1.0 / 10000.0 ** (torch.arange(0, 16, 2, dtype=torch.float64) / 16)
    factors = llama3_rope_factors(10000.0, 16, config.rope_parameters)
    assert torch.allclose(plain / torch.from_numpy(factors).double(), inv_freq.double(), rtol=1e-5)


# --- the CLI -------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun
    from conftest import SMALL_CALIB, WIKI_RAW

    out = tmp_path_factory.mktemp("gguf") / "run"
    config = PruneConfig(model=str(TINY_MODEL), steps=2, num_mask_samples=2, max_windows=2, init_batches=1,
                         calib=str(SMALL_CALIB), eval_data=str(WIKI_RAW))
    PruneRun(config, out, log=lambda m: None).run(progress=False)
    return out


def test_export_command_writes_a_gguf_that_llama_cpp_runs(tiny_run, tmp_path, capfd):
    from engine.cli import main

    dest = tmp_path / "tiny.gguf"
    assert main(["export", str(tiny_run), "--format", "gguf", "--out", str(dest), "--outtype", "f32"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tiny_run / "model", trust_remote_code=True).eval()
    ids = list(range(10, 30))
    with torch.no_grad():
        want = exported(input_ids=torch.tensor([ids])).logits[0].float()
    assert relative_error(llama_cpp_logits(dest, ids), want) <= 1e-3
    assert main(["export", str(tiny_run), "--format", "hf", "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"].startswith("pruned_")


def test_export_bad_input_is_one_error_line(tiny_run, tmp_path, capfd):
    from conftest import assert_cli_fails_with_one_line

    unfinished = tmp_path / "unfinished"
    shutil.copytree(tiny_run, unfinished)
    (unfinished / "masks.json").unlink()
    exists = tmp_path / "exists.gguf"
    exists.write_bytes(b"mine")
    capfd.readouterr()
    assert_cli_fails_with_one_line(["export", str(unfinished), "--format", "gguf", "--out", str(tmp_path / "a.gguf")],
                                   "no finished mask", capfd)
    assert_cli_fails_with_one_line(["export", str(tiny_run), "--format", "gguf", "--out", str(exists)],
                                   "already exists", capfd)
    assert exists.read_bytes() == b"mine"
    assert_cli_fails_with_one_line(["export", str(tmp_path), "--format", "gguf", "--out", str(tmp_path / "b.gguf")],
                                   "not a run folder", capfd)
    qwen3 = tmp_path / "qwen3_run"  # a finished run whose export has Qwen3's per-head q/k norms
    shutil.copytree(tiny_run, qwen3)
    shutil.rmtree(qwen3 / "model")
    AutoModelForCausalLM.from_config(Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=16)).save_pretrained(qwen3 / "model")
    assert_cli_fails_with_one_line(["export", str(qwen3), "--format", "gguf", "--out", str(tmp_path / "q.gguf")],
                                   "deci architecture cannot hold this qwen3 model", capfd)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists.gguf", "qwen3_run", "unfinished"]  # nothing half-written


def test_prune_export_gguf_writes_the_run_gguf(tmp_path, capfd):
    """`prune --export-gguf` at the end of a run: RUN/model.gguf gives the run's transformers export's logits."""
    from conftest import SMALL_CALIB, WIKI_RAW
    from engine.cli import main

    out = tmp_path / "run"
    assert main(["prune", "--model", str(TINY_MODEL), "--steps", "2", "--max-windows", "2", "--init-batches", "1",
                 "--batch-size", "2", "--calib", str(SMALL_CALIB), "--eval-data", str(WIKI_RAW),
                 "--unit-multiple", "channels=16", "--export-gguf", "f32", "--out", str(out)]) == 0
    assert "llama.cpp model (f32)" in capfd.readouterr().out
    exported = AutoModelForCausalLM.from_pretrained(out / "model", trust_remote_code=True).eval()
    ids = list(range(10, 30))
    with torch.no_grad():
        want = exported(input_ids=torch.tensor([ids])).logits[0].float()
    assert relative_error(llama_cpp_logits(out / "model.gguf", ids), want) <= 1e-3


def test_prune_export_gguf_refuses_before_the_optimisation(tmp_path, capfd):
    """A model deci cannot hold is refused when it is loaded, in one line, and --out is left as it was."""
    from conftest import SMALL_CALIB, WIKI_RAW, assert_cli_fails_with_one_line
    from transformers import AutoTokenizer

    folder = tmp_path / "qwen3"
    AutoModelForCausalLM.from_config(Qwen3Config(**COMMON, num_attention_heads=4, num_key_value_heads=2,
                                                 head_dim=16)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(folder)
    capfd.readouterr()  # (the test's own saving may print transformers' progress bars: only the CLI's lines count)
    out = tmp_path / "run"
    assert_cli_fails_with_one_line(["prune", "--model", str(folder), "--steps", "2", "--max-windows", "2",
                                    "--calib", str(SMALL_CALIB), "--eval-data", str(WIKI_RAW), "--export-gguf", "f16",
                                    "--out", str(out)], "deci architecture cannot hold this qwen3 model", capfd)
    assert not out.exists()
