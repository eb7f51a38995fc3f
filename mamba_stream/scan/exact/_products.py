"""The products, out = x weight^T + bias, in exact-1 and exact-2: kernel and twins.

k is split into 16 lanes, each summed in order (exact-1: a multiply then an add, never fused;
exact-2: one fused multiply-add a step), the lanes added by a fixed tree; the same for one row or
a thousand. The weight is read in its stored format (float32, or bfloat16 / float16 widened
exactly as it is read); block-int8 weights ("q8") take integer block sums, the blocks added in
order (`scan._quant`). The kernels are the `linear_*` of `_products.c`, on the C pool.

Separate because the products are most of a model's arithmetic and have the most variants (three
weight formats and q8, two arithmetics, the thread split): each variant and its twin in one place.
"""

from __future__ import annotations

import torch

from mamba_stream.scan._fma import fma_product
from mamba_stream.scan._quant import QB, Q8Weight, linear_q8_ref
from mamba_stream.scan.exact._build import _Library
from mamba_stream.scan.exact._threading import _threads

Tensor = torch.Tensor


class _Products(_Library):
    """The kernel call `linear` (`linear_threads` over `linear_<format>_<dtype>`, or over the q8
    product, `linear_q8_threads`), in the arithmetic of `fused`."""

    def _linear_q8(self, x: Tensor, weight: Q8Weight, bias: Tensor | None) -> Tensor:
        if x.dtype != torch.float32:
            raise TypeError(f"q8 products compute in float32, not {x.dtype}")
        k, n = x.shape[-1], weight.shape[0]
        x = x.contiguous()
        m = x.numel() // k if k else 0
        out = x.new_empty((*x.shape[:-1], n))
        if m:
            nb = (k + QB - 1) // QB
            qx = torch.empty((m, nb * QB), dtype=torch.int8)
            sx = torch.empty((m, nb), dtype=torch.float32)
            self.lib.quantize_rows_q8(x.data_ptr(), m, k, qx.data_ptr(), sx.data_ptr())
            self.lib.linear_q8_threads(self.linear_q8, qx.data_ptr(), sx.data_ptr(), m, k, weight.q.data_ptr(),
                                       weight.d.data_ptr(),
                                       weight.d8.data_ptr(), n, None if bias is None else bias.data_ptr(),
                                       out.data_ptr(), _threads(m * k * n))
        return out

    def linear(self, x: Tensor, weight: Tensor | Q8Weight, bias: Tensor | None = None) -> Tensor:
        if isinstance(weight, Q8Weight):
            return self._linear_q8(x, weight, bias)
        k, n = x.shape[-1], weight.shape[0]
        if not x.is_contiguous():
            x = x.contiguous()
        m = x.numel() // k if k else 0
        out = x.new_empty((*x.shape[:-1], n))
        if m:
            w = weight if weight.is_contiguous() else self._cached(weight, "contiguous", weight.contiguous)
            fn = self.linears.get((x.dtype, w.dtype))
            if fn is None:
                raise TypeError(f"no exact product of {x.dtype} inputs with {w.dtype} weights")
            self.lib.linear_threads(fn, x.data_ptr(), m, k, w.data_ptr(), n,
                                    None if bias is None else bias.data_ptr(), out.data_ptr(), _threads(m * k * n))
        return out


def linear_ref(x: Tensor, weight: Tensor | Q8Weight, bias: Tensor | None = None) -> Tensor:
    """The kernel `linear` in exact-1. x: (..., K); weight: (N, K); bias: (N,) -> (..., N).

    The kernel's order: 16 lanes (lane j sums k = j, j + 16, ... in order from 0, a multiply then
    an add; zeros past K), then the lanes by the fixed tree (j, j + 8), (j, j + 4), (j, j + 2),
    (0, 1); then + bias. A weight stored narrower (bfloat16, float16) is widened to x's dtype
    first, which is exact: the kernel widens each value as it reads it. Block-int8 weights take
    their own arithmetic (`scan._quant`)."""
    return _lane_product(x, weight, bias, fused=False)


def linear_fma_ref(x: Tensor, weight: Tensor | Q8Weight, bias: Tensor | None = None) -> Tensor:
    """The kernel `linear` in exact-2: `linear_ref` with each lane step one fused multiply-add
    (`scan._fma.fma_product`), as each q8 block's term; float32 only. Shapes as `linear_ref`'s."""
    if x.dtype != torch.float32:
        raise TypeError(f"exact-2 products compute in float32, not {x.dtype}")
    return _lane_product(x, weight, bias, fused=True)


def _lane_product(x: Tensor, weight: Tensor | Q8Weight, bias: Tensor | None, fused: bool) -> Tensor:
    if isinstance(weight, Q8Weight):
        return linear_q8_ref(x, weight, bias, fused=fused)
    if weight.dtype != x.dtype:
        if weight.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"no exact product of {x.dtype} inputs with {weight.dtype} weights")
        weight = weight.to(x.dtype)
    lead, k = x.shape[:-1], x.shape[-1]
    pad = (-k) % 16
    rows = torch.nn.functional.pad(x.reshape(-1, k), (0, pad)).reshape(-1, 1, (k + pad) // 16, 16)
    w = torch.nn.functional.pad(weight, (0, pad)).reshape(1, weight.shape[0], (k + pad) // 16, 16)
    if fused:
        lanes = _fused_lanes(rows, w)
    else:
        lanes = torch.zeros((rows.shape[0], weight.shape[0], 16), dtype=x.dtype)
        for b in range((k + pad) // 16):
            lanes = lanes + rows[:, :, b] * w[:, :, b]
    s8 = lanes[..., :8] + lanes[..., 8:]
    s4 = s8[..., :4] + s8[..., 4:]
    s2 = s4[..., :2] + s4[..., 2:]
    acc = s2[..., 0] + s2[..., 1]
    if bias is not None:
        acc = acc + bias
    return acc.reshape(*lead, weight.shape[0])


#: lane sums of a fused product's twin are taken this many (row, output, lane) values at a time:
#: a block's float64 temporaries stay in cache (the load-time probe runs this twin at 1.4B)
_FMA_BLOCK = 1 << 15


def _fused_lanes(rows: Tensor, w: Tensor) -> Tensor:
    """The 16 lanes of each (row, output), each lane step one fused multiply-add: rows
    (M, 1, KB, 16), w (1, N, KB, 16) float32 -> (M, N, 16) float32. The operands are widened to
    float64 once (exactly), their products taken there exactly, and each sum rounded once
    (`scan._fma.fma_product`); outputs in blocks, which changes no bit."""
    m, n, kb = rows.shape[0], w.shape[1], rows.shape[2]
    rows64 = rows.double()
    step = max(1, _FMA_BLOCK // (16 * max(m, 1)))
    out = []
    for n0 in range(0, n, step):
        w64 = w[:, n0 : n0 + step].double()
        lanes = torch.zeros((m, w64.shape[1], 16), dtype=torch.float32)
        for b in range(kb):
            lanes = fma_product(rows64[:, :, b] * w64[:, :, b], lanes)
        out.append(lanes)
    return torch.cat(out, dim=1) if out else torch.zeros((m, 0, 16), dtype=torch.float32)
