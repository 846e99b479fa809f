"""Perplexity: exp of the mean token cross-entropy over fixed windows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .loading import model_device


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


@torch.no_grad()
def batch_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each row: (batch,), on the CPU."""
    return token_loss(model, input_ids).cpu()


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
