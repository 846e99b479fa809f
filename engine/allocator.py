"""Freed memory kept by the process instead of handed back to the kernel and faulted in again.

glibc's malloc serves large blocks (a batch's activations, autocast's bfloat16 copy of each weight) with mmap and
returns them on free; the next forward asks again, and the kernel zeroes every 4 KiB page on first touch. On the
default model's one-shot passes that was about 110,000 page faults a forward of 8 x 128 tokens, and 15 million in
a first run (36 s of system time of 700 CPU seconds, /usr/bin/time). With the thresholds raised, large blocks come
from the heap and stay there for the next batch: the process keeps its high-water mark, which its peak is anyway.

    keep_freed_memory()   # once, at the start of a command or an app job; a no-op off glibc or when switched off

PG_PRUNE_MALLOC=off leaves malloc as it is (to compare, or where another allocator is preloaded).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

ENV = "PG_PRUNE_MALLOC"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLDS = (32 << 20,)  # blocks above it still use mmap; a glibc that refuses the first (above its
# DEFAULT_MMAP_THRESHOLD_MAX) takes the second, its 64-bit maximum (an evaluation's 200 MB logits then use mmap)
TRIM_THRESHOLD = 256 << 20  # the free memory at the heap's top kept before it is trimmed
_done: list[bool] = []


def switched_off(value: str | None) -> bool:
    """Whether the environment's value asks to leave malloc alone."""
    return (value or "").strip().lower() in ("off", "0", "no", "false", "default")


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once for this process; whether they are raised (False off glibc,
    or with PG_PRUNE_MALLOC=off)."""
    if _done:
        return _done[0]
    ok = False
    if not switched_off(os.environ.get(ENV)):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):  # (not glibc: macOS, musl without mallopt)
            mallopt = None
        if mallopt is not None:
            ok = any(mallopt(M_MMAP_THRESHOLD, t) for t in MMAP_THRESHOLDS) and bool(mallopt(M_TRIM_THRESHOLD,
                                                                                            TRIM_THRESHOLD))
    _done.append(ok)
    return ok
