"""The triton backend: mamba-ssm's Triton kernels on CUDA, imported lazily.

Dimension letters as in the mixer modules: B batch, L tokens, D d_model, H heads, P headdim,
G groups, N d_state, S rotary angles, C conv channels.

What runs (recorded as the result's path):
    Mamba-2  chunk: `mamba_chunk_scan_combined(initial_states, return_final_states)`  "fused-ssd"
             token: `selective_state_update`                                          "step-kernel"
             (a dt clamp is not supported by the step kernel: the torch step runs,      "torch-step")
    Mamba-3  SISO chunk: `mamba3_siso_combined(Input_States, return_final_states)`     "fused-siso"
             SISO token: `mamba3_siso_step`                                            "step-kernel"
             MIMO: the torch paths (the MIMO kernels take no initial state)            "torch-ssd"/"torch-step"
    Mamba-1  token: `selective_state_update`                                           "step-kernel"
             chunk: the CUDA selective scan has no initial state, so the torch scan
             of the chunked backend runs on the GPU                                    "torch-scan"

The conv, projections and norms are ours (torch); only the scans are kernels. States stay in
float32 (or the schema's dtype): kernel outputs are cast back, and input states are never
written (the in-place step kernel gets a copy).
"""

from __future__ import annotations

import functools
import importlib
import sys
import types
from typing import Any

import torch
import torch.nn.functional as F

from scan._mamba1 import Mamba1Mixer
from scan._mamba2 import Mamba2Mixer
from scan._mamba3 import Mamba3Mixer, _wrap
from scan._mixer import Mixer, States, conv_chunk
from scan._ops import NATIVE_OPS, conv_taps, gated_rms_norm, rms_normalize

__all__ = ["TRITON_CHUNK", "chunk", "step", "unavailable_reason"]

Tensor = torch.Tensor

#: block length handed to the chunk-scan kernels (their tuned default; no effect on results' meaning)
TRITON_CHUNK = 256
MAMBA3_CHUNK = 64


def _install_cuda_stub() -> None:
    """mamba-ssm's package __init__ imports its compiled selective-scan extension, which a
    pure-Python build lacks; the Triton kernels never call it, so a stub that fails loudly on use
    lets them import."""
    try:
        importlib.import_module("selective_scan_cuda")
    except ImportError:
        stub = types.ModuleType("selective_scan_cuda")

        def _missing(name: str) -> Any:
            raise ImportError("mamba-ssm was built without its CUDA selective scan (MAMBA_SKIP_CUDA_BUILD)")

        stub.__getattr__ = _missing  # type: ignore[attr-defined]
        sys.modules["selective_scan_cuda"] = stub


@functools.cache
def _kernels() -> types.SimpleNamespace:
    _install_cuda_stub()
    from mamba_ssm.ops.triton.mamba3.mamba3_siso_combined import mamba3_siso_combined
    from mamba_ssm.ops.triton.mamba3.mamba3_siso_step import mamba3_siso_step
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined

    return types.SimpleNamespace(
        chunk_scan=mamba_chunk_scan_combined, state_update=selective_state_update,
        siso_combined=mamba3_siso_combined, siso_step=mamba3_siso_step,
    )


