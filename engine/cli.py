"""Command line: `python -m engine prune|eval|zeroshot|finetune|measure ...`. Bad input ends in one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import typing
from pathlib import Path

from . import IMPORTED
from .settings.config import (DEFAULT_PRESET, PRESETS, PruneConfig, default_preset, no_steps_line, preset_text,
                              steps_bought_line, takes_no_steps)
from .settings.fields import choices_of
from .algo.methods import METHODS
from .errors import MAX_LINE, UserError, shorten
from .export import EXPORT_FORMATS
from .model.loading import DEFAULT_MODEL, DTYPES
from .run.folder import GGUF_FILE
from .run.files import MODEL_DIR, RECOVER_DIR
from .model.unit_types import UNIT_TYPES

DATA_SETTINGS = ("eval_data", "eval_seqlen", "max_windows", "eval_batch_size", "dtype", "device")  # prune's and eval's


def _comma_list(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


def _setting_args(p: argparse.ArgumentParser, cls, names: tuple[str, ...] | None = None, preset: dict | None = None) -> None:
    """One flag per field of a settings dataclass (all, or `names`), made from its declaration
    (engine.settings.fields.setting): --FIELD-NAME (or the declared flag), its type, choices, default and help (and the
    value `preset`, the fast preset, gives it)."""
    hints, defaults = typing.get_type_hints(cls), cls()
    for f in dataclasses.fields(cls):
        if (names is not None and f.name not in names) or f.metadata.get("flag") is False:
            continue
        hint, default, choices = hints[f.name], getattr(defaults, f.name), choices_of(f)
        shown = lambda v: ",".join(v) if isinstance(v, list) else ("none" if v in (None, {}) else v)  # noqa: E731
        text = f.metadata.get("help", "")
        text += "" if "(default" in text else f" (default {shown(default)})"  # a help that says its default says it better
        if f.name in (preset or {}):  # a setting the fast preset sets: what a run that names its units gets
            text += f" ({shown(preset[f.name])} where a run starts from the fast preset, see --preset)"
        kw = dict(default=default, help=text.replace("%", "%%"))
        flag = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        if hint is bool or set(typing.get_args(hint)) == {bool, type(None)}:  # (bool | None: neither flag = None)
            p.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        elif hint == list[str]:
            p.add_argument(flag, type=_comma_list, metavar=f.name.upper(), **kw)
        elif hint is dict:
            p.add_argument(flag, type=_unit_multiple, metavar="UNIT=N[,...]", **kw)
        else:
            base = next((t for t in typing.get_args(hint) if t is not type(None)), hint)  # X | None -> X
            p.add_argument(flag, type=base, choices=choices, metavar=None if choices else f.name.upper(), **kw)


def _option_flag(method: str, f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or f"--{method}-{f.name.replace('_', '-')}"


def _method_option_args(p: argparse.ArgumentParser) -> None:
    """The flags of each registered method's Options dataclass, from its fields' metadata: --METHOD-OPTION,
    or the flag a field declares (policy gradient's keep their short names, --baseline ...). Their
    default is None: the option's own default applies unless the flag is given."""
    for name, method in METHODS.items():
        if method.Options is None:
            continue
        hints = typing.get_type_hints(method.Options)
        for f in dataclasses.fields(method.Options):
            help_ = f"{name}: {f.metadata.get('help', f.name.replace('_', ' '))} (default {f.default})"
            kw = dict(dest=f"{name}_{f.name}", default=None, help=help_)
            if hints[f.name] is bool:
                p.add_argument(_option_flag(name, f), action=argparse.BooleanOptionalAction, **kw)
            else:  # (an optional option, float | None, parses as its type: its default None is "not given")
                kind = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
                p.add_argument(_option_flag(name, f), type=kind, choices=choices_of(f),
                               metavar=None if choices_of(f) else f.name.upper(), **kw)


def _method_options(args) -> dict:
    """The chosen method's options from its flags; such a flag for another method is an error."""
    options = {}
    for name, method in METHODS.items():
        for f in dataclasses.fields(method.Options) if method.Options is not None else ():
            value = getattr(args, f"{name}_{f.name}", None)
            if value is None:
                continue
            if name != args.method:
                raise UserError(f"{_option_flag(name, f)} applies to --method {name}, not {args.method}")
            options[f.name] = value
    return options


def _as_flag_defaults(values: dict, method: str) -> dict:
    """Preset values as the parser's defaults: a run-level field by its name, an option of the run's method
    (a preset names policy gradient's as their flags do: baseline, baseline_window) by its flag's
    destination; another method's options do not apply and are left out."""
    fields = {f.name for f in dataclasses.fields(PruneConfig)}
    out = {}
    for k, v in values.items():
        owner = next((m for m, cls in METHODS.items() if cls.Options is not None
                      and k in {f.name for f in dataclasses.fields(cls.Options)}), None)
        if k in fields or owner is None:
            out[k] = v
        elif owner == method:
            out[f"{owner}_{k}"] = v
    return out


def _unit_multiple(text: str) -> dict:
    """`channels=32[,kv_groups=2]` -> {"channels": 32, "kv_groups": 2}"""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        unit, _, n = part.partition("=")
        if not n.strip().isdigit():
            raise argparse.ArgumentTypeError(f"expected UNIT=N, e.g. channels=32, got {part!r}")
        if unit.strip() in out:
            raise argparse.ArgumentTypeError(f"{unit.strip()} is given twice in {text!r}")
        out[unit.strip()] = int(n)
    return out


def _config_defaults(path: str) -> dict:
    """A saved PruneConfig as prune's argument defaults (so that flags given explicitly override it)."""
    config = PruneConfig.load(Path(path)).resolved()
    values = {k: v for k, v in config.to_dict().items() if k != "method_options"}
    values.update({f"{config.method}_{k}": v for k, v in config.method_options.items()})
    return values


class _Parser(argparse.ArgumentParser):
    """Usage errors (an unknown flag, a bad choice) are one `error:` line too, like every other bad input."""

    def error(self, message: str):
        raise UserError(f"{message} (see {self.prog} --help)")


def build_parser() -> argparse.ArgumentParser:
    # (installed, the same command is `pg-prune`: its help and errors name the command the user typed)
    prog = "pg-prune" if Path(sys.argv[0]).name == "pg-prune" else "python -m engine"
    parser = _Parser(prog=prog, description="Policy-gradient structural pruning of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prune", help="learn masks over KV groups, MLP channels and layers, evaluate, export")
    p.add_argument("--config", default=None, metavar="RUN.json",
                   help="start from a saved run config (a run's config.json, or one a script wrote); flags given override it")
    p.add_argument("--preset", choices=list(PRESETS), default=None,
                   help="start from named settings, flags given override them: " + "; ".join(
                       f"{name}: {preset_text(name)}" for name in PRESETS) + f" (default {DEFAULT_PRESET}'s "
                       "one-shot init, whole layers and widths in one budget: the settings' own defaults; --steps N "
                       "buys its steps; --units, --scope uniform or --budget units start from fast; --config from "
                       "the file)")
    _setting_args(p, PruneConfig, preset=PRESETS["fast"])  # every run setting, from its declaration
    _method_option_args(p)
    p.add_argument("--out", required=True, help="run folder (config, metrics, masks, model/, results.json)")
    p.add_argument("--export-gguf", metavar="OUTTYPE", default=None, choices=list(EXPORT_FORMATS["gguf"].outtypes),
                   help=f"at the end, also write RUN/{GGUF_FILE} for llama.cpp ({', '.join(EXPORT_FORMATS['gguf'].outtypes)})")
    p.add_argument("--recover", metavar="MINUTES", type=float, default=None,
                   help=f"at the end, recover the pruned model for MINUTES into RUN/{RECOVER_DIR} (`recover RUN --out "
                        f"RUN/{RECOVER_DIR} --time-budget MINUTES`, its other defaults: LoRA on the calibration "
                        "text's cross-entropy)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint (its saved config is used)")
    g.add_argument("--overwrite", action="store_true", help="replace the run in --out")

    x = sub.add_parser("export", help="write a finished run's pruned model in another format (gguf: llama.cpp)")
    x.add_argument("run", metavar="RUN_DIR", help="a finished prune run folder")
    x.add_argument("--format", required=True, choices=list(EXPORT_FORMATS),
                   help="; ".join(f"{f.name}: {f.summary}" for f in EXPORT_FORMATS.values()))
    x.add_argument("--out", required=True, help="the file or folder to write (must not exist)")
    x.add_argument("--outtype", default=None, help="weight type; " + "; ".join(
        f"{f.name}: {', '.join(f.outtypes)} (default {f.outtypes[0]})" for f in EXPORT_FORMATS.values()))

    e = sub.add_parser("eval", help="WikiText-2 perplexity of a model")
    e.add_argument("--model", default=DEFAULT_MODEL, help="a model folder (a pruned export too), a .gguf file, a hub id, or the default")
    _setting_args(e, PruneConfig, DATA_SETTINGS)
    e.add_argument("--json", action="store_true", help="print one JSON object")

    from .tools.finetune import FinetuneConfig
    from .tools.measure import MeasureConfig
    from .tools.zeroshot import ALL_TASKS, DEFAULT_TASKS, ZeroshotConfig

    Z, F, M = ZeroshotConfig(), FinetuneConfig(), MeasureConfig()
    z = sub.add_parser("zeroshot", help="zero-shot accuracy with lm-evaluation-harness on local task data")
    z.add_argument("--model", default=None, help=f"a model folder (a pruned export too), a .gguf file, a hub id, or {DEFAULT_MODEL} "
                   "(the default; with --run: the run's base model)")
    z.add_argument("--run", default=None, help="a prune run folder: evaluate its base model with the run's masks applied as hooks")
    z.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help=f"comma list of: {', '.join(ALL_TASKS)} (default %(default)s)")
    z.add_argument("--limit", type=int, default=None, help="evaluate the first N documents of each task (default: all)")
    z.add_argument("--batch-size", type=int, default=Z.batch_size, help="(default %(default)s)")
    z.add_argument("--data-dir", default=None, help="task data folder (default: $PG_PRUNE_DATA_DIR/zeroshot or ../shared/data/zeroshot)")
    z.add_argument("--dtype", default=Z.dtype, choices=list(DTYPES))
    z.add_argument("--device", default=Z.device, help="cpu, cuda, cuda:N (default %(default)s)")
    z.add_argument("--out", default=None, help="folder for zeroshot_config.json, zeroshot.json, zeroshot.md and the task configs used")
    z.add_argument("--overwrite", action="store_true", help="replace an earlier zeroshot output in --out (only its own files)")
    z.add_argument("--write-tasks", metavar="DIR", default=None,
                   help="only write the local task configs to DIR (for `python -m lm_eval --include_path DIR`) and exit")

    f = sub.add_parser("finetune", help="LoRA recovery fine-tuning of a (pruned) model folder, merged and saved")
    f.add_argument("--model", required=True, help="the model folder, e.g. RUN/model (a pruned export)")
    f.add_argument("--out", required=True,
                   help="folder for model/ (merged), finetune_config.json, finetune_log.jsonl, finetune_results.json")
    f.add_argument("--overwrite", action="store_true", help="replace an earlier finetune output in --out (only its own files)")
    for name, help_ in (("samples", "training segments (the paper: 4000)"), ("seqlen", "tokens per segment (the paper: 1024)"),
                        ("epochs", None), ("batch_size", "segments per forward"), ("grad_accum", "forwards per optimizer step"),
                        ("warmup_steps", "linear warm-up steps"), ("lora_r", None), ("eval_seqlen", None), ("seed", None)):
        f.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(F, name),
                       help=f"{help_ + ' ' if help_ else ''}(default %(default)s)")
    for name in ("lr", "lora_alpha", "lora_dropout", "weight_decay"):
        f.add_argument("--" + name.replace("_", "-"), type=float, default=getattr(F, name), help="(default %(default)s)")
    f.add_argument("--calib", default=None, help="training text: C4-style JSON lines file or folder (default: the local C4 sample)")
    f.add_argument("--eval-data", default=None, help="WikiText-2 raw test for perplexity before/after (default: the data dir)")
    f.add_argument("--max-windows", type=int, default=F.max_windows, help="perplexity on the first N windows (0: all; default %(default)s)")
    f.add_argument("--skip-eval", action="store_true", help="no perplexity before and after")
    f.add_argument("--dtype", default=F.dtype, choices=list(DTYPES))
    f.add_argument("--device", default=F.device)

    m = sub.add_parser("measure", help="params, memory, prefill latency and generation speed of models side by side")
    m.add_argument("--model", default=DEFAULT_MODEL, help="the reference model (default %(default)s)")
    m.add_argument("--compare", action="append", default=[], help="a model to measure beside it (repeatable)")
    for name in ("batch_size", "seqlen", "new_tokens", "repeats", "seed"):
        m.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(M, name), help="(default %(default)s)")
    m.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    m.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    m.add_argument("--dtype", default=M.dtype, choices=list(DTYPES))
    m.add_argument("--device", default=M.device, help="cpu or cuda[:N] (default %(default)s)")
    m.add_argument("--llama-cpp", default=None, metavar="OUTTYPE", choices=list(EXPORT_FORMATS["gguf"].outtypes),
                   help="also write each model as a GGUF of this type and time it in llama.cpp "
                        f"({', '.join(EXPORT_FORMATS['gguf'].outtypes)})")
    m.add_argument("--out", default=None, help="folder for measure_config.json, measure.json and measure.md")
    m.add_argument("--overwrite", action="store_true", help="replace an earlier measure output in --out (only its own files)")
    m.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    _recover_parser(sub)
    return parser


