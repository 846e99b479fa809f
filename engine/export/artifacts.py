"""Artifacts of a run: the small mask artifact over the untouched base model, and the sliced export.

The export is a normal transformers folder (config.json, safetensors, tokenizer) whose model
type, e.g. "pruned_llama", carries per-layer KV-head counts and MLP widths. A copy of
modeling_pruned.py travels with it and config.json's auto_map points at it, so
`AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` loads it anywhere.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..model import modeling_pruned
from ..model.arch import ModelAdapter, base_model_type
from ..errors import UserError, shorten
from ..storage.io import atomic_file, atomic_dir, atomic_write_text
from ..model.loading import count_parameters
from ..run.files import MASKS_FILE, MASKS_META_FILE  # noqa: F401  (MASKS_FILE: the app reads it from here)
from ..model.unit_types import UNIT_TYPES, layer_unit_types, renamed_units, unit_name
from ..model.units import UnitLayout

_MODELING_FILE = "modeling_pruned.py"
# Config keys that describe the source checkpoint, not the architecture of the export.
_SOURCE_ONLY_KEYS = ("quantization_config", "architectures", "auto_map", "model_type", "transformers_version", "_name_or_path")


def save_mask_artifact(out: Path, base_model: str, layout: UnitLayout, scores: dict[str, torch.Tensor],
                       masks: dict[str, torch.Tensor], init_scores: dict[str, torch.Tensor],
                       init_masks: dict[str, torch.Tensor] | None = None) -> None:
    """masks.safetensors: per unit type the final scores and masks, the initial scores and (init_masks) the init
    mask, the one the init perplexity measured; masks.json: their layout and kept counts."""
    tensors = {}
    for u in scores:
        tensors[f"scores.{u}"] = scores[u].float().contiguous()
        tensors[f"masks.{u}"] = masks[u].float().contiguous()
        tensors[f"init_scores.{u}"] = init_scores[u].float().contiguous()
        if init_masks is not None and u in init_masks:
            tensors[f"init_masks.{u}"] = init_masks[u].float().contiguous()
    with atomic_file(out / MASKS_FILE, sum(t.numel() * t.element_size() for t in tensors.values())) as tmp:
        save_file(tensors, str(tmp))
    meta = {
        "base_model": base_model,
        "unit_types": layout.unit_types,
        "units_per_layer": layout.sizes,
        "kept_per_layer": {u: [int(m.sum()) for m in layout.split(u, masks[u])] for u in masks},
    }
    atomic_write_text(out / MASKS_META_FILE, json.dumps(meta, indent=2) + "\n")


def saved_mask_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    """A masks.safetensors' tensors (KIND.UNIT_TYPE: masks, scores, init_masks, init_scores), every unit type under
    its name: a run saved under an older name (heads) reads as today's (kv_groups)."""
    return {f"{kind}.{unit_name(u)}" if dot else name: t for name, t in load_file(str(path)).items()
            for kind, dot, u in [name.partition(".")]}


def saved_masks(path: str | Path, kind: str = "masks") -> dict[str, torch.Tensor]:
    """One kind of a masks.safetensors' tensors (masks, scores, init_masks, init_scores), unit type -> tensor over
    all layers, every unit type under its name today."""
    return {name.split(".", 1)[1]: t for name, t in saved_mask_tensors(path).items() if name.startswith(f"{kind}.")}


