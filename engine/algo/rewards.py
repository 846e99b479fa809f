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

from .evaluate import _row_losses, batch_loss, head_chunks, head_input, per_token, shifted_targets
from ..model.loading import model_device
from ..settings.registry import add_entry

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


def token_kl(logits: torch.Tensor, dense_logp: torch.Tensor) -> torch.Tensor:
    """(n,) KL(p_dense || p) at each of n positions, p = softmax(logits); both (n, vocab), float32."""
    return F.kl_div(F.log_softmax(logits, dim=-1), dense_logp, reduction="none", log_target=True).sum(-1)


def dense_rows(flat_dense: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """(n, vocab) the dense log-probabilities of positions start..start+n of rows that repeat the dense batch's
    (k copies one after another): a slice where the chunk lies in one copy, else the positions gathered."""
    first = start % flat_dense.shape[0]
    if first + n <= flat_dense.shape[0]:
        return flat_dense[first:first + n]
    return flat_dense[torch.arange(start, start + n, device=flat_dense.device) % flat_dense.shape[0]]


def row_kl(logits: torch.Tensor, dense_logp: torch.Tensor, rows_at_once: int = 1) -> torch.Tensor:
    """(rows,) mean over positions 0..T-2 of KL(p_dense || p) per row, p = softmax(logits). logits may hold k
    copies of the dense batch's rows one after another (k * rows_dense rows): each copy is compared with it. The
    log-softmax and the KL's terms are made `rows_at_once` rows at a time (never the whole batch's at once)."""
    rows, length, vocab = logits.shape
    flat_dense = dense_logp.reshape(-1, vocab)
    out = []
    for r in range(0, rows, rows_at_once):
        part = logits[r:r + rows_at_once]
        kl = token_kl(part.reshape(-1, vocab), dense_rows(flat_dense, r * length, part.shape[0] * length))
        out.append(kl.view(part.shape[0], length)[:, :-1].mean(1))
    return torch.cat(out)


class Reward:
    """A reward: `scorer(model, batch)` gives the function that scores the masked model on `batch` (rows of the
    batch, or copies of them). `held_out(mean)` is the figure a held-out check reports and compares."""

    name: ClassVar[str]
    needs_dense: ClassVar[bool] = False  # the scorer reads the dense model: compute it before the weights change
    # what scoring a token costs the plan (engine/plan/forecast.py), in LM heads (a token's hidden x vocabulary
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
        """(rows,) the reward of each row from logits already computed on ids."""
        raise NotImplementedError

    def token_values(self, batch: torch.Tensor):
        """value(logits, start) -> (n,) the reward at each of n positions (flattened row after row, from `start`)
        of `batch`, from their logits (n, vocab): what a held-out check reads beside the CE, chunk by chunk."""
        raise NotImplementedError

    @staticmethod
    def held_out(mean: float) -> float:
        raise NotImplementedError

    @torch.no_grad()
    def held_out_means(self, model, batches) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean token CE, mean reward) of the model as it is now over the batches, one forward per batch."""
        ce, score = [], []
        for b in batches:
            hidden = head_input(model, b)
            targets, reward = shifted_targets(b.to(hidden.device)), self.token_values(b)
            both = torch.empty(2, *b.shape, dtype=torch.float32, device=hidden.device)
            flat = both.view(2, -1)
            for start, logits in head_chunks(model, hidden):  # (the CE and the reward of each chunk of logits)
                end = start + logits.shape[0]
                flat[0, start:end] = F.cross_entropy(logits, targets[start:end], reduction="none", ignore_index=-100)
                flat[1, start:end] = reward(logits, start)
            ce.append(both[0, :, :-1].mean(1).cpu())
            score.append(both[1, :, :-1].mean(1).cpu())
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
# the one in use, the older ones dropped before a new one is made): 256 MiB is one batch of 8 x 128 tokens of a 49k
# vocabulary, all a step's N_s samples score. Every batch seen also keeps the LM head's input (rows x T x hidden,
# 1/85 of its log-probabilities on SmolLM2), from which its log-probabilities are computed again, exactly, when they
# were dropped: the head and the final norm are never pruned or refit. Before a bound the cache held 24 batches
# (4.8 GB; a 24-step run peaked at 7.5 GB); with two batches (512 MiB) and whole-batch logits it peaked at 3.8 GB.
DENSE_LOGP_BYTES = 256 << 20
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
        self._head_of = model  # (its head and final norm are never pruned nor refit: the head input gives them again)
        with torch.no_grad():
            hidden = head_input(model, batch)
        self.dense_forwards += 1
        self._hidden[key] = hidden
        while len(self._hidden) > self.keep:
            self._hidden.popitem(last=False)
        return self._keep(key, hidden)

    def _log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """(rows, T, vocab) float32 log-probabilities of the head of `hidden`, made chunk by chunk into one tensor
        (never a second one of its size)."""
        vocab = self._head_of.get_output_embeddings().weight.shape[0]
        out = torch.empty(hidden.shape[0] * hidden.shape[1], vocab, dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for start, logits in head_chunks(self._head_of, hidden):
                out[start:start + logits.shape[0]] = F.log_softmax(logits, dim=-1)
        return out.view(*hidden.shape[:2], vocab)

    def _recompute(self, key) -> torch.Tensor:
        """A dropped batch's log-probabilities from its kept LM head input: the forward's last product, bit for bit."""
        self._hidden.move_to_end(key)
        self.head_recomputes += 1
        return self._keep(key, self._hidden[key])

    def _keep(self, key, hidden: torch.Tensor) -> torch.Tensor:
        """The log-probabilities of `hidden`'s head, kept; older batches' dropped first, as many as the bound asks
        with the new one counted (the new one is kept in any case)."""
        need = hidden.shape[0] * hidden.shape[1] * self._head_of.get_output_embeddings().weight.shape[0] * 4
        while self._dense and sum(t.numel() * t.element_size() for t in self._dense.values()) + need > self.max_bytes:
            self._dense.popitem(last=False)
        self._dense[key] = logp = self._log_probs(hidden)
        return logp

    def prepare(self, model, batches) -> None:
        for b in batches:
            self.dense_logp(model, b)

    def scorer(self, model, batch):
        dense = self.dense_logp(model, batch)  # (computed here, before the masks' hooks are set)

        flat = dense.reshape(-1, dense.shape[-1])

        @torch.no_grad()
        def score(masked_model, ids):  # (the head by chunks: no logits of the whole batch at once)
            kl = per_token(masked_model, head_input(masked_model, ids),
                           lambda logits, start: token_kl(logits, dense_rows(flat, start, logits.shape[0])))
            return kl[:, :-1].mean(1).cpu()

        return score

    def rows(self, logits, ids, batch):
        return row_kl(logits, self._dense_of(batch))

    def token_values(self, batch):
        flat = self._dense_of(batch).reshape(-1, self._dense_of(batch).shape[-1])
        return lambda logits, start: token_kl(logits, dense_rows(flat, start, logits.shape[0]))

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