def _config_from_args(args) -> PruneConfig:
    fields = {f.name for f in dataclasses.fields(PruneConfig)}
    values = {k: v for k, v in vars(args).items() if k in fields}
    values["method_options"] = _method_options(args)
    return PruneConfig(**values)


def _resume_config(args, out: Path) -> PruneConfig:
    """The run's saved config, with the flags given beside --resume checked against it: only --steps may
    change (see checkpoints.Checkpoints.check_config_unchanged); any other difference is refused, naming the setting."""
    from .run.folder import CONFIG_FILE

    saved = PruneConfig.load(out / CONFIG_FILE).resolved()
    asked = _config_from_args(args).resolved()  # the saved config is the parser's default under --resume (parse_args)
    changed = [k for k, v in saved.to_dict().items() if k != "steps" and asked.to_dict()[k] != v]
    if changed:
        k = changed[0]
        raise UserError(f"--resume continues the run as it was set up; --{k.replace('_', '-')} "
                        f"{getattr(asked, k)!r} differs from the run's {getattr(saved, k)!r} ("
                        f"{', '.join(changed)} differ). Only --steps may change; start a new run with another --out")
    return dataclasses.replace(saved, steps=asked.steps)


def _init_label(config: PruneConfig) -> str:
    """The metrics a run's init came from, as its summary names them: "flap", "layers layerwise-ppl + flap"."""
    whole = [UNIT_TYPES[u].whole_layer for u in config.units]
    return " + ".join([f"layers {config.layer_init}"] * any(whole) + [config.init] * (not all(whole)))


