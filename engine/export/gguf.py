"""GGUF for llama.cpp, through its `deci` architecture, which reads per-layer head counts and FFN widths.

Each kept decoder layer is written with its own number of query heads, KV heads and MLP channels
(deci.attention.head_count, deci.attention.head_count_kv, deci.feed_forward_length are arrays);
removed layers are not written (the transformers export drops them too). Query and key rows are
permuted per layer, with that layer's head counts, from the rotate-half order of transformers to the
interleaved order of llama.cpp's rope. The tokenizer is copied from the base model's own GGUF when it
came as one, else built from its tokenizer.json (byte-level BPE, or BPE with byte fallback).

What llama.cpp's deci loader reads (llama-cpp-python 0.3.36; its src/models/deci.cpp and the optional
tensors of src/llama-model.cpp), and so what is written: Q/K/V/O and MLP biases when the model has them
(Qwen2's q/k/v biases, LLaMA's attention_bias/mlp_bias, and the output biases of bias compensation);
RoPE plain, linear-scaled, or llama3-scaled (its frequency factors as rope_freqs.weight). Sliding-window
attention does not exist in deci: the file's context length is capped at the window, inside which full
causal attention is the same computation. Refused before anything is written, in one sentence: per-head
q/k norms (Qwen3; a norm is not linear and cannot be folded into the weights), other activations than
SiLU, partial rotary embeddings, other RoPE scalings (yarn, dynamic, longrope), and layers that deci's
graph would mis-read (attention kept with no MLP channel; query heads not a multiple of the KV heads).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from ..model.arch import ModelAdapter
from ..errors import UserError
from ..model.gguf_file import read_gguf_header
from .checks import check_tokenizer_fits
from ..storage.io import atomic_file
from .registry import register_export_format

OUTTYPES = ("f16", "f32", "q8_0")
_BYTES_PER_WEIGHT = {"f16": 2, "f32": 4, "q8_0": 34 / 32}  # (q8_0: a 2-byte scale per 32 one-byte values)
_ARCH = "deci"


def _rope(config) -> tuple[float, str, dict]:
    """(theta, scaling kind, its parameters): kind is "default", "linear" or "llama3"; others are refused."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    return theta, kind, params


def _context_length(config) -> int:
    """max_position_embeddings, capped at the sliding window where the model uses one (deci has none)."""
    n = int(getattr(config, "max_position_embeddings", 2048))
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    uses_window = (any(t == "sliding_attention" for t in layer_types) if isinstance(layer_types, list)
                   else getattr(config, "use_sliding_window", True) is not False)
    return min(n, int(window)) if window and uses_window else n


