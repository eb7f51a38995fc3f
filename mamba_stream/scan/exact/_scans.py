"""The scans: Mamba-1's selective scan, Mamba-2's SSD, Mamba-3's angles and trapezoid: kernels and twins.

In time order, one token after the other, the same code for a prefill and a decode step; each
contraction with the state summed in index order (`_seq_contract`), each decay the exact exp of
`_unary`. The kernels are `selective_scan`, `ssd_scan`, `angle_scan` and `trapezoid_scan` of
`_scans.c`, their work units (streams, channel blocks, heads) split across Python's thread pool.

Separate because the scans are where a state crosses tokens: the arithmetic the chunking
invariance rests on.
"""

from __future__ import annotations

import torch

from mamba_stream.scan.exact._build import _Library
from mamba_stream.scan.exact._threading import _parallel
from mamba_stream.scan.exact._unary import unary_ref

Tensor = torch.Tensor


def _seq_contract(h: Tensor, c: Tensor) -> Tensor:
    """(((0 + h_0 c_0) + h_1 c_1) + ...) over the last dimension."""
    acc = torch.zeros_like(h[..., 0] * c[..., 0])
    for n in range(h.shape[-1]):
        acc = acc + h[..., n] * c[..., n]
    return acc


class _SelectiveScan(_Library):
    """The kernel `selective_scan` (out of place, and into the state it is given)."""

    def selective_scan(self, dt: Tensor, at: Tensor, x: Tensor, b: Tensor, cc: Tensor,
                       h0: Tensor) -> tuple[Tensor, Tensor]:
        return self._selective_scan(dt, at, x, b, cc, h0, into=None)

    def selective_scan_into(self, dt: Tensor, at: Tensor, x: Tensor, b: Tensor, cc: Tensor, h0: Tensor
                            ) -> tuple[Tensor, Tensor]:
        """`selective_scan`, the new state written over `h0` (returned): each work unit reads its
        block of h0 whole before it writes it, so aliasing changes no bit."""
        if not h0.is_contiguous():
            y, h = self.selective_scan(dt, at, x, b, cc, h0)
            return y, h0.copy_(h)
        return self._selective_scan(dt, at, x, b, cc, h0, into=h0)

    def _selective_scan(self, dt: Tensor, at: Tensor, x: Tensor, b: Tensor, cc: Tensor, h0: Tensor,
                        into: Tensor | None) -> tuple[Tensor, Tensor]:
        bsz, length, c = dt.shape
        n = at.shape[0]
        dt, at, x, b, cc, h0 = (t.contiguous() for t in (dt, at, x, b, cc, h0))
        # the kernel reads h0 and writes h: the caller's state stays as it was, unless it asked for it
        h = torch.empty_like(h0) if into is None else into
        y = torch.empty_like(dt)
        fn = self.fn["selective_scan", dt.dtype]
        nblk = (c + 63) // 64
        _parallel(lambda u0, u1: fn(dt.data_ptr(), at.data_ptr(), x.data_ptr(), b.data_ptr(), cc.data_ptr(),
                                    h0.data_ptr(), h.data_ptr(), y.data_ptr(), bsz, length, c, n, u0, u1),
                  bsz * nblk, bsz * length * c * n * 8)
        return y, h


