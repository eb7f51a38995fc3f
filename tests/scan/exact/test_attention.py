"""Exact attention and RoPE (`exact._attention`): a query's output depends on its keys alone.

Bit-identical for every chunking ([96], [1, 7, 30, 58], 96 x 1, the caller's KV growing in a
buffer with garbage past its rows) and every batch composition (rows of other lengths, padding
holding NaN, infinities or huge values), on the kernels (path "exact") and the twins
("exact-twin"), which give the same bits; close to a float64 reference and to transformers. The
negative controls show the checks can fail: torch's SDPA over the same chunkings is not
bit-identical here, and a query that sees one future key fails the reference bound.
"""

from __future__ import annotations

import hashlib
import types

import pytest
import torch

from mamba_stream.scan._attention import attention_native, attention_reference, rope_reference
from mamba_stream.scan.exact import _attention, exact_primitives, twin_primitives
from mamba_stream.scan.exact._kernels import _kernel_ops
from tests.scan.exact._helpers import NEEDS_KERNELS

F32, F64 = torch.float32, torch.float64
#: where the primitives run; the twins need no compiler
WHERE = [pytest.param("kernels", marks=NEEDS_KERNELS), "twins"]
#: (fused, compute dtype): exact-1 in float32 and float64, exact-2 (float32 only)
ARITHMETICS = [(False, F32), (False, F64), (True, F32)]
CHUNKINGS = {"whole": [96], "mixed": [1, 7, 30, 58], "tokens": [1] * 96}
#: the largest error against the float64 reference, relative to the largest |output| of the same
#: (query, head): measured at most 5.5e-7 in float32 (exact-1 and exact-2, K/V float32 or stored
#: bfloat16, 12 seeds for each shape below) and 2.9e-15 in float64, where the reference's own
#: rounding is of the same size (torch's SDPA: 1.1e-6 and 3.1e-15)
BOUND = {F32: 1e-6, F64: 1e-14}


def _prims(where: str, fused: bool = False):
    if where == "kernels":
        return exact_primitives(_kernel_ops(fused), "exact")
    return twin_primitives(fused)


def _qkv(seed: int, b: int, t: int, hq: int, hkv: int, d: int, dtype: torch.dtype,
         kv_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, t, h, d, generator=g, dtype=F64) for h in (hq, hkv, hkv))
    return q.to(dtype), k.to(kv_dtype or dtype), v.to(kv_dtype or dtype)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over (row, query, head) of max |out - ref| / max |ref| over the head's features."""
    diff = (out.double() - ref.double()).abs().amax(-1)
    return float((diff / ref.double().abs().amax(-1)).max())


def _garbage(like: torch.Tensor, rows: int) -> torch.Tensor:
    """Padding rows past a row's positions: NaN, infinities and huge values, as a stale buffer may hold."""
    shape = (like.shape[0], rows, *like.shape[2:])
    values = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e30], dtype=F64)
    return values[torch.arange(torch.Size(shape).numel()) % len(values)].reshape(shape).to(like.dtype)


def _fed(attention, q, k, v, sizes: list[int], scale: float, pad: int = 3) -> torch.Tensor:
    """The outputs of every query when the sequence comes in chunks of `sizes`: the caller appends
    each chunk's rows, then calls with a buffer `pad` rows longer than what it holds."""
    outs, n = [], 0
    for c in sizes:
        n += c
        kb, vb = torch.cat([k[:, :n], _garbage(k, pad)], 1), torch.cat([v[:, :n], _garbage(v, pad)], 1)
        outs.append(attention(q[:, n - c : n], kb, vb, torch.tensor([n] * q.shape[0]), scale))
    return torch.cat(outs, 1)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(("fused", "dtype"), ARITHMETICS)
@pytest.mark.parametrize(("hq", "hkv", "d", "stored"), [(8, 2, 16, None), (8, 2, 64, None), (32, 8, 64, None),
                                                         (8, 2, 64, torch.bfloat16)])