def _refusals(model) -> list[str]:
    """What this model has that llama.cpp's deci architecture does not read (empty: exportable)."""
    a = ModelAdapter.for_model(model)
    c = model.config
    out = []
    known = {id(p) for m in (*a.projections(0), *a.norms(a.layer(0))) for p in m.parameters()}
    extra = [name for name, p in a.layer(0).named_parameters() if id(p) not in known]
    if extra:  # e.g. Qwen3's per-head q/k norms
        out.append(f"layer parameters besides the projections and the two norms ({', '.join(extra)}; deci has no "
                   "per-head q/k norms, and a norm cannot be folded into the weights)")
    act = getattr(c, "hidden_act", "silu")
    if act != "silu":
        out.append(f"a {act!r} MLP activation (deci's MLP is SiLU-gated)")
    if float(getattr(c, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        out.append("partial rotary embeddings (deci rotates the whole head)")
    kind = _rope(c)[1]
    if kind not in ("default", "linear", "llama3"):
        out.append(f"RoPE scaling {kind!r} (deci takes none, linear or llama3)")
    if a.head_dim % 2:
        out.append(f"an odd head size ({a.head_dim})")
    return out


def check_exportable(model) -> None:
    refused = _refusals(model)
    if refused:
        raise UserError(f"llama.cpp's deci architecture cannot hold this {model.config.model_type} model: it has "
                        f"{'; '.join(refused)}; no GGUF was written")


def permute_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Query/key rows (or biases) from transformers' rotate-half rope order to llama.cpp's interleaved
    order, per head."""
    head_dim = w.shape[0] // n_heads
    return w.reshape(n_heads, 2, head_dim // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(theta: float, head_dim: int, p: dict) -> np.ndarray:
    """llama.cpp's rope_freqs for llama3 scaling: the divisor of each rotary frequency (as transformers'
    _compute_llama3_parameters scales them)."""
    factor, low, high = float(p["factor"]), float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p.get("original_max_position_embeddings", 8192))
    wavelen = 2 * np.pi * theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    smooth = np.clip((old_ctx / wavelen - low) / (high - low), 0.0, 1.0)
    divisor = 1.0 / ((1 - smooth) / factor + smooth)
    divisor[wavelen < old_ctx / high] = 1.0
    divisor[wavelen > old_ctx / low] = factor
    return divisor.astype(np.float32)


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
def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(device="cpu", dtype=torch.float32).numpy()


def _add(writer, name: str, t: torch.Tensor | np.ndarray, outtype: str) -> None:
    from gguf import GGMLQuantizationType, quants

    data = t if isinstance(t, np.ndarray) else _numpy(t)
    if data.ndim == 1 or outtype == "f32":  # norms stay f32, as llama.cpp's converter keeps them
        writer.add_tensor(name, data.astype(np.float32))
    elif outtype == "q8_0" and data.shape[-1] % 32 == 0:
        q = quants.quantize(data.astype(np.float32), GGMLQuantizationType.Q8_0)
        writer.add_tensor(name, q, raw_dtype=GGMLQuantizationType.Q8_0)  # q holds the bytes: shape follows
    else:  # f16, and q8_0 rows that are not a multiple of its 32-value blocks
        writer.add_tensor(name, data.astype(np.float16))


def _close_quietly(writer) -> None:
    """Close a GGUFWriter's files after a failed write (their last buffered bytes may fail to flush again)."""
    for fout in writer.fout or []:
        try:
            fout.close()
        except OSError:
            pass
    writer.fout = None


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
            raise UserError(f"layer {i} keeps attention but no MLP channel, which llama.cpp's deci graph would "
                            "drop; no GGUF was written")
        if n_head and (n_kv == 0 or n_head % n_kv):
            raise UserError(f"layer {i} has {n_head} query heads for {n_kv} KV heads; deci needs a whole number of "
                            "query heads per KV head; no GGUF was written")
        layers.append((n_head, n_kv, n_ff))
    file_type = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[outtype]
    check_tokenizer_fits(int(a.embedding().weight.shape[0]), tokenizer_gguf, tokenizer_json)
    needed = int(sum(p.numel() for p in model.parameters()) * _BYTES_PER_WEIGHT[outtype])  # (about: norms stay f32)
    with atomic_file(Path(dest), needed) as tmp:
        w = gguf.GGUFWriter(str(tmp), _ARCH)
        try:
            w.add_name(name)
            w.add_file_type(int(file_type))
            w.add_block_count(len(layers))
            w.add_context_length(_context_length(c))
            w.add_embedding_length(int(c.hidden_size))
            w.add_feed_forward_length([n for _, _, n in layers])
            w.add_head_count([n for n, _, _ in layers])
            w.add_head_count_kv([n for _, n, _ in layers])
            w.add_key_length(hd)
            w.add_value_length(hd)
            w.add_rope_dimension_count(hd)
            theta, rope_kind, rope_params = _rope(c)
            w.add_rope_freq_base(theta)
            if rope_kind == "linear":
                w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                w.add_rope_scaling_factor(float(rope_params["factor"]))
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
                tensors = [("attn_norm.weight", attn_norm.weight),
                           ("attn_q.weight", permute_rows(_numpy(att.query.weight), n_head)),
                           ("attn_k.weight", permute_rows(_numpy(att.key.weight), n_kv)),
                           ("attn_v.weight", att.value.weight), ("attn_output.weight", att.output.weight),
                           ("ffn_norm.weight", ffn_norm.weight), ("ffn_gate.weight", gate.weight),
                           ("ffn_up.weight", up.weight), ("ffn_down.weight", mlp.output.weight)]
                if att.query.bias is not None:
                    tensors.append(("attn_q.bias", permute_rows(_numpy(att.query.bias), n_head)))
                if att.key.bias is not None:
                    tensors.append(("attn_k.bias", permute_rows(_numpy(att.key.bias), n_kv)))
                tensors += [(f"{name}.bias", lin.bias) for name, lin in (
                    ("attn_v", att.value), ("attn_output", att.output), ("ffn_gate", gate), ("ffn_up", up),
                    ("ffn_down", mlp.output)) if lin.bias is not None]
                for tensor, t in tensors:
                    _add(w, f"blk.{i}.{tensor}", t, outtype)
            if rope_kind == "llama3":
                _add(w, "rope_freqs.weight", llama3_rope_factors(theta, hd, rope_params), outtype)
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_tensors_to_file()
        except BaseException:  # (a full disk: the open file would hold the space written so far)
            _close_quietly(w)
            raise
        w.close()
        read_gguf_header(tmp, str(dest))  # (the file reads back whole before it is called written)
    return {"path": str(dest), "layers": layers, "outtype": outtype}


def _tokenizer_files(gguf_source, folder: Path) -> dict:
    """write_gguf's tokenizer arguments: the GGUF `gguf_source` (a ModelSource) came as, if any, else the
    tokenizer.json in `folder`, if any."""
    tokenizer_json = folder / "tokenizer.json"
    return {"tokenizer_gguf": Path(gguf_source.path) / gguf_source.gguf_file if gguf_source.gguf_file else None,
            "tokenizer_json": tokenizer_json if tokenizer_json.is_file() else None}


def write_model_gguf(name: str, dest: Path, outtype: str = "f16") -> dict:
    """Any model the engine loads (the default model, a model folder, a run's model/ export) as a deci GGUF,
    its tokenizer from its own GGUF or its tokenizer.json."""
    from ..model.loading import load_model, resolve_model

    source = resolve_model(name)
    model, _ = load_model(source, "float32", "cpu")
    check_exportable(model)
    return write_gguf(model, dest, outtype, **_tokenizer_files(source, Path(source.path)),
                      name=Path(str(name)).name or "model")


def base_model_name(run_dir: Path) -> str:
    """The base model of a run folder (its config.json's `model`) or of a recovery's output folder (its
    recover_config.json's `teacher`, the run's base model): the model whose tokenizer files the GGUF carries."""
    import json

    from ..run.files import CONFIG_FILE, RECOVER_CONFIG_FILE, has_recover_marker, has_run_marker

    name, key = ((RECOVER_CONFIG_FILE, "teacher") if has_recover_marker(run_dir) and not has_run_marker(run_dir)
                 else (CONFIG_FILE, "model"))
    try:  # read from the folder's config, without the run's machinery
        value = json.loads((run_dir / name).read_text())[key]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"cannot read the base model from {run_dir / name} ({type(e).__name__})") from e
    if not isinstance(value, str) or not value:
        raise UserError(f"{run_dir / name} names no base model ({key}: {value!r})")
    return value


@register_export_format("gguf", outtypes=OUTTYPES)
def export_gguf(run_dir: Path, dest: Path, outtype: str) -> dict:
    """GGUF for llama.cpp (deci architecture: per-layer head counts and FFN widths)."""
    from ..model.loading import load_model, resolve_model
    from ..run.files import MODEL_DIR

    model, _ = load_model(resolve_model(str(run_dir / MODEL_DIR)), "float32", "cpu")
    check_exportable(model)  # before the base model's tokenizer is looked for
    base = resolve_model(base_model_name(run_dir))
    return write_gguf(model, dest, outtype, **_tokenizer_files(base, run_dir / MODEL_DIR), name=run_dir.name)
