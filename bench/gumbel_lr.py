"""How large the Gumbel-softmax gradient is next to the policy-gradient estimate, at the same scores.

    python bench/gumbel_lr.py [--model smollm2-135m-instruct] [--prune-ratio 0.3] [--batches 4] [--lr 0.02]

The PG estimate (L - delta)(m - s)/(s(1 - s)) has the size of a loss difference for every unit,
however small the unit; the back-propagated d loss / d s of one MLP channel is tiny. So one learning
rate cannot serve both. This measures, on calibration batches only (never the evaluation text),
the mean |g| of each estimator per unit type at the Wanda-sp initial scores, and prints the Gumbel
learning rate that gives its first steps the same mean |step| as PG's at --lr: that is how
`bench/paper_tables.py --gumbel-lr` was chosen.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile

from cli_common import positive, run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--prune-ratio", type=float, default=0.3)
    p.add_argument("--batches", type=positive(int), default=4)
    p.add_argument("--lr", type=positive(float), default=0.02, help="the PG learning rate to match")
    args = p.parse_args()

    import torch

    from engine.settings.config import PruneConfig
    from engine.algo.methods import METHODS, method_options
    from engine.run.loop import PruneRun
    from engine.run.initialise import fresh_state

    torch.manual_seed(0)
    config = PruneConfig.of(model=args.model, prune_ratio=args.prune_ratio, init="wanda-sp", max_windows=1, steps=100,
                         baseline="leave-one-out")
    run = PruneRun(config, tempfile.mkdtemp(), log=lambda m: None)
    run.res.loop.progress = False
    state = fresh_state(run.res, run.call_hooks)
    gumbel = METHODS["gumbel"](run.res.ctx, method_options("gumbel", {}))  # the same run, the other method's estimate
    pg = {u: [] for u in state.scores}
    gs = {u: [] for u in state.scores}
    for _ in range(args.batches):
        g_pg = run.res.method.gradient(state, run.res.sampler.next_batch()).grads
        g_gs = gumbel.gradient(state, run.res.sampler.next_batch()).grads
        for u in state.scores:
            pg[u].append(float(g_pg[u].abs().mean()))
            gs[u].append(float(g_gs[u].abs().mean()))
    print(f"model {args.model}, prune ratio {args.prune_ratio}, {args.batches} calibration batches, "
          f"N_s {config.num_mask_samples} (PG with leave-one-out baseline, so no warm-up of a moving average)")
    ratios = []
    for u in state.scores:
        a, b = sum(pg[u]) / len(pg[u]), sum(gs[u]) / len(gs[u])
        if a > 0 and b > 0:
            ratios.append(a / b)
            print(f"{u:9s} mean |g|  PG {a:.3e}   Gumbel {b:.3e}   ratio {a / b:,.1f}")
        else:  # e.g. PG with N_s = 2 when both samples drew the same mask of a small unit type
            print(f"{u:9s} mean |g|  PG {a:.3e}   Gumbel {b:.3e}   (a zero: left out; try more --batches)")
    if not ratios:
        sys.exit("error: every unit type had a zero gradient on these batches; try more --batches")
    ratio = statistics.geometric_mean(ratios)
    print(f"geometric mean ratio {ratio:,.1f}: Gumbel lr matching PG at lr {args.lr}: {args.lr * ratio:.3g}")


if __name__ == "__main__":
    run(main)
