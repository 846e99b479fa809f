"""Sizes that will not fit, refused before they are allocated (a huge --batch-size ended in a
`DefaultCPUAllocator: can't allocate memory` traceback after the model and the data had loaded).

The largest tensors a run makes are the logits of one forward, rows x seqlen x vocabulary floats, and the
cross-entropy's log-probabilities of the same size (engine/algo/evaluate.py): a lower bound on a forward's memory,
whatever else it holds. A run whose step or evaluation forward needs more than the memory available (Linux's
MemAvailable, capped by an address-space limit; a GPU's free memory) cannot finish, and is refused in one line."""

from __future__ import annotations

import resource

import torch

from ..errors import UserError

LOGIT_BYTES = 4  # the loss reads the logits in float32 (evaluate.token_loss)
LOGIT_COPIES = 2  # the logits and the cross-entropy's log-softmax of them


def forward_bytes(rows: int, seqlen: int, vocab: int) -> int:
    """A lower bound on one forward's memory: its logits and their log-softmax, in float32."""
    return LOGIT_COPIES * LOGIT_BYTES * rows * seqlen * vocab


def available_bytes(device: str = "cpu") -> int | None:
    """Memory this process can still get on `device`: a GPU's free memory, else MemAvailable (Linux), capped by
    RLIMIT_AS when one is set; None where unknown."""
    if str(device).startswith("cuda") and torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    found = None
    try:
        with open("/proc/meminfo") as f:
            found = next((int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemAvailable:")), None)
    except OSError:
        pass
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    if limit != resource.RLIM_INFINITY:
        found = limit if found is None else min(found, limit)
    return found


def gib(n: int) -> str:
    """A size in GiB, or in MiB under one GiB (a test's or a tiny model's sizes)."""
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def check_forwards_fit(forwards: dict[str, tuple[int, int]], vocab: int, available: int | None) -> None:
    """forwards: what -> (rows, seqlen) of a forward the run makes. Refused (UserError) when one needs more than
    `available` bytes (None: unknown, nothing refused), naming the sizes to lower."""
    if available is None:
        return
    for what, (rows, seqlen) in forwards.items():
        need = forward_bytes(rows, seqlen, vocab)
        if need > available:
            raise UserError(f"{what} of {rows:,} x {seqlen:,} tokens needs at least {gib(need)} for its logits "
                            f"({vocab:,}-token vocabulary), more than the {gib(available)} available; lower them")


def vocab_of(model) -> int:
    """The rows of the model's output layer (its logits' last dimension)."""
    head = model.get_output_embeddings()
    return int(head.weight.shape[0]) if head is not None else int(model.config.vocab_size)


def check_eval_fits(model, windows: int, batch_size: int, seqlen: int, device: str) -> None:
    """`eval`'s forwards: batches of --eval-batch-size of the `windows` evaluation windows."""
    check_forwards_fit({"an evaluation batch (--eval-batch-size x --eval-seqlen)": (min(batch_size, windows), seqlen)},
                       vocab_of(model), available_bytes(device))


def check_run_fits(config, model) -> None:
    """A prune run's forwards: a step's (its calibration batch; the batched executor repeats it per mask sample,
    so this is the least) and an evaluation's (no more rows than --max-windows), against config.device's memory."""
    vocab = vocab_of(model)
    eval_rows = min(config.eval_batch_size, config.max_windows or config.eval_batch_size)
    check_forwards_fit({"a step's batch (--batch-size x --seqlen)": (config.batch_size, config.seqlen),
                        "an evaluation batch (--eval-batch-size x --eval-seqlen)": (eval_rows, config.eval_seqlen)},
                       vocab, available_bytes(config.device))
