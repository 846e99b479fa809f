"""The masks a run takes from its scores (its budget schedule, the hooks' mask transforms in engine.hooks'
MASK_TRANSFORMS order) and what a mask costs in perplexity."""

from __future__ import annotations

import time
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING

import torch

from ..algo.context import KEEP
from ..storage import ppl_cache
from ..algo.evaluate import batch_loss, perplexity
from ..model.loading import model_device
from ..algo.policy import LR_SCHEDULE_FNS, stage_at
from ..model.precision import pass_precision, run_eval_dtype

if TYPE_CHECKING:  # annotations only
    from .resources import RunResources


def mask_key(flat_masks: dict[str, torch.Tensor] | None, comp_means) -> tuple:
    """What a perplexity depends on besides the run's model and windows: the hard masks' values (None: dense)
    and the compensation asked for (the run's, KEEP, or another object)."""
    if flat_masks is None:
        return (None,)
    return (tuple((u, (m > 0.5).numpy().tobytes()) for u, m in sorted(flat_masks.items())),
            "run" if comp_means is KEEP else id(comp_means))


class RunMasks:
    """The run's masks, made before its RunResources (which hold them) and bound to them once (bind)."""

    def __init__(self, transforms: list[tuple[str, object]] = ()):
        # transforms: (transform, hook) in the order they apply (engine.hooks.joined_transforms: MASK_TRANSFORMS' order)
        self.res: "RunResources | None" = None
        self.transforms = list(transforms)
        self.measured: dict[tuple, float] = {}  # mask_key -> perplexity, within this process
        self.longest_eval = 0.0  # wall seconds of the longest evaluation (--time-budget's reserve for the last one)

    def bind(self, res: "RunResources") -> "RunMasks":
        """The resources these masks are taken under (once, as the run is built)."""
        self.res = res
        return self

    def each(self, transform: str) -> list:
        """The hooks whose `transform` applies, in their order."""
        return [hook for name, hook in self.transforms if name == transform]

    def keep_ratio_at(self, step: int) -> float:
        """The budget at 0-based `step`: the target, or the current stage's (progressive)."""
        return 1.0 - stage_at(self.res.loop.stages, step, self.res.ctx.steps)[0]

    def lr_at(self, step: int) -> float:
        """The learning-rate schedule over the run, or over each stage (progressive)."""
        _, into, length = stage_at(self.res.loop.stages, step, self.res.ctx.steps)  # (the planned count: --time-budget stretches it)
        return LR_SCHEDULE_FNS[self.res.config.lr_schedule](self.res.config.lr, into, length)

    def hard_masks(self, scores: dict[str, torch.Tensor], keep_ratio: float | None = None) -> dict[str, torch.Tensor]:
        keep = self.res.config.keep_ratio if keep_ratio is None else keep_ratio
        masks = self.res.budget.hard_masks(scores, keep)
        for hook in self.each("hard_masks"):
            masks = hook.hard_masks(masks, scores)
        return masks

    def init_masks(self, state) -> dict[str, torch.Tensor] | None:
        """The init mask: the one the init perplexity measures (engine/run/initialise.py's fresh_state); None for a
        state that holds neither the init mask's scores nor the init metric."""
        scores = state.init_mask_scores or state.init_metric
        return None if scores is None else self.hard_masks(scores)

    def final_scores(self, state, scores: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The scores the final mask is cut from: the method's, then the hooks' (best-val's)."""
        for hook in self.each("final_scores"):
            scores = hook.final_scores(state, scores)
        return scores

    def final_masks(self, scores: dict[str, torch.Tensor], metric: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """The deterministic final masks: the top keep ratio of the scores per pool (then the hooks')."""
        masks = self.hard_masks(scores)
        for hook in self.each("final_masks"):
            masks = hook.final_masks(masks, metric)
        return masks

    @contextmanager
    def weights(self, masks: dict[str, torch.Tensor]):
        """The model as the run evaluates and exports this hard mask (every hook's weights_for: --reconstruct refits
        its kept columns), and the compensation means that go with it (... for the run's own). A hook that edits the
        weights sets the perplexities measured so far aside until they are restored (none of them holds there)."""
        reward = self.res.ctx.reward
        with ExitStack() as stack:
            comp_means = KEEP
            for hook in self.each("weights_for"):
                comp_means = stack.enter_context(hook.weights_for(masks, comp_means))
                if hook.edits_weights:
                    stack.enter_context(self.set_aside())
            was, reward.frozen = reward.frozen, True  # (a dense target would read edited weights)
            try:
                yield comp_means
            finally:
                reward.frozen = was

    @contextmanager
    def set_aside(self):
        """The perplexities measured so far, set aside (an empty record in their place) and brought back after."""
        outside, self.measured = self.measured, {}
        try:
            yield
        finally:
            self.measured = outside

    def layer_masks(self, flat: dict[str, torch.Tensor]) -> dict[str, list[torch.Tensor]]:
        return {u: self.res.layout.split(u, m) for u, m in flat.items()}

    def cached_dense(self) -> tuple[str | None, float | None, float | None]:
        """(the dense perplexity's cache key, the cached figure the run takes, its seconds): the figure is None
        when the cache has none for this model's files, dtype, device and windows, or when a budgeted run that
        evaluates nothing before its last evaluation needs the evaluation's seconds (its reserve for the last
        one) and the entry, from before the cache kept them, has none: it is measured again, once."""
        r, c = self.res, self.res.config
        fingerprint = ppl_cache.model_fingerprint(r.source.path, r.source.gguf_file) if r.from_disk else None
        evals = run_eval_dtype(c, r.model)  # (a dense figure in another dtype than the weights' is its own entry)
        dtype = c.dtype if evals == c.dtype else f"{c.dtype}, evaluated in {evals}"
        key = ppl_cache.dense_key(fingerprint, dtype, c.device, r.windows) if fingerprint else None
        cached = ppl_cache.lookup(key) if key else None
        seconds = ppl_cache.lookup_seconds(key) if cached is not None else None
        if cached is not None and not (seconds is not None or c.evaluates_init or c.time_budget is None):
            cached = None
        return key, cached, seconds

    def dense_perplexity(self) -> float:
        """The dense model's perplexity, from the cache (engine/storage/ppl_cache.py) when this model's files, dtype,
        device and windows were evaluated before."""
        r = self.res
        key, cached, seconds = self.cached_dense()
        if cached is not None:
            r.log(f"dense perplexity: {cached:.3f} (cached: the same model files and windows were evaluated before)")
            self.measured[mask_key(None, KEEP)] = cached
            self.longest_eval = max(self.longest_eval, seconds or 0.0)
            return cached
        t0 = time.monotonic()
        ppl = self.masked_perplexity(None, "dense")
        if key:
            ppl_cache.store(key, ppl, time.monotonic() - t0)
        return ppl

    def masked_perplexity(self, flat_masks: dict[str, torch.Tensor] | None, what: str, comp_means=KEEP) -> float:
        """WikiText perplexity of the dense model (None) or under one hard mask, computed by the run's executor
        (the sliced one computes only the kept units): exp of the mean over windows of each window's mean loss.
        comp_means: compensation means other than the run's (None: none). A mask evaluated before in this process (a
        one-shot method's final mask is its init mask; best-val often returns it) is not evaluated again."""
        key = mask_key(flat_masks, comp_means)
        if key in self.measured:
            self.res.log(f"{what} perplexity: {self.measured[key]:.3f} (the same mask as evaluated before)")
            return self.measured[key]
        self.res.log(f"evaluating {what} perplexity on {self.res.windows.shape[0]} windows of {self.res.config.eval_seqlen} tokens")

        def masked_loss(model, batch):  # the executor gives the batch's mean; every row counts it once
            return self.res.ctx.losses({u: m[None] for u, m in flat_masks.items()}, batch, comp_means).expand(batch.shape[0])

        t0 = time.monotonic()
        evals = run_eval_dtype(self.res.config, self.res.model)
        with self.res.phases("evaluations"), pass_precision(evals, model_device(self.res.model).type):
            ppl = perplexity(self.res.model, self.res.windows, self.res.config.eval_batch_size, self.res.loop.progress,
                             batch_loss if flat_masks is None else masked_loss)
        self.longest_eval = max(self.longest_eval, time.monotonic() - t0)
        self.res.log(f"{what} perplexity: {ppl:.3f}")
        self.measured[key] = ppl
        return ppl
