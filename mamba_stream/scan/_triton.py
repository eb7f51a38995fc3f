"""The triton backend: the chunked backend's primitives, with mamba-ssm's Triton kernels as the scans.

Dimension letters as in the mixer modules: B batch, L tokens, H heads, P headdim, G groups,
N d_state, S rotary angles, C channels.

What runs (recorded as the result's path):
    Mamba-2  chunk: `mamba_chunk_scan_combined(initial_states, return_final_states)`  "fused-ssd"
             token: `selective_state_update`                                          "step-kernel"
    Mamba-3  SISO chunk: `mamba3_siso_combined(Input_States, return_final_states)`     "fused-siso"
             SISO token: `mamba3_siso_step`                                            "step-kernel"
             MIMO: the torch scans (the MIMO kernels take no initial state)            "torch-ssd"/"torch-step"
    Mamba-1  token: `selective_state_update`                                           "step-kernel"
             chunk: the CUDA selective scan has no initial state, so the torch scan
             of the chunked backend runs on the GPU                                    "torch-scan"
    attention  refused (`UnsupportedBackend`): no Triton attention kernel is wired; RoPE is the
               chunked backend's (torch's cos/sin)

Everything around the scans (projections, conv, dt and its clamp, D, gates, norms) is the
mixers' own code with the chunked backend's primitives; the kernels get dt after softplus and
clamp, and neither D nor the gate (Mamba-3's kernels add D). States stay in the schema's dtype:
kernel outputs are cast back, and input states are never written (the in-place step kernel
gets a copy).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import types
from typing import Any

import torch

from mamba_stream.scan._attention import attention_unsupported
from mamba_stream.scan._backends import CHUNK_PRIMITIVES, ChunkedBackend, labelled, step_primitives
from mamba_stream.scan._mamba1 import selective_scan_chunked
from mamba_stream.scan._mamba3 import Mamba3Mixer, _wrap, mamba3_chunked, mamba3_steps
from mamba_stream.scan._mixer import States
from mamba_stream.scan._ops import NATIVE_OPS

__all__ = ["MAMBA3_CHUNK", "TRITON", "TRITON_CHUNK", "unavailable_reason"]

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


def _ssd_chunk(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor,
               chunk_size: int) -> tuple[Tensor, Tensor, str]:
    y, final = _kernels().chunk_scan(
        x, dt, a.float(), b, c, TRITON_CHUNK, D=None, z=None, dt_bias=None, initial_states=h0.float(),
        dt_softplus=False, return_final_states=True,
    )
    return y.to(x.dtype), final.to(h0.dtype), "fused-ssd"


def _ssd_step(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor,
              chunk_size: int) -> tuple[Tensor, Tensor, str]:
    h, p, n = h0.shape[1], h0.shape[2], h0.shape[3]
    new = h0.float().clone()  # the kernel updates in place; the input state is never written
    y = _kernels().state_update(
        new, x[:, 0], dt[:, 0, :, None].expand(-1, h, p), a.float()[:, None, None].expand(h, p, n),
        b[:, 0], c[:, 0], D=None, z=None, dt_bias=None, dt_softplus=False,
    )
    return y.unsqueeze(1).to(x.dtype), new.to(h0.dtype), "step-kernel"


# --- Mamba-1 -----------------------------------------------------------------------------------


def _selective_step(dt: Tensor, a: Tensor, x: Tensor, b: Tensor, cc: Tensor, h0: Tensor) -> tuple[Tensor, Tensor, str]:
    new = h0.float().clone()
    y = _kernels().state_update(new, x[:, 0], dt[:, 0], a.float(), b[:, 0], cc[:, 0], D=None, z=None,
                                dt_bias=None, dt_softplus=False)
    return y.unsqueeze(1).to(x.dtype), new.to(h0.dtype), "step-kernel"


# --- Mamba-3 (SISO) ----------------------------------------------------------------------------


def _siso_inputs(m: Mamba3Mixer, ang: Tensor) -> dict[str, Any]:
    h, s = m.cfg.nheads, m.cfg.n_angles
    return dict(Q_bias=m.C_bias[:, 0, :].float(), K_bias=m.B_bias[:, 0, :].float(),
                Angles=ang.unsqueeze(-2).expand(*ang.shape[:-1], h, s).float(), D=m.D.float(), Z=None)


def _states_in(states: States) -> tuple[Tensor, ...]:
    angle, ssm, k_prev, v_prev = states
    return angle.float(), ssm.float(), k_prev[:, 0].float(), v_prev.float()


def _mamba3_chunk(m: Mamba3Mixer, qn: Tensor, kn: Tensor, v: Tensor, a: Tensor, dt: Tensor, trap: Tensor,
                  ang: Tensor, states: States) -> tuple[Tensor, States, str]:
    if m.mimo:
        y, new = mamba3_chunked(m, qn, kn, v, a, dt, trap, ang, states)
        return y, new, "torch-ssd"
    y, fa, fs, fk, fv = _kernels().siso_combined(
        Q=qn[:, :, 0], K=kn[:, :, 0], V=v, ADT=(a * dt).transpose(1, 2).contiguous(),
        DT=dt.transpose(1, 2).contiguous(), Trap=trap.transpose(1, 2).contiguous(),
        **_siso_inputs(m, ang), Input_States=_states_in(states), chunk_size=MAMBA3_CHUNK,
        return_final_states=True,
    )
    dtype = states[1].dtype
    return y.unsqueeze(2).to(v.dtype), (_wrap(fa.float()).to(dtype), fs.to(dtype), fk.unsqueeze(1).to(dtype),
                                        fv.to(dtype)), "fused-siso"


def _mamba3_step(m: Mamba3Mixer, qn: Tensor, kn: Tensor, v: Tensor, a: Tensor, dt: Tensor, trap: Tensor,
                 ang: Tensor, states: States) -> tuple[Tensor, States, str]:
    if m.mimo:
        y, new = mamba3_steps(m, qn, kn, v, a, dt, trap, ang, states, ops=NATIVE_OPS)
        return y, new, "torch-step"
    y, (fa, fs, fk, fv) = _kernels().siso_step(
        qn[:, 0, 0], kn[:, 0, 0], v[:, 0], a[:, 0] * dt[:, 0], dt[:, 0], trap[:, 0],
        **_siso_inputs(m, ang[:, 0]), Input_States=_states_in(states),
    )
    dtype = states[1].dtype
    return y[:, None, None].to(v.dtype), (fa.to(dtype), fs.to(dtype), fk.unsqueeze(1).to(dtype),
                                          fv.to(dtype)), "step-kernel"


TRITON = ChunkedBackend(
    "triton",
    step=dataclasses.replace(step_primitives(NATIVE_OPS, "step"), name="triton", ssd=_ssd_step,
                             selective_scan=_selective_step, mamba3_scan=_mamba3_step,
                             attention=attention_unsupported("triton")),
    chunk=dataclasses.replace(CHUNK_PRIMITIVES, name="triton", ssd=_ssd_chunk,
                              selective_scan=labelled(selective_scan_chunked, "torch-scan"),
                              mamba3_scan=_mamba3_chunk, attention=attention_unsupported("triton")),
)
