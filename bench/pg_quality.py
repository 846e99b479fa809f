"""PG optimizer quality: variance-reduction and final-mask variants, several seeds, side by side.

    python bench/pg_quality.py --model PLAIN_COPY [--device cuda] [--variants plain,antithetic,...]
                               [--seeds 0,1,2] [--steps 300,50] [--workers 4] [--out bench/results/pg_quality]
    python bench/pg_quality.py --report-only [--out ...]

Protocol (issue 12): 30 % of KV groups and MLP channels, global, Wanda-sp init (sigmoid-norm), lr 0.02
cosine, N_s 2, T 5 unless the variant says otherwise, 8 x 128 C4 tokens per step; perplexity on the first
--max-windows (256) windows of 128 tokens of WikiText-2 raw test. Each (variant, seed, steps) job is one
process (jobs run --workers at a time: a small model leaves a GPU launch-bound, so processes side by side
use it far better than one). From one optimisation every job reports the perplexity of:
  last        the final mask: top 70 % of the scores (the paper's)
  hybrid      PG's per-layer counts, the Wanda-sp ranking inside each layer
  comp        the final mask with FLAP's bias compensation (dense mean inputs of removed units)
  hybrid+comp both
  step50      the hard mask at step 50 of the same run (runs of 300 steps)
  best-val    the mask of the step whose held-out calibration perplexity was best (checked every 25 steps)
Results: OUT/jobs/*.json (one per job, kept, never rerun) and OUT/report.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from cli_common import ROOT, csv_list, positive, run

PROTOCOL = dict(units=["heads", "channels"], prune_ratio=0.3, scope="global", init="wanda-sp", lr=0.02,
                lr_schedule="cosine", num_mask_samples=2, baseline_window=5, batch_size=8, seqlen=128,
                val_every=25, val_batches=4)
# variant -> PruneConfig overrides of the protocol
VARIANTS = {
    "plain": {},
    "antithetic": {"mask_sampling": "antithetic"},
    "ns4": {"num_mask_samples": 4, "sample_forward": "batched"},
    "ns8": {"num_mask_samples": 8, "sample_forward": "batched"},
    "loo4": {"num_mask_samples": 4, "baseline": "leave-one-out", "sample_forward": "batched"},
    "loo8": {"num_mask_samples": 8, "baseline": "leave-one-out", "sample_forward": "batched"},
    "anti-loo4": {"num_mask_samples": 4, "baseline": "leave-one-out", "mask_sampling": "antithetic",
                  "sample_forward": "batched"},
    "anti-ns4": {"num_mask_samples": 4, "mask_sampling": "antithetic", "sample_forward": "batched"},
    "cv": {"control_variate": "init-metric"},
    "cv-loo4": {"num_mask_samples": 4, "baseline": "leave-one-out", "control_variate": "init-metric",
                "sample_forward": "batched"},
    "comp": {"bias_compensation": True},
    "clamp1e-4": {"estimator_clamp": 1e-4},
    "lr0.01": {"lr": 0.01},
    "lr0.05": {"lr": 0.05},
}
FIGURES = ("last", "hybrid", "comp", "hybrid+comp", "step50", "best-val")


def job_name(variant: str, seed: int, steps: int) -> str:
    return f"{variant}-s{seed}-{steps}steps"


def worker(args) -> dict:
    import torch

    from engine.settings.config import PruneConfig
    from engine.hooks.compensation import compensation_fill
    from engine.hooks.ranking import rank_within_layers
    from engine.hooks.validation import Validation
    from engine.algo.metrics.activations import input_means
    from engine.run.loop import PruneRun
    from engine.run.initialise import fresh_state

    config = PruneConfig.of(model=args.model, seed=args.seed, steps=args.steps, max_windows=args.max_windows,
                         device=args.device, dtype=args.dtype, **{**PROTOCOL, **VARIANTS[args.variant]})
    logs: list[str] = []
    run_ = PruneRun(config, tempfile.mkdtemp(), log=logs.append)
    run_.res.loop.progress = False
    state = fresh_state(run_.res, run_.call_hooks)
    out = {"variant": args.variant, "seed": args.seed, "steps": args.steps, "config": config.to_dict(),
           "ppl_dense": state.ppl_dense, "ppl_init": state.ppl_init, "device": args.device}
    if args.device.startswith("cuda"):
        out["gpu"] = torch.cuda.get_device_name()
    step_seconds = []
    validation = Validation(run_)
    while state.step < config.steps:
        t = time.perf_counter()
        run_.step(state)
        step_seconds.append(time.perf_counter() - t)
        if config.val_every and state.step % config.val_every == 0:
            validation.validate(state)
        if state.step == 50 and config.steps > 50:
            out["step50"] = run_.res.masks.masked_perplexity(run_.res.masks.hard_masks(state.scores), "step 50", run_.res.ctx.comp_means)
    out["seconds_per_step"] = statistics.median(step_seconds[5:] or step_seconds)
    last = run_.res.masks.hard_masks(state.scores)
    hybrid = rank_within_layers(run_.res.layout, last, state.init_metric)
    fill = run_.res.ctx.comp_means or compensation_fill(input_means(run_.res.adapter, [run_.res.sampler.next_batch() for _ in range(16)]),
                                          run_.res.layout.unit_types)
    out["last"] = run_.res.masks.masked_perplexity(last, "last", run_.res.ctx.comp_means)
    out["hybrid"] = run_.res.masks.masked_perplexity(hybrid, "hybrid", run_.res.ctx.comp_means)
    out["comp"] = run_.res.masks.masked_perplexity(last, "comp", fill)
    out["hybrid+comp"] = run_.res.masks.masked_perplexity(hybrid, "hybrid+comp", fill)
    if state.best_scores is not None:
        best = run_.res.masks.hard_masks(state.best_scores)
        out["best-val"] = run_.res.masks.masked_perplexity(best, "best-val", run_.res.ctx.comp_means)
        out["best_val_step"] = state.best_step
    out["kept_heads_per_layer"] = [int(x.sum()) for x in run_.res.layout.split("kv_groups", last["kv_groups"])]
    return out


def run_jobs(args) -> None:
    jobs_dir = Path(args.out) / "jobs"
    jobs_dir.mkdir(parents=True, exist_ok=True)
    todo = [(v, s, n) for n in args.steps for v in args.variants for s in args.seeds
            if not (jobs_dir / f"{job_name(v, s, n)}.json").exists()]
    print(f"{len(todo)} jobs, {args.workers} at a time", flush=True)

    def one(job):
        v, s, n = job
        name = job_name(v, s, n)
        cmd = [sys.executable, __file__, "--worker", "--model", args.model, "--device", args.device, "--dtype", args.dtype,
               "--max-windows", str(args.max_windows), "--variant", v, "--seed", str(s), "--steps", str(n)]
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads_per_worker), "TOKENIZERS_PARALLELISM": "false"}
        t = time.time()
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if proc.returncode != 0:
            print(f"FAILED {name}:\n{proc.stderr[-3000:]}", flush=True)
            return
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["wall_seconds"] = time.time() - t
        (jobs_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
        print(f"[{time.strftime('%H:%M:%S')}] {name}: last {result['last']:.1f} hybrid {result['hybrid']:.1f} "
              f"comp {result['comp']:.1f} h+c {result['hybrid+comp']:.1f} ({result['seconds_per_step'] * 1000:.0f} ms/step, "
              f"{result['wall_seconds']:.0f} s)", flush=True)

    with ThreadPoolExecutor(args.workers) as pool:
        list(pool.map(one, todo))


def report(out: Path) -> str:
    results = [json.loads(p.read_text()) for p in sorted((out / "jobs").glob("*.json"))]
    if not results:
        return "no results yet\n"
    groups: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        groups.setdefault((r["variant"], r["steps"]), []).append(r)
    r0 = results[0]
    lines = [f"Model {Path(r0['config']['model']).name}, {r0['device']} ({r0.get('gpu', 'cpu')}), {r0['config']['dtype']}; "
             f"30 % of KV groups + MLP channels, global, Wanda-sp init (sigmoid-norm), cosine lr, T 5, "
             f"8 x 128 C4 tokens per step; WikiText-2 raw test, first {r0['config']['max_windows']} windows x 128 "
             f"(dense {r0['ppl_dense']:.2f}, Wanda-sp init mask {r0['ppl_init']:.1f}). Perplexity: mean ± std [seed 0 / 1 / 2].", ""]
    lines += ["| variant | steps | lr | N_s | " + " | ".join(FIGURES) + " | ms/step |",
              "|---|---|---|---|" + "---|" * len(FIGURES) + "---|"]
    for (v, n), rs in sorted(groups.items(), key=lambda kv: (kv[0][1], list(VARIANTS).index(kv[0][0]) if kv[0][0] in VARIANTS else 99)):
        rs = sorted(rs, key=lambda r: r["seed"])
        cells = []
        for f in FIGURES:
            xs = [r[f] for r in rs if f in r]
            if not xs:
                cells.append("–")
                continue
            spread = f" ± {statistics.stdev(xs):.0f}" if len(xs) > 1 else ""
            cells.append(f"{statistics.mean(xs):.0f}{spread} [{' / '.join(f'{x:.0f}' for x in xs)}]")
        ms = statistics.median(r["seconds_per_step"] for r in rs) * 1000
        c = rs[0]["config"]
        lines.append(f"| {v} | {n} | {c['lr']} | {c['num_mask_samples']} | " + " | ".join(cells) + f" | {ms:.0f} |")
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="best a plain safetensors copy (bench/plain_copy.py)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--variants", type=csv_list(str, lambda v: v in VARIANTS, f"variants of {', '.join(VARIANTS)}"),
                   default=["plain"])
    p.add_argument("--seeds", type=csv_list(int, lambda s: s >= 0, "seeds"), default=[0, 1, 2])
    p.add_argument("--steps", type=csv_list(int, lambda s: s > 0, "step counts"), default=[300])
    p.add_argument("--max-windows", type=positive(int), default=256)
    p.add_argument("--workers", type=positive(int), default=1)
    p.add_argument("--threads-per-worker", type=positive(int), default=2)
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "pg_quality"))
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        args.steps = args.steps[0]
        print(json.dumps(worker(args)))
        return
    if not args.report_only:
        run_jobs(args)
    print(report(Path(args.out)), end="")


if __name__ == "__main__":
    run(main)
