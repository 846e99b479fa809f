"""The seed paper's tables on one model, from real runs: resumable, each cell cached on disk.

    python bench/paper_tables.py [--tables 1,2,3,4,5] [--steps 150] [--max-windows 128] [--seeds 0,1,2]
                                 [--model smollm2-135m-instruct] [--out bench/results/paper_tables]
    python bench/paper_tables.py --list            # the cells and whether each is done
    python bench/paper_tables.py --report-only     # write the markdown from the cells done so far

Every cell is one `python -m engine prune` run in its own process, in OUT/cells/<cell>/ (the run's
usual folder: config.json, metrics.jsonl, checkpoint.pt, results.json; the sliced model is
deleted after the run to save disk). A cell with results.json is done and never rerun; one with
a checkpoint resumes. So an interrupted table continues where it stopped. The model is first
copied once to OUT/model (plain safetensors: loads in a second instead of de-quantizing a GGUF).

Tables (perplexity on WikiText-2 raw test, the first --max-windows windows of --eval-seqlen tokens;
calibration on the local C4 sample):
  1. heads + channels at 30/40/50 %: random, magnitude-sp, Wanda-sp (uniform), Wanda-sp metric
     ranked globally, PG (global, Wanda-sp init; mean +- std over --seeds), PG (uniform)
  2. initialisations of PG at 30/40/50 %: random, random-progressive, Taylor, Wanda-sp
  3. layers at 30/40/50 %: Layerwise-PPL, SLEB, PG (Layerwise-PPL init, both metric maps)
  4. ablations at 40 %: baseline (moving average / leave-one-out, also at half the lr / none),
     sqrt estimator, score-const map, N_s = 4
  5. PG vs Gumbel-softmax at 30/50 %: perplexity, wall time of the optimisation, peak memory
Results go to OUT/tables.md (and are printed).
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
from dataclasses import dataclass, replace
from pathlib import Path

from cli_common import ROOT, csv_list, positive, run
from engine.model.unit_types import unit_sizes

RATES = (0.3, 0.4, 0.5)
HC = {"units": "heads,channels"}


@dataclass
class Cell:
    table: int
    row: str
    rate: float
    settings: dict  # PruneConfig fields, as CLI values
    seed: int | None = None  # None: a row run once, with the first of --seeds
    pg: bool = True  # an optimisation run (uses --steps and --lr)
    lr_scale: float = 1.0  # times --lr (or --gumbel-lr): an ablation that controls the step size


def cells(tables: set[int], seeds: list[int], rates: tuple[float, ...] = RATES) -> list[Cell]:
    out: list[Cell] = []
    # the paper's optimiser (N_s 2, moving-average baseline), not the tool's defaults
    paper_pg = {"method": "pg", "num_mask_samples": 2, "baseline": "moving-average"}
    # (the key order is part of each cell's folder name, cell_key: "method" stays where it is written first)
    pg_global = {**HC, "method": "pg", "scope": "global", "init": "wanda-sp", **paper_pg}
    for r in rates:
        if 1 in tables:
            out += [Cell(1, "Random", r, {**HC, "method": "metric", "scope": "uniform", "init": "random"}, pg=False),
                    Cell(1, "Magnitude-sp", r, {**HC, "method": "metric", "scope": "uniform", "init": "magnitude-sp"}, pg=False),
                    Cell(1, "Wanda-sp (uniform)", r, {**HC, "method": "metric", "scope": "uniform", "init": "wanda-sp"}, pg=False),
                    Cell(1, "Wanda-sp metric, global ranking", r,
                         {**HC, "method": "metric", "scope": "global", "init": "wanda-sp"}, pg=False)]
            out += [Cell(1, "PG (global, Wanda-sp init)", r, pg_global, seed=s) for s in seeds]
            out += [Cell(1, "PG (uniform, Wanda-sp init)", r, {**pg_global, "scope": "uniform"}, seed=s) for s in seeds]
        if 2 in tables:
            out += [Cell(2, "Random", r, {**pg_global, "init": "random"}),
                    Cell(2, "Random-progressive", r, {**pg_global, "init": "random-progressive"}),
                    Cell(2, "LLM-Pruner (Taylor)", r, {**pg_global, "init": "taylor"}),
                    Cell(2, "Wanda-sp", r, pg_global)]
        if 3 in tables:
            layers = {"units": "layers", "scope": "global"}
            out += [Cell(3, "Layerwise-PPL", r, {**layers, "method": "metric", "layer_init": "layerwise-ppl"}, pg=False),
                    Cell(3, "SLEB", r, {**layers, "method": "metric", "layer_init": "sleb"}, pg=False),
                    Cell(3, "PG (Layerwise-PPL init)", r, {**layers, **paper_pg, "layer_init": "layerwise-ppl"}),
                    # score-const keeps the metric's order in the initial scores; sigmoid-norm over z-scores that a
                    # few outlier layers dominate starts most layers at almost the same score
                    Cell(3, "PG (Layerwise-PPL init, score-const map)", r,
                         {**layers, **paper_pg, "layer_init": "layerwise-ppl", "prob_map": "score-const"})]
        if 5 in tables and r in (0.3, 0.5):
            out += [Cell(5, "PG", r, pg_global, seed=s) for s in seeds]
            out += [Cell(5, "Gumbel-softmax", r, {**pg_global, "method": "gumbel"}, seed=s) for s in seeds]
    if 4 in tables and 0.4 in rates:
        r = 0.4
        rows = [("moving-average baseline (T = 5)", pg_global, 1.0),
                ("leave-one-out baseline", {**pg_global, "baseline": "leave-one-out"}, 1.0),
                # at N_s = 2 the leave-one-out advantage L1 - L2 is twice the batch-mean one, (L1 - L2) / 2: half
                # the lr separates "no stale losses" from "a doubled step"
                ("leave-one-out baseline, lr halved", {**pg_global, "baseline": "leave-one-out"}, 0.5),
                ("no baseline", {**pg_global, "baseline": "none"}, 1.0),
                ("sqrt estimator (reference code)", {**pg_global, "estimator": "sqrt"}, 1.0),
                ("score-const map (c = 0.8)", {**pg_global, "prob_map": "score-const"}, 1.0),
                ("N_s = 4", {**pg_global, "num_mask_samples": 4}, 1.0),
                ("N_s = 8, one batched forward", {**pg_global, "num_mask_samples": 8, "sample_forward": "batched"}, 1.0),
                ("leave-one-out, N_s = 8, one batched forward",
                 {**pg_global, "num_mask_samples": 8, "sample_forward": "batched", "baseline": "leave-one-out"}, 1.0)]
        out += [Cell(4, row, r, settings, seed=s, lr_scale=scale) for row, settings, scale in rows for s in seeds]
    return [replace(c, seed=seeds[0]) if c.seed is None else c for c in out]


def only_rows(todo: list[Cell], rows: list[str] | None) -> list[Cell]:
    """The cells of the named rows (all when none are named); a name no table has is an error."""
    names = {c.row for c in todo}
    unknown = [r for r in rows or [] if r not in names]
    if unknown:
        raise SystemExit(f"paper_tables.py: error: --only: no row {unknown[0]!r} in these tables; "
                         f"rows: {'; '.join(sorted(names))}")
    return [c for c in todo if not rows or c.row in rows]


def cell_key(c: Cell, args) -> str:
    """The run folder's name, from every setting of the run (the budget too, so a rerun with other
    --steps or --max-windows never takes an old cell). Cells with the same settings share one run
    (PG global, Wanda-sp init at 40 % serves tables 1, 2 and 4)."""
    import hashlib

    values = cell_values(c, args)  # hashed as the flags earlier versions passed, so their cells still count
    blob = json.dumps([x for k, v in values.items() for x in (f"--{k.replace('_', '-')}", str(v))]).encode()
    s = c.settings
    what = s.get("init") if s["units"] != "layers" else s.get("layer_init")
    return f"{s['method']}-{s['units'].replace(',', '+')}-{what}-{int(round(c.rate * 100))}-s{c.seed}-{hashlib.sha1(blob).hexdigest()[:6]}"


def cell_values(c: Cell, args) -> dict:
    """The cell's settings as PruneConfig fields (units as the comma list the tables name them by)."""
    values = {**c.settings, "prune_ratio": c.rate, "seed": c.seed, "max_windows": args.max_windows,
              "eval_seqlen": args.eval_seqlen, "device": args.device,
              "init_batches": c.settings.get("init_batches",  # (a row may fix its own)
                                             args.layer_init_batches if c.settings["units"] == "layers" else args.init_batches)}
    if c.pg:
        lr = args.gumbel_lr if c.settings.get("method") == "gumbel" else args.lr
        values |= {"steps": args.steps, "lr": lr * c.lr_scale}
    return values


