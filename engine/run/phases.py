"""Where a run's wall time goes: seconds per phase (loading, the init metric, the refit's statistics, the joint
mix, evaluations, steps, the export), this session's, for results.json and the log. A phase inside another is
counted once, in the inner one (an evaluation during the steps is an evaluation); what no phase claims is
"other" (checkpoints, the hooks' small work)."""

from __future__ import annotations

import os
import re
import time
from contextlib import contextmanager
from typing import Callable


SLOW_ENV = "PG_PRUNE_SLOW_PHASE"  # "NAME:SECONDS": that phase sleeps so long each time it starts (the progress
# line's tests slow a run on purpose; unset, nothing sleeps)


def slow_phase(name: str, env=os.environ) -> float:
    """The seconds $PG_PRUNE_SLOW_PHASE asks phase `name` to sleep on entry (0 unless it names it)."""
    want, _, seconds = env.get(SLOW_ENV, "").partition(":")
    try:
        return max(float(seconds), 0.0) if want == name else 0.0
    except ValueError:
        return 0.0


def resident_peak_mb(status: str | None = None) -> float | None:
    """The process's peak resident set so far (VmHWM of /proc/self/status) in MiB; None where there is no /proc."""
    if status is None:
        try:
            with open("/proc/self/status") as f:
                status = f.read()
        except OSError:
            return None
    m = re.search(r"^VmHWM:\s+(\d+) kB", status, re.MULTILINE)
    return int(m.group(1)) / 1024.0 if m else None


class PhaseClock:
    def __init__(self, started: float, clock: Callable[[], float] = time.monotonic,
                 peak: Callable[[], float | None] = resident_peak_mb):
        """started: the clock's reading when the session began; everything until now is "load". peak: the
        process's resident peak so far (MiB): each phase during which it rose is kept with the peak it reached
        (`raised_peak`: which phase set the run's peak, and what each one before it had reached)."""
        self.clock, self.started, self.peak = clock, started, peak
        self.seconds: dict[str, float] = {"load": clock() - started}
        self.raised_peak: dict[str, float] = {}  # phase -> the resident peak (MiB) it reached, where it raised it
        self._peak_seen = self._note_peak("load", None)
        self.stack: list[list] = []  # [name, since] of the open phases, innermost last
        self.last: str | None = None  # the phase entered last (an interrupt's message names it)

    def carve(self, name: str, seconds: float) -> None:
        """Count `seconds` of what has been "load" so far under `name` instead (work done before the clock was
        made, timed apart: the calibration text's generation, read with the data). Nothing under 0.05 s."""
        seconds = min(max(seconds, 0.0), self.seconds["load"])
        if seconds >= 0.05:
            self.seconds["load"] -= seconds
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextmanager
    def __call__(self, name: str):
        now = self.clock()
        if self.stack:  # the outer phase pauses
            self._credit(self.stack[-1], now)
        else:  # (a rise between phases is "other"'s)
            self._peak_seen = self._note_peak("other", self._peak_seen)
        self.stack.append([name, now])
        self.last = name
        try:
            if pause := slow_phase(name):
                time.sleep(pause)
            yield
        finally:
            now = self.clock()
            self._credit(self.stack.pop(), now)
            if self.stack:
                self.stack[-1][1] = now  # the outer phase resumes

    def _credit(self, entry: list, now: float) -> None:
        self.seconds[entry[0]] = self.seconds.get(entry[0], 0.0) + now - entry[1]
        self._peak_seen = self._note_peak(entry[0], self._peak_seen)

    def _note_peak(self, name: str, before: float | None) -> float | None:
        """The peak now; credited to `name` (the phase that ran since the last reading) where it rose."""
        now = self.peak()
        if now is not None and (before is None or now > before):
            self.raised_peak[name] = round(max(now, self.raised_peak.get(name, 0.0)), 1)
        return now if now is not None else before

    def so_far(self) -> tuple[str | None, dict[str, float]]:
        """(the phase open now, innermost, None between phases; seconds per phase until now, the open one's
        running time included): what a UI shows of a run in progress (read from another thread: a copy)."""
        now, seconds, stack = self.clock(), dict(self.seconds), list(self.stack)
        if not stack:
            return None, seconds
        name, since = stack[-1]
        seconds[name] = seconds.get(name, 0.0) + now - since
        return name, seconds

    def peak_report(self) -> dict[str, float]:
        """Each phase that raised the resident peak, with the peak (MiB) it reached, in the order the peaks were
        reached (the last one set the run's peak so far); the rise after the last phase is "other"."""
        self._peak_seen = self._note_peak(self.stack[-1][0] if self.stack else "other", self._peak_seen)
        return dict(sorted(self.raised_peak.items(), key=lambda kv: kv[1]))

    def report(self) -> dict[str, float]:
        """Seconds per phase in the order first entered, "other" for the rest, and "total" since `started`."""
        total = self.clock() - self.started
        out = {k: round(v, 1) for k, v in self.seconds.items()}
        out["other"] = round(max(total - sum(self.seconds.values()), 0.0), 1)
        out["total"] = round(total, 1)
        return out


def phase_line(report: dict[str, float]) -> str:
    """The log's one-line summary: "wall time 535 s: load 13, init metric 87, ..." (phases under a second left out)."""
    parts = [f"{k} {v:.0f}" for k, v in report.items() if k != "total" and v >= 1]
    return f"wall time {report['total']:.0f} s: " + ", ".join(parts)
