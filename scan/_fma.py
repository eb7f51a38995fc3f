"""IEEE-754 fusedMultiplyAdd of float32 values, computed exactly with float64 tensors.

The twin of a fused multiply-add instruction (and of C's `fmaf`): a * b + c rounded once, to
nearest with ties to even. torch has no fused multiply-add whose rounding it promises on every
CPU, so it is built from operations whose rounding is fixed:

- the product of two float32 values is exact in float64 (24 + 24 significant bits <= 53);
- TwoSum gives the float64 sum s and its exact error e (s + e = a * b + c, no overflow here:
  |a * b| < 2^256);
- s is moved to its odd neighbour towards e where e != 0 and s is even: that is a * b + c
  rounded to odd in float64 (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums:
  proved algorithms using rounding to odd", IEEE TC 2008);
- rounding a value rounded to odd with p + 2 or more bits to p bits gives the single rounding of
  the exact value (53 >= 24 + 2), also where the float32 result is subnormal or overflows.
"""

from __future__ import annotations

import torch

__all__ = ["fma_twin"]


def fma_twin(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a * b + c of float32 tensors (broadcast), rounded once to float32."""
    p = a.double() * b.double()
    cd = c.double()
    s = p + cd
    bb = s - p
    err = (p - (s - bb)) + (cd - bb)
    bits = s.view(torch.int64)
    # an inexact, even, finite sum: one unit in the last place towards the exact value (away from
    # zero where the error has the sum's sign; a power of two's lower neighbour is odd, as it should)
    fix = (err != 0) & ((bits & 1) == 0) & torch.isfinite(s)
    step = torch.where((err > 0) == (s > 0), 1, -1)
    return torch.where(fix, bits + step, bits).view(torch.float64).to(torch.float32)
