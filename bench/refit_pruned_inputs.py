"""The least-squares refit with its statistics taken on the *pruned* model (a prototype, not an engine option).

The engine's refit (`--reconstruct`, engine/algo/reconstruction.py) takes the input moments of every output projection
on the dense model. Here the moments are taken again with the mask applied and the dense-input refit in place (its
upstream layers refit), before the mask's own hooks (so the removed columns' values are the pruned model's), and
the same regression is solved on them: each layer reproduces its dense weights' output on the inputs it will see.
PASSES repeats that; MIX weights the pruned-model moments against the dense ones (1: pruned only).

    OMP_NUM_THREADS=1 python bench/refit_pruned_inputs.py CELL BATCHES PASSES [MIX]

CELL: a finished run folder with masks.safetensors (a compare_table cell run in this checkout). It prints the
perplexity of the dense-input refit and of each pass on the cell's own protocol. Measured 2026-11-27 (one thread
beside one other job) on FLAP's seed-0 mask at 30 % (`flap-heads+channels-flap-30-s0-07d5da`; log in
bench/results/refit_pruned_inputs/): on 16 batches 180.24 -> 173.27 (one pass, 136 CPU s) -> 172.43 (two);
on 64 batches 166.73 -> 164.14 (one pass, 319 CPU s). A first prototype (not kept; its log is beside the others) fit the dense
model's outputs from the pruned model's kept inputs instead (the targets W x of a dense pass, not W x~): it made the
mask worse, 180.24 -> 284.57 on 16 batches. One pass is worth 1.6 % at 64 batches for about 5 CPU minutes, less
than the 64 batches' own gain over 16 (7.5 % on this mask): not made an engine option.
"""
import json
import sys
import tempfile
import time
from pathlib import Path

if len(sys.argv) < 4 or sys.argv[1] in ("-h", "--help"):  # (a prototype: its arguments by position, no argparse)
    print(f"usage: {Path(__file__).name} CELL BATCHES PASSES [MIX]\n\n{__doc__.strip()}",
          file=sys.stdout if sys.argv[1:2] in (["-h"], ["--help"]) else sys.stderr)
    sys.exit(0 if sys.argv[1:2] in (["-h"], ["--help"]) else 2)

import torch
from engine.settings.config import PruneConfig
from engine.export.artifacts import load_mask_artifact, kept_indices
from engine.run.loop import PruneRun
from engine.model.masking import MaskHooks
from engine.algo.evaluate import decoder_forward
from engine.model.unit_types import layer_unit_types
from engine.algo.reconstruction import reconstructed
torch.set_num_threads(1)
cell, nb, passes = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
mix = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0  # weight of the pruned-model moments (1 - mix: dense)
saved = json.loads((cell / "config.json").read_text())
values = {**saved, "reconstruct_batches": nb, "reconstruct": True}
with tempfile.TemporaryDirectory() as tmp:
    run = PruneRun(PruneConfig.from_dict(values), tmp, log=lambda _: None)
    run.res.loop.progress = False
    _, masks, _ = load_mask_artifact(cell)
    ad, lay, c = run.res.adapter, run.res.layout, run.res.config
    rec = [h for h in run.res.hooks if type(h).__name__ == "Reconstruction"][0]
    dense = rec.statistics()
    sampler = run.res.sampler.reseeded(c.seed + 5)
    batches = [sampler.next_batch() for _ in range(nb)]
    kept = dict(kept_indices(lay, masks, ad))
    keys = [(t.name, i) for i in kept for t in layer_unit_types() if t.name in masks]
    moments = dense
    for it in range(passes):
        acc = {}
        def recx(key):
            def hook(mod, args):
                x = args[0].detach().float().reshape(-1, args[0].shape[-1])
                g, s = (x.T @ x).double(), x.sum(0).double()
                if key in acc:
                    acc[key][0].add_(g)
                    acc[key][1].add_(s)
                else:
                    acc[key] = [g, s]
            return hook
        t0 = time.process_time()
        with torch.no_grad(), reconstructed(ad, lay, masks, moments, c.reconstruct_ridge, c.bias_compensation) as fill:
            if it == 0:
                run.res.masks.measured.clear()
                print("dense-input refit", run.res.masks.masked_perplexity(masks, "r", fill), flush=True)
            types = {t.name: t for t in layer_unit_types()}
            hs = [types[u].output_proj(ad, i).register_forward_pre_hook(recx((u, i))) for u, i in keys]
            with MaskHooks(ad) as hooks:
                hooks.set({u: lay.split(u, m) for u, m in masks.items()}, fill)
                for batch in batches:
                    decoder_forward(ad.model, batch)
            for h in hs:
                h.remove()
        tok = sum(b.numel() for b in batches)
        pruned = {k: (v[0].float(), v[1].float(), tok) for k, v in acc.items()}
        moments = {k: ((mix * pruned[k][0] / tok + (1 - mix) * dense[k][0] / dense[k][2]),
                       (mix * pruned[k][1] / tok + (1 - mix) * dense[k][1] / dense[k][2]), 1) if k in pruned else dense[k]
                   for k in dense}
        print("pruned pass", time.process_time() - t0, flush=True)
        with torch.no_grad(), reconstructed(ad, lay, masks, moments, c.reconstruct_ridge, c.bias_compensation) as fill:
            run.res.masks.measured.clear()
            print(f"pass {it+1} mix {mix}: {run.res.masks.masked_perplexity(masks, 'b', fill):.2f}", flush=True)
