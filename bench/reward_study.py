"""Which reward and which calibration text make the optimiser's choices transfer (issue 50)? One resumable bench,
one thread a cell; every cell records its CPU seconds.

Protocol: the default model (SmolLM2-135M-Instruct), the default run's settings (the joint preset: whole layers,
KV groups and channels on one parameter budget), calibration on two C4 files (2,000 documents: the first 1,000 of
c4-train.00000 and the 1,000 of the redpajama sample); the third C4 file (300 documents) is held out and never read
by a run. Three held-out measures, each of the mask as it would be exported (refit):
- WikiText-2 raw test, the first 256 windows of 128 tokens (the tables' protocol);
- held-out C4: the first 128 windows of 128 tokens of the 300 held-out documents;
- zero-shot (with --zeroshot): the mean accuracy over PIQA, HellaSwag, WinoGrande and ARC-Easy, 500 examples each
  (lm-evaluation-harness's tasks, engine/tools/zeroshot.py).

Stages:

    oneshot  the joint's layer-count choice, per (rate, seed, calibration source): every candidate count's mask
             (k layers out, FLAP's widths to the budget) scored on the mix batches by CE and by KL to the dense
             model, each unrefit (the compensation only, as the engine's mix scores it by default) and refit; each
             of the four rules' choice is then evaluated on the held-out measures.
    pg       a policy-gradient run (`python -m engine prune` with the default preset) with one reward and source and
             a step count, then its exported mask on the held-out measures. Resumes a stopped run (--resume).
    curve    a finished PG cell's hard mask every --every steps (metrics.jsonl), refit and measured on WikiText and
             held-out C4, with the units it changed from the init mask and the CPU minutes to reach it (step 0:
             the init mask; a mask the steps did not change is not evaluated again): the figure's points.
    zeroshot-more  a finished PG cell's init and export on each zero-shot task's next examples (--start 500,
             --count 1000), scored example by example: the paired change of the zero-shot mean with its 95 %
             bootstrap interval, and the change over these and the first 500 together (zeroshot_more.json).
    heldout  any finished run's export (RUN: `python -m engine prune ... --out RUN`) on the same held-out measures,
             into RUN/heldout.json: the default command's runs beside the cells.
    report   the tables (markdown) and the figure (held-out quality against CPU minutes) from the cells done.

    OMP_NUM_THREADS=1 python bench/reward_study.py oneshot --rate 0.3 --seed 0 --source data [--zeroshot]
    OMP_NUM_THREADS=1 python bench/reward_study.py pg --rate 0.3 --seed 0 --source data --reward kl --steps 40
    OMP_NUM_THREADS=1 python bench/reward_study.py curve --rate 0.3 --seed 0 --source data --reward kl --steps 40
    OMP_NUM_THREADS=1 python bench/reward_study.py pg --rate 0.3 --seed 0 --source data --reward kl --budget 30
    OMP_NUM_THREADS=1 python bench/reward_study.py heldout runs/r50-s0 runs/r50-s0-data --zeroshot
    python bench/reward_study.py report

Cells: bench/results/reward_study/{oneshot,pg}/...; a rerun skips what a cell holds.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from cli_common import ROOT, positive, run

OUT = ROOT / "bench" / "results" / "reward_study"
SHARED = ROOT.parent / "shared" / "data"
CALIB_FILES = ("c4-train.00000-of-01024.first1000.json.gz", "c4-en.redpajama-sample2.1000.json.gz")
HELDOUT_C4 = "c4-en.llamafactory-c4_demo.300.text-only.json.gz"
ZEROSHOT_TASKS = ("piqa", "hellaswag", "winogrande", "arc_easy")
ZEROSHOT_LIMIT = 500
C4_WINDOWS = 128
RULES = ("ce", "kl", "ce-refit", "kl-refit")  # the mix's score: reward, scored unrefit or refit


def calib_folder() -> Path:
    """A folder of links to the two calibration files (made here, not tracked: the data stay in shared/)."""
    folder = OUT / "calib"
    folder.mkdir(parents=True, exist_ok=True)
    for name in CALIB_FILES:
        link = folder / name
        if not link.is_symlink():
            link.symlink_to((SHARED / "c4" / name).resolve())
    return folder


# a PG cell's variant of the default run: its flags (the cell's name ends in -VARIANT unless it is the default)
VARIANTS = {
    "": [],
    "step-refit": ["--step-refit"],  # every sampled mask scored under its own least-squares refit
    # a sharp init: sigmoid-cut (T 0.1) leaves only the units near the metric's cut uncertain, so a sample flips
    # about 5 % of them where sigmoid-norm's flips a quarter (its samples score far from the mask they vary)
    "sharp": ["--prob-map", "sigmoid-cut"],
    "sharp-step-refit": ["--prob-map", "sigmoid-cut", "--step-refit"],
    # PG over each layer's allocation only (engine/algo/methods/alloc.py): one logit offset per (unit type, layer), about
    # 54 on the default model where single units are 47k; every sample the budget's exact cut of the shifted scores
    "alloc": ["--method", "pg-alloc"],
    "alloc-step-refit": ["--method", "pg-alloc", "--step-refit"],
    # narrower offsets: sigma 0.5 drew samples 0.1-2.2 nats of refit KL above the init (session 51); 0.1 moves about
    # 110 of a layer's 1,176 channels a sample
    "alloc-s0.1-step-refit": ["--method", "pg-alloc", "--alloc-sigma", "0.1", "--step-refit"],
}


def cell_argv(rate: float, seed: int, source: str, reward: str = "ce", extra: list[str] = ()) -> list[str]:
    # (--refit-stream own: the refit's statistics on the stream every cell of the study read before the one
    # statistics pass made the init stream the default; --pass-dtype float32 and --reconstruct-batches 64: what
    # every cell ran, on any CPU, before they changed)
    return ["prune", "--prune-ratio", str(rate), "--seed", str(seed), "--calib", str(calib_folder()),
            "--calib-source", source, "--reward", reward, "--refit-stream", "own", "--pass-dtype", "float32",
            "--reconstruct-batches", "64", *extra]


def pg_name(args) -> str:
    """A PG cell's folder: rate, seed, reward, source, its length (the steps, or b and the --budget minutes), variant."""
    length = f"b{args.budget:g}" if getattr(args, "budget", None) else str(args.steps)
    return (f"r{round(args.rate * 100)}-s{args.seed}-{args.reward}-{args.source}-{length}"
            + (f"-{args.variant}" if args.variant else ""))