def load_mask_artifact(run_dir: str | Path) -> tuple[dict, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(metadata, final masks per unit type, scores per unit type) of a finished run."""
    run_dir = Path(run_dir)
    try:
        meta = json.loads((run_dir / MASKS_META_FILE).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{run_dir} holds no finished run's masks ({shorten(str(e), 120)})") from e
    try:
        tensors = saved_mask_tensors(run_dir / MASKS_FILE)
    except Exception as e:  # (a missing file, or safetensors' own error for a damaged or truncated one)
        raise UserError(f"{run_dir / MASKS_FILE} cannot be read ({shorten(str(e), 100)}): the run's masks are "
                        "damaged; run the pruning again (--overwrite)") from e
    if isinstance(meta, dict):  # (a unit type saved under an older name: by its name)
        meta = renamed_units(meta)
    problem = mask_meta_problem(meta, tensors)
    if problem is not None:
        raise UserError(f"{run_dir / MASKS_META_FILE} is damaged ({problem}); run the pruning again (--overwrite)")
    masks = {u: tensors[f"masks.{u}"] for u in meta["unit_types"]}
    scores = {u: tensors[f"scores.{u}"] for u in meta["unit_types"]}
    return meta, masks, scores


def mask_meta_problem(meta, tensors: dict[str, torch.Tensor]) -> str | None:
    """Why masks.json and masks.safetensors do not make a run's masks, or None: every unit type needs its
    units per layer (whole numbers), and its masks and scores, one value per unit."""
    if not isinstance(meta, dict) or not isinstance(meta.get("unit_types"), list) or not meta["unit_types"]:
        return "no list of unit_types"
    sizes = meta.get("units_per_layer")
    for u in meta["unit_types"]:
        if not isinstance(u, str) or u not in UNIT_TYPES:
            return f"unit type {shorten(repr(u), 40)} is not one this tool knows ({', '.join(UNIT_TYPES)})"
        if not isinstance(sizes, dict) or not isinstance(sizes.get(u), list) or not all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes[u]):
            return f"units_per_layer of {u} is missing or not a list of whole numbers"
        for kind in ("masks", "scores"):
            t = tensors.get(f"{kind}.{u}")
            if t is None or t.shape != (sum(sizes[u]),):
                return f"{kind} of {u} {'missing' if t is None else 'do not match units_per_layer'}"
    return None


def kept_indices(layout: UnitLayout, masks: dict[str, torch.Tensor], adapter: ModelAdapter,
                 empty_ok: bool = False) -> list[tuple[int, dict[str, torch.Tensor]]]:
    """(layer index, {unit type: kept unit indices}) of every kept layer, for each unit type inside
    layers; a type that was not pruned keeps everything. A whole-layer mask drops layers. empty_ok: a layer may
    keep no unit of a type (a sampled mask may; the refit then leaves only the compensation), else it is refused."""
    per_layer = {u: layout.split(u, m) for u, m in masks.items()}
    out = []
    for i in range(adapter.num_layers):
        if any(UNIT_TYPES[u].whole_layer and not parts[i].any() for u, parts in per_layer.items()):
            continue
        kept = {}
        for t in layer_unit_types():
            kept[t.name] = (torch.nonzero(per_layer[t.name][i]).flatten() if t.name in per_layer
                            else torch.arange(t.sizes(adapter)[i]))
            if len(kept[t.name]) == 0 and not empty_ok:
                raise ValueError(f"layer {i} would keep no unit of {t.name}")
        out.append((i, kept))
    if not out:
        raise ValueError("the masks keep no layer")
    return out


def _compensation_biases(adapter: ModelAdapter, i: int, kept: dict[str, torch.Tensor],
                         comp_means: dict[str, list[torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Layer i's output-projection biases that stand in for its removed units: W[:, removed] mu[removed]
    (the masked model with compensation computes exactly m x + (1 - m) mu before the projection).
    Keyed by the bias's state-dict name."""
    out = {}
    for t in layer_unit_types():
        proj = t.output_proj(adapter, i)
        w = proj.weight.detach().double().cpu()
        bias = torch.zeros(w.shape[0], dtype=torch.float64) if proj.bias is None else proj.bias.detach().double().cpu()
        if t.name in comp_means:
            bias = bias + t.removed_contribution(adapter, w, kept[t.name], comp_means[t.name][i].double().cpu())
        out[f"{adapter.param_name(proj)}.bias"] = bias.to(proj.weight.dtype)
    return out


@torch.no_grad()
def build_pruned_model(model, layout: UnitLayout, masks: dict[str, torch.Tensor],
                       comp_means: dict[str, list[torch.Tensor]] | None = None):
    """A physically smaller copy of `model` (on CPU) whose forward equals the masked model's.

    comp_means: bias compensation (see masking.MaskHooks.set): each removed unit's mean input becomes part
    of the output projections' biases, so the copy equals the masked model with those compensation means.

    Removed layers are dropped and the kept ones renumbered (so the KV cache lines up). When every
    kept layer keeps all its KV groups and channels, the copy is the plain base architecture with
    fewer layers (it reloads with plain transformers); otherwise it is the pruned_<type> model with
    per-layer KV-head counts and MLP widths.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    adapter = ModelAdapter.for_model(model)
    keep = kept_indices(layout, masks, adapter)
    base_type = base_model_type(model.config)
    cfg = {k: v for k, v in model.config.to_dict().items() if k not in _SOURCE_ONLY_KEYS}
    for key in (*(t.pruned_config_key for t in layer_unit_types()), "base_model_type", "output_bias"):
        cfg.pop(key, None)
    cfg["num_hidden_layers"] = len(keep)
    if isinstance(cfg.get("layer_types"), list):
        cfg["layer_types"] = [cfg["layer_types"][i] for i, _ in keep]
    counts = {t.pruned_config_key: [len(kept[t.name]) for _, kept in keep] for t in layer_unit_types()}
    dense = all(n == t.dense_count(model.config) for t in layer_unit_types() for n in counts[t.pruned_config_key])
    if not comp_means and dense and not getattr(model.config, "output_bias", False):
        config = AutoConfig.for_model(base_type, **cfg)
        pruned = AutoModelForCausalLM.from_config(config)
    else:
        config_cls, model_cls = adapter.pruned_classes()
        # a source export that already carries output biases keeps them
        cfg.update(counts, base_model_type=base_type,
                   output_bias=bool(comp_means) or bool(getattr(model.config, "output_bias", False)))
        cfg["auto_map"] = {
            "AutoConfig": f"{Path(_MODELING_FILE).stem}.{config_cls.__name__}",
            "AutoModelForCausalLM": f"{Path(_MODELING_FILE).stem}.{model_cls.__name__}",
        }
        pruned = model_cls(config_cls(**cfg))
    pruned = pruned.to(next(model.parameters()).dtype)
    state = dict(model.state_dict())
    prefix = adapter.layers_prefix + "."
    for i, kept in keep:
        for t in layer_unit_types():
            for key, (dim, idx) in t.slices(adapter, i, kept[t.name]).items():
                if key in state:
                    state[key] = state[key].index_select(dim, idx.to(state[key].device))
        if comp_means:
            state.update(_compensation_biases(adapter, i, kept, comp_means))
    renumber = {i: j for j, (i, _) in enumerate(keep)}
    new_state = {}
    for key, value in state.items():
        if key.startswith(prefix):
            index, rest = key[len(prefix):].split(".", 1)
            if int(index) not in renumber:
                continue
            key = f"{prefix}{renumber[int(index)]}.{rest}"
        new_state[key] = value.cpu()
    pruned.load_state_dict(new_state, strict=True)
    pruned.generation_config = model.generation_config
    pruned.eval().requires_grad_(False)
    return pruned


def weight_bytes(model) -> int:
    """The bytes of a model's weights as save_pretrained writes them: a tensor shared by two names (tied
    embeddings) once. A lower bound of the folder's size (the free-space check refuses nothing that fits)."""
    seen = {t.data_ptr(): t.numel() * t.element_size() for t in model.state_dict().values()}
    return sum(seen.values())


def export_pruned(model, tokenizer, layout: UnitLayout, masks: dict[str, torch.Tensor], dest: str | Path,
                  comp_means: dict[str, list[torch.Tensor]] | None = None) -> dict:
    """Write the sliced model to `dest` atomically; returns {"params": ...}."""
    pruned = build_pruned_model(model, layout, masks, comp_means)
    with atomic_dir(Path(dest), weight_bytes(pruned)) as tmp:
        pruned.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if getattr(pruned.config, "auto_map", None):
            shutil.copyfile(modeling_pruned.__file__, tmp / _MODELING_FILE)
    return {"params": count_parameters(pruned)}
