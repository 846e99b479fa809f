"""The app's Recover action: a finished run's export recovered (engine.tools.recover, its defaults) in a
thread of its own, into RUN/recover (what `prune --recover MINUTES` writes), with a snapshot the page reads.

    jobs = RecoverJobs()
    jobs.start(run_dir, minutes=5)          # UserError on bad input (checked here, fast); JobBusy while one runs
    snap = jobs.snapshot()                  # status, the loss of every step so far, the result or the error
    jobs.stop()                             # ends the training after the current step (saved: resumable)

Background work never calls Streamlit: the page draws the snapshot.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..run.files import RECOVER_DIR
from .jobs import DONE, IDLE, RUNNING, STOPPED, STOPPING, BackgroundJob, JobBusy

ACTIVE = (RUNNING, STOPPING)


@dataclass
class RecoverSnapshot:
    status: str = IDLE
    phase: str = ""  # the recovery's last log line
    run_dir: str | None = None
    out_dir: str | None = None
    minutes: float | None = None
    records: list[dict] = field(default_factory=list)  # recover_log.jsonl's lines so far: step, loss, kl, ce, lr
    result: dict | None = None  # recover_results.json's content
    error: str | None = None
    error_detail: str | None = None
    started_at: float | None = None
    finished_at: float | None = None

    @property
    def active(self) -> bool:
        return self.status in ACTIVE


class RecoverJobs(BackgroundJob):
    """Owns at most one recovery thread; every public method is thread-safe."""

    def __init__(self):
        super().__init__(RecoverSnapshot())

    def start(self, run_dir: str | Path, minutes: float, **options) -> None:
        """Distil RUN/model for `minutes` into RUN/recover (an earlier recovery there is replaced; one with its
        checkpoint is continued when resume=True is given in options)."""
        from ..tools.recover import RecoverConfig, run_settings

        run_dir = Path(run_dir)
        with self._lock:
            if self._snap.active:
                raise JobBusy(f"a recovery is already running ({self._snap.run_dir}); stop it or wait for it")
            RecoverConfig(run=str(run_dir), time_budget=minutes,
                          **{k: v for k, v in options.items() if k != "resume"}).validate()
            run_settings(run_dir)  # (a folder with no finished run: one line, before the thread)
            self._stop = threading.Event()
            out = run_dir / RECOVER_DIR
            self._snap = RecoverSnapshot(status=RUNNING, phase="loading the student and the teacher",
                                         run_dir=str(run_dir), out_dir=str(out), minutes=minutes,
                                         started_at=time.time())
            self._thread = threading.Thread(target=self._work, args=(run_dir, out, minutes, options, self._stop),
                                            name="recover-job", daemon=True)
            self._thread.start()

    def stop(self) -> bool:
        with self._lock:
            if not self._snap.active:
                return False
            self._stop.set()
            self._snap.status, self._snap.phase = STOPPING, "stopping after the current step (saved; resumable)"
            return True

    def snapshot(self) -> RecoverSnapshot:
        with self._lock:
            s = self._snap
            return dataclasses.replace(s, records=list(s.records), result=dict(s.result) if s.result else None)

    # --- the worker ------------------------------------------------------------------------
    def _on_step(self, record: dict) -> None:
        with self._lock:
            self._snap.records.append(dict(record))
            if self._snap.status == RUNNING:
                self._snap.phase = f"step {record.get('step')}: loss {record.get('loss', float('nan')):.4f}"

    def _work(self, run_dir: Path, out: Path, minutes: float, options: dict, stop: threading.Event) -> None:
        from ..tools.recover import CHECKPOINT_FILE, recover

        try:
            again = bool(options.pop("resume", False)) and (out / CHECKPOINT_FILE).is_file()
            r = recover(run_dir, out, resume=again, overwrite=not again, time_budget=minutes, log=self._log,
                        on_step=self._on_step, stop=stop, **options)
            ended = STOPPED if r.results.get("ended_by") == "stop" else DONE
            self._set(status=ended, result=r.results, phase=f"{ended}: {r.results.get('steps')} steps",
                      finished_at=time.time())
        except Exception as e:  # (said in the page, the UI stays alive)
            self._failed(e)
