"""Quality per CPU minute (issue 28): which optimiser settings buy the best mask for the minutes a run has.

    OMP_NUM_THREADS=1 python bench/cpu_curve.py [--variants a,b] [--seeds 0,1,2] [--minutes 15] &   (x2: two queues)
    python bench/cpu_curve.py --list          # the cells in the order they run, and which are done
    python bench/cpu_curve.py --report-only   # report.md and curve.svg from the cells done so far

Protocol: the default model as a user loads it (the GGUF, de-quantised), 30 % of the decoder's parameters
(`--budget params`, heads + channels, global), FLAP's init with its compensation, best-val, and every other
default, with `--time-budget MINUTES` (15) at one thread: each cell is one process on one core, two queues
side by side on the 2 cores, so wall minutes and CPU minutes agree. A variant changes one setting:

  default    N_s 8, leave-one-out, 8 x 128 tokens per step, 16 init batches, 256 evaluation windows
  ns4, ns2   N_s 4 or 2 (leave-one-out)
  ma8        the moving-average baseline (window 5) instead of leave-one-out
  tok4x128   4 x 128 tokens per step;   tok16x64: 16 x 64
  init4      FLAP from 4 calibration batches instead of 16;   init64: from 64
  eval64     the run's own evaluations (the init mask, the final mask) on 64 windows instead of 256

The curve of a run: after every step, the mask the run would export if it ended there (best-val: the mask
of the best held-out step so far, the init mask included) and the process's CPU time then, plus the CPU
time the run's end took (the final evaluation and the export). Every distinct exported mask is evaluated
afterwards on the protocol's windows (WikiText-2 raw test, the first 256 windows of 128 tokens; those
evaluations are not counted). The run's own time budget stretches its learning-rate schedule to the
budget, so a point before the end is where that run was, not what a shorter budget would have given.

Cells resume: a killed cell resumes its run (`--resume`, its CPU time carried over) and its trace.
Results: OUT/cells/<variant>-s<seed>/cell.json (run folders deleted but for results.json), OUT/report.md,
OUT/curve.svg.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

STARTED = time.monotonic()

from cli_common import ROOT, csv_list, positive, run  # noqa: E402
from paper_tables import claim, fmt  # noqa: E402

from engine.hooks.base import RunHook  # noqa: E402

OUT = ROOT / "bench" / "results" / "cpu_curve"
PROTOCOL = dict(units=["heads", "channels"], prune_ratio=0.3, budget="params", scope="global", method="pg",
                init="flap", bias_compensation=True, init_batches=16, best_val_margin=0.0,  # (the defaults it measured)
                reconstruct=False)  # (the curve compares masks; a least-squares refit would apply to any of them alike)
EVAL_WINDOWS = 256
MARGIN = 0.01  # the report's last column: the mask best-val would have exported with this --best-val-margin
VARIANTS: dict[str, tuple[str, dict]] = {  # name -> (what it changes, PruneConfig overrides of the protocol)
    "default": ("the defaults it measured: N_s 8, leave-one-out, 8 x 128 tokens, 16 init batches, 256 eval windows, "
                "best-val without a margin", {}),
    "ns4": ("N_s 4", {"num_mask_samples": 4}),
    "ns2": ("N_s 2", {"num_mask_samples": 2}),
    "ma8": ("moving-average baseline (T 5)", {"method_options": {"baseline": "moving-average"}}),
    "tok4x128": ("4 x 128 tokens per step", {"batch_size": 4}),
    "tok16x64": ("16 x 64 tokens per step", {"batch_size": 16, "seqlen": 64}),
    "init4": ("4 init batches", {"init_batches": 4}),
    "init64": ("64 init batches", {"init_batches": 64}),
    "eval64": ("the run's evaluations on 64 windows", {"max_windows": 64}),
    "cut10lr10": ("sigmoid-cut init, T 0.1, lr 0.1", {"prob_map": "sigmoid-cut", "prob_temperature": 0.1, "lr": 0.1}),
    "cut03lr10": ("sigmoid-cut init, T 0.03, lr 0.1", {"prob_map": "sigmoid-cut", "prob_temperature": 0.03, "lr": 0.1}),
}
COLOURS = ["#000000", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22",
           "#7f7f7f"]


def cell_config(variant: str, seed: int, minutes: float, model: str | None = None):
    from engine.settings.config import FAST, PruneConfig

    extra = {"model": model} if model else {}
    return PruneConfig.from_dict({**PruneConfig(**FAST).to_dict(), **PROTOCOL, **VARIANTS[variant][1], **extra, "seed": seed,
                                  "time_budget": minutes}).resolved()


# --- one cell, in its own process ------------------------------------------------------------------
class Trace(RunHook):
    """A run hook (appended to the run's own): after every step, the step, the CPU seconds so far (earlier
    sessions' included) and the step best-val would export; each new best step's final masks are saved."""

    def __init__(self, run, cell: Path):
        super().__init__(run)
        self.cell, self.file = cell, cell / "trace.jsonl"
        lines = [json.loads(x) for x in self.file.read_text().splitlines()] if self.file.exists() else []
        self.offset = lines[-1]["cpu"] - time.process_time() if lines else 0.0  # a resumed cell's earlier CPU

    def point(self, state, val_ppl=None) -> None:
        best = state.best_step if state.best_scores is not None else state.step
        mask_file = self.cell / "masks" / f"step{best}.pt"
        if not mask_file.exists():
            import torch

            scores = state.best_scores if state.best_scores is not None else state.scores
            masks = self.run.masks.final_masks(scores, state.init_metric)
            mask_file.parent.mkdir(exist_ok=True)
            torch.save({u: m.bool() for u, m in masks.items()}, mask_file.with_suffix(".tmp"))
            os.replace(mask_file.with_suffix(".tmp"), mask_file)
        line = {"step": state.step, "cpu": time.process_time() + self.offset, "wall": time.monotonic() - STARTED,
                "best_step": best, "val_ppl": val_ppl}
        with open(self.file, "a") as f:
            f.write(json.dumps(line) + "\n")

    def on_start(self, state) -> None:
        if state.step == 0:
            self.point(state)

    def on_step(self, state, report) -> None:
        self.point(state, report.val_ppl)


def run_one(variant: str, seed: int, minutes: float, cell: Path, model: str | None) -> None:
    import torch

    from engine.data.text import eval_windows, load_eval_text
    from engine.hooks import RunView
    from engine.run.loop import PruneRun

    out = cell / "run"
    resume = (out / "checkpoint.pt").exists()
    run = PruneRun(cell_config(variant, seed, minutes, model), out, started=STARTED)
    trace = Trace(RunView(), cell)  # (its view bound to the run's resources with the run's own hooks')
    run.replace_resources(hooks=(*run.res.hooks, trace))
    if (out / "results.json").exists():  # the run finished; the evaluations below had not
        results = json.loads((out / "results.json").read_text())
    else:
        results = run.run(resume=resume, progress=False)
    finished_cpu = time.process_time() + trace.offset
    points = [json.loads(x) for x in trace.file.read_text().splitlines()]
    exported = results.get("mask_step")  # (the run's last word: a time budget that fitted too few steps exports the
    if exported is not None and (cell / "masks" / f"step{exported}.pt").exists():  # init, whatever best-val kept)
        points[-1]["best_step"] = exported
    if run.res.windows.shape[0] != EVAL_WINDOWS:  # the curve's evaluations are on the protocol's windows
        text, _ = load_eval_text(run.res.config.eval_data)
        run.replace_resources(windows=eval_windows(run.res.tokenizer, text, run.res.config.eval_seqlen, EVAL_WINDOWS))
        run.res.masks.measured.clear()
    if run.res.ctx.comp_means is None and run.res.config.bias_compensation:
        run.start_state(resume=True)  # the compensation's means, from the checkpoint
    ppl = {}
    for step in sorted({p["best_step"] for p in points}):
        masks = torch.load(cell / "masks" / f"step{step}.pt", weights_only=True)
        ppl[step] = run.res.masks.masked_perplexity({u: m.float() for u, m in masks.items()}, f"the exported mask of step {step}")
    end = points[-1]["cpu"]
    finish = finished_cpu - end  # the final evaluation and the export (a finished run read back: 0)
    cell_json = {
        "variant": variant, "seed": seed, "minutes": minutes, "config": run.res.config.to_dict(),
        "steps": results.get("steps"), "mask_step": results.get("mask_step"), "ppl_init": ppl[points[0]["best_step"]],
        "ppl_final": ppl[results["mask_step"]] if results.get("mask_step") in ppl else None,
        "ppl_final_run": results.get("ppl_pruned"), "seconds_per_step": results.get("seconds_per_step"),
        "cpu_total": finished_cpu, "cpu_finish": finish, "cpu_start": points[0]["cpu"],
        "curve": [{"step": p["step"], "cpu": p["cpu"] + finish, "ppl": ppl[p["best_step"]], "best_step": p["best_step"]}
                  for p in points],
    }
    (cell / "cell.json.tmp").write_text(json.dumps(cell_json, indent=1) + "\n")
    os.replace(cell / "cell.json.tmp", cell / "cell.json")
    if (out / "model").exists():
        shutil.rmtree(out / "model")  # the curve needs the figures, not a sliced model per cell


# --- the queue ----------------------------------------------------------------------------------------
def cell_dir(out: Path, variant: str, seed: int) -> Path:
    return out / "cells" / f"{variant}-s{seed}"


def queue(args) -> None:
    for seed in args.seeds:
        for variant in args.variants:
            cell = cell_dir(args.out, variant, seed)
            if (cell / "cell.json").exists():
                continue
            cell.mkdir(parents=True, exist_ok=True)
            lock = cell.parent / f"{cell.name}.lock"
            if claim(lock) is not None:
                continue
            try:
                print(f"[{time.strftime('%H:%M:%S')}] {variant} seed {seed}: running", flush=True)
                env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
                cmd = [sys.executable, str(Path(__file__)), "--cell", variant, str(seed), "--minutes", str(args.minutes),
                       "--out", str(args.out)] + (["--model", args.model] if args.model else [])
                with open(cell.parent / f"{cell.name}.log", "a") as log:
                    proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
                if proc.returncode != 0:
                    raise SystemExit(f"cell {cell.name} failed (exit {proc.returncode}); see {cell.parent / (cell.name + '.log')}")
            finally:
                lock.unlink(missing_ok=True)


# --- the report -----------------------------------------------------------------------------------------
def load_cells(out: Path) -> dict[str, list[dict]]:
    found: dict[str, list[dict]] = {}
    for f in sorted(out.glob("cells/*/cell.json")):
        c = json.loads(f.read_text())
        c["ppl_margin"] = with_margin(f.parent, c, MARGIN)
        found.setdefault(c["variant"], []).append(c)
    return found


def with_margin(cell_dir: Path, cell: dict, margin: float) -> float | None:
    """The perplexity of the mask best-val would have exported with --best-val-margin `margin`: the same checks
    (the run's steps do not depend on it), kept by engine.hooks.validation.improves; None when that mask was never
    the exported one at some step (so never evaluated)."""
    from engine.hooks.validation import improves

    run = json.loads((cell_dir / "run" / "results.json").read_text())
    checks = [(run["val_ppl_init"], 0)] + [(t["val_ppl"], t["step"]) for t in map(json.loads, (cell_dir / "trace.jsonl")
                                                                                .read_text().splitlines()) if t["val_ppl"]]
    best, step = None, 0
    for ppl, at in checks:
        if improves(ppl, best, margin):
            best, step = ppl, at
    return next((p["ppl"] for p in cell["curve"] if p["best_step"] == step), None)


def ppl_at(curve: list[dict], cpu: float) -> float | None:
    """The perplexity of the mask a run had exported by `cpu` seconds (None before its first point)."""
    got = None
    for p in curve:
        if p["cpu"] <= cpu:
            got = p["ppl"]
    return got


def report(out: Path, marks: list[float]) -> str:
    found = load_cells(out)
    lines = ["| variant | seeds | steps | s/step | CPU min to the first step | "
             + " | ".join(f"at {m:g} CPU min" for m in marks) + f" | final (CPU min) | final, margin {MARGIN:.0%} |",
             "|---|---|---|---|---|" + "---|" * len(marks) + "---|---|"]
    for v in VARIANTS:
        cells = found.get(v, [])
        if not cells:
            continue
        at = [fmt([x for c in cells if (x := ppl_at(c["curve"], 60 * m)) is not None]) for m in marks]
        finals = [c["ppl_final"] for c in cells if c["ppl_final"] is not None]
        cpu = statistics.mean(c["cpu_total"] for c in cells) / 60
        lines.append(f"| {v} | {','.join(str(c['seed']) for c in cells)} | {'/'.join(str(c['steps']) for c in cells)} | "
                     f"{statistics.mean(c['seconds_per_step'] for c in cells):.1f} | "
                     f"{statistics.mean(c['cpu_start'] for c in cells) / 60:.1f} | " + " | ".join(at)
                     + f" | **{fmt(finals)}** ({cpu:.1f}) | {fmt([c['ppl_margin'] for c in cells if c['ppl_margin']])} |")
    return "\n".join(lines) + "\n"


def svg(out: Path, width: int = 720, height: int = 420) -> str:
    """Each variant's seed-mean perplexity of the exported mask against CPU minutes (a step line from the
    minute every seed of it has a mask; a finished run keeps its final mask), plain SVG."""
    found = load_cells(out)
    series = []
    for i, v in enumerate(VARIANTS):
        cells = found.get(v, [])
        if not cells:
            continue
        t0 = max(c["curve"][0]["cpu"] for c in cells)
        t1 = max(c["curve"][-1]["cpu"] for c in cells)
        ts = sorted({p["cpu"] for c in cells for p in c["curve"] if t0 <= p["cpu"] <= t1} | {t0, t1})
        pts = [(t / 60, statistics.mean(ppl_at(c["curve"], t) for c in cells)) for t in ts]
        series.append((v, len(cells), COLOURS[i % len(COLOURS)], pts))
    if not series:
        return ""
    xs = [x for *_, p in series for x, _ in p]
    ys = [y for *_, p in series for _, y in p]
    x0, x1, y0, y1 = 0.0, max(xs) * 1.05, min(ys) * 0.97, max(ys) * 1.03
    L, R, T, B = 60, 190, 20, 40
    sx = lambda x: L + (x - x0) / (x1 - x0) * (width - L - R)  # noqa: E731
    sy = lambda y: height - B - (y - y0) / (y1 - y0) * (height - T - B)  # noqa: E731
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="11"><rect width="100%" height="100%" fill="white"/>',
             f'<line x1="{L}" y1="{height - B}" x2="{width - R}" y2="{height - B}" stroke="black"/>',
             f'<line x1="{L}" y1="{T}" x2="{L}" y2="{height - B}" stroke="black"/>',
             f'<text x="{(L + width - R) / 2}" y="{height - 8}" text-anchor="middle">CPU minutes of the run (one core), '
             'its final evaluation and export included</text>',
             f'<text x="14" y="{(T + height - B) / 2}" transform="rotate(-90 14 {(T + height - B) / 2})" '
             f'text-anchor="middle">WikiText-2 perplexity, mean over seeds (256 windows)</text>']
    for k in range(6):
        x, y = x0 + k * (x1 - x0) / 5, y0 + k * (y1 - y0) / 5
        parts.append(f'<text x="{sx(x):.0f}" y="{height - B + 14}" text-anchor="middle">{x:.0f}</text>')
        parts.append(f'<text x="{L - 4}" y="{sy(y) + 4:.0f}" text-anchor="end">{y:.0f}</text>')
        parts.append(f'<line x1="{L}" y1="{sy(y):.1f}" x2="{width - R}" y2="{sy(y):.1f}" stroke="#ddd"/>')
    for i, (v, n, colour, pts) in enumerate(series):
        d, prev = [], None
        for x, y in pts:
            if prev is not None:
                d.append(f"L{sx(x):.1f},{sy(prev):.1f}")
            d.append(f"{'M' if prev is None else 'L'}{sx(x):.1f},{sy(y):.1f}")
            prev = y
        parts.append(f'<path d="{" ".join(d)}" fill="none" stroke="{colour}" stroke-width="1.8"/>')
        parts.append(f'<circle cx="{sx(pts[-1][0]):.1f}" cy="{sy(pts[-1][1]):.1f}" r="3" fill="{colour}"/>')  # the end
        parts.append(f'<text x="{width - R + 8}" y="{T + 14 + 16 * i}" fill="{colour}">{v} ({n} seed{"s" * (n > 1)})</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", type=csv_list(str, lambda v: v in VARIANTS, f"variants of {', '.join(VARIANTS)}"),
                   default=list(VARIANTS))
    p.add_argument("--seeds", type=csv_list(int, lambda s: s >= 0, "seeds (>= 0)"), default=[0, 1, 2])
    p.add_argument("--minutes", type=positive(float), default=15.0, help="each cell's --time-budget, on one core")
    p.add_argument("--marks", type=csv_list(float, lambda m: m > 0, "CPU minutes"), default=[8.0, 11.0, 14.0])
    p.add_argument("--out", type=Path, default=OUT)
    p.add_argument("--model", help="another model than the default (a quick check of the bench itself)")
    p.add_argument("--list", action="store_true")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--cell", nargs=2, metavar=("VARIANT", "SEED"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.cell:
        variant, seed = args.cell
        return run_one(variant, int(seed), args.minutes, cell_dir(args.out, variant, int(seed)), args.model)
    if args.list:
        for seed in args.seeds:
            for v in args.variants:
                done = (cell_dir(args.out, v, seed) / "cell.json").exists()
                print(f"{v:10s} seed {seed}: {'done' if done else 'to run'}  ({VARIANTS[v][0]})")
        return
    if not args.report_only:
        queue(args)
    table = report(args.out, args.marks)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "report.md").write_text(table)
    (args.out / "curve.svg").write_text(svg(args.out))
    print(table)


if __name__ == "__main__":
    run(main)
