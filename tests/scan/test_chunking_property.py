"""Property: every partition of a token sequence gives the full scan's logits and state.

Partitions are drawn by hypothesis from pieces that have broken peers: empty chunks, one-token
chunks, chunks shorter than d_conv - 1, prime sizes, long runs, and a final short chunk. The
scan starts from a warmed-up state so that the conv carry and the SSM state are non-trivial.
Reference and exact backends: bit-exact (torch.equal), float32 and float64 (exact-fma: float32),
200 examples per (architecture, dtype, backend); the exact backend also with bfloat16 and float16
states. Chunked backend: within its declared bound of the float64 truth.
"""

from __future__ import annotations

from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mamba_stream.scan import load_model, tolerance
from tests.scan._helpers import ARCH_PRESETS, model_for, scan_chunks, tokens

N = 37  # prime, longer than a chunked-backend block (16), short enough for 1600 examples
PRIMES = [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31]


@st.composite
def partitions(draw: st.DrawFn, n: int = N) -> list[int]:
    piece = st.one_of(
        st.just(1),
        st.integers(1, 2),  # shorter than d_conv - 1 for d_conv = 4
        st.sampled_from(PRIMES),
        st.integers(1, n),
    )
    out, total = [], 0
    for c in draw(st.lists(piece, min_size=1, max_size=n)):
        c = min(c, n - total)
        if c:
            out.append(c)
            total += c
    if total < n:
        out.append(n - total)
    if draw(st.booleans()) and out[-1] > 1:  # a final short chunk
        out[-1] -= 1
        out.append(1)
    for _ in range(draw(st.integers(0, 3))):  # empty chunks anywhere, the ends included
        out.insert(draw(st.integers(0, len(out))), 0)
    return out


@cache
def _truth(preset: str, backend: str, dtype: str):
    model = model_for(preset, backend, dtype)
    start = model.advance(model.initial_state(), tokens(11, 100)).state  # warmed up
    toks = tokens(N, 101)
    return start, toks, model.advance(start, toks)


@pytest.mark.parametrize(("backend", "dtype"), [(b, d) for b in ("reference", "exact") for d in ("float32", "float64")]
                         + [("exact-fma", "float32")])  # exact-2 computes in float32 only
@pytest.mark.parametrize("preset", ARCH_PRESETS)
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(chunks=partitions())
def test_exact_backends_partitions_are_bit_exact(preset, dtype, backend, chunks):
    model = model_for(preset, backend, dtype)
    start, toks, full = _truth(preset, backend, dtype)
    logits, state = scan_chunks(model, start, toks, chunks)
    assert torch.equal(logits, full.logits), f"logits differ for {chunks}"
    assert state.equal(full.state), f"state differs for {chunks}"
    assert state.position == start.position + N


@cache
def _narrow(preset: str, state_dtype: str):
    model = load_model(preset, backend="exact", state_dtype=getattr(torch, state_dtype))
    start = model.advance(model.initial_state(), tokens(11, 100)).state
    toks = tokens(N, 101)
    return model, start, toks, model.advance(start, toks)


@pytest.mark.parametrize("state_dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("preset", ARCH_PRESETS)
@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(chunks=partitions())
def test_the_exact_backend_with_a_narrow_state_is_bit_exact_under_partitions(preset, state_dtype, chunks):
    model, start, toks, full = _narrow(preset, state_dtype)
    logits, state = scan_chunks(model, start, toks, chunks)
    assert torch.equal(logits, full.logits), f"logits differ for {chunks}"
    assert state.equal(full.state), f"state differs for {chunks}"
    assert all(str(t.dtype) == f"torch.{state_dtype}" for t in state.tensors.values())


@cache
def _truth64(preset: str):
    """The float64 reference over warm-up + tokens: the truth the chunked backend is bounded against."""
    truth = model_for(preset, "reference", "float64")
    warm = truth.advance(truth.initial_state(), tokens(11, 100))
    return truth.advance(warm.state, tokens(N, 101))


@pytest.mark.parametrize("preset", ARCH_PRESETS)
@settings(max_examples=40, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(chunks=partitions())
def test_chunked_backend_partitions_within_declared_tolerance(preset, chunks):
    model = model_for(preset, "chunked", "float32")
    start = model.advance(model.initial_state(), tokens(11, 100)).state
    logits, state = scan_chunks(model, start, tokens(N, 101), chunks)
    truth = _truth64(preset)
    tol = tolerance(model.config.architecture, "chunked", "float32")
    assert tol.logits_excess(logits, truth.logits) <= 1.0
    for name, t in state.tensors.items():
        assert tol.state_excess(t, truth.state.tensors[name]) <= 1.0, name
