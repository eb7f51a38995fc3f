"""The fused multiply-add twin (`scan._fma.fma_ref`) against C's fmaf, which glibc computes
correctly rounded on every machine (with the FMA instruction or in software)."""

from __future__ import annotations

import ctypes
import ctypes.util

import pytest
import torch

from mamba_stream.scan._fma import fma_ref

_LIBM = ctypes.CDLL(ctypes.util.find_library("m") or "libm.so.6")
_LIBM.fmaf.argtypes = [ctypes.c_float] * 3
_LIBM.fmaf.restype = ctypes.c_float

N = 20_000


def _fmaf(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    out = [_LIBM.fmaf(x, y, z) for x, y, z in zip(a.tolist(), b.tolist(), c.tolist(), strict=True)]
    return torch.tensor(out, dtype=torch.float32)


def _bits(g: torch.Generator) -> torch.Tensor:
    return torch.randint(-(2**31), 2**31 - 1, (N,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)


def _cases(kind: str, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    r = lambda scale=1.0: torch.randn(N, generator=g) * scale  # noqa: E731
    if kind == "normal":
        return r(), r(), r()
    if kind == "cancelling":  # c close to -a*b: the fused result keeps the product's low bits
        a, b = r(), r()
        return a, b, -(a * b) + r(1e-7)
    if kind == "any-bits":  # every class: NaN, infinities, zeros, subnormals, huge and tiny
        return _bits(g), _bits(g), _bits(g)
    if kind == "subnormal":
        return r(1e-20), r(1e-19), r(1e-39)
    if kind == "overflowing":
        return r(1e19), r(1e19), r(3e38)
    # halfway cases: small integers and halves, whose sums tie
    a = torch.randint(-(2**12), 2**12, (N,), generator=g).float()
    b = torch.randint(-(2**12), 2**12, (N,), generator=g).float() * 0.5
    return a, b, torch.randint(-(2**24), 2**24, (N,), generator=g).float() * 2.0**-3


KINDS = ["normal", "cancelling", "any-bits", "subnormal", "overflowing", "ties"]


@pytest.mark.parametrize("kind", KINDS)
def test_the_twin_rounds_once_as_fmaf_does(kind):
    g = torch.Generator().manual_seed(KINDS.index(kind))
    a, b, c = _cases(kind, g)
    want, got = _fmaf(a, b, c), fma_ref(a, b, c)
    same = (want.view(torch.int32) == got.view(torch.int32)) | (torch.isnan(want) & torch.isnan(got))
    assert bool(same.all()), f"{int((~same).sum())} of {N} differ, first at {int((~same).nonzero()[0])}"


def test_a_fused_multiply_add_is_not_a_multiply_then_an_add():
    """So the test above can fail: rounding twice gives other bits on most cancelling inputs."""
    a, b, c = _cases("cancelling", torch.Generator().manual_seed(1))
    assert int((fma_ref(a, b, c).view(torch.int32) != (a * b + c).view(torch.int32)).sum()) > N // 2


def test_the_twin_broadcasts_and_returns_float32():
    a, b, c = torch.randn(3, 1, 4), torch.randn(1, 5, 4), torch.randn(3, 5, 4)
    out = fma_ref(a, b, c)
    assert out.dtype == torch.float32 and out.shape == (3, 5, 4)
    assert torch.equal(out[2, 3], fma_ref(a[2, 0], b[0, 3], c[2, 3]))
