"""The confirmation set (issue 64; docs/results.md, "Two sets"): does a variant's gain hold where nobody tuned?

A cell is one (set, rate, seed) of the default run as a user types it, with --calib naming the set's C4 file:
- `init`: `python -m engine prune --prune-ratio R --seed S --calib FILE --method flap` (the default preset's
  one-shot init alone: the joint mix, refit, no step);
- `pg24`: the same with `--steps 24` instead of `--method flap` (today's default method, 24 steps).
Each export (RUN/model) is then measured window by window and example by example into RUN/measures.json:
WikiText-2 test and validation (256 x 128), held-out C4 (the 300 documents no run reads, 128 x 128), the
four-task zero-shot mean (500 each) and LAMBADA (500): the confirmation set's measures; a tuning cell is measured
on the tuning set's judges only (WikiText-2 test, held-out C4, the zero-shot mean). The report pairs each run with
its init: the change of each measure with its paired 95 % bootstrap interval (the same windows or examples resampled for both).

    OMP_NUM_THREADS=1 python bench/confirm.py cell --rate 0.3 --seed 3            # init, pg24, both measured
    OMP_NUM_THREADS=1 python bench/confirm.py cell --rate 0.5 --seed 3 --only init
    OMP_NUM_THREADS=1 python bench/confirm.py cell --rate 0.3 --seed 3 --without zeroshot   # the hour-long one later
    OMP_NUM_THREADS=1 python bench/confirm.py cell --rate 0.3 --seed 0 --only init-bi      # a variant of the init
    OMP_NUM_THREADS=1 python bench/confirm.py dense                               # the dense model's measures
    OMP_NUM_THREADS=1 python bench/confirm.py checks --rate 0.3 --seed 0          # the final-choice rules' checks
    OMP_NUM_THREADS=1 python bench/confirm.py rule --rate 0.3 --seed 0            # and each rule's choice measured
    python bench/confirm.py report                                                # the tables, running nothing

The sets: `confirm` (seeds 3-5, the second C4 file) and `tune` (seeds 0-2, the first C4 file). A cell refuses a
seed of the other set. Cells: bench/results/confirm/<set>/r<rate>-s<seed>-<run>/; a rerun skips what a cell holds
and resumes a stopped run (--resume).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import random
import time
from pathlib import Path

from cli_common import ROOT, positive, run

OUT = ROOT / "bench" / "results" / "confirm"
SHARED = ROOT.parent / "shared" / "data"
SETS = {  # the seeds and the calibration file of each set (docs/results.md, "Two sets")
    "tune": ((0, 1, 2), "c4-train.00000-of-01024.first1000.json.gz"),
    "confirm": ((3, 4, 5), "c4-en.redpajama-sample2.1000.json.gz"),
}
HELDOUT_C4 = "c4-en.llamafactory-c4_demo.300.text-only.json.gz"
WIKI_WINDOWS, C4_WINDOWS, SEQLEN = 256, 128, 128
ZEROSHOT_TASKS = ("piqa", "hellaswag", "winogrande", "arc_easy")
ZEROSHOT_LIMIT = 500
LAMBADA = "lambada_openai"
PERPLEXITIES = ("wikitext_test", "wikitext_valid", "c4")
MEASURES = {  # each set's judges: the tuning set never measures the confirmation set's (nothing is chosen by them)
    "tune": ("wikitext_test", "c4", "zeroshot"),
    "confirm": (*PERPLEXITIES, "zeroshot", "lambada"),
}
RUNS = {  # a cell's runs: the flags after the default command's
    "init": ["--method", "flap"],
    "pg24": ["--steps", "24"],
    # a variant of the init, run with --only and reported against it (issue 65: the layer order from block influence,
    # one forward, instead of Layerwise-PPL's one forward per layer)
    "init-bi": ["--method", "flap", "--layer-init", "block-influence"],
    # (issue 65: the refit's statistics on 96 batches instead of 128, a quarter of the statistics pass off a first run)
    "init-b96": ["--method", "flap", "--reconstruct-batches", "96"],
    # (issue 65: the own text sampled 128 at a time in bfloat16, 3.3x faster: bench/self_text_speed.py; 50 % only;
    # the default's sampler since 2026-12-06, so an `init` cell at 50 % run after then samples this text too, while
    # the cells before it sampled with float32 generate, 32 a batch: docs/results.md, "The own text's sampler")
    "init-gen": ["--method", "flap", "--self-batch", "128", "--self-dtype", "auto"],
    # (issue 65: init-gen's control, another sample from today's sampler itself (float32, transformers' generate),
    # its documents grouped 64 a batch instead of 32, so each batch's seed draws other documents: how far another
    # sample of the same text moves the 50 % init, the noise floor under init-gen's comparison)
    "init-b64text": ["--method", "flap", "--self-batch", "64"],
    # (issue 65: the joint mix's candidates scored on 4 calibration batches instead of 8, about half its 44-90 s)
    "init-m4": ["--method", "flap", "--mix-batches", "4"],
    # (issue 64: does the drift follow the step size? 24 steps at half pg-alloc's step alpha, 0.125 for 0.25: its
    # step is scale-free, so --lr would change nothing and is refused)
    "pg24-a0125": ["--steps", "24", "--alloc-step", "0.125"],
    # (issue 64: does the drift come from the text the steps fit? The init and 24 steps on the mixture of the C4
    # file and the dense model's own text (`--calib-source mix`) instead of the own text alone at 50 %; the steps
    # are reported against the mixture's own init, VARIANT_BASES)
    "init-mix": ["--method", "flap", "--calib-source", "mix"],
    "pg24-mix": ["--steps", "24", "--calib-source", "mix"],
    # (issue 64, chosen on the tuning seeds: the steps on the mixture never drifted from their init, 3 seeds, while the
    # mixture's init was worse than the own text's on 2 of them; so today's init on its own text, and the steps and
    # their best-val check on the mixture: `--step-calib-source mix`; reported against today's init)
    "pg24-mixsteps": ["--steps", "24", "--step-calib-source", "mix"],
    # (the refit's ridge at 0.01 instead of 0.1: -0.4 to -0.8 % on WikiText test on the tuning seeds' fixed init
    # masks, bench/refit_batches.py --ridges; the whole run here, its joint mix scored on that refit too)
    "init-r001": ["--method", "flap", "--reconstruct-ridge", "0.01"],
}
# the phase each variant is about (its wall seconds against the init's in the report)
VARIANT_PHASES = {"init-bi": "init metric", "init-b96": "statistics", "init-gen": "calibration text",
                  "init-b64text": "calibration text",
                  "init-m4": "joint mix", "pg24-a0125": "steps", "init-r001": "refit",
                  "init-mix": "calibration text", "pg24-mix": "steps", "pg24-mixsteps": "steps"}
# the runs a variant is reported against where it is not the init alone (the steps on another text: that text's
# init, the rule's pair; then today's default, the init on its own text: the candidate's second judge)
VARIANT_BASES = {"pg24-mix": ("init-mix", "init")}
CELL_RUNS = ("init", "pg24")  # what a cell runs unless --only names one
VARIANTS = tuple(r for r in RUNS if r not in CELL_RUNS)
DRAWS = 2000


def cpu() -> float:
    return time.process_time()


def save(path: Path, data: dict) -> None:
    from engine.storage.io import atomic_write_text

    atomic_write_text(path, json.dumps(data, indent=1) + "\n")


def load(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


# --- the held-out measures ------------------------------------------------------------------------------------
def eval_texts() -> dict[str, str]:
    """Each perplexity's text: WikiText-2 raw test (the tables' file), validation (the tokenized release, read whole,
    as the raw test is), and the held-out C4 documents joined by blank lines."""
    from engine.data.text import load_calibration_texts, load_eval_text

    texts = {"wikitext_test": load_eval_text(str(SHARED / "wikitext-2-raw-v1" / "wiki.test.raw"))[0]}
    with gzip.open(SHARED / "wikitext-2-v1-tokens" / "wiki.valid.tokens.gz", "rt", encoding="utf-8") as fh:
        texts["wikitext_valid"] = fh.read()
    texts["c4"] = "\n\n".join(load_calibration_texts(str(SHARED / "c4" / HELDOUT_C4))[0])
    return texts


def window_losses(model, windows) -> list[float]:
    """Each window's mean token cross-entropy (nats), batches of 8."""
    import torch

    from engine.algo.evaluate import batch_loss

    with torch.no_grad():
        return [float(x) for i in range(0, windows.shape[0], 8) for x in batch_loss(model, windows[i:i + 8]).double()]


