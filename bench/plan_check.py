"""The app's time estimate against a finished run's real duration (issue 25): the plan panel's arithmetic
(engine/plan/forecast.py: tokens per phase x the seconds per token measured by a probe of this machine, plus loading) for
the run's own config, beside the wall time `bench/must_show.sh` recorded for it (`/usr/bin/time -v`).

    python bench/plan_check.py bench/results/must_show/default30 [--wall SECONDS]

Run it on the cores the run had (the probe measures them now; it is cached per model, dtype, batch shape and
thread count in $PG_PRUNE_CACHE). A run whose log says its dense perplexity was cached is planned without it,
as the app plans it when the cache holds it."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

from cli_common import run


def wall_seconds(run_dir: Path) -> float:
    """The wall time from `/usr/bin/time -v`'s report beside the run folder (RUN.time.txt)."""
    text = (run_dir.parent / f"{run_dir.name}.time.txt").read_text()
    clock = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): (\S+)", text).group(1)
    seconds = 0.0
    for part in clock.split(":"):
        seconds = 60 * seconds + float(part)
    return seconds


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", type=Path)
    p.add_argument("--wall", type=float, default=None, help="the run's wall seconds (default: RUN.time.txt)")
    args = p.parse_args(argv)

    from engine.settings.config import PruneConfig
    from engine.plan.forecast import model_skeleton, plan_time, probe_seconds_per_token
    from engine.storage.ppl_cache import cache_dir

    config = PruneConfig.from_dict(json.loads((args.run_dir / "config.json").read_text()))
    results = json.loads((args.run_dir / "results.json").read_text())
    log = args.run_dir.parent / f"{args.run_dir.name}.log"
    text = log.read_text() if log.exists() else ""
    dense_cached = "dense perplexity" in text and "(cached" in text
    if results.get("steps") is not None:  # a time budget or an early stop: the steps the run took
        config.steps = int(results["steps"])
    skeleton = model_skeleton(config.model)
    rate = probe_seconds_per_token(skeleton, config.dtype, config.batch_size, config.seqlen, cache=cache_dir())
    passes = results.get("pass_dtype")  # (the one-shot passes' dtype where the run says: their own rate)
    pass_rate = probe_seconds_per_token(skeleton, config.dtype, config.batch_size, config.seqlen, cache=cache_dir(),
                                        passes=passes) if passes and passes != config.dtype else None
    plan = plan_time(config, skeleton, rate, "a probe of this machine", dense_cached=dense_cached,
                     pass_seconds_per_token=pass_rate)
    wall = args.wall if args.wall is not None else wall_seconds(args.run_dir)
    print(f"run {args.run_dir}: {config.steps} steps x N_s {config.num_mask_samples}, {results['eval_windows']} "
          f"evaluation windows, dense perplexity {'cached' if dense_cached else 'evaluated'}")
    print(f"rate: {rate * 1e3:.4f} ms per token (probe)")
    if results.get("seconds_by_phase"):  # (the phases the run measured, beside the plan's: engine/run/plan.py)
        from engine.run.plan import plan_lines

        print("\n".join(plan_lines(plan.by_phase(), results["seconds_by_phase"])))
    else:
        for phase, seconds in plan.phases.items():
            print(f"  {phase:<18} {seconds:8.1f} s")
    print(f"estimate {plan.total:.0f} s, measured {wall:.0f} s wall: estimate / measured = {plan.total / wall:.2f}")


if __name__ == "__main__":
    run(main)