def test_attention_is_close_to_a_float64_reference(where, fused, dtype, hq, hkv, d, stored):
    q, k, v = _qkv(hq * d, 2, 96, hq, hkv, d, dtype, stored)
    lengths = [96, 61]  # the second row: its 61 positions, then 35 rows of padding
    k[1, 61:], v[1, 61:] = _garbage(k, 35)[1], _garbage(v, 35)[1]
    q = q[:, -30:]  # a chunk of 30 queries at the end of each row
    out = _prims(where, fused).attention(q, k, v, torch.tensor(lengths), d**-0.5)
    ref = attention_reference(q.double(), k.double(), v.double(), lengths, d**-0.5)
    assert out.dtype == dtype and out.shape == q.shape
    assert _rel(out, ref) <= BOUND[dtype]


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(("fused", "dtype"), ARITHMETICS)
def test_every_chunking_gives_the_same_bits(where, fused, dtype):
    q, k, v = _qkv(1, 1, 96, 8, 2, 16, dtype)
    v[:, 5], v[:, 6, :, :8], k[:, 7] = -0.0, 0.0, -0.0  # signed zeros among the values and keys
    attention = _prims(where, fused).attention
    outs = {name: _fed(attention, q, k, v, sizes, 0.25) for name, sizes in CHUNKINGS.items()}
    assert all(torch.equal(outs["whole"], o) for o in outs.values())
    assert bool(torch.isfinite(outs["whole"]).all())


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(("fused", "dtype"), ARITHMETICS)
def test_a_row_has_the_same_bits_alone_and_in_any_batch(where, fused, dtype):
    """Rows of other lengths beside it, in another order, with garbage in every padding row."""
    lengths = [96, 40, 17, 70]
    seqlen, t = 5, 100
    q, k, v = _qkv(2, len(lengths), t, 8, 2, 16, dtype)
    for row, n in enumerate(lengths):
        k[row, n:], v[row, n:] = _garbage(k, t - n)[row], _garbage(v, t - n)[row]
    attention = _prims(where, fused).attention
    batched = attention(q[:, :seqlen], k, v, torch.tensor(lengths), 0.25)
    flipped = attention(q[:, :seqlen].flip(0), k.flip(0), v.flip(0), torch.tensor(lengths[::-1]), 0.25).flip(0)
    for row, n in enumerate(lengths):
        alone = attention(q[row : row + 1, :seqlen], k[row : row + 1, :n], v[row : row + 1, :n], [n], 0.25)
        assert torch.equal(batched[row : row + 1], alone) and torch.equal(flipped[row : row + 1], alone), n
    assert bool(torch.isfinite(batched).all())


@NEEDS_KERNELS
@pytest.mark.parametrize(("fused", "dtype"), ARITHMETICS)
@pytest.mark.parametrize("stored", [None, torch.bfloat16, torch.float16])
def test_the_kernels_give_the_twins_bits(fused, dtype, stored, monkeypatch):
    """Long enough for several query blocks and lane remainders; GQA with head dimension 64; K/V
    stored narrow. Smaller query blocks change no bit either."""
    q, k, v = _qkv(3, 2, 203, 8, 2, 64, dtype, stored)
    lengths = torch.tensor([203, 150])
    kernels, twins = _prims("kernels", fused).attention, _prims("twins", fused).attention
    a = kernels(q[:, -130:], k, v, lengths, 0.125)
    assert torch.equal(a, twins(q[:, -130:], k, v, lengths, 0.125))
    monkeypatch.setattr(_attention, "QUERY_BLOCK", 7)
    assert torch.equal(a, kernels(q[:, -130:], k, v, lengths, 0.125))


# --- negative controls: the checks above can fail ----------------------------------------------


@pytest.mark.parametrize("dtype", [F32, F64])
def test_sdpa_over_the_same_chunkings_is_not_bit_identical_here(dtype):
    """torch's scaled_dot_product_attention (the chunked backend's) reduces in an order that follows
    the shapes: what the chunking test above would catch. If this ever passes, find another control."""
    q, k, v = _qkv(1, 1, 96, 8, 2, 16, dtype)
    outs = {name: _fed(attention_native, q, k, v, sizes, 0.25) for name, sizes in CHUNKINGS.items()}
    assert not torch.equal(outs["whole"], outs["tokens"])
    assert _rel(outs["whole"], outs["tokens"]) <= BOUND[dtype]  # close, not equal


