"""Mamba-1 (selective scan, S6) with explicit state.

Dimension letters:
    B   batch (streams)
    L   tokens in the chunk
    D   d_model
    C   d_inner = expand * d_model (conv channels and SSM channels)
    W   d_conv
    N   d_state
    R   dt_rank

State per stream: conv (C, W) holding the last W conv inputs, newest last; ssm (C, N).
Recurrence per token: dt = softplus(W_dt r + b_dt); h = exp(dt A) h + dt x B; y = C.h + D x.
Reference for the math: mamba-ssm `selective_scan_ref` and `Mamba.step`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from scan._config import ModelConfig
from scan._mixer import Mixer, States, conv_chunk
from scan._ops import Ops, conv_taps

__all__ = ["Mamba1Mixer"]

Tensor = torch.Tensor

# Tokens whose (B, L, C, N) discretized tensors are materialized at once by `chunk`.
_SEGMENT = 128


class Mamba1Mixer(Mixer):
    chunk_path = "scan"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        c, n, r = cfg.d_inner, cfg.d_state, cfg.resolved_dt_rank
        self.in_proj = nn.Linear(cfg.d_model, 2 * c, bias=cfg.bias)
        self.conv1d = nn.Conv1d(c, c, cfg.d_conv, groups=c, bias=cfg.conv_bias, padding=cfg.d_conv - 1)
        self.x_proj = nn.Linear(c, r + 2 * n, bias=False)
        self.dt_proj = nn.Linear(r, c, bias=True)
        self.A_log = nn.Parameter(torch.empty(c, n))
        self.D = nn.Parameter(torch.empty(c))
        self.out_proj = nn.Linear(c, cfg.d_model, bias=cfg.bias)

    def state_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        c = self.cfg.d_inner
        return [("conv", (c, self.cfg.d_conv)), ("ssm", (c, self.cfg.d_state))]

    def _A(self) -> Tensor:
        return -torch.exp(self.A_log)  # (C, N)

    def step(self, u: Tensor, states: States, ops: Ops) -> tuple[Tensor, States]:
        conv, ssm = states  # (B, C, W), (B, C, N)
        c, n, r = self.cfg.d_inner, self.cfg.d_state, self.cfg.resolved_dt_rank
        xz = ops.linear(u, self.in_proj.weight, self.in_proj.bias)  # (B, 2C)
        x, z = xz[:, :c], xz[:, c:]
        window = torch.cat([conv[:, :, 1:], x.unsqueeze(-1)], dim=-1)  # (B, C, W)
        xc = ops.silu(conv_taps(window, self.conv1d.weight[:, 0, :], self.conv1d.bias))
        x_dbl = ops.linear(xc, self.x_proj.weight)  # (B, R + 2N)
        dt_r, b, cc = x_dbl[:, :r], x_dbl[:, r : r + n], x_dbl[:, r + n :]
        dt = ops.softplus(ops.linear(dt_r, self.dt_proj.weight, self.dt_proj.bias))  # (B, C)
        d_a = torch.exp(dt.unsqueeze(-1) * self._A())  # (B, C, N)
        h = ops.decay_add(ssm, d_a, (dt * xc).unsqueeze(-1) * b.unsqueeze(1))
        y = ops.contract(h, cc.unsqueeze(1)) + self.D * xc  # (B, C)
        y = y * ops.silu(z)
        out = ops.linear(y, self.out_proj.weight, self.out_proj.bias)
        return out, (window, h)

    def chunk(self, u: Tensor, states: States) -> tuple[Tensor, States]:
        conv, h = states
        c, n, r = self.cfg.d_inner, self.cfg.d_state, self.cfg.resolved_dt_rank
        xz = F.linear(u, self.in_proj.weight, self.in_proj.bias)  # (B, L, 2C)
        x, z = xz[..., :c], xz[..., c:]
        xc, new_conv = conv_chunk(conv, x, self.conv1d.weight, self.conv1d.bias)
        xc = F.silu(xc)  # (B, L, C)
        x_dbl = F.linear(xc, self.x_proj.weight)
        dt_r, b, cc = x_dbl[..., :r], x_dbl[..., r : r + n], x_dbl[..., r + n :]
        dt = F.softplus(F.linear(dt_r, self.dt_proj.weight) + self.dt_proj.bias)  # (B, L, C)
        a = self._A()
        dtx = dt * xc
        ys = []
        for s in range(0, u.shape[1], _SEGMENT):
            e = s + _SEGMENT
            d_a = torch.exp(dt[:, s:e].unsqueeze(-1) * a)  # (B, l, C, N)
            d_bx = dtx[:, s:e].unsqueeze(-1) * b[:, s:e].unsqueeze(2)  # (B, l, C, N)
            if torch.is_grad_enabled():
                # training: autograd cannot see through out=, and unbind keeps the backward of
                # per-token slices from materializing a segment-sized gradient for each token
                steps = []
                for d_bx_t, d_a_t in zip(d_bx.unbind(1), d_a.unbind(1)):
                    h = torch.addcmul(d_bx_t, d_a_t, h)
                    steps.append(h)
                hs = torch.stack(steps, dim=1)
            else:
                hs = torch.empty_like(d_a)
                for t in range(d_a.shape[1]):
                    h = torch.addcmul(d_bx[:, t], d_a[:, t], h, out=hs[:, t])
            ys.append(torch.matmul(hs, cc[:, s:e].unsqueeze(-1)).squeeze(-1))  # (B, l, C)
        y = (torch.cat(ys, dim=1) + self.D * xc) * F.silu(z)
        out = F.linear(y, self.out_proj.weight, self.out_proj.bias)
        return out, (new_conv, h.clone())
