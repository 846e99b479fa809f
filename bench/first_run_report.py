"""The first-run protocol's table (bench/first_run.sh): per folder of runs (commit, rate, cores) and seed, the first
and the second run's wall time, their fixed costs (every phase but the steps and their held-out checks), steps,
the batches the refit's statistics read (fewer where the time budget cut them), WikiText-2 perplexity and the
probe's ms per token, read from the runs on disk; nothing is run.

    python bench/first_run_report.py [FOLDER]      (default: bench/results/first_run)
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from cli_common import ROOT, run

STEP_PHASES = ("steps", "validation")  # (the steps and their held-out checks: what a budget buys, not a fixed cost)


def wall_seconds(time_txt: str) -> float | None:
    """`/usr/bin/time -v`'s elapsed wall clock (h:mm:ss or m:ss.cc) in seconds."""
    m = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", time_txt)
    if not m:
        return None
    seconds = 0.0
    for part in m.group(1).split(":"):
        seconds = 60 * seconds + float(part)
    return seconds


def probe_ms(log: str) -> float | None:
    """The plan line's ms per token of a dense forward (the probe's)."""
    m = re.search(r"([\d.]+) ms per token from", log)
    return float(m.group(1)) if m else None


def fixed_seconds(phases: dict) -> float:
    total = float(phases.get("total") or sum(v for k, v in phases.items() if k != "total"))
    return total - sum(float(phases.get(k, 0.0)) for k in STEP_PHASES)


def row(folder: Path) -> str | None:
    res_file = folder / "results.json"
    if not res_file.is_file():
        return f"| {folder.parent.name} | {folder.name} | not finished | | | | | | |"
    res = json.loads(res_file.read_text())
    time_txt = (folder / "time.txt").read_text() if (folder / "time.txt").is_file() else ""
    # (the plan's line with the probe's rate; plan.txt kept only the first plan line before 2026-12-02, which may
    # be the budget's warning)
    ms = next((probe_ms(f.read_text()) for f in (folder / "plan.txt", folder / "run.log")
               if f.is_file() and probe_ms(f.read_text()) is not None), None)
    wall = wall_seconds(time_txt)
    phases = res.get("seconds_by_phase", {})
    shown = ", ".join(f"{k} {v:.0f}" for k, v in phases.items() if k not in ("total", "other") and v >= 1)
    refit = (res.get("reconstruction") or {}).get("batches", "")
    return (f"| {folder.parent.name} | {folder.name} | {'' if wall is None else f'{wall / 60:.1f} min'} | "
            f"{fixed_seconds(phases) / 60:.2f} min | {res.get('steps')} | {refit} | {res.get('ppl_pruned', float('nan')):.2f} | "
            f"{'' if ms is None else f'{ms:.3f}'} | {shown} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", type=Path, default=ROOT / "bench" / "results" / "first_run")
    args = p.parse_args()
    lines = ["| runs | seed, run | wall | fixed costs | steps | refit batches | WikiText-2 | probe ms/token | "
             "seconds by phase |", "|---|---|---|---|---|---|---|---|---|"]
    for group in sorted(d for d in args.folder.glob("*") if d.is_dir()) if args.folder.is_dir() else []:
        for folder in sorted(d for d in group.glob("s*-*") if d.is_dir()):
            lines.append(row(folder))
    if len(lines) == 2:
        lines.append("| (no runs yet: bash bench/first_run.sh) | | | | | | | | |")
    print("\n".join(lines))


if __name__ == "__main__":
    run(main)