def cmd_prune(args) -> int:
    """One process, or under torchrun one rank of a data-parallel run (engine/model/distributed.py): rank 0 is the run
    as in one process and alone writes the run folder; the other ranks follow it from a scratch folder."""
    from .model.distributed import RankLost, join_world

    world = join_world(args.device)
    clean = True  # (after a refusal or an interrupt the group is whole and is left: gloo aborts at exit otherwise)
    try:
        return (_prune_writer if world.writes else _prune_follower)(args, world)
    except _Finished as e:
        print(str(e), file=sys.stderr)
        return 0
    except RankLost:
        clean = False
        raise
    finally:
        world.leave(clean)


# the run files a rank other than 0 needs to resume: rank 0 sends them (the ranks may not share a filesystem)
_RESUME_FILES = ("config.json", "checkpoint.pt", "metrics.jsonl")


def _job_digest(config: PruneConfig | None) -> int | None:
    """What every rank must agree on before a data-parallel run starts: the settings and the model's files (names,
    sizes and the small files' content, not their times: copies on other machines are newer)."""
    if config is None:
        return None
    from .model.distributed import digest
    from .model.loading import resolve_model

    source = resolve_model(config.model)
    folder = Path(source.path)
    files = sorted(folder.iterdir()) if folder.is_dir() and not source.gguf_file else [folder / (source.gguf_file or "")]
    seen = [(f.name, f.stat().st_size, f.read_bytes() if f.suffix == ".json" and f.stat().st_size < 2**20 else b"")
            for f in files if f.is_file()]
    return digest(json.dumps(config.to_dict(), sort_keys=True), str(seen))


