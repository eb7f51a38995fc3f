"""Mamba-3 (exponential-trapezoidal recurrence, data-dependent RoPE on B/C, optional MIMO).

Follows mamba-ssm 2.3.2's `Mamba3` module and its SISO kernels (`mamba3_siso_step`,
`mamba3_siso_combined`), with A = min(-softplus(a_raw), -A_floor) (not the later
heavy-tail activation of upstream main).

Dimension letters:
    B   batch (streams)
    L   tokens in the chunk
    Q   chunk_size of the chunked algorithm; K chunks
    D   d_model
    H   heads, d_inner / P
    P   headdim
    G   ngroups (B/C heads; H / G SSM heads share one)
    N   d_state
    R   MIMO rank (1 for SISO)
    S   rotary angles

State per stream: angle (H, S), kept modulo 2 pi; ssm (H, P, N); k (R, H, N), the previous token's
rotated, biased B; v (H, P), the previous token's x. There is no conv.
Recurrence per token and head, with lam = sigmoid(trap), alpha = exp(A dt):
    h = alpha h + (1 - lam) dt alpha sum_r x_prev_r k_prev_r^T + lam dt sum_r x_r k_r^T
    y_r = h q_r + D x_r
where x_r = x * mimo_x[r] (x for SISO), and q, k are C, B after RMSNorm, bias and rotation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._mixer import Mixer, States
from mamba_stream.scan._ops import REFERENCE_OPS, Ops, Primitives, chunk_decays

__all__ = ["Mamba3Mixer", "mamba3_chunked", "mamba3_steps"]

Tensor = torch.Tensor
_TWO_PI = 2.0 * math.pi


class _Weight(nn.Module):
    """Holds a `.weight` under mamba-ssm's module name (B_norm, C_norm, norm)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


def _wrap(theta: Tensor) -> Tensor:
    """Angles into [0, 2 pi), as the SISO kernels keep them (cos/sin are unchanged)."""
    return theta - _TWO_PI * torch.floor(theta / _TWO_PI)


