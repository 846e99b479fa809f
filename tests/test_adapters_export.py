"""Adapters, mask hooks and the sliced export on tiny random LLaMA / Mistral / Qwen2 / Qwen3 models.

Sizes are odd on purpose: GQA with 2-4 query heads per KV group, head_dim set apart from
hidden_size / num_heads where the config allows it, biases where the architecture has them.
The export is reloaded in a separate interpreter that cannot import `engine`, as a user would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

import engine
from engine.model.arch import ModelAdapter, supported_model_types
from engine.errors import UserError
from engine.export.artifacts import export_pruned
from engine.model.loading import count_parameters
from engine.model.masking import MaskHooks
from engine.model.modeling_pruned import PRUNED_CLASSES
from engine.model.units import UnitLayout

from conftest import clean_env
from engine.model.unit_types import unit_sizes

COMMON = dict(vocab_size=128, hidden_size=96, intermediate_size=200, num_hidden_layers=3, max_position_embeddings=64,
              initializer_range=0.1, rms_norm_eps=1e-6)
ARCHS = {
    # 3 query heads per KV group, head_dim 20 (hidden/heads would be 16), biases on q/k/v/o and the MLP, tied
    "llama": (LlamaConfig, dict(num_attention_heads=6, num_key_value_heads=2, head_dim=20, attention_bias=True,
                                mlp_bias=True, tie_word_embeddings=True)),
    "mistral": (MistralConfig, dict(num_attention_heads=6, num_key_value_heads=3, head_dim=20, sliding_window=None)),
    # Qwen2 has no head_dim setting (16 here) and always has q/k/v biases
    "qwen2": (Qwen2Config, dict(num_attention_heads=6, num_key_value_heads=2)),
    # per-head q/k RMS norms
    "qwen3": (Qwen3Config, dict(num_attention_heads=8, num_key_value_heads=4, head_dim=12)),
}
KEEP = 0.6


def build_model(arch: str, seed: int = 0):
    config_cls, extra = ARCHS[arch]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config_cls(**COMMON, **extra))
    with torch.no_grad():  # non-trivial norms and biases, so that slicing them wrongly shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.mul_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.normal_(0.0, 0.1)
    return model.eval().requires_grad_(False)


def layout_of(adapter: ModelAdapter) -> UnitLayout:
    return UnitLayout({"kv_groups": unit_sizes(adapter)["kv_groups"], "channels": unit_sizes(adapter)["channels"]})


def random_hard_masks(layout: UnitLayout, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {u: layout.hard_mask(u, torch.rand(layout.total(u), generator=g), "global", KEEP) for u in layout.unit_types}


@torch.no_grad()
def masked_logits(model, layout, masks, ids):
    with MaskHooks(ModelAdapter.for_model(model)) as hooks:
        hooks.set({u: layout.split(u, m) for u, m in masks.items()})
        return model(input_ids=ids).logits.float()


def expected_params(model, kept_groups: list[int], kept_channels: list[int]) -> int:
    """Parameter count of a model whose layer i has kept_groups[i] KV groups and kept_channels[i] channels,
    from the architecture's formula (biases and norms read off the dense modules)."""
    c = model.config
    a = ModelAdapter.for_model(model)
    H, hd, q = c.hidden_size, a.head_dim, a.queries_per_group
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp  # the LLaMA-like modules, by name
    total = c.vocab_size * H + H  # embeddings, final norm
    if not c.tie_word_embeddings:
        total += c.vocab_size * H
    for g, ch in zip(kept_groups, kept_channels):
        total += H * g * q * hd + (g * q * hd if attn.q_proj.bias is not None else 0)
        total += 2 * (H * g * hd + (g * hd if attn.k_proj.bias is not None else 0))
        total += g * q * hd * H + (H if attn.o_proj.bias is not None else 0)
        total += 3 * H * ch + ((2 * ch + H) if mlp.down_proj.bias is not None else 0)
        total += 2 * H + (2 * hd if hasattr(attn, "q_norm") else 0)
    return total


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    return torch.randint(0, COMMON["vocab_size"], (2, 23), generator=torch.Generator().manual_seed(42))