def _start_together(world, resolve) -> PruneConfig:
    """Every rank's config, checked together: one rank's refusal (a bad flag, a model that is not there) ends every
    rank with its line; different settings or model files end them as a mismatched world."""
    config, error, job = None, None, None
    try:
        config = resolve()
        job = _job_digest(config)
    except UserError as e:
        error = str(e)
    world.agree((error, job), "their settings or model files")
    return config


def _prune_follower(args, world) -> int:
    """A rank other than 0: the same run in a scratch folder (its checkpoints are rank 0's), no output."""
    import tempfile

    from .settings.config import PruneConfig
    from .run.loop import PruneRun

    sent = world.from_writer(None, "the run's start")
    if sent["error"]:
        raise UserError(sent["error"])
    with tempfile.TemporaryDirectory(prefix=f"pg-prune-rank{world.rank}-") as scratch:
        out = Path(scratch)
        for name, data in sent["files"].items():  # --resume: rank 0's checkpoint, config and metrics
            (out / name).write_bytes(data)

        def resolve():  # under --resume the run's saved config, as rank 0 read it (with its --steps)
            return (PruneConfig.from_dict(sent["config"]) if args.resume else _config_from_args(args)).resolved()

        config = _start_together(world, resolve)
        run = PruneRun(config, out, log=lambda m: None, started=IMPORTED, world=world)
        run.run(resume=args.resume, progress=False)
    return 0


class _Finished(UserError):
    """A bare --resume of a finished run (one process): nothing to do, said in one line, exit 0."""