class Mamba3Mixer(Mixer):
    chunk_path = "ssd"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        h, r, g, n, p = cfg.nheads, cfg.mimo_rank, cfg.ngroups, cfg.d_state, cfg.headdim
        self.mimo = r > 1
        d_in_proj = 2 * cfg.d_inner + 2 * n * g * r + 3 * h + cfg.n_angles
        self.in_proj = nn.Linear(cfg.d_model, d_in_proj, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(h))
        self.B_bias = nn.Parameter(torch.ones(h, r, n))
        self.C_bias = nn.Parameter(torch.ones(h, r, n))
        self.B_norm = _Weight(n)
        self.C_norm = _Weight(n)
        if self.mimo:
            self.mimo_x = nn.Parameter(torch.ones(h, r, p) / r)
            self.mimo_z = nn.Parameter(torch.ones(h, r, p))
            self.mimo_o = nn.Parameter(torch.ones(h, r, p) / r)
        self.D = nn.Parameter(torch.ones(h))
        if cfg.is_outproj_norm:
            self.norm = _Weight(cfg.d_inner)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=False)

    def state_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        cfg = self.cfg
        h, p, n = cfg.nheads, cfg.headdim, cfg.d_state
        return [
            ("angle", (h, cfg.n_angles)),
            ("ssm", (h, p, n)),
            ("k", (cfg.mimo_rank, h, n)),
            ("v", (h, p)),
        ]

    # --- shared pieces -----------------------------------------------------------------------

    def _split(self, proj: Tensor) -> list[Tensor]:
        cfg = self.cfg
        h, bc = cfg.nheads, cfg.d_state * cfg.ngroups * cfg.mimo_rank
        sizes = [cfg.d_inner, cfg.d_inner, bc, bc, h, h, h, cfg.n_angles]
        return list(torch.split(proj, sizes, dim=-1))

    def _decay_and_dt(self, dd_dt: Tensor, dd_a: Tensor, ops: Primitives) -> tuple[Tensor, Tensor]:
        a = torch.clamp(-ops.softplus(dd_a), max=-self.cfg.A_floor)
        dt = ops.softplus(dd_dt + self.dt_bias)
        return a, dt

    def _normalized(self, raw: Tensor, weight: Tensor, be: Primitives) -> Tensor:
        """(..., R * G * N) projection slice -> (..., R, G, N), RMS-normalized per group, weighted."""
        cfg = self.cfg
        r, g, n = cfg.mimo_rank, cfg.ngroups, cfg.d_state
        return be.norm(raw.reshape(*raw.shape[:-1], r, g, n), weight, None, cfg.mixer_norm_eps, True)

    def _heads_rotated(self, t: Tensor, bias: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Broadcast (..., R, G, N) to heads, add the per-head bias, rotate by the angles whose cos
        and sin are given (..., H, S).

        Returns:
            (..., R, H, N).
        """
        cfg = self.cfg
        g, n, h = cfg.ngroups, cfg.d_state, cfg.nheads
        t = t.repeat_interleave(h // g, dim=-2) if g > 1 else t.expand(*t.shape[:-2], h, n)
        t = t + bias.transpose(0, 1)  # (R, H, N)
        return self._rotate(t, cos.unsqueeze(-3), sin.unsqueeze(-3))

    def _rotate(self, t: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """SISO rotates adjacent pairs (2i, 2i+1); MIMO pairs i with i + N/2 (its kernel's layout)."""
        s = cos.shape[-1]
        n = t.shape[-1]
        if not self.mimo:
            rot = t[..., : 2 * s].reshape(*t.shape[:-1], s, 2)
            t0, t1 = rot[..., 0], rot[..., 1]
            out = torch.stack([t0 * cos - t1 * sin, t0 * sin + t1 * cos], dim=-1)
            return torch.cat([out.reshape(*t.shape[:-1], 2 * s), t[..., 2 * s :]], dim=-1)
        half = n // 2
        t0, t1 = t[..., :s], t[..., half : half + s]
        out0 = t0 * cos - t1 * sin
        out1 = t0 * sin + t1 * cos
        return torch.cat([out0, t[..., s:half], out1, t[..., half + s :]], dim=-1)

    def _xr(self, v: Tensor) -> Tensor:
        """(..., H, P) -> (..., R, H, P): the per-rank inputs."""
        if not self.mimo:
            return v.unsqueeze(-3)
        return v.unsqueeze(-3) * self.mimo_x.transpose(0, 1)

    def _combine(self, yr: Tensor, z: Tensor, ops: Primitives) -> Tensor:
        """(..., R, H, P) per-rank outputs and (..., H, P) gate -> (..., H, P)."""
        cfg = self.cfg
        zr = z.unsqueeze(-3)
        if self.mimo:
            zr = zr * self.mimo_z.transpose(0, 1)
        if cfg.is_outproj_norm:
            shape = yr.shape
            yr = ops.gated_norm(
                yr.reshape(*shape[:-2], cfg.d_inner), zr.expand_as(yr).reshape(*shape[:-2], cfg.d_inner),
                self.norm.weight, cfg.mixer_norm_eps, cfg.headdim, True,
            ).reshape(shape)
        else:
            yr = yr * ops.silu(zr)
        if not self.mimo:
            return yr.squeeze(-3)
        weighted = yr * self.mimo_o.transpose(0, 1)
        out = weighted[..., 0, :, :]
        for i in range(1, weighted.shape[-3]):
            out = out + weighted[..., i, :, :]
        return out

    # --- any number of tokens --------------------------------------------------------------

    def forward(self, u: Tensor, states: States, be: Primitives) -> tuple[Tensor, States, str]:
        cfg = self.cfg
        h, p = cfg.nheads, cfg.headdim
        bsz, length, _ = u.shape
        z, x, bp, cp, dd_dt, dd_a, trap, ang = self._split(be.linear(u, self.in_proj.weight))
        a, dt = self._decay_and_dt(dd_dt, dd_a, be)  # (B, L, H)
        qn = self._normalized(cp, self.C_norm.weight, be)  # (B, L, R, G, N)
        kn = self._normalized(bp, self.B_norm.weight, be)
        v = x.reshape(bsz, length, h, p)
        yr, new_states, path = be.mamba3_scan(self, qn, kn, v, a, dt, trap, ang, states)
        y = self._combine(yr, z.reshape(bsz, length, h, p), be)
        out = be.linear(y.reshape(bsz, length, cfg.d_inner), self.out_proj.weight)
        return out, new_states, path


def mamba3_steps(m: Mamba3Mixer, qn: Tensor, kn: Tensor, v: Tensor, a: Tensor, dt: Tensor, trap: Tensor,
                 ang: Tensor, states: States, *, ops: Ops = REFERENCE_OPS) -> tuple[Tensor, States]:
    """The Mamba-3 recurrence one token at a time: the reference twin of `mamba3_chunked` (same
    arguments), with the primitives `ops`.

    Args:
        m: the layer (its biases, D and MIMO projections).
        qn, kn: (B, L, R, G, N) normalized C and B, before the bias and the rotation.
        v: (B, L, H, P) the inputs x.
        a, dt: (B, L, H) decay rate (< 0) and step size; trap, ang: the raw trapezoid gate
            (B, L, H) and angle rates (B, L, S) of the projection.
        states: (angle (B, H, S), ssm (B, H, P, N), k (B, R, H, N), v (B, H, P)).

    Returns:
        y (B, L, R, H, P), including the D skip term, and the new states.
    """
    angle, ssm, k_prev, v_prev = states
    lam = ops.sigmoid(trap)
    inc = torch.tanh(ang).unsqueeze(-2) * math.pi * dt.unsqueeze(-1)  # (B, L, H, S)
    ys = []
    for t in range(v.shape[1]):
        angle = _wrap(angle + inc[:, t])
        cos, sin = torch.cos(angle), torch.sin(angle)
        q = m._heads_rotated(qn[:, t], m.C_bias, cos, sin)  # (B, R, H, N)
        k = m._heads_rotated(kn[:, t], m.B_bias, cos, sin)
        alpha = torch.exp(a[:, t] * dt[:, t])
        beta = alpha * dt[:, t] * (1.0 - lam[:, t])
        gamma = lam[:, t] * dt[:, t]
        xr, xr_prev = m._xr(v[:, t]), m._xr(v_prev)  # (B, R, H, P)
        terms = (beta[:, None, :, None] * xr_prev).unsqueeze(-1) * k_prev.unsqueeze(-2)
        terms = terms + (gamma[:, None, :, None] * xr).unsqueeze(-1) * k.unsqueeze(-2)
        upd = terms[:, 0]
        for i in range(1, terms.shape[1]):
            upd = upd + terms[:, i]
        ssm = ops.decay_add(ssm, alpha[:, :, None, None], upd)  # (B, H, P, N)
        ys.append(ops.contract(ssm.unsqueeze(1), q.unsqueeze(-2)) + m.D[:, None] * xr)  # (B, R, H, P)
        k_prev, v_prev = k, v[:, t]
    return torch.stack(ys, dim=1), (angle, ssm, k_prev, v_prev)


def mamba3_chunked(m: Mamba3Mixer, qn: Tensor, kn: Tensor, v: Tensor, a: Tensor, dt: Tensor, trap: Tensor,
                   ang: Tensor, states: States) -> tuple[Tensor, States]:
    """The chunked backend's Mamba-3 scan (arguments and results as `mamba3_steps`)."""
    angle, h0, k_prev, v_prev = states
    cfg = m.cfg
    lam = torch.sigmoid(trap)
    inc = torch.tanh(ang).unsqueeze(-2) * math.pi * dt.unsqueeze(-1)  # (B, L, H, S)
    # Summed in float64 so that long chunks lose no angle precision before wrapping.
    theta = _wrap(angle.unsqueeze(1).double() + torch.cumsum(inc.double(), dim=1)).to(v.dtype)
    # cos and sin once for q and once for k: sharing them would reorder the training gradient's sums
    q = m._heads_rotated(qn, m.C_bias, torch.cos(theta), torch.sin(theta))  # (B, L, R, H, N)
    k = m._heads_rotated(kn, m.B_bias, torch.cos(theta), torch.sin(theta))
    xr = m._xr(v)  # (B, L, R, H, P)
    gamma = lam * dt
    delta = (1.0 - lam) * dt  # beta = alpha * delta
    # The previous token's pending term enters the state before the first decay.
    pending = (delta[:, 0, None, :, None] * m._xr(v_prev)).unsqueeze(-1) * k_prev.unsqueeze(-2)
    h_start = h0 + pending.sum(1)
    # A source j reaches i > j with weight gamma_j + delta_{j+1}, and i == j with gamma_j.
    delta_next = torch.cat([delta[:, 1:], torch.zeros_like(delta[:, :1])], dim=1)
    y, h_end = _trapezoid_chunked(q, k, xr, a * dt, gamma, gamma + delta_next, h_start, cfg.chunk_size)
    yr = y + m.D[:, None] * xr
    return yr, (theta[:, -1].contiguous(), h_end, k[:, -1].contiguous(), v[:, -1].contiguous())


def _trapezoid_chunked(
    q: Tensor, k: Tensor, xr: Tensor, log_alpha: Tensor, w_self: Tensor, w_later: Tensor,
    h0: Tensor, chunk_size: int,
) -> tuple[Tensor, Tensor]:
    """h_i = sum_{j<=i} exp(sum_{j<l<=i} log_alpha_l) w(i, j) sum_r xr_j,r k_j,r^T  + decay h0.

    w(i, j) = w_self_j when i == j, w_later_j when i > j. Outputs y_i,s = h_i q_i,s.

    Args:
        q, k: (B, L, R, H, N).
        xr: (B, L, R, H, P).
        log_alpha, w_self, w_later: (B, L, H).
        h0: (B, H, P, N).

    Returns:
        y (B, L, R, H, P) and the state after the last position (B, H, P, N).
    """
    bsz, length, r, h, n = q.shape
    p = xr.shape[-1]
    qn = min(chunk_size, length)
    pad = (-length) % qn
    if pad:
        # zero weights and zero log-decay: padded positions change nothing
        q, k, xr = (F.pad(t, (0, 0, 0, 0, 0, 0, 0, pad)) for t in (q, k, xr))
        log_alpha, w_self, w_later = (F.pad(t, (0, 0, 0, pad)) for t in (log_alpha, w_self, w_later))
    nk = (length + pad) // qn
    q = q.reshape(bsz, nk, qn, r, h, n)
    k = k.reshape(bsz, nk, qn, r, h, n)
    xr = xr.reshape(bsz, nk, qn, r, h, p)
    decay, to_end, chunk_decay, from_start = chunk_decays(log_alpha.reshape(bsz, nk, qn, h), q.dtype)
    w_self = w_self.reshape(bsz, nk, qn, h)
    w_later = w_later.reshape(bsz, nk, qn, h)

    idx = torch.arange(qn, device=q.device)
    later = idx[:, None] > idx[None, :]
    same = idx[:, None] == idx[None, :]
    wl = w_later.transpose(2, 3).unsqueeze(-2)  # (B, K, H, 1, Qj)
    ws = w_self.transpose(2, 3).unsqueeze(-2)
    weight = torch.where(later, wl, torch.where(same, ws, torch.zeros_like(ws)))
    coef = decay * weight  # (B, K, H, Qi, Qj)
    qk = torch.einsum("bkishn,bkjrhn->bkhsrij", q, k)  # (B, K, H, R, R, Qi, Qj)
    y = torch.einsum("bkhsrij,bkhij,bkjrhp->bkishp", qk, coef, xr)

    to_end = to_end * w_later  # (B, K, Q, H)
    chunk_states = torch.einsum("bkjrhp,bkjh,bkjrhn->bkhpn", xr, to_end, k)
    state = h0
    entering = []
    for i in range(nk):
        entering.append(state)
        state = chunk_decay[:, i, :, None, None] * state + chunk_states[:, i]
    h_in = torch.stack(entering, dim=1)  # (B, K, H, P, N)
    y_off = torch.einsum("bkishn,bkhpn->bkishp", q, h_in) * from_start[:, :, :, None, :, None]
    y = (y + y_off).reshape(bsz, nk * qn, r, h, p)[:, :length]
    return y, state
