"""Causal grouped-query attention and rotary position embeddings: the contract, the reference, the native.

Every backend's primitives carry `attention` and `rope` (`scan._ops.Primitives`), so a hybrid
model's one forward pass calls `prims.attention(...)` and `prims.rope(...)` whatever runs it:

    attention(q, k, v, lengths, scale) -> out
        q        (batch, seqlen, n_q_heads, headdim)          the chunk's queries (B, L, Hq, D)
        k, v     (batch, max_positions_in_batch, n_kv_heads, headdim)
                                                             every position so far, the chunk's own
                                                             rows included (the caller appends them
                                                             first), (B, T, Hkv, D); q's dtype or
                                                             stored bfloat16/float16
        lengths  (batch,) int                                positions row b holds, L <= n_b <= T
        scale    float                                       the scores' factor (1/sqrt(D) or a
                                                             model's attention multiplier)
        out      (batch, seqlen, n_q_heads, headdim)          in q's dtype

    Query i of row b sits at position n_b - L + i and sees keys 0..that position; query head h
    reads kv head h // (Hq // Hkv). Rows at positions >= n_b are padding: never read.

    rope(x, positions, theta, rotary_dim) -> x'
        x (batch, seqlen, heads, headdim); positions (batch, seqlen) int; the HF "rotate_half"
        convention (transformers' `apply_rotary_pos_emb`) over the first rotary_dim features,
        inv_freq[i] = theta^(-2i / rotary_dim).

The implementations:

    reference  one query at a time over exactly its keys, plain softmax; computes in q's dtype
               (pass float64 for a float64 reference). Each query's arithmetic has shapes that
               depend on its position alone, so on one machine it is the same under any chunking
               and batching (as the reference backend's other primitives). RoPE: float64 angles,
               torch's cos/sin one token at a time.
    native     torch's scaled_dot_product_attention over the chunk with a causal mask per row:
               fast, not exact (its reductions follow the shapes; tolerance-tested). RoPE: float64
               angles, torch's cos/sin over the whole chunk.
    exact      `scan.exact._attention`: composed of the exact product and exp, sin, cos; a
               query's bits depend on its keys alone.
    triton     refuses attention (`UnsupportedBackend`): no Triton attention kernel is wired.

Separate because the contract is shared by all of them (`check_attention`, `rotate`), and the
exact module builds on it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mamba_stream.scan._errors import UnsupportedBackend

__all__ = ["attention_native", "attention_reference", "attention_unsupported", "check_attention", "check_rope",
           "rope_native", "rope_reference", "rotate"]

Tensor = torch.Tensor

#: what k and v may be stored as besides the compute dtype (widened exactly before use)
STORED_KV = (torch.bfloat16, torch.float16)


def check_attention(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | list[int]) -> list[int]:
    """The shapes of an attention call checked (ValueError, TypeError); the lengths as ints.

    q (B, L, Hq, D); k (B, T, Hkv, D); v (B, T, Hkv, Dv); lengths (B,) with L <= n_b <= T and Hq a
    multiple of Hkv. k and v in q's dtype, or stored in bfloat16/float16.
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k and v are (batch, positions, heads, headdim): got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    b, seqlen, hq, d = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} do not fit q {tuple(q.shape)}")
    hkv = k.shape[2]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{hq} query heads cannot share {hkv} key/value heads")
    if q.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"attention computes in float32 or float64, not {q.dtype}")
    for t in (k, v):
        if t.dtype != q.dtype and t.dtype not in STORED_KV:
            raise TypeError(f"keys and values are {q.dtype} as the queries, or stored bfloat16/float16; "
                            f"not {t.dtype}")
    ns = [int(n) for n in (lengths.tolist() if isinstance(lengths, Tensor) else lengths)]
    if len(ns) != b:
        raise ValueError(f"{len(ns)} lengths for a batch of {b}")
    for n in ns:
        if not seqlen <= n <= k.shape[1]:
            raise ValueError(f"a row holds {n} positions: at least its {seqlen} queries, at most the "
                             f"{k.shape[1]} positions passed")
    return ns