def length_argv(args) -> list[str]:
    """A PG cell's length: --steps, or --time-budget (the run's wall minutes: its CPU minutes at one thread)."""
    budget = getattr(args, "budget", None)
    return ["--time-budget", f"{budget:g}"] if budget else ["--steps", str(args.steps)]


def cell_config(argv: list[str]):
    from engine.cli import _config_from_args, parse_args

    return _config_from_args(parse_args(argv))


def heldout_c4_windows(tokenizer):
    from engine.data.text import eval_windows, load_calibration_texts

    texts, _ = load_calibration_texts(str(SHARED / "c4" / HELDOUT_C4))
    return eval_windows(tokenizer, "\n\n".join(texts), 128, C4_WINDOWS)


def windows_ppl(model, windows, loss) -> float:
    from engine.algo.evaluate import perplexity

    return perplexity(model, windows, 8, False, loss)


def harness(model, tokenizer, tasks, **kw) -> dict:
    """lm-eval on a loaded model over `tasks` (their configs written to a scratch folder), batches of 8; `kw`: the
    documents (limit= or samples=) and log_samples."""
    import tempfile

    from engine.tools.zeroshot import evaluate_model, write_task_dir

    with tempfile.TemporaryDirectory() as tmp:
        task_dir = write_task_dir(Path(tmp) / "tasks", tuple(tasks))
        return evaluate_model(model, tokenizer, list(tasks), task_dir, batch_size=8, **kw)


def zeroshot_mean(model, tokenizer) -> dict:
    from engine.tools.zeroshot import average, summarize

    per_task = summarize(harness(model, tokenizer, ZEROSHOT_TASKS, limit=ZEROSHOT_LIMIT), ZEROSHOT_TASKS)
    return {"per_task": per_task, "mean": average(per_task)}


def measure_refit(run_, masks: dict, what: str, c4, zeroshot: bool, into: dict) -> float:
    """A mask's held-out measures as it would be exported (the run's refit of it), each one `into` lacks: WikiText
    (the run's windows), held-out C4 and, with zeroshot, the zero-shot mean. Returns the CPU seconds spent."""
    with run_.masks.weights(masks) as fill:
        t0 = cpu()
        if "wikitext" not in into:
            into["wikitext"] = run_.masks.masked_perplexity(masks, f"{what} (refit)", fill)
        if "c4" not in into:
            def loss(model, b):
                return run_.ctx.losses({u: m[None] for u, m in masks.items()}, b, fill).expand(b.shape[0])
            into["c4"] = windows_ppl(run_.model, c4, loss)
        if zeroshot and "zeroshot" not in into:
            with run_.ctx.masked(masks, fill):
                into["zeroshot"] = zeroshot_mean(run_.model, run_.tokenizer)
        return cpu() - t0


