"""Perplexity: exp of the mean token cross-entropy over fixed windows."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .loading import model_device


def token_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each row, (batch,), on the model's device; differentiable."""
    input_ids = input_ids.to(model_device(model))
    logits = model(input_ids=input_ids, use_cache=False).logits[:, :-1].float()
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), input_ids[:, 1:].reshape(-1), reduction="none")
    return ce.view(input_ids.shape[0], -1).mean(1)


@torch.no_grad()
def batch_loss(model, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy of each row: (batch,), on the CPU."""
    return token_loss(model, input_ids).cpu()


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch_size: int = 8, progress: bool = False) -> float:
    """ppl = exp(mean over windows of the mean token CE); windows all have the same length."""
    batches = range(0, windows.shape[0], batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, desc="perplexity", unit="batch", leave=False)
    losses = [batch_loss(model, windows[i : i + batch_size]) for i in batches]
    return float(torch.exp(torch.cat(losses).double().mean()))
