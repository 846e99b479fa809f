"""What one policy-gradient step costs next to plain inference, measured side by side in one run.

    python bench/step_cost.py [--model smollm2-135m-instruct | --random-config 1b|7b] [--repeats 5]
                              [--batch-size 8] [--seqlen 128] [--executors sequential,batched,sliced]
                              [--reward ce|kl] [--step-dtypes float32,bfloat16]
                              [--device cpu|cuda|auto] [--dtype float32] [--no-gumbel] [--out DIR]

Prints seconds per PG step / seconds per dense forward of the same batch, for every executor of the
step's N_s masked forwards (engine/model/executors.py), all interleaved in one process so that they see the
same machine load; and peak memory during PG steps / peak during plain forwards (each in a fresh
subprocess with identical set-up; on the CPU the peak RSS counter is reset after set-up through
/proc/self/clear_refs, so model loading does not count; on CUDA torch's peak allocation counter).
The hook executors need N_s masked forwards per step (a ratio near N_s means the bookkeeping is free);
the sliced one computes only the kept units, about N_s x the kept fraction.
The same is measured for one Gumbel-softmax step (N_s relaxed masks, back-propagated through the
model): the time and memory side of the paper's PG vs Gumbel-softmax comparison (its Table 3).
--random-config builds a LLaMA of that size with random weights (the default model's tokenizer and
vocabulary) instead of loading one: time and memory do not depend on the weights' values.

--ranks 1,2 measures instead the data-parallel step (engine/model/distributed.py: torchrun, gloo on the CPU, NCCL with
--device cuda): one PG step with each number of ranks, side by side, each rank with --threads-per-rank threads (1),
the N_s masked forwards shared out over the ranks (docs/scale.md).
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
from pathlib import Path

from cli_common import ROOT, csv_list, positive, run
from engine.model.unit_types import unit_sizes

# Random LLaMA configs for the cost by model size (GQA like the default model; tied 49,152-token vocabulary).
RANDOM_CONFIGS = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
               num_key_value_heads=4),  # TinyLlama's shape: 1.07 B parameters with this vocabulary
    "7b": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),  # Llama-2-7B's shape with GQA: 6.5 B parameters
}


def vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")


def peak_mb(device: str) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**20 if on_cuda(device) else vm_hwm_mb()


def on_cuda(device: str) -> bool:
    """cuda[:N], or auto (accelerate's device_map) on a host with a GPU: then the GPU's peak is measured."""
    import torch

    return device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())


def reset_peak_of(device: str) -> None:
    import torch

    if on_cuda(device):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak()


def setup(args):
    """Identical set-up for every worker: model copy, data, a PG run and (unless --no-gumbel) a Gumbel-softmax run
    over the same model object, with the PG run's initial state."""
    from dataclasses import replace

    from engine.settings.config import PruneConfig
    from engine.run.loop import PruneRun
    from engine.run.initialise import fresh_state

    config = PruneConfig.of(model=args.plain_copy, init="random", steps=1000, batch_size=args.batch_size, seqlen=args.seqlen,
                         num_mask_samples=args.num_mask_samples, baseline="moving-average", max_windows=1,
                         prune_ratio=args.prune_ratio, dtype=args.dtype, device=args.device, reward=args.reward)
    run = PruneRun(config, tempfile.mkdtemp(), log=lambda m: None)
    gumbel = None  # (--no-gumbel: not made, nor its data read)
    if args.gumbel:
        gumbel = PruneRun(replace(config, method="gumbel", method_options={}), tempfile.mkdtemp(), model=run.res.model,
                          tokenizer=run.res.tokenizer, log=lambda m: None)
        gumbel.res.loop.progress = False
    run.res.loop.progress = False
    state = fresh_state(run.res, run.call_hooks)
    return run, gumbel, state


# the parent's own arguments, never passed on to a worker (a worker gets the plain copy, not the model)
PARENT_ONLY = ("worker", "plain_copy", "out", "random_config", "model", "ranks")


def worker_flags(args) -> list[str]:
    """The parent's settings as a worker's flags: --NAME=VALUE for each one set (a list comma-joined), the
    parent's own (PARENT_ONLY) and those left unset (None: the worker's default is the same) left out, so that a
    worker never parses "None" (--ranks=None killed every worker of a plain run)."""
    flags = [f"--{key.replace('_', '-')}={','.join(map(str, v)) if isinstance(v, list) else v}"
             for key, v in vars(args).items() if key not in (*PARENT_ONLY, "gumbel") and v is not None]
    return flags + ([] if args.gumbel else ["--no-gumbel"])  # (a worker told --no-gumbel makes no Gumbel run)


def rank_worker(args) -> dict | None:
    """One rank of a data-parallel step (started by torchrun): the median seconds of a PG step, on rank 0."""
    import torch

    from engine.settings.config import PruneConfig
    from engine.model.distributed import join_world
    from engine.run.loop import PruneRun
    from engine.run.initialise import fresh_state

    torch.set_num_threads(args.threads_per_rank)
    torch.manual_seed(0)
    world = join_world(args.device)
    config = PruneConfig.of(model=args.plain_copy, init="random", steps=1000, batch_size=args.batch_size, seqlen=args.seqlen,
                            num_mask_samples=args.num_mask_samples, baseline="moving-average", max_windows=1,
                            prune_ratio=args.prune_ratio, dtype=args.dtype, device=args.device, val_every=0,
                            final_mask="last", sample_forward=args.executors[0] if len(args.executors) == 1 else "auto")
    run = PruneRun(config, tempfile.mkdtemp(), log=lambda m: None, world=world)
    run.res.loop.progress = False
    state = fresh_state(run.res, run.call_hooks)
    run.step(state)  # warm-up
    seconds = []
    for _ in range(args.repeats):
        t = time.perf_counter()
        run.step(state)  # (the losses' all-gather ends every rank's step together)
        if on_cuda(args.device):
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - t)
    world.leave()
    return {"ranks": world.size, "sec_step": statistics.median(seconds), "threads": torch.get_num_threads()} if world.writes else None


