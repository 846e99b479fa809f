"""Writes that never leave a half-written file or folder that looks complete."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError

_JSON_SUFFIXES = (".json", ".jsonl")


def non_finite_key(obj, where: str = "") -> str | None:
    """The path ("a.b[2]") of the first NaN or infinite float inside obj, or None when there is none."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (where or "the value")
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = ((f"[{i}]", v) for i, v in enumerate(obj))
    else:
        return None
    for k, v in items:
        key = f"{where}{k}" if str(k).startswith("[") else (f"{where}.{k}" if where else str(k))
        found = non_finite_key(v, key)
        if found is not None:
            return found
    return None


def dumps_json(obj, what: str = "JSON", **kw) -> str:
    """json.dumps that refuses NaN and infinities (JSON has none; Python would write the invalid NaN)."""
    bad = non_finite_key(obj)
    if bad is not None:
        raise UserError(f"{what}: {bad} is not a finite number; refusing to write it")
    return json.dumps(obj, allow_nan=False, **kw)


def _refuse_constant(name: str):
    raise ValueError(name)


def check_json_text(path: Path, text: str) -> None:
    """A .json/.jsonl file's text must hold no NaN/Infinity (raises UserError naming the file)."""
    docs = [ln for ln in text.splitlines() if ln.strip()] if path.name.endswith(".jsonl") else [text]
    for doc in docs:
        try:
            json.loads(doc, parse_constant=_refuse_constant)
        except ValueError as e:
            if isinstance(e, json.JSONDecodeError):
                continue  # not JSON at all is not this check's business
            raise UserError(f"{path}: refusing to write {e}, which is not a finite number") from None


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publish_mode(path: str | Path, directory: bool = False) -> None:
    """mkstemp/mkdtemp create private files; give them the permissions a plain write would."""
    os.chmod(path, (0o777 if directory else 0o666) & ~_umask())


def atomic_write_text(path: Path, text: str) -> None:
    """Write text to path atomically. A .json/.jsonl file holding NaN or Infinity is refused (UserError)."""
    path = Path(path)
    if path.name.endswith(_JSON_SUFFIXES):
        check_json_text(path, text)
    with atomic_file(path) as tmp, open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


@contextmanager
def atomic_file(path: Path):
    """Yields a temporary path beside `path`; it replaces `path` only if the block succeeds."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        _publish_mode(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(path: Path):
    """Yields a temporary folder beside `path`; it becomes `path` (replacing an old one) only on success."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        _publish_mode(tmp, directory=True)
        for f in tmp.rglob("*"):
            _publish_mode(f, directory=f.is_dir())
        if path.exists():
            old = path.with_name(f".{path.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