def measured_line(ev: dict) -> str:
    return (f"WikiText {ev['wikitext']:.2f}, held-out C4 {ev['c4']:.2f}"
            + (f", zero-shot {ev['zeroshot']['mean']:.4f}" if "zeroshot" in ev else ""))


def cpu() -> float:
    return time.process_time()


def save(path: Path, data: dict) -> None:
    from engine.storage.io import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def complete(done: dict, zeroshot: bool) -> bool:
    """A one-shot cell holds every rule's choice and each choice's held-out measures."""
    wanted = ("wikitext", "c4") + (("zeroshot",) if zeroshot else ())
    return "chosen" in done and all(all(m in done["evals"].get(str(k), {}) for m in wanted)
                                    for k in set(done["chosen"].values()))


# --- oneshot ----------------------------------------------------------------------------------------------
def oneshot(args) -> None:
    import torch

    import engine.run.initialise as initialise
    from engine.algo.context import KEEP
    from engine.algo.evaluate import _row_losses
    from engine.algo.joint import candidate_scores, layer_counts
    from engine.run.loop import PruneRun
    from engine.run.initialise import fresh_state
    from engine.algo.rewards import DenseKL, logits_of, row_kl

    name = f"r{round(args.rate * 100)}-s{args.seed}-{args.source}"
    dest = OUT / "oneshot" / f"{name}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    done = json.loads(dest.read_text()) if dest.exists() else {"cell": name, "rate": args.rate, "seed": args.seed,
                                                                  "source": args.source, "counts": {}, "evals": {}}
    if complete(done, args.zeroshot):
        print(f"{name}: done", flush=True)
        return
    config = cell_config(cell_argv(args.rate, args.seed, args.source, extra=["--out", str(OUT / "unused")]))
    done["cpu_seconds_before"] = done.get("cpu_seconds", 0.0)
    t_cpu = cpu()

    def mix(run_, z, mix_on, keep, comparable=frozenset(), **kw):
        budget, kl = run_.budget, DenseKL(keep=len(mix_on) + 2)
        kl.prepare(run_.model, mix_on)
        done["mix_batches"] = len(mix_on)

        def scores_of(masks, fill) -> tuple[float, float]:
            ce, d = [], []
            with torch.no_grad(), run_.ctx.masked(masks, fill):
                for b in mix_on:
                    logits = logits_of(run_.model, b)
                    ce.append(float(_row_losses(logits, b).double().mean()))
                    d.append(float(row_kl(logits, kl.dense_logp(run_.model, b)).double().mean()))
            return sum(ce) / len(ce), sum(d) / len(d)

        masks_of = {}
        for k in layer_counts(budget.layer_params, budget.decoder - budget.kept_target(keep)):
            masks = run_.masks.hard_masks(candidate_scores(budget, z, run_.layout, k, keep, run_.config, comparable), keep)
            masks_of[k] = masks
            if str(k) in done["counts"]:
                continue
            t0 = cpu()
            ce, d = scores_of(masks, KEEP)
            t1 = cpu()
            with run_.masks.weights(masks) as fill:
                t2 = cpu()  # (the refit of this mask solved: what scoring a mask refit adds to scoring it)
                ce_r, d_r = scores_of(masks, fill)
            done["counts"][str(k)] = {"layers_removed": int((masks[budget.layer_type] <= 0.5).sum()), "ce": ce, "kl": d,
                                      "ce-refit": ce_r, "kl-refit": d_r, "cpu_seconds": cpu() - t0,
                                      "cpu_seconds_scoring": t1 - t0, "cpu_seconds_refit_solve": t2 - t1}
            save(dest, done)
            print(f"{name} k={k}: ce {ce:.4f} kl {d:.4f} | refit ce {ce_r:.4f} kl {d_r:.4f}", flush=True)
        done["chosen"] = {rule: int(min(done["counts"], key=lambda k: (done["counts"][k][rule], int(k))))
                          for rule in RULES}
        save(dest, done)
        c4 = heldout_c4_windows(run_.tokenizer)
        for k in sorted(set(done["chosen"].values())):
            ev = done["evals"].setdefault(str(k), {})
            ev["cpu_seconds"] = ev.get("cpu_seconds", 0.0) + measure_refit(run_, masks_of[k], f"{k} layers out", c4,
                                                                           args.zeroshot, ev)
            save(dest, done)
            print(f"{name} k={k}: {measured_line(ev)}", flush=True)
        raise SystemExit(0)

    import tempfile

    initialise.choose_mix = mix
    with tempfile.TemporaryDirectory() as tmp:
        try:
            r = PruneRun(config, Path(tmp) / "run", log=lambda m: print(m, flush=True))
            fresh_state(r.res, r.call_hooks)
        finally:
            done["cpu_seconds"] = done["cpu_seconds_before"] + cpu() - t_cpu
            done.pop("cpu_seconds_before")
            save(dest, done)


