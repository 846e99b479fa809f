"""How fast the dense model's own text is sampled (issue 65, item 5: the own text at 50 % in 90 s on a first run):
`--calib-source self`'s generation (engine/data/calib_sources.py's sample_documents, the run's own code) timed for each
batch size and dtype asked, on the same prompts, one after the other in one process, beside the probe's ms per
token of a dense forward in float32 and bfloat16 (so that figures from other machines read side by side).

    python bench/self_text_speed.py [--model smollm2-135m-instruct] [--docs 128] [--tokens 256] \
        [--batches 32,128] [--dtypes float32,auto] [--threads 2]

A row per (batch, dtype): seconds, ms per sampled token, and the speed-up over the first row. The default run
samples 256 documents of 256 tokens (--self-docs, --self-tokens); --docs 128 times half of them (the rate per
token, which is what a batch size changes, is the same). auto is bfloat16 on a CPU that runs it natively
(engine/model/precision.py), float32 elsewhere.
"""

from __future__ import annotations

import argparse
import time

from cli_common import csv_list, positive, run



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--docs", type=positive(int), default=128, help="documents sampled per row")
    ap.add_argument("--tokens", type=positive(int), default=256, help="tokens sampled per document")
    ap.add_argument("--batches", type=csv_list(int, lambda v: v > 0, "batch sizes above 0"), default=[32, 128],
                    help="--self-batch values")
    ap.add_argument("--dtypes", type=csv_list(str, bool, "dtype names"), default=["float32", "auto"],
                    help="--self-dtype values: auto, float32, bfloat16")
    ap.add_argument("--threads", type=positive(int), default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    import torch

    from engine.data.calib_sources import prompts, sample_documents
    from engine.data.text import load_calibration_texts
    from engine.model.loading import load_model, resolve_model
    from engine.plan.forecast import probe_seconds_per_token, skeleton_of
    from engine.errors import UserError
    from engine.model.precision import PASS_DTYPES, native_bf16_cpu, resolve_pass_dtype

    for d in args.dtypes:  # (checked here, against the engine's list: importing it loads torch, too slow for --help)
        if d not in PASS_DTYPES:
            raise UserError(f"--dtypes: {d!r} is not one of {', '.join(PASS_DTYPES)}")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(resolve_model(args.model), "float32", "cpu")
    model.eval()
    skeleton = skeleton_of(model, args.model)
    probe = {p: probe_seconds_per_token(skeleton, "float32", 8, 128, model=model, passes=p) * 1e3
             for p in ("float32", "bfloat16")}
    texts, _ = load_calibration_texts(None)
    ids = prompts(tokenizer, texts, args.docs, args.seed)
    print(f"{args.model}: {args.docs} documents x {args.tokens} tokens a row; {args.threads} threads; CPU with native "
          f"bfloat16: {native_bf16_cpu()}; probe {probe['float32']:.2f} ms a token (float32), "
          f"{probe['bfloat16']:.2f} (bfloat16)")
    print("| batch | dtype | seconds | ms per token | speed-up |\n|---|---|---|---|---|")
    first = None
    for batch in args.batches:
        for asked in args.dtypes:
            dtype = resolve_pass_dtype(asked, "float32", "cpu")
            t0 = time.monotonic()
            docs = sample_documents(model, tokenizer, ids, args.tokens, 1.0, args.seed, log=lambda m: None,
                                    batch_size=batch, dtype=dtype)
            seconds = time.monotonic() - t0
            assert len(docs) == args.docs
            first = first or seconds
            shown = asked if asked == dtype else f"{asked} ({dtype})"
            print(f"| {batch} | {shown} | {seconds:.1f} | {1e3 * seconds / (args.docs * args.tokens):.2f} | "
                  f"{first / seconds:.2f}x |", flush=True)


if __name__ == "__main__":
    run(main)
