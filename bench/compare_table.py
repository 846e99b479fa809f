"""The comparison table at matched parameters (issue 27): every row removes the same fraction of the decoder
layers' parameters (`--budget params`), on one protocol; resumable, each cell cached on disk.

    python bench/compare_table.py [--rates 0.3,0.5] [--seeds 0,1,2] [--only ROW ...] [--out DIR]
    python bench/compare_table.py --list            # the cells, in the order they run, and which are done
    python bench/compare_table.py --report-only     # write table.md from the cells done so far

Protocol: the default model (SmolLM2-135M-Instruct); WikiText-2 raw test as the engine loads it, the first
--max-windows (256) windows of 128 tokens; C4 calibration, 8 x 128 tokens per step; the tool's defaults (the
fast preset: 50 steps, leave-one-out over N_s 8, lr 0.02 cosine; Taylor for widths, SLEB for layers,
best-val final mask) unless a row says otherwise. PG rows run every --seeds at the first rate and the first
seed at the others; one-shot rows run the first seed.

Every cell is one `python -m engine prune` run in its own process (bench/paper_tables.run_cell: a cell with
results.json is done, one with a checkpoint resumes, two queues side by side share the cells through lock
files). Each cell's CPU and wall seconds (summed over its resumes) go to cells/<cell>.time.json; git keeps
them all in times.json and the cells' configs in configs.json (main writes both with the table).
Two queues at one thread each on 2 cores:

    OMP_NUM_THREADS=1 python bench/compare_table.py &  OMP_NUM_THREADS=1 python bench/compare_table.py &
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time
from pathlib import Path

from cli_common import ROOT, csv_list, positive, run
from paper_tables import Cell, cell_key, fmt, plain_copy, run_cell

HC = {"units": "heads,channels", "budget": "params"}
LAYERS = {"units": "layers", "budget": "params", "scope": "global"}
JOINT = {"units": "layers,heads,channels", "budget": "params", "scope": "global"}
JOINT4 = {**JOINT, "mix_batches": 4}  # the rows measured before the mix took 8 batches (the config's old default)
JOINT8 = {**JOINT, "mix_batches": 8}  # (PruneConfig.of reads a config without the field as an old one: 4)
# PG on the widths of the layers the joint one-shot keeps (SLEB's layers fixed, FLAP's compensated widths on 64 init
# batches, the init read as the one-shot row reads it, best-val's 1 % margin): the row of that name and its variants
FIXED64 = {**JOINT8, "method": "pg", "init": "flap", "layer_init": "sleb", "bias_compensation": True,
           "layer_score_const": 1.0, "init_batches": 64, "init_data": "all", "best_val_margin": 0.01}
# SLEB runs the model once per layer and removal: about 30 CPU minutes per cell at 30 % here. The joint rows
# take Layerwise-PPL's layer order (n model runs) so that a PG cell fits in about 35 minutes on one core.
ROWS: list[tuple] = [  # (row, settings, optimises[, lr scale])
    ("Taylor (LLM-Pruner's metric, global ranking)", {**HC, "method": "metric", "scope": "global", "init": "taylor"}, False),
    ("Wanda-sp (uniform)", {**HC, "method": "metric", "scope": "uniform", "init": "wanda-sp"}, False),
    ("SLEB", {**LAYERS, "method": "metric", "layer_init": "sleb"}, False),
    ("Layerwise-PPL", {**LAYERS, "method": "metric", "layer_init": "layerwise-ppl"}, False),
    ("Joint one-shot (Layerwise-PPL + Taylor, best mix)", {**JOINT4, "method": "metric", "init": "taylor",
                                                          "layer_init": "layerwise-ppl"}, False),
    ("PG joint (layers + heads + channels)", {**JOINT4, "method": "pg", "init": "taylor", "layer_init": "layerwise-ppl"}, True),
    ("PG heads + channels (global)", {**HC, "method": "pg", "scope": "global", "init": "taylor"}, True),
    ("PG heads + channels (uniform)", {**HC, "method": "pg", "scope": "uniform", "init": "taylor"}, True),
    ("PG layers (SLEB, score-const, best-val)", {**LAYERS, "method": "pg", "layer_init": "sleb"}, True),
    # the peers of issue 24: FLAP one-shot, PG from FLAP, and Bonsai at PG's compute (its steps x N_s forwards)
    ("FLAP (one-shot, with its bias compensation)", {**HC, "method": "flap", "scope": "global", "init": "flap"}, False),
    ("PG from FLAP", {**HC, "method": "pg", "scope": "global", "init": "flap"}, True),
    ("PG from FLAP, compensated", {**HC, "method": "pg", "scope": "global", "init": "flap", "bias_compensation": True}, True),
    ("Bonsai (50 steps x N_s 8 forwards, as PG)", {**HC, "method": "bonsai", "scope": "global", "init": "wanda-sp"}, True),
    # the joint method with the tool's own defaults (SLEB's layer order: about 30 CPU minutes more per cell)
    ("PG joint, SLEB layer order (the defaults)", {**JOINT4, "method": "pg", "init": "taylor", "layer_init": "sleb"}, True),
    # the joint method on the strongest one-shot parts: SLEB's layers, FLAP's widths (one ranking across types) and
    # its bias compensation, the mix chosen on compensated losses over every layer count
    ("Joint one-shot (SLEB + FLAP, compensated, best mix)", {**JOINT4, "method": "flap", "init": "flap", "layer_init": "sleb"}, False),
    ("PG joint from SLEB + FLAP (compensated)", {**JOINT4, "method": "pg", "init": "flap", "layer_init": "sleb",
                                                 "bias_compensation": True}, True),
    # the same with sampled masks close to the init mask (score-const c = 0.95 for layers and widths): a local search
    ("PG joint from SLEB + FLAP, sharp init (score-const 0.95)", {**JOINT4, "method": "pg", "init": "flap", "layer_init": "sleb",
                                                                 "bias_compensation": True, "prob_map": "score-const",
                                                                 "score_const": 0.95}, True),
    # ... with 10x the step size: at c = 0.95 a unit whose drop helps by 0.3 nats moves by about lr * 0.3 a step,
    # so at lr 0.02 nothing flips in 50 steps (the row above); at 0.2 it can
    ("PG joint from SLEB + FLAP, sharp init, lr 0.2", {**JOINT4, "method": "pg", "init": "flap", "layer_init": "sleb",
                                                       "bias_compensation": True, "prob_map": "score-const",
                                                       "score_const": 0.95}, True, 10.0),
    # the mix chosen on 8 batches (4 held-out + 4 init batches for PG, the first 8 init batches one-shot) in place of 4
    ("Joint one-shot (SLEB + FLAP, compensated, mix on 8 batches)", {**JOINT8, "method": "flap", "init": "flap",
                                                                     "layer_init": "sleb"}, False),
    # the width metrics on 64 calibration batches in place of 16 (bench/init_batches.py: 8 batches' masks differ from
    # 16's in 12 % (FLAP) to 30 % (Taylor) of the removed parameters, so 16 is not converged either)
    ("FLAP, 64 init batches", {**HC, "method": "flap", "scope": "global", "init": "flap", "init_batches": 64}, False),
    ("Taylor, 64 init batches", {**HC, "method": "metric", "scope": "global", "init": "taylor", "init_batches": 64}, False),
    # PG on the widths of the layers that mix keeps: layers fixed at 0/1 (score-const c = 1), widths from FLAP's
    # sigmoid-norm map (the setting in which PG improves on its init for widths alone)
    ("PG joint from SLEB + FLAP, fixed layers (mix on 8 batches)", {**JOINT8, "method": "pg", "init": "flap", "layer_init": "sleb",
                                                                    "bias_compensation": True, "layer_score_const": 1.0}, True),
    # PG from FLAP's compensated init on 64 init batches: FLAP's one-shot mask from 64 batches is the best width row,
    # and PG's init from 16 batches starts above it (258.3 against 221.2 on seed 0); 64 batches cost about 1.5 CPU
    # minutes more. Does PG improve on the best width init, at the same init data as the one-shot row?
    # (--init-data all: the init reads what the one-shot row reads, so PG starts from that row's mask, seed by seed)
    ("PG from FLAP, compensated, 64 init batches", {**HC, "method": "pg", "scope": "global", "init": "flap",
                                                    "bias_compensation": True, "init_batches": 64, "init_data": "all",
                                                    "best_val_margin": 0.01}, True),
    # the joint rows on the tool's defaults today: FLAP's widths from 64 init batches (the width row's best), SLEB's
    # layers (2 batches, the same as above: the batches come first from the seed's stream), the mix on 8 batches;
    # PG's init reads the one-shot row's batches (--init-data all), so it starts from that row's mask; best-val with
    # today's 1 % margin (the two 64-batch PG rows)
    ("Joint one-shot (SLEB + FLAP, compensated, 64 init batches)", {**JOINT8, "method": "flap", "init": "flap",
                                                                    "layer_init": "sleb", "init_batches": 64}, False),
    ("PG joint from SLEB + FLAP, fixed layers, 64 init batches", FIXED64, True),
    # the mix refined: the 3 layer counts that lose least on the 8 mix batches compared again on the next 24 init
    # batches (bench/joint_counts.py: on seed 0 the loss on those 24 batches ranks the counts 2-6 as WikiText does)
    ("Joint one-shot (SLEB + FLAP, compensated, 64 init batches, mix refined on 24)",
     {**JOINT8, "method": "flap", "init": "flap", "layer_init": "sleb", "init_batches": 64,
      "mix_refine_batches": 24}, False),
    # SLEB's order on 8 batches in place of 2: on 2 the first four layers out differ from seed to seed ({14, 5, 17, 4},
    # {5, 17, 16, 18}, {14, 17, 13, 16}) and the mix inherits the draw; about 4x SLEB's CPU minutes
    ("Joint one-shot (SLEB on 8 batches + FLAP, compensated, 64 init batches)",
     {**JOINT8, "method": "flap", "init": "flap", "layer_init": "sleb", "init_batches": 64,
      "layer_init_batches": 8}, False),
    # Layerwise-PPL's order in place of SLEB's: one round of n model runs instead of one per removal (SLEB to 9 layers
    # is about 12 CPU minutes here, Layerwise-PPL about 3), so a joint one-shot could fit a 10-minute run on 2 cores
    ("Joint one-shot (Layerwise-PPL + FLAP, compensated, 64 init batches)",
     {**JOINT8, "method": "flap", "init": "flap", "layer_init": "layerwise-ppl", "init_batches": 64}, False),
    # ... on FLAP's 16 init batches, where SLEB's joint did better than on 64 (178.5 against 181.4): the cheapest joint
    ("Joint one-shot (Layerwise-PPL + FLAP, compensated, mix on 8 batches)",
     {**JOINT8, "method": "flap", "init": "flap", "layer_init": "layerwise-ppl", "init_batches": 16}, False),
    # --sleb-finalists 5: each SLEB round runs every layer left on a quarter of the batches and the 5 best there on
    # all of them. On SLEB's 2 batches (1 + 1): does it remove what SLEB removes (the SLEB row's orders, same batches)?
    ("SLEB, 5 finalists", {**LAYERS, "method": "metric", "layer_init": "sleb", "sleb_finalists": 5}, False),
    # ... and SLEB's order on 8 batches at 38 % of its model runs (2 + 5 x 6 a round in place of 8 a layer)
    ("Joint one-shot (SLEB on 8 batches, 5 finalists + FLAP, compensated, 64 init batches)",
     {**JOINT8, "method": "flap", "init": "flap", "layer_init": "sleb", "init_batches": 64, "layer_init_batches": 8,
      "sleb_finalists": 5}, False),
    # PG's channels learned in blocks (--unit-block B: B neighbours in FLAP's ranking within a layer share one keep
    # probability): a channel alone moves the loss by far less than the spread of the sampled losses, so 50 steps of
    # 8 samples never rank 46,080 of them; 720 blocks of 64 (or 180 of 256) each move it B times more
    *[(f"PG joint from SLEB + FLAP, fixed layers, 64 init batches, channel blocks of {b}",
       {**FIXED64, "method_options": {"unit_block": b}}, True) for b in (64, 256)],
    # ... with the samples near the init mask (sigmoid-cut T 0.1: a sample flips about 5 % of the blocks, those at
    # FLAP's cut), and a step size for a block's effect (about 0.004 nats for 64 channels at the cut: at lr 0.02 the
    # signal moves a block's probability by 0.004 in 50 steps; at lr 1.0 by about 0.2)
    *[(f"PG joint from SLEB + FLAP, fixed layers, 64 init batches, sigmoid-cut, channel blocks of {b}, lr 1.0",
       {**FIXED64, "prob_map": "sigmoid-cut", "method_options": {"unit_block": b}}, True, 50.0) for b in (64, 256)],
    # --reconstruct: the final mask's kept columns refit by least squares to the dense projections' outputs (16
    # batches of their own, ridge 0.1); the masks are the rows' above, each row against its own mask unrefit. SLEB
    # removes whole layers only: nothing to refit. Taylor's row with the intercept (the compensation's means). The
    # joint rows' cells run before --mix-refit's default became off (2026-11-27) scored their mix refit (their
    # configs load so); the "mix unrefit" rows pin it off
    *[(f"{row} + least-squares reconstruction", {**settings, "reconstruct": True}, pg) for row, settings, pg in (
        ("FLAP (one-shot, with its bias compensation)", {**HC, "method": "flap", "scope": "global", "init": "flap"}, False),
        ("Taylor (LLM-Pruner's metric, global ranking)", {**HC, "method": "metric", "scope": "global", "init": "taylor",
                                                          "bias_compensation": True}, False),
        ("PG heads + channels (global)", {**HC, "method": "pg", "scope": "global", "init": "taylor"}, True),
        ("Joint one-shot (SLEB + FLAP, compensated, 64 init batches)", {**JOINT8, "method": "flap", "init": "flap",
                                                                        "layer_init": "sleb", "init_batches": 64}, False),
        ("Joint one-shot (Layerwise-PPL + FLAP, compensated, mix on 8 batches)",
         {**JOINT8, "method": "flap", "init": "flap", "layer_init": "layerwise-ppl", "init_batches": 16}, False),
        ("PG joint from SLEB + FLAP, fixed layers, 64 init batches", FIXED64, True),
        # the joint mix chosen on the compensated losses (as the rows without the refit chose it), the chosen mask
        # refit: at 40 and 50 % the refit-scored mix took fewer layers out (4 and 9) than the unrefit one (9 and 11)
        # and ended above that row's mask unrefit on WikiText (290.7 against 259.3, 498.6 against 444.9; seed 0)
        ("Joint one-shot (SLEB + FLAP, compensated, 64 init batches, mix unrefit)",
         {**JOINT8, "method": "flap", "init": "flap", "layer_init": "sleb", "init_batches": 64, "mix_refit": False}, False),
        ("Joint one-shot (Layerwise-PPL + FLAP, compensated, mix on 8 batches, mix unrefit)",
         {**JOINT8, "method": "flap", "init": "flap", "layer_init": "layerwise-ppl", "init_batches": 16,
          "mix_refit": False}, False))],
]
RECONSTRUCTED = tuple(row for row, settings, *_ in ROWS if settings.get("reconstruct"))
# one-shot rows whose seeds (their calibration batches) are all run at the first rate, as the PG rows'
SEEDED_ONE_SHOT = ("Joint one-shot (SLEB + FLAP, compensated, best mix)",
                   "Joint one-shot (SLEB + FLAP, compensated, mix on 8 batches)",
                   "FLAP (one-shot, with its bias compensation)", "FLAP, 64 init batches",
                   "Taylor (LLM-Pruner's metric, global ranking)", "Taylor, 64 init batches",
                   "Joint one-shot (SLEB + FLAP, compensated, 64 init batches)",
                   "Joint one-shot (SLEB + FLAP, compensated, 64 init batches, mix refined on 24)",
                   "Joint one-shot (SLEB on 8 batches + FLAP, compensated, 64 init batches)",
                   "Joint one-shot (Layerwise-PPL + FLAP, compensated, 64 init batches)", "SLEB", "SLEB, 5 finalists",
                   "Joint one-shot (Layerwise-PPL + FLAP, compensated, mix on 8 batches)",
                   "Joint one-shot (SLEB on 8 batches, 5 finalists + FLAP, compensated, 64 init batches)",
                   *(r for r in RECONSTRUCTED if "one-shot" in r or r.startswith(("FLAP", "Taylor"))))
# the variants measured on the way to the rows above them (maps, mix batches, init batches, step sizes): the report
# puts them in a second table, so that the first reads as the comparison
EXPLORED = ("Joint one-shot (Layerwise-PPL + Taylor, best mix)", "PG joint (layers + heads + channels)",
            "PG from FLAP", "PG from FLAP, compensated", "PG joint, SLEB layer order (the defaults)",
            "Joint one-shot (SLEB + FLAP, compensated, best mix)", "PG joint from SLEB + FLAP (compensated)",
            "PG joint from SLEB + FLAP, sharp init (score-const 0.95)", "PG joint from SLEB + FLAP, sharp init, lr 0.2",
            "Joint one-shot (SLEB + FLAP, compensated, mix on 8 batches)", "Taylor, 64 init batches",
            "PG joint from SLEB + FLAP, fixed layers (mix on 8 batches)",
            "Joint one-shot (SLEB + FLAP, compensated, 64 init batches, mix refined on 24)",
            "Joint one-shot (SLEB on 8 batches + FLAP, compensated, 64 init batches)",
            "Joint one-shot (Layerwise-PPL + FLAP, compensated, 64 init batches)", "SLEB, 5 finalists",
            "Joint one-shot (Layerwise-PPL + FLAP, compensated, mix on 8 batches)",
            "Joint one-shot (SLEB on 8 batches, 5 finalists + FLAP, compensated, 64 init batches)",
            "PG joint from SLEB + FLAP, fixed layers, 64 init batches, channel blocks of 64",
            "PG joint from SLEB + FLAP, fixed layers, 64 init batches, channel blocks of 256",
            *[f"PG joint from SLEB + FLAP, fixed layers, 64 init batches, sigmoid-cut, channel blocks of {b}, lr 1.0"
              for b in (64, 256)])
RUN_FIRST = ("Taylor (LLM-Pruner's metric, global ranking)", "PG joint (layers + heads + channels)",
             "PG heads + channels (global)", "Wanda-sp (uniform)", "FLAP (one-shot, with its bias compensation)")


def cells(rates: list[float], seeds: list[int]) -> list[Cell]:
    out = []
    for i, r in enumerate(rates):
        for row, settings, pg, *lr_scale in ROWS:  # (a fourth element: the row's lr as a multiple of --lr)
            for s in (seeds if (pg or row in SEEDED_ONE_SHOT) and i == 0 else seeds[:1]):
                out.append(Cell(27, row, r, settings, seed=s, pg=pg, lr_scale=lr_scale[0] if lr_scale else 1.0))
    return out


def order(todo: list[Cell], rates: list[float], seeds: list[int]) -> list[Cell]:
    """The must-show cells first: the first rate's headline rows seed by seed, then the rest, SLEB last."""
    def key(c: Cell):
        return (rates.index(c.rate), c.row not in RUN_FIRST, seeds.index(c.seed), "SLEB" in c.row,
                RUN_FIRST.index(c.row) if c.row in RUN_FIRST else 9)
    return sorted(todo, key=key)


