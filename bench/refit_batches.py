"""How many calibration batches the least-squares refit needs (`--reconstruct-batches`): a finished run's final
mask refit on N batches' statistics and evaluated on the run's own protocol, for each N, in one process per cell.

    OMP_NUM_THREADS=1 python bench/refit_batches.py CELL [CELL ...] [--batches 16,64] [--out bench/results/refit_batches]
    OMP_NUM_THREADS=1 python bench/refit_batches.py CELL --batches 64,128 --ridges 0.03,0.1,0.3,1   # and the ridge

CELL is a run folder with masks.safetensors (a compare_table cell run in this checkout: the repository keeps
only masks.json). The refit is the engine's own (RunMasks.weights around the run's masked perplexity), with the
cell's config and --reconstruct-batches N, so N equal to the cell's reproduces its perplexity. A run made with N
would also score its joint mix on that refit: these are the same masks, not the same runs. --ridges refits each N
at each ridge (`--reconstruct-ridge`; default the cell's own), an N's statistics taken once for all its ridges.
One JSON line per (cell, N, ridge) is appended to OUT/results.jsonl (a rerun skips what it has).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from cli_common import ROOT, csv_list


def refit_perplexities(cell: Path, batches: int, ridges: list[float]) -> list[dict]:
    """The cell's mask refit on `batches` batches' statistics (taken once) at each ridge."""
    import torch

    from engine.settings.config import PruneConfig
    from engine.export.artifacts import load_mask_artifact
    from engine.run.loop import PruneRun

    torch.set_num_threads(1)
    saved = json.loads((cell / "config.json").read_text())
    values = {**saved, "reconstruct_batches": batches}
    values["reconstruct"] = True
    out, cell_ppl = [], json.loads((cell / "results.json").read_text())["ppl_pruned"]
    with tempfile.TemporaryDirectory() as tmp:
        run = PruneRun(PruneConfig.from_dict(values), tmp, log=lambda _: None)
        run.res.loop.progress = False
        _, masks, _ = load_mask_artifact(cell)
        t0 = time.process_time()
        for ridge in ridges:  # (the hook reads the ridge at each refit; its statistics are taken at the first)
            run.res.config.reconstruct_ridge = ridge
            with run.res.masks.weights(masks) as fill:
                ppl = run.res.masks.masked_perplexity(masks, "refit", fill)
            out.append({"cell": cell.name, "batches": batches, "ridge": ridge, "ppl": ppl,
                        "cpu_seconds": time.process_time() - t0, "cell_ppl": cell_ppl,
                        "cell_batches": saved.get("reconstruct_batches")})
            t0 = time.process_time()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cells", nargs="+", type=Path)
    p.add_argument("--batches", type=csv_list(int, lambda n: n >= 1, "batch counts (integers >= 1)"), default=[16, 64])
    p.add_argument("--ridges", type=csv_list(float, lambda r: r >= 0, "ridges (numbers >= 0)"), default=None)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "refit_batches")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / "results.jsonl"
    rows = list(map(json.loads, log.read_text().splitlines())) if log.exists() else []
    done = {(r["cell"], r["batches"], r.get("ridge")) for r in rows}  # (None: a row from before --ridges)
    for cell in args.cells:
        if not (cell / "masks.safetensors").exists():
            raise SystemExit(f"refit_batches.py: error: {cell} has no masks.safetensors (run the cell in this checkout)")
        own = json.loads((cell / "config.json").read_text()).get("reconstruct_ridge")
        for n in args.batches:  # (a row from before --ridges was refit at the cell's own ridge)
            ridges = [r for r in (args.ridges or [own]) if (cell.name, n, r) not in done
                      and not (r == own and (cell.name, n, None) in done)]
            if not ridges:
                continue
            for r in refit_perplexities(cell, n, ridges):
                with open(log, "a") as f:
                    f.write(json.dumps(r) + "\n")
                print(f"{cell.name}: {n} batches, ridge {r['ridge']} -> {r['ppl']:.2f} (the cell, {r['cell_batches']}: "
                      f"{r['cell_ppl']:.2f}); {r['cpu_seconds']:.0f} CPU s", flush=True)


if __name__ == "__main__":
    main()
