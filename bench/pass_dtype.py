"""The one-shot passes in bfloat16 against float32, run for run (issue 51, item 5): for each seed, the default run
made twice with `--pass-dtype float32` and `--pass-dtype bfloat16` (`bash bench/must_show.sh oneshot 0 1 2`: folders
oneshot-DTYPE-sSEED-COMMIT), the units where their final masks differ, both perplexities, and the seconds of the
one-shot part (load to the final mask: load, statistics, init metric, joint mix, refit) from results.json's
seconds_by_phase. Keep bfloat16 only where the masks and the perplexities agree within 1 %.

    python bench/pass_dtype.py [--runs bench/results/must_show] [--commit 1647886] [--seeds 0,1,2]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cli_common import ROOT, run

ONE_SHOT = ("load", "statistics", "init metric", "joint mix", "refit")  # the phases to the final mask
DTYPES = ("float32", "bfloat16")


def effective(masks: dict) -> dict:
    """The masks as the model runs them: a unit inside a removed layer is removed (a width mask holds the same
    number of units in every layer; `layers`, when there, one per layer)."""
    out = {k: m > 0.5 for k, m in masks.items()}
    layers = out.get("layers")
    if layers is not None:
        for k, m in out.items():
            if k != "layers":
                out[k] = m & layers.repeat_interleave(len(m) // len(layers))
    return out


def mask_differences(a: dict, b: dict) -> dict[str, int]:
    """Unit type -> how many units one mask keeps and the other removes, as the model runs them (the masks: name ->
    0/1 tensor)."""
    a, b = effective(a), effective(b)
    return {k: int((a[k] != b[k]).sum()) for k in sorted(a) if k in b}


def one_shot_seconds(results: dict) -> float:
    phases = results.get("seconds_by_phase") or {}
    return sum(phases.get(p, 0.0) for p in ONE_SHOT)


def final_masks(folder: Path) -> dict:
    from engine.export.artifacts import saved_masks

    return saved_masks(folder / "masks.safetensors")


def row(runs: Path, seed: int, commit: str) -> str:
    folders = {d: runs / f"oneshot-{d}-s{seed}-{commit}" for d in DTYPES}
    if not all((f / "results.json").is_file() for f in folders.values()):
        return f"| {seed} | n/a (not run: {', '.join(str(f) for f in folders.values())}) | | | | |"
    res = {d: json.loads((f / "results.json").read_text()) for d, f in folders.items()}
    diff = mask_differences(*(final_masks(folders[d]) for d in DTYPES))
    p32, p16 = (res[d]["ppl_pruned"] for d in DTYPES)
    s32, s16 = (one_shot_seconds(res[d]) for d in DTYPES)
    changed = ", ".join(f"{k} {v}" for k, v in diff.items() if v) or "none"
    return (f"| {seed} | {changed} | {p32:.2f} / {p16:.2f} ({(p16 / p32 - 1) * 100:+.2f} %) | {s32:.0f} / {s16:.0f} s | "
            f"{res['float32']['seconds_by_phase'].get('total', 0):.0f} / {res['bfloat16']['seconds_by_phase'].get('total', 0):.0f} s |")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=Path, default=ROOT / "bench" / "results" / "must_show", help="the run folders' parent")
    p.add_argument("--commit", default="1647886", help="the commit in the folders' names")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    args = p.parse_args(argv)
    print("| seed | units the final masks differ in | perplexity float32 / bfloat16 | one-shot part float32 / bfloat16 "
          "| whole run |")
    print("|---|---|---|---|---|")
    for seed in (int(s) for s in args.seeds.split(",")):
        print(row(args.runs, seed, args.commit))


if __name__ == "__main__":
    run(main)
