"""The causal conv (`_conv`): a decode step's and a prefill's, out of place and into its state, give
the twin's bits on one thread and split."""

from __future__ import annotations

import pytest
import torch

from mamba_stream.scan.exact import TWIN_OPS, _threading
from mamba_stream.scan.exact._kernels import _kernel_ops
from tests.scan.exact._helpers import DTYPES, NEEDS_KERNELS, _equal, _r

pytestmark = NEEDS_KERNELS


@pytest.mark.parametrize("width", [3, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_a_prefill_conv_split_across_threads_gives_the_twins_bits(monkeypatch, dtype, width):
    """The prefill conv (taps transposed, channels inner, tokens split between the C pool's
    threads) against the twin, on 1 and 2 threads, out of place and into its own state; chunks
    shorter than the conv's width (its state feeds every output) and longer; big enough to split."""
    ops = _kernel_ops()
    g = torch.Generator().manual_seed(11)
    seen: list[int] = []
    for name in ("conv_threads_f32", "conv_threads_f64"):
        real = getattr(ops.lib, name)
        monkeypatch.setitem(ops.convs, torch.float32 if name.endswith("32") else torch.float64,
                            lambda *a, _real=real: (seen.append(a[-1]), _real(*a))[1])
    for b, length, c in [(2, width - 1, 40000), (1, 1, 90000), (2, 300, 257), (3, 130, 1000)]:
        assert b * length * c * width >= _threading._THREADED_WORK
        state, xs = _r(g, b, c, width, dtype=dtype), _r(g, b, length, c, dtype=dtype)
        cw, cb = _r(g, c, 1, width, dtype=dtype), _r(g, c, dtype=dtype)
        for bias in (cb, None):
            want = TWIN_OPS.conv(state, xs, cw, bias)
            for threads in (1, 2):
                monkeypatch.setattr(_threading, "_THREADS", threads)
                seen.clear()
                assert _equal(ops.conv(state, xs, cw, bias), want), (b, length, c, threads)
                h = state.clone()
                got = ops.conv_into(h, xs, cw, bias)
                assert got[1] is h and _equal(got, want), (b, length, c, threads, "into")
                assert seen == [threads, threads]