# --- pg ---------------------------------------------------------------------------------------------------
def pg_cell(args) -> None:
    from engine.cli import main as engine_main

    name = pg_name(args)
    folder = OUT / "pg" / name
    folder.parent.mkdir(parents=True, exist_ok=True)
    argv = cell_argv(args.rate, args.seed, args.source, args.reward,
                     [*length_argv(args), "--out", str(folder), *VARIANTS[args.variant]])
    t0, w0 = cpu(), time.monotonic()
    if not (folder / "results.json").is_file():
        resume = (folder / "checkpoint.pt").is_file()
        code = engine_main([*argv, "--resume"] if resume else [*argv, "--overwrite"])
        if code != 0:  # (stopped: its minutes so far are the run's too, counted when it resumes and ends)
            record_session(folder, cpu() - t0, time.monotonic() - w0)
            raise SystemExit(code)
    evaluate_export(folder, args.zeroshot, cpu() - t0)


def record_session(folder: Path, cpu_seconds: float, wall_seconds: float) -> None:
    """A run stopped before its end (SIGTERM: its checkpoint saved): its CPU seconds join heldout.json's
    `cpu_seconds_run` (what the finished run's table and figure count), its wall seconds `wall_seconds_earlier`
    (the sessions before the one whose results.json ends the run: the figure's wall time outside the steps)."""
    dest = folder / "heldout.json"
    ev = json.loads(dest.read_text()) if dest.exists() else {}
    ev["cpu_seconds_run"] = ev.get("cpu_seconds_run", 0.0) + cpu_seconds
    ev["wall_seconds_earlier"] = ev.get("wall_seconds_earlier", 0.0) + wall_seconds
    save(dest, ev)


def evaluate_export(folder: Path, with_zeroshot: bool, cpu_run: float | None) -> None:
    """The held-out measures of a finished run's export (folder/model: sliced, refit), into folder/heldout.json;
    `cpu_run`: the run's CPU seconds in this process (None: a run made elsewhere, whose minutes are not known)."""
    from engine.algo.evaluate import batch_loss
    from engine.model.loading import load_model, resolve_model

    dest = folder / "heldout.json"
    ev = json.loads(dest.read_text()) if dest.exists() else {}
    if cpu_run is not None:
        ev["cpu_seconds_run"] = ev.get("cpu_seconds_run", 0.0) + cpu_run
    res = json.loads((folder / "results.json").read_text())
    ev["wikitext"] = res["ppl_pruned"]
    model, tok = load_model(resolve_model(str(folder / "model")))
    t0 = cpu()
    if "c4" not in ev:
        ev["c4"] = windows_ppl(model, heldout_c4_windows(tok), batch_loss)
    if with_zeroshot and "zeroshot" not in ev:
        ev["zeroshot"] = zeroshot_mean(model, tok)
    ev["cpu_seconds_eval"] = ev.get("cpu_seconds_eval", 0.0) + cpu() - t0
    save(dest, ev)
    print(f"{folder.name}: {measured_line(ev)}", flush=True)


def heldout(args) -> None:
    """Any finished run's export (`python -m engine prune ... --out RUN`) on the study's held-out measures, into
    RUN/heldout.json: the same measures as a PG cell's, for runs made outside the study (the default command)."""
    missing = [str(f) for f in args.runs if not ((f / "results.json").is_file() and (f / "model").is_dir())]
    if missing:
        raise SystemExit(f"error: not a finished run with its export (results.json and model/): {', '.join(missing)}")
    for folder in args.runs:
        evaluate_export(folder, args.zeroshot, None)


