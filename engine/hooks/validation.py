"""`--val-every N`: the held-out perplexity of the current hard mask every N steps and at the last step, and of
the init mask at step 0 (every 10th calibration document is held out); the best step and its scores are kept
in the state, for --final-mask best-val. With --val-refit (the default) each mask is validated as the run would
export it (RunMasks.weights: with --reconstruct, its kept columns refit), so that best-val chooses among the
models it could export. A later mask becomes the best only when it beats the best so far by more
than --best-val-margin (relative perplexity), so that a gain within the noise of a few held-out batches does not
trade a measured mask for an unmeasured one. A check whose hard mask is the one checked last (a short run's steps
often leave it) reuses that perplexity: the held-out batches and the refit would give the same figure again."""

from __future__ import annotations

from contextlib import ExitStack

import torch

from ..algo.context import KEEP
from ..run.masks import mask_key
from ..run.state import check_finite
from .base import RunHook


def improves(ppl: float, best: float | None, margin: float) -> bool:
    """Whether a held-out perplexity takes the place of the best so far: lower by more than the margin (relative)."""
    return best is None or ppl < best * (1.0 - margin)


class Validation(RunHook):
    @staticmethod
    def applies(config) -> bool:
        return config.validates

    last: tuple | None = None  # (the mask key of the last check, its held-out perplexity and reward value)
    value: float | None = None  # the reward's held-out value of the last check (its perplexity for ce)

    def validate(self, state) -> float:
        run = self.run
        masks = run.hard_masks(state.scores)
        key = mask_key(masks, KEEP)
        if self.last is not None and self.last[0] == key:
            return self.record(state, *self.last[1:])
        reward = run.ctx.reward
        with ExitStack() as stack:
            stack.enter_context(run.phases("validation"))
            reward.prepare(run.model, run.val_batches)  # (kl: the dense model's part, before a refit edits weights)
            comp_means = stack.enter_context(run.masks.weights(masks)) if run.config.val_refit else KEEP
            stack.enter_context(run.ctx.masked(masks, comp_means))
            ce, score = reward.held_out_means(run.model, run.val_batches)
        ppl, value = float(torch.exp(ce)), reward.held_out(float(score))
        self.last = (key, ppl, value)
        return self.record(state, ppl, value)

    def record(self, state, ppl: float, value: float | None = None) -> float:
        """Best-val's bookkeeping of one check: `value` is the run's reward on the held-out batches (the
        perplexity itself for ce; state.best_val keeps that value); returns the held-out perplexity."""
        value = ppl if value is None else value
        self.value = value
        if improves(value, state.best_val, self.run.config.best_val_margin):
            self.own(state).update(best_val=value, best_step=state.step,
                                   best_scores={u: s.clone() for u, s in state.scores.items()})
        return ppl

    def on_init(self, state, batches) -> None:  # the init mask is best-val's first candidate
        self.own(state)["val_ppl_init"] = self.validate(state)
        self.run.log(f"held-out perplexity of the init mask: {state.val_ppl_init:.3f}")

    def on_step(self, state, report) -> None:
        c = self.run.config
        if state.step % c.val_every == 0 or state.step == self.run.ctx.steps:
            report.val_ppl = self.validate(state)
            report.val_reward = self.value if self.run.ctx.reward.own_held_out else None
            check_finite(f"step {state.step}", {}, {"held-out perplexity": report.val_ppl})