def _check_unfinished(out: Path) -> None:
    """A bare --resume (no --steps, no --export-gguf) of a run that finished, results.json and model/ written, has
    nothing to do: raise _Finished saying so, rather than evaluate and export model/ again."""
    from .run.folder import MODEL_DIR, RESULTS_FILE

    try:
        results = json.loads((out / RESULTS_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(results, dict) and results.get("status") == "done" and (out / MODEL_DIR).is_dir():
        raise _Finished(f"the run in {out} is finished ({RESULTS_FILE}: {results.get('steps')} steps, model/ "
                        "exported); nothing to resume: --resume --steps N continues it to N steps, --overwrite "
                        "starts it again")


def _prune_writer(args, world) -> int:
    import contextlib

    from .model.distributed import RankLost
    from .storage.outdir import folder_lock
    from .run.loop import PruneRun
    from .run.folder import (CHECKPOINT_FILE, CONFIG_FILE, check_out_dir, cleanup_out_dir,
                             interrupted_before_first_step, prepare_out_dir)

    out = Path(args.out)

    def resolve():
        check_out_dir(out, args.resume, args.overwrite, clear=False)  # refuse early; delete nothing yet
        if getattr(args, "recover", None) is not None:  # (a bad --recover before the run, not after it)
            from .tools.recover import RecoverConfig

            RecoverConfig(run=str(out), time_budget=args.recover).validate()
        config = _resume_config(args, out) if args.resume else _config_from_args(args)
        return config.resolved()

    created: list[Path] = []
    claimed = contextlib.ExitStack()  # torchrun: rank 0 holds the folder's lock from before the start (below)
    if world.size > 1:  # the other ranks start from what rank 0 resolved or refused
        try:  # (a folder another process writes, a one-process run or the app's, refuses every rank with its holder)
            config, error = resolve(), None
            created = prepare_out_dir(out)
            claimed.enter_context(folder_lock(out, what="prune into"))
        except UserError as e:
            config, error = None, str(e)
        files = {n: (out / n).read_bytes() for n in _RESUME_FILES if args.resume and (out / n).is_file()} if not error else {}
        try:
            world.from_writer({"error": error, "config": config.to_dict() if config else None, "files": files}, "the run's start")
            if error:
                raise UserError(error)
            config = _start_together(world, lambda: config)
        except BaseException:
            claimed.close()
            cleanup_out_dir(created)
            raise
    else:
        config = resolve()
        created = prepare_out_dir(out)  # --out exists and is writable before the slow model load
    with claimed, contextlib.ExitStack() as held:
        try:
            held.enter_context(folder_lock(out, what="prune into"))  # held to the end: one writer at a time
            check_out_dir(out, args.resume, args.overwrite, clear=False)  # again, now that nobody else writes
            run = PruneRun(config, out, log=lambda m: print(m, file=sys.stderr), started=IMPORTED, world=world)
            if args.resume and (out / CHECKPOINT_FILE).exists():
                run.load_checkpoint()  # an edited config.json or a --steps below the checkpoint fail here
                if world.size == 1 and not getattr(args, "steps_given", True) and not args.export_gguf \
                        and args.recover is None:
                    _check_unfinished(out)  # (a bare --resume of a finished run: nothing to do)
            if args.export_gguf:  # refuse now what llama.cpp cannot take, not after the optimisation
                from .export.gguf import check_exportable

                check_exportable(run.res.model)
        except BaseException:
            held.close()
            cleanup_out_dir(created)  # a folder made only for this run leaves no trace of a failed start
            raise
        # model and data loaded: only now may --overwrite remove the old run, not for a typo in an argument
        check_out_dir(out, args.resume, args.overwrite)
        if getattr(args, "default_preset", None) == DEFAULT_PRESET:  # (after every refusal: a refused run's stderr is its one error line)
            if getattr(args, "no_steps", False):
                run.res.log(no_steps_line(config.prune_ratio))
            elif config.method == PRESETS[args.default_preset].get("method"):  # (the preset's steps, bought)
                run.res.log(steps_bought_line(config.prune_ratio, config.steps, config.time_budget))
            run.res.log(f"the default preset {args.default_preset}: {preset_text(args.default_preset)} (--preset fast, "
                    "or --units, for policy gradient over KV groups and channels)")
        saved_steps = PruneConfig.load(out / CONFIG_FILE).steps if args.resume else config.steps
        if saved_steps != config.steps:
            print(f"steps: {saved_steps} -> {config.steps} (the schedules follow a {config.steps}-step run from the "
                  "checkpoint on)", file=sys.stderr)
            config.save(out / CONFIG_FILE)
        if not args.resume:  # (what --time-budget will cut, said with the plan, before the work)
            for trade in budget_trades_of(run.res):
                run.res.log(f"plan: {trade}")
        try:
            results = run.run(resume=args.resume)
        except (KeyboardInterrupt, RankLost) as e:
            step = run.checkpoints.saved_step  # None when the run had written no checkpoint yet
            where = (f"the checkpoint holds step {step}/{config.steps}: continue with python -m engine prune "
                     f"--out {out} --resume") if step is not None else interrupted_before_first_step(out, run.res.phases.last)
            if isinstance(e, RankLost):
                raise UserError(f"{e}; {where} (with any number of ranks)") from None
            raise _Interrupted(f"interrupted; {where}") from None
        if results["status"] == "done":
            print(f"perplexity ({results['eval_windows']} windows x {results['seqlen']} tokens): "
                  f"dense {results['ppl_dense']:.2f} | init ({_init_label(config)}) "
                  + (f"{results['ppl_init']:.2f}" if results["ppl_init"] is not None else "skipped (--eval-init)") + " | "
                  f"pruned {results['ppl_pruned']:.2f}"
                  + (f" (least-squares reconstruction; {r['ppl_before']:.2f} before it)"
                     if "ppl_before" in (r := results.get("reconstruction") or {})
                     else f" (reconstruction skipped: {r['skipped']})" if "skipped" in r
                     else " (least-squares reconstruction)" if r else ""))  # (ppl_before: only with --eval-unrefit)
            print(f"parameters: {results['params_dense']:,} -> {results['params_pruned']:,}; "
                  f"{results['seconds_per_step']:.2f} s/step; results in {out}")
            shares = ", ".join(f"{u} {n:,}" for u, n in results["params_removed_by_unit_type"].items())
            print(f"removed {results['params_removed']:,} parameters: {results['removed_of_decoder']:.1%} of the decoder "
                  f"layers, {results['removed_of_model']:.1%} of the model ({shares})")
            if results.get("seconds_by_phase"):  # the plan it started with against what it measured, per phase
                from .run.plan import PLAN_KEY, plan_lines

                print("\n".join(plan_lines(results.get(PLAN_KEY), results["seconds_by_phase"])))
            if args.export_gguf:
                from .export import export_run

                (out / GGUF_FILE).unlink(missing_ok=True)  # a resumed run's earlier file is replaced
                export_run(out, "gguf", out / GGUF_FILE, args.export_gguf)
                print(f"llama.cpp model ({args.export_gguf}): {out / GGUF_FILE}")
    if results["status"] == "done" and getattr(args, "recover", None) is not None:
        chain_recover(out, args.recover, args.resume, args.overwrite)
    return 0


def chain_recover(out: Path, minutes: float, resume: bool, overwrite: bool) -> None:
    """prune --recover MINUTES: the finished run's export recovered into RUN/recover, as `recover` does it. A
    resumed run continues a recovery that has its checkpoint there; an overwritten run replaces the recovery."""
    from .tools.recover import CHECKPOINT_FILE as RECOVER_CHECKPOINT, RecoverInterrupted, recover
    from .tools.recover import recovery_words, recovery_words_of

    dest = out / RECOVER_DIR
    again = resume and (dest / RECOVER_CHECKPOINT).is_file()
    how = recovery_words_of(dest) if again else recovery_words()
    print(f"recovery: {out / MODEL_DIR} {how}, for {minutes:g} min into {dest}"
          + (" (continued from its checkpoint)" if again else ""), file=sys.stderr)
    try:
        r = recover(out, dest, resume=again, overwrite=overwrite and not again, time_budget=minutes)
    except RecoverInterrupted as e:
        raise _Interrupted(f"interrupted during the recovery (the run in {out} is finished); {e.out} holds its first "
                           f"{e.step} steps: {_prog()} recover {out} --out {dest} --resume continues it") from None
    say_recovered(r)


def _prog() -> str:
    return "pg-prune" if Path(sys.argv[0]).name == "pg-prune" else "python -m engine"


def say_recovered(r) -> None:
    """A recovery's last lines: the perplexity before and after, the loss, the steps and where the model is."""
    res = r.results
    if "ppl_after" in res:
        print(f"perplexity ({res['eval_windows']} windows x {res['eval_seqlen']} tokens): before {res['ppl_before']:.2f} "
              f"| after {res['ppl_after']:.2f}")
    losses = f"loss {res['loss_first']:.4f} -> {res['loss_last']:.4f}, " if res["steps"] and res["loss_first"] is not None else ""
    print(f"{res['mode']} recovery: {losses}{res['steps']} steps (ended by {res['ended_by']}), {res['train_seconds']:.0f} s "
          f"of training; recovered model in {r.model}")


def budget_trades_of(res) -> list[str]:
    """What --time-budget will cut in this run (the refit's statistics: results.json's "reduced" records it after),
    from the plan the run makes of its time (engine/run/plan.py's time_plan: this machine's probe, the passes' dtype,
    the dense perplexity's cache), before the work; none without a budget or a refit."""
    from .plan.forecast import budget_trades
    from .run.plan import time_plan

    c = res.config
    if c.time_budget is None or not c.reconstruct:
        return []
    return budget_trades(c, time_plan(res)[0])


def error_line(e: BaseException) -> str:
    """The one line a refusal prints: `error: ...`, under MAX_LINE characters (a long OS error is shortened)."""
    return "error: " + shorten(str(e), MAX_LINE - 1 - len("error: "))


class _Interrupted(Exception):
    """Ctrl-C or SIGTERM, with what the user can do next."""


def interrupted_line(e: KeyboardInterrupt, argv: list[str]) -> str:
    """What Ctrl-C or SIGTERM outside a run's steps prints: "interrupted"; while the calibration text is generated
    (before the run folder holds a run, so --resume has nothing to take up), how much of it is saved and the command
    that continues from there: the same one again (the saved batches are taken up)."""
    import shlex

    from .data.calib_sources import GenerationInterrupted

    if not isinstance(e, GenerationInterrupted):
        return "interrupted"
    prog = "pg-prune" if Path(sys.argv[0]).name == "pg-prune" else "python -m engine"
    again = f"{prog} {shlex.join(argv)}"
    if not e.saved:
        return f"{e}; the same command starts it again: {again}"
    return (f"{e}; run the same command again to continue from them: {again} (--resume needs a run that reached its "
            "first step)")


def cmd_export(args) -> int:
    from .export import export_run
    from .run.folder import check_export_destination

    if args.out:
        check_export_destination(Path(args.out))
    info = export_run(args.run, args.format, args.out, args.outtype)
    print(f"wrote {info['path']}")
    return 0


def cmd_eval(args) -> int:
    from .data.text import eval_windows, load_eval_text
    from .algo.evaluate import perplexity
    from .model.loading import check_positions, count_parameters, load_model, resolve_model

    if args.eval_seqlen < 2:  # a window of 1 token predicts nothing: its loss is NaN
        raise UserError(f"eval seqlen must be at least 2 tokens, got {args.eval_seqlen}")
    if args.eval_batch_size < 1:
        raise UserError("eval batch size must be at least 1")
    if args.max_windows is not None and args.max_windows < 0:
        raise UserError(f"max windows must be 0 (all) or more, got {args.max_windows}")
    source = resolve_model(args.model)
    model, tok = load_model(source, args.dtype, args.device)
    check_positions(model.config, {"eval seqlen": args.eval_seqlen})
    text, src = load_eval_text(args.eval_data)
    windows = eval_windows(tok, text, args.eval_seqlen, args.max_windows)
    from .model.memory_check import check_eval_fits

    check_eval_fits(model, int(windows.shape[0]), args.eval_batch_size, args.eval_seqlen, args.device)  # (one line)
    ppl = perplexity(model, windows, args.eval_batch_size, progress=not args.json)
    if not math.isfinite(ppl):
        raise UserError(f"perplexity of {args.model} is {ppl}: the model's outputs are not finite (try another --dtype)")
    result = {"model": args.model, "ppl": ppl, "eval_windows": int(windows.shape[0]), "seqlen": args.eval_seqlen,
              "eval_data": src, "params": count_parameters(model), "dtype": args.dtype}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"perplexity {ppl:.3f} on {result['eval_windows']} windows x {args.eval_seqlen} tokens "
              f"({result['params']:,} parameters, {args.dtype})")
    return 0


def _tasks(value: str) -> list[str]:
    return [t.strip() for t in value.split(",") if t.strip()]


def cmd_zeroshot(args) -> int:
    from .storage.outdir import output_folder
    from .tools.zeroshot import ALL_TASKS, TASKS_OUTPUT, ZeroshotConfig, run_zeroshot, write_task_dir

    config = ZeroshotConfig(model=args.model, run=args.run, tasks=_tasks(args.tasks), limit=args.limit,
                            batch_size=args.batch_size, data_dir=args.data_dir, dtype=args.dtype, device=args.device)
    if args.write_tasks:
        config.validate()
        with output_folder(Path(args.write_tasks), TASKS_OUTPUT, args.overwrite, flag="--write-tasks"):
            dest = write_task_dir(args.write_tasks, ALL_TASKS, args.data_dir)
        print(f"task configs for {', '.join(ALL_TASKS)} in {dest}; use: python -m lm_eval --include_path {dest} --tasks ...")
        return 0
    summary = run_zeroshot(config, args.out, log=lambda m: print(m, file=sys.stderr), overwrite=args.overwrite)
    print(summary["table"], end="")
    limit = f"first {config.limit} documents per task" if config.limit else "all documents"
    print(f"({limit}; {summary['seconds']:.0f} s; results in {summary['out']})")
    return 0


def cmd_finetune(args) -> int:
    from .tools.finetune import FinetuneConfig, finetune

    fields = {f.name for f in dataclasses.fields(FinetuneConfig)}
    config = FinetuneConfig(**{k: v for k, v in vars(args).items() if k in fields})
    config.validate()
    r = finetune(config, args.out, overwrite=args.overwrite)
    if "ppl_before" in r:
        print(f"perplexity ({r['eval_windows']} windows x {config.eval_seqlen} tokens): before {r['ppl_before']:.2f} | "
              f"after {r['ppl_after']:.2f}")
    print(f"training loss (first {config.loss_probe_segments} segments): before {r['train_loss_before']:.4f} | "
          f"after {r['train_loss_after']:.4f}; {r['samples_used']} segments x {config.seqlen} tokens, {r['steps']} steps, "
          f"{r['train_seconds']:.0f} s; merged model in {r['out_model']}")
    return 0


# --- recover (engine/tools/recover.py: a run's export trained on text, or distilled from its dense base model) -----
def _recover_parser(sub) -> None:
    """The `recover RUN_DIR --out OUT ...` subcommand: one flag per RecoverConfig field, from its declaration."""
    from .tools.recover import RecoverConfig

    r = sub.add_parser("recover", help="recover a finished run's pruned model: LoRA (or all decoder weights) on the "
                                       "calibration text's cross-entropy, or distilled from the dense model (KL), "
                                       "merged and saved like the export")
    r.add_argument("run", metavar="RUN_DIR", help="a finished prune run folder: its model/ is the student")
    r.add_argument("--out", required=True, help="folder for model/ (recovered), recover_config.json, recover_log.jsonl, "
                                                "recover_checkpoint.pt and recover_results.json")
    g = r.add_mutually_exclusive_group()
    # (dest recover_resume: parse_args reads a prune run's saved config under args.resume)
    g.add_argument("--resume", dest="recover_resume", action="store_true",
                   help="continue the recovery in --out from its checkpoint (its saved settings; --steps or "
                        "--time-budget given set how far)")
    g.add_argument("--overwrite", action="store_true", help="replace an earlier recover output in --out (only its own files)")
    _setting_args(r, RecoverConfig)


def cmd_recover(args) -> int:
    from .tools.recover import RecoverConfig, RecoverInterrupted, recover

    fields = {f.name for f in dataclasses.fields(RecoverConfig)} - {"run"}
    try:
        r = recover(args.run, args.out, resume=args.recover_resume, overwrite=args.overwrite,
                    **{k: v for k, v in vars(args).items() if k in fields})
    except RecoverInterrupted as e:
        print(f"interrupted; {e.out} holds its first {e.step} steps: {_prog()} recover {args.run} --out {args.out} "
              "--resume continues it", file=sys.stderr)
        return 130
    say_recovered(r)
    return 0


def cmd_measure(args) -> int:
    from .tools.measure import MeasureConfig, run_measure

    config = MeasureConfig(models=[args.model, *args.compare], batch_size=args.batch_size, seqlen=args.seqlen,
                           new_tokens=args.new_tokens, repeats=args.repeats, dtype=args.dtype, device=args.device,
                           threads=args.threads, seed=args.seed, memory=not args.no_memory, llama_cpp=args.llama_cpp)
    config.validate()
    from .model.loading import resolve_model

    for name in config.models:  # a typo fails before any model is loaded
        resolve_model(name)
    result = run_measure(config, args.out, overwrite=args.overwrite)
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "table"}))
    else:
        print(result["table"], end="")
        print(f"(median of {config.repeats} after a warm-up; torch threads {result['torch_threads']}; {config.dtype} on {config.device})")
    return 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse twice when `prune --preset NAME` or `--config FILE` is given, or the default preset applies
    (config.default_preset): their values become the defaults (the file's over the preset's), so that flags given
    explicitly still override them. args.default_preset names the default preset a prune run started from."""
    parser = build_parser()
    args = parser.parse_args(argv)
    defaults, chosen, steps_given = {}, None, True
    # (a preset's method options apply under the method the run will have: the one given, else the preset's)
    method_of = lambda preset: args.method if _given(argv, "method") else preset.get("method", args.method)  # noqa: E731
    if getattr(args, "preset", None):
        defaults.update(_as_flag_defaults(PRESETS[args.preset], method_of(PRESETS[args.preset])))
    if getattr(args, "config", None):
        defaults.update(_config_defaults(args.config))
    if args.command == "prune" and not (args.preset or args.config or args.resume):
        chosen = default_preset(_given(argv, "units"), args.scope, args.budget)
        defaults.update(_as_flag_defaults(PRESETS[chosen], method_of(PRESETS[chosen])))
    if getattr(args, "resume", False):  # the run's own settings: a flag given beside --resume is checked against them
        if args.preset or args.config:
            raise UserError("--resume continues the run with its saved config; --preset and --config do not apply")
        saved = Path(args.out) / "config.json"
        if saved.is_file():
            defaults.update(_config_defaults(str(saved)))
        steps_given = _given(argv, "steps")  # (a bare --resume of a finished run has nothing to do)
    if defaults:
        _prune_parser(parser).set_defaults(**defaults)
        args = parser.parse_args(argv)
    args.default_preset, args.steps_given = chosen, steps_given
    args.no_steps = args.command == "prune" and not args.resume and takes_no_steps(
        chosen, args.prune_ratio, _given(argv, "method"), _given(argv, "steps"))
    if args.no_steps:  # (the default preset: the init alone, STEP_VERDICTS; said when the run starts)
        args.method = "flap"
    if args.command == "prune" and not args.resume:  # (under --resume a flag is checked against the saved run's)
        refuse_inert_flags(args, _given_of(argv, _INERT))
    return args


# settings that apply to one part of a run only, and what a run without that part would do with them: nothing
# the own text's (--calib-source self, mix, auto from 0.5)
_SELF_TEXT = ("self_docs", "self_tokens", "self_temperature", "self_batch", "self_dtype")
_MIX = ("mix_search", "mix_batches", "mix_reward", "mix_refit", "mix_refine_batches")  # the joint mix's
_STEPS_TEXT = ("step_calib_source",)  # the steps' (a method that optimises)
_INERT = (*_SELF_TEXT, *_MIX, *_STEPS_TEXT)


def refuse_inert_flags(args, given: list[str]) -> None:
    """A flag given for a part the run does not have is refused in one line, as another method's option is (rather
    than ignored without a word): --self-* where the run's calibration source generates no text, --mix-* where
    no joint mix is chosen (whole layers and widths on one --budget params)."""
    from .algo.methods import METHODS
    from .data.calib_sources import SELF_FROM, run_generates
    from .model.unit_types import UNIT_TYPES

    flag = lambda dest: "--" + dest.replace("_", "-")  # noqa: E731
    text = [d for d in given if d in _SELF_TEXT]
    if text and not run_generates(args):
        how = "" if args.calib_source == "data" else f" at --prune-ratio {args.prune_ratio:g}"
        raise UserError(f"{flag(text[0])} applies to the model's own text (--calib-source self or mix, or auto from "
                        f"--prune-ratio {SELF_FROM:g} up); this run reads the calibration documents as "
                        f"given (--calib-source {args.calib_source}{how}): drop {flag(text[0])}")
    if [d for d in given if d in _STEPS_TEXT] and not METHODS[args.method].optimises:
        why = ": the default takes the init alone, --steps N buys steps" if getattr(args, "no_steps", False) else ""
        raise UserError(f"--step-calib-source applies to the steps; this run takes none (--method {args.method}{why}); "
                        "drop --step-calib-source, or run a method that takes steps")
    mix = [d for d in given if d in _MIX]
    whole = [u for u in args.units if u in UNIT_TYPES and UNIT_TYPES[u].whole_layer]
    if mix and not (whole and len(whole) < len(args.units) and args.budget == "params"):
        why = (f"--budget {args.budget}" if whole and len(whole) < len(args.units) else f"--units {','.join(args.units)}")
        raise UserError(f"{flag(mix[0])} applies to the joint mix of whole layers and widths (--units with layers and "
                        f"kv_groups or channels, --budget params); this run has none ({why}): drop {flag(mix[0])}")


def _prune_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return parser._subparsers._group_actions[0].choices["prune"]


_UNSET = object()


def _given(argv: list[str] | None, dest: str) -> bool:
    """Whether the prune command line gives the setting `dest` (its flag in any of argparse's spellings)."""
    return bool(_given_of(argv, (dest,)))


def _given_of(argv: list[str] | None, dests: tuple[str, ...]) -> list[str]:
    """The settings among `dests` that the prune command line gives (one parse)."""
    probe = build_parser()
    _prune_parser(probe).set_defaults(**{dest: _UNSET for dest in dests})
    parsed = probe.parse_args(argv)
    return [dest for dest in dests if getattr(parsed, dest) is not _UNSET]


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except UserError as e:
        print(error_line(e), file=sys.stderr)
        return 2
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    import signal
    import threading

    def terminate(signum, frame):  # SIGTERM ends a command as Ctrl-C does: a prune run saves its last step
        raise KeyboardInterrupt

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, terminate) if in_main else None
    try:
        commands = {"prune": cmd_prune, "export": cmd_export, "eval": cmd_eval, "zeroshot": cmd_zeroshot,
                    "finetune": cmd_finetune, "measure": cmd_measure, "recover": cmd_recover}
        return commands[args.command](args)
    except UserError as e:
        print(error_line(e), file=sys.stderr)
        return 2
    except _Interrupted as e:
        print(str(e), file=sys.stderr)
        return 130
    except KeyboardInterrupt as e:
        print(interrupted_line(e, sys.argv[1:] if argv is None else argv), file=sys.stderr)
        return 130
    finally:
        if in_main:
            signal.signal(signal.SIGTERM, previous)
