"""Mamba-1's selective scan: the hand-written backward against autograd through the same loop."""

from __future__ import annotations

import pytest
import torch

from mamba_stream.scan._mamba1 import _selective_scan_forward, selective_scan, selective_scan_autograd

# float64 agrees to rounding; float32 within a few ulps of values of order 1-10 after 12 tokens
_TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


def _inputs(dtype: torch.dtype, bsz: int = 3, length: int = 12, c: int = 6, n: int = 4, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    dt = torch.rand(bsz, length, c, generator=g, dtype=dtype) * 0.5 + 0.01
    a = -torch.rand(c, n, generator=g, dtype=dtype) * 4
    dtx = torch.randn(bsz, length, c, generator=g, dtype=dtype)
    b = torch.randn(bsz, length, n, generator=g, dtype=dtype)
    cc = torch.randn(bsz, length, n, generator=g, dtype=dtype)
    h0 = torch.randn(bsz, c, n, generator=g, dtype=dtype)
    return dt, a, dtx, b, cc, h0


def test_the_backward_passes_gradcheck():
    ins = [t.requires_grad_() for t in _inputs(torch.float64, bsz=2, length=5, c=3, n=2)]
    assert torch.autograd.gradcheck(selective_scan, ins)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_outputs_and_every_gradient_match_autograd_through_the_loop(dtype):
    fast = [t.clone().requires_grad_() for t in _inputs(dtype)]
    ref = [t.clone().requires_grad_() for t in _inputs(dtype)]
    y, h = selective_scan(*fast)
    y_ref, h_ref = selective_scan_autograd(*ref)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=_TOL[dtype])
    torch.testing.assert_close(h, h_ref, rtol=0, atol=_TOL[dtype])
    g = torch.Generator().manual_seed(1)
    gy, gh = torch.randn(y.shape, generator=g, dtype=dtype), torch.randn(h.shape, generator=g, dtype=dtype)
    ((y * gy).sum() + (h * gh).sum()).backward()
    ((y_ref * gy).sum() + (h_ref * gh).sum()).backward()
    for name, p, q in zip(("dt", "A", "dtx", "B", "C", "h0"), fast, ref, strict=True):
        scale = q.grad.abs().max().item()
        assert (p.grad - q.grad).abs().max().item() <= _TOL[dtype] * max(1.0, scale), name


def test_a_segment_split_carries_the_gradient_through_the_state():
    whole = [t.clone().requires_grad_() for t in _inputs(torch.float64)]
    split = [t.clone().requires_grad_() for t in _inputs(torch.float64)]
    y, h = selective_scan(*whole)
    dt, a, dtx, b, cc, h0 = split
    y1, h1 = selective_scan(dt[:, :5], a, dtx[:, :5], b[:, :5], cc[:, :5], h0)
    y2, h2 = selective_scan(dt[:, 5:], a, dtx[:, 5:], b[:, 5:], cc[:, 5:], h1)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y, rtol=0, atol=1e-12)
    (y.square().sum() + h.sum()).backward()
    (torch.cat([y1, y2], 1).square().sum() + h2.sum()).backward()
    for p, q in zip(whole, split, strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-11)


def test_the_inference_scan_keeps_no_states_and_leaves_its_input_state_alone():
    dt, a, dtx, b, cc, h0 = _inputs(torch.float32)
    before = h0.clone()
    y, h = _selective_scan_forward(dt, a, dtx, b, cc, h0)
    hs = torch.empty((*dt.shape, a.shape[-1]))
    y_kept, h_kept = _selective_scan_forward(dt, a, dtx, b, cc, h0, hs)
    assert torch.equal(y, y_kept) and torch.equal(h, h_kept) and torch.equal(hs[:, -1], h)
    assert torch.equal(h0, before)
