"""The few numerical primitives whose results must not depend on batch size.

The reference backend advances every stream one token at a time, so chunking cannot change its
arithmetic. Batching several streams can: on CPU, `F.linear` takes a GEMV path for one row and a
GEMM path for several, and `F.silu`/`F.softplus`/`torch.sigmoid` treat the tail of a tensor
with scalar code and the rest with vector code, so a row's value depends on where it sits.
`REFERENCE_OPS` avoids both: linears run as batched one-row products (each row the same
product whatever the batch), and the activations are built from exp/log1p, whose vector and
scalar paths agree. `tests/scan/test_ops.py` checks that this holds on the machine at hand.

`NATIVE_OPS` uses PyTorch's own kernels: faster, with last-ulp differences between batch sizes.

Attention and RoPE (`scan._attention`): the reference computes one query at a time over exactly
its keys; the native runs torch's scaled_dot_product_attention over the chunk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mamba_stream.scan._attention import attention_native, attention_reference, rope_native, rope_reference

__all__ = ["NATIVE_OPS", "REFERENCE_OPS", "Ops", "Primitives", "chunk_decays", "gelu"]

Tensor = torch.Tensor


def _linear_rows(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x (..., K) @ weight (N, K)^T, one independent (1, K) x (K, N) product per row."""
    lead = x.shape[:-1]
    k = x.shape[-1]
    n = weight.shape[0]
    rows = x.reshape(-1, k)
    m = rows.shape[0]
    if m == 0:
        out = x.new_zeros((0, n))
    else:
        # One identical (1, K) x (K, N) call per row, on a fresh (aligned) copy of the row: a
        # batched bmm is not row-invariant on every CPU (AVX-512 MKL, K=256, N=1100, float32
        # differed), and a kernel may take another path for another alignment.
        wt = weight.t()
        out = torch.cat([rows[i : i + 1].clone() @ wt for i in range(m)])
    if bias is not None:
        out = out + bias
    return out.reshape(*lead, n)


def _linear_native(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    return F.linear(x, weight, bias)


def _sigmoid_ref(x: Tensor) -> Tensor:
    return 1.0 / (1.0 + torch.exp(-x))


def _silu_ref(x: Tensor) -> Tensor:
    return x / (1.0 + torch.exp(-x))


def _softplus_ref(x: Tensor) -> Tensor:
    # Same threshold as F.softplus: above 20, softplus(x) == x to within float64 precision.
    return torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))


def _softplus_native(x: Tensor) -> Tensor:
    return F.softplus(x)


def _decay_add_ref(h: Tensor, decay: Tensor, update: Tensor) -> Tensor:
    return h * decay + update


def _decay_add_native(h: Tensor, decay: Tensor, update: Tensor) -> Tensor:
    # one pass over the state instead of two: decode is bound by state traffic
    return torch.addcmul(update, h, decay)


def _contract_ref(h: Tensor, c: Tensor) -> Tensor:
    return (h * c).sum(-1)


def _contract_native(h: Tensor, c: Tensor) -> Tensor:
    # h (..., P, N) against c (..., 1, N): a batched mat-vec, without an (..., P, N) temporary
    return torch.matmul(h, c.transpose(-1, -2)).squeeze(-1)


@dataclass(frozen=True)
class Ops:
    """A set of primitives; mixers take one and never call the others directly.

    decay_add(h, decay, update) = h * decay + update; contract(h, c) = (h * c).sum(-1) for h
    (..., P, N) and c (..., 1, N). The native versions fuse them, which changes rounding.
    attention and rope as `Primitives`' (`scan._attention`).
    """

    name: str
    linear: Callable[..., Tensor]
    silu: Callable[[Tensor], Tensor]
    sigmoid: Callable[[Tensor], Tensor]
    softplus: Callable[[Tensor], Tensor]
    decay_add: Callable[[Tensor, Tensor, Tensor], Tensor]
    contract: Callable[[Tensor, Tensor], Tensor]
    attention: Callable[..., Tensor]
    rope: Callable[..., Tensor]


