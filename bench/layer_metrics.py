"""The layer metrics' shortcut against one full forward per removed layer, side by side in one process.

    python bench/layer_metrics.py [--model smollm2-135m-instruct] [--batches 1] [--batch-size 8] [--seqlen 128]
                                  [--removed 0] [--repeats 1]

Layerwise-PPL and every round of SLEB need the calibration loss with each remaining layer removed in turn.
The plain way runs the whole model once per candidate layer (`loss_without`); the engine records every
layer's input once and then runs only the layers after each candidate (`losses_without_each`). This prints
the seconds of both for one round over every candidate (after `--removed` layers are gone, as in a later SLEB
round), alternated `--repeats` times, and the largest difference between their losses.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from cli_common import positive, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--batches", type=positive(int), default=1)
    p.add_argument("--batch-size", type=positive(int), default=8)
    p.add_argument("--seqlen", type=positive(int), default=128)
    p.add_argument("--removed", type=int, default=0, help="layers already removed (the first ones; default %(default)s)")
    p.add_argument("--repeats", type=positive(int), default=1)
    args = p.parse_args()

    import torch

    from engine.model.arch import ModelAdapter
    from engine.data.text import CalibrationSampler, load_calibration_texts
    from engine.model.loading import load_model, resolve_model
    from engine.algo.metrics.layerwise_ppl import loss_without, losses_without_each

    model, tok = load_model(resolve_model(args.model))
    a = ModelAdapter.for_model(model)
    texts, _ = load_calibration_texts(None)
    sampler = CalibrationSampler(tok, texts, args.seqlen, args.batch_size, 0)
    batches = [sampler.next_batch() for _ in range(args.batches)]
    removed = list(range(args.removed))
    candidates = [i for i in range(a.num_layers) if i not in removed]
    seconds = {"one full forward per candidate": [], "shortcut": []}
    for _ in range(args.repeats):
        t = time.perf_counter()
        plain = {i: loss_without(a, batches, removed + [i]) for i in candidates}
        seconds["one full forward per candidate"].append(time.perf_counter() - t)
        t = time.perf_counter()
        short = losses_without_each(a, batches, removed, candidates)
        seconds["shortcut"].append(time.perf_counter() - t)
    base = statistics.median(seconds["one full forward per candidate"])
    print(f"model {args.model}, {args.batches} batch(es) of {args.batch_size} x {args.seqlen}, {len(candidates)} candidate "
          f"layers ({args.removed} removed), torch threads {torch.get_num_threads()}, median of {args.repeats}, "
          f"load average {'/'.join(f'{x:.2f}' for x in os.getloadavg())}")
    for name, s in seconds.items():
        print(f"  {name}: {statistics.median(s):.1f} s ({statistics.median(s) / base:.2f} x)")
    print(f"  largest loss difference: {max(abs(plain[i] - short[i]) for i in candidates):.2e}")


if __name__ == "__main__":
    run(main)
