"""GGUF for llama.cpp, through its `deci` architecture, which reads per-layer head counts and FFN widths.

Each kept decoder layer is written with its own number of query heads, KV heads and MLP channels
(deci.attention.head_count, deci.attention.head_count_kv, deci.feed_forward_length are arrays);
removed layers are not written (the transformers export drops them too). Query and key rows are
permuted per layer, with that layer's head counts, from the rotate-half order of transformers to the
interleaved order of llama.cpp's rope. The tokenizer is copied from the base model's own GGUF when it
came as one, else built from its tokenizer.json (byte-level BPE, or BPE with byte fallback).

What deci cannot hold is refused before anything is written: projection biases (Qwen2's q/k/v
biases, bias compensation's output biases), per-head q/k norms (Qwen3), sliding-window attention and
rope scaling.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..arch import ModelAdapter
from ..errors import UserError
from ..io import atomic_file
from . import register_export_format

OUTTYPES = ("f16", "f32", "q8_0")
_ARCH = "deci"


def _refusals(model) -> list[str]:
    """What this model has that llama.cpp's deci architecture does not read."""
    a = ModelAdapter.for_model(model)
    c = model.config
    out = []
    for i in range(a.num_layers):
        for linear in a.projections(i):
            if linear.bias is not None:
                out.append(f"projection biases ({a.param_name(linear)}.bias; Qwen2's q/k/v biases and bias "
                           "compensation's output biases are such)")
                break
        if out:
            break
    known = {id(p) for m in (*a.projections(0), *a.norms(a.layer(0))) for p in m.parameters()}
    extra = [name for name, p in a.layer(0).named_parameters() if id(p) not in known]
    if extra:  # e.g. Qwen3's per-head q/k norms
        out.append(f"layer parameters besides the projections and the two norms ({', '.join(extra)})")
    if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True) is not False \
            and c.sliding_window < getattr(c, "max_position_embeddings", 0):
        out.append(f"sliding-window attention (window {c.sliding_window})")
    scaling = getattr(c, "rope_scaling", None) or {}
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        out.append(f"rope scaling {scaling.get('rope_type', scaling.get('type'))!r}")
    return out


def check_exportable(model) -> None:
    refused = _refusals(model)
    if refused:
        raise UserError(f"llama.cpp's deci architecture cannot hold this {model.config.model_type} model: it has "
                        f"{'; '.join(refused)}; no GGUF was written")


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Query/key rows from transformers' rotate-half rope order to llama.cpp's interleaved order, per head."""
    rows, cols = w.shape
    head_dim = rows // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


# --- tokenizer ------------------------------------------------------------------------------------
def copy_tokenizer_from_gguf(writer, gguf_path: Path) -> None:
    """Every tokenizer.* key of the base model's own GGUF, as it is."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(str(gguf_path))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)


def tokenizer_from_json(writer, tokenizer_json: Path, config) -> None:
    """A BPE tokenizer.json: byte-level BPE as llama.cpp's "gpt2" model (tokens + merges), BPE with byte
    fallback (SentencePiece-style) as its "llama" model (tokens + scores + types)."""
    from gguf import TokenType

    t = json.loads(Path(tokenizer_json).read_text(encoding="utf-8"))
    model = t.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"the tokenizer ({model.get('type')!r}) is not a BPE tokenizer; GGUF export supports BPE only")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {a["content"]: a["id"] for a in t.get("added_tokens", [])}
    vocab.update(special)
    n = max(config.vocab_size, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [TokenType.UNUSED] * n
    for tok, i in vocab.items():
        tokens[i] = tok
        types[i] = TokenType.CONTROL if tok in special else TokenType.NORMAL
    if model.get("byte_fallback"):
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        for i, tok in enumerate(tokens):
            if len(tok) == 6 and tok.startswith("<0x") and tok.endswith(">"):
                types[i] = TokenType.BYTE
        unk = model.get("unk_token")
        if unk in vocab:
            types[vocab[unk]] = TokenType.UNKNOWN
            writer.add_unk_token_id(vocab[unk])
        writer.add_token_list(tokens)
        writer.add_token_scores([-float(i) for i in range(n)])  # earlier ids merge first
        writer.add_token_types(types)
        normalizers = json.dumps(t.get("normalizer") or {})
        writer.add_add_space_prefix("Prepend" in normalizers)
    else:
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        merges = model.get("merges", [])
        writer.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in merges])
    for name, setter in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                         ("pad_token_id", writer.add_pad_token_id)):
        value = getattr(config, name, None)
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            setter(int(value))


# --- weights --------------------------------------------------------------------------------------
def _add(writer, name: str, t: torch.Tensor, outtype: str) -> None:
    from gguf import GGMLQuantizationType, quants

    data = t.detach().float().cpu().numpy()
    if data.ndim == 1 or outtype == "f32":  # norms stay f32, as llama.cpp's converter keeps them
        writer.add_tensor(name, data.astype(np.float32))
    elif outtype == "q8_0" and data.shape[-1] % 32 == 0:
        q = quants.quantize(data.astype(np.float32), GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, q, raw_dtype=GGMLQuantizationType.Q8_0)  # q holds the bytes: shape follows
    else:  # f16, and q8_0 rows that are not a multiple of its 32-value blocks
        writer.add_tensor(name, data.astype(np.float16))


