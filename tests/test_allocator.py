"""engine/allocator.py: the process keeps its freed large blocks (no page faults for each batch's tensors)."""

from __future__ import annotations

import ctypes
import resource
import sys

import pytest
import torch

from engine import allocator


@pytest.mark.parametrize("value, off", [(None, False), ("", False), ("on", False), ("off", True), ("0", True),
                                        ("Default", True), (" no ", True)])
def test_the_switch_reads_off_and_its_spellings(value, off):
    assert allocator.switched_off(value) is off


def test_switched_off_it_leaves_malloc_alone_and_decides_once(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "_done", [])
    monkeypatch.setenv(allocator.ENV, "off")
    monkeypatch.setattr(ctypes, "CDLL", lambda *a, **k: calls.append(a))
    assert allocator.keep_freed_memory() is False and calls == []
    monkeypatch.delenv(allocator.ENV)
    assert allocator.keep_freed_memory() is False and calls == []  # (decided for the process at its first call)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_with_the_thresholds_raised_a_batchs_tensors_fault_no_pages_in(monkeypatch):
    """Blocks of a few MB freed and asked for again (a forward's activations) come back from the heap: almost no
    minor page faults, where glibc's defaults map and unmap them (a fault for each 4 KiB page at first touch)."""
    monkeypatch.setattr(allocator, "_done", [])
    monkeypatch.delenv(allocator.ENV, raising=False)
    if not allocator.keep_freed_memory():
        pytest.skip("no glibc mallopt here")

    def faults(n=20):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(n):
            x = torch.ones(3 << 20, dtype=torch.uint8)  # (3 MiB: above glibc's first mmap threshold)
            del x
        return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

    faults(2)
    assert faults() < 20 * (3 << 20) // 4096 // 10  # (without: about 770 faults a block)