def cell_config(c: Cell, args, model: str):
    """The cell's run config: what `python -m engine prune --config` runs."""
    from engine.settings.config import PruneConfig

    values = cell_values(c, args)
    values["units"] = values["units"].split(",")
    values.setdefault("reconstruct_batches", 16)  # (what the refit rows ran with before 64 became the default; not hashed)
    return PruneConfig.of(model=model, **values)


KEPT_IN_GIT = ("config.json", "metrics.jsonl", "masks.json")  # what a cell's folder keeps in the repository


def clear_started(out: Path) -> None:
    """A cell started in another clone comes back from git as its kept files alone, with no checkpoint to resume
    and no run marker, and `engine prune --overwrite` refuses a folder that holds no run: those files go (the
    cell runs again from its start). Anything else in the folder is left alone, and the engine's refusal stands."""
    if out.is_dir() and all(p.name in KEPT_IN_GIT for p in out.iterdir()):
        for p in list(out.iterdir()):
            p.unlink()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def claim(lock: Path) -> int | None:
    """Take a cell's lock file (it holds our pid). Returns None when we hold it, or the pid of the live
    process that does: two queues side by side (as README runs them) must never run one cell twice,
    since a fresh run starts with --overwrite. A lock whose process is gone is taken over."""
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                pid = int(lock.read_text().strip() or 0)
            except (OSError, ValueError):
                pid = 0
            if pid and pid != os.getpid() and _alive(pid):
                return pid
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        return None
    raise SystemExit(f"could not take the lock {lock}")


