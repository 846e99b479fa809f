"""Rewards: what a sampled mask's score L_j is, in a policy-gradient step and wherever the run compares masks on
calibration data (the joint mix, the held-out check of best-val). One registry entry per reward, chosen with
`--reward NAME`:

    ce   the masked model's mean next-token cross-entropy on the calibration text (the language-modelling loss)
    kl   the mean over tokens of KL(p_dense || p_masked): how far the masked model's next-token distribution is
         from the dense model's on the same text (EvoPress's and DarwinLM's fitness). The dense log-probabilities
         of a batch are computed once and shared by every mask sample scored on it.

A reward turns a batch into a scorer, `scorer(model, ids) -> (rows,)` on the CPU, that the executors call on the
masked model; rows of `ids` may repeat the batch (the batched executor runs N_s copies in one forward). Both
rewards score the same positions: 0..T-2 of each row (the last position predicts nothing in the CE). A held-out
value is the figure best-val compares (lower is better): the perplexity exp(mean CE) for ce, the mean KL for kl.
"""

from __future__ import annotations

import hashlib
import math
from collections import OrderedDict
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from .evaluate import _row_losses, batch_loss
from .loading import model_device
from .registry import add_entry

Scorer = Callable[[object, torch.Tensor], torch.Tensor]
REWARDS: dict[str, type["Reward"]] = {}


def register_reward(name: str):
    def add(cls):
        cls.name = name
        add_entry(REWARDS, name, cls, "reward")
        return cls

    return add


def logits_of(model, input_ids: torch.Tensor) -> torch.Tensor:
    """(rows, T, vocab) float32 logits of the model as it is now (hooks and all), on its device."""
    return model(input_ids=input_ids.to(model_device(model)), use_cache=False).logits.float()


def row_kl(logits: torch.Tensor, dense_logp: torch.Tensor) -> torch.Tensor:
    """(rows,) mean over positions 0..T-2 of KL(p_dense || p) per row, p = softmax(logits). logits may hold k
    copies of the dense batch's rows one after another (k * rows_dense rows): each copy is compared with it."""
    rows, length, vocab = logits.shape
    copies = rows // dense_logp.shape[0]
    logq = F.log_softmax(logits[:, :-1], dim=-1).view(copies, -1, length - 1, vocab)
    kl = F.kl_div(logq, dense_logp[None, :, :-1], reduction="none", log_target=True).sum(-1)
    return kl.reshape(rows, length - 1).mean(1)


