"""One background pruning job at a time, watched from a UI; and the run folders on disk.

    jobs = JobManager()
    jobs.start(config, "runs/my-run")      # raises JobBusy while another job runs
    snap = jobs.snapshot()                 # thread-safe copy: status, phase, step history, result
    jobs.stop()                            # the run stops after its current step; resumable

The worker thread never touches a UI. It records the messages PruneRun logs (loading,
initialising, evaluating perplexities, exporting) as the current phase, every StepReport, the
hard masks the last step computed and the init mask (as the run computed them: no mask is derived
here), so that a UI only reads memory.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING
from pathlib import Path

from ..settings.config import PruneConfig
from ..errors import UserError
from ..run.state import report_masks
from .paths import RUNS_DIR_ENV, default_runs_dir  # noqa: F401  (the runs folder: the pages import it from here)

if TYPE_CHECKING:  # annotations only
    from .masks import MaskView


# Job status values. "idle": nothing started yet in this process.
IDLE, LOADING, RUNNING, STOPPING, STOPPED, DONE, FAILED = "idle", "loading", "running", "stopping", "stopped", "done", "failed"
ACTIVE = (LOADING, RUNNING, STOPPING)
DAMAGED = "damaged"  # a run folder whose results.json or config.json the pages cannot read (RunInfo.damaged says why)


class JobBusy(UserError):
    """A second job was asked for while one runs."""


def new_run_name(config: PruneConfig, label: str = "") -> str:
    model = Path(config.model).stem if config.model else "model"
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    base = f"{stamp}-{model}-{config.scope}-{int(round(config.prune_ratio * 100))}pct"
    label = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in label.strip())
    return f"{base}-{label}" if label else base


@dataclass
class JobSnapshot:
    """A consistent copy of a job's state, safe to read from any thread."""

    status: str = IDLE
    phase: str = ""  # the last message the run logged ("evaluating dense perplexity ...")
    error: str | None = None
    error_detail: str | None = None  # traceback of an unexpected failure (UserErrors have none)
    out_dir: str | None = None
    config: dict | None = None
    history: list[dict] = field(default_factory=list)  # StepReport dicts, oldest first (their masks: in `masks`)
    masks: dict[str, list[list[int]]] | None = None  # the last step's hard masks (StepReport.masks), per layer
    init_view: "MaskView | None" = None  # the init mask the run measured, with its initial scores
    result: dict | None = None
    started_at: float | None = None
    finished_at: float | None = None
    resumed_from: int = 0  # steps already done when this job started (resume)
    clock: dict | None = None  # the run's phase open now, its seconds and its plan (engine/run/plan.py's phase_status)
    plan: dict | None = None  # the time plan the run started with (results.json's plan_seconds_by_phase)

    @property
    def active(self) -> bool:
        return self.status in ACTIVE

    @property
    def last(self) -> dict | None:
        return self.history[-1] if self.history else None


class _ModelCache:
    """The last loaded (model, tokenizer), reused by the next job on the same model: loading the default model
    takes ~25 s. Pruning never modifies the model's weights."""

    def __init__(self, enabled: bool):
        self.enabled, self.entry = enabled, None

    def load(self, config: PruneConfig):
        from ..model.loading import load_model, resolve_model

        key = (config.model, config.dtype, config.device)
        if self.entry is not None and self.entry[0] == key:
            return self.entry[1], self.entry[2]
        self.entry = None  # free the old model before loading another
        return load_model(resolve_model(config.model), config.dtype, config.device)

    def keep(self, config: PruneConfig, model, tokenizer) -> None:
        if self.enabled:
            self.entry = ((config.model, config.dtype, config.device), model, tokenizer)


def _kept_history(run, out: Path) -> list[dict]:
    """The steps a resumed run keeps: trimmed to its checkpoint first, as run() will (steps past it are redone,
    and reading them before the trim showed them twice); never the metrics of a run another process writes."""
    from ..storage.outdir import folder_lock

    with folder_lock(out, what="resume"):
        return run.checkpoints.restore_metrics(run.load_checkpoint())


def _without_masks(report: dict) -> dict:
    return {k: v for k, v in report.items() if k != "masks"}


def _init_view(run):
    """The init mask the run computed (PruneRun.start_masks), with the initial scores of the units it reports in
    detail; None before the run has one."""
    from ..run.state import mask_rows
    from .masks import INIT, scores_view

    if getattr(run, "start_masks", None) is None:
        return None
    scores = {u: [p.tolist() for p in run.res.layout.split(u, s)] for u, s in run.init_scores.items()}
    return scores_view(INIT, "init (step 0)", mask_rows(run.res.layout, run.start_masks), scores)