# --- curve ------------------------------------------------------------------------------------------------
def step_masks(folder: Path) -> tuple[dict[int, dict], dict]:
    """A PG cell's hard masks by step (metrics.jsonl: the mask each step computed) and its init mask
    (masks.safetensors), as flat 0/1 tensors per unit type."""
    import torch
    from engine.export.artifacts import saved_masks

    from engine.run.state import report_masks

    def flat(rows):
        return {u: torch.tensor([x for layer in r for x in layer], dtype=torch.float32) for u, r in rows.items()}

    by_step = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rep = json.loads(line)
        rows = report_masks(rep)
        if rows is not None:
            by_step[int(rep["step"])] = {"masks": flat(rows), "seconds": float(rep.get("seconds") or 0.0)}
    return by_step, saved_masks(folder / "masks.safetensors", "init_masks")


def changed(a: dict, b: dict) -> int:
    """Units whose keep/drop differs between two hard masks."""
    return int(sum(int(((a[u] > 0.5) != (b[u] > 0.5)).sum()) for u in a))


def finished_cell(args) -> tuple[str, Path]:
    name = pg_name(args)
    folder = OUT / "pg" / name
    if not (folder / "heldout.json").is_file():
        raise SystemExit(f"error: {name} has not finished (run its pg cell first)")
    return name, folder


def at_refit_statistics(args, evaluate) -> None:
    """The cell's own run (its config, a scratch folder) up to its joint mix, where the refit's statistics are
    gathered: there `evaluate(run_)` measures masks as the export would be refit (run_.masks.weights), and the run
    stops (its own mix and steps are not needed)."""
    import tempfile

    import torch

    import engine.run.initialise as initialise
    from engine.run.loop import PruneRun
    from engine.run.initialise import fresh_state

    config = cell_config(cell_argv(args.rate, args.seed, args.source, args.reward,
                                   ["--out", str(OUT / "unused"), *VARIANTS[args.variant]]))

    def stop_after(run_, *a, **kw):
        evaluate(run_)
        raise SystemExit(0)

    initialise.choose_mix = stop_after
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        r = PruneRun(config, Path(tmp) / "run", log=lambda m: print(m, flush=True))
        fresh_state(r.res, r.call_hooks)


def curve(args) -> None:
    """The held-out measures of a PG cell's hard mask every --every steps (refit, as the export would be), with the
    units each step's mask changed from the init mask and the CPU minutes spent to reach it: the figure's points."""
    name, folder = finished_cell(args)
    dest = folder / "curve.json"
    done = json.loads(dest.read_text()) if dest.exists() else {"cell": name, "points": {}}
    by_step, init = step_masks(folder)
    heldout = json.loads((folder / "heldout.json").read_text())
    res = json.loads((folder / "results.json").read_text())
    phases = res.get("seconds_by_phase", {})
    wall_total = float(phases.get("total") or sum(v for k, v in phases.items() if k != "total"))
    wall_total += heldout.get("wall_seconds_earlier", 0.0)  # (a resumed run: results.json has its last session's)
    wall_steps = sum(v["seconds"] for v in by_step.values())
    cpu_per_wall = heldout["cpu_seconds_run"] / wall_total if wall_total else 1.0
    fixed = wall_total - wall_steps  # (the run's wall time outside its steps: metrics, mix, evaluations, export)
    if init:  # (step 0: the init mask, the run's own one-shot joint mix; the baseline every step is judged by)
        by_step[0] = {"masks": init, "seconds": 0.0}
    wanted = [k for k in sorted(by_step) if k % args.every == 0 or k == max(by_step)]
    for k in wanted:
        p = done["points"].setdefault(str(k), {})
        p["units_changed_from_init"] = changed(by_step[k]["masks"], init) if init else None
        p["cpu_minutes"] = cpu_per_wall * (fixed + sum(v["seconds"] for j, v in by_step.items() if j <= k)) / 60
    done["cpu_minutes_init"] = cpu_per_wall * fixed / 60
    save(dest, done)
    last = max(wanted)
    measures = lambda k: ("wikitext", "c4") + (("zeroshot",) if args.zeroshot and k in (0, last) else ())  # noqa: E731
    todo = [k for k in wanted if not all(m in done["points"][str(k)] for m in measures(k))
            and (k == 0 or done["points"][str(k)]["units_changed_from_init"] != 0)]
    for k in wanted:
        print(f"{name} step {k}: {done['points'][str(k)]['units_changed_from_init']} units changed from the init mask",
              flush=True)
    if not todo:
        print(f"{name}: curve done", flush=True)
        return
    def evaluate(run_, *_, **__):
        c4 = heldout_c4_windows(run_.tokenizer)
        for k in todo:
            p = done["points"][str(k)]
            zeroshot = args.zeroshot and k in (0, last)  # (minutes a mask: the ends only)
            p["cpu_seconds_eval"] = p.get("cpu_seconds_eval", 0.0) + measure_refit(run_, by_step[k]["masks"],
                                                                                   f"step {k}", c4, zeroshot, p)
            save(dest, done)
            print(f"{name} step {k}: {measured_line(p)}", flush=True)

    at_refit_statistics(args, evaluate)