@torch.no_grad()
def write_gguf(model, dest: Path, outtype: str = "f16", tokenizer_gguf: Path | None = None,
               tokenizer_json: Path | None = None, name: str = "pruned") -> dict:
    """Write `model` (a plain or pruned LLaMA-like transformers model) as a deci GGUF at `dest`, atomically.
    Returns the per-layer (query heads, KV heads, FFN width)."""
    import gguf

    if outtype not in OUTTYPES:
        raise UserError(f"outtype must be one of {', '.join(OUTTYPES)}, got {outtype!r}")
    check_exportable(model)
    a = ModelAdapter.for_model(model)
    c = model.config
    hd = a.head_dim
    layers = []
    for i in range(a.num_layers):
        att, mlp = a.attention(i), a.mlp(i)
        n_head, n_kv, n_ff = att.query.out_features // hd, att.key.out_features // hd, mlp.inputs[0].out_features
        if n_ff == 0 and n_head > 0:  # llama.cpp skips a layer's attention output when its n_ff is 0
            raise UserError(f"layer {i} keeps attention but no MLP channel, which llama.cpp would mis-read")
        layers.append((n_head, n_kv, n_ff))
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    with atomic_file(Path(dest)) as tmp:
        w = gguf.GGUFWriter(str(tmp), _ARCH)
        w.add_name(name)
        w.add_file_type(int(file_type))
        w.add_block_count(len(layers))
        w.add_context_length(int(getattr(c, "max_position_embeddings", 2048)))
        w.add_embedding_length(int(c.hidden_size))
        w.add_feed_forward_length([n for _, _, n in layers])
        w.add_head_count([n for n, _, _ in layers])
        w.add_head_count_kv([n for _, n, _ in layers])
        w.add_key_length(hd)
        w.add_value_length(hd)
        w.add_rope_dimension_count(hd)
        w.add_rope_freq_base(_rope_theta(c))
        w.add_layer_norm_rms_eps(float(c.rms_norm_eps))
        w.add_vocab_size(int(c.vocab_size))
        if tokenizer_gguf is not None:
            copy_tokenizer_from_gguf(w, tokenizer_gguf)
        elif tokenizer_json is not None:
            tokenizer_from_json(w, tokenizer_json, c)
        else:
            raise UserError("no tokenizer for the GGUF (neither a base GGUF nor a tokenizer.json)")
        _add(w, "token_embd.weight", a.embedding().weight, outtype)
        _add(w, "output_norm.weight", a.final_norm().weight, outtype)
        if not getattr(c, "tie_word_embeddings", False):
            _add(w, "output.weight", a.lm_head().weight, outtype)
        for i, (n_head, n_kv, _) in enumerate(layers):
            att, mlp = a.attention(i), a.mlp(i)
            attn_norm, ffn_norm = a.norms(a.layer(i))
            gate, up = mlp.inputs
            q = permute_rows(att.query.weight.float().cpu().numpy(), n_head)
            k = permute_rows(att.key.weight.float().cpu().numpy(), n_kv)
            for tensor, t in (("attn_norm", attn_norm.weight), ("attn_q", torch.from_numpy(q)),
                              ("attn_k", torch.from_numpy(k)), ("attn_v", att.value.weight),
                              ("attn_output", att.output.weight), ("ffn_norm", ffn_norm.weight),
                              ("ffn_gate", gate.weight), ("ffn_up", up.weight), ("ffn_down", mlp.output.weight)):
                _add(w, f"blk.{i}.{tensor}.weight", t, outtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
    return {"path": str(dest), "layers": layers, "outtype": outtype}


@register_export_format("gguf", outtypes=OUTTYPES)
def export_gguf(run_dir: Path, dest: Path, outtype: str) -> dict:
    """GGUF for llama.cpp (deci architecture: per-layer head counts and FFN widths)."""
    from ..config import PruneConfig
    from ..loading import load_model, resolve_model
    from ..rundir import CONFIG_FILE, MODEL_DIR

    model, _ = load_model(resolve_model(str(run_dir / MODEL_DIR)), "float32", "cpu")
    check_exportable(model)  # before the base model's tokenizer is looked for
    base = resolve_model(PruneConfig.load(run_dir / CONFIG_FILE).model)
    tokenizer_gguf = Path(base.path) / base.gguf_file if base.gguf_file else None
    tokenizer_json = run_dir / MODEL_DIR / "tokenizer.json"
    return write_gguf(model, dest, outtype, tokenizer_gguf=tokenizer_gguf,
                      tokenizer_json=tokenizer_json if tokenizer_json.is_file() else None, name=run_dir.name)
