"""The recovery study (issue 67): which distillation recovers the default run's exports best per CPU minute?

A cell is one (rate, seed, row, text) of `engine recover` on the default run's export, bench/confirm.py's init cell
(the default takes no steps since 2026-12-02, docs/results.md; bench/results/confirm/<set>/r<rate>-s<seed>-init:
its model/, rebuilt from its masks when this checkout
lacks it), one thread, in a ladder of minutes: 2, then resumed to 5, 10 and 30 minutes of training in all (CPU
minutes of the process, `--budget-clock cpu`: equal work for every cell whatever else shares the cores; the
learning rate is constant after its warm-up, so each rung is where one longer recovery passes; the rungs' exports
are measured as they come). Rows:
- `ce-lora`: CE only, LoRA (what `finetune` trains: the baseline; recover's default since the study chose it; since
  then it runs no teacher forward, so a rung run after 2026-12-06 takes more steps a minute than the earlier ones);
- `kl-lora`: KL from the dense model, LoRA (recover's default before the study);
- `kl-full`: KL, every decoder weight;
- `mix-lora`: half KL, half CE, LoRA.
Text: `c4`, the set's C4 calibration file (the run's own); `own`, the dense model's own text (256 documents of 256
tokens sampled as the engine's own-text source samples them, seeded by the cell's seed; cached beside the cells).
Each rung's export is measured on the set's judges (bench/confirm.py's measures: the confirmation set's WikiText-2
test and validation, held-out C4, LAMBADA and the four-task zero-shot mean; the tuning set's test, held-out C4
and zero-shot), and its CPU seconds recorded. Tune on the tuning seeds (0-2), report on the confirmation seeds.

    OMP_NUM_THREADS=1 python bench/recover_study.py cell --rate 0.3 --seed 0 --row kl-lora --text c4
    OMP_NUM_THREADS=1 python bench/recover_study.py cell --rate 0.3 --seed 0 --row kl-lora --text c4 --minutes 2,5
    python bench/recover_study.py list                     # every cell and rung, done or to do
    python bench/recover_study.py report                   # the tables and figures, running nothing

Cells: bench/results/recover_study/<set>/r<rate>-s<seed>-<row>-<text>/ (the recovery's own files; its model/ and
checkpoint are working files); each rung's measures in <cell>/measures-<M>min.json and its CPU in cell.json. A
rerun skips what a cell holds and resumes a stopped rung. The report writes OUT/table.md and, for each set, OUT/figure-<set>.svg:
each perplexity judge against CPU minutes, a line per rate, row and text.
"""

from __future__ import annotations

import argparse
import os
import shutil
import time
from pathlib import Path

import confirm
from cli_common import ROOT, run

OUT = ROOT / "bench" / "results" / "recover_study"
ROWS = {  # row -> recover's settings
    "ce-lora": {"mode": "lora", "ce_weight": 1.0},
    "kl-lora": {"mode": "lora", "ce_weight": 0.0},
    "kl-full": {"mode": "full", "ce_weight": 0.0},
    "mix-lora": {"mode": "lora", "ce_weight": 0.5},
}
TEXTS = ("c4", "own")
RUNGS = (2.0, 5.0, 10.0, 30.0)  # minutes of training in all
OWN_DOCS, OWN_TOKENS = 256, 256


def cell_dir(rate: float, seed: int, row: str, text: str) -> Path:
    return OUT / confirm.set_of(seed) / f"r{round(rate * 100)}-s{seed}-{row}-{text}"


STUDENT = "init"  # the confirmation cell's run that the default makes (no steps: engine/settings/config.py's STEP_VERDICTS)


def student(rate: float, seed: int) -> Path:
    """The default run's cell of bench/confirm.py (STUDENT), finished, with its export on disk."""
    folder = confirm.cell_dir(rate, seed, STUDENT)
    if not (folder / "results.json").is_file():
        raise SystemExit(f"error: {folder} has not finished: python bench/confirm.py cell --rate {rate:g} --seed {seed} "
                         f"--only {STUDENT} runs it")
    confirm.ensure_export(folder)
    return folder


