"""Attention and RoPE on the reference, chunked and triton backends (`scan._attention`).

Every backend's primitives carry `attention` and `rope`. The reference computes one query at a
time over exactly its keys, so on this machine its bits do not depend on the chunking or the
batch; the native (torch's SDPA) is close to it; triton refuses, typed; malformed calls are
refused before any arithmetic. The exact backend's are tested in tests/scan/exact/test_attention.py.
"""

from __future__ import annotations

import pytest
import torch

from mamba_stream.scan._attention import (
    attention_native,
    attention_reference,
    check_attention,
    rope_native,
    rope_reference,
)
from mamba_stream.scan._backends import CHUNKED, REFERENCE
from mamba_stream.scan._errors import UnsupportedBackend
from mamba_stream.scan._triton import TRITON

F32, F64 = torch.float32, torch.float64
CHUNKINGS = [[96], [1, 7, 30, 58], [1] * 96]


def _qkv(seed: int, b: int, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(b, t, h, d, generator=g, dtype=F64).to(dtype) for h in (hq, hkv, hkv))


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over (row, query, head) of max |out - ref| / max |ref| over the head's features."""
    diff = (out.double() - ref.double()).abs().amax(-1)
    return float((diff / ref.double().abs().amax(-1)).max())


def _fed(attention, q, k, v, sizes: list[int]) -> torch.Tensor:
    """Every query's output when the sequence comes in chunks of `sizes`, the KV growing; the
    buffer passed is 4 rows longer than what it holds, those rows NaN."""
    outs, n = [], 0
    for c in sizes:
        n += c
        pad = torch.full((1, 4, *k.shape[2:]), float("nan"), dtype=k.dtype)
        outs.append(attention(q[:, n - c : n], torch.cat([k[:, :n], pad], 1), torch.cat([v[:, :n], pad], 1), [n], 0.25))
    return torch.cat(outs, 1)


def test_every_backend_has_attention_and_rope_and_triton_refuses_attention():
    q, k, v = _qkv(0, 1, 4, 4, 2, 8, F32)
    for prims in (REFERENCE.primitives(1), CHUNKED.primitives(1), CHUNKED.primitives(4)):
        assert prims.attention(q, k, v, [4], 0.5).shape == q.shape
        assert prims.rope(q, torch.arange(4)[None], 10000.0, 8).shape == q.shape
    for length in (1, 4):
        with pytest.raises(UnsupportedBackend, match="triton"):
            TRITON.primitives(length).attention(q, k, v, [4], 0.5)
        assert TRITON.primitives(length).rope(q, torch.arange(4)[None], 10000.0, 8).shape == q.shape


@pytest.mark.parametrize("dtype", [F32, F64])
def test_the_reference_gives_the_same_bits_under_every_chunking_and_batch(dtype):
    q, k, v = _qkv(1, 1, 96, 8, 2, 16, dtype)
    outs = [_fed(attention_reference, q, k, v, sizes) for sizes in CHUNKINGS]
    assert all(torch.equal(outs[0], o) for o in outs)
    lengths = [96, 40, 17]
    qb, kb, vb = _qkv(2, 3, 100, 8, 2, 16, dtype)
    for row, n in enumerate(lengths):
        kb[row, n:], vb[row, n:] = float("nan"), 1e30
    batched = attention_reference(qb[:, :5], kb, vb, lengths, 0.25)
    for row, n in enumerate(lengths):
        alone = attention_reference(qb[row : row + 1, :5], kb[row : row + 1, :n], vb[row : row + 1, :n], [n], 0.25)
        assert torch.equal(batched[row : row + 1], alone)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_sdpa_is_close_to_the_reference_and_padding_cannot_reach_it(dtype):
    """GQA 32/8 heads of 64; rows of 96 and 50 positions, the second padded with NaN."""
    q, k, v = _qkv(3, 2, 96, 32, 8, 64, dtype)
    k[1, 50:], v[1, 50:] = float("nan"), float("nan")
    ref = attention_reference(q[:, -20:].double(), k.double(), v.double(), [96, 50], 0.125)
    out = attention_native(q[:, -20:], k, v, torch.tensor([96, 50]), 0.125)
    assert bool(torch.isfinite(out).all())
    assert _rel(out, ref) <= (4e-6 if dtype == F32 else 1e-14)


def test_stored_bfloat16_keys_and_values_are_read_widened():
    q, k, v = _qkv(4, 1, 20, 4, 2, 16, F32)
    k16, v16 = k.to(torch.bfloat16), v.to(torch.bfloat16)
    for fn in (attention_reference, attention_native):
        assert torch.equal(fn(q, k16, v16, [20], 0.25), fn(q, k16.float(), v16.float(), [20], 0.25))


def test_malformed_calls_are_refused_before_any_arithmetic():
    q, k, v = _qkv(5, 2, 10, 6, 4, 8, F32)
    with pytest.raises(ValueError, match="cannot share"):
        check_attention(q, k, v, [10, 10])
    q, k, v = _qkv(5, 2, 10, 8, 4, 8, F32)
    with pytest.raises(ValueError, match="at least its"):
        check_attention(q[:, :5], k, v, [10, 4])
    with pytest.raises(ValueError, match="at most"):
        check_attention(q[:, :5], k, v, [10, 11])
    with pytest.raises(ValueError, match="lengths for a batch"):
        check_attention(q, k, v, [10])
    with pytest.raises(ValueError, match="do not fit"):
        check_attention(q, k[..., :4], v, [10, 10])
    with pytest.raises(TypeError, match="float32 as the queries"):
        check_attention(q, k.double(), v, [10, 10])
    with pytest.raises(TypeError, match="float32 or float64"):
        check_attention(q.half(), k.half(), v.half(), [10, 10])
    for rope in (rope_reference, rope_native):
        with pytest.raises(ValueError, match="rotary_dim"):
            rope(q, torch.zeros(2, 10, dtype=torch.int64), 10000.0, 7)
        with pytest.raises(ValueError, match="positions"):
            rope(q, torch.zeros(2, 9, dtype=torch.int64), 10000.0, 8)


@pytest.mark.parametrize("dtype", [F32, F64])
def test_reference_rope_is_chunk_and_batch_invariant_and_native_is_close(dtype):
    x = torch.randn(2, 96, 4, 64, generator=torch.Generator().manual_seed(6), dtype=F64).to(dtype)
    positions = torch.stack([torch.arange(96), torch.arange(5000, 5096)])
    whole = rope_reference(x, positions, 10000.0, 64)
    for sizes in CHUNKINGS:
        n, parts = 0, []
        for c in sizes:
            parts.append(rope_reference(x[:, n : n + c], positions[:, n : n + c], 10000.0, 64))
            n += c
        assert torch.equal(torch.cat(parts, 1), whole)
    assert torch.equal(rope_reference(x[1:], positions[1:], 10000.0, 64), whole[1:])
    assert _rel(rope_native(x, positions, 10000.0, 64), whole) <= (2.5e-7 if dtype == F32 else 1e-15)
