"""The exact arithmetic as a model's primitives, on the kernels or on the twins, and the kernels' backend.

`exact_primitives(ops, path)` turns a kernel object (`_kernels._Kernels`) or the twins
(`TWIN_OPS`, `TWIN_OPS_FMA`) into the `Primitives` a mixer's forward calls: the same code over
either, so the same bits, each result labelled with the path that computed it ("exact" or
"exact-twin": the path that ran is recorded, never a silent fallback). `_KernelBackend` runs the
kernels' primitives with torch's threads off, and a Mamba-1 or Mamba-2 decode step in one call.

Separate because this is where the ops become a model's arithmetic (the Mamba-3 scan is composed
here of the unary, angle and trapezoid ops; attention and RoPE of the product and the unary ops,
in `_attention`), apart from any one op.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch

from mamba_stream.scan._backends import FixedBackend, RoundState, labelled
from mamba_stream.scan._mamba1 import Mamba1Mixer
from mamba_stream.scan._mamba2 import Mamba2Mixer
from mamba_stream.scan._mamba3 import Mamba3Mixer
from mamba_stream.scan._mixer import States
from mamba_stream.scan._ops import Primitives
from mamba_stream.scan.exact._attention import attention as exact_attention
from mamba_stream.scan.exact._attention import rope as exact_rope
from mamba_stream.scan.exact._kernels import TWIN_OPS, TWIN_OPS_FMA, _kernel_ops
from mamba_stream.scan.exact._threading import _torch_threads_off

Tensor = torch.Tensor


def exact_primitives(ops: Any, path: str, *, in_place: bool = False) -> Primitives:
    """The exact arithmetic, computed by `ops` (the kernels or the twins).

    `in_place`: the conv and the Mamba-1/2 scans write the new state over the state they are
    given and return it (`*_into`), for a caller that steps states where they live (the slot
    table's decode step: no copy-back) and owns them; the same bits either way. Mamba-3's
    states are written anew.
    """
    conv = ops.conv_into if in_place else ops.conv
    scan_ssd = ops.ssd_into if in_place else ops.ssd
    scan_selective = ops.selective_scan_into if in_place else ops.selective_scan

    def silu(x: Tensor) -> Tensor:
        return ops.unary(x, "silu")

    def sigmoid(x: Tensor) -> Tensor:
        return ops.unary(x, "sigmoid")

    def softplus(x: Tensor) -> Tensor:
        return ops.unary(x, "softplus")

    def selective_scan(dt: Tensor, a: Tensor, x: Tensor, b: Tensor, cc: Tensor, h0: Tensor) -> tuple[Tensor, Tensor]:
        return scan_selective(dt, a.t().contiguous(), x, b, cc, h0)

    def ssd(x: Tensor, dt: Tensor, a: Tensor, b: Tensor, c: Tensor, h0: Tensor, chunk_size: int = 0
            ) -> tuple[Tensor, Tensor]:
        return scan_ssd(x, dt, a, b, c, h0)

    def mamba3(m: Mamba3Mixer, qn: Tensor, kn: Tensor, v: Tensor, a: Tensor, dt: Tensor, trap: Tensor,
               ang: Tensor, states: States) -> tuple[Tensor, States]:
        angle, ssm, k_prev, v_prev = states
        lam = ops.unary(trap, "sigmoid")
        inc = ops.unary(ang, "tanh").unsqueeze(-2) * math.pi * dt.unsqueeze(-1)  # (B, L, H, S)
        theta, angle_end = ops.angle(inc, angle)
        cos, sin = ops.unary(theta, "cos"), ops.unary(theta, "sin")
        q = m._heads_rotated(qn, m.C_bias, cos, sin)  # (B, L, R, H, N)
        k = m._heads_rotated(kn, m.B_bias, cos, sin)
        alpha = ops.unary(a * dt, "exp")
        beta = alpha * dt * (1.0 - lam)
        gamma = lam * dt
        xr = m._xr(v)
        y, s = ops.trapezoid(q, k, xr, alpha, beta, gamma, m.D, ssm, k_prev, m._xr(v_prev))
        return y, (angle_end, s, k[:, -1].contiguous(), v[:, -1].contiguous())

    return Primitives(
        name=path, linear=ops.linear, silu=silu, sigmoid=sigmoid, softplus=softplus,
        exp=ops.exp, norm=ops.norm, gated_norm=ops.gated_norm, conv=conv,
        selective_scan=labelled(selective_scan, path), ssd=labelled(ssd, path),
        mamba3_scan=labelled(mamba3, path),
        attention=functools.partial(exact_attention, ops), rope=functools.partial(exact_rope, ops),
    )


TWIN_PRIMITIVES = exact_primitives(TWIN_OPS, "exact-twin")
TWIN_STEP_PRIMITIVES = exact_primitives(TWIN_OPS, "exact-twin", in_place=True)
_TWIN_FMA = {False: exact_primitives(TWIN_OPS_FMA, "exact-twin"),
             True: exact_primitives(TWIN_OPS_FMA, "exact-twin", in_place=True)}


def twin_primitives(fused: bool = False, in_place: bool = False) -> Primitives:
    """The twins' primitives: exact-1's, or with `fused` exact-2's (`exact_primitives`' `in_place`)."""
    if fused:
        return _TWIN_FMA[in_place]
    return TWIN_STEP_PRIMITIVES if in_place else TWIN_PRIMITIVES


@functools.cache
def _kernel_primitives(in_place: bool = False, fused: bool = False) -> Primitives | None:
    ops = _kernel_ops(fused)
    return None if ops is None else exact_primitives(ops, "exact", in_place=in_place)


class _KernelBackend(FixedBackend):
    """The kernels' primitives, and a Mamba-1 or Mamba-2 layer's decode step (one token) in one
    kernel call (`_Kernels.step`: the same bits as the primitives' path, verified by the probe)."""

    def running(self) -> contextlib.AbstractContextManager[None]:
        return _torch_threads_off()

    def __init__(self, in_place: bool = False, fused: bool = False) -> None:
        prims = _kernel_primitives(in_place, fused)
        assert prims is not None
        super().__init__(prims, "exact-fma" if fused else "exact")
        self._ops, self._in_place = _kernel_ops(fused), in_place

    def decode(self, lm: Any, hidden: Tensor, layer_states: list[States]) -> tuple[Tensor, list[States], str] | None:
        done = self._ops.step_model(lm, hidden, layer_states, self._in_place)
        return None if done is None else (*done, self._prims.name)

    def mix(self, mixer: Any, u: Tensor, states: States, round_state: RoundState = None
            ) -> tuple[Tensor, States, str]:
        if u.shape[1] == 1 and isinstance(mixer, (Mamba1Mixer, Mamba2Mixer)):
            done = self._ops.step(mixer, u, states, self._in_place)
            if done is not None:  # one token: what `_token_by_token` does, in one call
                out, new = done
                return out, (new if round_state is None else round_state(new)), self._prims.name
        return super().mix(mixer, u, states, round_state)