@pytest.mark.parametrize("where", WHERE)
def test_a_query_that_sees_one_future_key_fails_the_reference_bound(where):
    """The reference test's bound catches a mask one key off: the same queries called as if each
    sat one position later, so each also sees the key after it."""
    q, k, v = _qkv(4, 1, 96, 8, 2, 16, F32)
    attention = _prims(where).attention
    ref = attention_reference(q[:, :95].double(), k.double(), v.double(), [95], 0.25)
    assert _rel(attention(q[:, :95], k, v, [95], 0.25), ref) <= BOUND[F32]
    assert _rel(attention(q[:, :95], k, v, [96], 0.25), ref) > 100 * BOUND[F32]


# --- against transformers ----------------------------------------------------------------------


@pytest.mark.parametrize("where", WHERE)
def test_attention_matches_transformers_eager_attention(where):
    """transformers' eager attention (Llama's, which Bamba and Granite share) with its causal
    additive mask, GQA 8/2 heads of 16, a chunk of 12 queries after 84 positions: within 1e-5."""
    from transformers.models.llama.modeling_llama import eager_attention_forward

    q, k, v = _qkv(5, 2, 96, 8, 2, 16, F32)
    seqlen, t = 12, 96
    pos = torch.arange(t - seqlen, t)
    mask = torch.where(torch.arange(t)[None, :] <= pos[:, None], 0.0, float("-inf"))[None, None]
    module = types.SimpleNamespace(num_key_value_groups=4, training=False)
    theirs, _ = eager_attention_forward(module, q[:, -seqlen:].transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                        mask.expand(2, 1, seqlen, t), scaling=0.25)
    ours = _prims(where).attention(q[:, -seqlen:], k, v, [t, t], 0.25)
    assert _rel(ours, theirs) <= 1e-5


# --- RoPE --------------------------------------------------------------------------------------