def _ended(result: dict) -> dict:
    if result.get("status") == "stopped":
        return {"status": STOPPED, "phase": f"stopped at step {result.get('step')}; resumable"}
    return {"status": DONE, "phase": f"done: perplexity {result['ppl_dense']:.2f} dense -> {result['ppl_pruned']:.2f} pruned"}


class BackgroundJob:
    """One worker thread and the snapshot it fills, under one lock: what the app's pruning job (JobManager) and its
    recovery (engine/ui/recover_job.py) share. A snapshot has status, phase, error, error_detail and finished_at."""

    def __init__(self, snap):
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._snap = snap

    def wait(self, timeout: float | None = None):
        """Block until the current job ends (tests, scripts); its snapshot."""
        t = self._thread
        if t is not None:
            t.join(timeout)
        return self.snapshot()

    def _set(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                setattr(self._snap, k, v)

    def _log(self, message: str) -> None:
        with self._lock:
            if self._snap.status != STOPPING:
                self._snap.phase = message

    def _failed(self, e: Exception) -> None:
        """The job ended on an exception: one line for bad input (UserError) and the environment (OSError: a full
        disk, a folder that went away), the traceback too for anything else (a bug: the UI stays alive)."""
        if isinstance(e, UserError):
            error, detail = str(e), None
        elif isinstance(e, OSError):
            error, detail = f"{e.strerror or type(e).__name__}" + (f": {e.filename}" if e.filename else ""), None
        else:
            error, detail = f"{type(e).__name__}: {e}", traceback.format_exc()
        self._set(status=FAILED, error=error, error_detail=detail, phase="failed", finished_at=time.time())


class JobManager(BackgroundJob):
    """Owns at most one pruning thread. All public methods are thread-safe."""

    def __init__(self, keep_model: bool = True):
        super().__init__(JobSnapshot())
        self._models = _ModelCache(keep_model)
        self._run = None  # the PruneRun of the current job once it exists: its phase clock and plan are read

    # --- control ---------------------------------------------------------------------------
    def start(self, config: PruneConfig | None, out_dir: str | Path, resume: bool = False) -> None:
        """Start a job; raises JobBusy while one runs and UserError on bad input (checked here, fast). With
        resume=True the run folder's own config.json is used and `config` is ignored."""
        from ..model.loading import resolve_model
        from ..run.folder import CONFIG_FILE, check_out_dir

        out = Path(out_dir)
        with self._lock:
            if self._snap.status in ACTIVE:
                raise JobBusy(f"a job is already running ({self._snap.out_dir}); stop it or wait for it to finish")
            try:
                if resume:
                    check_out_dir(out, resume=True, overwrite=False)
                    config = PruneConfig.load(out / CONFIG_FILE)
                else:
                    check_out_dir(out, resume=False, overwrite=False)
            except OSError as e:  # the runs folder: a file, unwritable, gone (one line, no traceback)
                raise UserError(f"cannot use the run folder {out} ({e.strerror or type(e).__name__}): check the "
                                "runs folder ($PG_PRUNE_RUNS_DIR)") from None
            config.validate()
            resolve_model(config.model)  # a missing file or a folder without a model fails here
            self._stop, self._run = threading.Event(), None
            self._snap = JobSnapshot(status=LOADING, phase=f"loading {config.model}", out_dir=str(out),
                                     config=config.to_dict(), started_at=time.time())
            self._thread = threading.Thread(target=self._work, args=(config, out, resume, self._stop),
                                            name="prune-job", daemon=True)
            self._thread.start()

    def stop(self) -> bool:
        """Ask the running job to stop after its current step. False when nothing runs."""
        with self._lock:
            if self._snap.status not in ACTIVE:
                return False
            self._stop.set()
            self._snap.status = STOPPING
            self._snap.phase = "stopping after the current step (state is saved; resumable)"
            return True

    def snapshot(self) -> JobSnapshot:
        from ..run.plan import phase_status

        with self._lock:
            s, run = self._snap, self._run
            clock = phase_status(run.res.loop.plan, run.res.phases) if run is not None and s.active else None
            return dataclasses.replace(s, history=list(s.history), config=dict(s.config or {}) or None,
                                       result=dict(s.result) if s.result else None, clock=clock,
                                       plan=dict(run.res.loop.plan) if run is not None and run.res.loop.plan else s.plan)

    def busy_with(self, out_dir: str | Path) -> bool:
        with self._lock:
            return self._busy_with_locked(out_dir)

    def _busy_with_locked(self, out_dir: str | Path) -> bool:
        return self._snap.status in ACTIVE and self._snap.out_dir is not None \
            and Path(self._snap.out_dir).resolve() == Path(out_dir).resolve()

    @contextlib.contextmanager
    def holding(self, out_dir: str | Path):
        """The block runs while no job runs in out_dir and none can start (refused if one runs there now)."""
        with self._lock:
            if self._busy_with_locked(out_dir):
                raise UserError(f"{Path(out_dir).name} is being pruned right now; stop the job first")
            yield

    # --- the worker ------------------------------------------------------------------------
    def _work(self, config: PruneConfig, out: Path, resume: bool, stop: threading.Event) -> None:
        try:
            from ..run.loop import PruneRun
            from ..run.folder import CHECKPOINT_FILE

            started = time.monotonic()  # (the run's "load" and --time-budget count the model's loading, as the CLI's)
            model, tok = self._models.load(config)
            self._log("reading calibration and evaluation data")
            run = PruneRun(config, out, model=model, tokenizer=tok, log=self._log, started=started,
                           from_files=True)  # (the keeper's model is config.model's files, never changed by a run)
            with self._lock:
                self._run = run
            self._models.keep(config, model, tok)
            if resume and (out / CHECKPOINT_FILE).exists():
                history = _kept_history(run, out)
                masks = report_masks(history[-1]) if history else None
                self._set(history=[_without_masks(r) for r in history], masks=masks, resumed_from=len(history))
            with self._lock:
                if self._snap.status == LOADING:
                    self._snap.status = RUNNING

            def observe(report) -> None:
                line = dataclasses.asdict(dataclasses.replace(report, masks=None))  # (one step's masks kept: the last)
                line["received"] = time.time()  # (the ETA's wall rate: the checks between steps included)
                init = _init_view(run) if self._snap.init_view is None else None
                with self._lock:
                    self._snap.history.append(line)
                    self._snap.masks = report.masks
                    if init is not None:
                        self._snap.init_view = init
                    if self._snap.status == RUNNING:
                        self._snap.phase = f"step {report.step}/{report.total_steps}"

            result = run.run(resume=resume, observer=observe, stop=stop, progress=False)
            self._set(**_ended(result), result=result, finished_at=time.time())
        except Exception as e:  # (bad input, the environment, or a bug: said in the page, the UI stays alive)
            self._failed(e)


# --- runs on disk ------------------------------------------------------------------------------
@dataclass
class RunInfo:
    path: Path
    name: str
    config: dict
    results: dict | None
    steps_done: int
    has_masks: bool
    has_model: bool
    has_checkpoint: bool
    modified: float
    damaged: str | None = None  # why its results.json or config.json cannot be shown (results is then None)

    @property
    def status(self) -> str:
        if self.damaged is not None:
            return DAMAGED
        if self.results is not None:
            return DONE
        return STOPPED if self.has_checkpoint else "incomplete"


def read_metrics(run_dir: str | Path) -> list[dict]:
    from ..run.folder import METRICS_FILE

    path = Path(run_dir) / METRICS_FILE
    if not path.exists():
        return []
    out = []
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    for ln in text.splitlines():
        if ln.strip():
            try:
                record = json.loads(ln)
            except json.JSONDecodeError:
                break  # a line being written
            if isinstance(record, dict) and isinstance(record.get("step"), int):  # (a step's report; nothing else)
                out.append(record)
    return out


def _stamp(p: Path) -> tuple | None:
    """What read_run reads, as (modification time, size) of each file, or None when config.json is not there: a
    run whose stamp is unchanged reads the same."""
    from ..run.files import CHECKPOINT_FILE, CONFIG_FILE, MASKS_FILE, METRICS_FILE, MODEL_DIR, RESULTS_FILE

    out = []
    for name in (CONFIG_FILE, RESULTS_FILE, METRICS_FILE, MASKS_FILE, MODEL_DIR, CHECKPOINT_FILE):
        try:
            st = (p / name).stat()
            out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            if name == CONFIG_FILE:
                return None
            out.append(None)
    return tuple(out)


_READ: dict[Path, tuple[tuple, "RunInfo"]] = {}  # run folder -> (its stamp, its summary): the pages' reruns re-read
# only the runs whose files changed (the Runs page with 50 runs on disk: bench/runs_page.py)


def read_run(path: str | Path) -> RunInfo | None:
    """A run folder's summary, or None when the folder holds no run; read again only when one of its files
    changed (_stamp)."""
    p = Path(path)
    stamp = _stamp(p)
    if stamp is None:
        _READ.pop(p, None)
        return None
    kept = _READ.get(p)
    if kept is not None and kept[0] == stamp:
        return dataclasses.replace(kept[1])  # (a copy of the summary; its config and results dicts are shared: read only)
    info = _read_run(p)
    if info is not None and _stamp(p) == stamp:  # (a run written while it was read is read again next time)
        _READ[p] = (stamp, info)
    return dataclasses.replace(info) if info is not None else None


def _read_run(path: str | Path) -> RunInfo | None:
    from ..run.files import CHECKPOINT_FILE, CONFIG_FILE, MASKS_FILE, METRICS_FILE, MODEL_DIR, RESULTS_FILE

    from .checks import config_problem, results_problem

    p = Path(path)
    try:
        text = (p / CONFIG_FILE).read_text()
        modified = (p / CONFIG_FILE).stat().st_mtime
    except (OSError, UnicodeDecodeError):
        return None
    damaged, config, results = None, {}, None
    try:
        config = json.loads(text)
        if (why := config_problem(config)) is not None:
            damaged, config = f"{CONFIG_FILE} {why}", {}
    except ValueError as e:
        damaged = f"{CONFIG_FILE} is not valid JSON ({e})"
    try:
        results = json.loads((p / RESULTS_FILE).read_text())
    except FileNotFoundError:
        results = None
    except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError)
        damaged, results = damaged or f"{RESULTS_FILE} is not valid JSON ({e})", None
    except OSError as e:
        damaged, results = damaged or f"{RESULTS_FILE} cannot be read ({e.strerror or e})", None
    if results is not None and (why := results_problem(results)) is not None:
        damaged, results = damaged or f"{RESULTS_FILE} {why}", None
    if damaged is not None:
        results = None
    steps = 0
    try:
        if (p / METRICS_FILE).exists():
            steps = sum(1 for ln in (p / METRICS_FILE).read_text(errors="replace").splitlines() if ln.strip())
    except OSError:
        pass
    return RunInfo(path=p, name=p.name, config=config, results=results, steps_done=steps,
                   has_masks=(p / MASKS_FILE).exists(), has_model=(p / MODEL_DIR).is_dir(),
                   has_checkpoint=(p / CHECKPOINT_FILE).exists(), modified=modified, damaged=damaged)


