"""The names of what a run writes into its folder (one place; engine/run/folder.py holds the folder's rules).

A leaf module: anything may import it, from the loader up to the app."""

from __future__ import annotations

from pathlib import Path

CONFIG_FILE, METRICS_FILE, CHECKPOINT_FILE, RESULTS_FILE = "config.json", "metrics.jsonl", "checkpoint.pt", "results.json"
MASKS_FILE, MASKS_META_FILE = "masks.safetensors", "masks.json"
MODEL_DIR = "model"
# a greedy init metric's removals so far (SLEB's), while the run has no checkpoint yet: --resume continues them
INIT_PROGRESS_DIR = "init_progress"
GGUF_FILE = "model.gguf"  # prune --export-gguf
RECOVER_DIR = "recover"  # prune --recover: the chained recovery's own folder, beside the run's files
# the app's GGUF downloads of another weight type than model.gguf's, exported on demand (engine/ui/deploy.py)
GGUF_CACHE_FILES = ("model.f16.gguf", "model.q8_0.gguf", "model.f32.gguf")
# A run folder's own marker: its name and content say what the folder is, so that --overwrite can never
# mistake a model folder (which also holds a config.json) for a run.
RUN_MARKER, RUN_FORMAT_VERSION = "pg-prune-run", 1
# Everything a run writes into its folder (--overwrite removes these and nothing else).
RUN_FILES = (CONFIG_FILE, METRICS_FILE, CHECKPOINT_FILE, RESULTS_FILE, MASKS_FILE, MASKS_META_FILE, GGUF_FILE,
             *GGUF_CACHE_FILES)


def has_run_marker(folder: Path) -> bool:
    """Does the folder carry a run's marker file? (engine.run.folder.is_run_dir also recognises runs from before it.)"""
    return (Path(folder) / RUN_MARKER).is_file()


# A recovery's output folder (engine/tools/recover.py): its marker, and its config, which names the teacher (the
# run's base model, whose tokenizer files a GGUF export of the recovered model reads)
RECOVER_MARKER, RECOVER_CONFIG_FILE = "pg-prune-recover", "recover_config.json"


def has_recover_marker(folder: Path) -> bool:
    """Does the folder carry a recovery's marker file (`python -m engine recover ... --out FOLDER`)?"""
    return (Path(folder) / RECOVER_MARKER).is_file()
