"""GGUF files made on demand and kept: the weight type a GGUF holds, and the dense model converted to GGUF once
(cached beside the runs) so that llama.cpp can run it beside a pruned run's GGUF, like for like.

    gguf_outtype("runs/pg30/model.gguf")                          # "f16"
    dense_gguf("smollm2-135m-instruct", "f16", "runs/.dense-gguf")  # written once, atomically; then reused
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import threading
from pathlib import Path

from ..errors import UserError

DENSE_GGUF_DIR = ".dense-gguf"  # beside the runs: the dense models converted for llama.cpp, one file per model and type
# llama.cpp's general.file_type values (gguf.LlamaFileType) of the types the exporter writes
_FILE_TYPES = {0: "f32", 1: "f16", 7: "q8_0"}

_locks: dict[str, threading.Lock] = {}
_locks_guard = threading.Lock()


def file_lock(path: Path) -> threading.Lock:
    """One lock per file path in this process: a second writer of the same file waits for the first."""
    with _locks_guard:
        return _locks.setdefault(str(Path(path).resolve()), threading.Lock())


def gguf_outtype(path: str | Path) -> str | None:
    """The weight type a GGUF file says it holds ("f16", "q8_0", "f32"), or None (missing, another type, not a
    GGUF)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _outtype(str(Path(path).resolve()), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _outtype(path: str, size: int, mtime_ns: int) -> str | None:  # (size and time: a rewritten file is read anew)
    try:
        from gguf import GGUFReader

        field = GGUFReader(path).fields.get("general.file_type")
        return _FILE_TYPES.get(int(field.contents())) if field is not None else None
    except Exception:  # a file that is not a GGUF, or cut short: not one we can name
        return None


def check_outtype(outtype: str) -> None:
    from ..export.gguf import OUTTYPES

    if outtype not in OUTTYPES:
        raise UserError(f"GGUF type must be one of {', '.join(OUTTYPES)}, not {outtype!r}")


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "model"


def dense_gguf_path(model: str, outtype: str, cache_dir: str | Path) -> Path:
    """Where the dense model's GGUF of this type is cached: named after the model, with a hash of where it
    resolves to and when its files last changed (a model folder rewritten in place gets a new file)."""
    from ..model.loading import resolve_model

    check_outtype(outtype)
    source = resolve_model(str(model))
    where = Path(source.path) / source.gguf_file if source.gguf_file else Path(source.path)
    try:
        files = [where] if where.is_file() else sorted(p for p in where.iterdir() if p.is_file())
        stamp = ";".join(f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files)
    except OSError:
        stamp = ""  # a hub id: its name alone
    key = hashlib.sha1(f"{where.resolve() if where.exists() else where}|{stamp}".encode()).hexdigest()[:10]
    return Path(cache_dir) / f"{_slug(Path(str(model)).name)}-{key}.{outtype}.gguf"


def dense_gguf(model: str, outtype: str, cache_dir: str | Path) -> Path:
    """The dense model as a GGUF of this type, for llama.cpp beside the pruned run's GGUF: the same exporter and
    weight type as the pruned file, so their speeds compare like for like (the default model's packaged Q4_1 file
    would not). Written once into cache_dir (the runs folder's .dense-gguf/), atomically."""
    from ..export.gguf import write_model_gguf

    path = dense_gguf_path(model, outtype, cache_dir)
    with file_lock(path):
        if not path.is_file():
            path.parent.mkdir(parents=True, exist_ok=True)
            try:
                write_model_gguf(str(model), path, outtype)
            except OSError as e:
                raise UserError(f"cannot write the dense model's GGUF {path}: {e.strerror or e}") from None
    return path
