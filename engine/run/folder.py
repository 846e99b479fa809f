"""A run's folder: what a run writes into it, the marker that says it holds a run, and the checks that
keep --overwrite and --resume from touching anything else.

Everything a run makes goes into its folder: the marker file pg-prune-run, config.json, metrics.jsonl,
checkpoint.pt, masks.safetensors + masks.json, model/ (the sliced export) and results.json. --overwrite
and --resume act only on a folder that carries the marker (or, from before the marker, that holds a run's
own files); --overwrite removes only those files.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from ..settings.config import PruneConfig
from ..errors import UserError
from ..storage.io import atomic_write_text
from ..storage.outdir import (LOCK_FILE, RUN_OWN_NAMES, check_removable, cleanup_out_dir, entries, folder_lock,  # noqa: F401  (the CLI's)
                              prepare_out_dir)
from .files import (CHECKPOINT_FILE, CONFIG_FILE, GGUF_FILE, METRICS_FILE, MODEL_DIR, RESULTS_FILE,  # noqa: F401
                    RUN_FILES, RUN_FORMAT_VERSION, RUN_MARKER, INIT_PROGRESS_DIR)

_MARKER_TEXT = "pg-prune run, format version {}\n"
_MARKER_RE = re.compile(r"pg-prune run, format version (\d+)")


def write_run_marker(out: Path) -> None:
    atomic_write_text(out / RUN_MARKER, _MARKER_TEXT.format(RUN_FORMAT_VERSION))


def run_marker_version(out: Path) -> int | None:
    """The format version the folder's marker names, or None without a (readable, well-formed) marker."""
    try:
        m = _MARKER_RE.fullmatch((out / RUN_MARKER).read_text(encoding="utf-8").strip())
    except (OSError, UnicodeDecodeError):
        return None
    return int(m.group(1)) if m else None


def _is_legacy_run(out: Path) -> bool:
    """A run from before the marker: a config.json that parses as a run config, and the run's own
    metrics.jsonl and checkpoint.pt beside it. A model folder's config.json never parses as one."""
    if not ((out / METRICS_FILE).is_file() and (out / CHECKPOINT_FILE).is_file()):
        return False
    try:
        PruneConfig.load(out / CONFIG_FILE)
    except UserError:
        return False
    return True


def is_run_dir(out: Path, adopt: bool = True) -> bool:
    """Does `out` hold a run? Marked folders do; a pre-marker run is recognised by its content and,
    with adopt, gets the marker. Nothing else counts."""
    out = Path(out)
    if not out.is_dir():
        return False
    if run_marker_version(out) is not None:
        return True
    if _is_legacy_run(out):
        if adopt:
            try:
                write_run_marker(out)
            except OSError:
                pass  # a read-only old run is still a run
        return True
    return False


def remove_leftovers(out: Path) -> None:
    """Remove what interrupted atomic writes of a run left behind (.config.json.x.tmp, .model.x.tmp, .model.old):
    a process killed with SIGKILL cannot clean up after itself."""
    for p in out.iterdir():
        name = p.name
        if name.startswith(".") and any(name.startswith(f".{n}.") for n in (*RUN_FILES, MODEL_DIR, RUN_MARKER)) \
                and (name.endswith(".tmp") or name == f".{MODEL_DIR}.old"):
            # (a link is removed, never what it points at: rmtree refuses a link and would leave it in the way)
            shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)


def check_run_files_are_files(out: Path, flag: str = "--overwrite") -> None:
    """A run writes its RUN_FILES as files: a folder under one of those names (RUN/model.f16.gguf/) is the user's,
    and is refused before anything is deleted (an unlink of it would fail midway, half the run's files gone)."""
    folders = [n for n in RUN_FILES if (Path(out) / n).is_dir() and not (Path(out) / n).is_symlink()]
    if folders:
        raise UserError(f"{flag} refused: {Path(out) / folders[0]} is a folder, which the run never writes (it writes a "
                        "file there); move it elsewhere first (nothing was deleted)")


def remove_run_files(out: Path) -> None:
    """Remove what a run wrote (RUN_FILES, model/, init_progress/, leftovers of interrupted atomic writes, the marker);
    anything else in the folder stays. Refused, before anything is deleted, when model/ holds anything a
    model export does not write (a user's copy, notes), or when one of the run's file names is a folder."""
    check_removable(out, (MODEL_DIR,))
    check_run_files_are_files(out)
    for name in RUN_FILES:
        (out / name).unlink(missing_ok=True)
    for d in (MODEL_DIR, INIT_PROGRESS_DIR):  # (a link is removed, never what it points at)
        (out / d).unlink() if (out / d).is_symlink() else shutil.rmtree(out / d, ignore_errors=True)
    remove_leftovers(out)
    (out / RUN_MARKER).unlink(missing_ok=True)