def _rope_inputs(dtype: torch.dtype, d: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(2, 96, 4, d, generator=torch.Generator().manual_seed(d), dtype=F64).to(dtype)
    positions = torch.stack([torch.arange(96), torch.arange(1000, 1096)])
    return x, positions


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("dtype", [F32, F64])
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rope_gives_the_same_bits_under_every_chunking_and_batch(where, dtype, rotary_dim):
    x, positions = _rope_inputs(dtype)
    rope = _prims(where).rope
    whole = rope(x, positions, 10000.0, rotary_dim)
    for sizes in CHUNKINGS.values():
        n, parts = 0, []
        for c in sizes:
            parts.append(rope(x[:, n : n + c], positions[:, n : n + c], 10000.0, rotary_dim))
            n += c
        assert torch.equal(torch.cat(parts, 1), whole)
    assert torch.equal(rope(x[1:], positions[1:], 10000.0, rotary_dim), whole[1:])
    assert torch.equal(whole[..., rotary_dim:], x[..., rotary_dim:])  # the rest passes unchanged


@NEEDS_KERNELS
@pytest.mark.parametrize("dtype", [F32, F64])
def test_rope_kernels_give_the_twins_bits(dtype):
    x, positions = _rope_inputs(dtype)
    positions = positions * 97  # angles up to some 1e5 radians
    for theta, rotary_dim in [(10000.0, 64), (500000.0, 64), (10000.0, 16)]:
        assert torch.equal(_prims("kernels").rope(x, positions, theta, rotary_dim),
                           _prims("twins").rope(x, positions, theta, rotary_dim))


@pytest.mark.parametrize("dtype", [F32, F64])
def test_rope_is_close_to_float64_and_its_frequencies_to_transformers_formula(dtype):
    """Within a few units in the last place of the float64 reference, at positions up to 106k;
    inv_freq within 2e-15 of theta ** -(2i / d) in float64 (exp of a rounded float64 exponent of up
    to 13: a few float64 ulps, measured 1.4e-15 from the value to 50 digits; transformers' float32
    inv_freq is 6e-8 from it)."""
    x, positions = _rope_inputs(dtype)
    positions = positions * 97
    for theta, rotary_dim in [(10000.0, 64), (500000.0, 64), (10000.0, 16)]:
        ours = _prims("twins").rope(x, positions, theta, rotary_dim)
        ref = rope_reference(x.double(), positions, theta, rotary_dim)
        # float64: an angle a carries inv_freq's error (below 1.5e-15 of it) into the last digits
        assert _rel(ours, ref) <= (2.5e-7 if dtype == F32 else 5e-11), (theta, rotary_dim)
        inv = _attention.rope_inv_freq(theta, rotary_dim)
        formula = 1.0 / theta ** (torch.arange(0, rotary_dim, 2, dtype=F64) / rotary_dim)
        assert float(((inv - formula).abs() / formula).max()) <= 2e-15


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_rope_matches_transformers_apply_rotary_pos_emb(where, partial):
    """Bamba's rotary embedding and `apply_rotary_pos_emb` (the Llama/Granite convention), head
    dimension 64, partial_rotary_factor 1 and 0.5: within 1e-5 of |x| at positions below 96.
    transformers takes the angle in float32, an error of up to half an ulp of the angle that grows
    with the position (measured 4.2e-6 of |x| below 96, 3.5e-5 at 1000-1095, 1.2e-3 at 32k against
    the float64 reference); ours is the float64 angle rounded once (1.2e-7 of |x| at all three), so
    beyond 96 we are as far from transformers as transformers is from float64, no farther."""
    from transformers import BambaConfig
    from transformers.models.bamba.modeling_bamba import BambaRotaryEmbedding, apply_rotary_pos_emb

    config = BambaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=4,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "partial_rotary_factor": partial})
    x, positions = _rope_inputs(F32)
    cos, sin = BambaRotaryEmbedding(config)(x, positions)
    theirs, _ = apply_rotary_pos_emb(x, x, cos, sin, unsqueeze_dim=2)
    ours = _prims(where).rope(x, positions, 10000.0, int(64 * partial))
    ref = rope_reference(x.double(), positions, 10000.0, int(64 * partial))
    assert _rel(ours[:1], theirs[:1]) <= 1e-5  # positions 0..95
    assert _rel(ours, ref) <= 2.5e-7 and _rel(ours, theirs) <= _rel(theirs, ref) + 2.5e-7


# --- the arithmetic's bits, pinned ---------------------------------------------------------------


def _integer_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Inputs from integers (no random generator): the same on every machine and torch version."""
    def t(shape, mult):
        i = torch.arange(torch.Size(shape).numel(), dtype=torch.int64).reshape(shape)
        return ((i * mult + 11) % 193 - 96).to(dtype) / 64

    return t((2, 9, 8, 16), 37), t((2, 40, 2, 16), 53), t((2, 40, 2, 16), 71)


#: sha256 of the outputs (exact-1 in float32 and float64, exact-2 in float32) of `_integer_inputs`,
#: attention then RoPE: a change of any bit is a new arithmetic version (`scan._backends.EXACT_BACKENDS`)
PINNED = {
    (False, F32): "083723f4ea49304f86aac12df8757d7ef62d9a84e04952eef1fd74873a672f00",
    (False, F64): "4f9fe7c3b9adaf0cbc52148770328e3bd8b778107ecb592f71c530e4350cfd58",
    (True, F32): "e7279fb788c553118f9e49e34787357c40269df5219c7b5ed5d6071c83da9b0a",
}


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize(("fused", "dtype"), ARITHMETICS)
def test_this_version_of_the_exact_arithmetic_gives_its_pinned_attention_bits(where, fused, dtype):
    q, k, v = _integer_inputs(dtype)
    prims = _prims(where, fused)
    out = prims.attention(q, k, v, [40, 23], 0.25)
    rotated = prims.rope(q, torch.arange(18).reshape(2, 9) * 1000, 10000.0, 16)
    digest = hashlib.sha256(out.numpy().tobytes() + rotated.numpy().tobytes()).hexdigest()
    assert digest == PINNED[fused, dtype]