TIMES_FILE = "times.json"  # every cell's CPU and wall seconds, in one file (cell_times)
CONFIGS_FILE = "configs.json"  # every cell's config.json, in one file (cell_configs): git keeps it, not 137 files


def timed_cell(c: Cell, args, model_dir: Path, cells_dir: Path) -> dict | None:
    """run_cell, adding this process's share of the cell's CPU and wall time to cells/<cell>.time.json."""
    key = cell_key(c, args)
    if (cells_dir / key / "results.json").exists():
        return json.loads((cells_dir / key / "results.json").read_text())
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    res = run_cell(c, args, model_dir, cells_dir)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if cpu > 1:  # it ran here (not skipped as another queue's)
        f = cells_dir / f"{key}.time.json"
        old = json.loads(f.read_text()) if f.exists() else {"cpu_seconds": 0.0, "wall_seconds": 0.0}
        f.write_text(json.dumps({"cpu_seconds": old["cpu_seconds"] + cpu,
                                 "wall_seconds": old["wall_seconds"] + time.monotonic() - t0}) + "\n")
    return res


def cell_times(cells_dir: Path) -> dict[str, dict]:
    """Each cell's CPU and wall seconds: cells/<cell>.time.json as timed_cell writes them (working files, not in
    git), over times.json beside cells/, the one file git keeps of them all (main rewrites it with the table)."""
    merged = cells_dir.parent / TIMES_FILE
    times = json.loads(merged.read_text()) if merged.exists() else {}
    for f in sorted(cells_dir.glob("*.time.json")):
        times[f.name[:-len(".time.json")]] = json.loads(f.read_text())
    return times


