"""Causal grouped-query attention and rotary position embeddings in the exact arithmetic.

Composed of the exact primitives (the product `linear`, `unary`'s exp, sin and cos) and IEEE
basic operations (*, -, /, max, select), so there is no kernel of its own and no twin of its own:
`attention(ops, ...)` over the kernels (`_kernels._Kernels`, path "exact") and over the twins
(`TWIN_OPS`, path "exact-twin") computes the same bits because every op it calls does.

Shapes (B streams, L the chunk's queries, T key positions held, Hq query heads, Hkv key/value
heads, G = Hq // Hkv, D the head dimension):

    q        (batch, seqlen, n_q_heads, headdim)               the chunk's queries, (B, L, Hq, D)
    k, v     (batch, max_positions_in_batch, n_kv_heads, headdim)
                                                              every position so far, the chunk's own
                                                              included, (B, T, Hkv, D); float32 or
                                                              float64 as q, or stored bfloat16/float16
    lengths  (batch,) int                                     positions row b holds (L <= n_b <= T)
    out      (batch, seqlen, n_q_heads, headdim)               as q

Query i of row b sits at position p = n_b - L + i and sees keys 0..p; query head h reads kv head
h // G. Rows of k and v at positions >= n_b are never read (they may hold anything: NaN, huge
values, another stream's past).

Why a query's output depends on nothing but its own keys (and so never on the chunking, the batch
or how many positions the caller passed):

    score_j  = linear(q, k)[j] * scale: one product per (query, key), in the product's fixed order
               over the head dimension, the same whatever else is in the call (`_products`).
    m        = the max of the scores of keys 0..p: a max is exact whatever the order (a -0.0
               against a +0.0 may come out either way, but s - (+-0) and exp(+-0) = 1 do not care).
    p_j      = exp(score_j - m) for j <= p, exactly +0.0 for j > p (selected, not computed: a
               future key's score may be anything).
    [num, den] = linear(p, [v^T; 1]): the position sums of p_j v_j and of p_j through the product,
               so position j always adds into lane j % 16, in position order, whatever the number
               of positions in the call. The positions after p that a chunk's earlier query sees
               in the same call (its chunk's later keys) add +0 * v_j = +-0.0 to a lane. A lane
               starts at +0.0 and, rounding to nearest, a sum that cancels is +0.0, so a lane never
               holds -0.0; and x + (+-0.0) = x for every x that is not -0.0. The zeros change no
               bit: the lanes, the tree that adds them and the quotient are those of the call that
               held exactly keys 0..p.
    out      = num / den.

This holds for finite values at the held positions: a chunk's later value that is infinite or NaN
makes 0 * v NaN for the chunk's earlier queries too (the forward refuses a non-finite output
whichever chunking meets it first). Padding rows (positions >= n_b) are sliced away before any
arithmetic, so nothing there reaches a result, finite or not.

RoPE (`rope`): the HF "rotate_half" convention (Llama, Bamba, Granite, ...):
x' = x * cos + rotate_half(x) * sin over the first `rotary_dim` features, the rest unchanged, with
angle position * inv_freq[i], inv_freq[i] = theta^(-2i / rotary_dim). inv_freq is computed once
per (theta, rotary_dim) from basic float64 operations (`_unary`'s exp and log, no libm), the angle
is one float64 product (exact inputs: a position below 2^53), cos and sin are `unary`'s, rounded
to x's dtype once. transformers computes the angle in float32 (its error grows with the position:
some 2e-3 rad at 32k); ours is the float64 one, rounded once.

Separate because attention is the one layer whose reduction runs over positions (the KV rows a
stream owns), and because it is composed, not compiled: this is where its exactness argument lives.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from mamba_stream.scan._attention import check_attention, check_rope, rotate
from mamba_stream.scan.exact._unary import _exp64, _log_ge1_64

Tensor = torch.Tensor

__all__ = ["QUERY_BLOCK", "attention", "rope", "rope_angles", "rope_inv_freq"]

#: queries per block of a long chunk: bounds the scores held at once to QUERY_BLOCK * G rows of T
#: (a query's bits never depend on its block: each is its own row of every product)
QUERY_BLOCK = 64


def attention(ops: Any, q: Tensor, k: Tensor, v: Tensor, lengths: Tensor | list[int], scale: float) -> Tensor:
    """Causal grouped-query attention over each row's held positions, in the exact arithmetic.

    Args:
        ops: the kernels or the twins (`linear`, `unary`).
        q: (batch, seqlen, n_q_heads, headdim), float32 or float64.
        k: (batch, max_positions_in_batch, n_kv_heads, headdim), q's dtype or bfloat16/float16.
        v: (batch, max_positions_in_batch, n_kv_heads, headdim_v), as k.
        lengths: (batch,) int, positions row b holds, its chunk's included.
        scale: the scores' factor (1/sqrt(headdim), or a model's attention multiplier).

    Returns:
        (batch, seqlen, n_q_heads, headdim_v) in q's dtype; see the module docstring for why each
        query's bits depend on its keys 0..p alone.
    """
    ns = check_attention(q, k, v, lengths)
    b, seqlen, hq, _ = q.shape
    hkv, dv = k.shape[2], v.shape[3]
    group = hq // hkv
    out = q.new_empty((b, seqlen, hq, dv))
    for row, n in enumerate(ns):
        start = n - seqlen  # the position of the chunk's first query
        # only the row's n positions from here on: its padding rows are never read
        keys, values = _by_head(k[row, :n], v[row, :n])
        for i0 in range(0, seqlen, QUERY_BLOCK):
            i1 = min(seqlen, i0 + QUERY_BLOCK)
            held = start + i1  # keys 0..held-1: the block's last query's
            # (queries, group) rows, query-major: row r is query i0 + r // group
            pos = torch.arange(start + i0, start + i1).repeat_interleave(group)
            future = torch.arange(held).unsqueeze(0) > pos.unsqueeze(1)  # (rows, held)
            for g in range(hkv):
                qg = q[row, i0:i1, g * group : (g + 1) * group].reshape(-1, q.shape[3]).contiguous()
                vt1 = values[g, :, :held] if held == n else values[g, :, :held].contiguous()
                out[row, i0:i1, g * group : (g + 1) * group] = _one_group(
                    ops, qg, keys[g, :held], vt1, future, scale).reshape(i1 - i0, group, dv)
    return out


def _by_head(k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """A row's keys and values laid out for the products: k (n, Hkv, D) -> (Hkv, n, D); v
    (n, Hkv, Dv) -> (Hkv, Dv + 1, n), each head's [v^T; 1] (the ones row gives the denominator, and
    is exact in any stored format). A copy, not arithmetic: no bit changes."""
    n, hkv, dv = v.shape
    keys = k.transpose(0, 1).contiguous()
    ext = torch.cat([v, v.new_ones((n, hkv, 1))], dim=-1).reshape(n, hkv * (dv + 1))
    # one 2-D transpose of a contiguous matrix, which torch copies in cache blocks: 2.5x faster
    # than a transposed copy per head at 1k and 4k positions, 8 heads of 64 (a decode's time is
    # mostly these copies: a state laid out as the products read it would need none)
    return keys, ext.t().contiguous().view(hkv, dv + 1, n)


def _one_group(ops: Any, qg: Tensor, kg: Tensor, vt1: Tensor, future: Tensor, scale: float) -> Tensor:
    """The queries of one kv head: qg (rows, D) against kg (held, D) and vt1 = [v^T; 1]
    (Dv + 1, held), all contiguous, with future (rows, held) True where a key comes after its
    query -> (rows, Dv)."""
    scores = ops.linear(qg, kg).mul_(scale)
    # selected, never added: a future key's score may be NaN or inf, and NaN + -inf is NaN
    scores.masked_fill_(future, float("-inf"))
    top = scores.amax(dim=-1, keepdim=True)
    p = ops.unary(scores.sub_(top), "exp").masked_fill_(future, 0.0)  # exactly +0.0 for future keys
    # the numerators and the denominator in one product, each position in its lane whatever the length
    sums = ops.linear(p, vt1)
    return sums[:, :-1] / sums[:, -1:]


@functools.cache
def rope_inv_freq(theta: float, rotary_dim: int) -> Tensor:
    """inv_freq[i] = theta^(-2i / rotary_dim), i < rotary_dim / 2, as exp(-(2i / rotary_dim) ln theta)
    from `_unary`'s float64 exp and log (basic operations only: the same bits on every machine).
    (rotary_dim // 2,) float64; computed once per (theta, rotary_dim)."""
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim is a positive even number, not {rotary_dim}")
    if not theta > 1.0:
        raise ValueError(f"rope theta is above 1, not {theta}")
    exponent = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    log_theta = _log_ge1_64(torch.tensor([float(theta)], dtype=torch.float64))
    return _exp64(-(exponent * log_theta))


def rope_angles(positions: Tensor, theta: float, rotary_dim: int) -> Tensor:
    """position * inv_freq: positions (batch, seqlen) int -> (batch, seqlen, rotary_dim // 2) float64,
    one rounding each (a position below 2^53 is exact in float64)."""
    return positions.to(torch.float64).unsqueeze(-1) * rope_inv_freq(float(theta), int(rotary_dim))


def rope(ops: Any, x: Tensor, positions: Tensor, theta: float, rotary_dim: int) -> Tensor:
    """Rotary position embedding, HF "rotate_half" convention, with the exact sin and cos.

    Args:
        ops: the kernels or the twins (`unary`).
        x: (batch, seqlen, heads, headdim) queries or keys, float32 or float64.
        positions: (batch, seqlen) int, each token's position in its stream.
        theta: the base (`rope_theta`).
        rotary_dim: how many leading features rotate (headdim * partial_rotary_factor; even).

    Returns:
        x's shape and dtype. Each token's bits depend on its features and its position alone.
    """
    check_rope(x, positions, rotary_dim)
    angles = rope_angles(positions, theta, rotary_dim)
    cos = ops.unary(angles, "cos").to(x.dtype)
    sin = ops.unary(angles, "sin").to(x.dtype)
    return rotate(x, cos, sin)