def run_cell(c: Cell, args, model_dir: Path, cells_dir: Path) -> dict | None:
    """The cell's results, running it if needed; None when another process is running it now."""
    key = cell_key(c, args)
    out = cells_dir / key
    done = out / "results.json"
    if done.exists():
        return json.loads(done.read_text())
    lock = cells_dir / f"{key}.lock"
    other = claim(lock)
    if other is not None:
        print(f"table {c.table} | {c.row} | {c.rate:.0%} | seed {c.seed}: process {other} is running {key}; skipped",
              flush=True)
        return None
    try:
        if done.exists():  # finished by another process between our check and the lock
            return json.loads(done.read_text())
        resume = (out / "checkpoint.pt").exists() and (out / "config.json").exists()
        cmd = [sys.executable, "-m", "engine", "prune", "--out", str(out)]
        if resume:
            cmd += ["--resume"]
        else:
            clear_started(out)
            config_file = cells_dir / f"{key}.config.json"
            cell_config(c, args, str(model_dir)).resolved().save(config_file)
            cmd += ["--config", str(config_file), "--overwrite"]
        print(f"[{time.strftime('%H:%M:%S')}] table {c.table} | {c.row} | {c.rate:.0%} | seed {c.seed}: "
              f"{'resuming' if resume else 'running'} {key}", flush=True)
        with open(cells_dir / f"{key}.log", "a") as log:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        if proc.returncode != 0:
            raise SystemExit(f"cell {key} failed (exit {proc.returncode}); see {cells_dir / (key + '.log')}")
        shutil.rmtree(out / "model", ignore_errors=True)  # the tables need the figures, not 40 sliced models
        return json.loads(done.read_text())
    finally:
        lock.unlink(missing_ok=True)


def plain_copy(model: str, dest: Path) -> Path:
    """The model as plain safetensors (a GGUF loads by de-quantizing; a copy loads in a second)."""
    if (dest / "config.json").exists():
        return dest
    import torch

    from engine.model.arch import ModelAdapter
    from engine.export.artifacts import export_pruned
    from engine.model.loading import load_model, resolve_model
    from engine.model.units import UnitLayout

    m, tok = load_model(resolve_model(model))
    layout = UnitLayout(unit_sizes(ModelAdapter.for_model(m)))
    export_pruned(m, tok, layout, {u: torch.ones(layout.total(u)) for u in layout.unit_types}, dest)
    return dest