def example_scores(model, tokenizer, tasks) -> dict[str, str]:
    """Each task's first examples scored one by one: a string of 1 (right) and 0 (wrong)."""
    from reward_study import zeroshot_docs

    return zeroshot_docs(model, tokenizer, {t: list(range(ZEROSHOT_LIMIT)) for t in tasks})


def measure(model_dir: str, dest: Path, wanted=MEASURES["confirm"]) -> dict:
    """A model's measures among `wanted`, each one dest lacks (saved as it is done: a stopped measure resumes)."""
    import torch

    from engine.data.text import eval_windows
    from engine.model.loading import load_model, resolve_model

    done = load(dest)
    if all(k in done for k in wanted):
        return done
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model, tok = load_model(resolve_model(model_dir))
    model.eval()
    texts = None
    for name in PERPLEXITIES:
        if name in done or name not in wanted:
            continue
        texts = texts or eval_texts()
        t0 = cpu()
        windows = eval_windows(tok, texts[name], SEQLEN, WIKI_WINDOWS if name != "c4" else C4_WINDOWS)
        done[name] = {"losses": window_losses(model, windows), "cpu_seconds": cpu() - t0}
        save(dest, done)
        print(f"{dest.parent.name}: {name} {ppl(done[name]['losses']):.2f}", flush=True)
    for name, tasks in (("lambada", (LAMBADA,)), ("zeroshot", ZEROSHOT_TASKS)):  # (LAMBADA: minutes; zero-shot: an hour)
        if name in done or name not in wanted:
            continue
        t0 = cpu()
        with torch.no_grad():
            done[name] = {"scores": example_scores(model, tok, tasks), "cpu_seconds": cpu() - t0}
        save(dest, done)
        print(f"{dest.parent.name}: {name} {accuracy(done[name]['scores']):.4f}", flush=True)
    return done


