"""The elementwise kernels (`_unary`): each op gives its twin's bits, on one thread and split, and
is the function it names."""

from __future__ import annotations

import pytest
import torch

from mamba_stream.scan.exact import TWIN_OPS, _threading
from mamba_stream.scan.exact._kernels import _kernel_ops
from mamba_stream.scan.exact._unary import _UNARY, unary_ref
from tests.scan.exact._helpers import DTYPES, NEEDS_KERNELS, _both, _equal, _r

pytestmark = NEEDS_KERNELS


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_elementwise_kernel_gives_its_twins_bits(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.cat([_r(g, 5000, dtype=dtype, scale=6.0), _r(g, 1000, dtype=dtype, scale=200.0),
                   torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, 20.000001, 709.5, -708.5, -800.0, 800.0,
                                 float("inf"), float("-inf"), float("nan")], dtype=dtype)])
    for op in _UNARY:
        v = x.abs() + 1e-6 if op == "rsqrt" else x
        k, t = _kernel_ops().unary(v, op), unary_ref(v, op)
        assert torch.equal(k.nan_to_num(7.0), t.nan_to_num(7.0)) and bool((k.isnan() == t.isnan()).all()), op
    # and they are the functions they name, to a few units in the last place
    finite = x[torch.isfinite(x) & (x.abs() < 80)].double()
    ulp = 6e-8 if dtype == torch.float32 else 2e-15
    reference = {"exp": torch.exp, "sigmoid": torch.sigmoid, "tanh": torch.tanh, "sin": torch.sin, "cos": torch.cos,
                 "silu": torch.nn.functional.silu, "softplus": torch.nn.functional.softplus}
    for op, fn in reference.items():
        got = _kernel_ops().unary(finite.to(dtype), op).double()
        want = fn(finite.to(dtype).double())
        assert float(((got - want).abs() / want.abs().clamp_min(1e-30)).max()) <= 8 * ulp, op
    v = finite.abs() + 1e-3
    assert float((_kernel_ops().unary(v.to(dtype), "rsqrt").double() * v.sqrt() - 1).abs().max()) <= 4 * ulp


@pytest.mark.parametrize("dtype", DTYPES)
def test_elementwise_functions_split_across_threads_give_the_twins_bits(monkeypatch, dtype):
    """A prefill's elementwise functions run on the C pool in runs of whole 4096-value units: on 1
    and 2 threads, with a last unit cut short, every function gives the twin's bits."""
    ops = _kernel_ops()
    g = torch.Generator().manual_seed(12)
    x = _r(g, 3 * 4096 * 5 + 77, dtype=dtype, scale=4.0)
    assert x.numel() * 20 >= _threading._THREADED_WORK
    seen: list[int] = []
    for dt in (torch.float32, torch.float64):
        real = ops.unarys[dt]
        monkeypatch.setitem(ops.unarys, dt, lambda *a, _real=real: (seen.append(a[-1]), _real(*a))[1])
    for op in _UNARY:
        v = x.abs() + 1e-3 if op == "rsqrt" else x
        want = unary_ref(v, op)
        for threads in (1, 2):
            monkeypatch.setattr(_threading, "_THREADS", threads)
            seen.clear()
            assert torch.equal(ops.unary(v, op), want), (op, threads)
            assert seen == [threads]


@pytest.mark.parametrize("dtype", DTYPES)
def test_exp_gives_its_twins_bits_and_a_parameters_exp_follows_the_parameter(dtype):
    """`exp`, the kernel call the mixers' A = -exp(A_log) takes: a tensor's and a parameter's
    (kept on the parameter while it is unchanged) have the twin's bits, and a parameter written
    in place gets its new exp."""
    g = torch.Generator().manual_seed(16)
    x = _r(g, 3, 70, dtype=dtype, scale=4.0)
    assert _equal(*_both("exp", x)) and _equal(*_both("exp", x.t()))  # and strided
    a_log = torch.nn.Parameter(_r(g, 16, dtype=dtype))
    first = _kernel_ops().exp(a_log)
    assert _equal(first, TWIN_OPS.exp(a_log.detach())) and _kernel_ops().exp(a_log) is first  # kept
    with torch.no_grad():
        a_log.add_(0.5)
    again = _kernel_ops().exp(a_log)
    assert again is not first and _equal(again, TWIN_OPS.exp(a_log.detach())) and not torch.equal(again, first)