class Reward:
    """A reward: `scorer(model, batch)` gives the function that scores the masked model on `batch` (rows of the
    batch, or copies of them). `held_out(mean)` is the figure a held-out check reports and compares."""

    name: ClassVar[str]
    needs_dense: ClassVar[bool] = False  # the scorer reads the dense model: compute it before the weights change
    # what scoring a token costs the plan (engine/plan.py), in LM heads (a token's hidden x vocabulary
    # multiply-adds at the float32 forward's rate): the softmax over the vocabulary is float32 work, as long as the
    # head is wide. Measured on 2 Zen 5 cores, SmolLM2 (8 x 128 tokens, 49,152 entries; its head 0.31 ms a token):
    # the CE 0.059 ms a token (0.105 from bfloat16 logits), the KL of 8 samples 0.49 ms, the dense log-softmax 0.063
    score_heads: ClassVar[float] = 0.2
    dense_heads: ClassVar[float] = 0.0  # ... of its dense target, once a batch (needs_dense: beside its forward)
    own_held_out: ClassVar[bool] = True  # its held-out value is not the perplexity (reported beside it)
    frozen: bool = False  # set while the model's weights are not the dense ones (RunMasks.weights)

    def scorer(self, model, batch: torch.Tensor) -> Scorer:
        raise NotImplementedError

    def rows(self, logits: torch.Tensor, ids: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        """(rows,) the reward of each row from logits already computed on ids (a held-out check computes the
        CE and the reward from one forward)."""
        raise NotImplementedError

    @staticmethod
    def held_out(mean: float) -> float:
        raise NotImplementedError

    @torch.no_grad()
    def held_out_means(self, model, batches) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean token CE, mean reward) of the model as it is now over the batches, one forward per batch."""
        ce, score = [], []
        for b in batches:
            logits = logits_of(model, b)
            ce.append(_row_losses(logits, b.to(logits.device)).cpu())
            score.append(self.rows(logits, b, b).cpu())
        return torch.cat(ce).double().mean(), torch.cat(score).double().mean()

    def prepare(self, model, batches) -> None:
        """Compute what the scorer needs from the dense model for these batches now (before weights change)."""


@register_reward("ce")
class CrossEntropy(Reward):
    own_held_out = False
    def scorer(self, model, batch):
        return batch_loss  # (the very function the executors always called: ce is today's loss, bit for bit)

    def rows(self, logits, ids, batch):
        return _row_losses(logits, ids.to(logits.device))

    @staticmethod
    def held_out(mean: float) -> float:
        return math.exp(mean)

    def held_out_means(self, model, batches):
        loss = torch.cat([batch_loss(model, b) for b in batches]).double().mean()  # (as validation always did)
        return loss, loss


def batch_key(batch: torch.Tensor) -> tuple:
    return tuple(batch.shape), hashlib.sha1(batch.cpu().contiguous().numpy().tobytes()).hexdigest()


# What the KL reward's dense targets may hold in memory as full log-probabilities (the last batches', at least
# one): 512 MiB is two batches of 8 x 128 tokens of a 49k vocabulary. Every batch seen also keeps the LM head's input
# (rows x T x hidden, 1/85 of its log-probabilities on SmolLM2), from which its log-probabilities are computed again,
# exactly, when they were dropped: the head and the final norm are never pruned or refit. Before this bound the
# cache held 24 batches (4.8 GB; a 24-step run peaked at 7.5 GB, though a step's batch is never scored again).
DENSE_LOGP_BYTES = 512 << 20
DENSE_HIDDEN_BATCHES = 64


@register_reward("kl")
class DenseKL(Reward):
    """KL(p_dense || p_masked) per token. The dense log-probabilities of the last batches stay in memory up to
    `max_bytes` (float32: rows x T x vocab x 4 bytes, 200 MB for 8 x 128 tokens of a 49k vocabulary), so that a
    step's N_s samples, or the joint mix's candidates on the same batches, share one dense forward; the LM head's
    input of the last `keep` batches stays too, and gives a dropped batch's log-probabilities again at the cost of
    the head alone (no forward, and allowed while the weights are edited)."""

    needs_dense = True
    score_heads, dense_heads = 1.6, 0.2

    def __init__(self, keep: int = DENSE_HIDDEN_BATCHES, max_bytes: int = DENSE_LOGP_BYTES):
        self.keep, self.max_bytes = keep, max_bytes
        self._dense, self._hidden = OrderedDict(), OrderedDict()
        self.dense_forwards = 0  # (counted: tests and the step-cost figures read it)
        self.head_recomputes = 0

    def cached_bytes(self) -> int:
        """What the dense targets hold now: the log-probabilities and the LM head's inputs."""
        return sum(t.numel() * t.element_size() for d in (self._dense, self._hidden) for t in d.values())

    def dense_logp(self, model, batch: torch.Tensor) -> torch.Tensor:
        key = batch_key(batch)
        if key in self._dense:
            self._dense.move_to_end(key)
            return self._dense[key]
        if key in self._hidden:
            return self._recompute(key)
        if self.frozen:
            raise RuntimeError("the kl reward's dense target was asked for while the weights are edited: "
                               "prepare() the batches first")
        self._head = model.get_output_embeddings()  # (never pruned nor refit: its input gives the logits again)
        seen = []
        hook = self._head.register_forward_hook(lambda m, inputs, out: seen.append(inputs[0].detach()))
        try:
            with torch.no_grad():
                logp = F.log_softmax(logits_of(model, batch), dim=-1)
        finally:
            hook.remove()
        self.dense_forwards += 1
        self._hidden[key] = seen[-1]
        while len(self._hidden) > self.keep:
            self._hidden.popitem(last=False)
        return self._keep(key, logp)

    def _recompute(self, key) -> torch.Tensor:
        """A dropped batch's log-probabilities from its kept LM head input: the forward's last product, bit for bit."""
        self._hidden.move_to_end(key)
        with torch.no_grad():
            logp = F.log_softmax(self._head(self._hidden[key]).float(), dim=-1)
        self.head_recomputes += 1
        return self._keep(key, logp)

    def _keep(self, key, logp: torch.Tensor) -> torch.Tensor:
        self._dense[key] = logp
        while len(self._dense) > 1 and sum(t.numel() * t.element_size() for t in self._dense.values()) > self.max_bytes:
            self._dense.popitem(last=False)
        return logp

    def prepare(self, model, batches) -> None:
        for b in batches:
            self.dense_logp(model, b)

    def scorer(self, model, batch):
        dense = self.dense_logp(model, batch)  # (computed here, before the masks' hooks are set)

        @torch.no_grad()
        def score(masked_model, ids):
            return row_kl(logits_of(masked_model, ids), dense).cpu()

        return score

    def rows(self, logits, ids, batch):
        return row_kl(logits, self._dense_of(batch))

    def _dense_of(self, batch):
        """A prepared batch's dense log-probabilities (from the kept head input, where they were dropped)."""
        key = batch_key(batch)
        if key in self._dense:
            return self._dense[key]
        if key not in self._hidden:
            raise KeyError("the kl reward's dense target of this batch was never computed: prepare() it first")
        return self._recompute(key)

    @staticmethod
    def held_out(mean: float) -> float:
        return mean
