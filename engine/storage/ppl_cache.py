"""The dense model's perplexity, remembered across runs (a fixed cost every run paid again).

A run that loaded its model from disk looks up the dense perplexity under a key made of everything it depends
on: the model's files (name, size and modification time of each), the dtype and device, and the evaluation
windows' token ids themselves (so the data file, its tokenization, the window length and count are all in
it). A model handed in memory (tests, the app's own copies) is never cached: nothing ties it to its files.

The folder is $PG_PRUNE_CACHE, or ~/.cache/pg-prune; PG_PRUNE_CACHE=off turns the cache off."""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path

import torch

from ..errors import UserError
from .io import atomic_write_text

MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".gguf", ".json", ".model")


OFF_VALUES = ("", "off", "0", "none")


def switched_off(value: str | None) -> bool:
    """An environment setting that turns a cache off: off, 0, none or empty (unset is not off)."""
    return value is not None and value.strip().lower() in OFF_VALUES


def cache_dir() -> Path | None:
    value = os.environ.get("PG_PRUNE_CACHE")
    if switched_off(value):
        return None
    return Path(value).expanduser() if value else Path.home() / ".cache" / "pg-prune"


def check_cache_dir() -> None:
    """A $PG_PRUNE_CACHE that names something other than a folder (a file, or a path through one) is refused in one
    line when a run starts: every cache under it (the dense perplexity, the time probe, model copies) would be
    skipped without a word."""
    check_folder("PG_PRUNE_CACHE", cache_dir(), " (or set PG_PRUNE_CACHE=off)")


def check_folder(env: str, folder: Path | None, hint: str = "") -> None:
    """A cache folder ($env) that names a file, or a path through one, refused in one line (None: no cache)."""
    if folder is None:
        return
    blocker = next((p for p in (folder, *folder.parents) if p.exists()), None)
    if blocker is not None and not blocker.is_dir():
        what = "is a file" if blocker == folder else f"lies under {blocker}, a file"
        raise UserError(f"${env} is {folder}, which {what}, not a folder: point it at a folder{hint}")


def files_key(source, dtype: str) -> str | None:
    """A resolved model's files (model_fingerprint's) by name, size and content (file_digest), and the dtype it is
    computed in, as one string: the key of what is cached per model (the generated calibration text); None when the
    model is not on this disk. By content: weights written over in place, their size and modification time kept,
    are another model (the name, size and time alone served the old model's text); a copy elsewhere is the same."""
    found = model_fingerprint(source.path, source.gguf_file)
    return json.dumps([[[Path(f).name, size, file_digest(Path(f))] for f, size, _ in found], dtype]) if found else None


_DIGESTS_FILE = "file-digests.json"  # in cache_dir(): file_digest's memo across processes
_DIGESTS_KEPT = 256  # entries the memo keeps (the latest)
_digests: dict[str, str] = {}  # this process's memo


def file_digest(path: Path) -> str:
    """The sha256 of a file's bytes, computed once per version of the file: memoised (in this process, and in the
    cache folder's file-digests.json) under its real path, size, modification time, inode and change time. The change
    time (ctime) is the kernel's: every write to the file sets it, and so does setting its modification time back
    (os.utime), so a file written over in place is hashed again. Hashing is cheap enough to do once: SmolLM2's 98 MB
    GGUF in 0.11 s on one shared core, a 14 GB model in about 15 s."""
    st = path.stat()
    stamp = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}|{st.st_ctime_ns}"
    if stamp in _digests:
        return _digests[stamp]
    memo = _digest_memo()
    digest = memo.get(stamp)
    if not isinstance(digest, str):
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
        digest = h.hexdigest()
        _keep_digest(memo, stamp, digest)
    _digests[stamp] = digest
    return digest


def _digest_memo() -> dict:
    folder = cache_dir()
    try:
        memo = json.loads((folder / _DIGESTS_FILE).read_text()) if folder is not None else {}
    except (OSError, ValueError):
        return {}  # (none yet, or damaged: written again)
    return memo if isinstance(memo, dict) else {}


def _keep_digest(memo: dict, stamp: str, digest: str) -> None:
    folder = cache_dir()
    if folder is None:
        return
    memo = {**{k: v for k, v in memo.items() if k != stamp}, stamp: digest}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / _DIGESTS_FILE, json.dumps(dict(list(memo.items())[-_DIGESTS_KEPT:]), indent=0) + "\n")
    except (OSError, UserError):
        pass  # (a read-only or full cache: hashed again next time)


def model_fingerprint(path: str, gguf_file: str | None = None) -> list | None:
    """(name, size, mtime) of the model's files: a folder's weights and configs, or the GGUF file; None when
    the model is not on this disk (a hub id)."""
    p = Path(path)
    if gguf_file:
        files = [p / gguf_file]
    elif p.is_dir():
        files = sorted(f for f in p.iterdir() if f.suffix in MODEL_FILE_SUFFIXES)
    else:
        files = [p]
    if not files or not all(f.is_file() for f in files):
        return None
    return [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]


def dense_key(fingerprint: list, dtype: str, device: str, windows: torch.Tensor) -> str:
    h = hashlib.sha1(json.dumps([fingerprint, str(dtype), str(device), list(windows.shape)]).encode())
    h.update(windows.contiguous().numpy().tobytes())
    return h.hexdigest()[:20]


def _entry(key: str) -> dict:
    folder = cache_dir()
    f = folder / f"dense-{key}.json" if folder else None
    if f is None or not f.is_file():
        return {}
    try:
        entry = json.loads(f.read_text())
    except (OSError, ValueError):
        return {}  # a damaged entry is measured again (and rewritten)
    return entry if isinstance(entry, dict) else {}


def _positive(value) -> float | None:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if number and value == value and 0 < value < math.inf else None


def lookup(key: str) -> float | None:
    return _positive(_entry(key).get("ppl_dense"))


def lookup_seconds(key: str) -> float | None:
    """The wall seconds the cached dense evaluation took (--time-budget's reserve for an evaluation when the run
    evaluates nothing before its last one); None for an entry made before the cache kept them."""
    return _positive(_entry(key).get("seconds"))


def store(key: str, ppl: float, seconds: float | None = None) -> None:
    folder = cache_dir()
    if folder is None or not math.isfinite(ppl):  # (a non-finite figure is never kept: lookup refuses it)
        return
    entry = {"ppl_dense": ppl, **({"seconds": round(seconds, 3)} if seconds else {})}
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / f"dense-{key}.json", json.dumps(entry) + "\n")
    except OSError:
        pass  # a read-only home: the run goes on, measuring next time too