def trim_metrics(path: Path, step: int, last_line: str | None = None) -> list[dict]:
    """Keep the metric lines of steps 1..step (the checkpoint's), each once; drop later steps (a resumed run
    redoes them) and a line cut short by a crash. `last_line` (the checkpoint's copy of step `step`'s line)
    takes the place of that step's line when it was lost. Returns the kept records."""
    path = Path(path)
    if not path.exists() and last_line is None:
        return []
    kept: dict[int, str] = {}
    text = path.read_text(encoding="utf-8", errors="replace") if path.exists() else ""  # (garbage bytes: skipped lines)
    for ln in [*text.splitlines(), *([last_line] if last_line else [])]:
        try:
            record = json.loads(ln)
            n = record["step"]
        except (ValueError, KeyError, TypeError):
            continue  # blank, or cut short by a crash mid-write
        if isinstance(n, int) and 1 <= n <= step and n not in kept:
            kept[n] = ln
    lines = [kept[n] for n in sorted(kept)]
    atomic_write_text(path, "".join(ln + "\n" for ln in lines))
    return [json.loads(ln) for ln in lines]


_OWN_NAMES = RUN_OWN_NAMES  # (a run's own names in its folder: what --overwrite or --resume replaces)


def check_no_links(out: Path) -> None:
    """A run's own files and folders in `out` are never symbolic links: a run writes them (metrics.jsonl appended
    to, init_progress/ written into), so a link would send its writes into whatever it points at (a user's file
    in a folder unpacked from elsewhere). Refused in one line, naming the link; nothing is followed."""
    links = [n for n in _OWN_NAMES if (Path(out) / n).is_symlink()]
    if links:
        target = os.readlink(Path(out) / links[0])
        raise UserError(f"{', '.join(links)} in {out}: {'a symbolic link' if len(links) == 1 else 'symbolic links'} "
                        f"({links[0]} to {target}); a run never writes through a link: replace each with the file "
                        "itself, or remove it")


def enclosing_run(path: Path) -> tuple[Path, str] | None:
    """(run folder, the name of its own file or folder that holds `path`) when `path` lies inside a run folder
    (its ancestors' markers, symbolic links followed), else None. The name is "" for a path among the run's own
    that it does not own (a user's file beside the run's)."""
    real = Path(os.path.realpath(path))
    for parent in real.parents:
        if is_run_dir(parent, adopt=False):
            top = real.relative_to(parent).parts[0]
            return parent, (top if top in _OWN_NAMES else "")
    return None


def check_not_in_run(out: Path, flag: str = "--out") -> None:
    """No run (nor other output) starts inside another run's folder: that run's --overwrite or --resume would
    delete it, or mix it with the run's own files."""
    found = enclosing_run(out)
    if found is not None:
        raise UserError(f"{flag} {out} lies inside the run folder {found[0]}, whose --overwrite or --resume could "
                        "delete it; choose a folder outside it")


def check_export_destination(dest: Path, flag: str = "--out") -> None:
    """An export (the CLI's, the app's copy of a model) never writes one of a run's own names (RUN/model.gguf,
    RUN/results.json, RUN/init_progress/...): that run's --overwrite would delete it, its --resume replace it. A name
    of the user's own beside the run (RUN/mine.gguf) survives both; RUN/model/... is export_run's to refuse."""
    found = enclosing_run(Path(dest))
    if found is not None and found[1] not in ("", MODEL_DIR):
        raise UserError(f"{flag} {dest}: {found[1]} belongs to the run around it (its --overwrite and --resume "
                        "replace it); choose another name, or a folder outside the run")


# how check_out_dir names the arguments it checks: the command line's flags, or engine.api.prune's keywords
CLI_FLAGS = {"out": "--out", "resume": "--resume", "overwrite": "--overwrite"}
API_FLAGS = {"out": "out", "resume": "the command line's --resume", "overwrite": "overwrite=True"}  # (no resume)