# --- zeroshot-more ------------------------------------------------------------------------------------------
# each task's documents (../shared/data/README.md): the further examples stop there
ZEROSHOT_SIZES = {"piqa": 1838, "hellaswag": 10042, "winogrande": 1267, "arc_easy": 2376}


def zeroshot_docs(model, tokenizer, docs: dict[str, list[int]]) -> dict[str, str]:
    """Each named document's score (the task's table metric), by task: a string of "1" (right) and "0" (wrong) in
    the order of `docs` (a few kB a mask where a list of numbers would be a hundred)."""
    from engine.tools.zeroshot import TABLE_METRIC

    raw = harness(model, tokenizer, docs, log_samples=True, samples=docs)
    out = {}
    for t, ids in docs.items():
        score = {int(r["doc_id"]): float(r[TABLE_METRIC[t]]) for r in raw["samples"][t]}
        if sorted(score) != sorted(ids) or not set(score.values()) <= {0.0, 1.0}:
            raise SystemExit(f"error: {t}: the harness scored other documents or non-0/1 scores")
        out[t] = "".join("1" if score[i] else "0" for i in ids)
    return out


def paired_change(before: dict, after: dict, draws: int = 2000, seed: int = 0) -> dict:
    """The change of the zero-shot mean (the mean over tasks of each task's accuracy), in points, from `before` to
    `after` on the same documents (zeroshot_docs' strings of 0 and 1), and its 95 % bootstrap interval (documents
    resampled within each task, the same draw for both: a paired interval)."""
    import random

    rng = random.Random(seed)
    diffs = {t: [int(a) - int(b) for b, a in zip(before[t], after[t], strict=True)] for t in before}
    point = 100.0 * sum(sum(v) / len(v) for v in diffs.values()) / len(diffs)
    boot = []
    for _ in range(draws):
        boot.append(100.0 * sum(sum(rng.choices(v, k=len(v))) / len(v) for v in diffs.values()) / len(diffs))
    boot.sort()
    return {"points": point, "low": boot[int(0.025 * draws)], "high": boot[int(0.975 * draws) - 1],
            "documents": {t: len(v) for t, v in diffs.items()}}


