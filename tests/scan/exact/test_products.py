"""The products (`_products`): every weight format, exact-1 and exact-2, one thread and split across
the C pool, give their twins' bits; a row alone is the same row in a batch."""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
from collections.abc import Iterator

import pytest
import torch

from mamba_stream.scan import load_model
from mamba_stream.scan._quant import quantize_q8
from mamba_stream.scan.exact import TWIN_OPS, TWIN_OPS_FMA, _threading, linear_fma_ref
from mamba_stream.scan.exact._build import _LINEAR, _SUFFIX, _WEIGHT_FORMATS
from mamba_stream.scan.exact._kernels import _kernel_ops
from tests.scan.exact._helpers import _SPLIT_SHAPES, DTYPES, NEEDS_KERNELS, _both, _equal, _r, _weights_in_every_format

pytestmark = NEEDS_KERNELS


@pytest.mark.parametrize("dtype", DTYPES)
def test_products_norms_and_conv_give_their_twins_bits(dtype):
    """The products, then on the same seeded inputs the norms and the conv (which test_norms.py and
    test_conv.py also hold on their own)."""
    g = torch.Generator().manual_seed(2)
    for m, k, n in [(1, 7, 5), (2, 64, 130), (3, 37, 64), (5, 40, 129), (9, 256, 200), (33, 16, 1000)]:
        x, w, b = _r(g, m, k, dtype=dtype), _r(g, n, k, dtype=dtype), _r(g, n, dtype=dtype)
        assert _equal(*_both("linear", x, w, b)) and _equal(*_both("linear", x, w, None)), (m, k, n)
        big = _kernel_ops().linear(x, w, b)
        for i in range(m):  # one row alone is the same row in a batch
            assert torch.equal(_kernel_ops().linear(x[i : i + 1], w, b)[0], big[i])
    x, z, w = _r(g, 3, 5, 48, dtype=dtype), _r(g, 3, 5, 48, dtype=dtype), _r(g, 48, dtype=dtype)
    assert _equal(*_both("mean", x))
    for rms, bias in ((True, None), (False, _r(g, 48, dtype=dtype))):
        assert _equal(*_both("norm", x, w, bias, 1e-5, rms))
    for before in (False, True):
        assert _equal(*_both("gated_norm", x, z, w, 1e-5, 16, before))
    state, xs, cw, cb = _r(g, 2, 7, 4, dtype=dtype), _r(g, 2, 5, 7, dtype=dtype), _r(g, 7, 1, 4, dtype=dtype), \
        _r(g, 7, dtype=dtype)
    assert _equal(*_both("conv", state, xs, cw, cb)) and _equal(*_both("conv", state, xs, cw, None))