def rank_table(args, copy_dir: Path) -> list[str]:
    """torchrun --nproc-per-node K for each K of --ranks; the step time of each side by side."""
    out = {}
    for k in args.ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={k}", __file__,
               "--worker", "ranks", "--plain-copy", str(copy_dir)] + worker_flags(args)
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads_per_rank))
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env)
        if res.returncode != 0:
            sys.exit(f"{k} ranks failed:\n{res.stderr[-2000:]}")
        out[k] = json.loads([ln for ln in res.stdout.strip().splitlines() if ln.startswith("{")][-1])
    one = out[min(out)]["sec_step"] * min(out)  # (a table without K = 1 compares against the smallest K's total)
    lines = ["| ranks | s / step | speed-up | efficiency | samples per rank |", "|---|---|---|---|---|"]
    for k, r in out.items():
        lines.append(f"| {k} | {r['sec_step']:.3f} | {one / r['sec_step']:.2f} | {one / r['sec_step'] / k:.0%} | "
                     f"{-(-args.num_mask_samples // k)} |")
    return lines


def worker(args) -> dict:
    import torch

    from engine.algo.evaluate import batch_loss
    from engine.model.executors import EXECUTORS

    torch.manual_seed(0)
    run, gumbel, state = setup(args)
    batch = run.res.sampler.next_batch()

    def pg_step(executor, dtype="float32"):
        def step():
            # (the executor the step's samples run on, and --step-dtypes' autocast: the step reads the executor from
            # its context and the dtype from the run's resources, bound once, so a replaced copy)
            run.res.ctx.executor = EXECUTORS[executor]
            run.replace_resources(step_dtype=dtype)
            run.step(state)
        return step

    def synced(f):
        def timed():
            f()
            if on_cuda(args.device):
                torch.cuda.synchronize()
        return timed

    work = {"dense": lambda: batch_loss(run.res.model, batch)}
    work |= {f"pg-{e}": pg_step(e) for e in args.executors}
    if args.worker == "time":  # (each further --step-dtypes entry: the same steps under its autocast, timed only)
        work |= {f"pg-{e}-{d}": pg_step(e, d) for e in args.executors for d in args.step_dtypes if d != "float32"}
    if args.worker == "time":
        # the floor of any executor: N_s forwards of a physically smaller model that keeps the same fraction
        # (the run's final mask at its initial probabilities), with no gathers and no hooks
        from engine.export.artifacts import build_pruned_model

        sub = build_pruned_model(run.res.model, run.res.layout, run.res.masks.hard_masks(state.scores))
        work["floor"] = lambda: [batch_loss(sub, batch) for _ in range(args.num_mask_samples)]
    if args.gumbel:
        work["gumbel"] = lambda: gumbel.step(state)
    work = {k: synced(f) for k, f in work.items()}
    if args.worker == "time":  # all interleaved, so they see the same machine load
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
    reset_peak_of(args.device)
    for _ in range(args.repeats):
        f()
    return {"peak_mb": peak_mb(args.device)}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch-size", type=positive(int), default=8)
    p.add_argument("--seqlen", type=positive(int), default=128)
    p.add_argument("--num-mask-samples", type=positive(int), default=2)
    p.add_argument("--repeats", type=positive(int), default=5)
    p.add_argument("--prune-ratio", type=float, default=0.3)
    p.add_argument("--device", default="cpu", help="cpu, cuda[:N] or auto (accelerate's device_map)")
    p.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default=None,
                   help="a LLaMA of this size with random weights instead of --model")
    p.add_argument("--no-gumbel", dest="gumbel", action="store_false", help="skip the Gumbel-softmax step")
    p.add_argument("--executors", default="sequential,batched,sliced",
                   type=lambda v: [e.strip() for e in v.split(",") if e.strip()])
    p.add_argument("--reward", default="ce", help="the step's reward (engine/algo/rewards.py: ce or kl)")
    p.add_argument("--step-dtypes", default=["float32"], type=csv_list(str, lambda d: d in ("float32", "bfloat16"), "dtypes"),
                   help="e.g. float32,bfloat16: each executor's step also under --step-dtype bfloat16 (the decoder's "
                        "products under autocast, the head in float32), timed beside the float32 one")
    p.add_argument("--out", default=None, help="folder for a JSON record of the figures (bench/results/step_cost)")
    p.add_argument("--ranks", type=csv_list(int, lambda k: k > 0, "rank counts"), default=None,
                   help="e.g. 1,2: the data-parallel step time with each number of ranks (torchrun) instead of the table")
    p.add_argument("--threads-per-rank", type=positive(int), default=1, help="torch threads of each rank (with --ranks)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--plain-copy", help=argparse.SUPPRESS)
    return p


