"""The transformers export: the run's sliced model folder (config with per-layer sizes, safetensors,
tokenizer, modeling_pruned.py), which reloads with `from_pretrained(..., trust_remote_code=True)`."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..io import atomic_dir
from ..runfiles import MODEL_DIR
from .registry import register_export_format


@register_export_format("hf", outtypes=("as-run",))
def export_hf(run_dir: Path, dest: Path, outtype: str) -> dict:
    """A transformers folder: the run's sliced export, copied."""
    with atomic_dir(dest) as tmp:
        shutil.copytree(run_dir / MODEL_DIR, tmp, dirs_exist_ok=True)
    return {"path": str(dest)}
