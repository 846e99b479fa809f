"""Deploying a finished run from the app: its sliced model as a zip, its GGUF on demand, and the dense model's
GGUF for a same-backend speed comparison. No st.* here: the pages call these, the tests call them directly.

    data = model_zip_bytes(run_dir)                  # a zip of RUN/model/ (one top folder: <run>-model/)
    path = ensure_run_gguf(run_dir, "q8_0")          # RUN/model.q8_0.gguf (or RUN/model.gguf when it is that type)
    dense = dense_gguf("smollm2-135m-instruct", "f16", runs_dir / DENSE_GGUF_DIR)   # cached beside the runs

Every file is written atomically (a temporary file renamed into place), so an interrupted export leaves nothing
half-written; a second caller for the same file waits for the first and then reads its result.
"""

from __future__ import annotations

import io
import os
import zipfile
from pathlib import Path

from ..errors import UserError
from ..storage.io import remove_stale_temps, temp_name
from ..run.files import GGUF_FILE, MODEL_DIR
from ..tools.gguf_cache import (DENSE_GGUF_DIR, check_outtype, dense_gguf, dense_gguf_path, file_lock,  # noqa: F401
                                gguf_outtype)

GGUF_OUTTYPES = ("f16", "q8_0")  # offered in the app (the exporter also writes f32)


# --- the sliced model as a zip ------------------------------------------------------------------------------
def _model_folder(run_dir: str | Path) -> Path:
    folder = Path(run_dir) / MODEL_DIR
    if not (folder / "config.json").is_file():
        raise UserError(f"{Path(run_dir).name} has no sliced model yet (finish the run first)")
    return folder


def model_zip_name(run_dir: str | Path) -> str:
    return f"{Path(run_dir).name}-model.zip"


def model_zip_bytes(run_dir: str | Path) -> bytes:
    """A zip of the run's sliced model folder, every file under one top folder `<run>-model/`: unzipped, it
    loads with AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True). Built in memory (nothing
    is written to disk); weights are stored as they are (they hardly compress), the rest deflated."""
    folder = _model_folder(run_dir)
    top = model_zip_name(run_dir)[: -len(".zip")]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for p in sorted(folder.rglob("*")):
            if not p.is_file() or p.name.startswith("."):
                continue
            method = zipfile.ZIP_STORED if p.suffix in (".safetensors", ".bin", ".gguf") else zipfile.ZIP_DEFLATED
            z.write(p, f"{top}/{p.relative_to(folder).as_posix()}", compress_type=method)
    return buf.getvalue()


# --- GGUF files -----------------------------------------------------------------------------------------------
def run_gguf_path(run_dir: str | Path, outtype: str) -> Path:
    """Where a run's GGUF of this type is (or goes): RUN/model.gguf when `prune --export-gguf` (or Chat) already
    wrote that type there, else RUN/model.<outtype>.gguf."""
    check_outtype(outtype)
    run_dir = Path(run_dir)
    main = run_dir / GGUF_FILE
    if main.is_file() and gguf_outtype(main) == outtype:
        return main
    return run_dir / f"model.{outtype}.gguf"


def ensure_run_gguf(run_dir: str | Path, outtype: str) -> Path:
    """The run's GGUF of this type, exported the first time (the project's exporter, as `python -m engine export
    RUN --format gguf --outtype TYPE`) and cached in the run folder. Slow the first time (the model is loaded
    and written): callers show a spinner."""
    from ..export import export_run

    folder = _model_folder(run_dir)
    path = run_gguf_path(run_dir, outtype)
    with file_lock(path):
        if not path.is_file() or path.stat().st_mtime < _newest(folder):  # missing, or older than the model
            remove_stale_temps(path)  # (what an export killed with kill -9 left: the next export cleans it)
            tmp = temp_name(path)
            tmp.unlink(missing_ok=True)
            try:
                export_run(run_dir, "gguf", tmp, outtype)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
    return path


def cached_run_gguf(run_dir: str | Path, outtype: str) -> Path | None:
    """The run's GGUF of this type when it is already there and not older than the sliced model, else None
    (ensure_run_gguf makes it)."""
    folder = _model_folder(run_dir)
    path = run_gguf_path(run_dir, outtype)
    return path if path.is_file() and path.stat().st_mtime >= _newest(folder) else None


def _newest(folder: Path) -> float:
    return max((p.stat().st_mtime for p in folder.rglob("*") if p.is_file()), default=0.0)


def gguf_download_name(run_dir: str | Path, outtype: str) -> str:
    return f"{Path(run_dir).name}-{outtype}.gguf"


def file_size(path: str | Path) -> str:
    """A file's size for a label: 12.3 MB, 456 kB."""
    n = os.path.getsize(path)
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.0f} kB"
