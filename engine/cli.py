"""Command line: `python -m engine prune|eval ...`. Bad input ends in one line on stderr, exit 2."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from .config import BASELINES, ESTIMATORS, FINAL_MASKS, INITS, LAYER_INITS, LR_SCHEDULES, METHODS, PROB_MAPS, PruneConfig
from .errors import UserError
from .loading import DEFAULT_MODEL, DTYPES
from .units import SCOPES

D = PruneConfig()  # defaults, shown in --help


def _data_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--eval-data", default=None, help="WikiText-2 raw test: a .parquet/.raw/.txt file or a folder "
                   "(default: $PG_PRUNE_DATA_DIR or ../shared/data, else the hub)")
    p.add_argument("--eval-seqlen", type=int, default=D.eval_seqlen, help="tokens per evaluation window (default %(default)s)")
    p.add_argument("--max-windows", type=int, default=None, help="evaluate only the first N windows (default: all)")
    p.add_argument("--eval-batch-size", type=int, default=D.eval_batch_size, help="windows per forward (default %(default)s)")
    p.add_argument("--dtype", default=D.dtype, choices=list(DTYPES), help="weights dtype (default %(default)s)")
    p.add_argument("--device", default=D.device, help="cpu, cuda, cuda:N, or auto (accelerate device_map) (default %(default)s)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description="Policy-gradient structural pruning of LLMs.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("prune", help="learn masks over KV groups, MLP channels and layers, evaluate, export")
    p.add_argument("--model", default=D.model, help=f"{DEFAULT_MODEL} (packaged GGUF), a model folder, a .gguf file or a hub id")
    p.add_argument("--units", default=",".join(D.units), help="comma list of: heads (KV groups), channels (MLP), layers (whole decoder layers) (default %(default)s)")
    p.add_argument("--prune-ratio", type=float, default=D.prune_ratio, help="fraction of each unit pool removed (default %(default)s)")
    p.add_argument("--scope", default=D.scope, choices=SCOPES, help="global: budget shared across layers (learned per-layer split); uniform: same ratio per layer")
    p.add_argument("--method", default=D.method, choices=METHODS,
                   help="pg: policy gradient, forward passes only (default); gumbel: Gumbel-softmax masks trained by "
                        "back-propagation through the model (for comparison); metric: no optimisation, keep the top "
                        "units of the init metric (the one-shot baselines: Wanda-sp, magnitude-sp, random, Layerwise-PPL, SLEB)")
    p.add_argument("--init", default=D.init, choices=INITS,
                   help="initial scores of KV groups and channels (default %(default)s). taylor needs one backward pass "
                        "per init batch (LLM-Pruner's first-order importance); random-progressive starts random at "
                        "--progressive-increment pruning and raises the rate by that much per stage")
    p.add_argument("--layer-init", default=D.layer_init, choices=LAYER_INITS,
                   help="initial scores of whole layers (default %(default)s): layerwise-ppl = calibration loss with each "
                        "layer removed alone; sleb = greedy removal order")
    p.add_argument("--progressive-increment", type=float, default=D.progressive_increment,
                   help="random-progressive: prune-ratio step per stage (default %(default)s)")
    p.add_argument("--prob-map", default=D.prob_map, choices=PROB_MAPS, help="metric -> initial keep probability (default %(default)s)")
    p.add_argument("--score-const", type=float, default=D.score_const, help="score-const: s of metric-kept units (default %(default)s)")
    p.add_argument("--init-batches", type=int, default=D.init_batches, help="calibration batches for the init metric (default %(default)s)")
    p.add_argument("--steps", type=int, default=D.steps, help="policy-gradient steps (default %(default)s)")
    p.add_argument("--lr", type=float, default=D.lr, help="learning rate eta (default %(default)s, the paper's; short CPU runs do better near 0.02)")
    p.add_argument("--lr-schedule", default=D.lr_schedule, choices=LR_SCHEDULES, help="(default %(default)s)")
    p.add_argument("--batch-size", type=int, default=D.batch_size, help="calibration segments per step (default %(default)s)")
    p.add_argument("--seqlen", type=int, default=D.seqlen, help="tokens per calibration segment (default %(default)s)")
    p.add_argument("--num-mask-samples", type=int, default=D.num_mask_samples, help="N_s masks sampled per step (default %(default)s)")
    p.add_argument("--baseline", default=D.baseline, choices=BASELINES, help="variance-reducing baseline: moving-average (window T), leave-one-out (mean loss of the other samples of the batch), none (default %(default)s)")
    p.add_argument("--baseline-window", type=int, default=D.baseline_window, help="T of the moving-average baseline (default %(default)s)")
    p.add_argument("--estimator", default=D.estimator, choices=ESTIMATORS, help="paper: (m-s)/(s(1-s)); sqrt: the reference code's (m-s)/sqrt(s(1-s))/(N_s-1)")
    p.add_argument("--estimator-clamp", type=float, default=D.estimator_clamp, help="s clamped to [c, 1-c] inside the estimate (default %(default)s)")
    p.add_argument("--gumbel-temperature", type=float, default=D.gumbel_temperature, help="gumbel: temperature at the first step (default %(default)s)")
    p.add_argument("--gumbel-final-temperature", type=float, default=D.gumbel_final_temperature, help="gumbel: temperature at the last step (default %(default)s)")
    p.add_argument("--gumbel-straight-through", action="store_true", help="gumbel: hard masks forward, relaxed gradient backward")
    p.add_argument("--seed", type=int, default=D.seed)
    p.add_argument("--calib", default=None, help="C4-style JSON lines (.json/.jsonl[.gz]) file or folder (default: $PG_PRUNE_DATA_DIR/c4 or ../shared/data/c4, else the hub)")
    p.add_argument("--val-every", type=int, default=D.val_every, help="every N steps, held-out perplexity of the current hard mask (0: off; every 10th calibration document is held out)")
    p.add_argument("--val-batches", type=int, default=D.val_batches, help="held-out batches per check (default %(default)s)")
    p.add_argument("--final-mask", default=D.final_mask, choices=FINAL_MASKS, help="last: from the final scores; best-val: from the step whose hard mask validated best (needs --val-every)")
    p.add_argument("--checkpoint-every", type=int, default=D.checkpoint_every, help="save state every N steps (default %(default)s)")
    _data_args(p)
    p.add_argument("--out", required=True, help="run folder (config, metrics, masks, model/, results.json)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint (its saved config is used)")
    g.add_argument("--overwrite", action="store_true", help="replace the run in --out")

    e = sub.add_parser("eval", help="WikiText-2 perplexity of a model")
    e.add_argument("--model", default=DEFAULT_MODEL, help="a model folder (a pruned export too), a .gguf file, a hub id, or the default")
    _data_args(e)
    e.add_argument("--json", action="store_true", help="print one JSON object")
    return parser


def cmd_prune(args) -> int:
    from .pruner import CONFIG_FILE, PruneRun, check_out_dir

    out = Path(args.out)
    check_out_dir(out, args.resume, args.overwrite, clear=False)  # refuse early; delete nothing yet
    if args.resume:
        config = PruneConfig.load(out / CONFIG_FILE)
    else:
        fields = {f.name for f in dataclasses.fields(PruneConfig)}
        values = {k: v for k, v in vars(args).items() if k in fields}
        values["units"] = [u.strip() for u in args.units.split(",") if u.strip()]
        config = PruneConfig(**values)
    config.validate()
    run = PruneRun(config, out, log=lambda m: print(m, file=sys.stderr))
    # model and data loaded: only now may --overwrite remove the old run, not for a typo in an argument
    check_out_dir(out, args.resume, args.overwrite)
    results = run.run(resume=args.resume)
    if results["status"] == "done":
        print(f"perplexity ({results['eval_windows']} windows x {results['seqlen']} tokens): "
              f"dense {results['ppl_dense']:.2f} | init ({config.init}) {results['ppl_init']:.2f} | "
              f"pruned {results['ppl_pruned']:.2f}")
        print(f"parameters: {results['params_dense']:,} -> {results['params_pruned']:,}; "
              f"{results['seconds_per_step']:.2f} s/step; results in {out}")
    return 0


def cmd_eval(args) -> int:
    from .data import eval_windows, load_eval_text
    from .evaluate import perplexity
    from .loading import count_parameters, load_model, resolve_model

    for name in ("eval_seqlen", "eval_batch_size"):
        if getattr(args, name) < 1:
            raise UserError(f"{name.replace('_', ' ')} must be at least 1")
    if args.max_windows is not None and args.max_windows < 1:
        raise UserError("max windows must be at least 1")
    source = resolve_model(args.model)
    model, tok = load_model(source, args.dtype, args.device)
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and args.eval_seqlen > max_pos:
        raise UserError(f"eval seqlen {args.eval_seqlen} is beyond the model's {max_pos} positions")
    text, src = load_eval_text(args.eval_data)
    windows = eval_windows(tok, text, args.eval_seqlen, args.max_windows)
    ppl = perplexity(model, windows, args.eval_batch_size, progress=not args.json)
    result = {"model": args.model, "ppl": ppl, "eval_windows": int(windows.shape[0]), "seqlen": args.eval_seqlen,
              "eval_data": src, "params": count_parameters(model), "dtype": args.dtype}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"perplexity {ppl:.3f} on {result['eval_windows']} windows x {args.eval_seqlen} tokens "
              f"({result['params']:,} parameters, {args.dtype})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        return {"prune": cmd_prune, "eval": cmd_eval}[args.command](args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted; a prune run can continue with --resume", file=sys.stderr)
        return 130