def cell_configs(cells_dir: Path) -> dict[str, dict]:
    """Each cell's run config: cells/<cell>/config.json as its run writes it (a working file, not in git), over
    configs.json beside cells/, the one file git keeps of them all (main rewrites it with the table)."""
    merged = cells_dir.parent / CONFIGS_FILE
    configs = json.loads(merged.read_text()) if merged.exists() else {}
    for f in sorted(cells_dir.glob("*/config.json")):
        if (f.parent / "results.json").exists():  # (a cell done: one that never finished has no figures)
            configs[f.parent.name] = json.loads(f.read_text())
    return configs


def cell_config_file(cell: Path) -> Path:
    """A cell's config.json (what bench/joint_counts.py and bench/oneshot_on_pg_data.py read): the cell's own, or,
    in a fresh clone, written back into the cell from configs.json. Raises FileNotFoundError for neither."""
    own = cell / "config.json"
    if not own.is_file():
        merged = cell.parent.parent / CONFIGS_FILE
        configs = json.loads(merged.read_text()) if merged.is_file() else {}
        if cell.name not in configs:
            raise FileNotFoundError(own)
        cell.mkdir(parents=True, exist_ok=True)
        own.write_text(json.dumps(configs[cell.name], indent=2) + "\n")
    return own


def load_cell_config(cell: Path):
    """A comparison cell's PruneConfig (cell_config_file's), or one `error:` line for a folder that is no cell."""
    from engine.settings.config import PruneConfig
    from engine.errors import UserError

    try:
        return PruneConfig.load(cell_config_file(cell))
    except FileNotFoundError:
        raise UserError(f"{cell} holds no config.json (a cell of bench/compare_table.py)") from None