def training_text(rate: float, seed: int, text: str, run_dir: Path) -> str:
    """The training text's file: the set's C4 calibration file, or the dense model's own text (made once)."""
    if text == "c4":
        return str(confirm.SHARED / "c4" / confirm.SETS[confirm.set_of(seed)][1])
    path = OUT / "own-text" / f"own-s{seed}.json.gz"
    if not path.is_file():
        import dataclasses

        from engine.data.calib_sources import CALIB_SOURCES, write_documents
        from engine.settings.config import PruneConfig
        from engine.data.text import load_calibration_texts
        from engine.model.loading import load_model, resolve_model

        config = dataclasses.replace(PruneConfig.load(run_dir / "config.json"), self_docs=OWN_DOCS,
                                     self_tokens=OWN_TOKENS, seed=seed)
        model, tok = load_model(resolve_model(config.model))
        texts, _ = load_calibration_texts(config.calib)
        docs, _ = CALIB_SOURCES["self"](texts, model, tok, config, None, log=lambda m: print(m, flush=True))
        if not write_documents(path, docs, print):
            raise SystemExit(f"error: cannot write {path}")
    return str(path)


def start_over(info: dict, done_minutes: float, longest: float, checkpoint: Path) -> str | None:
    """Why a cell must train again from its start, or None: its rungs were wall minutes (fewer CPU seconds when
    other jobs shared the cores; every cell is on CPU minutes now); a longer rung is asked and no checkpoint is here
    (a later session's checkout keeps the rungs' measures, not the checkpoint git ignores); or its checkpoint is from
    before the recovery kept its CPU seconds (a rung stopped midway cannot say how much of it was trained, since
    --time-budget counts one session's minutes)."""
    from engine.tools.recover import trained_so_far

    if done_minutes and info.get("budget_clock") != "cpu":
        return "its rungs were wall minutes: trained again on CPU minutes"
    if longest <= done_minutes:
        return None  # (nothing to train: the rungs on record are measured as they are)
    if not checkpoint.is_file():
        return (f"no checkpoint of its {done_minutes:g}-minute rung here: trained again from the start"
                if done_minutes else None)
    if trained_so_far(checkpoint.parent)[1] is None:
        return "its checkpoint does not say its CPU seconds: trained again from the start"
    return None


def cell(args) -> None:
    from engine.tools.recover import CHECKPOINT_FILE, recover, trained_so_far

    folder = cell_dir(args.rate, args.seed, args.row, args.text)
    book = confirm.beside(folder, ".cell.json")
    info = confirm.load(book)
    wanted = tuple(m for m in confirm.MEASURES[confirm.set_of(args.seed)] if m not in args.without)
    run_dir = student(args.rate, args.seed)
    calib = training_text(args.rate, args.seed, args.text, run_dir)
    done_minutes = info.get("minutes", 0.0)
    why = start_over(info, done_minutes, max(args.minutes), folder / CHECKPOINT_FILE)
    if why:  # (the checkpoint and every rung's measures go: the cell trains from its start, each rung measured anew)
        print(f"{folder.name}: {why}", flush=True)
        (folder / CHECKPOINT_FILE).unlink(missing_ok=True)
        for old in folder.glob("measures-*min.json"):
            old.unlink()
        book.unlink(missing_ok=True)  # (at once: a start over stopped in its first rung resumes it, not a rung gone)
        info, done_minutes = {}, 0.0
    for rung in sorted(args.minutes):
        dest = folder / f"measures-{rung:g}min.json"
        if rung <= done_minutes + 1e-9:
            if not all(m in confirm.load(dest) for m in wanted):
                if rung != done_minutes:
                    print(f"{folder.name}: the {rung:g}-minute rung's export is gone (a later rung is trained); "
                          "its measures stay as they are", flush=True)
                else:
                    confirm.measure(str(folder / "model"), dest, wanted)
            continue
        t0, w0 = time.process_time(), time.monotonic()
        again = (folder / CHECKPOINT_FILE).is_file()
        steps, cpu = trained_so_far(folder)
        left = rung - cpu / 60  # (the rung's minutes in all, less every session's so far)
        until = dict(time_budget=left) if left > 0 else dict(steps=steps)  # (trained to it, stopped before the export)
        r = recover(run_dir, folder, resume=again, overwrite=not again and folder.exists(), **until,
                    budget_clock="cpu", skip_eval=True, calib=calib,
                    seed=args.seed, log=lambda m: print(m, flush=True), **ROWS[args.row])
        info.setdefault("rungs", {})[f"{rung:g}"] = {
            "cpu_seconds": info.get("cpu_seconds", 0.0) + time.process_time() - t0,
            "train_seconds": r.results.get("train_seconds"), "steps": r.results.get("steps"),
            "loss_last": r.results.get("loss_last"), "kl_last": r.results.get("kl_last")}
        info.update(minutes=rung, cpu_seconds=info.get("cpu_seconds", 0.0) + time.process_time() - t0,
                    wall_seconds=info.get("wall_seconds", 0.0) + time.monotonic() - w0, row=args.row,
                    text=args.text, settings=ROWS[args.row], calib=calib, budget_clock="cpu")
        confirm.save(book, info)
        done_minutes = rung
        confirm.measure(str(folder / "model"), dest, wanted)
    if args.drop_model and (folder / "model").is_dir():
        shutil.rmtree(folder / "model")