def ppl(losses: list[float]) -> float:
    return math.exp(sum(losses) / len(losses))


def accuracy(scores: dict[str, str]) -> float:
    """The mean over tasks of each task's accuracy."""
    return sum(s.count("1") / len(s) for s in scores.values()) / len(scores)


# --- paired intervals (pure) ------------------------------------------------------------------------------------
def ppl_change_draws(before: list[float], after: list[float], draws: int = DRAWS, seed: int = 0,
                     block: int = 1) -> list[float]:
    """The perplexity's change (%) from `before` to `after` (each window's mean loss, the same windows), then the
    same change on `draws` resamplings of the windows (one draw resamples both: a paired bootstrap). [0]: the point.
    block > 1: a moving-block bootstrap, each draw made of runs of `block` consecutive windows (neighbouring windows
    share an article, so single windows are not independent draws; the blocks keep that dependence)."""
    if len(before) != len(after):
        raise ValueError("the two runs were measured on different windows")
    if not 1 <= block <= len(before):
        raise ValueError(f"block must be between 1 and the {len(before)} windows, got {block}")
    rng = random.Random(seed)
    d = [a - b for b, a in zip(before, after)]
    n = len(d)
    out = [100.0 * (math.exp(sum(d) / n) - 1.0)]
    starts = range(n - block + 1)
    for _ in range(draws):
        if block == 1:
            s = rng.choices(d, k=n)
        else:
            s = []
            while len(s) < n:
                i = rng.choice(starts)
                s += d[i:i + block]
            s = s[:n]
        out.append(100.0 * (math.exp(sum(s) / n) - 1.0))
    return out


def acc_change_draws(before: dict[str, str], after: dict[str, str], draws: int = DRAWS, seed: int = 0) -> list[float]:
    """The change (points) of the mean over tasks of each task's accuracy, on the same examples; then the same on
    `draws` resamplings (examples within each task, one draw for both runs). [0]: the point."""
    if {t: len(v) for t, v in before.items()} != {t: len(v) for t, v in after.items()}:
        raise ValueError("the two runs were scored on different examples")
    rng = random.Random(seed)
    diffs = {t: [int(a) - int(b) for b, a in zip(before[t], after[t])] for t in before}

    def mean(per_task):
        return 100.0 * sum(sum(v) / len(v) for v in per_task.values()) / len(per_task)

    return [mean(diffs)] + [mean({t: rng.choices(v, k=len(v)) for t, v in diffs.items()}) for _ in range(draws)]


def interval(draws: list[float]) -> tuple[float, float, float]:
    """The point ([0]) and the 95 % interval of the draws after it."""
    rest = sorted(draws[1:])
    return draws[0], rest[int(0.025 * len(rest))], rest[int(0.975 * len(rest)) - 1]


def mean_draws(per_seed: list[list[float]]) -> list[float]:
    """The mean over seeds of each draw (each seed's draws independent): the mean change and its interval."""
    return [sum(x) / len(x) for x in zip(*per_seed)]


def changes(before: dict, after: dict, names=MEASURES["confirm"], block: int = 1) -> dict[str, list[float]]:
    return {m: (ppl_change_draws(before[m]["losses"], after[m]["losses"], block=block) if m in PERPLEXITIES
                else acc_change_draws(before[m]["scores"], after[m]["scores"])) for m in names}


# --- cells ------------------------------------------------------------------------------------------------------
def set_of(seed: int) -> str:
    return next(name for name, (seeds, _) in SETS.items() if seed in seeds)


def cell_dir(rate: float, seed: int, which: str) -> Path:
    return OUT / set_of(seed) / f"r{round(rate * 100)}-s{seed}-{which}"


def beside(folder: Path, suffix: str) -> Path:
    """A cell's own file beside its run folder (--overwrite empties the run's folder): r30-s3-pg24<suffix>."""
    return folder.parent / f"{folder.name}{suffix}"


def cell_measures(rate: float, seed: int, which: str) -> dict:
    """A cell run's measures ({} before any)."""
    return load(beside(cell_dir(rate, seed, which), ".measures.json"))


def run_argv(rate: float, seed: int, which: str, folder: Path) -> list[str]:
    calib = SHARED / "c4" / SETS[set_of(seed)][1]
    return ["prune", "--prune-ratio", f"{rate:g}", "--seed", str(seed), "--calib", str(calib), *RUNS[which],
            "--out", str(folder)]


