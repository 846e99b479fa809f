"""Folders the tool writes into: one rule for every command that writes, and a lock per folder.

The rule: a command writes only into a folder it creates, or into a folder it owns, recognised by its
marker file (a prune run's `pg-prune-run`, a fine-tune's `pg-prune-finetune`, ...). An existing folder
holding anything else is refused, in one line, before any work. `--overwrite` removes only the files
and folders that kind of output writes, and refuses, before deleting anything, when one of its own
folders (model/) holds something it did not write.

The lock: a writer holds an exclusive advisory lock (flock) on FOLDER/.pg-prune.lock for as long as it
writes; a reader (export) holds a shared one. The kernel drops a lock when its process dies, so a stale
lock (kill -9, power loss) never blocks anyone; the file's text only names the holder for the message.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import tempfile
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .io import atomic_write_text
from ..run.files import INIT_PROGRESS_DIR, MODEL_DIR, RUN_FILES, RUN_MARKER, has_run_marker

LOCK_FILE = ".pg-prune.lock"
# a prune run's own names in its folder: what it writes, and what its --overwrite or --resume removes or replaces
RUN_OWN_NAMES = (*RUN_FILES, MODEL_DIR, INIT_PROGRESS_DIR, RUN_MARKER, LOCK_FILE)
_WRITE_PROBE = ".pg-prune-write-test."
# What a model export (save_pretrained of a model and its tokenizer, plus the pruned model's code) puts in
# its folder: an owned model/ folder is removed by --overwrite only when it holds nothing else.
_EXPORT_FILE_RE = re.compile(
    r"(config|generation_config|model\.safetensors\.index|tokenizer|tokenizer_config|special_tokens_map|"
    r"added_tokens|vocab|preprocessor_config)\.json|model(-\d+-of-\d+)?\.safetensors|merges\.txt|"
    r"tokenizer\.model|chat_template\.jinja|(modeling|configuration)_pruned\.py|pytorch_model\.bin")
# the same for other owned folders, by name (zeroshot's tasks/: lm-eval task configs and their helpers)
_OWNED_DIR_FILES = {"tasks": re.compile(r"[\w.-]+\.(yaml|py)")}


@dataclass(frozen=True)
class OutputKind:
    """One kind of output folder: its marker, and the files and folders it writes (and --overwrite removes)."""

    name: str  # "run", "finetune", ...: said in messages
    marker: str  # the marker file's name
    files: tuple[str, ...]  # names or glob patterns
    dirs: tuple[str, ...] = ()  # owned sub-folders (a model export, task configs)
    version: int = 1

    @property
    def marker_text(self) -> str:
        return f"pg-prune {self.name}, format version {self.version}\n"

    def owns(self, out: Path) -> bool:
        """Does `out` carry this kind's marker?"""
        try:
            return (out / self.marker).read_text(encoding="utf-8").startswith(f"pg-prune {self.name}")
        except (OSError, UnicodeDecodeError):
            return False


def entries(out: Path) -> list[Path]:
    """What a folder holds, less the lock file and write probes (a folder holding only those is empty)."""
    return [p for p in Path(out).iterdir() if p.name != LOCK_FILE and not p.name.startswith(_WRITE_PROBE)]


def foreign_in_owned_dir(folder: Path) -> list[str]:
    """The entries of an owned export folder that no export writes (user files, sub-folders)."""
    if not folder.is_dir():
        return []
    pattern = _OWNED_DIR_FILES.get(folder.name, _EXPORT_FILE_RE)
    return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir()
                  if p.is_dir() or not pattern.fullmatch(p.name))


def check_removable(out: Path, dirs: tuple[str, ...], flag: str = "--overwrite") -> None:
    """Refuse (before anything is deleted) when an owned folder holds files its writer did not put there."""
    for d in dirs:
        foreign = foreign_in_owned_dir(out / d)
        if foreign:
            shown = ", ".join(foreign[:3]) + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else "")
            raise UserError(f"{flag} refused: {out / d} holds {shown}, which the tool did not write; "
                            "move it elsewhere first (nothing was deleted)")


def remove_owned(out: Path, files: tuple[str, ...], dirs: tuple[str, ...]) -> None:
    check_removable(out, dirs)
    for pattern in files:
        for p in out.glob(pattern):
            if p.is_file() or p.is_symlink():
                p.unlink(missing_ok=True)
    for d in dirs:
        shutil.rmtree(out / d, ignore_errors=True)


def check_not_in_run_files(out: Path, flag: str = "--out") -> None:
    """`out` never lies inside a prune run's own file or folder (RUN/model/..., RUN/init_progress/...): that run's
    --overwrite or --resume would delete it, or refuse to go on beside it. A folder of its own beside the run's
    files (RUN/zeroshot) is fine."""
    real = Path(os.path.realpath(out))
    for parent in real.parents:
        if has_run_marker(parent):
            top = real.relative_to(parent).parts[0]
            if top in RUN_OWN_NAMES:
                raise UserError(f"{flag} {out} lies inside {parent / top}, which belongs to the run in {parent} (its "
                                "--overwrite and --resume replace it); choose a path outside it")
            return