@pytest.fixture(scope="module")
def exported(tmp_path_factory, tiny, ids):
    """For each architecture: dense model, masks, logits, and its export in a folder."""
    tokenizer = tiny[1]
    root = tmp_path_factory.mktemp("exports")
    out = {}
    for i, arch in enumerate(ARCHS):
        model = build_model(arch, seed=i)
        layout = layout_of(ModelAdapter.for_model(model))
        masks = random_hard_masks(layout, seed=100 + i)
        with torch.no_grad():
            dense = model(input_ids=ids).logits.float()
        export = export_pruned(model, tokenizer, layout, masks, root / arch)
        out[arch] = dict(model=model, layout=layout, masks=masks, dense=dense, dir=root / arch, export=export,
                         masked=masked_logits(model, layout, masks, ids))
    return out


@pytest.fixture(scope="module")
def reloaded(exported, ids, tmp_path_factory):
    """Each export loaded by a fresh interpreter that cannot import `engine`, with trust_remote_code."""
    work = tmp_path_factory.mktemp("elsewhere")
    torch.save(ids, work / "ids.pt")
    script = textwrap.dedent("""
        import importlib.util, json, sys
        import torch
        from transformers import AutoModelForCausalLM
        # (a user who loads the export has no pg-prune: the editable install's finder, `pip install -e .`, goes)
        sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
        sys.path_hooks[:] = [h for h in sys.path_hooks if "__editable__" not in getattr(h, "__module__", "")]
        sys.path_importer_cache.clear()
        assert importlib.util.find_spec("engine") is None, "engine must not be importable here"
        ids = torch.load("ids.pt")
        for name, folder in json.loads(sys.argv[1]).items():
            model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
            with torch.no_grad():
                logits = model(input_ids=ids).logits.float()
            params = {id(p): p.numel() for p in model.parameters()}
            torch.save({"logits": logits, "cls": type(model).__name__, "module": type(model).__module__,
                        "params": sum(params.values()), "dtype": str(next(model.parameters()).dtype)},
                       name + ".out.pt")
        print("ok")
    """)
    folders = {arch: str(rec["dir"]) for arch, rec in exported.items()}
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(folders)], cwd=work, capture_output=True, text=True,
                          env=clean_env(HF_MODULES_CACHE=str(work / "hf_modules")), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {arch: torch.load(work / f"{arch}.out.pt") for arch in ARCHS}


# --- adapter geometry and hooks ---------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_adapter_geometry(arch):
    model = build_model(arch)
    a = ModelAdapter.for_model(model)
    c = model.config
    assert a.num_layers == 3
    assert unit_sizes(a)["kv_groups"] == [c.num_key_value_heads] * 3
    assert unit_sizes(a)["channels"] == [200] * 3
    assert a.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    assert a.queries_per_group * c.num_key_value_heads == c.num_attention_heads
    assert a.attention(0).output.in_features == c.num_attention_heads * a.head_dim
    # a count that the params formula reproduces for the dense model validates the formula itself
    assert count_parameters(model) == expected_params(model, unit_sizes(a)["kv_groups"], unit_sizes(a)["channels"])


@pytest.mark.parametrize("arch", ARCHS)
def test_all_ones_masks_reproduce_dense(arch, ids):
    model = build_model(arch)
    a = ModelAdapter.for_model(model)
    layout = layout_of(a)
    with torch.no_grad():
        dense = model(input_ids=ids).logits
        with MaskHooks(a) as hooks:
            hooks.set({u: layout.split(u, torch.ones(layout.total(u))) for u in layout.unit_types})
            ones = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert torch.equal(ones, dense)
    assert torch.equal(after, dense)
    assert all(len(a.attention(i).output._forward_pre_hooks) == 0 and len(a.mlp(i).output._forward_pre_hooks) == 0
               for i in range(a.num_layers))


