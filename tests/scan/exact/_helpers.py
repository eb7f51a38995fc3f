"""Helpers shared by the exact backend's tests: seeded inputs, kernel-against-twin comparison."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mamba_stream.scan._quant import quantize_q8
from mamba_stream.scan.exact import TWIN_OPS, build_kernels
from mamba_stream.scan.exact._kernels import _kernel_ops

ROOT = Path(__file__).resolve().parents[3]
DTYPES = [torch.float32, torch.float64]

#: every test module here: `pytestmark = NEEDS_KERNELS`
NEEDS_KERNELS = pytest.mark.skipif(_kernel_ops() is None, reason=f"no exact kernels here: {build_kernels()[1]}")


def _r(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _both(name: str, *args):
    """The kernel call `name` and its twin, on the same arguments."""
    return getattr(_kernel_ops(), name)(*args), getattr(TWIN_OPS, name)(*args)


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_equal(x, y) for x, y in zip(a, b, strict=False))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


_SPLIT_SHAPES = [(1, 40, 5), (1, 96, 17), (2, 64, 33), (1, 300, 1000), (3, 70, 129), (1, 2048, 96)]


def _weights_in_every_format(g: torch.Generator, n: int, k: int) -> list:
    w = _r(g, n, k, dtype=torch.float32, scale=0.2)
    return [w, w.to(torch.bfloat16), w.to(torch.float16), quantize_q8(w)]