# --- report ---------------------------------------------------------------------------------------
def fmt(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:,.1f}"
    return f"{statistics.mean(values):,.1f} ± {statistics.stdev(values):,.1f}"


def report(all_cells: list[Cell], results: dict[str, dict], args) -> str:
    done = [results[cell_key(c, args)] for c in all_cells if cell_key(c, args) in results]
    if not done:
        return "no cell finished yet\n"
    dense = done[0]["ppl_dense"]
    lines = [f"Model: {args.model} on {args.device}; WikiText-2 raw test, first {done[0]['eval_windows']} windows x "
             f"{done[0]['seqlen']} tokens "
             f"(dense perplexity {dense:.2f}); calibration: local C4 sample, {args.init_batches} batches of 8 x 128 for the "
             f"metrics ({args.layer_init_batches} for the layer metrics of table 3); PG: {args.steps} steps, lr {args.lr} "
             "cosine, N_s 2, T 5 unless stated. "
             f"Each cell: perplexity [seeds] (parameters of the pruned model; dense {done[0]['params_dense'] / 1e6:.1f} M).", ""]
    if 5 in {c.table for c in all_cells}:
        lines[0] += (f" Gumbel-softmax: lr {args.gumbel_lr} (chosen with bench/gumbel_lr.py, calibration data only), "
                     "temperature and schedule as `python -m engine prune --help` gives by default.")
    titles = {1: "Table 1: heads + channels, one-shot baselines vs PG", 2: "Table 2: initialisations of PG (global)",
              3: "Table 3: layer pruning", 4: "Table 4: ablations at 40 % (PG, global, Wanda-sp init)",
              5: "Table 5: PG vs Gumbel-softmax (heads + channels, global, Wanda-sp init)"}
    for t in sorted({c.table for c in all_cells}):
        tc = [c for c in all_cells if c.table == t]
        rates = sorted({c.rate for c in tc})
        rows = list(dict.fromkeys(c.row for c in tc))
        lines += [f"### {titles[t]}", ""]
        if t == 5:
            lines += ["| method | rate | perplexity | init ppl | optimisation time (s) | s / step | peak RSS (MB) | seed |",
                      "|---|---|---|---|---|---|---|---|"]
            for row in rows:
                for r in rates:
                    got = [(c, results[cell_key(c, args)]) for c in tc if c.row == row and c.rate == r
                           and cell_key(c, args) in results]
                    for c, res in got:
                        lines.append(f"| {row} | {r:.0%} | {res['ppl_pruned']:,.1f} | {res['ppl_init']:,.1f} | "
                                     f"{res['seconds_in_steps']:.0f} | {res['seconds_per_step']:.2f} | "
                                     f"{res['peak_rss_mb']:.0f} | {c.seed} |")
                    if len(got) > 1:
                        lines.append(f"| {row} | {r:.0%} | **{fmt([res['ppl_pruned'] for _, res in got])}** | | | | | "
                                     f"{','.join(str(c.seed) for c, _ in got)} |")
            lines += ["", "Each cell's time and peak memory come from its own run (its process, under whatever load the "
                      "machine had then); `python bench/step_cost.py` measures one PG and one Gumbel-softmax step side by "
                      "side in one process, which is the comparison to trust.", ""]
            continue
        lines += ["| method | " + " | ".join(f"{r:.0%}" for r in rates) + " |", "|---" * (len(rates) + 1) + "|",
                  "| dense | " + " | ".join(f"{dense:.2f}" for _ in rates) + " |"]
        for row in rows:
            cols = []
            for r in rates:
                group = [c for c in tc if c.row == row and c.rate == r]
                finished = [c for c in group if cell_key(c, args) in results]
                got = [results[cell_key(c, args)] for c in finished]
                seeds = ",".join(str(c.seed) for c in finished)
                # parameters too: a uniform budget rounds per layer (3 KV groups at 50 % keep 2), so rows differ
                cols.append(f"{fmt([g['ppl_pruned'] for g in got])} [{seeds}] ({got[0]['params_pruned'] / 1e6:.1f} M)"
                            if got else "–")
            lines.append(f"| {row} | " + " | ".join(cols) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tables", default="1,2,3,4,5", type=csv_list(int, lambda t: 1 <= t <= 5, "table numbers 1 to 5"))
    p.add_argument("--steps", type=positive(int), default=150, help="PG (and Gumbel) steps per cell (default %(default)s)")
    p.add_argument("--lr", type=positive(float), default=0.02, help="PG learning rate (default %(default)s)")
    p.add_argument("--gumbel-lr", type=positive(float), default=0.6,
                   help="Gumbel-softmax learning rate (default %(default)s: on this model its gradient is ~30x smaller "
                        "than PG's estimate, geometric mean over heads and channels; bench/gumbel_lr.py measures it)")
    p.add_argument("--seeds", default="0,1,2", type=csv_list(int, lambda s: s >= 0, "seeds (integers >= 0)"),
                   help="seeds of the main PG cells (table 1's PG global, table 5)")
    p.add_argument("--rates", default=",".join(str(r) for r in RATES),
                   type=csv_list(float, lambda r: 0 < r < 1, "prune ratios in (0, 1)"), help="prune ratios (default %(default)s)")
    p.add_argument("--max-windows", type=positive(int), default=128)
    p.add_argument("--eval-seqlen", type=positive(int), default=128)
    p.add_argument("--init-batches", type=positive(int), default=8, help="calibration batches for the unit metrics (default %(default)s)")
    p.add_argument("--layer-init-batches", type=positive(int), default=2,
                   help="calibration batches for the layer metrics of table 3 (default %(default)s): Layerwise-PPL "
                        "runs the model once per layer and SLEB once per layer per removal, so on CPU they get fewer")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]; several queues of this script side by side "
                   "share the cells through lock files (a GPU runs a few at once far better than one)")
    p.add_argument("--only", action="append", metavar="ROW",
                   help="run only the cells of this row (its name as the tables print it; repeat for more rows); "
                        "the report still lists every row")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "paper_tables"))
    p.add_argument("--list", action="store_true", help="list the cells and whether each is done")
    p.add_argument("--report-only", action="store_true", help="write the tables from the cells done so far")
    args = p.parse_args()
    tables, seeds = set(args.tables), args.seeds
    out = Path(args.out)
    cells_dir = out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    # the PG rows of tables 1, 4 and 5 run over every seed; tables 2 and 3 and the one-shot rows once
    todo = cells(tables, seeds, tuple(args.rates))
    unique: dict[str, Cell] = {}
    for c in only_rows(todo, args.only):
        unique.setdefault(cell_key(c, args), c)
    # table 1 first: the cells of the headline comparison (PG vs Wanda-sp, uniform and global ranking) rate
    # by rate, then its other rows; seed 0 before the other seeds; then the cheap one-shot cells of the
    # other tables, then their PG cells
    headline = ("Wanda-sp (uniform)", "Wanda-sp metric, global ranking", "PG (global, Wanda-sp init)")
    # (SLEB, O(layers^2) model runs, goes after the PG cells)
    def cost(c: Cell) -> int:
        return 0 if c.table == 1 else 2 if c.row == "SLEB" else int(c.pg)

    unique = sorted(unique.values(), key=lambda c: (c.table != 1, c.seed, c.row not in headline, cost(c), c.rate, c.pg, c.table))
    if args.list:
        for c in unique:
            state = "done" if (cells_dir / cell_key(c, args) / "results.json").exists() else "todo"
            print(f"{state:5} table {c.table} | {c.row} | {c.rate:.0%} | seed {c.seed} | {cell_key(c, args)}")
        return
    results: dict[str, dict] = {}
    if not args.report_only:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        model_dir = plain_copy(args.model, out / "model")
        busy = 0
        for c in unique:
            res = run_cell(c, args, model_dir, cells_dir)
            if res is None:
                busy += 1
                continue
            results[cell_key(c, args)] = res
            (out / "tables.md").write_text(report(todo, results, args))
        if busy:
            print(f"{busy} cell(s) were running in another process: rerun this command when it has finished", flush=True)
    for c in unique:
        f = cells_dir / cell_key(c, args) / "results.json"
        if f.exists():
            results[cell_key(c, args)] = json.loads(f.read_text())
    text = report(todo, results, args)
    (out / "tables.md").write_text(text)
    print(text)


if __name__ == "__main__":
    run(main)