def list_runs(runs_dir: str | Path) -> list[RunInfo]:
    """Runs under runs_dir, newest first."""
    d = Path(runs_dir)
    try:
        children = [c for c in d.iterdir() if c.is_dir()] if d.is_dir() else []
    except OSError:  # (an unreadable runs folder: the pages say what is wrong with it)
        return []
    runs = [r for r in (read_run(c) for c in children) if r is not None]
    return sorted(runs, key=lambda r: r.modified, reverse=True)


def delete_run(run_dir: str | Path, jobs: JobManager | None = None) -> None:
    """Delete a run's files, its chained recovery's (RUN/recover: prune --recover, the app's Recover) and its folder,
    when nothing else is in it. Refused while a job runs in it: the check and the removal hold the job manager's
    lock, so no job can start in between."""
    from contextlib import nullcontext

    from ..storage.outdir import cleanup_out_dir, folder_lock, remove_owned
    from ..run.folder import is_run_dir, remove_run_files
    from ..run.files import RECOVER_DIR
    from ..tools.recover import RECOVER_OUTPUT

    p = Path(run_dir)
    with jobs.holding(p) if jobs is not None else nullcontext():
        if read_run(p) is None or not is_run_dir(p):
            raise UserError(f"{p} holds no run; not deleting it")
        with folder_lock(p, what="delete"):  # a run another process writes is refused, naming it
            remove_run_files(p)  # what the run wrote; a file the user put there stays
            recovered = p / RECOVER_DIR
            if RECOVER_OUTPUT.owns(recovered):  # (its own files and model/; anything else there stays)
                with folder_lock(recovered, what="delete"):
                    remove_owned(recovered, (*RECOVER_OUTPUT.files, RECOVER_OUTPUT.marker), RECOVER_OUTPUT.dirs)
                cleanup_out_dir([recovered])
        cleanup_out_dir([p])  # the folder too, when only the lock file is left


def export_run_model(run_dir: str | Path, dest: str | Path) -> Path:
    """Copy a finished run's sliced model folder to dest (which must not exist yet), atomically: the hf
    exporter's copy, the same as `python -m engine export RUN --format hf`. dest must lie in the runs folder or a
    folder of $PG_PRUNE_APP_FOLDERS (engine/ui/paths.py): it is typed in the page."""
    from ..export import export_run
    from ..run.folder import check_export_destination
    from ..run.files import MODEL_DIR
    from .paths import app_path

    dest = app_path(dest, "the export folder")
    check_export_destination(dest, "the export folder")  # (never a run's own name: its --overwrite would delete it)
    if not (Path(run_dir) / MODEL_DIR).is_dir():
        raise UserError(f"{Path(run_dir).name} has no exported model yet (finish the run first)")
    if dest.exists():
        raise UserError(f"{dest} already exists; choose a new folder")
    export_run(run_dir, "hf", dest)
    return dest
