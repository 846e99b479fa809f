"""Is a PG run's init mask the one-shot method's mask? A PG run holds every 10th calibration document out (for
best-val), so at the same seed it draws other init batches than the one-shot run, and its init perplexity
differs: PG from FLAP (compensated) started at 258.3 on seed 0 where FLAP one-shot gave 221.2. This runs a
one-shot cell's config once more with the PG run's calibration stream (the same held-out split and seed) and
prints its init perplexity, to put beside the PG cell's `ppl_init`: equal means the two differ by their data
alone, so PG's gain over its own init is its gain over the one-shot method on the same data (a paired figure).
(PG runs with --init-data all, the default since 2026-11-26, start from the one-shot mask itself: this is for the
cells that ran before, with --init-data training.)

    OMP_NUM_THREADS=1 python bench/oneshot_on_pg_data.py CELL_DIR [--out bench/results/oneshot_on_pg_data]

CELL_DIR: a one-shot cell of bench/compare_table.py (its config.json). The result goes to OUT/<cell>.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from cli_common import ROOT, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cell", type=Path, help="a one-shot cell folder (with config.json)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "oneshot_on_pg_data")
    args = p.parse_args()

    from engine.data.text import CalibrationSampler, load_calibration_texts, split_holdout
    from engine.run.loop import PruneRun
    from engine.run.initialise import fresh_state

    from compare_table import load_cell_config

    config = load_cell_config(args.cell)  # (a fresh clone's cell gets it back from compare_table/configs.json)
    t0, cpu0 = time.monotonic(), time.process_time()
    with tempfile.TemporaryDirectory() as tmp:
        r = PruneRun(config, tmp)
        texts, _ = load_calibration_texts(config.calib)
        kept, _ = split_holdout(texts)  # what a PG run (validation on) draws its calibration batches from
        sampler = CalibrationSampler(r.res.tokenizer, kept, config.seqlen, config.batch_size, config.seed)
        r.replace_resources(sampler=sampler, init_sampler=sampler)
        state = fresh_state(r.res, r.call_hooks)
    own = json.loads((args.cell / "results.json").read_text()) if (args.cell / "results.json").exists() else {}
    out = {"cell": args.cell.name, "method": config.method, "init": config.init, "seed": config.seed,
           "prune_ratio": config.prune_ratio, "ppl_init_on_pg_data": state.ppl_init,
           "ppl_init_on_own_data": own.get("ppl_init"), "ppl_dense": state.ppl_dense,
           "wall_seconds": time.monotonic() - t0, "cpu_seconds": time.process_time() - cpu0}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.cell.name}.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    run(main)
