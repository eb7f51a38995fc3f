"""The kernels and the twins as two objects with the same calls: `_Kernels` and `TWIN_OPS`.

`_Kernels` is the built library behind the twins' signatures, made of one part per op (each in
the module of its twins: `_unary`, `_products`, `_norms`, `_conv`, `_scans`, `_step`); `_Twins`
holds the twins in the same call shape, the product of the arithmetic it is made with. The
primitives (`_primitives.exact_primitives`) take either and compute the same bits.

Separate because it is where the parts meet: the one list of what a kernel object offers, which
tests/scan/exact/test_kernels.py holds to the twins' (the same names, the same signatures).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from mamba_stream.scan.exact._build import build_kernels
from mamba_stream.scan.exact._conv import _Conv, conv_into_ref, conv_ref
from mamba_stream.scan.exact._norms import _GatedNorm, _Mean, _Norm, gated_norm_ref, mean_ref, norm_ref
from mamba_stream.scan.exact._products import _Products, linear_fma_ref, linear_ref
from mamba_stream.scan.exact._scans import (
    _Angle,
    _SelectiveScan,
    _Ssd,
    _Trapezoid,
    angle_ref,
    selective_scan_into_ref,
    selective_scan_ref,
    ssd_into_ref,
    ssd_ref,
    trapezoid_ref,
)
from mamba_stream.scan.exact._step import _Step
from mamba_stream.scan.exact._unary import _Unary, exp_ref, unary_ref

Tensor = torch.Tensor


class _Kernels(_Unary, _Products, _Mean, _Norm, _GatedNorm, _Conv, _SelectiveScan, _Ssd, _Angle, _Trapezoid, _Step):
    """The C kernels behind the signatures of the twins (thin: decode is bound by call overhead).
    `fused`: the exact-2 products (fused multiply-adds; float32 only), else exact-1's."""


class _Twins:
    """The twins, in the kernels' call shape; `linear` is the arithmetic's product."""

    def __init__(self, linear: Callable[..., Tensor]) -> None:
        self.linear = linear

    unary = staticmethod(unary_ref)
    exp = staticmethod(exp_ref)
    mean = staticmethod(mean_ref)
    norm = staticmethod(norm_ref)
    gated_norm = staticmethod(gated_norm_ref)
    selective_scan = staticmethod(selective_scan_ref)
    ssd = staticmethod(ssd_ref)
    angle = staticmethod(angle_ref)
    trapezoid = staticmethod(trapezoid_ref)
    conv = staticmethod(conv_ref)
    conv_into = staticmethod(conv_into_ref)
    selective_scan_into = staticmethod(selective_scan_into_ref)
    ssd_into = staticmethod(ssd_into_ref)


TWIN_OPS = _Twins(linear_ref)
TWIN_OPS_FMA = _Twins(linear_fma_ref)


def _kernel_ops(fused: bool = False) -> _Kernels | None:
    """The kernels, once built (None where they cannot be: `build_kernels` says why); `fused`:
    with the exact-2 products. One object per arithmetic, however it is asked for."""
    return _kernels(bool(fused))


@functools.cache
def _kernels(fused: bool) -> _Kernels | None:
    lib = build_kernels()[0]
    return None if lib is None else _Kernels(lib, fused)