def cell(args) -> None:
    from engine.cli import main as engine_main

    if not any(args.seed in seeds for seeds, _ in SETS.values()):
        raise SystemExit(f"error: seed {args.seed} is in no set ({', '.join(f'{k}: {v[0]}' for k, v in SETS.items())})")
    for which in ([args.only] if args.only else CELL_RUNS):
        folder = cell_dir(args.rate, args.seed, which)
        book = beside(folder, ".cell.json")
        info = load(book)
        if not (folder / "results.json").is_file():
            t0, w0 = cpu(), time.monotonic()
            resume = (folder / "checkpoint.pt").is_file()
            argv = run_argv(args.rate, args.seed, which, folder)
            code = engine_main([*argv, "--resume"] if resume else [*argv, "--overwrite"])
            info["argv"] = argv
            info["cpu_seconds_run"] = info.get("cpu_seconds_run", 0.0) + cpu() - t0
            info["wall_seconds_run"] = info.get("wall_seconds_run", 0.0) + time.monotonic() - w0
            save(book, info)
            if code != 0:
                raise SystemExit(code)
        t0 = cpu()
        wanted = tuple(m for m in MEASURES[set_of(args.seed)] if m not in args.without)
        dest = beside(folder, ".measures.json")
        if not all(m in load(dest) for m in wanted):
            measure(str(ensure_export(folder)), dest, wanted)
        info["cpu_seconds_measure"] = info.get("cpu_seconds_measure", 0.0) + cpu() - t0
        res = load(folder / "results.json")
        info.update({k: res.get(k) for k in ("steps", "ppl_dense", "ppl_init", "ppl_pruned", "params_pruned")})
        save(book, info)
    if not args.only:
        same_init(args.rate, args.seed)


def same_init(rate: float, seed: int) -> None:
    """Whether the pg run's init mask (masks.safetensors' init_masks) is the init run's mask, unit for unit: the
    pair is like for like only then. Recorded in the pg cell's book."""
    from engine.export.artifacts import saved_masks

    init, pg = cell_dir(rate, seed, "init"), cell_dir(rate, seed, "pg24")
    try:
        mask_a = saved_masks(init / "masks.safetensors")
        mask_b = saved_masks(pg / "masks.safetensors", "init_masks")
    except (OSError, FileNotFoundError):
        return
    same = same_mask(mask_a, mask_b)
    book = beside(pg, ".cell.json")
    info = load(book)
    info["init_is_the_init_runs_mask"] = same
    save(book, info)
    print(f"r{round(rate * 100)}-s{seed}: the pg run's init {'is' if same else 'is NOT'} the init run's mask", flush=True)


def dense(args) -> None:
    from engine.model.loading import DEFAULT_MODEL

    OUT.mkdir(parents=True, exist_ok=True)
    measure(DEFAULT_MODEL, OUT / "dense.measures.json")


# --- the final choice: checks of each validated step's mask, and rules that choose among them -------------------
OTHER_DOCS = 32  # the other kind of text's documents (the dense model's own text: 32 x seqlen tokens, cached)
RULES = ("calib", "agree", "other")


def choose(checks: dict[int, dict], rule: str, margin: float = 0.01) -> int:
    """The step whose mask a final-choice rule exports, from each validated step's held-out values (lower is
    better; step 0: the init mask): `calib`, best-val as the engine runs it (a later step replaces the best only
    below it by more than `margin`, relative, on the calibration text's held-out batches); `other`, the same on the
    other kind of text's; `agree`, only steps below the init by more than `margin` on both, the lowest product of
    the two ratios to the init (none: the init)."""
    steps = sorted(checks)
    if rule in ("calib", "other"):
        best = steps[0]
        for s in steps[1:]:
            if checks[s][rule] < checks[best][rule] * (1.0 - margin):
                best = s
        return best
    if rule != "agree":
        raise ValueError(f"unknown rule {rule!r}")
    init = checks[steps[0]]
    ok = [s for s in steps[1:] if all(checks[s][k] < init[k] * (1.0 - margin) for k in ("calib", "other"))]
    return min(ok, key=lambda s: (checks[s]["calib"] / init["calib"]) * (checks[s]["other"] / init["other"]),
               default=steps[0])


def other_texts(config, texts: list[str], run_) -> tuple[list[str], str]:
    """The held-out text of the other kind than the run calibrates on: the dense model's own text (OTHER_DOCS
    documents of seqlen tokens, from the run's seed: the engine's own-text source and cache) for a C4-calibrated run;
    for an own-text run, the calibration file's held-out C4 documents (every 10th: split_holdout's)."""
    import dataclasses

    from engine.data.calib_sources import CALIB_SOURCES, source_of
    from engine.data.text import split_holdout

    if source_of(config) == "data":
        own = dataclasses.replace(config, self_docs=OTHER_DOCS, self_tokens=config.seqlen)
        docs, _ = CALIB_SOURCES["self"](texts, run_.res.model, run_.res.tokenizer, own, None, log=print)
        return docs, "own text"
    return split_holdout(texts)[1], "held-out C4"


