"""The threads the kernels split their work on, and torch's threads off while they do.

A product, an elementwise pass and a prefill's conv split their outputs in C, across the helper
threads of `_threading.c` (`pool_run`); the scans split in Python, across a thread pool. Each
work unit is computed whole by one thread, so no split changes a bit: the thresholds here
(`_THREADED_WORK`, `_PARALLEL_WORK`) and the thread count (`_THREADS`) are speed only. Tests set
them on this module, where every kernel call reads them.

Separate from the kernels because it is shared by all of them and computes nothing.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

#: below this many multiply-adds a scan runs on the calling thread alone: handing half of it to
#: Python's thread pool costs 0.1-0.4 ms on a 2-core VM
_PARALLEL_WORK = 1 << 23
#: below this many multiply-adds a product runs on the calling thread alone. The products split
#: their outputs in C, across helper threads that wait spinning between products (`pool_run` in
#: _threading.c): a hand-off costs microseconds, not the 0.1-0.4 ms of Python's pool.
_THREADED_WORK = 1 << 18

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()
_THREADS = max(1, min(torch.get_num_threads(), os.cpu_count() or 1))


def _threads(work: int) -> int:
    """How many threads a product of `work` multiply-adds runs on."""
    return _THREADS if work >= _THREADED_WORK else 1


def _parallel(fn: Callable[[int, int], None], units: int, work: int) -> None:
    """fn(u0, u1) over [0, units), split across threads when the work is worth it. Each unit is
    computed whole by one thread: the split never changes a result."""
    t = min(_THREADS, units)
    if t <= 1 or work < _PARALLEL_WORK:
        fn(0, units)
        return
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=_THREADS, thread_name_prefix="exact")
    bounds = [units * j // t for j in range(t + 1)]
    futures = [_pool.submit(fn, bounds[j], bounds[j + 1]) for j in range(1, t)]
    fn(bounds[0], bounds[1])
    for f in futures:
        f.result()


@functools.cache
def _openmp() -> Any:
    """The OpenMP runtime torch runs its parallel operations on (None: not found, or not OpenMP)."""
    root = Path(torch.__file__).parent  # torch/lib, or torch.libs beside it in a manylinux wheel
    found = [p for d in (root / "lib", root.parent / "torch.libs") for name in ("libgomp", "libiomp5", "libomp")
             for p in sorted(d.glob(name + "*.so*"))]
    for path in found:
        try:
            lib = ctypes.CDLL(str(path))  # already loaded by torch: the same library
            lib.omp_set_num_threads.argtypes, lib.omp_get_max_threads.restype = [ctypes.c_int], ctypes.c_int
            return lib
        except (OSError, AttributeError):
            continue
    log.info("torch's OpenMP runtime was not found beside %s: its threads stay on during exact forward "
             "passes (a speed matter only)", root)
    return None


@contextlib.contextmanager
def _torch_threads_off() -> Iterator[None]:
    """torch's OpenMP threads off for the calling thread alone (`omp_set_num_threads` sets that
    thread's own value; `torch.set_num_threads` would also change what threads that start
    meanwhile begin with), while the kernels split their work on their own pool. After each of
    torch's parallel operations its OpenMP workers spin a while, waiting for the next one: spinning
    beside the pool's threads on a 2-core machine they took a fifth to a third of a 130M prefill's
    speed (a run with OMP_WAIT_POLICY=PASSIVE gained as much). torch's operations here are copies
    and elementwise passes, which one thread does at memory speed."""
    omp = _openmp() if _THREADS > 1 else None
    n = omp.omp_get_max_threads() if omp is not None else 1
    if n <= 1:
        yield
        return
    omp.omp_set_num_threads(1)
    try:
        yield
    finally:
        omp.omp_set_num_threads(n)