@pytest.mark.parametrize("stored", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", DTYPES)
def test_products_read_narrow_weights_as_stored_with_the_bits_of_their_widened_copies(dtype, stored):
    """A bfloat16 or float16 weight read as it is stored gives the bits of the same product over
    its values widened to the computation's dtype, on the kernels and the twins: every shape class
    (tile remainders in k and n, one row and many), float16's subnormals and extremes included."""
    g = torch.Generator().manual_seed(7)
    ops = _kernel_ops()
    for m, k, n in [(1, 7, 5), (1, 64, 200), (2, 64, 130), (3, 37, 97), (5, 40, 129), (1, 1000, 33), (9, 256, 200),
                    (33, 16, 1000)]:
        x, b = _r(g, m, k, dtype=dtype), _r(g, n, dtype=dtype)
        w = _r(g, n, k, dtype=torch.float32, scale=0.2).to(stored)
        if stored == torch.float16:
            special = [6e-8, -6e-8, 1e-5, -3e-6, 65504.0, -65504.0, 6.1e-5, 0.0, -0.0]
            w.view(-1)[: len(special)] = torch.tensor(special, dtype=torch.float16)
        wide = w.to(dtype)
        for bias in (b, None):
            got, twin, want = ops.linear(x, w, bias), TWIN_OPS.linear(x, w, bias), ops.linear(x, wide, bias)
            assert _equal(got, want) and _equal(twin, want), (m, k, n, stored)
            assert torch.equal(want, TWIN_OPS.linear(x, wide, bias))
        assert torch.equal(ops.linear(x[:1], w, b)[0], ops.linear(x, w, b)[0])
    with pytest.raises(TypeError, match="no exact product"):
        ops.linear(_r(g, 2, 16, dtype=torch.float32), _r(g, 4, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="no exact product"):
        TWIN_OPS.linear(_r(g, 2, 16, dtype=torch.float32), _r(g, 4, 16, dtype=torch.float64))


def test_block_int8_products_give_their_twins_bits_and_stay_near_the_float_product():
    """q8: integer block sums, the blocks added in order. Kernel and twin agree bit for bit on every
    shape class (k not a multiple of 32, outputs past a tile of 8, one row and many), a row alone
    is the same row in a batch, a non-finite activation gives NaN (never a cast integer), and the
    error against the float product is what 8-bit blocks allow."""
    g = torch.Generator().manual_seed(8)
    ops = _kernel_ops()
    for m, k, n in [(1, 7, 5), (1, 64, 200), (2, 64, 130), (3, 37, 97), (5, 40, 129), (1, 1000, 33),
                    (9, 256, 200), (33, 16, 1000), (2, 2048, 96)]:
        x, b = _r(g, m, k, dtype=torch.float32), _r(g, n, dtype=torch.float32)
        w = _r(g, n, k, dtype=torch.float32, scale=0.2)
        qw = quantize_q8(w)
        for bias in (b, None):
            got = ops.linear(x, qw, bias)
            assert _equal(got, TWIN_OPS.linear(x, qw, bias)), (m, k, n)
            assert torch.equal(ops.linear(x[:1], qw, bias)[0], got[0])
        exact = x.double() @ w.double().T + b.double()
        err = (ops.linear(x, qw, b).double() - exact).norm() / exact.norm()
        assert 1e-4 < err < 2e-2, (m, k, n, err)  # quantized (not the float product), and close to it
    x = _r(g, 3, 70, dtype=torch.float32)
    x[0, 5], x[1, 66] = float("nan"), float("inf")
    qw = quantize_q8(_r(g, 11, 70, dtype=torch.float32))
    got, twin = ops.linear(x, qw, None), TWIN_OPS.linear(x, qw, None)
    assert got[:2].isnan().all() and twin[:2].isnan().all() and torch.equal(got[2], twin[2])
    with pytest.raises(TypeError, match="float32"):
        ops.linear(x.double(), qw)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_products_split_across_the_c_helper_threads_give_the_twins_bits(monkeypatch, threads):
    """Every product, whatever its size, handed to the C pool (`pool_run`) on 2, 3 and 5 threads:
    outputs split in runs of 16 (fewer runs than threads, a last run short of 16) give the twins'
    bits in every weight format. Thread counts go up and down between calls, so helpers that
    have no part of a job answer it too."""
    g = torch.Generator().manual_seed(9)
    ops = _kernel_ops()
    monkeypatch.setattr(_threading, "_THREADED_WORK", 0)
    for m, k, n in _SPLIT_SHAPES:
        x, b = _r(g, m, k, dtype=torch.float32), _r(g, n, dtype=torch.float32)
        for w in _weights_in_every_format(g, n, k):
            want = TWIN_OPS.linear(x, w, b)
            for t in (threads, 1, threads):
                monkeypatch.setattr(_threading, "_THREADS", t)
                assert _equal(ops.linear(x, w, b), want), (m, k, n, t, type(w).__name__)


def _threaded_shapes() -> list[tuple[int, int, int]]:
    """(rows, k, outputs) of products at least `_THREADED_WORK` multiply-adds, the size from which
    a product splits across threads: decode (one row) and prefill (seven: a tile of rows and a
    remainder), k off and on a block of 16/32, and outputs 9 past a run of 16, so that the two
    threads' spans are unequal and the last run of the last span is short."""
    shapes = []
    for m, k in [(1, 300), (1, 1024), (7, 200)]:
        n = -(-_threading._THREADED_WORK // (m * k))
        shapes.append((m, k, n + (9 - n) % 16))
    return shapes


def _record_threads(monkeypatch: pytest.MonkeyPatch, lib) -> list[int]:
    """The thread count each product hands the C pool (`linear_threads`, `linear_q8_threads`)."""
    seen: list[int] = []
    for name in ("linear_threads", "linear_q8_threads"):
        real = getattr(lib, name)
        monkeypatch.setattr(lib, name, lambda *a, _real=real: (seen.append(a[-1]), _real(*a))[1])
    return seen


_LINEAR_FN = ctypes.CFUNCTYPE(None, *_LINEAR)


@contextlib.contextmanager
def _record_spans(ops, dtype: torch.dtype, wdtype: torch.dtype
                  ) -> Iterator[list[tuple[int, int]]]:
    """The outputs [n0, n1) each part of a float product's job is called on (the pool's split,
    seen from inside C), while the context lasts: the product's kernel is called through a
    recorder, and the kernel itself again after."""
    fmt = {v: k for k, v in _WEIGHT_FORMATS.items()}[None if wdtype == dtype else wdtype]
    kernel, spans = getattr(ops.lib, f"linear_{fmt}{_SUFFIX[dtype]}"), []

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
    ops = _kernel_ops()
    threads = _record_threads(monkeypatch, ops.lib)
    for m, k, n in _threaded_shapes():
        assert m * k * n >= _threading._THREADED_WORK and n % 16 == 9, (m, k, n)
        x, b = _r(g, m, k, dtype=dtype), _r(g, n, dtype=dtype)
        w = _r(g, n, k, dtype=dtype, scale=0.2)
        w = quantize_q8(w) if stored == "q8" else w.to(stored)
        for bias in (b, None):
            want = TWIN_OPS.linear(x, w, bias)
            got = {}
            for t in (1, 2):
                monkeypatch.setattr(_threading, "_THREADS", t)
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
                monkeypatch.setattr(_threading, "_THREADS", t)
                with _record_spans(ops, dtype, w.dtype) as spans:
                    recorded = ops.linear(x, w, bias)
                assert _equal(recorded, want), (fmt, m, k, n, t, "recorded", _differ(recorded, want))
                assert sorted(spans) == parts and (n - s) % 16 != 0, (m, k, n, t, spans)


@pytest.mark.parametrize("fmt", ["float32", "q8"])
def test_a_product_splits_from_exactly_the_threaded_work(monkeypatch, fmt):
    """At `_THREADED_WORK` multiply-adds a product goes to 2 threads, one output fewer stays on
    one; both with the twins' bits, biased."""
    g = torch.Generator().manual_seed(13)
    ops = _kernel_ops()
    threads = _record_threads(monkeypatch, ops.lib)
    monkeypatch.setattr(_threading, "_THREADS", 2)
    k = 256
    n = -(-_threading._THREADED_WORK // k)
    assert n * k >= _threading._THREADED_WORK > (n - 1) * k
    for outputs, want_threads in ((n, 2), (n - 1, 1)):
        x, b = _r(g, 1, k, dtype=torch.float32), _r(g, outputs, dtype=torch.float32)
        w = _r(g, outputs, k, dtype=torch.float32, scale=0.2)
        w = quantize_q8(w) if fmt == "q8" else w
        threads.clear()
        got = ops.linear(x, w, b)
        want = TWIN_OPS.linear(x, w, b)
        assert threads == [want_threads] and _equal(got, want), (outputs, threads, _differ(got, want))


#: (rows, k, outputs): tile remainders in k (16, 32) and n (8, 16, BLOCK_N), one row and many
_FUSED_SHAPES = [(1, 7, 5), (1, 64, 200), (2, 64, 130), (3, 37, 97), (5, 40, 129), (1, 1000, 33), (9, 256, 200),
                 (33, 16, 1000), (2, 2048, 96)]


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_fused_products_give_their_twins_bits_in_every_format_and_split(monkeypatch, threads):
    """The exact-2 products (`linear_fma_*_f32`, `linear_q8_fma_f32`) against their twin (each lane
    step `scan._fma.fma_ref`): every shape class, every weight format, biased and not, split
    across 1-3 threads from any size; a row alone is the same row in a batch; and the bits are
    not exact-1's (past a few lane steps, most outputs differ: a fused step rounds once)."""
    g = torch.Generator().manual_seed(13)
    fused, plain = _kernel_ops(True), _kernel_ops()
    monkeypatch.setattr(_threading, "_THREADED_WORK", 0)
    monkeypatch.setattr(_threading, "_THREADS", threads)
    differ = total = 0
    for m, k, n in _FUSED_SHAPES + _threaded_shapes():
        x, b = _r(g, m, k, dtype=torch.float32), _r(g, n, dtype=torch.float32)
        for w in _weights_in_every_format(g, n, k):
            for bias in (b, None):
                got = fused.linear(x, w, bias)
                assert _equal(got, TWIN_OPS_FMA.linear(x, w, bias)), (m, k, n, threads, getattr(w, "dtype", "q8"))
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
        linear_fma_ref(torch.ones(2, 16, dtype=torch.float64), torch.ones(3, 16, dtype=torch.float64))
    with pytest.raises(TypeError, match="no exact product"):
        _kernel_ops(True).linear(torch.ones(2, 16, dtype=torch.float64), torch.ones(3, 16, dtype=torch.float64))


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
