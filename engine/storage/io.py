"""Writes that never leave a half-written file or folder that looks complete."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import shutil
import socket
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..errors import UserError

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
    with atomic_file(path, len(text.encode())) as tmp, open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())


def _host() -> str:
    """This machine's short name, as a temporary name carries it (a folder shared between machines: a pid is only
    checked on its own machine)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname().split(".")[0]) or "host"


def _temp_prefix(path: Path) -> str:
    """An atomic write's temporary name beside `path`: .NAME.pidPID@HOST.XXXX.tmp, so that what a killed process
    left is recognised as its (remove_stale_temps)."""
    return f".{path.name}.pid{os.getpid()}@{_host()}."


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # (another user's process: alive)
        return True
    return True


def remove_stale_temps(path: Path) -> list[Path]:
    """Remove what atomic writes to `path` left beside it when their process was killed (kill -9 leaves no
    chance to clean up): .NAME.pidPID[@HOST].*.tmp of a process that is gone. A live process's, and another
    machine's, are left alone. Returns what was removed."""
    path, removed = Path(path), []
    # (two dots: an atomic write to a temporary name of this pattern, as the app's GGUF export makes)
    pattern = re.compile(rf"\.\.?{re.escape(path.name)}\.pid(\d+)(?:@([A-Za-z0-9-]+))?\..*\.tmp")
    try:
        siblings = [(p, pattern.fullmatch(p.name)) for p in path.parent.iterdir()]
    except OSError:
        return removed
    for p, m in siblings:
        if m is not None and m.group(2) in (None, _host()) and not _alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _size(n: int) -> str:
    return next((f"{n / 1024 ** k:.1f} {unit}" for k, unit in ((3, "GiB"), (2, "MiB"), (1, "KiB")) if n >= 1024 ** k),
                f"{n} bytes")


def free_space(folder: Path) -> int | None:
    """The free bytes of the folder's device; None when unknown (a pseudo filesystem such as /proc reports a size
    of 0: its writes fail for their own reason, never for want of space)."""
    try:
        usage = shutil.disk_usage(folder)
    except OSError:
        return None
    return usage.free if usage.total > 0 else None


def is_disk_full(e: BaseException, folder: Path | None = None, needed: int | None = None) -> bool:
    """Whether a write failed for want of space: OSError ENOSPC, safetensors' "No space left on device" (os error
    28), or (torch.save says only "unexpected pos") any write error while `folder` has less free than `needed`."""
    if isinstance(e, UserError):
        return False
    if (isinstance(e, OSError) and e.errno == errno.ENOSPC) or "No space left on device" in str(e):
        return True
    free = free_space(folder) if folder is not None and needed else None
    return isinstance(e, (OSError, RuntimeError)) and free is not None and free < needed


def check_space(folder: Path, what: str, needed: int | None) -> None:
    """Refuse a write of `needed` bytes (a lower bound, so that nothing that fits is refused) into `folder` before
    it starts, when the folder's device has less free: the full-disk line, and nothing half-written."""
    free = free_space(folder) if needed else None
    if free is not None and free < needed:
        raise disk_full_error(folder, what, needed)


def temp_name(path: Path, tag: str = "export") -> Path:
    """A temporary name beside `path` that remove_stale_temps recognises once its process is gone (for a write
    that is not an atomic_file's own)."""
    path = Path(path)
    return path.with_name(f"{_temp_prefix(path)}{tag}.tmp")


def append_line(fh, line: str, folder: Path, name: str) -> None:
    """Append a line to a file opened unbuffered in binary mode (open(path, "ab", buffering=0)): every byte is
    written or the write raises, and a full disk is the one full-disk line (no buffer left to fail again on
    close). A line that does not fit is cut off again: the file ends with its last whole line."""
    data = memoryview((line + "\n").encode())
    start = os.fstat(fh.fileno()).st_size
    try:
        while data:
            data = data[fh.write(data):]
    except OSError as e:
        if is_disk_full(e):
            try:
                os.ftruncate(fh.fileno(), start)
            except OSError:
                pass  # (trim_metrics drops a line cut short when the run resumes)
            raise disk_full_error(folder, name, len(line) + 1) from None
        raise


def disk_full_error(folder: Path, what: str, needed: int | None) -> UserError:
    """The one line for a full disk: the folder, what was being written, the space it needs and the space free."""
    free = free_space(folder)
    size = _size
    if needed and free is not None and _size(needed) == _size(free):  # (1.0 MiB against 1.0 MiB says nothing)
        size = "{:,} bytes".format
    need = f"about {size(needed)}" if needed else "more space"
    return UserError(f"no space left on the device of {folder} while writing {what} (nothing was written): it needs "
                     f"{need}{f', {size(free)} free' if free is not None else ''}; free some space there, or write "
                     "to another folder")


@contextmanager
def atomic_file(path: Path, needed: int | None = None):
    """Yields a temporary path beside `path`; it replaces `path` only if the block succeeds. `needed` (bytes, a lower
    bound) is checked against the free space first; a full disk ends in one UserError naming the folder and
    `needed` bytes (see is_disk_full). What a killed write to `path` left is removed first."""
    path = Path(path)
    remove_stale_temps(path)  # (what a write to the same path left when its process was killed)
    check_space(path.parent, path.name, needed)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        _publish_mode(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if is_disk_full(e, path.parent, needed):
            raise disk_full_error(path.parent, path.name, needed) from None
        raise


@contextmanager
def atomic_dir(path: Path, needed: int | None = None):
    """Yields a temporary folder beside `path`; it becomes `path` (replacing an old one) only on success. `needed`
    (bytes, a lower bound) is checked against the free space first; a full disk ends in one UserError naming the
    folder and `needed` bytes (see is_disk_full). What a killed write to `path` left is removed first."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(path)  # (what a write to the same path left when its process was killed)
    check_space(path.parent, path.name + "/", needed)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=_temp_prefix(path), suffix=".tmp"))
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
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e, path.parent, needed):
            raise disk_full_error(path.parent, path.name + "/", needed) from None
        raise


# What a checkpoint may hold besides tensors, numbers, strings, None, lists, tuples and dicts (which torch's
# weights-only reader takes anyway): nothing so far. A checkpoint is read with that reader and this list, never with
# plain pickle, so that a checkpoint.pt from someone else's run folder cannot run code on --resume.
SAFE_GLOBALS: list = []
_GLOBAL_RE = re.compile(r"GLOBAL ([\w.]+)")


def safe_load(path: Path, what: str, remedy: str, mmap: bool = False):
    """A file pg-prune wrote with torch.save (a checkpoint, a cached metric), unpickled by torch's weights-only reader
    (tensors, numbers, strings, lists and dicts, plus SAFE_GLOBALS): a file that names any other Python object is
    refused in one line (UserError: "refusing WHAT PATH: ... REMEDY"), its code never run. Other failures (garbage,
    a truncated file) raise as they come. mmap: the tensors mapped, not read (to look at the file's other values)."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(SAFE_GLOBALS):
            return torch.load(path, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        found = _GLOBAL_RE.search(str(e))
        if found is None and "weights_only" not in str(e):
            raise
        named = f"the Python object {found.group(1)}" if found else "Python objects"
        raise UserError(f"refusing {what} {path}: it names {named}, which a pg-prune {what} never holds "
                        f"(loading it could run code); it was not read. {remedy}") from None