def check_out_dir(out: Path, resume: bool, overwrite: bool, clear: bool = True, flags: dict = CLI_FLAGS) -> None:
    """Refuse to mix two runs in one folder, and refuse --resume/--overwrite on any folder that is not a
    run (see is_run_dir). With overwrite, remove the old run's files (unless clear=False: check only, so
    that a caller can validate everything else before deleting anything). The one check of a run's folder: the
    command line's --out, the app's jobs and engine.api.prune's `out` (flags: how its messages name them)."""
    out, flag = Path(out), flags["out"]
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} exists and is not a folder")
    check_not_in_run(out, flag)
    if not out.exists() or not entries(out):
        if resume:
            raise UserError(f"{flags['resume']}: {out} holds no run (no {CONFIG_FILE}, no {RUN_MARKER} marker)")
        return
    holds_run = is_run_dir(out)
    if holds_run:
        version = run_marker_version(out)
        if version is not None and version > RUN_FORMAT_VERSION:
            raise UserError(f"{out} holds a run of format version {version}, newer than this program's "
                            f"{RUN_FORMAT_VERSION}; update pg-prune or choose another {flag}")
    if resume:
        if not holds_run:
            raise UserError(f"{flags['resume']} refused: {out} holds no run (no {RUN_MARKER} marker and no run's "
                            f"{CONFIG_FILE}, {METRICS_FILE} and {CHECKPOINT_FILE})")
        check_checkpoint_kept(out)  # (steps were done: a resume without their checkpoint would start again)
        check_no_links(out)
        check_removable(out, (MODEL_DIR,), flags["resume"])  # (a finished run re-exports model/: --overwrite's rule)
        if clear:
            remove_leftovers(out)
        return
    if overwrite:
        if holds_run:
            check_removable(out, (MODEL_DIR,), flags["overwrite"])
            check_run_files_are_files(out, flags["overwrite"])
            if clear:
                remove_run_files(out)
            return
        raise UserError(f"{flags['overwrite']} refused: {out} is not empty and holds no run (no {RUN_MARKER} marker); "
                        "nothing was touched; choose another folder")
    if holds_run:
        raise UserError(f"{flag} {out} already holds files of another run; use {flags['resume']}, "
                        f"{flags['overwrite']} or another {flag}")
    raise UserError(f"{flag} {out} already holds files and no run ({held(out)}); nothing was touched; choose a new "
                    "or empty folder")


def held(folder: Path, shown: int = 3) -> str:
    """What a folder holds, for a message: its first names (a sub-folder with a slash), and how many more."""
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in entries(folder))
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more" if len(names) > shown else "")


def recorded_steps(out: Path) -> int:
    """The highest step metrics.jsonl records; 0 when it records none or is missing (lines cut short are skipped)."""
    try:
        text = (Path(out) / METRICS_FILE).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return 0
    best = 0
    for ln in text.splitlines():
        try:
            n = json.loads(ln)["step"]
        except (ValueError, KeyError, TypeError):
            continue
        if isinstance(n, int) and not isinstance(n, bool) and n > best:
            best = n
    return best


def check_checkpoint_kept(out: Path) -> None:
    """--resume of a run that did steps needs its checkpoint: without checkpoint.pt a resume would start again at
    step 0, beside the old metric lines (or redo a finished run). Refused when metrics.jsonl records steps or
    results.json says the run finished; a run stopped before its first checkpoint has neither, and resumes from
    its start (see interrupted_before_first_step)."""
    out = Path(out)
    if (out / CHECKPOINT_FILE).exists():
        return
    steps, finished = recorded_steps(out), (out / RESULTS_FILE).is_file()
    if steps or finished:
        said = f"{RESULTS_FILE} says the run finished" if finished else f"{METRICS_FILE} records {steps} finished steps"
        raise UserError(f"--resume refused: {CHECKPOINT_FILE} is missing from {out}, but {said}; a resume would start "
                        f"again at step 0. Restore {CHECKPOINT_FILE}, or start again with --overwrite")


def interrupted_before_first_step(out: Path, phase: str | None = None) -> str:
    """What to do after an interrupt before the run's first checkpoint (the init metric, the refit's statistics,
    the dense evaluation ...). The run's marker and config.json are written first, so the folder holds a run: a
    plain re-run into it is refused, and --resume (no checkpoint, no recorded step) redoes the start, taking what
    is cached (SLEB's removals so far in init_progress/, $PG_PRUNE_METRIC_CACHE, the dense perplexity)."""
    where = f" (in the {phase})" if phase and phase != "load" else ""
    if not is_run_dir(out, adopt=False):
        return f"before the first step{where}; nothing of the run was written to {out}: start it again"
    return (f"before the first step{where}; python -m engine prune --out {out} --resume redoes the phases before the "
            "steps, reusing what is cached (SLEB's removals so far, the dense perplexity); a new run there needs --overwrite")