def step_masks(folder: Path) -> dict[int, dict]:
    """A finished run's hard mask at each validated step (metrics.jsonl's lines with a val_ppl) and at step 0 (its
    init mask, masks.safetensors' init_masks), unit type -> 0/1 tensor over all layers."""
    import torch
    from engine.export.artifacts import saved_masks

    from engine.run.state import report_masks

    by_step = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        rep = json.loads(line)
        rows = report_masks(rep)
        if rep.get("val_ppl") is not None and rows is not None:
            by_step[int(rep["step"])] = {u: torch.tensor([x for r in layer_rows for x in r], dtype=torch.float32)
                                         for u, layer_rows in rows.items()}
    by_step[0] = saved_masks(folder / "masks.safetensors", "init_masks")
    return by_step


def same_mask(a: dict, b: dict) -> bool:
    return bool(a) and a.keys() == b.keys() and all(bool(((a[u] > 0.5) == (b[u] > 0.5)).all()) for u in a)


def checks(args) -> None:
    """A finished pg24 cell's validated steps (metrics.jsonl's val_ppl lines) and its init: each hard mask refit as
    exported, scored by the run's reward (its mean KL) on the run's own held-out calibration batches (what best-val
    read) and on as many batches of the other kind of text; then each rule's choice. Into the cell's
    <cell>.checks.json; nothing here reads a set's judges."""
    import tempfile

    import torch

    from engine.settings.config import PruneConfig
    from engine.data.text import CalibrationSampler, load_calibration_texts
    from engine.run.loop import PruneRun
    from engine.run.initialise import fresh_state

    folder = cell_dir(args.rate, args.seed, "pg24")
    dest = beside(folder, ".checks.json")
    if not (folder / "results.json").is_file() or not (folder / "metrics.jsonl").is_file():
        raise SystemExit(f"error: {folder.name} has not finished on this machine (results.json and metrics.jsonl)")
    done = load(dest)
    by_step = step_masks(folder)
    todo = [s for s in sorted(by_step) if str(s) not in done.get("checks", {})]
    config = PruneConfig.load(folder / "config.json")

    def evaluate(run_):
        reward = run_.res.ctx.reward
        texts, _ = load_calibration_texts(config.calib)
        other, what = other_texts(config, texts, run_)
        sampler = CalibrationSampler(run_.res.tokenizer, other, config.seqlen, config.batch_size, config.seed + 3)
        batches = {"calib": run_.res.val_batches, "other": [sampler.next_batch() for _ in range(config.val_batches)]}
        done["other_text"] = what
        for b in batches.values():
            reward.prepare(run_.res.model, b)
        for s in todo:
            masks = by_step[s]
            with run_.res.masks.weights(masks) as fill, run_.res.ctx.masked(masks, fill):
                values = {k: reward.held_out(float(reward.held_out_means(run_.res.model, b)[1])) for k, b in batches.items()}
            done.setdefault("checks", {})[str(s)] = values
            save(dest, done)
            print(f"{folder.name} step {s}: calib {values['calib']:.4f}, other ({what}) {values['other']:.4f}", flush=True)

    if todo:  # (the run's own init again, its refit statistics and held-out batches; no init evaluation)
        import dataclasses

        with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
            run_ = PruneRun(dataclasses.replace(config, eval_init=False), Path(tmp) / "run",
                            log=lambda m: print(m, flush=True))
            fresh_state(run_.res, run_.call_hooks)
            evaluate(run_)
    got = {int(k): v for k, v in load(dest)["checks"].items()}
    done = load(dest)
    done["chosen"] = {rule: choose(got, rule, config.best_val_margin) for rule in RULES}
    res = load(folder / "results.json")
    done["exported_step"] = res.get("mask_step")
    if res.get("mask_step") in by_step:  # (the step lines' masks are the masks a step exports: checked on the export)
        done["step_mask_is_the_export"] = same_mask(by_step[res["mask_step"]], final_masks(folder))
    save(dest, done)
    print(f"{folder.name}: chosen steps {done['chosen']} (the run exported step {done['exported_step']})", flush=True)