def check_output_folder(out: Path, kind: OutputKind, overwrite: bool, flag: str = "--out") -> None:
    """The rule, checked without touching anything: `out` is absent, empty, or (with --overwrite) this
    kind's own folder whose owned sub-folders hold only what it wrote; and never inside a run's own files."""
    out = Path(out)
    check_not_in_run_files(out, flag)
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} exists and is not a folder")
    if not out.exists() or not entries(out):
        return
    if not kind.owns(out):
        raise UserError(f"{flag} {out} is not empty and is not a {kind.name} output folder (no {kind.marker} "
                        "marker); nothing was touched; choose a new or empty folder")
    if not overwrite:
        raise UserError(f"{flag} {out} holds an earlier {kind.name} output; use --overwrite to replace it, or another {flag}")
    check_removable(out, kind.dirs)


def prepare_out_dir(out: Path, flag: str = "--out") -> list[Path]:
    """Create `out` (and missing parents) and check that files can be written in it, before anything
    slow happens. Returns the folders it created, outermost first, for cleanup_out_dir."""
    out = Path(out)
    created = [d for d in reversed([out, *out.parents]) if not d.exists()]
    try:
        out.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise UserError(f"{flag} {out} exists and is not a folder") from None
    except OSError as e:
        raise UserError(f"cannot create {flag} {out}: {e.strerror or e}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=out, prefix=_WRITE_PROBE)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        cleanup_out_dir(created)
        raise UserError(f"{flag} {out} is not writable: {e.strerror or e}") from None
    return created


def cleanup_out_dir(created: list[Path]) -> None:
    """Remove the folders prepare_out_dir created, innermost first, where they hold nothing but a lock file."""
    for d in reversed(created):
        try:
            (d / LOCK_FILE).unlink(missing_ok=True)
            d.rmdir()
        except OSError:
            break


# --- the lock ---------------------------------------------------------------------------------
_held: dict[str, list] = {}  # real path -> [fd, count, exclusive, thread id]
_held_lock = threading.Lock()


def lock_holder(out: Path) -> str:
    try:
        text = (Path(out) / LOCK_FILE).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError):
        text = ""
    return text or "another process"


@contextmanager
def _holding(key: str, entry: list):
    """One holder's share of a lock entry; the last one out closes the descriptor (which drops the flock)."""
    try:
        yield
    finally:
        with _held_lock:
            entry[1] -= 1
            if entry[1] == 0:
                _held.pop(key, None)
                os.close(entry[0])


@contextmanager
def folder_lock(out: Path, exclusive: bool = True, what: str = "write"):
    """Hold the folder's advisory lock for the block. Re-entrant in one thread; another process or thread
    that holds it makes this raise UserError naming the holder. The folder must exist."""
    key = os.path.realpath(out)
    me = threading.get_ident()
    with _held_lock:
        entry = _held.get(key)
        if entry is not None:
            if entry[3] != me:
                raise UserError(f"{out} is in use by another job of this process; wait for it to finish")
            if exclusive and not entry[2]:
                raise UserError(f"{out} is being read; cannot {what} it now")
            entry[1] += 1
            reentered = True
        else:
            reentered = False
    if reentered:
        with _holding(key, entry):
            yield
        return
    path = Path(out) / LOCK_FILE
    try:  # O_NOFOLLOW: a lock file that is a link (to a user's file) is never truncated and written through
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise UserError(f"{path} is a symbolic link; a folder's lock file is never one (it is not followed): "
                            "remove the link, then try again") from None
        if exclusive:
            raise UserError(f"cannot lock {out} to {what} it: {e.strerror or e}") from None
        fd = None  # a read-only folder: nobody can write it either
    if fd is not None:
        try:
            fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise UserError(f"{out} is in use by {lock_holder(out)}; cannot {what} it now "
                            "(wait for it to finish, or stop it)") from None
        if exclusive:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"process {os.getpid()}\n".encode(), 0)
    with _held_lock:
        entry = _held[key] = [fd if fd is not None else os.open(os.devnull, os.O_RDONLY), 1, exclusive, me]
    with _holding(key, entry):
        yield


@contextmanager
def output_folder(out: str | Path, kind: OutputKind, overwrite: bool = False, flag: str = "--out"):
    """Claim `out` for a command that writes `kind`: check the rule (before any work), create it, lock
    it, remove the earlier output's own files (--overwrite), mark it. A failure inside the block leaves
    a folder this call created as it found it: absent."""
    out = Path(out)
    check_output_folder(out, kind, overwrite, flag)
    created = prepare_out_dir(out, flag)
    try:
        with folder_lock(out, what=f"write {kind.name} output into"):
            check_output_folder(out, kind, overwrite, flag)  # again, under the lock
            if entries(out):
                remove_owned(out, kind.files, kind.dirs)
            atomic_write_text(out / kind.marker, kind.marker_text)
            yield out
    except BaseException:
        if created:
            remove_owned(out, (*kind.files, kind.marker), ())
            for d in kind.dirs:
                if not foreign_in_owned_dir(out / d):
                    shutil.rmtree(out / d, ignore_errors=True)
            cleanup_out_dir(created)
        raise