def cells() -> list[tuple[float, int, str, str]]:
    return [(rate, seed, row, text) for seeds, _ in confirm.SETS.values() for seed in seeds for rate in (0.3, 0.5)
            for row in ROWS for text in TEXTS]


def listing(args) -> None:
    for rate, seed, row, text in cells():
        folder = cell_dir(rate, seed, row, text)
        minutes = confirm.load(confirm.beside(folder, ".cell.json")).get("minutes", 0.0)
        rungs = ", ".join(f"{m:g} min {'done' if m <= minutes else 'to run'}" for m in RUNGS)
        print(f"{folder.parent.name}/{folder.name}: {rungs}")


def mean_cells(measured: list[dict], names) -> str:
    """Each measure's mean over the measured cells that hold it, with how many ("pending" where none does)."""
    def one(n):
        have = [m for m in measured if n in m]
        if not have:
            return "pending"
        return confirm.fmt_value(n, sum(confirm.value(m, n) for m in have) / len(have)) + (
            f" ({len(have)})" if len(have) != len(measured) else "")
    return " | ".join(one(n) for n in names)


def against_before(pairs: list[tuple[dict, dict]], names) -> str:
    """Each measure's mean over the seeds whose rung and export before recovery both hold it, with the mean change
    from before on those same seeds (perplexities in %, accuracies in points), and how many seeds where fewer
    than all hold it."""
    def one(n):
        have = [(a, b) for a, b in pairs if n in a and n in b]
        if not have:
            return "pending"
        after = sum(confirm.value(a, n) for a, _ in have) / len(have)
        if n in confirm.PERPLEXITIES:
            change = f"{100 * sum(confirm.value(a, n) / confirm.value(b, n) - 1 for a, b in have) / len(have):+.1f} %"
        else:
            change = f"{100 * sum(confirm.value(a, n) - confirm.value(b, n) for a, b in have) / len(have):+.1f} pt"
        return f"{confirm.fmt_value(n, after)} ({change}" + (f", of {len(have)})" if len(have) != len(pairs) else ")")
    return " | ".join(one(n) for n in names)


