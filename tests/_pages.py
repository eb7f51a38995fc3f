"""Which pages of a tensor are in the process's memory: the tests of memory that is taken page by
page (a slot table's zeros) or given back (a checkpoint's q8 scales)."""

from __future__ import annotations

import mmap

import torch


def pages_in_memory(t: torch.Tensor) -> list[bool]:
    """For each whole page inside `t`'s bytes, whether it is mapped in (the present bit of
    /proc/self/pagemap, which a process may read of itself; Linux only)."""
    page = mmap.PAGESIZE
    lo = -(-t.data_ptr() // page)
    hi = (t.data_ptr() + t.numel() * t.element_size()) // page
    with open("/proc/self/pagemap", "rb") as pm:
        pm.seek(lo * 8)
        raw = pm.read(max(hi - lo, 0) * 8)
    return [bool(int.from_bytes(raw[i:i + 8], "little") >> 63) for i in range(0, len(raw), 8)]