@pytest.mark.parametrize("arch", ARCHS)
def test_mask_zeroes_a_group_and_a_channel(arch, ids):
    """A zero in a KV-group mask removes all query heads of that group from the attention output;
    a zero in a channel mask removes that MLP channel. Compare with zeroed weight columns."""
    model = build_model(arch)
    a = ModelAdapter.for_model(model)
    layout = layout_of(a)
    heads = torch.ones(layout.total("kv_groups"))
    group = unit_sizes(a)["kv_groups"][0] + 1  # layer 1, group 1
    heads[group] = 0
    channels = torch.ones(layout.total("channels"))
    channels[[3, 150]] = 0  # layer 0, channels 3 and 150
    logits = masked_logits(model, layout, {"kv_groups": heads, "channels": channels}, ids)

    width = a.queries_per_group * a.head_dim
    with torch.no_grad():
        o = a.attention(1).output.weight
        o_saved, d_saved = o.clone(), a.mlp(0).output.weight.clone()
        o[:, width : 2 * width] = 0
        a.mlp(0).output.weight[:, [3, 150]] = 0
        reference = model(input_ids=ids).logits.float()
        o.copy_(o_saved)
        a.mlp(0).output.weight.copy_(d_saved)
        dense = model(input_ids=ids).logits.float()
    torch.testing.assert_close(logits, reference, atol=1e-6, rtol=0)
    assert float((logits - dense).abs().max()) > 1e-4  # the masks did something


def test_unsupported_model_type():
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32))
    with pytest.raises(UserError) as info:
        ModelAdapter.for_model(model)
    msg = str(info.value)
    assert "gpt2" in msg
    for t in ("llama", "mistral", "qwen2", "qwen3"):
        assert t in msg
    assert set(supported_model_types()) == {"llama", "mistral", "qwen2", "qwen3"}


