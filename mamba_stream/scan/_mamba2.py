"""Mamba-2 (SSD: scalar decay per head) with explicit state.

Dimension letters:
    B   batch (streams)
    L   tokens in the chunk
    T   L rounded up to a multiple of Q
    Q   chunk_size of the chunked algorithm
    K   number of chunks, T / Q
    D   d_model
    E   d_ssm (channels that go through the SSM; d_inner unless a gated-MLP part is configured)
    C   conv channels, E + 2 * G * N
    W   d_conv
    H   heads, E / P
    P   headdim
    G   ngroups (B and C are shared by the H / G heads of a group)
    N   d_state

State per stream: conv (C, W), newest input last; ssm (H, P, N).
Recurrence per token and head: dt = clamp(softplus(dt_raw + dt_bias)); h = exp(dt A) h + dt x B^T;
y = h C + D x. Reference for the math: mamba-ssm `Mamba2.step`, `ssd_minimal_discrete`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._mixer import Mixer, States
from mamba_stream.scan._ops import REFERENCE_OPS, Ops, Primitives, chunk_decays

__all__ = ["Mamba2Mixer", "ssd_chunked", "ssd_steps"]

Tensor = torch.Tensor


class _GatedNorm(nn.Module):
    """Holds `norm.weight` under mamba-ssm's name; the math is the backend's `gated_norm`."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Mamba2Mixer(Mixer):
    chunk_path = "ssd"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        e, g, n, h = cfg.resolved_d_ssm, cfg.ngroups, cfg.d_state, cfg.nheads
        d_in_proj = 2 * cfg.d_inner + 2 * g * n + h
        self.in_proj = nn.Linear(cfg.d_model, d_in_proj, bias=cfg.bias)
        self.conv1d = nn.Conv1d(
            cfg.conv_dim, cfg.conv_dim, cfg.d_conv, groups=cfg.conv_dim, bias=cfg.conv_bias,
            padding=cfg.d_conv - 1,
        )
        self.dt_bias = nn.Parameter(torch.empty(h))
        self.A_log = nn.Parameter(torch.empty(h))
        self.D = nn.Parameter(torch.empty(e if cfg.D_has_hdim else h))
        if cfg.rmsnorm:
            self.norm = _GatedNorm(e)
        self.out_proj = nn.Linear(cfg.d_inner, cfg.d_model, bias=cfg.bias)
        # Falcon-H1's in_proj multipliers as one vector per (dtype, device): a config value, not a
        # tensor of the checkpoint (transformers derives its mup_vector and saves none)
        self._mup_cache: dict[tuple[torch.dtype, torch.device], Tensor] = {}

    def state_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        cfg = self.cfg
        return [
            ("conv", (cfg.conv_dim, cfg.d_conv)),
            ("ssm", (cfg.nheads, cfg.headdim, cfg.d_state)),
        ]

    # --- pieces shared by step and chunk ---------------------------------------------------

    def _split(self, zxbcdt: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        cfg = self.cfg
        d_mlp = cfg.d_inner - cfg.resolved_d_ssm
        sizes = [d_mlp, d_mlp, cfg.resolved_d_ssm, cfg.conv_dim, cfg.nheads]
        z0, x0, z, xbc, dt = torch.split(zxbcdt, sizes, dim=-1)
        return z0, x0, z, xbc, dt

    def _dt(self, dt_raw: Tensor, ops: Primitives) -> Tensor:
        dt = ops.softplus(dt_raw + self.dt_bias)
        if self.cfg.dt_min_clamp > 0.0 or self.cfg.dt_max_clamp is not None:
            dt = torch.clamp(dt, min=self.cfg.dt_min_clamp, max=self.cfg.dt_max_clamp)
        return dt

    def _mup(self, like: Tensor) -> Tensor:
        """Falcon-H1's mup_vector (`ssm_multipliers`: z, x, B, C, dt) over the in_proj output's
        columns, in `like`'s dtype: each column's multiplier rounded to it, as transformers' float32
        vector holds it; the gated-MLP columns (none in Falcon-H1) * 1.0."""
        key = (like.dtype, like.device)
        if key not in self._mup_cache:
            cfg = self.cfg
            assert cfg.ssm_multipliers is not None
            mz, mx, mb, mc, mdt = cfg.ssm_multipliers
            gn, d_mlp = cfg.ngroups * cfg.d_state, cfg.d_inner - cfg.resolved_d_ssm
            parts = [(2 * d_mlp, 1.0), (cfg.resolved_d_ssm, mz), (cfg.resolved_d_ssm, mx), (gn, mb), (gn, mc),
                     (cfg.nheads, mdt)]
            self._mup_cache[key] = torch.cat([torch.full((n,), m, dtype=like.dtype, device=like.device)
                                              for n, m in parts])
        return self._mup_cache[key]

    def _D(self) -> Tensor:
        """D broadcastable against (..., H, P)."""
        cfg = self.cfg
        if cfg.D_has_hdim:
            return self.D.reshape(cfg.nheads, cfg.headdim)
        return self.D.unsqueeze(-1)

    def _finish(self, y: Tensor, z: Tensor, z0: Tensor, x0: Tensor, ops: Primitives) -> Tensor:
        """Gate / norm, gated-MLP part, out_proj. y: (..., E)."""
        cfg = self.cfg
        if cfg.rmsnorm:
            y = ops.gated_norm(y, z, self.norm.weight, cfg.mixer_norm_eps, cfg.resolved_d_ssm // cfg.ngroups,
                               cfg.norm_before_gate)
        else:
            y = y * ops.silu(z)
        if z0.shape[-1] > 0:
            y = torch.cat([ops.silu(z0) * x0, y], dim=-1)
        return ops.linear(y, self.out_proj.weight, self.out_proj.bias)

    # --- any number of tokens --------------------------------------------------------------

    def forward(self, u: Tensor, states: States, be: Primitives) -> tuple[Tensor, States, str]:
        conv, ssm = states  # (B, C, W), (B, H, P, N)
        cfg = self.cfg
        e, g, n, h, p = cfg.resolved_d_ssm, cfg.ngroups, cfg.d_state, cfg.nheads, cfg.headdim
        bsz, length, _ = u.shape
        zxbcdt = be.linear(u, self.in_proj.weight, self.in_proj.bias)
        if cfg.ssm_multipliers is not None:  # Falcon-H1: one exact product per element, before the conv
            zxbcdt = zxbcdt * self._mup(zxbcdt)
        z0, x0, z, xbc, dt_raw = self._split(zxbcdt)
        xbc, new_conv = be.conv(conv, xbc, self.conv1d.weight, self.conv1d.bias)
        xbc = be.silu(xbc)
        x = xbc[..., :e].reshape(bsz, length, h, p)
        b = xbc[..., e : e + g * n].reshape(bsz, length, g, n)
        c = xbc[..., e + g * n :].reshape(bsz, length, g, n)
        dt = self._dt(dt_raw, be)
        y, new_ssm, path = be.ssd(x, dt, -be.exp(self.A_log), b, c, ssm, cfg.chunk_size)
        y = y + self._D() * x
        out = self._finish(y.reshape(bsz, length, e), z, z0, x0, be)
        return out, (new_conv, new_ssm), path


def ssd_steps(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor, chunk_size: int = 0, *,
              ops: Ops = REFERENCE_OPS) -> tuple[Tensor, Tensor]:
    """The SSD recurrence one token at a time: the reference twin of `ssd_chunked` (same arguments;
    `chunk_size` has no meaning here), decaying and contracting with the primitives `ops`.

    Per token and head: h = exp(dt a) h + dt x b^T; y = h c.
    """
    bsz, length, h, p = x.shape
    g, n = b.shape[2], b.shape[3]
    hg = h // g
    state, ys = h0, []
    for t in range(length):
        d_a = torch.exp(dt[:, t] * a)  # (B, H)
        # heads of a group are contiguous: view (B, H, ...) as (B, G, H/G, ...)
        dtx = (dt[:, t].unsqueeze(-1) * x[:, t]).reshape(bsz, g, hg, p, 1)
        bt = b[:, t].reshape(bsz, g, 1, n)
        state = ops.decay_add(state, d_a[:, :, None, None], (dtx * bt.unsqueeze(3)).reshape(bsz, h, p, n))
        # a group's heads share c: one (H/G * P, N) mat-vec per group rather than one per head
        ys.append(ops.contract(state.reshape(bsz, g, hg * p, n), c[:, t].reshape(bsz, g, 1, n)).reshape(bsz, h, p))
    return torch.stack(ys, dim=1), state


def ssd_chunked(
    x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor]:
    """The SSD scan in chunked (quadratic within a chunk, recurrent across chunks) form.

    Args:
        x: (B, L, H, P).
        dt: (B, L, H) after softplus.
        a: (H,) negative decay rates.
        b, c: (B, L, G, N).
        h0: (B, H, P, N) state before the chunk.
        chunk_size: Q.

    Returns:
        y (B, L, H, P) without the D skip term, and the final state (B, H, P, N).
    """
    bsz, length, h, p = x.shape
    g, n = b.shape[2], b.shape[3]
    hg = h // g
    q = min(chunk_size, length)
    pad = (-length) % q
    if pad:
        # dt = 0 makes a padded position neither decay the state nor feed it
        x, dt, b, c = (F.pad(t, (0,) * (2 * (t.dim() - 2)) + (0, pad)) for t in (x, dt, b, c))
    k = (length + pad) // q
    x = x.reshape(bsz, k, q, g, hg, p)
    dt = dt.reshape(bsz, k, q, g, hg)
    b = b.reshape(bsz, k, q, g, n)
    c = c.reshape(bsz, k, q, g, n)

    decay, decay_to_end, chunk_decay, from_start = chunk_decays(dt * a.reshape(g, hg), x.dtype)
    xdt = x * dt.unsqueeze(-1)
    cb = torch.einsum("bkign,bkjgn->bkgij", c, b)  # (B, K, G, Qi, Qj)
    scores = cb.unsqueeze(3) * decay  # (B, K, G, Hg, Qi, Qj)
    y = torch.einsum("bkghij,bkjghp->bkighp", scores, xdt)

    chunk_states = torch.einsum("bkjghp,bkjgh,bkjgn->bkghpn", xdt, decay_to_end, b)

    state = h0.reshape(bsz, g, hg, p, n)
    entering = []
    for i in range(k):
        entering.append(state)
        state = chunk_decay[:, i, :, :, None, None] * state + chunk_states[:, i]
    h_in = torch.stack(entering, dim=1)  # (B, K, G, Hg, P, N)
    y_off = torch.einsum("bkign,bkghpn->bkighp", c, h_in) * from_start.unsqueeze(-1)
    y = (y + y_off).reshape(bsz, k * q, h, p)[:, :length]
    return y, state.reshape(bsz, h, p, n)
