"""A model's first run against its own plan, phase by phase (issue 49): the CLI's default run (the joint preset)
with a fresh cache (so the plan's probe of this machine's forward speed is measured at the start, as on a new
machine), then results.json's plan beside its measured seconds, and the phases outside 0.7x-1.3x of the plan.

    python bench/plan_phases.py [--model PATH] [--out DIR]

The default model is the tiny one in ../shared/models (seconds); on the default model the run is the README's
without --time-budget (minutes). A speed figure: run it on idle cores, one run at a time, and say the machine."""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

from cli_common import run

TINY = Path(__file__).resolve().parent.parent.parent / "shared" / "models" / "tinystories-656k"
BAND = (0.7, 1.3)


def off_plan(plan: dict, actual: dict, band=BAND) -> dict[str, tuple[float, float]]:
    """The phases over a second and over 5 % of the run whose measured seconds are outside the band of the plan."""
    floor = max(1.0, 0.05 * actual["total"])
    return {k: (plan.get(k, 0.0), v) for k, v in actual.items()
            if k != "other" and v > floor and not (plan.get(k) and band[0] <= v / plan[k] <= band[1])}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(TINY), help="the model (default: the tiny model)")
    p.add_argument("--out", type=Path, default=None, help="the run folder (default: a temporary one)")
    args = p.parse_args(argv)

    from engine.cli import main as engine_main
    from engine.run.plan import PLAN_KEY

    with tempfile.TemporaryDirectory() as tmp:
        os.environ["PG_PRUNE_CACHE"] = str(Path(tmp) / "cache")  # (a first run: the probe measured now)
        out = args.out or Path(tmp) / "run"
        code = engine_main(["prune", "--model", args.model, "--out", str(out), "--overwrite"])
        if code != 0:
            raise SystemExit(code)
        results = json.loads((out / "results.json").read_text())
    plan, actual = results[PLAN_KEY], results["seconds_by_phase"]
    print("\n| phase | planned s | measured s | measured / planned |\n|---|---|---|---|")
    for k, v in actual.items():
        ratio = f"{v / plan[k]:.2f}" if plan.get(k) else "–"
        print(f"| {k} | {plan.get(k, 0.0):.1f} | {v:.1f} | {ratio} |")
    off = off_plan(plan, actual)
    print(f"\nphases over a second and 5 % of the run outside {BAND[0]}x-{BAND[1]}x of the plan: "
          + (", ".join(f"{k} (planned {a:.1f} s, measured {b:.1f} s)" for k, (a, b) in off.items()) or "none"))


if __name__ == "__main__":
    run(main)
