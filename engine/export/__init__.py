"""Exports: what a finished run writes for deployment.

    artifacts   the run's own artifacts: the small mask file over the base model, and the sliced export
    hf, gguf    the export formats, one file each (`@register_export_format`, EXPORT_FORMATS)
    checks      what an export is checked for before it is called done
    registry    the formats' table and its decorator

    python -m engine export RUN_DIR --format NAME --out DEST [--outtype ...]

An exporter takes a finished run folder (its sliced transformers export, RUN/model) and writes DEST
atomically; `outtypes` are the weight types it can write (the first is its default).
"""

from __future__ import annotations

from .registry import EXPORT_FORMATS, export_run, ExportFormat, register_export_format  # noqa: F401
from . import hf, gguf  # noqa: E402,F401  (register)

__all__ = ["EXPORT_FORMATS", "ExportFormat", "export_run", "register_export_format"]