@dataclass(frozen=True)
class Primitives:
    """Everything a mixer computes with: a backend is one of these per chunk length.

    The elementwise and product primitives, and the sequence primitives a mixer's `forward`
    hands its tensors to. Each sequence primitive returns its outputs and the path it took.

        linear(x (..., K), weight (N, K), bias (N,) | None) -> (..., N)
        silu, sigmoid, softplus, exp: elementwise
        norm(x, weight, bias, eps, rms): RMSNorm (rms) or LayerNorm over the last dimension
        gated_norm(x, z, weight, eps, group_size, norm_before_gate): mamba-ssm's RMSNormGated
        conv(conv_state (B, C, W), xs (B, L, C), weight (C, 1, W), bias) -> out (B, L, C), state
        selective_scan(dt, a, x, b, cc, h0) -> y, h, path                    (Mamba-1)
        ssd(x, dt, a, b, c, h0, chunk_size) -> y, h, path                     (Mamba-2)
        mamba3_scan(mixer, qn, kn, v, a, dt, trap, ang, states) -> y, states, path  (Mamba-3)
        attention(q (B, L, Hq, D), k (B, T, Hkv, D), v (B, T, Hkv, D), lengths (B,), scale)
            -> (B, L, Hq, D): causal grouped-query attention, the chunk's rows already in k, v
        rope(x (B, L, H, D), positions (B, L), theta, rotary_dim) -> (B, L, H, D)

    Shapes of the scans' arguments are in `scan._mamba1.selective_scan_steps`,
    `scan._mamba2.ssd_steps` and `scan._mamba3.mamba3_steps`, the reference twins; attention's
    and rope's contract is `scan._attention`'s docstring.
    """

    name: str
    linear: Callable[..., Tensor]
    silu: Callable[[Tensor], Tensor]
    sigmoid: Callable[[Tensor], Tensor]
    softplus: Callable[[Tensor], Tensor]
    exp: Callable[[Tensor], Tensor]
    norm: Callable[..., Tensor]
    gated_norm: Callable[..., Tensor]
    conv: Callable[..., tuple[Tensor, Tensor]]
    selective_scan: Callable[..., tuple[Tensor, Tensor, str]]
    ssd: Callable[..., tuple[Tensor, Tensor, str]]
    mamba3_scan: Callable[..., tuple[Tensor, tuple[Tensor, ...], str]]
    attention: Callable[..., Tensor]
    rope: Callable[..., Tensor]


REFERENCE_OPS = Ops("reference", _linear_rows, _silu_ref, _sigmoid_ref, _softplus_ref, _decay_add_ref, _contract_ref,
                    attention_reference, rope_reference)
NATIVE_OPS = Ops("native", _linear_native, F.silu, torch.sigmoid, _softplus_native, _decay_add_native,
                 _contract_native, attention_native, rope_native)