def rule(args) -> None:
    """Each rule's chosen step (the cell's checks.json) measured on its set's judges as the run would export it: the
    init's and the exported step's are the cells' own measures; any other step's mask is refit and exported here
    (the run's own statistics) and measured into <cell>-step<N>.measures.json."""
    import tempfile

    folder = cell_dir(args.rate, args.seed, "pg24")
    info = load(beside(folder, ".checks.json"))
    if "chosen" not in info:
        raise SystemExit(f"error: {folder.name} has no checks yet: python bench/confirm.py checks --rate {args.rate:g} "
                         f"--seed {args.seed}")
    todo = sorted({c for c in info["chosen"].values() if c not in (0, info["exported_step"])})
    wanted = tuple(m for m in MEASURES[set_of(args.seed)] if m not in args.without)
    todo = [c for c in todo if not all(m in load(step_measures(folder, c)) for m in wanted)]
    if not todo:
        print(f"{folder.name}: every rule's choice is measured ({info['chosen']})", flush=True)
        return
    by_step = step_masks(folder)
    with tempfile.TemporaryDirectory() as tmp:
        dests = {c: Path(tmp) / f"step{c}" for c in todo}
        export_masks(folder, {dests[c]: by_step[c] for c in todo})
        for c in todo:
            measure(str(dests[c]), step_measures(folder, c), wanted)