def zeroshot_more(args) -> None:
    """A finished PG cell's init (refit, as the curve's step 0) and export (folder/model) on the zero-shot tasks'
    next --count examples from --start, scored example by example; the paired change and its interval, and the
    change over these and the first ZEROSHOT_LIMIT together, into folder/zeroshot_more.json."""
    import torch

    from engine.model.loading import load_model, resolve_model

    name, folder = finished_cell(args)
    dest = folder / "zeroshot_more.json"
    done = json.loads(dest.read_text()) if dest.exists() else {"cell": name, "scores": {}}
    docs = {t: list(range(args.start, min(args.start + args.count, ZEROSHOT_SIZES[t]))) for t in ZEROSHOT_TASKS}
    if done.get("docs") not in (None, docs):
        raise SystemExit(f"error: {dest} holds other documents; move it away to measure these")
    done["docs"] = docs

    def finish() -> None:
        done["change"] = paired_change(done["scores"]["init"], done["scores"]["export"])
        curve = json.loads((folder / "curve.json").read_text()) if (folder / "curve.json").is_file() else {}
        first = {"init": curve.get("points", {}).get("0", {}).get("zeroshot"),  # (None: no curve stage with it)
                 "export": json.loads((folder / "heldout.json").read_text()).get("zeroshot")}
        if all(first.values()):  # (the first ZEROSHOT_LIMIT of each task, measured by the pg and curve stages)
            def pooled(which):
                return sum((first[which]["per_task"][t]["score"] * first[which]["per_task"][t]["samples"]
                            + done["scores"][which][t].count("1"))
                           / (first[which]["per_task"][t]["samples"] + len(done["scores"][which][t]))
                           for t in ZEROSHOT_TASKS) / len(ZEROSHOT_TASKS)
            done["pooled"] = {w: pooled(w) for w in ("init", "export")}
            done["pooled"]["change_points"] = 100.0 * (done["pooled"]["export"] - done["pooled"]["init"])
        save(dest, done)
        c = done["change"]
        print(f"{name}: zero-shot mean on the further examples {c['points']:+.2f} points "
              f"[{c['low']:+.2f}, {c['high']:+.2f}]" + (f"; with the first {ZEROSHOT_LIMIT}: "
              f"{done['pooled']['change_points']:+.2f}" if "pooled" in done else ""), flush=True)

    t0 = cpu()
    if "export" not in done["scores"]:
        model, tok = load_model(resolve_model(str(folder / "model")))
        with torch.no_grad():
            done["scores"]["export"] = zeroshot_docs(model, tok, docs)
        done["cpu_seconds"] = done.get("cpu_seconds", 0.0) + cpu() - t0
        save(dest, done)
        del model
    if "init" in done["scores"]:
        finish()
        return
    _, init = step_masks(folder)

    def evaluate(run_, *_, **__):
        t1 = cpu()
        with run_.masks.weights(init) as fill:
            # (the refit init's WikiText beside the curve's step 0: the same mask and refit as the cell's)
            done["init_wikitext"] = run_.masks.masked_perplexity(init, "init (refit)", fill)
            with run_.ctx.masked(init, fill):
                done["scores"]["init"] = zeroshot_docs(run_.model, run_.tokenizer, docs)
        done["cpu_seconds"] = done.get("cpu_seconds", 0.0) + cpu() - t1
        finish()

    at_refit_statistics(args, evaluate)


# --- report -----------------------------------------------------------------------------------------------
def report(args) -> None:
    lines = ["## The one-shot stage: the joint's layer count chosen by each rule", "",
             "| cell | rule | layers out | WikiText | held-out C4 | zero-shot mean |", "|---|---|---|---|---|---|"]
    for f in sorted((OUT / "oneshot").glob("*.json")):
        d = json.loads(f.read_text())
        for rule, k in d.get("chosen", {}).items():
            ev = d["evals"].get(str(k), {})
            zs = ev.get("zeroshot", {}).get("mean")
            lines.append(f"| {d['cell']} | {rule} | {d['counts'][str(k)]['layers_removed']} | "
                         f"{ev.get('wikitext', float('nan')):.2f} | {ev.get('c4', float('nan')):.2f} | "
                         f"{'' if zs is None else f'{zs:.4f}'} |")
    lines += ["", "## PG cells", "", "(the init refit: the curve stage's step 0, where it ran; the final mask refit)", "",
              "| cell | steps | init WikiText (unrefit) | init refit: WikiText / held-out C4 | WikiText | held-out C4 "
              "| zero-shot | CPU min |", "|---|---|---|---|---|---|---|---|"]
    for f in sorted((OUT / "pg").glob("*/heldout.json")):
        ev, res = json.loads(f.read_text()), json.loads((f.parent / "results.json").read_text())
        zs = ev.get("zeroshot", {}).get("mean")
        curve = f.parent / "curve.json"
        p0 = json.loads(curve.read_text())["points"].get("0", {}) if curve.is_file() else {}
        init = f"{p0['wikitext']:.2f} / {p0['c4']:.2f}" if "wikitext" in p0 and "c4" in p0 else ""
        lines.append(f"| {f.parent.name} | {res['steps']} | {res['ppl_init']:.2f} | {init} | {ev['wikitext']:.2f} | "
                     f"{ev['c4']:.2f} | {'' if zs is None else f'{zs:.4f}'} | {ev['cpu_seconds_run'] / 60:.1f} |")
    more = sorted((OUT / "pg").glob("*/zeroshot_more.json"))
    if more:
        lines += ["", "## Zero-shot on further examples: the export against its init, document by document", "",
                  "(zeroshot-more: each task's examples from 500 on; the change of the mean over the four tasks, "
                  "with its paired 95 % bootstrap interval; then pooled with the first 500)", "",
                  "| cell | documents | init refit: WikiText (the curve's step 0) | change, points [95 %] | "
                  "pooled with the first 500: init → export (change) |", "|---|---|---|---|---|"]
        for f in more:
            d = json.loads(f.read_text())
            if "change" not in d:
                continue
            c, docs = d["change"], sum(d["change"]["documents"].values())
            pooled = d.get("pooled")
            lines.append(f"| {f.parent.name} | {docs:,} | {d.get('init_wikitext', float('nan')):.2f} | "
                         f"{c['points']:+.2f} [{c['low']:+.2f}, {c['high']:+.2f}] | "
                         + (f"{pooled['init']:.4f} → {pooled['export']:.4f} ({pooled['change_points']:+.2f}) |"
                            if pooled else " |"))
    text = "\n".join(lines) + "\n"
    (OUT / "table.md").write_text(text)
    print(text)
    figure = curve_figure(sorted((OUT / "pg").glob("*/curve.json")))
    if figure:
        (OUT / "curve.svg").write_text(figure)
        print(f"figure: {OUT / 'curve.svg'}")


