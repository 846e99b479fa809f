"""The final evaluation in bfloat16 against float32 (issue 65, item 2): each model's WikiText-2 perplexity computed
both ways on the same windows, one after the other in one process, with the seconds each took. The engine keeps a
float32 evaluation unless bfloat16 is within --tolerance (0.2 %) on every model measured.

    python bench/eval_dtype.py MODEL_DIR [MODEL_DIR ...] [--max-windows 256] [--seqlen 128] [--threads 2]
    python bench/eval_dtype.py --default-model runs/a/model runs/b/model     # the dense default model too

bfloat16 is torch's autocast on the CPU (engine/model/precision.py: the matrix products in bfloat16, the weights and
the sums in float32), as the one-shot passes run; on a CPU without native bfloat16 it is slower, not faster.
Prints a table: model, float32 perplexity and seconds, bfloat16 perplexity and seconds, the relative change.
"""

from __future__ import annotations

import argparse
import time

from cli_common import positive, run


def measure(model, windows, dtype: str) -> tuple[float, float]:
    """(perplexity, seconds) of `model` on `windows` with its matrix products in `dtype`."""
    from engine.algo.evaluate import perplexity
    from engine.model.precision import pass_precision

    t0 = time.monotonic()
    with pass_precision(dtype, "cpu"):
        ppl = perplexity(model, windows, 8)
    return ppl, time.monotonic() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", help="model folders (transformers' save_pretrained: a run's model/)")
    ap.add_argument("--default-model", action="store_true", help="the dense default model first")
    ap.add_argument("--max-windows", type=positive(int), default=256)
    ap.add_argument("--seqlen", type=positive(int), default=128)
    ap.add_argument("--threads", type=positive(int), default=2)
    ap.add_argument("--tolerance", type=positive(float), default=0.002, help="relative (0.002: 0.2 %%)")
    args = ap.parse_args()
    import torch

    from engine.data.text import eval_windows, load_eval_text
    from engine.errors import UserError
    from engine.model.loading import DEFAULT_MODEL, load_model, resolve_model
    from engine.model.precision import native_bf16_cpu

    names = (["default model"] if args.default_model else []) + list(args.models)
    if not names:
        raise UserError("name at least one model folder, or --default-model")
    torch.set_num_threads(args.threads)
    print(f"CPU with native bfloat16: {native_bf16_cpu()}; {args.threads} threads; WikiText-2 raw test, "
          f"{args.max_windows} x {args.seqlen} tokens")
    print("| model | float32 ppl | s | bfloat16 ppl | s | change |\n|---|---|---|---|---|---|")
    worst = 0.0
    for name in names:
        model, tokenizer = load_model(resolve_model(DEFAULT_MODEL if name == "default model" else name), "float32", "cpu")
        windows = eval_windows(tokenizer, load_eval_text()[0], args.seqlen, args.max_windows)
        (p32, s32), (p16, s16) = measure(model, windows, "float32"), measure(model, windows, "bfloat16")
        change = p16 / p32 - 1.0
        worst = max(worst, abs(change))
        print(f"| {name} | {p32:.3f} | {s32:.1f} | {p16:.3f} | {s16:.1f} | {100 * change:+.3f} % |", flush=True)
    verdict = "within" if worst <= args.tolerance else "NOT within"
    print(f"largest change {100 * worst:.3f} %: {verdict} {100 * args.tolerance:g} %")


if __name__ == "__main__":
    run(main)
