"""How many calibration batches an init metric needs (issue 28): the masks from the first k batches against the
mask from all of them, side by side in one process, with each metric's CPU seconds.

    OMP_NUM_THREADS=1 python bench/init_batches.py [--metrics taylor,flap,wanda-sp] [--batches 1,2,4,8,16]
                                                   [--prune-ratio 0.3] [--seed 0] [--out bench/results/init_batches]

Each metric runs on the first k batches of a default run's calibration stream (the same PruneRun, so the same
held-out split, budget and init map as `python -m engine prune --init METRIC`), and its one-shot init mask is
cut as the run cuts it. "differs" is the share of the removed parameters that one mask removes and the other
keeps: the parameters in units whose decision changed, over the parameters the most batches' mask removes.
The smallest k whose mask differs by at most 1 % is the one a run could take instead. Results: OUT/<metric>-
s<seed>.json (kept: a rerun skips the metrics it has) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from cli_common import ROOT, csv_list, positive, run


def removed_difference(weights: dict, a: dict, b: dict) -> float:
    """Parameters of the units removed in exactly one of the masks a and b, over the parameters b removes."""
    differ = sum(float((weights[u] * ((a[u] > 0.5) != (b[u] > 0.5)).double()).sum()) for u in b)
    removed = sum(float((weights[u] * (b[u] <= 0.5).double()).sum()) for u in b)
    return differ / removed if removed else 0.0


def masks_for(pr, metric: str, batches: list) -> tuple[dict, float]:
    """(the one-shot init masks of `metric` on these batches, CPU seconds of the metric), cut as a run cuts them."""
    from engine.algo.metrics import METRICS, MetricContext
    from engine.algo.metrics.probability import initial_scores, standardize

    c, keep = pr.config, pr.keep_ratio_at(0)
    units = list(pr.layout.unit_types)
    ctx = MetricContext(pr.adapter, pr.layout, batches, keep_ratio=c.keep_ratio, seed=c.seed + 2, progress=False,
                        log=lambda m: None)
    t = time.process_time()
    raw = METRICS[metric].fn(ctx, units)
    cpu = time.process_time() - t
    import torch

    comparable = METRICS[metric].comparable
    z = {u: torch.cat(raw[u]).float() if comparable else standardize(u, raw[u]) for u in units}
    keeps = pr.budget.type_keeps(keep, z if comparable and len(units) > 1 else None)
    scores = pr.budget.initial({u: initial_scores(z[u], pr.layout, u, c.scope, keeps.get(u, keep), *c.map_for(u))
                                for u in units}, keep)
    return pr.hard_masks(pr.budget.init_mask_scores(scores) or z), cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--metrics", default="taylor,flap,wanda-sp", type=csv_list(str, bool, "metric names"))
    p.add_argument("--batches", default="1,2,4,8,16", type=csv_list(int, lambda k: k > 0, "batch counts (> 0)"))
    p.add_argument("--prune-ratio", type=positive(float), default=0.3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "init_batches"))
    args = p.parse_args()

    import torch

    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [m for m in args.metrics if not (out / f"{m}-s{args.seed}.json").exists()]
    if todo:
        config = PruneConfig.of(model=args.model, prune_ratio=args.prune_ratio, seed=args.seed, init=todo[0], budget="params",
                                init_batches=max(args.batches))
        with tempfile.TemporaryDirectory() as tmp:
            pr = PruneRun(config, tmp, log=lambda m: None)
            batches = [pr.sampler.next_batch() for _ in range(max(args.batches))]
            for metric in todo:
                pr.config.init = metric
                rows, ref = [], None
                for k in sorted(args.batches, reverse=True):
                    masks, cpu = masks_for(pr, metric, batches[:k])
                    ref = ref or masks
                    rows.append({"batches": k, "cpu_seconds": cpu, "differs": removed_difference(pr.budget.weights, masks, ref),
                                 "kept_params": pr.budget.kept_params(masks)})
                    print(f"{metric}: {k} batches, {cpu:.0f} CPU s, differs {rows[-1]['differs']:.2%}", flush=True)
                (out / f"{metric}-s{args.seed}.json").write_text(json.dumps(
                    {"metric": metric, "model": args.model, "prune_ratio": args.prune_ratio, "seed": args.seed,
                     "torch_threads": torch.get_num_threads(), "rows": sorted(rows, key=lambda r: r["batches"])}, indent=1) + "\n")
    print(f"\n{args.model}, {args.prune_ratio:.0%} of the decoder's parameters, seed {args.seed}: the init mask from k "
          f"batches of 8 x 128 against the mask from the most; differs = removed parameters whose decision changed")
    print("| metric | " + " | ".join(f"{k} batches" for k in sorted(args.batches)) + " | fewest within 1 % |")
    print("|---" * (len(args.batches) + 2) + "|")
    for metric in args.metrics:
        f = out / f"{metric}-s{args.seed}.json"
        if not f.exists():
            continue
        rows = json.loads(f.read_text())["rows"]
        cells = [f"{r['differs']:.1%} ({r['cpu_seconds']:.0f} s)" for r in rows]
        fewest = min(r["batches"] for r in rows if r["differs"] <= 0.01)
        print(f"| {metric} | " + " | ".join(cells) + f" | {fewest} |")


if __name__ == "__main__":
    run(main)
