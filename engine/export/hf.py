"""The transformers export: the run's sliced model folder (config with per-layer sizes, safetensors,
tokenizer, modeling_pruned.py), which reloads with `from_pretrained(..., trust_remote_code=True)`."""

from __future__ import annotations

import shutil
from pathlib import Path

from ..errors import UserError, shorten
from ..storage.io import atomic_dir
from .checks import model_folder_problem
from ..run.files import MODEL_DIR
from .registry import register_export_format


@register_export_format("hf", outtypes=("as-run",))
def export_hf(run_dir: Path, dest: Path, outtype: str) -> dict:
    """A transformers folder: the run's sliced export, copied."""
    source = run_dir / MODEL_DIR
    if (problem := model_folder_problem(source)) is not None:  # (before a copy that would not load is written)
        raise UserError(f"{source} would not load ({problem}); nothing was written: restore it, or run the pruning "
                        "again")
    with atomic_dir(dest, sum(f.stat().st_size for f in source.rglob("*") if f.is_file())) as tmp:
        shutil.copytree(source, tmp, dirs_exist_ok=True)
        if (problem := model_folder_problem(tmp)) is not None:  # (the copy itself, before it is called written)
            raise UserError(f"the copy of the run's {MODEL_DIR}/ does not load ({shorten(problem, 100)}); nothing was "
                            f"written to {dest}")  # (the library's words shortened, so the remedy stays whole)
    return {"path": str(dest)}
