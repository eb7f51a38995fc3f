"""The norms (`_norms`): the mean of rows, RMSNorm and LayerNorm (biased or not) and the gated
RMSNorm give their twins' bits, whatever the rows, the width and the layout of their input."""

from __future__ import annotations

import pytest
import torch

from mamba_stream.scan.exact import TWIN_OPS
from mamba_stream.scan.exact._kernels import _kernel_ops
from tests.scan.exact._helpers import DTYPES, NEEDS_KERNELS, _both, _equal, _r

pytestmark = NEEDS_KERNELS

#: (leading dimensions, width): one row and many, widths off and on a vector's lanes
_SHAPES = [((1,), 1), ((1,), 7), ((3,), 48), ((2, 5), 64), ((1, 1), 1000), ((4, 3), 129)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_mean_and_the_norms_give_their_twins_bits(dtype):
    g = torch.Generator().manual_seed(14)
    for lead, d in _SHAPES:
        x, w, b = _r(g, *lead, d, dtype=dtype, scale=3.0), _r(g, d, dtype=dtype), _r(g, d, dtype=dtype)
        assert _equal(*_both("mean", x)), (lead, d)
        for rms, bias in ((True, None), (True, b), (False, None), (False, b)):
            for eps in (1e-5, 1e-6):
                assert _equal(*_both("norm", x, w, bias, eps, rms)), (lead, d, rms, bias is None, eps)
        # a strided input (the kernel takes a contiguous copy) gives the same bits
        wide = torch.stack([x, x], dim=-1)[..., 0]  # every other value of a buffer
        assert (d == 1 or not wide.is_contiguous()) and _equal(_kernel_ops().norm(wide, w, None, 1e-5, True),
                                                               TWIN_OPS.norm(x, w, None, 1e-5, True))
        assert _equal(_kernel_ops().mean(wide), TWIN_OPS.mean(x))


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_gated_norm_gives_its_twins_bits_in_every_group_size(dtype):
    """mamba-ssm's RMSNormGated: groups of 1 channel to all of them, the gate before the norm and
    after it, z large enough that silu saturates."""
    g = torch.Generator().manual_seed(15)
    for lead, d, groups in [((1,), 8, (1, 8)), ((3,), 48, (16, 48)), ((2, 5), 64, (8, 32, 64)), ((1,), 1000, (125,))]:
        x, z, w = _r(g, *lead, d, dtype=dtype), _r(g, *lead, d, dtype=dtype, scale=30.0), _r(g, d, dtype=dtype)
        for gs in groups:
            for before in (False, True):
                assert _equal(*_both("gated_norm", x, z, w, 1e-5, gs, before)), (lead, d, gs, before)
    with pytest.raises(ValueError, match="does not divide"):
        _kernel_ops().gated_norm(x, z, w, 1e-5, 7, False)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_norms_split_across_threads_give_the_twins_bits(monkeypatch, dtype):
    """A prefill's norms run on the C pool, each row normed whole by one thread: on 1, 2 and 3
    threads (more threads than some calls' rows, rows not a multiple of the threads), the RMSNorm
    and the gated norm (the gate before and after) give the twins' bits, and the pool was used."""
    from mamba_stream.scan.exact import _threading

    ops = _kernel_ops()
    monkeypatch.setattr(_threading, "_THREADED_WORK", 0)
    seen: list[int] = []
    for table in (ops.rms_norms, ops.gated_norms):
        real = table[dtype]
        monkeypatch.setitem(table, dtype, lambda *a, _real=real: (seen.append(a[-1]), _real(*a))[1])
    g = torch.Generator().manual_seed(16)
    for rows in (1, 2, 77):
        x, z = _r(g, rows, 96, dtype=dtype, scale=3.0), _r(g, rows, 96, dtype=dtype, scale=30.0)
        w = _r(g, 96, dtype=dtype)
        for threads in (1, 2, 3):
            monkeypatch.setattr(_threading, "_THREADS", threads)
            seen.clear()
            assert _equal(ops.norm(x, w, None, 1e-5, True), TWIN_OPS.norm(x, w, None, 1e-5, True)), (rows, threads)
            for before in (False, True):
                assert _equal(ops.gated_norm(x, z, w, 1e-5, 32, before),
                              TWIN_OPS.gated_norm(x, z, w, 1e-5, 32, before)), (rows, threads, before)
            assert seen == [threads] * 3