def step(args) -> None:
    """One validated step's mask of a finished steps run (pg24 or a variant, --only), exported as the run would
    export it (its config's init and refit statistics) and measured into <cell>-step<N>.measures.json: what a
    final choice that declined (or took) that step would have given."""
    import tempfile

    folder = cell_dir(args.rate, args.seed, args.only)
    by_step = step_masks(folder)
    if args.step not in by_step:
        raise SystemExit(f"error: {folder.name} has no mask of step {args.step} (validated steps: {sorted(by_step)})")
    wanted = tuple(m for m in MEASURES[set_of(args.seed)] if m not in args.without)
    dest = step_measures(folder, args.step)
    if all(m in load(dest) for m in wanted):
        print(f"{folder.name} step {args.step}: measured ({dest})", flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        export_masks(folder, {Path(tmp) / "model": by_step[args.step]})
        measure(str(Path(tmp) / "model"), dest, wanted)


def export_masks(folder: Path, masks_by_dest: dict[Path, dict]) -> None:
    """Each hard mask exported as the run in `folder` exports its final one: the run started again from its
    config (its init and its refit statistics, no evaluation), each mask refit with them and sliced into its dest
    (a finished run's export rebuilt in a later session, whose model/ git does not keep, is its final mask's)."""
    import dataclasses
    import tempfile

    import torch

    from engine.settings.config import PruneConfig
    from engine.export.artifacts import export_pruned
    from engine.run.loop import PruneRun
    from engine.run.initialise import fresh_state

    from engine.algo.context import KEEP

    config = PruneConfig.load(folder / "config.json")
    with tempfile.TemporaryDirectory() as tmp, torch.no_grad():
        run_ = PruneRun(dataclasses.replace(config, eval_init=False), Path(tmp) / "run",
                        log=lambda m: print(m, flush=True))
        fresh_state(run_.res, run_.call_hooks)
        for dest, masks in masks_by_dest.items():
            with run_.res.masks.weights(masks) as fill:
                export_pruned(run_.res.model, run_.res.tokenizer, run_.res.layout, masks, dest,
                              run_.res.ctx.comp_means if fill is KEEP else fill)


def final_masks(folder: Path) -> dict:
    """The mask a finished run exported (masks.safetensors' masks), unit type -> 0/1 tensor over all layers."""
    from engine.export.artifacts import saved_masks

    return saved_masks(folder / "masks.safetensors")


def ensure_export(folder: Path) -> Path:
    """A finished run's model/, rebuilt from its masks when this checkout lacks it (git keeps the masks, not the
    export): folder/model."""
    if not (folder / "model" / "config.json").is_file():
        print(f"{folder.name}: rebuilding its export from masks.safetensors (refit with the run's statistics)",
              flush=True)
        export_masks(folder, {folder / "model": final_masks(folder)})
    return folder / "model"


def step_measures(folder: Path, step: int) -> Path:
    return beside(folder, f"-step{step}.measures.json")


def chosen_measures(rate: float, seed: int, rule_name: str) -> dict:
    """The measures of the mask a final-choice rule exports for this cell ({} until its checks and measures)."""
    folder = cell_dir(rate, seed, "pg24")
    info = load(beside(folder, ".checks.json"))
    if rule_name not in info.get("chosen", {}):
        return {}
    c = info["chosen"][rule_name]
    if c == 0:
        init = cell_dir(rate, seed, "init")
        same = load(beside(folder, ".cell.json")).get("init_is_the_init_runs_mask")
        return load(beside(init, ".measures.json")) if same else {}
    if c == info["exported_step"]:
        return load(beside(folder, ".measures.json"))
    return load(step_measures(folder, c))


# --- report -----------------------------------------------------------------------------------------------------
LABELS = {"wikitext_test": "WikiText test", "wikitext_valid": "WikiText valid", "c4": "held-out C4",
          "zeroshot": "zero-shot mean", "lambada": "LAMBADA"}


def value(m: dict, name: str) -> float:
    return ppl(m[name]["losses"]) if name in PERPLEXITIES else accuracy(m[name]["scores"])


def fmt_value(name: str, v: float) -> str:
    return f"{v:.2f}" if name in PERPLEXITIES else f"{100 * v:.1f} %"


def fmt_change(name: str, draws: list[float]) -> str:
    p, lo, hi = interval(draws)
    unit = " %" if name in PERPLEXITIES else ""
    return f"{p:+.1f}{unit} [{lo:+.1f}, {hi:+.1f}]"


def pair_cells(a: dict, b: dict, c: dict, names) -> str:
    """A table row's cells: each measure before → after (its change and interval), or 'pending' where the change
    is not in yet."""
    return " | ".join(f"{fmt_value(n, value(a, n))} → {fmt_value(n, value(b, n))} ({fmt_change(n, c[n])})" if n in c
                      else "pending" for n in names)


def mean_row(per_seed: list[dict], names, tail: str = "") -> str:
    """A table's mean row: each measure's change averaged over the seeds that have it, with how many ("pending"
    where none has it yet); `tail` closes the row's further columns."""
    means = {n: [c[n] for c in per_seed if n in c] for n in names}
    return "| mean | " + " | ".join(f"{fmt_change(n, mean_draws(means[n]))} (of {len(means[n])})" if means[n]
                                    else "pending" for n in names) + " |" + tail


def report(args) -> None:
    everything = MEASURES["confirm"]
    block = getattr(args, "block", 1)  # (--block: a namespace made by hand may leave it out)
    lines = ["# The confirmation set: the init alone against the default's 24 steps", "",
             "(bench/confirm.py report; every cell: SmolLM2-135M-Instruct, the default preset, `--calib` the set's C4 "
             "file; perplexities 256 x 128 (held-out C4 128 x 128), zero-shot 500 examples a task; each change is "
             "pg24 against its init, with its paired 95 % bootstrap interval"
             + (f", resampling blocks of {block} consecutive windows" if block > 1 else
                ", resampling single windows (`report --block 8`: blocks of windows, wider)") + ")", ""]
    dense_m = load(OUT / "dense.measures.json")
    if all(n in dense_m for n in everything):
        lines += ["dense: " + ", ".join(f"{LABELS[n]} {fmt_value(n, value(dense_m, n))}" for n in everything), ""]
    verdicts = []
    for set_name, (seeds, _) in SETS.items():
        names = MEASURES[set_name]
        for rate in (0.3, 0.5):
            rows, per_seed = [], []
            for seed in seeds:
                a, b = cell_measures(rate, seed, "init"), cell_measures(rate, seed, "pg24")
                have = [n for n in names if n in a and n in b]  # (a measure not in yet: pending, the others shown)
                if not have:
                    rows.append(f"| {seed} | " + " | ".join("not finished" for _ in names) + " |")
                    continue
                c = changes(a, b, have, block)
                per_seed.append(c)
                rows.append(f"| {seed} | {pair_cells(a, b, c, names)} |")
            if not per_seed and not args.all:
                continue
            lines += [f"## {set_name}, {round(rate * 100)} %", "",
                      "| seed | " + " | ".join(LABELS[n] for n in names) + " |", "|---" * (len(names) + 1) + "|", *rows]
            if per_seed:
                lines.append(mean_row(per_seed, names))
                judged = [c for c in per_seed if "wikitext_valid" in c and "c4" in c]
                if set_name == "confirm" and len(judged) == len(seeds):
                    verdicts.append(rule_verdict(rate, judged))
            lines.append("")
    for rule_name in RULES:  # each final-choice rule's export against the init, the same cells
        for set_name, (seeds, _) in SETS.items():
            names = MEASURES[set_name]
            for rate in (0.3, 0.5):
                rows, per_seed = [], []
                for seed in seeds:
                    a, b = cell_measures(rate, seed, "init"), chosen_measures(rate, seed, rule_name)
                    have = [n for n in names if n in a and n in b]  # (as the tables above: the rest pending)
                    if not have:
                        continue
                    step = load(beside(cell_dir(rate, seed, "pg24"), ".checks.json"))["chosen"][rule_name]
                    c = changes(a, b, have, block)
                    per_seed.append(c)
                    rows.append(f"| {seed} (step {step}) | {pair_cells(a, b, c, names)} |")
                if not per_seed:
                    continue
                lines += [f"## Rule `{rule_name}`: {set_name}, {round(rate * 100)} %", "",
                          "| seed (chosen step) | " + " | ".join(LABELS[n] for n in names) + " |",
                          "|---" * (len(names) + 1) + "|", *rows, mean_row(per_seed, names), ""]
                if set_name == "confirm" and len(per_seed) == len(seeds) and all(
                        "wikitext_valid" in c and "c4" in c for c in per_seed):
                    verdicts.append(f"- rule `{rule_name}`, " + rule_verdict(rate, per_seed)[2:])
    for variant, base in [(v, b) for v in VARIANTS for b in VARIANT_BASES.get(v, ("init",))]:  # the same cells
        for set_name, (seeds, _) in SETS.items():
            names = MEASURES[set_name]
            for rate in (0.3, 0.5):
                rows, per_seed = [], []
                for seed in seeds:
                    a, b = cell_measures(rate, seed, base), cell_measures(rate, seed, variant)
                    have = [n for n in names if n in a and n in b]
                    if not have:
                        continue
                    c = changes(a, b, have, block)
                    per_seed.append(c)
                    secs = [phase_seconds(cell_dir(rate, seed, w), VARIANT_PHASES[variant]) for w in (base, variant)]
                    rows.append(f"| {seed} | {pair_cells(a, b, c, names)} | " + " → ".join(
                        f"{x:.0f} s" if x is not None else "?" for x in secs) + " |")
                if not per_seed:
                    continue
                lines += [f"## `{variant}` ({' '.join(RUNS[variant])}) against `{base}`: {set_name}, {round(rate * 100)} %",
                          "", "| seed | " + " | ".join(LABELS[n] for n in names) + f" | {VARIANT_PHASES[variant]}, wall |",
                          "|---" * (len(names) + 2) + "|", *rows, mean_row(per_seed, names, " |"), ""]
                if set_name == "confirm" and RUNS[variant][:1] == ["--steps"] and len(per_seed) == len(seeds) and all(
                        "wikitext_valid" in c and "c4" in c for c in per_seed):  # (steps against their own init)
                    verdicts.append(f"- `{variant}` against `{base}`, " + rule_verdict(rate, per_seed)[2:])
    if verdicts:
        lines += ["## The rule (docs/results.md): steps only if the mean gain is ≥ 5 % on WikiText validation and held-out "
                  "C4, and no seed worse than its init by more than 1 % on either", "", *verdicts, ""]
    text = "\n".join(lines) + "\n"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / ("table.md" if block == 1 else f"table-block{block}.md")).write_text(text)
    print(text)


