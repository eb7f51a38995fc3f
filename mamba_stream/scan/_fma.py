"""IEEE-754 fusedMultiplyAdd of float32 values, computed exactly with float64 tensors.

The twin of a fused multiply-add instruction (and of C's `fmaf`): a * b + c rounded once, to
nearest with ties to even. torch has no fused multiply-add whose rounding it promises on every
CPU, so it is built from operations whose rounding is fixed:

- the product of two float32 values is exact in float64 (24 + 24 significant bits <= 53);
- s = p + c rounded to float64, then to float32, rounds twice; that differs from one rounding of
  the exact sum only where s lies exactly halfway between two float32 values (or the float32
  result is subnormal, where the halfway points sit higher in s's bits) and s is not exact
  (an exact midpoint then rounds to even, as it should; a sum rounding to zero is exact);
- there, TwoSum gives s's exact error e (s + e = a * b + c; no overflow: |a * b| < 2^256) and s
  moves to its odd neighbour towards e: a * b + c rounded to odd in float64 (Boldo and
  Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to
  odd", IEEE TC 2008), and rounding a value rounded to odd with p + 2 or more bits to p bits gives
  the single rounding of the exact value (53 >= 24 + 2), overflow included.
"""

from __future__ import annotations

import torch

__all__ = ["fma_product", "fma_ref"]

#: s's low 29 bits (53 - 24) when s is halfway between two float32 neighbours of normal range
_LOW = (1 << 29) - 1
_HALF = 1 << 28
#: below this magnitude a float32 result may be subnormal (2^-126) or round into that range
_SMALL = 2.0**-125


def fma_ref(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c of float32 tensors (broadcast), rounded once to float32."""
    return fma_product(a.double() * b.double(), c)


def fma_product(p: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """p + c rounded once to float32, for p an exact float64 product of two float32 values and c
    float32 (broadcast): `fma_ref` with the product already taken (a product's lane steps
    widen their operands once, not once a step)."""
    cd = c.double()
    s = p + cd
    bits = s.view(torch.int64)
    # (a sum that rounds to zero is exactly zero: no second rounding to fear there)
    risky = ((bits & _LOW) == _HALF) | ((s.abs() < _SMALL) & (s != 0))
    if not bool(risky.any()):
        return s.to(torch.float32)
    # the few sums rounding twice could change: rounded to odd first (module docstring)
    idx = risky.nonzero(as_tuple=True)
    shape = s.shape
    pr, cr, sr = p.expand(shape)[idx], cd.expand(shape)[idx], s[idx]
    bb = sr - pr
    err = (pr - (sr - bb)) + (cr - bb)
    rb = sr.view(torch.int64)
    # inexact, even and finite: one unit in the last place towards the exact value (away from zero
    # where the error has the sum's sign; a power of two's lower neighbour is odd, as it should be)
    fix = (err != 0) & ((rb & 1) == 0) & torch.isfinite(sr)
    step = torch.where((err > 0) == (sr > 0), 1, -1)
    out = s.clone()
    out[idx] = torch.where(fix, rb + step, rb).view(torch.float64)
    return out.to(torch.float32)
