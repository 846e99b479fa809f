"""The exporters registry: the table and its decorator (the package's __init__ imports the entries).

Entries import their decorator from here, never from the package, so that no entry imports the package that
imports it."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import UserError
from ..storage.io import remove_stale_temps
from ..storage.outdir import folder_lock
from ..settings.registry import add_entry
from ..run.files import has_recover_marker, has_run_marker, MASKS_META_FILE, MODEL_DIR

Exporter = Callable[[Path, Path, str], dict]  # (run folder, destination, outtype) -> what was written


@dataclass(frozen=True)
class ExportFormat:
    name: str
    fn: Exporter
    outtypes: tuple[str, ...]
    summary: str


EXPORT_FORMATS: dict[str, ExportFormat] = {}


def register_export_format(name: str, outtypes: tuple[str, ...]):
    def add(fn: Exporter) -> Exporter:
        add_entry(EXPORT_FORMATS, name, ExportFormat(name, fn, outtypes, (fn.__doc__ or "").strip().split("\n")[0]), "export format")
        return fn

    return add


def export_run(run_dir: str | Path, fmt: str, dest: str | Path, outtype: str | None = None) -> dict:
    """Export a finished run, or a finished recovery's output folder (engine/tools/recover.py), in format `fmt` to
    `dest` (which must not exist): its model/ is what is written."""
    if fmt not in EXPORT_FORMATS:
        raise UserError(f"unknown export format {fmt!r}; choose from {', '.join(EXPORT_FORMATS)}")
    f = EXPORT_FORMATS[fmt]
    outtype = outtype or f.outtypes[0]
    if outtype not in f.outtypes:
        raise UserError(f"format {fmt} writes {', '.join(f.outtypes)}, not {outtype!r}")
    if fmt == "gguf" and (str(dest).endswith(("/", os.sep)) or Path(dest).is_dir()):  # Path() drops the slash
        raise UserError(f"--out {dest} names a folder, but the gguf format writes one file; give a file name "
                        "(e.g. --out model.gguf)")
    run_dir, dest = Path(run_dir), Path(dest)
    recovered = run_dir.is_dir() and has_recover_marker(run_dir) and not has_run_marker(run_dir)
    if not run_dir.is_dir() or not (has_run_marker(run_dir) or recovered):
        raise UserError(f"{run_dir} is not a run folder (nor a recover output folder)")
    with folder_lock(run_dir, exclusive=False, what="export"):  # a run being written is refused, naming its process
        if recovered and not (run_dir / MODEL_DIR / "config.json").is_file():
            raise UserError(f"{run_dir} holds no recovered model ({MODEL_DIR}/): finish the recovery first (python -m "
                            f"engine recover RUN --out {run_dir} --resume)")
        if not recovered and (not (run_dir / MASKS_META_FILE).is_file() or not (run_dir / MODEL_DIR / "config.json").is_file()):
            raise UserError(f"{run_dir} holds no finished mask and export ({MASKS_META_FILE}, {MODEL_DIR}/): finish the run "
                            "first (python -m engine prune --out RUN --resume)")
        if dest.exists():
            raise UserError(f"--out {dest} already exists; choose a new path (nothing was written)")
        if not dest.parent.is_dir():
            raise UserError(f"the folder of --out {dest} does not exist")
        inside = next((a for a in dest.resolve().parents if a.name == MODEL_DIR
                       and (has_run_marker(a.parent) or has_recover_marker(a.parent))), None)
        if inside is not None:
            raise UserError(f"--out {dest} is inside {inside}, the run's own model folder, which --overwrite and "
                            "--resume replace; choose a path outside it")
        remove_stale_temps(dest)  # (what an export killed with kill -9 left beside the same --out)
        try:
            return f.fn(run_dir, dest, outtype)
        except OSError as e:  # the exporters write atomically: nothing is left half-written
            raise UserError(f"cannot write --out {dest}: {e.strerror or e}") from None
