"""Perplexity: exp of the mean token cross-entropy over fixed windows."""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F

from ..model.loading import model_device


def token_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each row, (batch,), on the model's device; differentiable."""
    input_ids = input_ids.to(model_device(model))
    logits = model(input_ids=input_ids, use_cache=False).logits.float()  # no copy in float32
    return _row_losses(logits, input_ids)


def _row_losses(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean over positions 0..T-2 of each row of CE(logits[t], ids[t + 1]). The targets are shifted,
    not the logits: a shifted (rows x T x vocab) view would be copied whole before the cross-entropy
    (200 MB for 8 x 128 tokens of a 49k vocabulary), on every forward of a PG step."""
    rows, length = input_ids.shape
    targets = input_ids.roll(-1, dims=1)
    targets[:, -1] = -100  # the last position predicts nothing: ignored (its CE is 0)
    ce = F.cross_entropy(logits.view(rows * length, -1), targets.reshape(-1), reduction="none", ignore_index=-100)
    return ce.view(rows, length)[:, :-1].mean(1)


@torch.no_grad()
def decoder_forward(model, input_ids: torch.Tensor) -> None:
    """The decoder stack only (transformers' base_model), without the lm_head and the loss, for hooks that read
    the layers' activations: it saves about a quarter of a forward of a small model with a large vocabulary (the
    default model at one thread, 8 x 128 tokens: about 5.0 s against 7.0 s)."""
    model.base_model(input_ids=input_ids.to(model_device(model)), use_cache=False)


# Where a score needs no gradient, the LM head runs on HEAD_TOKENS token positions at a time, and each chunk's
# logits are reduced to a value per token before the next: the (rows x T x vocabulary) float32 logits and their
# log-softmax never exist whole (8 x 128 tokens of a 49k vocabulary: 200 MB each; 25 MB a chunk). The families this
# tool prunes (LLaMA, Mistral, Qwen2, Qwen3) compute their logits as the head of the decoder's last hidden state,
# nothing after it, so the values are the forward's.
HEAD_TOKENS = 128


def head_input(model, input_ids: torch.Tensor) -> torch.Tensor:
    """(rows, T, hidden) the LM head's input: the decoder stack's last hidden state (its final norm applied), from
    transformers' get_decoder() with the model's hooks as they are (a PEFT model's: its adapters inside)."""
    return model.get_decoder()(input_ids=input_ids.to(model_device(model)), use_cache=False).last_hidden_state


_HEAD_FLOAT32 = contextvars.ContextVar("head_float32", default=False)


@contextlib.contextmanager
def head_in_float32():
    """Within it, head_chunks runs the LM head outside any autocast, in float32 (the steps' bfloat16 forwards keep
    the logits their KL or CE reads exact to float32: engine/model/precision.py's step_precision)."""
    token = _HEAD_FLOAT32.set(True)
    try:
        yield
    finally:
        _HEAD_FLOAT32.reset(token)


def head_chunks(model, hidden: torch.Tensor, tokens: int | None = None):
    """(start, logits) for each chunk of at most `tokens` (HEAD_TOKENS) positions of `hidden` read row after row:
    start, the chunk's first position in that order; logits, (n, vocab) float32, the head of those positions
    (within head_in_float32, computed in float32 whatever autocast is on)."""
    tokens = tokens or HEAD_TOKENS
    flat, head = hidden.reshape(-1, hidden.shape[-1]), model.get_output_embeddings()
    autocast = torch.is_autocast_enabled(flat.device.type)
    exact = _HEAD_FLOAT32.get() and autocast
    # under autocast a plain head's weight is cast once for every chunk, not once a chunk as its forward would
    # (the same products: autocast casts the weight and the input to its dtype and multiplies them there)
    cast = autocast and not exact and type(head) is torch.nn.Linear and head.bias is None
    if cast:
        dtype = torch.get_autocast_dtype(flat.device.type)
        weight = head.weight.to(dtype)
    for start in range(0, flat.shape[0], tokens):
        if exact:  # (the with ends before the yield: the caller's code between chunks runs under its own autocast)
            with torch.autocast(flat.device.type, enabled=False):
                logits = head(flat[start:start + tokens].float())
        elif cast:
            logits = F.linear(flat[start:start + tokens].to(dtype), weight)
        else:
            logits = head(flat[start:start + tokens])
        yield start, logits.float()


def per_token(model, hidden: torch.Tensor, value, tokens: int | None = None) -> torch.Tensor:
    """(rows, T) float32: value(logits, start) -> (n,) for each of head_chunks' chunks of `hidden`."""
    out = torch.empty(hidden.shape[0] * hidden.shape[1], dtype=torch.float32, device=hidden.device)
    for start, logits in head_chunks(model, hidden, tokens):
        out[start:start + logits.shape[0]] = value(logits, start)
    return out.view(hidden.shape[:2])


def shifted_targets(input_ids: torch.Tensor) -> torch.Tensor:
    """Each position's next token, -100 (ignored) at the last position of each row, flattened row after row."""
    targets = input_ids.roll(-1, dims=1)
    targets[:, -1] = -100
    return targets.reshape(-1)


def ce_by_chunks(model, hidden: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """(rows,) mean over positions 0..T-2 of each row's next-token cross-entropy, the head run by chunks."""
    targets = shifted_targets(input_ids.to(hidden.device))

    def ce(logits, start):
        return F.cross_entropy(logits, targets[start:start + logits.shape[0]], reduction="none", ignore_index=-100)

    return per_token(model, hidden, ce)[:, :-1].mean(1)


@torch.no_grad()
def batch_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each row: (batch,), on the CPU (token_loss's values, the head by chunks)."""
    return ce_by_chunks(model, head_input(model, input_ids), input_ids).cpu()


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 8, progress: bool = False, loss=batch_loss) -> float:
    """ppl = exp(mean over windows of the mean token CE); windows all have the same length.
    loss(model, batch) -> each row's mean token CE (batch_loss, or a masked model's)."""
    batches = range(0, windows.shape[0], batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="perplexity", unit="batch", leave=False)
    losses = [loss(model, windows[i : i + batch_size]) for i in batches]
    return float(torch.exp(torch.cat(losses).double().mean()))
