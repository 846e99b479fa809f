"""What one policy-gradient step costs next to plain inference, measured side by side in one run.

    python bench/step_cost.py [--model smollm2-135m-instruct] [--repeats 5] [--batch-size 8] [--seqlen 128]

Prints seconds per PG step / seconds per dense forward of the same batch (interleaved in one
process, so both see the same machine load), and peak resident memory during PG steps / peak
during plain forwards (each in a fresh subprocess with identical set-up; the peak counter is
reset after set-up through /proc/self/clear_refs, so model loading does not count).
The method needs N_s masked forwards per step; a ratio near N_s means the bookkeeping is free.
The same is measured for one Gumbel-softmax step (N_s relaxed masks, back-propagated through the
model): the time and memory side of the paper's PG vs Gumbel-softmax comparison (its Table 3).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from cli_common import ROOT, positive, run


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def setup(args):
    """Identical set-up for every worker: model copy, data, a PG run and a Gumbel-softmax run over
    the same model object, with the PG run's initial state."""
    from dataclasses import replace

    from engine.config import PruneConfig
    from engine.pruner import PruneRun

    config = PruneConfig(model=args.plain_copy, init="random", steps=1000, batch_size=args.batch_size, seqlen=args.seqlen,
                         num_mask_samples=args.num_mask_samples, max_windows=1, dtype=args.dtype)
    run = PruneRun(config, tempfile.mkdtemp(), log=lambda m: None)
    gumbel = PruneRun(replace(config, method="gumbel"), tempfile.mkdtemp(), model=run.model, tokenizer=run.tokenizer,
                      log=lambda m: None)
    run.progress = gumbel.progress = False
    state = run.fresh_state()
    return run, gumbel, state


def worker(args) -> dict:
    import torch

    from engine.evaluate import batch_loss

    torch.manual_seed(0)
    run, gumbel, state = setup(args)
    batch = run.sampler.next_batch()
    work = {"dense": lambda: batch_loss(run.model, batch), "pg": lambda: run.step(state),
            "gumbel": lambda: gumbel.step(state)}
    if args.worker == "time":  # all three interleaved, so they see the same machine load
        for f in work.values():
            f()  # warm-up
        seconds = {k: [] for k in work}
        for _ in range(args.repeats):
            for k, f in work.items():
                t = time.perf_counter()
                f()
                seconds[k].append(time.perf_counter() - t)
        return {f"sec_{k}": statistics.median(v) for k, v in seconds.items()}
    f = work[args.worker.removeprefix("mem-")]
    f()  # warm-up, before the peak counter is reset
    reset_peak()
    for _ in range(args.repeats):
        f()
    return {"peak_mb": vm_hwm_mb()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-size", type=positive(int), default=8)
    p.add_argument("--seqlen", type=positive(int), default=128)
    p.add_argument("--num-mask-samples", type=positive(int), default=2)
    p.add_argument("--repeats", type=positive(int), default=5)
    p.add_argument("--worker", choices=["time", "mem-dense", "mem-pg", "mem-gumbel"], help=argparse.SUPPRESS)
    p.add_argument("--plain-copy", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args)))
        return

    import torch

    from engine.export import build_pruned_model
    from engine.loading import load_model, resolve_model
    from engine.units import UnitLayout
    from engine.arch import ModelAdapter

    # A plain safetensors copy (a GGUF loads by de-quantizing, whose spike would blur the peaks).
    model, tok = load_model(resolve_model(args.model), args.dtype)
    a = ModelAdapter.for_model(model)
    layout = UnitLayout(a.unit_sizes())
    full = {u: torch.ones(layout.total(u)) for u in layout.unit_types}
    copy_dir = Path(tempfile.mkdtemp()) / "plain"
    build_pruned_model(model, layout, full).save_pretrained(copy_dir)
    tok.save_pretrained(copy_dir)
    del model

    out = {}
    for w in ("time", "mem-dense", "mem-pg", "mem-gumbel"):
        cmd = [sys.executable, __file__, "--worker", w, "--plain-copy", str(copy_dir)] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k not in ("worker", "plain_copy")
        ]
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if res.returncode != 0:
            sys.exit(f"worker {w} failed:\n{res.stderr[-2000:]}")
        out[w] = json.loads(res.stdout.strip().splitlines()[-1])
    t, md, mp, mg = out["time"], out["mem-dense"]["peak_mb"], out["mem-pg"]["peak_mb"], out["mem-gumbel"]["peak_mb"]
    print(f"model {args.model} ({args.dtype}), batch {args.batch_size}x{args.seqlen}, N_s={args.num_mask_samples}, "
          f"median of {args.repeats}; torch threads {torch.get_num_threads()}")
    print(f"dense forward (with loss): {t['sec_dense']:.3f} s")
    print(f"PG step:                   {t['sec_pg']:.3f} s")
    print(f"step / forward:            {t['sec_pg'] / t['sec_dense']:.2f}  (N_s = {args.num_mask_samples})")
    print(f"peak RSS plain inference:  {md:.0f} MB")
    print(f"peak RSS PG steps:         {mp:.0f} MB")
    print(f"peak ratio PG / inference: {mp / md:.3f}")
    print(f"Gumbel-softmax step:       {t['sec_gumbel']:.3f} s  ({t['sec_gumbel'] / t['sec_pg']:.2f} x a PG step)")
    print(f"peak RSS Gumbel steps:     {mg:.0f} MB  ({mg / mp:.3f} x PG's; {mg / md:.3f} x inference)")


if __name__ == "__main__":
    run(main)