def phase_seconds(folder: Path, phase: str) -> float | None:
    """A finished run's wall seconds in one phase (results.json's seconds_by_phase), None where it lacks them."""
    return (load(folder / "results.json").get("seconds_by_phase") or {}).get(phase)


def rule_verdict(rate: float, per_seed: list[dict]) -> str:
    """Whether the steps pass the default's rule at this rate (the points, not the intervals)."""
    means = {m: sum(c[m][0] for c in per_seed) / len(per_seed) for m in ("wikitext_valid", "c4")}
    worst = {m: max(c[m][0] for c in per_seed) for m in ("wikitext_valid", "c4")}
    ok = all(means[m] <= -5.0 and worst[m] <= 1.0 for m in means)
    return (f"- {round(rate * 100)} %: {'passes' if ok else 'fails'}: mean change WikiText valid {means['wikitext_valid']:+.1f} %, "
            f"held-out C4 {means['c4']:+.1f} %; worst seed {worst['wikitext_valid']:+.1f} % / {worst['c4']:+.1f} %")


def cell_args(s: argparse.ArgumentParser, without: bool = True) -> argparse.ArgumentParser:
    """A cell's flags: --rate, --seed, and (without) --without MEASURE, repeatable (also bench/recover_study.py's)."""
    s.add_argument("--rate", type=positive(float), default=0.3)
    s.add_argument("--seed", type=int, required=True)
    if without:
        s.add_argument("--without", action="append", default=[], choices=MEASURES["confirm"],
                       help="a measure left for a later pass (the lanes measure every cell's perplexities first)")
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    s = cell_args(sub.add_parser("cell", help="a (rate, seed)'s init and pg24 runs, each measured"))
    s.add_argument("--only", choices=tuple(RUNS), default=None,
                   help="one run: init or pg24 (a cell's two), or a variant of the init (%(choices)s)")
    cell_args(sub.add_parser("checks", help="a finished pg24 cell's validated masks on two held-out texts; each "
                                            "rule's choice"), without=False)
    cell_args(sub.add_parser("rule", help="each rule's chosen step of a checked pg24 cell, exported and measured"))
    s = cell_args(sub.add_parser("step", help="one validated step's mask of a finished steps run, exported and measured"))
    s.add_argument("--only", choices=[r for r in RUNS if RUNS[r][:1] == ["--steps"]], default="pg24",
                   help="the steps run (default pg24)")
    s.add_argument("--step", type=int, required=True, help="a validated step (metrics.jsonl's lines with a check)")
    sub.add_parser("dense", help="the dense model's measures")
    s = sub.add_parser("report", help="the tables from the cells on disk")
    s.add_argument("--all", action="store_true", help="also the (set, rate) pairs with no finished cell")
    s.add_argument("--block", type=positive(int), default=1,
                   help="resample blocks of this many consecutive windows (a moving-block bootstrap; default 1: "
                        "single windows); N > 1 writes table-blockN.md beside table.md")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("PG_PRUNE_METRIC_CACHE", str(OUT / "metric_cache"))
    {"cell": cell, "checks": checks, "rule": rule, "step": step, "dense": dense, "report": report}[args.stage](args)


if __name__ == "__main__":
    run(main)