# --- the export ----------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_export_folder(arch, exported):
    rec = exported[arch]
    d = rec["dir"]
    cfg = json.loads((d / "config.json").read_text())
    kept = {u: [int(m.sum()) for m in rec["layout"].split(u, rec["masks"][u])] for u in rec["masks"]}
    assert cfg["model_type"] == f"pruned_{arch}"
    assert cfg["base_model_type"] == arch
    assert cfg["kv_heads_per_layer"] == kept["kv_groups"]
    assert cfg["intermediate_size_per_layer"] == kept["channels"]
    assert cfg["auto_map"]["AutoModelForCausalLM"] == f"modeling_pruned.{PRUNED_CLASSES[arch][1].__name__}"
    assert (d / "modeling_pruned.py").is_file() and (d / "model.safetensors").is_file()
    assert (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()
    assert not [p.name for p in d.parent.iterdir() if p.name.startswith(".")]  # no temp folders left
    # the random masks really prune something in some layer, not everything everywhere
    assert sum(kept["kv_groups"]) < rec["layout"].total("kv_groups") and sum(kept["channels"]) < rec["layout"].total("channels")


@pytest.mark.parametrize("arch", ARCHS)
def test_export_reloads_elsewhere_with_same_logits(arch, exported, reloaded):
    rec, out = exported[arch], reloaded[arch]
    assert out["cls"] == PRUNED_CLASSES[arch][1].__name__
    assert not out["module"].startswith("engine")  # the copy beside the weights, not the project's module
    assert out["dtype"] == "torch.float32"
    assert float((rec["masked"] - rec["dense"]).abs().max()) > 1e-3  # pruning changed the output
    torch.testing.assert_close(out["logits"], rec["masked"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ARCHS)
def test_export_param_count(arch, exported, reloaded):
    rec = exported[arch]
    kept_groups = [int(m.sum()) for m in rec["layout"].split("kv_groups", rec["masks"]["kv_groups"])]
    kept_channels = [int(m.sum()) for m in rec["layout"].split("channels", rec["masks"]["channels"])]
    expected = expected_params(rec["model"], kept_groups, kept_channels)
    assert rec["export"]["params"] == expected
    assert reloaded[arch]["params"] == expected
    assert expected < count_parameters(rec["model"])


@pytest.mark.parametrize("arch", ARCHS)
def test_registered_classes_load_without_remote_code(arch, exported, ids):
    engine.register_pruned_classes()
    rec = exported[arch]
    model = AutoModelForCausalLM.from_pretrained(rec["dir"])
    assert isinstance(model, PRUNED_CLASSES[arch][1])
    with torch.no_grad():
        logits = model.eval()(input_ids=ids).logits.float()
    torch.testing.assert_close(logits, rec["masked"], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_pruning_an_export_again(arch, exported, ids, tmp_path, tiny):
    """The adapter reads unit counts from the weights, so an export can be pruned once more."""
    engine.register_pruned_classes()
    rec = exported[arch]
    pruned = AutoModelForCausalLM.from_pretrained(rec["dir"]).eval()
    a = ModelAdapter.for_model(pruned)
    kept = {u: [int(m.sum()) for m in rec["layout"].split(u, rec["masks"][u])] for u in rec["masks"]}
    assert unit_sizes(a)["kv_groups"] == kept["kv_groups"] and unit_sizes(a)["channels"] == kept["channels"]
    layout = layout_of(a)
    masks = random_hard_masks(layout, seed=7)
    expected = masked_logits(pruned, layout, masks, ids)
    export_pruned(pruned, tiny[1], layout, masks, tmp_path / "again")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "again").eval()
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits.float(), expected, atol=1e-5, rtol=1e-5)


def test_export_keeping_everything_equals_dense(tmp_path, tiny, ids):
    engine.register_pruned_classes()
    model = build_model("mistral", seed=5)
    layout = layout_of(ModelAdapter.for_model(model))
    masks = {u: torch.ones(layout.total(u)) for u in layout.unit_types}
    export = export_pruned(model, tiny[1], layout, masks, tmp_path / "all")
    assert export["params"] == count_parameters(model)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "all").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-6, rtol=0)


# --- atomicity -------------------------------------------------------------------------------------
def _failing_save(self, save_directory, *args, **kwargs):
    (Path(save_directory) / "model.safetensors").write_bytes(b"half a model")
    raise RuntimeError("disk full")


def test_failed_export_leaves_nothing(tmp_path, tiny, monkeypatch):
    model = build_model("llama", seed=3)
    layout = layout_of(ModelAdapter.for_model(model))
    masks = random_hard_masks(layout, seed=3)
    parent = tmp_path / "run"
    parent.mkdir()
    monkeypatch.setattr(PRUNED_CLASSES["llama"][1], "save_pretrained", _failing_save)
    with pytest.raises(RuntimeError, match="disk full"):
        export_pruned(model, tiny[1], layout, masks, parent / "model")
    assert list(parent.iterdir()) == []  # neither the destination nor a hidden temp folder


def test_failed_export_keeps_previous_export(tmp_path, tiny, monkeypatch):
    model = build_model("llama", seed=4)
    layout = layout_of(ModelAdapter.for_model(model))
    dest = tmp_path / "model"
    export_pruned(model, tiny[1], layout, random_hard_masks(layout, seed=1), dest)
    before = {p.name: p.read_bytes() for p in dest.iterdir()}
    monkeypatch.setattr(PRUNED_CLASSES["llama"][1], "save_pretrained", _failing_save)
    with pytest.raises(RuntimeError):
        export_pruned(model, tiny[1], layout, random_hard_masks(layout, seed=2), dest)
    assert [p.name for p in tmp_path.iterdir()] == ["model"]
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before