def attention_reference(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | list[int], scale: float) -> Tensor:
    """Plain softmax attention, one query at a time over exactly its keys, in q's dtype.

    Shapes as the module docstring's: q (B, L, Hq, D), k/v (B, T, Hkv, D), lengths (B,) ->
    (B, L, Hq, D). A query's products have shapes fixed by its position, on fresh copies of its
    keys, so its bits do not depend on the chunk or the batch around it (on this machine).
    """
    ns = check_attention(q, k, v, lengths)
    b, seqlen, hq, d = q.shape
    hkv = k.shape[2]
    out = q.new_empty((b, seqlen, hq, v.shape[3]))
    for row, n in enumerate(ns):
        for i in range(seqlen):
            seen = n - seqlen + i + 1
            kk = k[row, :seen].to(q.dtype).transpose(0, 1).contiguous()  # (Hkv, seen, D)
            vv = v[row, :seen].to(q.dtype).transpose(0, 1).contiguous()
            qq = q[row, i].reshape(hkv, hq // hkv, d).contiguous()  # (Hkv, G, D)
            weights = torch.softmax(torch.matmul(qq, kk.transpose(1, 2)) * scale, dim=-1)
            out[row, i] = torch.matmul(weights, vv).reshape(hq, -1)
    return out


def attention_native(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | list[int], scale: float) -> Tensor:
    """torch's scaled_dot_product_attention with a causal mask per row (fast, not exact).

    Shapes as the module docstring's. Padding rows are zeroed first: SDPA adds its -inf mask to
    the scores and multiplies its zero weights by the values, so a NaN there would spread.
    """
    ns = check_attention(q, k, v, lengths)
    seqlen, t = q.shape[1], k.shape[1]
    n = torch.tensor(ns, device=q.device).unsqueeze(1)  # (B, 1)
    keys = torch.arange(t, device=q.device)
    held = (keys.unsqueeze(0) < n)[:, :, None, None]  # (B, T, 1, 1)
    k = torch.where(held, k.to(q.dtype), 0.0)
    v = torch.where(held, v.to(q.dtype), 0.0)
    pos = n - seqlen + torch.arange(seqlen, device=q.device).unsqueeze(0)  # (B, L)
    mask = keys.view(1, 1, t) <= pos.unsqueeze(-1)  # (B, L, T)
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True)
    return out.transpose(1, 2)


def attention_unsupported(backend: str) -> Callable[..., Tensor]:
    """An attention primitive for a backend that has none: it refuses, typed."""

    def refuse(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | list[int], scale: float) -> Tensor:
        raise UnsupportedBackend(f"the {backend} backend has no attention kernel; run a hybrid model on the "
                                 "exact, chunked or reference backend")

    return refuse


def check_rope(x: Tensor, positions: Tensor, rotary_dim: int) -> None:
    """A rope call's shapes checked (ValueError): x (B, L, H, D), positions (B, L), rotary_dim even, <= D."""
    if x.dim() != 4 or tuple(positions.shape) != tuple(x.shape[:2]):
        raise ValueError(f"rope takes x (batch, seqlen, heads, headdim) and positions (batch, seqlen): got "
                         f"{tuple(x.shape)} and {tuple(positions.shape)}")
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > x.shape[-1]:
        raise ValueError(f"rotary_dim is even, positive and at most the head dimension {x.shape[-1]}: "
                         f"not {rotary_dim}")


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """transformers' `apply_rotary_pos_emb` on one tensor, in its operations and their order:
    x (batch, seqlen, heads, headdim), cos/sin (batch, seqlen, rotary_dim // 2) in x's dtype ->
    x's shape; the features past rotary_dim pass unchanged."""
    half = cos.shape[-1]
    rot = x[..., : 2 * half]
    cos2 = torch.cat([cos, cos], dim=-1).unsqueeze(2)
    sin2 = torch.cat([sin, sin], dim=-1).unsqueeze(2)
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos2 + rotated * sin2
    if 2 * half == x.shape[-1]:
        return out
    return torch.cat([out, x[..., 2 * half :]], dim=-1)


def _reference_angles(positions: Tensor, theta: float, rotary_dim: int) -> Tensor:
    """(B, L) -> (B, L, rotary_dim // 2) float64: transformers' inv_freq formula, in float64."""
    inv_freq = 1.0 / (float(theta) ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    return positions.to(torch.float64).unsqueeze(-1) * inv_freq.to(positions.device)


def rope_reference(x: Tensor, positions: Tensor, theta: float, rotary_dim: int) -> Tensor:
    """RoPE with float64 angles and torch's float64 cos/sin, one token at a time (a fixed shape per
    token, so the same bits whatever the batch on this machine). Shapes as `rotate`'s."""
    check_rope(x, positions, rotary_dim)
    angles = _reference_angles(positions, theta, rotary_dim)
    flat = angles.reshape(-1, rotary_dim // 2)
    cos = torch.stack([torch.cos(a.clone()) for a in flat]) if len(flat) else flat.clone()
    sin = torch.stack([torch.sin(a.clone()) for a in flat]) if len(flat) else flat.clone()
    return rotate(x, cos.reshape(angles.shape).to(x.dtype), sin.reshape(angles.shape).to(x.dtype))


def rope_native(x: Tensor, positions: Tensor, theta: float, rotary_dim: int) -> Tensor:
    """RoPE with float64 angles and torch's cos/sin over the chunk at once. Shapes as `rotate`'s."""
    check_rope(x, positions, rotary_dim)
    angles = _reference_angles(positions, theta, rotary_dim)
    return rotate(x, torch.cos(angles).to(x.dtype), torch.sin(angles).to(x.dtype))
