"""Running a GGUF file in llama.cpp (llama-cpp-python): logits, perplexity, speed, token streaming.

    llm = open_gguf("runs/pg30/model.gguf", n_ctx=512, logits_all=True, kv_f32=True)
    z = logits(llm, ids)                                     # (len(ids), vocab), from a fresh context
    perplexity("runs/pg30/model.gguf", windows)              # as engine.algo.evaluate.perplexity computes it
    speed(llm, prompt_ids, new_tokens=64)                    # (prompt tokens/s, generation tokens/s)

llama-cpp-python is optional at import time: every entry point raises UserError with the install line
when it is missing (install.sh installs it).
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import numpy as np

from ..errors import UserError

PIN = "llama-cpp-python==0.3.36"


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


def default_threads() -> int:
    """The cores this process may run on (its CPU affinity: a container's or taskset's share, not the host's count),
    which is what llama.cpp should use: more threads than cores only makes them wait on each other."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def open_gguf(path: str | Path, n_ctx: int = 512, logits_all: bool = False, threads: int | None = None,
              kv_f32: bool = False):
    """A quiet llama_cpp.Llama over the file. kv_f32: the KV cache in f32 (llama.cpp's default f16 cache alone
    moves logits by about 1e-3 of their scale), for comparisons with transformers."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"GGUF file not found: {path}")
    try:
        import llama_cpp
    except ImportError as e:
        raise UserError(f"llama.cpp is not installed: pip install {PIN} (install.sh does it)") from e
    kw = dict(n_ctx=n_ctx, n_batch=n_ctx, logits_all=logits_all, verbose=False,
              n_threads=threads or default_threads())
    if kv_f32:
        kw.update(type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32)
    try:
        return llama_cpp.Llama(model_path=str(path), **kw)
    except (ValueError, RuntimeError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"llama.cpp could not load {path}: {first}") from e


def close(llm) -> None:
    with contextlib.suppress(Exception):
        llm.close()


def logits(llm, ids: list[int]) -> np.ndarray:
    """(len(ids), vocab) logits of one sequence from a fresh context (`llm` opened with logits_all)."""
    llm.reset()
    llm.eval(list(ids))
    return np.asarray(llm.scores[: len(ids)], dtype=np.float32)


def perplexity(path: str | Path, windows, threads: int | None = None, kv_f32: bool = True) -> float:
    """exp(mean next-token cross-entropy over all windows' tokens), as engine.algo.evaluate.perplexity computes it
    for a transformers model: the same windows give comparable figures."""
    rows = windows.tolist() if hasattr(windows, "tolist") else [list(w) for w in windows]
    llm = open_gguf(path, n_ctx=max(len(r) for r in rows), logits_all=True, threads=threads, kv_f32=kv_f32)
    total, count = 0.0, 0
    try:
        for ids in rows:
            z = logits(llm, ids)[:-1].astype(np.float64)
            z -= z.max(axis=1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            total -= float(logp[np.arange(len(ids) - 1), ids[1:]].sum())
            count += len(ids) - 1
    finally:
        close(llm)
    return float(np.exp(total / count))


def speed(llm, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """(prompt tokens/s, generated tokens/s): the prompt in one batch from a fresh context, then exactly
    new_tokens greedy tokens one at a time (end-of-text does not stop it)."""
    llm.reset()
    t = time.perf_counter()
    llm.eval(list(prompt))
    prompt_s = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([int(np.argmax(_last_logits(llm)))])
    return len(prompt) / prompt_s, new_tokens / (time.perf_counter() - t)


def alternating_speeds(paths: list[Path], prompt: list[int], new_tokens: int, repeats: int,
                       threads: int | None = None) -> list[tuple[float, float]]:
    """Median (prompt tokens/s, generated tokens/s) of each file over `repeats` rounds after a warm-up round,
    the files alternating within each round so that all see the same machine load."""
    import statistics

    llms = []
    try:
        for path in paths:
            llms.append(open_gguf(path, n_ctx=len(prompt) + new_tokens + 8, threads=threads))
        times = [[] for _ in llms]
        for r in range(repeats + 1):
            for llm, t in zip(llms, times):
                timing = speed(llm, prompt, new_tokens)
                if r:  # the first round warms up
                    t.append(timing)
        return [(statistics.median(s[0] for s in t), statistics.median(s[1] for s in t)) for t in times]
    finally:
        for llm in llms:
            close(llm)


def _last_logits(llm) -> np.ndarray:
    """The logits of the last evaluated token (with or without logits_all)."""
    if llm._logits_all:
        return np.asarray(llm.scores[llm.n_tokens - 1])
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def generate(llm, prompt: list[int], max_new_tokens: int, stop_ids: set[int], greedy: bool = True,
             temperature: float = 0.7, top_p: float = 0.95, seed: int = 0):
    """Yields the generated token ids one by one (stops at a stop id, which is not yielded, or after
    max_new_tokens)."""
    if max_new_tokens < 1:
        return
    llm.set_seed(int(seed))
    tokens = llm.generate(list(prompt), temp=0.0 if greedy else float(temperature), top_p=float(top_p), top_k=0,
                          min_p=0.0, repeat_penalty=1.0, reset=True)
    for n, token in enumerate(tokens, 1):
        if token in stop_ids:
            return
        yield int(token)
        if n == max_new_tokens:  # before the generator evaluates one more token
            return
