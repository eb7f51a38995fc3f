"""The scans (`_scans`): Mamba-1's, Mamba-2's and Mamba-3's give their twins' bits, out of place and
into the state they are given."""

from __future__ import annotations

import pytest
import torch

from mamba_stream.scan.exact import TWIN_OPS
from mamba_stream.scan.exact._kernels import _kernel_ops
from tests.scan.exact._helpers import DTYPES, NEEDS_KERNELS, _both, _equal, _r

pytestmark = NEEDS_KERNELS


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
        want = getattr(_kernel_ops(), name)(*args(h0))
        for ops in (_kernel_ops(), TWIN_OPS):
            h = h0.clone() if contiguous else state(*h0.shape).copy_(h0)
            got = getattr(ops, name + "_into")(*args(h))
            assert got[1] is h and _equal(got, want), (name, ops)