def unavailable_reason(device: torch.device) -> str | None:
    """Why the triton backend cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return f"the triton backend runs on CUDA devices; the model is on {device}"
    if not torch.cuda.is_available():
        return "CUDA is not available"
    try:
        _kernels()
    except Exception as exc:  # noqa: BLE001 - any import failure means the kernels cannot run
        return f"mamba-ssm's Triton kernels cannot be imported: {exc}"
    return None


# --- Mamba-2 -----------------------------------------------------------------------------------


def _m2_D(m: Mamba2Mixer) -> Tensor:
    cfg = m.cfg
    return m.D.float().reshape(cfg.nheads, cfg.headdim) if cfg.D_has_hdim else m.D.float()


def _m2_chunk(m: Mamba2Mixer, u: Tensor, states: States) -> tuple[Tensor, States, str]:
    conv, ssm = states
    cfg = m.cfg
    e, g, n, h, p = cfg.resolved_d_ssm, cfg.ngroups, cfg.d_state, cfg.nheads, cfg.headdim
    bsz, length, _ = u.shape
    z0, x0, z, xbc, dt = m._split(F.linear(u, m.in_proj.weight, m.in_proj.bias))
    xbc, new_conv = conv_chunk(conv, xbc, m.conv1d.weight, m.conv1d.bias)
    xbc = F.silu(xbc)
    x = xbc[..., :e].reshape(bsz, length, h, p)
    b = xbc[..., e : e + g * n].reshape(bsz, length, g, n)
    c = xbc[..., e + g * n :].reshape(bsz, length, g, n)
    limit = (cfg.dt_min_clamp, cfg.dt_max_clamp if cfg.dt_max_clamp is not None else float("inf"))
    y, final = _kernels().chunk_scan(
        x, dt, -torch.exp(m.A_log.float()), b, c, TRITON_CHUNK, D=_m2_D(m), z=None, dt_bias=m.dt_bias.float(),
        initial_states=ssm.float(), dt_softplus=True, dt_limit=limit, return_final_states=True,
    )
    out = m._finish(y.reshape(bsz, length, e).to(u.dtype), z, z0, x0, NATIVE_OPS)
    return out, (new_conv, final.to(ssm.dtype)), "fused-ssd"


def _m2_step(m: Mamba2Mixer, u: Tensor, states: States) -> tuple[Tensor, States, str]:
    cfg = m.cfg
    if cfg.dt_min_clamp > 0.0 or cfg.dt_max_clamp is not None:
        out, new = m.step(u, states, NATIVE_OPS)
        return out, new, "torch-step"
    conv, ssm = states
    e, g, n, h, p = cfg.resolved_d_ssm, cfg.ngroups, cfg.d_state, cfg.nheads, cfg.headdim
    z0, x0, z, xbc, dt = m._split(F.linear(u, m.in_proj.weight, m.in_proj.bias))
    window = torch.cat([conv[:, :, 1:], xbc.unsqueeze(-1)], dim=-1)
    xbc = F.silu(conv_taps(window, m.conv1d.weight[:, 0, :], m.conv1d.bias))
    x = xbc[:, :e].reshape(-1, h, p)
    b = xbc[:, e : e + g * n].reshape(-1, g, n)
    c = xbc[:, e + g * n :].reshape(-1, g, n)
    a = (-torch.exp(m.A_log.float()))[:, None, None].expand(h, p, n)
    D = _m2_D(m)
    D = D if D.dim() == 2 else D[:, None].expand(h, p)
    new_ssm = ssm.float().clone()  # the kernel updates in place; the input state is never written
    y = _kernels().state_update(
        new_ssm, x, dt[:, :, None].expand(-1, h, p), a, b, c, D=D, z=None,
        dt_bias=m.dt_bias.float()[:, None].expand(h, p), dt_softplus=True,
    )
    out = m._finish(y.reshape(-1, e).to(u.dtype), z, z0, x0, NATIVE_OPS)
    return out, (window, new_ssm.to(ssm.dtype)), "step-kernel"


# --- Mamba-1 -----------------------------------------------------------------------------------


def _m1_step(m: Mamba1Mixer, u: Tensor, states: States) -> tuple[Tensor, States, str]:
    conv, ssm = states
    cfg = m.cfg
    c, n, r = cfg.d_inner, cfg.d_state, cfg.resolved_dt_rank
    xz = F.linear(u, m.in_proj.weight, m.in_proj.bias)
    x, z = xz[:, :c], xz[:, c:]
    window = torch.cat([conv[:, :, 1:], x.unsqueeze(-1)], dim=-1)
    xc = F.silu(conv_taps(window, m.conv1d.weight[:, 0, :], m.conv1d.bias))
    x_dbl = F.linear(xc, m.x_proj.weight)
    dt_r, b, cc = x_dbl[:, :r], x_dbl[:, r : r + n], x_dbl[:, r + n :]
    dt = F.linear(dt_r, m.dt_proj.weight)
    new_ssm = ssm.float().clone()
    y = _kernels().state_update(
        new_ssm, xc, dt, -torch.exp(m.A_log.float()), b, cc, D=m.D.float(), z=z,
        dt_bias=m.dt_proj.bias.float(), dt_softplus=True,
    )
    out = F.linear(y.to(u.dtype), m.out_proj.weight, m.out_proj.bias)
    return out, (window, new_ssm.to(ssm.dtype)), "step-kernel"


# --- Mamba-3 (SISO) ----------------------------------------------------------------------------


def _m3_inputs(m: Mamba3Mixer, proj: Tensor):
    """Kernel inputs from the projection: B/C normalized per group (the kernels add the biases
    and rotate), decay, dt and the raw trap and angle rates."""
    cfg = m.cfg
    g, n = cfg.ngroups, cfg.d_state
    z, x, bp, cp, dd_dt, dd_a, trap, ang = m._split(proj)
    a = torch.clamp(-F.softplus(dd_a.float()), max=-cfg.A_floor)
    dt = F.softplus(dd_dt.float() + m.dt_bias.float())
    k = rms_normalize(bp.reshape(*bp.shape[:-1], g, n), cfg.mixer_norm_eps) * m.B_norm.weight
    q = rms_normalize(cp.reshape(*cp.shape[:-1], g, n), cfg.mixer_norm_eps) * m.C_norm.weight
    return z, x, q, k, a, dt, trap, ang


def _m3_finish(m: Mamba3Mixer, y: Tensor, z: Tensor, dtype: torch.dtype) -> Tensor:
    cfg = m.cfg
    y = y.reshape(*y.shape[:-2], cfg.d_inner).to(dtype)
    if cfg.is_outproj_norm:
        y = gated_rms_norm(y, z, m.norm.weight, cfg.mixer_norm_eps, cfg.headdim, True, NATIVE_OPS.silu)
    return F.linear(y, m.out_proj.weight)


def _m3_chunk(m: Mamba3Mixer, u: Tensor, states: States) -> tuple[Tensor, States, str]:
    if m.mimo:
        out, new = m.chunk(u, states)
        return out, new, "torch-ssd"
    angle, ssm, k_prev, v_prev = states
    cfg = m.cfg
    h, p, s = cfg.nheads, cfg.headdim, cfg.n_angles
    bsz, length, _ = u.shape
    z, x, q, k, a, dt, trap, ang = _m3_inputs(m, F.linear(u, m.in_proj.weight))
    y, fa, fs, fk, fv = _kernels().siso_combined(
        Q=q, K=k, V=x.reshape(bsz, length, h, p), ADT=(a * dt).transpose(1, 2).contiguous(),
        DT=dt.transpose(1, 2).contiguous(), Trap=trap.transpose(1, 2).contiguous(),
        Q_bias=m.C_bias[:, 0, :].float(), K_bias=m.B_bias[:, 0, :].float(),
        Angles=ang.unsqueeze(-2).expand(bsz, length, h, s).float(), D=m.D.float(),
        Z=None if cfg.is_outproj_norm else z.reshape(bsz, length, h, p),
        Input_States=(angle.float(), ssm.float(), k_prev[:, 0].float(), v_prev.float()),
        chunk_size=MAMBA3_CHUNK, return_final_states=True,
    )
    out = _m3_finish(m, y, z, u.dtype)
    st_dtype = ssm.dtype
    return out, (_wrap(fa.float()).to(st_dtype), fs.to(st_dtype), fk.unsqueeze(1).to(st_dtype),
                 fv.to(st_dtype)), "fused-siso"


def _m3_step(m: Mamba3Mixer, u: Tensor, states: States) -> tuple[Tensor, States, str]:
    if m.mimo:
        out, new = m.step(u, states, NATIVE_OPS)
        return out, new, "torch-step"
    angle, ssm, k_prev, v_prev = states
    cfg = m.cfg
    h, p, s = cfg.nheads, cfg.headdim, cfg.n_angles
    z, x, q, k, a, dt, trap, ang = _m3_inputs(m, F.linear(u, m.in_proj.weight))
    y, (fa, fs, fk, fv) = _kernels().siso_step(
        q, k, x.reshape(-1, h, p), a * dt, dt, trap, m.C_bias[:, 0, :].float(), m.B_bias[:, 0, :].float(),
        ang.unsqueeze(-2).expand(-1, h, s).float(), D=m.D.float(),
        Z=None if cfg.is_outproj_norm else z.reshape(-1, h, p),
        Input_States=(angle.float(), ssm.float(), k_prev[:, 0].float(), v_prev.float()),
    )
    out = _m3_finish(m, y, z, u.dtype)
    st_dtype = ssm.dtype
    return out, (fa.to(st_dtype), fs.to(st_dtype), fk.unsqueeze(1).to(st_dtype), fv.to(st_dtype)), "step-kernel"


# --- dispatch ----------------------------------------------------------------------------------


def step(mixer: Mixer, u: Tensor, states: States) -> tuple[Tensor, States, str]:
    """One token per stream through the kernels. u: (B, D)."""
    if isinstance(mixer, Mamba2Mixer):
        return _m2_step(mixer, u, states)
    if isinstance(mixer, Mamba3Mixer):
        return _m3_step(mixer, u, states)
    return _m1_step(mixer, u, states)  # type: ignore[arg-type]


def chunk(mixer: Mixer, u: Tensor, states: States) -> tuple[Tensor, States, str]:
    """L >= 1 tokens per stream (the chunk kernels must never see L = 0). u: (B, L, D)."""
    assert u.shape[1] > 0
    if isinstance(mixer, Mamba2Mixer):
        return _m2_chunk(mixer, u, states)
    if isinstance(mixer, Mamba3Mixer):
        return _m3_chunk(mixer, u, states)
    out, new = mixer.chunk(u, states)
    return out, new, "torch-scan"