def conv_taps(window: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """One causal-conv output per channel from its last W inputs.

    Args:
        window: (batch, C, W), oldest input first.
        weight: (C, W).
        bias: (C,) or None.

    Returns:
        (batch, C). The taps are summed in a fixed order, elementwise, so the result depends on
        nothing but the window.
    """
    acc = window[..., 0] * weight[:, 0]
    for j in range(1, window.shape[-1]):
        acc = acc + window[..., j] * weight[:, j]
    if bias is not None:
        acc = acc + bias
    return acc


def rms_normalize(x: Tensor, eps: float) -> Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dimension."""
    return x * (1.0 / torch.sqrt((x * x).mean(dim=-1, keepdim=True) + eps))


def norm(x: Tensor, weight: Tensor, bias: Tensor | None, eps: float, rms: bool) -> Tensor:
    """RMSNorm (rms=True) or LayerNorm over the last dimension, with affine weight (and bias)."""
    if rms:
        out = rms_normalize(x, eps) * weight
    else:
        mean = x.mean(dim=-1, keepdim=True)
        xc = x - mean
        out = xc * (1.0 / torch.sqrt((xc * xc).mean(dim=-1, keepdim=True) + eps)) * weight
    if bias is not None:
        out = out + bias
    return out


def gated_rms_norm(
    x: Tensor,
    z: Tensor | None,
    weight: Tensor,
    eps: float,
    group_size: int,
    norm_before_gate: bool,
    silu: Callable[[Tensor], Tensor],
) -> Tensor:
    """mamba-ssm's RMSNormGated: norm(x) * silu(z), or norm(x * silu(z)), per group.

    Args:
        x: (..., D) with D a multiple of group_size.
        z: (..., D) gate or None.
    """
    if z is not None and not norm_before_gate:
        x = x * silu(z)
    shape = x.shape
    groups = x.reshape(*shape[:-1], shape[-1] // group_size, group_size)
    out = rms_normalize(groups, eps).reshape(shape) * weight
    if z is not None and norm_before_gate:
        out = out * silu(z)
    return out


#: erfc(z) ~= t * exp(-z*z + P(t)), t = 1 / (1 + z/2), z >= 0 (Numerical Recipes' `erfcc`, a
#: Chebyshev fit): P's coefficients, constant term first; fractional error below 1.2e-7 for every z
_ERFC_COEFFS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
                1.48851587, -0.82215223, 0.17087277)
_SQRT1_2 = 0.7071067811865476  # 1 / sqrt(2), correctly rounded


def gelu(x: Tensor, exp: Callable[[Tensor], Tensor]) -> Tensor:
    """The exact (erf) GELU, x * Phi(x), Phi the standard normal CDF: x (...) -> (...), x's dtype.

    torch's `erf` (and `F.gelu`) is not the same function on every CPU (AVX2 and AVX-512 kernels
    round differently), so Phi is built of IEEE-exact elementwise operations (+, -, *, /, abs,
    comparison, where: each correctly rounded, in this fixed order, no fused multiply-add) and
    `exp`, the backend's (the exact backend's is the same on every CPU): with z = |x| / sqrt(2),
    e = erfc(z) / 2 by the fit above, Phi(x) = e for x < 0 and 1 - e otherwise, so both tails
    keep their relative precision (no 1 - 1 cancellation on the negative side).
    Elementwise: each output depends on its own input alone, whatever the shape or batch. In
    float32 within 3.8e-7 of the truth over [-12, 12] (torch's own F.gelu: 3.7e-7; tests/scan/
    test_gelu.py); in float64 the fit's 1.2e-7 relative error is the error.
    """
    z = x.abs() * _SQRT1_2
    one = torch.ones_like(z)
    t = one / (one + z * 0.5)
    p = t * _ERFC_COEFFS[-1] + _ERFC_COEFFS[-2]
    for c in reversed(_ERFC_COEFFS[:-2]):
        p = p * t + c
    half_erfc = t * exp(p - z * z) * 0.5
    return x * torch.where(x < 0, half_erfc, one - half_erfc)


def chunk_decays(log_decay: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The decays of a chunked scan, from per-position log-decays.

    The decay from position j to i of a chunk is exp of the log-decays summed over j < l <= i,
    taken as the difference of two sums from the chunk start. The sums are float64: in float32
    that difference cancels away the precision of a long or fast-decaying chunk (a trained
    Mamba-2's chunked logits drifted 4e-4 of their scale from the truth, 1.1e-5 with float64).

    Args:
        log_decay: (B, K, Q, *heads) log-decay of each position of each chunk (<= 0).
        dtype: the dtype of the decays returned.

    Returns:
        within (B, K, *heads, Qi, Qj): the decay from j to i, 0 where j > i;
        to_end (B, K, Q, *heads): from each position to the chunk's end;
        whole (B, K, *heads): over the whole chunk;
        from_start (B, K, Q, *heads): from the chunk's start to each position.
    """
    acum = torch.cumsum(log_decay.double(), dim=2)
    ac = acum.movedim(2, -1)  # (B, K, *heads, Q)
    diff = ac.unsqueeze(-1) - ac.unsqueeze(-2)
    q = log_decay.shape[2]
    causal = torch.ones(q, q, dtype=torch.bool, device=log_decay.device).tril()
    within = torch.exp(torch.where(causal, diff, torch.full_like(diff, float("-inf")))).to(dtype)
    to_end = torch.exp(acum[:, :, -1:] - acum).to(dtype)
    return within, to_end, torch.exp(acum[:, :, -1]).to(dtype), torch.exp(acum).to(dtype)
