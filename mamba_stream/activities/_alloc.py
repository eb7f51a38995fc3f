"""Process allocator settings for a serving worker (glibc malloc).

Every batched decode step allocates a few state-sized temporaries (B x nheads x headdim x d_state
floats: 4 MB at 32 streams of a d_state-64 Mamba-2 layer). glibc serves allocations over its mmap
threshold with a fresh mmap, so each one is page-faulted and zeroed by the kernel and unmapped on
free; its dynamic threshold only adapts after some frees and per arena. Measured on the 2-core CI
machine (bench/bench_serving.py's model, 32 streams): 20 ms per batched step with the defaults,
7.5 ms with a fixed 32 MB threshold, so the batch gain is lost to page faults. PyTorch's own CPU
inference guides recommend a caching allocator for the same reason; this keeps glibc and fixes
its thresholds instead, so freed blocks are reused from the heap.

The same retention keeps a big model's freed state copies: a 7B Mamba-2 state is 279 MB in 4 MB
tensors, under the mmap threshold, so each chunk's copy for its commit stayed in the heap after it
was sealed (0.28-0.30 GB of a worker's RSS, measured with bench/serve_model.py). `release_freed`
gives such pages back after the work that freed them, for states of RELEASE_BYTES and more only:
a small model's decode temporaries stay where the tuning keeps them.

Set MAMBA_STREAM_MALLOC_TUNE=0 to leave the allocator alone (for example under jemalloc).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
import threading

__all__ = ["RELEASE_BYTES", "release_freed", "tune_allocator"]

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# glibc refuses an mmap threshold above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 256 * 1024 * 1024
#: a state this size or larger has its freed copies given back after a commit (`release_freed`)
RELEASE_BYTES = 64 * 1024 * 1024

_lock = threading.Lock()
_applied: dict[str, int] | None = None


def _switched_off() -> bool:
    return os.environ.get("MAMBA_STREAM_MALLOC_TUNE", "1") == "0"


@functools.lru_cache(maxsize=1)
def _libc() -> ctypes.CDLL | None:
    """The C library (glibc where `mallopt` and `malloc_trim` are), or None where it cannot be loaded."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def tune_allocator() -> dict[str, int]:
    """Fix glibc's mmap and trim thresholds once per process; returns what was set (empty if nothing).

    Idempotent and safe off glibc (nothing happens). Memory freed stays in the heap up to
    TRIM_THRESHOLD, so RSS holds the peak working set of a step rather than shrinking between steps.
    """
    global _applied
    with _lock:
        if _applied is not None:
            return dict(_applied)
        _applied = {}
        if _switched_off():
            log.info("allocator tuning disabled by MAMBA_STREAM_MALLOC_TUNE=0")
            return {}
        mallopt = getattr(_libc(), "mallopt", None)
        if mallopt is None:
            log.info("no glibc mallopt here; allocator left as it is")
            return {}
        for label, param, value in (("mmap_threshold", _M_MMAP_THRESHOLD, MMAP_THRESHOLD),
                                    ("trim_threshold", _M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
            if mallopt(ctypes.c_int(param), ctypes.c_int(value)) == 1:
                _applied[label] = value
            else:
                log.warning("mallopt refused %s=%d", label, value)
        log.info("allocator thresholds set: %s", _applied)
        return dict(_applied)


def release_freed(nbytes: int) -> bool:
    """Give the heap's free pages back to the system after work that freed about `nbytes` (a
    state's copy, sealed and dropped), when that is RELEASE_BYTES or more; True if it did.

    glibc's malloc_trim(0) (every arena; free pages inside the heap too, by madvise): a few
    milliseconds against the seconds a chunk of a model this big takes. Nothing happens off glibc
    or with MAMBA_STREAM_MALLOC_TUNE=0.
    """
    if nbytes < RELEASE_BYTES or _switched_off():
        return False
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim(ctypes.c_size_t(0))
    return True
