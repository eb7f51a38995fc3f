"""The norms: the mean of rows, RMSNorm (and LayerNorm) and mamba-ssm's gated RMSNorm: kernels and twins.

Every mean is summed in index order; rsqrt and silu are `_unary`'s. The kernels are `mean_rows`,
`rms_norm` and `gated_norm` of `_norms.c`; a LayerNorm, or an RMSNorm with a bias, is composed of
the exact mean and rsqrt (`_exact_norm`), by the kernels and the twins alike.

Separate because the norms are the reductions of a layer (sequential sums), apart from the
products' lane sums and the scans' sums over time.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from mamba_stream.scan.exact._build import _Library
from mamba_stream.scan.exact._threading import _threads
from mamba_stream.scan.exact._unary import unary_ref

Tensor = torch.Tensor


class _Mean(_Library):
    """The kernel `mean_rows`."""

    def mean(self, x: Tensor) -> Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        d = x.shape[-1]
        out = x.new_empty((*x.shape[:-1], 1))
        self.fn["mean_rows", x.dtype](x.data_ptr(), out.data_ptr(), x.numel() // d if d else 0, d)
        return out


def mean_ref(x: Tensor) -> Tensor:
    """The kernel `mean_rows`: the mean over the last dimension (kept), summed in order from 0.
    x: (..., D) -> (..., 1)."""
    acc = torch.zeros_like(x[..., :1])
    for j in range(x.shape[-1]):
        acc = acc + x[..., j : j + 1]
    return acc / x.shape[-1]


def _exact_norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool,
                mean: Callable[[Tensor], Tensor], rsqrt: Callable[[Tensor], Tensor]) -> Tensor:
    """RMSNorm, x rsqrt(mean(x x) + eps) w, or LayerNorm, with the exact mean and rsqrt."""
    if not rms:
        x = x - mean(x)
    out = (x * rsqrt(mean(x * x) + eps)) * weight
    return out if bias is None else out + bias


class _Norm(_Library):
    """The kernel `rms_norm`; a LayerNorm or a biased norm composed of `mean` and `unary` (the
    other parts of `_kernels._Kernels`)."""

    def norm(self, x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool) -> Tensor:
        if not rms or bias is not None:
            return _exact_norm(x, weight, bias, eps, rms, self.mean, lambda t: self.unary(t, "rsqrt"))
        if not x.is_contiguous():
            x = x.contiguous()
        d = x.shape[-1]
        out = torch.empty_like(x)
        w = weight.contiguous()
        rows = x.numel() // d if d else 0
        # rows split between threads (the same bits): an RMSNorm is about 4 operations a value
        self.rms_norms[x.dtype](x.data_ptr(), w.data_ptr(), out.data_ptr(), rows, d, eps, _threads(x.numel() * 4))
        return out


def norm_ref(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool) -> Tensor:
    """The kernel `rms_norm` (and the LayerNorm composed of the exact mean and rsqrt).
    x: (..., D); weight, bias: (D,) -> (..., D)."""
    return _exact_norm(x, weight, bias, eps, rms, mean_ref, lambda t: unary_ref(t, "rsqrt"))


class _GatedNorm(_Library):
    """The kernel `gated_norm`."""

    def gated_norm(self, x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int,
                   norm_before_gate: bool) -> Tensor:
        x, z = x.contiguous(), z.contiguous()
        d = x.shape[-1]
        if d % group_size:
            raise ValueError(f"group size {group_size} does not divide {d}")
        out = torch.empty_like(x)
        # rows split between threads (the same bits): a silu in double is about 20 operations a value
        self.gated_norms[x.dtype](x.data_ptr(), z.data_ptr(), weight.contiguous().data_ptr(), out.data_ptr(),
                                  x.numel() // d if d else 0, d, group_size, eps, int(norm_before_gate),
                                  _threads(x.numel() * 24))
        return out


def gated_norm_ref(x: Tensor, z: Tensor, weight: Tensor, eps: float, group_size: int,
                    norm_before_gate: bool) -> Tensor:
    """The kernel `gated_norm`: mamba-ssm's RMSNormGated with the exact silu, mean and rsqrt, over
    groups of `group_size` channels. x, z: (..., D); weight: (D,) -> (..., D)."""
    silu = unary_ref(z, "silu")
    if not norm_before_gate:
        x = x * silu
    shape = x.shape
    groups = x.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    inv = unary_ref(mean_ref(groups * groups) + eps, "rsqrt")
    out = (groups * inv).reshape(shape) * weight
    return out * silu if norm_before_gate else out
