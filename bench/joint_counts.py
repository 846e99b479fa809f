"""How well does the joint method's mix rule pick the number of removed layers? The joint one-shot mask (SLEB's
k least important layers out, FLAP's compensated widths cut to what the budget leaves) is chosen among every k
by its calibration loss on `--mix-batches` batches (8 by default). On the default model at 30 % the best counts
were within 0.002-0.006 nats on seeds 1 and 2, i.e. the choice is noise at that resolution. This re-runs a joint
one-shot cell's config and, for each candidate count k, measures:

- the calibration loss on the mix batches (as the run chose on; checked against the cell's `init_mix`),
- the calibration loss on the next init batches (the ones FLAP's metric read beyond the mix's, `--more`),
- the WikiText-2 perplexity of that count's mask (the table's protocol: the cell's windows).

so that a selection rule (more batches, a margin, ...) can be read off the figures before it goes into the
engine. It selects nothing on the test windows: the perplexities are the diagnostic, not the rule.

`--sequential` measures the widths after the layers: FLAP's statistics and the compensation's means are read
from the model with the count's k layers already removed (the layers after a removed one see other inputs than
in the dense model), not from the dense model as the engine does today. Results go to `<cell>-seq.json`.

    OMP_NUM_THREADS=1 python bench/joint_counts.py CELL_DIR [--counts 2,3,4,5,6,7] [--more 24] [--sequential]

CELL_DIR: a joint one-shot cell of bench/compare_table.py (its config.json). One JSON per cell in
`--out` (default bench/results/joint_counts/<cell>.json), rewritten after each count: a rerun skips the counts
done (it recomputes the metric statistics first: a few minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

from cli_common import ROOT, csv_list, positive, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cell", type=Path, help="a joint one-shot cell folder (with config.json)")
    p.add_argument("--counts", type=csv_list(int, lambda v: v >= 0, "layer counts (0 or more)"),
                   default=[2, 3, 4, 5, 6, 7], help="the numbers of removed layers to measure")
    p.add_argument("--more", type=positive(int), default=24,
                   help="init batches after the mix's to measure each count's calibration loss on")
    p.add_argument("--sequential", action="store_true",
                   help="width statistics and compensation means measured with the k layers removed")
    p.add_argument("--layer-compensation", action="store_true",
                   help="a removed layer adds its mean residual update on the init batches (measured dense)")
    p.add_argument("--skip-first", action="store_true", help="--layer-compensation's means without position 0")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "joint_counts")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PG_PRUNE_METRIC_CACHE", str(ROOT / "bench" / "results" / "compare_table" / "metric_cache"))

    import engine.run.initialise as initialise
    from engine.errors import UserError
    from engine.algo.context import KEEP
    from engine.algo.joint import candidate_scores, layer_counts
    from engine.run.mix import hard_mask_loss
    from engine.run.loop import PruneRun
    from engine.run.initialise import fresh_state
    from widths_after_layers import layer_compensation, layer_mean_deltas, widths_after_layers

    from compare_table import load_cell_config

    config = load_cell_config(args.cell)  # (a fresh clone's cell gets it back from compare_table/configs.json)
    if "layers" not in config.units or len(config.units) < 2:
        raise UserError(f"{args.cell} is not a joint cell (units {','.join(config.units)})")
    args.out.mkdir(parents=True, exist_ok=True)
    tags = ('-seq' if args.sequential else '') + ('-lc' if args.layer_compensation else '') + ('-sf' if args.skip_first else '')
    dest = args.out / f"{args.cell.name}{tags}.json"
    done = json.loads(dest.read_text()) if dest.exists() else {"cell": args.cell.name, "seed": config.seed,
                                                                  "prune_ratio": config.prune_ratio, "counts": {}}
    own = json.loads((args.cell / "results.json").read_text()) if (args.cell / "results.json").exists() else {}
    done["cell_ppl"] = own.get("ppl_pruned")
    done["cell_mix"] = own.get("init_mix")
    seen: dict = {}
    real_metric, real_mix = initialise.initial_metric, initialise.choose_mix

    def metric(run_, batches):  # (to keep the init batches)
        seen["batches"] = batches
        return real_metric(run_, batches)

    def mix(run_, z, mix_on, keep, comparable=frozenset(), **kw):
        if done.get("cell_mix"):  # (the cell's own lines: the mix is not run again)
            scores, lines = None, done["cell_mix"]
        else:
            scores, lines = real_mix(run_, z, mix_on, keep, comparable=comparable, **kw)
        deltas = layer_mean_deltas(run_, seen["batches"][:16], args.skip_first) if args.layer_compensation else None
        more = seen["batches"][len(mix_on):len(mix_on) + args.more]
        allowed = layer_counts(run_.budget.layer_params, run_.budget.decoder - run_.budget.kept_target(keep))
        for k in args.counts:
            if str(k) in done["counts"] or k not in allowed:
                continue
            t0, cpu0 = time.monotonic(), time.process_time()
            cand = candidate_scores(run_.budget, z, run_.layout, k, keep, run_.config, comparable)
            masks, fill = run_.masks.hard_masks(cand, keep), KEEP
            if args.sequential:
                z_k, fill = widths_after_layers(run_, masks[run_.budget.layer_type], seen["batches"], z)
                cand = candidate_scores(run_.budget, z_k, run_.layout, k, keep, run_.config, comparable)
                masks = run_.masks.hard_masks(cand, keep)
            with layer_compensation(deltas) if deltas else contextlib.nullcontext():
                losses = [hard_mask_loss(run_, masks, b, fill) for b in mix_on + more]
                removed = int((masks[run_.budget.layer_type] <= 0.5).sum())
                ppl = run_.masks.masked_perplexity(masks, f"{removed} layers out", fill)
            done["counts"][str(k)] = {
                "layers_removed": removed, "loss_mix": sum(losses[:len(mix_on)]) / len(mix_on),
                "loss_more": sum(losses[len(mix_on):]) / max(len(more), 1), "mix_batches": len(mix_on),
                "more_batches": len(more), "losses": losses, "ppl": ppl,
                "kept_params": float(run_.budget.kept_params(masks)),
                "wall_seconds": time.monotonic() - t0, "cpu_seconds": time.process_time() - cpu0}
            done["chosen_by_mix"] = min(lines, key=lambda line: line["loss"])["layers_removed"]
            dest.write_text(json.dumps(done, indent=1) + "\n")
            print(f"k={k}: {removed} layers out, loss mix {done['counts'][str(k)]['loss_mix']:.4f} "
                  f"more {done['counts'][str(k)]['loss_more']:.4f}, WikiText {ppl:.2f}", flush=True)
        raise SystemExit(0)  # (the rest of the run: not needed)

    initialise.initial_metric, initialise.choose_mix = metric, mix
    with tempfile.TemporaryDirectory() as tmp:
        r = PruneRun(config, tmp)
        fresh_state(r.res, r.call_hooks)


if __name__ == "__main__":
    run(main)