def report(todo: list[Cell], args, cells_dir: Path) -> str:
    got, times = {}, cell_times(cells_dir)
    for c in todo:
        f = cells_dir / cell_key(c, args) / "results.json"
        if f.exists():
            got[cell_key(c, args)] = (json.loads(f.read_text()), times.get(cell_key(c, args)))
    if not got:
        return "no cell finished yet\n"
    first = next(iter(got.values()))[0]
    rates = sorted({c.rate for c in todo})
    lines = [f"Model {args.model}; WikiText-2 raw test, first {first['eval_windows']} windows x {first['seqlen']} tokens "
             f"(dense {first['ppl_dense']:.2f}); C4 calibration, 8 x 128 tokens per step; --budget params (each column "
             f"removes that share of the decoder layers' parameters); PG: the fast preset ({args.steps} steps, lr "
             f"{args.lr} cosine, leave-one-out over N_s 8), best-val final mask; {args.init_batches} calibration batches "
             f"for Taylor/Wanda-sp, {args.layer_init_batches} for the layer metrics. A cell: perplexity [seeds], "
             "CPU minutes per run (one thread).", "",
             "| method | " + " | ".join(f"{r:.0%}" for r in rates) + " |", "|---" * (len(rates) + 1) + "|",
             "| dense | " + " | ".join(f"{first['ppl_dense']:.2f}" for _ in rates) + " |"]
    names = list(dict.fromkeys(c.row for c in todo))
    explored = [r for r in names if r in EXPLORED]
    for row in [r for r in names if r not in EXPLORED] + explored:
        if explored and row == explored[0]:
            lines += ["", "Variants measured on the way (same protocol):", "",
                      "| variant | " + " | ".join(f"{r:.0%}" for r in rates) + " |", "|---" * (len(rates) + 1) + "|"]
        cols = []
        for r in rates:
            done = [(c, *got[cell_key(c, args)]) for c in todo if c.row == row and c.rate == r and cell_key(c, args) in got]
            if not done:
                cols.append("–")
                continue
            ppl = fmt([res["ppl_pruned"] for _, res, _ in done])
            seeds = ",".join(str(c.seed) for c, _, _ in done)
            cpu = [t["cpu_seconds"] / 60 for _, _, t in done if t]
            mix = {res.get("layers_removed") for _, res, _ in done if res.get("layers_removed") is not None}
            extra = f"; {'/'.join(str(m) for m in sorted(mix))} layers out" if mix and "joint" in row.lower() else ""
            cols.append(f"{ppl} [{seeds}] ({statistics.mean(cpu):.0f} CPU min{extra})" if cpu else f"{ppl} [{seeds}]{extra}")
        lines.append(f"| {row} | " + " | ".join(cols) + " |")
    lines += ["", "Removed (parameters, % of the decoder) per finished cell:", ""]
    for c in sorted(todo, key=lambda c: c.rate):  # (by rate, as the columns: the same list for any --rates order)
        k = cell_key(c, args)
        if k in got:
            res = got[k][0]
            alone = f", the final mask unrefit {r['ppl_before']:,.1f}" if (r := res.get("reconstruction")) else ""
            lines.append(f"- {c.row}, {c.rate:.0%}, seed {c.seed}: {res['ppl_pruned']:,.1f} (init {res['ppl_init']:,.1f}{alone}); "
                         f"{res.get('params_removed', 0):,} removed ({res.get('removed_of_decoder', 0):.1%}); `{k}`")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--rates", default="0.3,0.5,0.4", type=csv_list(float, lambda r: 0 < r < 1, "ratios in (0, 1)"),
                   help="shares of the decoder's parameters to remove (default %(default)s; the first gets every seed)")
    p.add_argument("--seeds", default="0,1,2", type=csv_list(int, lambda s: s >= 0, "seeds (integers >= 0)"))
    p.add_argument("--steps", type=positive(int), default=50)
    p.add_argument("--lr", type=positive(float), default=0.02)
    p.add_argument("--max-windows", type=positive(int), default=256)
    p.add_argument("--eval-seqlen", type=positive(int), default=128)
    p.add_argument("--init-batches", type=positive(int), default=16)
    p.add_argument("--layer-init-batches", type=positive(int), default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--only", action="append", metavar="ROW", help="run only this row's cells (repeat for more)")
    p.add_argument("--out", default=str(ROOT / "bench" / "results" / "compare_table"))
    p.add_argument("--list", action="store_true")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--write-docs", action="store_true",
                   help="also put the table into docs/results.md, between its compare_table markers")
    args = p.parse_args()
    args.gumbel_lr = args.lr  # (paper_tables' cell settings read it; no Gumbel row here)
    out = Path(args.out)
    cells_dir = out / "cells"
    cells_dir.mkdir(parents=True, exist_ok=True)
    todo = cells(args.rates, args.seeds)
    rows = {c.row for c in todo}
    for r in args.only or []:
        if r not in rows:
            raise SystemExit(f"compare_table.py: error: --only: no row {r!r}; rows: {'; '.join(sorted(rows))}")
    queue = order([c for c in todo if not args.only or c.row in args.only], args.rates, args.seeds)
    if args.list:
        for c in queue:
            done = (cells_dir / cell_key(c, args) / "results.json").exists()
            print(f"{'done' if done else 'todo':4} | {c.row} | {c.rate:.0%} | seed {c.seed} | {cell_key(c, args)}")
        return
    if not args.report_only:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        os.environ.setdefault("PG_PRUNE_METRIC_CACHE", str(out / "metric_cache"))  # cells share SLEB's order
        model_dir = plain_copy(args.model, out / "model")
        for c in queue:
            timed_cell(c, args, model_dir, cells_dir)
            (out / "table.md").write_text(report(todo, args, cells_dir))
    text = report(todo, args, cells_dir)
    (out / "table.md").write_text(text)
    (out / TIMES_FILE).write_text(json.dumps(cell_times(cells_dir), indent=1, sort_keys=True) + "\n")
    (out / CONFIGS_FILE).write_text(json.dumps(cell_configs(cells_dir), indent=1, sort_keys=True) + "\n")
    if args.write_docs:
        write_docs(text, ROOT / "docs" / "results.md")
    print(text)


def write_docs(table: str, doc: Path) -> None:
    """The table (its protocol line and rows; the per-cell list stays in table.md) between the markers."""
    start, end = "<!-- compare_table -->", "<!-- /compare_table -->"
    body = table.split("\nRemoved (parameters")[0].strip()
    text = doc.read_text()
    head, rest = text.split(start, 1)
    doc.write_text(f"{head}{start}\n{body}\n{end}{rest.split(end, 1)[1]}")


if __name__ == "__main__":
    run(main)
