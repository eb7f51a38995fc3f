"""The exact backends a model runs: the kernels where the probe verified them, else the twins.

`exact_backend(lm, dtype, name)` probes the model once per dtype and arithmetic ("exact":
exact-1, "exact-fma": exact-2) and keeps the backend it chose beside the model;
`exact_step_backend` is the same backend with its conv and Mamba-1/2 scans writing the states
they are given (the slot table's decode step), checked once per model too.

Separate because this is the only part the rest of `scan` calls (`_forward.backend_named`,
`Model`): the choice and its cache, apart from what they choose between.
"""

from __future__ import annotations

import logging
import weakref

import torch

from mamba_stream.scan._backends import EXACT_BACKENDS, Backend, FixedBackend
from mamba_stream.scan.exact._primitives import _KernelBackend, twin_primitives
from mamba_stream.scan.exact._probe import Probe, _in_place_agrees, probe

log = logging.getLogger(__name__)

#: The versions of the arithmetic (`scan._backends.EXACT_BACKENDS`): exact-1, and exact-2 with
#: every step of a product's sums one fused multiply-add (`scan.exact`'s docstring).
ARITHMETIC = EXACT_BACKENDS["exact"]
ARITHMETIC_FMA = EXACT_BACKENDS["exact-fma"]

_PROBED: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[torch.dtype, bool], tuple[Backend, Probe]]] = (
    weakref.WeakKeyDictionary())


def _fused(name: str) -> bool:
    if name not in EXACT_BACKENDS:
        raise ValueError(f"{name!r} is not an exact backend ({sorted(EXACT_BACKENDS)})")
    return EXACT_BACKENDS[name] == ARITHMETIC_FMA


def exact_backend(lm: torch.nn.Module, dtype: torch.dtype, name: str = "exact") -> tuple[Backend, Probe]:
    """The exact backend `name` ("exact": exact-1, "exact-fma": exact-2) for this model: the
    kernels if the probe verified them, else the twins. Probed once per model, dtype and backend."""
    fused = _fused(name)
    if fused and dtype != torch.float32:
        raise TypeError(f"the {name} backend ({ARITHMETIC_FMA}) computes in float32, not {dtype}")
    cache = _PROBED.setdefault(lm, {})
    if (dtype, fused) in cache:
        return cache[dtype, fused]
    found = probe(lm, dtype, fused)
    if not found.kernels:
        log.warning("%s backend: %s; running the pure-PyTorch twins (same results, slower)", name, found.reason)
    else:
        log.info("%s backend: %s in %.0f ms", name, found.reason, found.seconds * 1000)
    backend = _KernelBackend(fused=fused) if found.kernels else FixedBackend(twin_primitives(fused), name)
    cache[dtype, fused] = (backend, found)
    return backend, found


_STEP: weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple[torch.dtype, bool], Backend]] = (
    weakref.WeakKeyDictionary())


def exact_step_backend(lm: torch.nn.Module, dtype: torch.dtype, name: str = "exact") -> Backend:
    """The exact backend whose conv and Mamba-1/2 scans write new states over the states they are
    given (`exact_primitives(..., in_place=True)`): the slot table's decode step runs it on its
    buffers and copies nothing back. Same arithmetic, same bits, same path as `exact_backend`.

    Where the probe verified the kernels, one batched step in place must give the step's
    out-of-place bits on this model (an aliasing the compiler did not expect would show here);
    otherwise the out-of-place kernels run (and the caller copies back). Checked once per model.
    """
    fused = _fused(name)
    cache = _STEP.setdefault(lm, {})
    if (dtype, fused) in cache:
        return cache[dtype, fused]
    plain, found = exact_backend(lm, dtype, name)
    if not found.kernels:
        backend: Backend = FixedBackend(twin_primitives(fused, in_place=True), name)
    else:
        backend = _KernelBackend(in_place=True, fused=fused)
        if not _in_place_agrees(lm, dtype, plain, backend):
            log.warning("%s backend: the in-place decode step gave other bits on this model; "
                        "stepping out of place", name)
            backend = plain
    cache[dtype, fused] = backend
    return backend