def cell_group(name: str) -> str:
    """A PG cell's line in the figure: its name without the seed (rate, reward, source, steps, variant)."""
    rate, _seed, reward, source, *rest = name.split("-")
    return f"{rate[1:]} %, {reward}, {source}" + (f", {'-'.join(rest[1:])}" if rest[1:] else "")


def curve_figure(curves: list[Path]) -> str | None:
    """Held-out quality against CPU minutes: each PG cell's measured steps as the change (%) from its own init
    (step 0) on WikiText and on held-out C4, one colour a cell group (its seeds share it). None without two points."""
    from svg_chart import PALETTE, Panel, Series, line_chart

    panels = {m: Panel(t) for m, t in (("wikitext", "WikiText-2, % against the run's init"),
                                       ("c4", "held-out C4, % against the run's init"))}
    colors: dict[str, str] = {}
    for path in curves:
        d = json.loads(path.read_text())
        pts = sorted((int(k), v) for k, v in d["points"].items())
        group = cell_group(path.parent.name)
        color = colors.setdefault(group, PALETTE[len(colors) % len(PALETTE)])
        for m, panel in panels.items():
            if not pts or m not in pts[0][1]:
                continue
            base = pts[0][1][m]
            series = [(v["cpu_minutes"], 100.0 * (v[m] / base - 1.0)) for _, v in pts if m in v and "cpu_minutes" in v]
            if len(series) > 1:
                panel.series.append(Series(group, series, color))
    if not any(p.series for p in panels.values()):
        return None
    return line_chart(list(panels.values()), "CPU minutes of the run (one thread)", "% change, refit")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    for stage in ("oneshot", "pg", "curve", "zeroshot-more"):
        s = sub.add_parser(stage)
        s.add_argument("--rate", type=positive(float), default=0.3)
        s.add_argument("--seed", type=int, default=0)
        s.add_argument("--source", choices=("data", "self", "mix"), default="data")
        if stage != "zeroshot-more":
            s.add_argument("--zeroshot", action="store_true", help="also the zero-shot mean (minutes a mask)")
        if stage in ("pg", "curve", "zeroshot-more"):
            s.add_argument("--reward", choices=("ce", "kl"), default="kl")
            s.add_argument("--steps", type=positive(int), default=40)
            s.add_argument("--budget", type=positive(float), default=None, metavar="MINUTES",
                           help="instead of --steps: the run's --time-budget (wall minutes: CPU minutes at one "
                                "thread, on a core of its own); the cell's name holds b<MINUTES>")
            s.add_argument("--variant", choices=tuple(VARIANTS), default="",
                           help="the default run's settings, or a variant of them: " + ", ".join(v for v in VARIANTS if v))
        if stage == "curve":
            s.add_argument("--every", type=positive(int), default=10, help="evaluate the mask of every N-th step")
        if stage == "zeroshot-more":
            s.add_argument("--start", type=int, default=ZEROSHOT_LIMIT, help="the first further example of each task")
            s.add_argument("--count", type=positive(int), default=1000, help="further examples a task (fewer where "
                           "a task has fewer)")
    s = sub.add_parser("heldout")
    s.add_argument("runs", nargs="+", type=Path, metavar="RUN", help="a finished run's folder (results.json, model/)")
    s.add_argument("--zeroshot", action="store_true", help="also the zero-shot mean (minutes a run)")
    sub.add_parser("report")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PG_PRUNE_METRIC_CACHE", str(OUT / "metric_cache"))  # (the cells of one seed share metrics)
    {"oneshot": oneshot, "pg": pg_cell, "curve": curve, "zeroshot-more": zeroshot_more, "heldout": heldout,
     "report": report}[args.stage](args)


if __name__ == "__main__":
    run(main)
