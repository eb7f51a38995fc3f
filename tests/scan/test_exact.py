"""The exact backend: its kernels give their twins' bits, and nothing the caller cannot see changes
a bit (the chunking, the batch, prefill against decode, the threads, the instruction set the
kernels were built for, whether the kernels were built at all)."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mamba_stream.scan import _exact as E
from mamba_stream.scan import load_model
from mamba_stream.scan._forward import embed, forward
from mamba_stream.scan._quant import quantize_q8
from tests.scan._helpers import ARCH_PRESETS, model_for, scan_chunks, tokens

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.float64]

pytestmark = pytest.mark.skipif(E._kernel_ops() is None, reason=f"no exact kernels here: {E.build_kernels()[1]}")


def _r(g: torch.Generator, *shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def _both(name: str, *args):
    return getattr(E._kernel_ops(), name)(*args), getattr(E.TWIN_OPS, name)(*args)


def _equal(a, b) -> bool:
    if isinstance(a, tuple):
        return all(_equal(x, y) for x, y in zip(a, b, strict=False))
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


# --- kernels against twins ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_elementwise_kernel_gives_its_twins_bits(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.cat([_r(g, 5000, dtype=dtype, scale=6.0), _r(g, 1000, dtype=dtype, scale=200.0),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, 20.000001, 709.5, -708.5, -800.0, 800.0,
                                 float("inf"), float("-inf"), float("nan")], dtype=dtype)])
    for op in E._UNARY:
        v = x.abs() + 1e-6 if op == "rsqrt" else x
        k, t = E._kernel_ops().unary(v, op), E.unary_twin(v, op)
        assert torch.equal(k.nan_to_num(7.0), t.nan_to_num(7.0)) and bool((k.isnan() == t.isnan()).all()), op
    # and they are the functions they name, to a few units in the last place
    finite = x[torch.isfinite(x) & (x.abs() < 80)].double()
    ulp = 6e-8 if dtype == torch.float32 else 2e-15
    reference = {"exp": torch.exp, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "sin": torch.sin, "cos": torch.cos,
                 "silu": torch.nn.functional.silu, "softplus": torch.nn.functional.softplus}
    for op, fn in reference.items():
        got = E._kernel_ops().unary(finite.to(dtype), op).double()
        want = fn(finite.to(dtype).double())
        assert float(((got - want).abs() / want.abs().clamp_min(1e-30)).max()) <= 8 * ulp, op
    v = finite.abs() + 1e-3
    assert float((E._kernel_ops().unary(v.to(dtype), "rsqrt").double() * v.sqrt() - 1).abs().max()) <= 4 * ulp


@pytest.mark.parametrize("contiguous", [True, False], ids=["in-place", "strided-state"])
@pytest.mark.parametrize("length", [1, 2, 6])
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_in_place_scans_and_conv_give_the_out_of_place_bits_in_the_state_they_were_given(dtype, length,
                                                                                         contiguous):
    """`*_into` (the slot table's decode step) against the out-of-place kernel and both twins: the
    same outputs and new state, written over the state passed in, which is what they return."""
    g, L = torch.Generator().manual_seed(5), length

    def state(*shape: int) -> torch.Tensor:
        t = _r(g, *shape, dtype=dtype)
        # a strided state (rows of a wider buffer) cannot be written by the kernel in place
        return t if contiguous else torch.cat([t, t], dim=-1)[..., : shape[-1]]

    dt = torch.rand(3, L, 70, generator=g, dtype=torch.float64).to(dtype) * 0.1
    sel = (dt, -torch.rand(16, 70, generator=g, dtype=torch.float64).to(dtype), _r(g, 3, L, 70, dtype=dtype),
           _r(g, 3, L, 16, dtype=dtype), _r(g, 3, L, 16, dtype=dtype))
    ssd = (_r(g, 3, L, 4, 11, dtype=dtype), torch.rand(3, L, 4, generator=g, dtype=torch.float64).to(dtype) * 0.1,
           -torch.rand(4, generator=g, dtype=torch.float64).to(dtype), _r(g, 3, L, 2, 16, dtype=dtype),
           _r(g, 3, L, 2, 16, dtype=dtype))
    conv = (_r(g, 3, L, 7, dtype=dtype), _r(g, 7, 1, 4, dtype=dtype), _r(g, 7, dtype=dtype))
    cases = [("selective_scan", lambda h: (*sel, h), state(3, 70, 16), -1),
             ("ssd", lambda h: (*ssd, h), state(3, 4, 11, 16), -1),
             ("conv", lambda h: (h, *conv), state(3, 7, 4), 0)]
    for name, args, h0, _where in cases:
        want = getattr(E._kernel_ops(), name)(*args(h0))
        for ops in (E._kernel_ops(), E.TWIN_OPS):
            h = h0.clone() if contiguous else state(*h0.shape).copy_(h0)
            got = getattr(ops, name + "_into")(*args(h))
            assert got[1] is h and _equal(got, want), (name, ops)


@pytest.mark.parametrize("dtype", DTYPES)
def test_products_norms_and_conv_give_their_twins_bits(dtype):
    g = torch.Generator().manual_seed(2)
    for m, k, n in [(1, 7, 5), (2, 64, 130), (3, 37, 64), (5, 40, 129), (9, 256, 200), (33, 16, 1000)]:
        x, w, b = _r(g, m, k, dtype=dtype), _r(g, n, k, dtype=dtype), _r(g, n, dtype=dtype)
        assert _equal(*_both("linear", x, w, b)) and _equal(*_both("linear", x, w, None)), (m, k, n)
        big = E._kernel_ops().linear(x, w, b)
        for i in range(m):  # one row alone is the same row in a batch
            assert torch.equal(E._kernel_ops().linear(x[i : i + 1], w, b)[0], big[i])
    x, z, w = _r(g, 3, 5, 48, dtype=dtype), _r(g, 3, 5, 48, dtype=dtype), _r(g, 48, dtype=dtype)
    assert _equal(*_both("mean", x))
    for rms, bias in ((True, None), (False, _r(g, 48, dtype=dtype))):
        assert _equal(*_both("norm", x, w, bias, 1e-5, rms))
    for before in (False, True):
        assert _equal(*_both("gated_norm", x, z, w, 1e-5, 16, before))
    state, xs, cw, cb = _r(g, 2, 7, 4, dtype=dtype), _r(g, 2, 5, 7, dtype=dtype), _r(g, 7, 1, 4, dtype=dtype), \
        _r(g, 7, dtype=dtype)
    assert _equal(*_both("conv", state, xs, cw, cb)) and _equal(*_both("conv", state, xs, cw, None))


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_functions_split_across_threads_give_the_twins_bits(monkeypatch, dtype):
    """A prefill's elementwise functions run on the C pool in runs of whole 4096-value units: on 1
    and 2 threads, with a last unit cut short, every function gives the twin's bits."""
    ops = E._kernel_ops()
    g = torch.Generator().manual_seed(12)
    x = _r(g, 3 * 4096 * 5 + 77, dtype=dtype, scale=4.0)
    assert x.numel() * 20 >= E._THREADED_WORK
    seen: list[int] = []
    for dt in (torch.float32, torch.float64):
        real = ops.unarys[dt]
        monkeypatch.setitem(ops.unarys, dt, lambda *a, _real=real: (seen.append(a[-1]), _real(*a))[1])
    for op in E._UNARY:
        v = x.abs() + 1e-3 if op == "rsqrt" else x
        want = E.unary_twin(v, op)
        for threads in (1, 2):
            monkeypatch.setattr(E, "_THREADS", threads)
            seen.clear()
            assert torch.equal(ops.unary(v, op), want), (op, threads)
            assert seen == [threads]


@pytest.mark.parametrize("width", [3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefill_conv_split_across_threads_gives_the_twins_bits(monkeypatch, dtype, width):
    """The prefill conv (taps transposed, channels inner, tokens split between the C pool's
    threads) against the twin, on 1 and 2 threads, out of place and into its own state; chunks
    shorter than the conv's width (its state feeds every output) and longer; big enough to split."""
    ops = E._kernel_ops()
    g = torch.Generator().manual_seed(11)
    seen: list[int] = []
    for name in ("conv_threads_f32", "conv_threads_f64"):
        real = getattr(ops.lib, name)
        monkeypatch.setitem(ops.convs, torch.float32 if name.endswith("32") else torch.float64,
                            lambda *a, _real=real: (seen.append(a[-1]), _real(*a))[1])
    for b, length, c in [(2, width - 1, 40000), (1, 1, 90000), (2, 300, 257), (3, 130, 1000)]:
        assert b * length * c * width >= E._THREADED_WORK
        state, xs = _r(g, b, c, width, dtype=dtype), _r(g, b, length, c, dtype=dtype)
        cw, cb = _r(g, c, 1, width, dtype=dtype), _r(g, c, dtype=dtype)
        for bias in (cb, None):
            want = E.TWIN_OPS.conv(state, xs, cw, bias)
            for threads in (1, 2):
                monkeypatch.setattr(E, "_THREADS", threads)
                seen.clear()
                assert _equal(ops.conv(state, xs, cw, bias), want), (b, length, c, threads)
                h = state.clone()
                got = ops.conv_into(h, xs, cw, bias)
                assert got[1] is h and _equal(got, want), (b, length, c, threads, "into")
                assert seen == [threads, threads]


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_products_read_narrow_weights_as_stored_with_the_bits_of_their_widened_copies(dtype, stored):
    """A bfloat16 or float16 weight read as it is stored gives the bits of the same product over
    its values widened to the computation's dtype, on the kernels and the twins: every shape class
    (tile remainders in k and n, one row and many), float16's subnormals and extremes included."""
    g = torch.Generator().manual_seed(7)
    ops = E._kernel_ops()
    for m, k, n in [(1, 7, 5), (1, 64, 200), (2, 64, 130), (3, 37, 97), (5, 40, 129), (1, 1000, 33), (9, 256, 200),
                    (33, 16, 1000)]:
        x, b = _r(g, m, k, dtype=dtype), _r(g, n, dtype=dtype)
        w = _r(g, n, k, dtype=torch.float32, scale=0.2).to(stored)
        if stored == torch.float16:
            special = [6e-8, -6e-8, 1e-5, -3e-6, 65504.0, -65504.0, 6.1e-5, 0.0, -0.0]
            w.view(-1)[: len(special)] = torch.tensor(special, dtype=torch.float16)
        wide = w.to(dtype)
        for bias in (b, None):
            got, twin, want = ops.linear(x, w, bias), E.TWIN_OPS.linear(x, w, bias), ops.linear(x, wide, bias)
            assert _equal(got, want) and _equal(twin, want), (m, k, n, stored)
            assert torch.equal(want, E.TWIN_OPS.linear(x, wide, bias))
        assert torch.equal(ops.linear(x[:1], w, b)[0], ops.linear(x, w, b)[0])
    with pytest.raises(TypeError, match="no exact product"):
        ops.linear(_r(g, 2, 16, dtype=torch.float32), _r(g, 4, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="no exact product"):
        E.TWIN_OPS.linear(_r(g, 2, 16, dtype=torch.float32), _r(g, 4, 16, dtype=torch.float64))


def test_block_int8_products_give_their_twins_bits_and_stay_near_the_float_product():
    """q8: integer block sums, the blocks added in order. Kernel and twin agree bit for bit on every
    shape class (k not a multiple of 32, outputs past a tile of 8, one row and many), a row alone
    is the same row in a batch, a non-finite activation gives NaN (never a cast integer), and the
    error against the float product is what 8-bit blocks allow."""
    g = torch.Generator().manual_seed(8)
    ops = E._kernel_ops()
    for m, k, n in [(1, 7, 5), (1, 64, 200), (2, 64, 130), (3, 37, 97), (5, 40, 129), (1, 1000, 33),
                    (9, 256, 200), (33, 16, 1000), (2, 2048, 96)]:
        x, b = _r(g, m, k, dtype=torch.float32), _r(g, n, dtype=torch.float32)
        w = _r(g, n, k, dtype=torch.float32, scale=0.2)
        qw = quantize_q8(w)
        for bias in (b, None):
            got = ops.linear(x, qw, bias)
            assert _equal(got, E.TWIN_OPS.linear(x, qw, bias)), (m, k, n)
            assert torch.equal(ops.linear(x[:1], qw, bias)[0], got[0])
        exact = x.double() @ w.double().T + b.double()
        err = (ops.linear(x, qw, b).double() - exact).norm() / exact.norm()
        assert 1e-4 < err < 2e-2, (m, k, n, err)  # quantized (not the float product), and close to it
    x = _r(g, 3, 70, dtype=torch.float32)
    x[0, 5], x[1, 66] = float("nan"), float("inf")
    qw = quantize_q8(_r(g, 11, 70, dtype=torch.float32))
    got, twin = ops.linear(x, qw, None), E.TWIN_OPS.linear(x, qw, None)
    assert got[:2].isnan().all() and twin[:2].isnan().all() and torch.equal(got[2], twin[2])
    with pytest.raises(TypeError, match="float32"):
        ops.linear(x.double(), qw)


_SPLIT_SHAPES = [(1, 40, 5), (1, 96, 17), (2, 64, 33), (1, 300, 1000), (3, 70, 129), (1, 2048, 96)]


def _weights_in_every_format(g: torch.Generator, n: int, k: int) -> list:
    w = _r(g, n, k, dtype=torch.float32, scale=0.2)
    return [w, w.to(torch.bfloat16), w.to(torch.float16), quantize_q8(w)]


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_products_split_across_the_c_helper_threads_give_the_twins_bits(monkeypatch, threads):
    """Every product, whatever its size, handed to the C pool (`pool_run`) on 2, 3 and 5 threads:
    outputs split in runs of 16 (fewer runs than threads, a last run short of 16) give the twins'
    bits in every weight format. Thread counts go up and down between calls, so helpers that
    have no part of a job answer it too."""
    g = torch.Generator().manual_seed(9)
    ops = E._kernel_ops()
    monkeypatch.setattr(E, "_THREADED_WORK", 0)
    for m, k, n in _SPLIT_SHAPES:
        x, b = _r(g, m, k, dtype=torch.float32), _r(g, n, dtype=torch.float32)
        for w in _weights_in_every_format(g, n, k):
            want = E.TWIN_OPS.linear(x, w, b)
            for t in (threads, 1, threads):
                monkeypatch.setattr(E, "_THREADS", t)
                assert _equal(ops.linear(x, w, b), want), (m, k, n, t, type(w).__name__)


def _threaded_shapes() -> list[tuple[int, int, int]]:
    """(rows, k, outputs) of products at least `_THREADED_WORK` multiply-adds, the size from which
    a product splits across threads: decode (one row) and prefill (seven: a tile of rows and a
    remainder), k off and on a block of 16/32, and outputs 9 past a run of 16, so that the two
    threads' spans are unequal and the last run of the last span is short."""
    shapes = []
    for m, k in [(1, 300), (1, 1024), (7, 200)]:
        n = -(-E._THREADED_WORK // (m * k))
        shapes.append((m, k, n + (9 - n) % 16))
    return shapes


def _record_threads(monkeypatch: pytest.MonkeyPatch, lib) -> list[int]:
    """The thread count each product hands the C pool (`linear_threads`, `linear_q8_threads`)."""
    seen: list[int] = []
    for name in ("linear_threads", "linear_q8_threads"):
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, _real=real: (seen.append(a[-1]), _real(*a))[1])
    return seen


_LINEAR_FN = ctypes.CFUNCTYPE(None, *E._LINEAR)


@contextlib.contextmanager
def _record_spans(ops, dtype: torch.dtype, wdtype: torch.dtype
                  ) -> Iterator[list[tuple[int, int]]]:
    """The outputs [n0, n1) each part of a float product's job is called on (the pool's split,
    seen from inside C), while the context lasts: the product's kernel is called through a
    recorder, and the kernel itself again after."""
    fmt = {v: k for k, v in E._WEIGHT_FORMATS.items()}[None if wdtype == dtype else wdtype]
    kernel, spans = getattr(ops.lib, f"linear_{fmt}{E._SUFFIX[dtype]}"), []

    def part(x, m, k, w, n, bias, out, n0, n1):
        spans.append((n0, n1))
        kernel(x, m, k, w, n, bias, out, n0, n1)

    recorder, real = _LINEAR_FN(part), ops.linears[dtype, wdtype]
    ops.linears[dtype, wdtype] = ctypes.cast(recorder, ctypes.c_void_p).value
    try:
        yield spans
    finally:  # before the recorder is freed
        ops.linears[dtype, wdtype] = real


def _differ(got: torch.Tensor, want: torch.Tensor) -> str:
    """Which outputs (the last dimension) differ: the count, the first and the last."""
    if got.shape != want.shape or got.dtype != want.dtype:
        return f"{got.dtype} {tuple(got.shape)} against {want.dtype} {tuple(want.shape)}"
    cols = (got != want).reshape(-1, got.shape[-1]).any(0).nonzero().flatten().tolist()
    return f"{len(cols)} of {got.shape[-1]} outputs differ" + (f", {cols[0]}..{cols[-1]}" if cols else "")


#: weight formats: (the computation's dtype, how the weight is stored)
_FORMATS = {"float32": (torch.float32, torch.float32), "float64": (torch.float64, torch.float64),
            "bfloat16": (torch.float32, torch.bfloat16), "float16": (torch.float32, torch.float16),
            "q8": (torch.float32, "q8")}


@pytest.mark.parametrize("fmt", list(_FORMATS))
def test_products_past_the_threaded_work_give_the_twins_bits_on_one_thread_and_on_two(monkeypatch, fmt):
    """Products big enough to split across threads at the real threshold (`_THREADED_WORK`, not
    lowered), biased and not, one row and seven, on 1 thread and on 2: every output has the twin's
    bits and the same bits either way. The split is seen: the pool gets 2 threads (1 when set to
    1), and a float product's kernel is called on [0, s) and [s, N), s a whole number of runs of 16
    and the last span's last run short. A bias added outside a part's own span is added twice (or
    over outputs another thread has not yet written) on two threads, and only there."""
    dtype, stored = _FORMATS[fmt]
    g = torch.Generator().manual_seed(12)
    ops = E._kernel_ops()
    threads = _record_threads(monkeypatch, ops.lib)
    for m, k, n in _threaded_shapes():
        assert m * k * n >= E._THREADED_WORK and n % 16 == 9, (m, k, n)
        x, b = _r(g, m, k, dtype=dtype), _r(g, n, dtype=dtype)
        w = _r(g, n, k, dtype=dtype, scale=0.2)
        w = quantize_q8(w) if stored == "q8" else w.to(stored)
        for bias in (b, None):
            want = E.TWIN_OPS.linear(x, w, bias)
            got = {}
            for t in (1, 2):
                monkeypatch.setattr(E, "_THREADS", t)
                threads.clear()
                got[t] = ops.linear(x, w, bias)
                case = f"{fmt} ({m}, {k}) x ({n}, {k}), {t} thread(s), {'no ' * (bias is None)}bias"
                assert threads == [t], (case, threads)
                assert _equal(got[t], want), f"{case}: {_differ(got[t], want)}"
                if m > 1:  # a row of the threaded prefill is the same row decoded alone
                    assert torch.equal(ops.linear(x[-1:], w, bias)[0], got[t][-1])
            assert torch.equal(got[1], got[2])
            if stored == "q8":
                continue
            units = (n + 15) // 16
            s = units // 2 * 16
            for t, parts in ((1, [(0, n)]), (2, [(0, s), (s, n)])):
                monkeypatch.setattr(E, "_THREADS", t)
                with _record_spans(ops, dtype, w.dtype) as spans:
                    recorded = ops.linear(x, w, bias)
                assert _equal(recorded, want), (fmt, m, k, n, t, "recorded", _differ(recorded, want))
                assert sorted(spans) == parts and (n - s) % 16 != 0, (m, k, n, t, spans)


@pytest.mark.parametrize("fmt", ["float32", "q8"])
def test_a_product_splits_from_exactly_the_threaded_work(monkeypatch, fmt):
    """At `_THREADED_WORK` multiply-adds a product goes to 2 threads, one output fewer stays on
    one; both with the twins' bits, biased."""
    g = torch.Generator().manual_seed(13)
    ops = E._kernel_ops()
    threads = _record_threads(monkeypatch, ops.lib)
    monkeypatch.setattr(E, "_THREADS", 2)
    k = 256
    n = -(-E._THREADED_WORK // k)
    assert n * k >= E._THREADED_WORK > (n - 1) * k
    for outputs, want_threads in ((n, 2), (n - 1, 1)):
        x, b = _r(g, 1, k, dtype=torch.float32), _r(g, outputs, dtype=torch.float32)
        w = _r(g, outputs, k, dtype=torch.float32, scale=0.2)
        w = quantize_q8(w) if fmt == "q8" else w
        threads.clear()
        got = ops.linear(x, w, b)
        want = E.TWIN_OPS.linear(x, w, b)
        assert threads == [want_threads] and _equal(got, want), (outputs, threads, _differ(got, want))


# --- exact-2: the products' sums in fused multiply-adds ------------------------------------------

#: (rows, k, outputs): tile remainders in k (16, 32) and n (8, 16, BLOCK_N), one row and many
_FUSED_SHAPES = [(1, 7, 5), (1, 64, 200), (2, 64, 130), (3, 37, 97), (5, 40, 129), (1, 1000, 33), (9, 256, 200),
                 (33, 16, 1000), (2, 2048, 96)]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_products_give_their_twins_bits_in_every_format_and_split(monkeypatch, threads):
    """The exact-2 products (`linear_fma_*_f32`, `linear_q8_fma_f32`) against their twin (each lane
    step `scan._fma.fma_twin`): every shape class, every weight format, biased and not, split
    across 1-3 threads from any size; a row alone is the same row in a batch; and the bits are
    not exact-1's (past a few lane steps, most outputs differ: a fused step rounds once)."""
    g = torch.Generator().manual_seed(13)
    fused, plain = E._kernel_ops(True), E._kernel_ops()
    monkeypatch.setattr(E, "_THREADED_WORK", 0)
    monkeypatch.setattr(E, "_THREADS", threads)
    differ = total = 0
    for m, k, n in _FUSED_SHAPES + _threaded_shapes():
        x, b = _r(g, m, k, dtype=torch.float32), _r(g, n, dtype=torch.float32)
        for w in _weights_in_every_format(g, n, k):
            for bias in (b, None):
                got = fused.linear(x, w, bias)
                assert _equal(got, E.TWIN_OPS_FMA.linear(x, w, bias)), (m, k, n, threads, getattr(w, "dtype", "q8"))
                assert torch.equal(fused.linear(x[-1:], w, bias)[0], got[-1])
            if k >= 64:  # a few lane steps round alike: fma(x, w, 0) is the rounded product
                other = plain.linear(x, w, b)
                differ, total = differ + int((fused.linear(x, w, b) != other).sum()), total + other.numel()
    assert differ > total // 3, (differ, total)


def test_the_fma_backend_computes_in_float32_only():
    from mamba_stream.scan import UnsupportedBackend

    with pytest.raises(UnsupportedBackend, match="float32"):
        load_model("tiny-mamba1", backend="exact-fma", dtype=torch.float64)
    with pytest.raises(TypeError, match="float32"):
        E.linear_fma_twin(torch.ones(2, 16, dtype=torch.float64), torch.ones(3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="no exact product"):
        E._kernel_ops(True).linear(torch.ones(2, 16, dtype=torch.float64), torch.ones(3, 16, dtype=torch.float64))


def test_the_fma_backend_is_probed_and_named_on_its_own():
    """One model, both arithmetics: each probed on its own kernels, each result naming its own
    arithmetic in the receipt's id, and other bits (the same tokens, another checksum)."""
    one, two = load_model("tiny-mamba2", backend="exact"), load_model("tiny-mamba2", backend="exact-fma")
    assert two.exact_probe.kernels and two.exact_probe.path == "exact"
    assert (one.arithmetic().id, two.arithmetic().id) == ("exact-1/float32", "exact-2/float32")
    assert one.arithmetic().exact and two.arithmetic().exact
    a, b = (m.advance(m.initial_state(), tokens(12, 3)) for m in (one, two))
    assert a.path == b.path == "exact" and not torch.equal(a.logits, b.logits)
    assert (a.logits - b.logits).abs().max() < 1e-3  # the same function, rounded otherwise


def test_products_called_from_many_threads_at_once_each_get_their_own_bits(monkeypatch):
    """Eight Python threads run products at once (the engine's and activities' threads): one at a
    time has the pool, the others run theirs on their own thread; every result has its bits."""
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setattr(E, "_THREADED_WORK", 0)
    monkeypatch.setattr(E, "_THREADS", 2)
    g = torch.Generator().manual_seed(10)
    ops = E._kernel_ops()
    cases = []
    for m, k, n in _SPLIT_SHAPES:
        x = _r(g, m, k, dtype=torch.float32)
        cases += [(x, w, E.TWIN_OPS.linear(x, w, None)) for w in _weights_in_every_format(g, n, k)]

    def run(i: int) -> bool:
        return all(_equal(ops.linear(x, w, None), want) for x, w, want in cases[i % 3 :] * 4)

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(run, range(16)))


def test_a_forked_child_runs_threaded_products_without_the_parents_helpers():
    """The helper threads do not survive a fork: a child forked after the parent used the pool
    starts its own, and its products finish with the parent's bits (a child that waited on the
    parent's helpers would hang; the join's timeout fails the test instead)."""
    script = """
import os, sys, torch
from mamba_stream.scan import _exact as E
from mamba_stream.scan._quant import quantize_q8
torch.set_num_threads(1)  # libgomp's own threads do not survive a fork either
E._THREADED_WORK, E._THREADS = 0, 2
ops = E._kernel_ops()
g = torch.Generator().manual_seed(11)
x, w = torch.randn(2, 512, generator=g), torch.randn(300, 512, generator=g)
qw = quantize_q8(w)
want = [ops.linear(x, w, None), ops.linear(x, qw, None)]  # the parent's pool is running
r, wfd = os.pipe()
pid = os.fork()
if pid == 0:
    ok = torch.equal(ops.linear(x, w, None), want[0]) and torch.equal(ops.linear(x, qw, None), want[1])
    os.write(wfd, b"1" if ok else b"0")
    os._exit(0)
os.close(wfd)
print(os.read(r, 1).decode())
os.waitpid(pid, 0)
"""
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the hung child too, not only its parent
        proc.communicate()
        pytest.fail("a forked child's threaded product did not finish in 120 s")
    assert proc.returncode == 0, err
    assert out.strip() == "1"


def test_quantizing_is_deterministic_and_its_bytes_are_pinned():
    """The same float weights give the same q8 bytes on every CPU (IEEE division and rounding,
    exact maxima): pinned, with the cases at the edges of a block (all zeros, one value, k past
    a block, a weight at the float16 scale's rounding)."""
    g = torch.Generator().manual_seed(9)
    w = _r(g, 40, 75, dtype=torch.float32, scale=0.05)
    w[3] = 0.0
    w[4, :] = 0.0
    w[4, 10] = -1.0
    w[5, 0] = 127.0 * 6.1e-5  # the scale lands on a float16 subnormal's neighbourhood
    qw = quantize_q8(w)
    assert qw.q.shape == (40, 96) and qw.d.shape == (40, 3) and qw.q[:, 75:].eq(0).all()
    assert qw.q[3].eq(0).all() and qw.d[3].eq(0).all() and qw.q[4, 10] == -127 and qw.q.abs().max() <= 127
    digest = hashlib.sha256(qw.q.numpy().tobytes() + qw.d.view(torch.int16).numpy().tobytes()).hexdigest()
    assert digest == Q8_PINNED
    assert torch.equal(quantize_q8(w.to(torch.bfloat16).float()).q, quantize_q8(w.to(torch.bfloat16)).q)
    deq = qw.dequantize()
    assert deq.shape == w.shape \
        and ((deq - w).abs() <= qw.d.float().repeat_interleave(32, 1)[:, :75] * 0.5 + 1e-12).all()


Q8_PINNED = "3d0520c75772c3b7b0e7640c4f7c181729779fa9756be3cd5d43287565938653"


@pytest.mark.parametrize("length", [1, 2, 6])  # the kernels take another loop for decode (<= 2 tokens)
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_scans_give_their_twins_bits(dtype, length):
    g, L = torch.Generator().manual_seed(3), length
    dt = torch.rand(2, L, 70, generator=g, dtype=torch.float64).to(dtype) * 0.1
    args = (dt, -torch.rand(16, 70, generator=g, dtype=torch.float64).to(dtype), _r(g, 2, L, 70, dtype=dtype),
            _r(g, 2, L, 16, dtype=dtype), _r(g, 2, L, 16, dtype=dtype), _r(g, 2, 70, 16, dtype=dtype))
    assert _equal(*_both("selective_scan", *args))
    for p in (8, 11):  # whole rows of 8 and a remainder
        args = (_r(g, 2, L, 4, p, dtype=dtype), torch.rand(2, L, 4, generator=g, dtype=torch.float64).to(dtype) * 0.1,
                -torch.rand(4, generator=g, dtype=torch.float64).to(dtype), _r(g, 2, L, 2, 16, dtype=dtype),
                _r(g, 2, L, 2, 16, dtype=dtype), _r(g, 2, 4, p, 16, dtype=dtype))
        assert _equal(*_both("ssd", *args))
    assert _equal(*_both("angle", _r(g, 2, L, 4, 3, dtype=dtype, scale=3.0), _r(g, 2, 4, 3, dtype=dtype)))
    for r in (1, 2):
        args = (_r(g, 2, L, r, 4, 16, dtype=dtype), _r(g, 2, L, r, 4, 16, dtype=dtype),
                _r(g, 2, L, r, 4, 8, dtype=dtype),
                torch.rand(2, L, 4, generator=g, dtype=torch.float64).to(dtype), _r(g, 2, L, 4, dtype=dtype),
                _r(g, 2, L, 4, dtype=dtype), _r(g, 4, dtype=dtype), _r(g, 2, 4, 8, 16, dtype=dtype),
                _r(g, 2, r, 4, 16, dtype=dtype), _r(g, 2, r, 4, 8, dtype=dtype))
        assert _equal(*_both("trapezoid", *args))


#: the exact arithmetics and the computations each is tested in: exact-2 computes in float32 only
ARITHMETICS = [("exact", d) for d in ("float32", "float64")] + [("exact-fma", "float32")]


@pytest.mark.parametrize(("backend", "dtype"), ARITHMETICS)
@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_a_whole_model_on_the_kernels_gives_the_twins_bits(preset, backend, dtype):
    model = load_model(preset, backend=backend, dtype=getattr(torch, dtype))
    fused = backend == "exact-fma"
    lm = model.module
    states = model._stack([model.initial_state(), model.advance(model.initial_state(), tokens(5, 1)).state])
    with torch.inference_mode():
        hidden = embed(lm, torch.tensor([tokens(21, 2), tokens(21, 3)]))
        a = forward(lm, hidden, states, E.FixedBackend(E.exact_primitives(E._kernel_ops(fused), "exact")))
        b = forward(lm, hidden, states, E.FixedBackend(E.twin_primitives(fused)))
    assert torch.equal(a[0], b[0]) and E._states_equal(a[1], b[1])
    assert (a[2], b[2]) == ("exact", "exact-twin")


# --- nothing the caller cannot see changes a bit --------------------------------------------------


@st.composite
def _schedules(draw: st.DrawFn) -> list[tuple[int, list[int]]]:
    """Co-scheduled streams: (warm-up length, next chunk length) each."""
    n = draw(st.integers(1, 6))
    return [(draw(st.integers(0, 20)), draw(st.integers(0, 9))) for _ in range(n)]


#: the computation, or the computation and the format its weights are read in
COMPUTE = ["float32", "float64", "float32/bfloat16", "float32/float16", "float32/q8"]
#: ... and the exact arithmetic: exact-1 in each, exact-2 (float32 only) in each float32 one
EXACT_COMPUTE = [("exact", d) for d in COMPUTE] + [("exact-fma", d) for d in COMPUTE if d != "float64"]


@pytest.mark.parametrize(("backend", "dtype"), EXACT_COMPUTE)
@pytest.mark.parametrize("preset", ARCH_PRESETS)
@settings(max_examples=25, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(schedule=_schedules())
def test_any_co_scheduled_batch_gives_each_stream_its_solo_bits(preset, backend, dtype, schedule):
    model = model_for(preset, backend, dtype)
    states = [model.advance(model.initial_state(), tokens(w, 10 + i)).state for i, (w, _) in enumerate(schedule)]
    chunks = [tokens(c, 50 + i) for i, (_, c) in enumerate(schedule)]
    for s, c, got in zip(states, chunks, model.advance_batch(states, chunks), strict=True):
        solo = model.advance(s, c)
        assert torch.equal(got.logits, solo.logits) and got.state.equal(solo.state)
    # the slot table's decode step over the same streams, one token each, any subset of rows
    buffers = {name: torch.stack([s.tensors[name] for s in states]) for name in states[0].tensors}
    rows = list(range(0, len(states), 2))
    logits, path = model.step_rows(buffers, torch.tensor(rows), torch.tensor([7] * len(rows)))
    for i, r in enumerate(rows):
        solo = model.advance(states[r], [7])
        assert torch.equal(logits[i], solo.logits[0]) and path == "exact"
        assert all(torch.equal(buffers[k][r], solo.state.tensors[k]) for k in buffers)


@pytest.mark.parametrize(("backend", "dtype"), EXACT_COMPUTE)
@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_the_in_place_step_gives_the_steps_bits_and_touches_only_its_rows(preset, backend, dtype):
    """`step_rows(in_place=True)`: the layers write the slot buffers as they run, on a span of rows
    (no copy-back) and on scattered ones, with the bits of the out-of-place step."""
    model = model_for(preset, backend, dtype)
    step, plain = E.exact_step_backend(model.module, model.dtype, backend), E.exact_backend(model.module, model.dtype,
                                                                                            backend)[0]
    assert step is not plain and step.name == plain.name == backend
    states = [model.advance(model.initial_state(), tokens(n, 30 + n)).state for n in (3, 7, 1, 12, 5)]
    stacked = {name: torch.stack([s.tensors[name] for s in states]) for name in states[0].tensors}
    for rows in ([1, 2, 3], [4, 0, 2], [0, 1, 2, 3, 4]):
        plain = {k: v.clone() for k, v in stacked.items()}
        fast = {k: v.clone() for k, v in stacked.items()}
        toks = torch.tensor([9, 200, 31, 4, 77][: len(rows)])
        want, path = model.step_rows(plain, torch.tensor(rows), toks)
        got, path_in_place = model.step_rows(fast, torch.tensor(rows), toks, in_place=True)
        assert torch.equal(got, want) and path_in_place == path == "exact"
        assert all(torch.equal(fast[k], plain[k]) for k in plain), rows  # stepped rows and the others
        for r in sorted(set(range(5)) - set(rows)):
            assert all(torch.equal(fast[k][r], stacked[k][r]) for k in fast)


def _states(lm, batch: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randn((batch, *shape), generator=g) * 0.5 for _, shape in blk.mixer.state_shapes())
            for blk in lm.backbone.layers]


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtype", ["float32", "float32/bfloat16", "float32/float16", "float32/q8"])
@pytest.mark.parametrize("preset", ["tiny-mamba1", "tiny-mamba2"])
def test_a_decode_step_in_one_kernel_call_gives_the_primitives_bits(monkeypatch, preset, dtype, threads, backend):
    """`mamba1_step_f32` / `mamba2_step_f32` (a layer's decode step in one call) against the same
    step through the kernels' primitives and through the twins: logits and every layer's states,
    for one stream and for five, out of place and in place, on 1-3 threads, in every weight
    format. The one call must have run, once per layer and step."""
    monkeypatch.setattr(E, "_THREADED_WORK", 0 if threads > 1 else 1 << 62)
    monkeypatch.setattr(E, "_THREADS", threads)
    lib = E._kernel_ops().lib
    name = "mamba1_step_f32" if preset == "tiny-mamba1" else "mamba2_step_f32"
    real, calls = getattr(lib, name), []
    monkeypatch.setattr(lib, name, lambda *a: (calls.append(1), real(*a))[1])
    fused = backend == "exact-fma"
    model = model_for(preset, backend, dtype)
    lm = model.module
    for batch in (1, 5):
        states = _states(lm, batch, 40 + batch)
        hidden = torch.randn((batch, 1, lm.cfg.d_model), generator=torch.Generator().manual_seed(batch))
        with torch.inference_mode():
            calls.clear()
            got, got_states, path = forward(lm, hidden, states, E._KernelBackend(fused=fused))
            assert len(calls) == lm.cfg.n_layer and path == "exact"
            plain, plain_states, _ = forward(lm, hidden, states, E.FixedBackend(E._kernel_primitives(fused=fused)))
            twin, twin_states, _ = forward(lm, hidden, states, E.FixedBackend(E.twin_primitives(fused)))
            work = [tuple(t.clone() for t in st) for st in states]
            in_place, in_place_states, _ = forward(lm, hidden, work, E._KernelBackend(in_place=True, fused=fused))
            other, _, _ = forward(lm, hidden, states, E._KernelBackend(fused=not fused))
        assert torch.equal(got, plain) and torch.equal(got, twin) and torch.equal(in_place, got), (dtype, batch)
        assert not torch.equal(other, got)  # the one call computes the arithmetic it was asked for
        assert E._states_equal(got_states, plain_states) and E._states_equal(got_states, twin_states)
        assert E._states_equal(in_place_states, got_states)
        assert all(a is b for st, st_w in zip(in_place_states, work, strict=True)
                   for a, b in zip(st, st_w, strict=True))  # written in place
        assert not E._states_equal(got_states, states)  # and the step did move them


def test_a_copied_model_steps_on_its_own_weights():
    """A model copied after it stepped (the slot table's tests deepcopy one) carries no C pointer
    into the original: the copy's one-call step reads the copy's weights."""
    import copy

    model = load_model("tiny-mamba1", backend="exact")
    lm = model.module
    states = _states(lm, 1, 51)
    hidden = torch.randn((1, 1, lm.cfg.d_model), generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        original, _, _ = forward(lm, hidden, states, E._KernelBackend())
    twin = copy.deepcopy(lm)
    with torch.inference_mode():
        for blk in twin.backbone.layers:
            blk.mixer.in_proj.weight.mul_(2.0)
        changed, _, _ = forward(twin, hidden, states, E._KernelBackend())
        want, _, _ = forward(twin, hidden, states, E.FixedBackend(E.TWIN_PRIMITIVES))
        again, _, _ = forward(lm, hidden, states, E._KernelBackend())
    assert torch.equal(changed, want) and not torch.equal(changed, original) and torch.equal(again, original)


@pytest.mark.parametrize("how", ["written-in-place", "replaced"])
@pytest.mark.parametrize("preset", ["tiny-mamba1", "tiny-mamba2"])
def test_the_one_call_step_rereads_a_mixer_whose_weights_changed(preset, how):
    """The C description of a mixer is kept while its tensors are unchanged: a weight written in
    place (a fine-tune, a test) or a parameter replaced by another (`module.weight = ...`, which
    the step finds in the modules' dicts, not through nn.Module's attribute lookup) is seen by
    the next step, with the primitives' bits."""
    model = load_model(preset, backend="exact")
    lm = model.module
    states = _states(lm, 1, 50)
    hidden = torch.randn((1, 1, lm.cfg.d_model), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        before, _, _ = forward(lm, hidden, states, E._KernelBackend())
    for blk in lm.backbone.layers:
        mixer = blk.mixer
        if how == "replaced":
            mixer.out_proj.weight = torch.nn.Parameter(mixer.out_proj.weight.detach() * 0.5)
            mixer.D = torch.nn.Parameter(mixer.D.detach() + 1.0)
        else:
            with torch.no_grad():
                mixer.out_proj.weight.mul_(0.5)
                mixer.D.add_(1.0)
    with torch.inference_mode():
        after, _, _ = forward(lm, hidden, states, E._KernelBackend())
        want, _, _ = forward(lm, hidden, states, E.FixedBackend(E.TWIN_PRIMITIVES))
    assert not torch.equal(after, before) and torch.equal(after, want)


@pytest.mark.parametrize("backend", ["exact", "exact-fma"])
@pytest.mark.parametrize("dtype", ["float32", "float32/bfloat16", "float32/float16", "float32/q8"])
@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_decode_token_by_token_equals_the_prefill_of_the_same_tokens(preset, dtype, backend):
    model = model_for(preset, backend, dtype)
    start = model.advance(model.initial_state(), tokens(9, 4)).state
    toks = tokens(40, 5)
    chunk = model.advance(start, toks)
    logits, state = scan_chunks(model, start, toks, [1] * 40)
    assert torch.equal(logits, chunk.logits) and state.equal(chunk.state)


_CHECKSUMS = """
import hashlib, json, sys, torch
from mamba_stream.scan import load_model
from tests.scan._helpers import tokens
out = {}
for entry in sys.argv[1].split(","):
    backend, _, model = entry.rpartition(":")
    name, _, weights = model.partition("@")
    m = load_model(name, backend=backend or "exact", weights=weights or None)
    r = m.advance(m.advance(m.initial_state(), tokens(30, 1)).state, tokens(17, 2))
    h = hashlib.sha256(r.logits.numpy().tobytes())
    for t in r.state.tensors.values():
        h.update(t.contiguous().numpy().tobytes())
    out[entry] = [h.hexdigest(), r.path, m.arithmetic(r.path).id]
print(json.dumps(out))
"""


def _checksums(env: dict[str, str], presets: list[str]) -> dict[str, list[str]]:
    proc = subprocess.run([sys.executable, "-c", _CHECKSUMS, ",".join(presets)], env={**os.environ, **env},
                          capture_output=True, text=True, cwd=ROOT, timeout=600, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_same_bits_for_every_instruction_set_thread_count_and_without_kernels(tmp_path):
    """Kernels built for plain x86-64 (SSE2), for AVX2 and for this machine, on one or two threads,
    and the twins alone, under torch's scalar build: one checksum per preset."""
    presets = [*PINNED, *PINNED_FMA]
    cache = str(tmp_path / "cache")
    runs = {
        "native, 2 threads": {"MAMBA_STREAM_CACHE": cache, "OMP_NUM_THREADS": "2"},
        "native, 1 thread": {"MAMBA_STREAM_CACHE": cache, "OMP_NUM_THREADS": "1"},
        "x86-64": {"MAMBA_STREAM_CACHE": cache, "MAMBA_STREAM_EXACT_MARCH": "x86-64"},
        "x86-64-v3": {"MAMBA_STREAM_CACHE": cache, "MAMBA_STREAM_EXACT_MARCH": "x86-64-v3",
                      "ATEN_CPU_CAPABILITY": "avx2"},
        "twins, torch default": {"MAMBA_STREAM_EXACT_KERNELS": "0", "ATEN_CPU_CAPABILITY": "default"},
    }
    got = {label: _checksums(env, presets) for label, env in runs.items()}
    first = got["native, 2 threads"]
    for label, sums in got.items():
        assert {k: v[0] for k, v in sums.items()} == {k: v[0] for k, v in first.items()}, label
    assert {v[1] for v in got["twins, torch default"].values()} == {"exact-twin"}
    assert {v[1] for v in first.values()} == {"exact"}
    assert len({v[0] for v in first.values()}) == len(presets)  # and the presets do differ
    # the receipt's arithmetic says so: one id everywhere, naming the weight format where it is narrower
    for sums in got.values():
        assert {k: v[2] for k, v in sums.items()} == {
            k: (E.ARITHMETIC_FMA if k.startswith("exact-fma:") else E.ARITHMETIC) + "/float32"
            + (f"/weights-{k.partition('@')[2]}" if "@" in k else "") for k in presets}
    # and they are these versions' bits
    assert {k: v[0] for k, v in first.items()} == {**PINNED, **PINNED_FMA}


#: The bits of arithmetic `exact-1` (the `_CHECKSUMS` run), on whatever CPU this runs. A change
#: of any of them is a new arithmetic: bump `scan._exact.ARITHMETIC`, then these.
PINNED = {
    "tiny-mamba1": "d19c7d10294ac3235319c4821186f49b0e2bfddfc715a552463f63870dce09ed",
    "tiny-mamba2": "09f1f989186456a65a888209770d43b720d6059a90dbc135f6064a004b79a74f",
    "tiny-mamba3": "4066780d1324baf2404e5882328bced56ca5ba1ae0617f193f4f20838e59a836",
    "tiny-mamba3-mimo": "de54304970cbfa0be1c72472be1371119c7e919e602ac96007f9d1b6c9b32450",
    # the same presets with their matrices rounded to bfloat16 / float16 at load, read as such, ...
    "tiny-mamba1@bfloat16": "73010811dc29743ca2b568db9278755ee019a7e2d95d8de13acd0e544d79a896",
    "tiny-mamba2@bfloat16": "19545b517312e28a30b4928b7ed593ddd3cd6a80497f1c2dc7abfa88f3dd0c2a",
    "tiny-mamba3@float16": "723aca271103d3752f34be12f7064e04aad52c5a5ccded794573c1da23fb7369",
    # ... and quantized to block-int8 at load
    "tiny-mamba1@q8": "1b8568157024c3ed3ff9a2f2952f103a7ecce196af04c1be89de6626351d3bb4",
    "tiny-mamba2@q8": "51c40b1f052d5f9d31780cdd9b4b1b1976733f3e288f922f55d677bf09d97b46",
    "tiny-mamba3-mimo@q8": "715099238ad46b1a2708d12502f929a33796c0a61686b7d3e139fe9ba4136fa4",
}


#: The bits of arithmetic `exact-2` (backend "exact-fma"), as `PINNED` for exact-1: each differs
#: from exact-1's for the same preset (a fused multiply-add rounds once where exact-1 rounds twice).
PINNED_FMA = {
    "exact-fma:tiny-mamba1": "d9a6551c537207a7d6db420c3eefa4bfe118eed9bc7e4105bd4cffc38eaa7b77",
    "exact-fma:tiny-mamba2": "8d8ff8fb8799d8ab2893bbdf71ec1f62ddfca4d3a38a4c3f45fe21559b4a40b7",
    "exact-fma:tiny-mamba3": "cce01caf59208b20c3dd6495f01bb8d21148431f5dceea7d8d715c8c2076e645",
    "exact-fma:tiny-mamba3-mimo": "bb7fe65962d0dcbbe97caa09077acd1669d96758edb148ebddcbb6556fe184e8",
    "exact-fma:tiny-mamba1@bfloat16": "ab86020a93b435d342b49305f1db8cf8b6a429655d13259cfb77c0b7a4a71637",
    "exact-fma:tiny-mamba3@float16": "78e1627c5767403b47d8889273b849d9420900ed97a7088194527436a5fd1657",
    "exact-fma:tiny-mamba2@q8": "8995e76a7dfb17ea530d080b4afad77cc74b1155b8cfec1402fb609b2936d090",
}


def test_this_version_of_the_exact_arithmetic_gives_its_pinned_bits():
    assert E.ARITHMETIC == "exact-1" and E.ARITHMETIC_FMA == "exact-2"
    assert {k: v[0] for k, v in _checksums({}, [*PINNED, *PINNED_FMA]).items()} == {**PINNED, **PINNED_FMA}
    for entry, digest in PINNED_FMA.items():  # exact-2 is not exact-1 under another name
        assert digest != PINNED.get(entry.partition(":")[2])


# --- the probe ------------------------------------------------------------------------------------


def test_the_probe_verifies_the_kernels_on_the_model_it_loads():
    model = load_model("tiny-mamba2", backend="exact")
    found = model.exact_probe
    assert found.kernels and found.path == "exact" and "verified" in found.reason
    assert model.advance(model.initial_state(), [1, 2]).path == "exact"


def test_a_product_that_depends_on_its_batch_is_caught_and_the_twins_run(monkeypatch):
    ops = E._kernel_ops()
    honest = type(ops).linear

    def batch_dependent(self, x, weight, bias=None):  # a BLAS that changes kernels with M
        out = honest(self, x, weight, bias)
        rows = out.numel() // out.shape[-1]
        return torch.nextafter(out, out + 1) if rows > 1 else out

    monkeypatch.setattr(type(ops), "linear", batch_dependent)
    # primitives built around the patched product (the module's own stay as they were)
    monkeypatch.setattr(E, "_kernel_primitives", functools.cache(E._kernel_primitives.__wrapped__))
    model = load_model("tiny-mamba1", backend="exact")  # a fresh module: probed anew
    found = model.exact_probe
    assert not found.kernels and found.path == "exact-twin"
    assert "not: kernels equal their twins" in found.reason and "not: token by token equals the chunk" in found.reason
    r = model.advance(model.initial_state(), tokens(6, 1))
    assert r.path == "exact-twin"
    honest_model = model_for("tiny-mamba1", "exact", "float32")
    want = honest_model.advance(honest_model.initial_state(), tokens(6, 1))
    assert torch.equal(r.logits, want.logits) and r.state.equal(want.state)  # the twins: the same bits


def test_without_a_compiler_the_twins_run_and_say_why(tmp_path):
    env = {"MAMBA_STREAM_CACHE": str(tmp_path), "PATH": str(tmp_path), "MAMBA_STREAM_CC": ""}
    code = ("import sys; sys.modules['ziglang'] = None\n"
            "from mamba_stream.scan import load_model\n"
            "m = load_model('tiny-mamba2', backend='exact')\n"
            "print(m.exact_probe.kernels, m.advance(m.initial_state(), [1]).path, '|', m.exact_probe.reason)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                         cwd=ROOT, timeout=300, check=True)
    line = out.stdout.strip().splitlines()[-1]
    assert line.startswith("False exact-twin |") and "no C compiler" in line


def test_a_forward_on_the_kernels_turns_torchs_threads_off_for_its_thread_only(monkeypatch):
    """While the exact backend runs (its kernels split work on their own pool), torch's OpenMP
    threads are off for the calling thread, so they do not spin beside the pool; a thread started
    meanwhile, and the caller afterwards, have torch's setting as it was."""
    import threading

    from mamba_stream.scan import ModelConfig, init_model

    if E._openmp() is None or torch.get_num_threads() < 2:
        pytest.skip("torch runs no OpenMP threads here")
    monkeypatch.setattr(E, "_THREADS", 2)
    model = init_model(ModelConfig.create(architecture="mamba2", d_model=64, n_layer=2, vocab_size=300,
                                          d_state=16, headdim=16), seed=0).with_backend("exact")
    ops = E._kernel_ops()
    seen: list[int] = []
    other: list[int] = []
    real_lib = ops.lib

    class Lib:
        def __getattr__(self, name: str):
            return getattr(real_lib, name)

        def linear_threads(self, *a):
            seen.append(torch.get_num_threads())
            probe = threading.Thread(target=lambda: other.append(torch.get_num_threads()))
            probe.start()
            probe.join()
            return real_lib.linear_threads(*a)

    monkeypatch.setattr(ops, "lib", Lib())
    n = torch.get_num_threads()
    tokens = list(range(1, 40))
    out = model.advance(model.initial_state(), tokens)
    assert seen and all(t == 1 for t in seen), seen
    assert other and all(t == n for t in other), other
    assert torch.get_num_threads() == n
    monkeypatch.setattr(ops, "lib", real_lib)
    again = model.advance(model.initial_state(), tokens)  # and the bits are the bits
    assert torch.equal(out.logits, again.logits)