def report(args) -> None:
    """Per set and rate: each row and text at each rung, the mean over the seeds measured of each judge, beside the
    export before recovery (the STUDENT cell's measures)."""
    lines = ["# The recovery study: the default run's exports recovered by distillation", "",
             f"(bench/recover_study.py report; SmolLM2-135M-Instruct, the default preset's export (bench/confirm.py's "
             f"`{STUDENT}` cells); one thread a cell; minutes of training in all, CPU seconds recorded per "
             "rung; perplexities 256 x 128, held-out C4 128 x 128; mean over the seeds measured, and in brackets the "
             "mean change from before recovery on those same seeds (the first row: every seed's export))", ""]
    for set_name, (seeds, _) in confirm.SETS.items():
        names = confirm.MEASURES[set_name]
        for rate in (0.3, 0.5):
            rows = []
            for row in ROWS:
                for text in TEXTS:
                    for rung in RUNGS:
                        got = [(confirm.load(cell_dir(rate, s, row, text) / f"measures-{rung:g}min.json"),
                                confirm.cell_measures(rate, s, STUDENT) or {}) for s in seeds]
                        got = [(a, b) for a, b in got if a]
                        if got:
                            rows.append(f"| {row} | {text} | {rung:g} | {len(got)} | {against_before(got, names)} |")
            if not rows and not args.all:
                continue
            base = [m for m in (confirm.cell_measures(rate, s, STUDENT) for s in seeds) if m]
            before = mean_cells(base, names) if base else " | ".join("not finished" for _ in names)
            lines += [f"## {set_name}, {round(rate * 100)} %", "",
                      "| row | text | minutes | seeds | " + " | ".join(confirm.LABELS[n] for n in names) + " |",
                      "|---" * (len(names) + 4) + "|", f"| before recovery ({STUDENT}) | | 0 | {len(base)} | {before} |",
                      *rows, ""]
    text = "\n".join(lines) + "\n"
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "table.md").write_text(text)
    for set_name in confirm.SETS:
        if (svg := figure(set_name)) is not None:
            (OUT / f"figure-{set_name}.svg").write_text(svg)
    print(text)


def figure(set_name: str) -> str | None:
    """Each perplexity judge of a set against the CPU minutes of training: one line per rate, row and text, the
    mean over the seeds measured to the line's last rung, from their exports before recovery (0 minutes). None
    before any rung is measured."""
    from svg_chart import PALETTE, Panel, Series, line_chart

    seeds = confirm.SETS[set_name][0]
    names = [n for n in confirm.MEASURES[set_name] if n in confirm.PERPLEXITIES]
    panels = {n: Panel(f"{confirm.LABELS[n]} perplexity") for n in names}
    colors: dict[str, str] = {}
    for rate in (0.3, 0.5):
        before = {s: confirm.cell_measures(rate, s, STUDENT) for s in seeds}  # (every row's line starts there)
        for row in ROWS:
            for text in TEXTS:
                label = f"{round(rate * 100)} %, {row}, {text}"
                per_seed = {s: [(0.0, before[s])] + [
                    (rung, confirm.load(cell_dir(rate, s, row, text) / f"measures-{rung:g}min.json")) for rung in RUNGS]
                    for s in seeds}
                for n, panel in panels.items():
                    # (the line's seeds: those measured to its last rung, the furthest any seed reached; the same
                    # seeds at every point)
                    reach = {s: next((i for i, (_, m) in enumerate(ms) if n not in m), len(ms)) for s, ms in
                             per_seed.items()}
                    last = max(reach.values(), default=0)
                    have = [per_seed[s] for s, r in reach.items() if r == last]
                    points = [(have[0][i][0], sum(confirm.value(ms[i][1], n) for ms in have) / len(have))
                              for i in range(last)] if have else []
                    if len(points) > 1:
                        color = colors.setdefault(label, PALETTE[len(colors) % len(PALETTE)])
                        panel.series.append(Series(label, points, color, dashed=rate == 0.5))
    if not any(p.series for p in panels.values()):
        return None
    return line_chart(list(panels.values()), "CPU minutes of training (one thread)", "perplexity, mean over seeds")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="stage", required=True)
    s = confirm.cell_args(sub.add_parser("cell", help="one (rate, seed, row, text): its rungs trained, resumed and "
                                                       "measured"))
    s.add_argument("--row", choices=tuple(ROWS), required=True)
    s.add_argument("--text", choices=TEXTS, required=True)
    s.add_argument("--minutes", type=lambda v: [float(x) for x in v.split(",")], default=list(RUNGS),
                   help="the rungs: minutes of training in all (default 2,5,10,30)")
    s.add_argument("--drop-model", action="store_true", help="remove the cell's model/ after its last rung")
    sub.add_parser("list", help="every cell's rungs, done or to run")
    s = sub.add_parser("report", help="the tables from the cells on disk")
    s.add_argument("--all", action="store_true", help="also the (set, rate) pairs with no measured rung")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.stage == "cell" and not any(args.seed in seeds for seeds, _ in confirm.SETS.values()):
        raise SystemExit(f"error: seed {args.seed} is in no set")
    {"cell": cell, "list": listing, "report": report}[args.stage](args)


if __name__ == "__main__":
    run(main)