def main() -> None:
    args = build_parser().parse_args()
    load_before = os.getloadavg()
    if args.worker == "ranks":
        result = rank_worker(args)
        if result is not None:
            print(json.dumps(result))
        return
    if args.worker:
        print(json.dumps(worker(args)))
        return

    import torch

    from engine.model.arch import ModelAdapter
    from engine.model.executors import EXECUTORS
    from engine.export.artifacts import build_pruned_model
    from engine.model.loading import load_model, resolve_model
    from engine.model.precision import native_bf16_cpu
    from engine.model.units import UnitLayout

    unknown = [e for e in args.executors if e not in EXECUTORS]
    if unknown:
        raise SystemExit(f"step_cost.py: error: unknown executors {unknown}; known: {', '.join(EXECUTORS)}")
    # A plain safetensors copy (a GGUF loads by de-quantizing, whose spike would blur the peaks).
    copy_dir = Path(tempfile.mkdtemp()) / "plain"
    if args.random_config:
        from transformers import AutoModelForCausalLM, LlamaConfig

        from engine.model.loading import DEFAULT_MODEL, DTYPES, load_tokenizer

        tok = load_tokenizer(resolve_model(DEFAULT_MODEL))
        config = LlamaConfig(**RANDOM_CONFIGS[args.random_config], vocab_size=len(tok), tie_word_embeddings=True,
                             max_position_embeddings=max(2048, args.seqlen))
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[args.dtype])
        model.save_pretrained(copy_dir)
        args.model = f"random LLaMA {args.random_config} ({sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters)"
    else:
        model, tok = load_model(resolve_model(args.model), args.dtype)
        a = ModelAdapter.for_model(model)
        layout = UnitLayout(unit_sizes(a))
        full = {u: torch.ones(layout.total(u)) for u in layout.unit_types}
        build_pruned_model(model, layout, full).save_pretrained(copy_dir)
    tok.save_pretrained(copy_dir)
    del model

    if args.ranks:
        lines = [f"model {args.model} ({args.dtype}, {args.device}), batch {args.batch_size}x{args.seqlen}, "
                 f"N_s={args.num_mask_samples}, {args.prune_ratio:.0%} pruned, median of {args.repeats} PG steps; "
                 f"{args.threads_per_rank} torch thread(s) per rank; load average (1/5/15 min) before: "
                 f"{'/'.join(f'{x:.2f}' for x in load_before)}", *rank_table(args, copy_dir),
                 f"load average after: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}"]
        print("\n".join(lines))
        return
    workers = ["time", "mem-dense", *(f"mem-pg-{e}" for e in args.executors), *(["mem-gumbel"] if args.gumbel else [])]
    out = {}
    for w in workers:
        cmd = [sys.executable, __file__, "--worker", w, "--plain-copy", str(copy_dir)] + worker_flags(args) + (
            [] if args.gumbel else ["--no-gumbel"])
        res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if res.returncode != 0:
            sys.exit(f"worker {w} failed:\n{res.stderr[-2000:]}")
        out[w] = json.loads(res.stdout.strip().splitlines()[-1])
    t, md = out["time"], out["mem-dense"]["peak_mb"]
    lines = [f"model {args.model} ({args.dtype}, {args.device}), batch {args.batch_size}x{args.seqlen}, "
             f"N_s={args.num_mask_samples}, {args.prune_ratio:.0%} pruned (masks sampled from keep probabilities "
             f"~{1 - args.prune_ratio:.0%}), reward {args.reward}, median of {args.repeats}; torch threads "
             f"{torch.get_num_threads()}; native bfloat16 CPU: {native_bf16_cpu()}; "
             f"load average (1/5/15 min) before: {'/'.join(f'{x:.2f}' for x in load_before)}, "
             f"after: {'/'.join(f'{x:.2f}' for x in os.getloadavg())}",
             f"dense forward (with loss): {t['sec_dense']:.3f} s;  peak memory of inference {md:.0f} MB",
             "| executor | s / step | step / dense forward | peak memory / inference | peak MB |", "|---|---|---|---|---|"]
    if "sec_floor" in t:
        lines.append(f"| (floor: N_s forwards of the physically pruned model, no gathers) | {t['sec_floor']:.3f} | "
                     f"{t['sec_floor'] / t['sec_dense']:.2f} | | |")
    for e in args.executors:
        lines.append(f"| {e} | {t[f'sec_pg-{e}']:.3f} | {t[f'sec_pg-{e}'] / t['sec_dense']:.2f} | "
                     f"{out[f'mem-pg-{e}']['peak_mb'] / md:.3f} | {out[f'mem-pg-{e}']['peak_mb']:.0f} |")
        for d in (d for d in args.step_dtypes if d != "float32"):
            lines.append(f"| {e}, --step-dtype {d} ({t[f'sec_pg-{e}'] / t[f'sec_pg-{e}-{d}']:.2f}x faster than "
                         f"float32) | {t[f'sec_pg-{e}-{d}']:.3f} | {t[f'sec_pg-{e}-{d}'] / t['sec_dense']:.2f} | | |")
    if args.gumbel:
        mg = out["mem-gumbel"]["peak_mb"]
        lines.append(f"| Gumbel-softmax (back-propagation) | {t['sec_gumbel']:.3f} | {t['sec_gumbel'] / t['sec_dense']:.2f} | "
                     f"{mg / md:.3f} | {mg:.0f} |")
    print("\n".join(lines))
    if args.out:
        dest = Path(args.out)
        dest.mkdir(parents=True, exist_ok=True)
        record = {"args": {k: v for k, v in vars(args).items() if k not in ("worker", "plain_copy")}, "workers": out,
                  "table": lines, "when": time.strftime("%Y-%m-%d %H:%M:%S")}
        (dest / f"step_cost-{args.device.replace(':', '')}-{time.strftime('%Y%m%d-%H%M%S')}.json").write_text(
            json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    run(main)