def selective_scan_ref(dt: Tensor, at: Tensor, x: Tensor, b: Tensor, cc: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel `selective_scan`: dt, x: (B, L, C); at: (N, C) (A transposed); b, cc: (B, L, N);
    h0: (B, C, N) -> y (B, L, C), state (B, C, N)."""
    a = at.t()
    h, ys = h0, []
    for t in range(dt.shape[1]):
        decay = unary_ref(dt[:, t].unsqueeze(-1) * a, "exp")
        h = h * decay + (dt[:, t] * x[:, t]).unsqueeze(-1) * b[:, t].unsqueeze(1)
        ys.append(_seq_contract(h, cc[:, t].unsqueeze(1)))
    return torch.stack(ys, dim=1), h


def selective_scan_into_ref(dt: Tensor, at: Tensor, x: Tensor, b: Tensor, cc: Tensor, h0: Tensor
                             ) -> tuple[Tensor, Tensor]:
    """The kernel call `selective_scan_into`: `selective_scan_ref`, its new state written over
    `h0` (returned). Shapes as `selective_scan_ref`'s."""
    y, h = selective_scan_ref(dt, at, x, b, cc, h0)
    return y, h0.copy_(h)


class _Ssd(_Library):
    """The kernel `ssd_scan` (out of place, and into the state it is given)."""

    def ssd(self, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
        return self._ssd(x, dt, a, b, c, h0, into=None)

    def ssd_into(self, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
        """`ssd`, the new state written over `h0` (returned). Each work unit (stream, head) owns
        its (P, N) block: the decode loop reads an element and writes it in one statement, the
        longer loop reads the block whole first, so aliasing changes no bit."""
        if not h0.is_contiguous():
            y, s = self.ssd(x, dt, a, b, c, h0)
            return y, h0.copy_(s)
        return self._ssd(x, dt, a, b, c, h0, into=h0)

    def _ssd(self, x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor,
             into: Tensor | None) -> tuple[Tensor, Tensor]:
        bsz, length, h, p = x.shape
        g, n = b.shape[2], b.shape[3]
        x, dt, a, b, c, h0 = (t.contiguous() for t in (x, dt, a, b, c, h0))
        s = torch.empty_like(h0) if into is None else into
        y = torch.empty_like(x)
        fn = self.fn["ssd_scan", x.dtype]
        _parallel(lambda u0, u1: fn(x.data_ptr(), dt.data_ptr(), a.data_ptr(), b.data_ptr(), c.data_ptr(),
                                    h0.data_ptr(), s.data_ptr(), y.data_ptr(), bsz, length, h, p, g, n, u0, u1),
                  bsz * h, bsz * length * h * p * n * 4)
        return y, s


def ssd_ref(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel `ssd_scan`: x: (B, L, H, P); dt: (B, L, H); a: (H,); b, c: (B, L, G, N);
    h0: (B, H, P, N) -> y (B, L, H, P), state (B, H, P, N)."""
    _bsz, length, h, _p = x.shape
    g = b.shape[2]
    hg = h // g
    s, ys = h0, []
    for t in range(length):
        d = dt[:, t]
        decay = unary_ref(d * a, "exp")  # (B, H)
        dx = d.unsqueeze(-1) * x[:, t]  # (B, H, P)
        bt = b[:, t].repeat_interleave(hg, dim=1)  # (B, H, N)
        s = s * decay[:, :, None, None] + dx.unsqueeze(-1) * bt.unsqueeze(2)
        ys.append(_seq_contract(s, c[:, t].repeat_interleave(hg, dim=1).unsqueeze(2)))
    return torch.stack(ys, dim=1), s


def ssd_into_ref(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel call `ssd_into`: `ssd_ref`, its new state written over `h0` (returned). Shapes
    as `ssd_ref`'s."""
    y, s = ssd_ref(x, dt, a, b, c, h0)
    return y, h0.copy_(s)


class _Angle(_Library):
    """The kernel `angle_scan`."""

    def angle(self, inc: Tensor, angle: Tensor) -> tuple[Tensor, Tensor]:
        bsz, length = inc.shape[:2]
        inc = inc.contiguous()
        ang = angle.contiguous().clone()
        theta = torch.empty_like(inc)
        hs = ang[0].numel() if bsz else 0
        self.fn["angle_scan", inc.dtype](inc.data_ptr(), ang.data_ptr(), theta.data_ptr(), bsz, length, hs, 0, bsz)
        return theta, ang


def angle_ref(inc: Tensor, angle: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel `angle_scan`: inc: (B, L, H, S); angle: (B, H, S) -> theta (B, L, H, S), the
    last angle (B, H, S)."""
    two_pi = torch.tensor(6.283185307179586, dtype=inc.dtype)
    out = []
    for t in range(inc.shape[1]):
        v = angle + inc[:, t]
        angle = v - two_pi * torch.floor(v / two_pi)
        out.append(angle)
    return torch.stack(out, dim=1), angle


class _Trapezoid(_Library):
    """The kernel `trapezoid_scan`."""

    def trapezoid(self, q: Tensor, k: Tensor, xr: Tensor, alpha: Tensor, beta: Tensor, gamma: Tensor, d: Tensor,
                  s0: Tensor, kp: Tensor, xp: Tensor) -> tuple[Tensor, Tensor]:
        bsz, length, r, h, n = q.shape
        p = xr.shape[-1]
        q, k, xr, alpha, beta, gamma, d, s0 = (t.contiguous() for t in (q, k, xr, alpha, beta, gamma, d, s0))
        s = torch.empty_like(s0)
        kp, xp = kp.contiguous().clone(), xp.contiguous().clone()
        y = torch.empty_like(xr)
        fn = self.fn["trapezoid_scan", q.dtype]
        _parallel(lambda u0, u1: fn(q.data_ptr(), k.data_ptr(), xr.data_ptr(), alpha.data_ptr(), beta.data_ptr(),
                                    gamma.data_ptr(), d.data_ptr(), s0.data_ptr(), s.data_ptr(), kp.data_ptr(),
                                    xp.data_ptr(), y.data_ptr(), bsz, length, r, h, p, n, u0, u1),
                  bsz * h, bsz * length * r * h * p * n * 4)
        return y, s


def trapezoid_ref(q: Tensor, k: Tensor, xr: Tensor, alpha: Tensor, beta: Tensor, gamma: Tensor, d: Tensor,
                   s0: Tensor, kp: Tensor, xp: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel `trapezoid_scan`: q, k: (B, L, R, H, N); xr: (B, L, R, H, P); alpha, beta, gamma:
    (B, L, H); d: (H,); s0: (B, H, P, N); kp: (B, R, H, N), xp: (B, R, H, P) the previous token's
    -> y (B, L, R, H, P), state (B, H, P, N)."""
    s, ys = s0, []
    for t in range(q.shape[1]):
        bx = beta[:, t, None, :, None] * xp  # (B, R, H, P)
        gx = gamma[:, t, None, :, None] * xr[:, t]
        terms = bx.unsqueeze(-1) * kp.unsqueeze(-2) + gx.unsqueeze(-1) * k[:, t].unsqueeze(-2)  # (B, R, H, P, N)
        upd = terms[:, 0]
        for r in range(1, terms.shape[1]):
            upd = upd + terms[:, r]
        s = s * alpha[:, t, :, None, None] + upd
        ys.append(_seq_contract(s.unsqueeze(1), q[:, t].unsqueeze(-2)) + d[:, None] * xr[:, t])
        kp, xp = k[:, t], xr[:, t]
    return torch.stack(ys, dim=1), s
