"""The elementwise functions (exp, silu, sigmoid, softplus, tanh, sin, cos, rsqrt): kernel and twin.

Each value is computed in double from basic operations (a Taylor polynomial after an exact range
reduction; rsqrt by Newton steps), then rounded to the compute dtype: no libm, no vector library,
so no vector-or-scalar split and no dependence on the instruction set. The kernel is `unary` in
`_unary.c`; `unary_ref` performs the same operations in the same order in torch.

Separate because the other kernels' twins build on it (the scans' decays, the norms' rsqrt and
silu): it is the one place the arithmetic of a transcendental function is written in Python.
"""

from __future__ import annotations

import math

import torch

from mamba_stream.scan.exact._build import _Library
from mamba_stream.scan.exact._threading import _threads

Tensor = torch.Tensor

#: the kernel's op codes (`unary_f32`'s switch in _unary.c)
_UNARY = {"exp": 0, "silu": 1, "sigmoid": 2, "softplus": 3, "tanh": 4, "sin": 5, "cos": 6, "rsqrt": 7}


class _Unary(_Library):
    """The kernels `unary_threads_f32` / `_f64` (the C pool's split of `unary`) and `exp`."""

    def unary(self, x: Tensor, op: str) -> Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty_like(x)
        # an exact exp is some 20 multiply-adds in double: a prefill's are worth two threads
        self.unarys[x.dtype](x.data_ptr(), out.data_ptr(), x.numel(), _UNARY[op], _threads(x.numel() * 20))
        return out

    def exp(self, x: Tensor) -> Tensor:
        if isinstance(x, torch.nn.Parameter):  # A_log: the same every call
            return self._cached(x, "exp", lambda: self.unary(x.detach(), "exp"))
        return self.unary(x, "exp")


def unary_ref(x: Tensor, op: str) -> Tensor:
    """The kernel `unary`: `op` (a key of `_UNARY`) of every element, computed in double from
    basic operations, rounded to x's dtype. x: any shape, float32 or float64 -> x's shape."""
    return _unary64(x.double(), op).to(x.dtype)


def exp_ref(x: Tensor) -> Tensor:
    """The kernel call `exp`: `unary_ref(x, "exp")`. x: any shape -> x's shape."""
    return unary_ref(x, "exp")


# --- the arithmetic in double, as _unary.c computes it -------------------------------------------

_INV_LN2 = 1.44269504088896338700
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_SQRT_HALF = 0.70710678118654752440
_TWO_OVER_PI = 6.36619772367581382433e-01
_PIO2 = (1.57079632673412561417e00, 6.07710050650619224932e-11, 2.02226624879595063154e-21)
_EXP_POLY = [1.0 / math.factorial(k) for k in range(15)]  # low order first
_EXPM1_POLY = [1.0 / math.factorial(k + 1) for k in range(18)]
_LOG_POLY = [1.0 / (2 * k + 1) for k in range(12)]
_SIN_POLY = [(-1.0) ** k / math.factorial(2 * k + 1) for k in range(10)]
_COS_POLY = [(-1.0) ** k / math.factorial(2 * k + 2) for k in range(9)]


def _horner(x: Tensor, coeffs: list[float]) -> Tensor:
    """coeffs[0] + coeffs[1] x + ..., highest power first, one rounding per operation (as the C)."""
    acc = torch.full_like(x, coeffs[-1])
    for c in reversed(coeffs[:-1]):
        acc = acc * x + c
    return acc


_ROUNDER = 6755399441055744.0  # 1.5 * 2**52: v + _ROUNDER rounds v to an integer (ties to even)


def _exp64(x: Tensor) -> Tensor:
    xc = torch.where(x > 709.0, torch.full_like(x, 709.0), x)
    xc = torch.where(xc < -708.0, torch.full_like(x, -708.0), xc)
    t = xc * _INV_LN2 + _ROUNDER
    k = t - _ROUNDER
    r = (xc - k * _LN2_HI) - k * _LN2_LO
    scale = ((t.view(torch.int64) + 1023) << 52).view(torch.float64)
    out = _horner(r, _EXP_POLY) * scale
    out = torch.where(x > 709.0, torch.full_like(out, math.inf), out)
    return torch.where(x < -708.0, torch.zeros_like(out), out)


def _expm1_64(x: Tensor) -> Tensor:
    small = (x > -0.5) & (x < 0.5)
    series = x * _horner(torch.where(small, x, torch.zeros_like(x)), _EXPM1_POLY)
    return torch.where(small, series, _exp64(x) - 1.0)


def _log_ge1_64(u: Tensor) -> Tensor:
    bits = u.view(torch.int64)
    e = ((bits >> 52) & 0x7FF) - 1023
    m = ((bits & 0x000FFFFFFFFFFFFF) | 0x3FF0000000000000).view(torch.float64)
    big = m > 2.0 * _SQRT_HALF
    m = torch.where(big, m * 0.5, m)
    k = (e + big.to(torch.int64)).to(torch.float64)
    f = m - 1.0
    s = f / (2.0 + f)
    return k * _LN2_HI + (k * _LN2_LO + 2.0 * s * _horner(s * s, _LOG_POLY))


def _log1p_pos64(y: Tensor) -> Tensor:
    u = 1.0 + y
    one = u == 1.0
    safe = torch.where(one, torch.full_like(u, 2.0), u)
    return torch.where(one, y, _log_ge1_64(safe) * (y / (safe - 1.0)))


def _sincos64(x: Tensor) -> tuple[Tensor, Tensor]:
    t = x * _TWO_OVER_PI + _ROUNDER
    n = t - _ROUNDER
    r = ((x - n * _PIO2[0]) - n * _PIO2[1]) - n * _PIO2[2]
    z = r * r
    s = r * _horner(z, _SIN_POLY)
    c = 1.0 - z * _horner(z, _COS_POLY)
    q = t.view(torch.int64) & 3
    sn = torch.where(q == 0, s, torch.where(q == 1, c, torch.where(q == 2, -s, -c)))
    cs = torch.where(q == 0, c, torch.where(q == 1, -s, torch.where(q == 2, -c, s)))
    return sn, cs


def _tanh64(x: Tensor) -> Tensor:
    a = x.abs()
    e = _expm1_64(2.0 * torch.where(a > 20.0, torch.zeros_like(a), a))
    t = torch.where(a > 20.0, torch.ones_like(a), e / (e + 2.0))
    return torch.where(x < 0.0, -t, t)


def _rsqrt64(v: Tensor) -> Tensor:
    y = (0x5FE6EB50C7B537A9 - (v.view(torch.int64) >> 1)).view(torch.float64)
    h = 0.5 * v
    for _ in range(5):
        y = y * (1.5 - (h * y) * y)
    return y


def _unary64(x: Tensor, op: str) -> Tensor:
    if op == "rsqrt":
        return _rsqrt64(x)
    if op == "exp":
        return _exp64(x)
    if op == "silu":
        return x / (1.0 + _exp64(-x))
    if op == "sigmoid":
        return 1.0 / (1.0 + _exp64(-x))
    if op == "softplus":
        small = torch.where(x > 20.0, torch.zeros_like(x), x)
        return torch.where(x > 20.0, x, _log1p_pos64(_exp64(small)))
    if op == "tanh":
        return _tanh64(x)
    sn, cs = _sincos64(x)
    return sn if op == "sin" else cs
