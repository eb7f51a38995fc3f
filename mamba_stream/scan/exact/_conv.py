"""The causal depthwise conv over a chunk, out of place and into its state: kernel and twins.

Each output's taps are summed in order, then its bias (`conv_steps`' arithmetic, every token
side by side). The kernel is `conv_threads_f32` / `_f64` of `_conv.c`: a decode step's few tokens
on one thread in `conv`'s own loop, a prefill's tokens split across the C pool, the same bits.

Separate because the conv carries its own state (the last W inputs), which the slot table's
decode step has the kernel write in place (`conv_into`).
"""

from __future__ import annotations

import torch

from mamba_stream.scan.exact._build import _Library
from mamba_stream.scan.exact._threading import _threads

Tensor = torch.Tensor


class _Conv(_Library):
    """The kernel `conv_threads` (out of place, and into the state it is given)."""

    def conv(self, conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        return self._conv(conv_state, xs, weight, bias, into=None)

    def conv_into(self, conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
        """`conv`, the new state written over `conv_state` (returned): the kernel reads each stream's
        window before it writes it, and shifts it front to back, so aliasing changes no bit."""
        if not conv_state.is_contiguous():
            out, new = self.conv(conv_state, xs, weight, bias)
            return out, conv_state.copy_(new)
        return self._conv(conv_state, xs, weight, bias, into=conv_state)

    def _conv(self, conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None,
              into: Tensor | None) -> tuple[Tensor, Tensor]:
        bsz, length, c = xs.shape
        w = weight.shape[-1]
        st, xs = conv_state.contiguous(), xs.contiguous()
        taps = self._cached(weight, "taps", lambda: weight.detach()[:, 0, :].contiguous())
        out = torch.empty_like(xs)
        new = torch.empty_like(st) if into is None else into
        self.convs[xs.dtype](st.data_ptr(), xs.data_ptr(), taps.data_ptr(),
                             None if bias is None else bias.data_ptr(), out.data_ptr(), new.data_ptr(),
                             bsz, length, c, w, _threads(bsz * length * c * w))
        return out, new


def conv_ref(conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """The kernel `conv`: the causal conv over a chunk, each output's taps summed in order
    (`conv_steps`' arithmetic, all tokens side by side). conv_state: (B, C, W); xs: (B, L, C);
    weight: (C, 1, W); bias: (C,) -> out (B, L, C), new state (B, C, W)."""
    w = weight.shape[-1]
    length = xs.shape[1]
    full = torch.cat([conv_state, xs.transpose(1, 2)], dim=-1)  # (B, C, W + L)
    taps = weight[:, 0, :]
    acc = full[:, :, 1 : 1 + length] * taps[:, 0:1]
    for j in range(1, w):
        acc = acc + full[:, :, 1 + j : 1 + j + length] * taps[:, j : j + 1]
    if bias is not None:
        acc = acc + bias[:, None]
    return acc.transpose(1, 2), full[:, :, -w:].contiguous()


def conv_into_ref(conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None) -> tuple[Tensor, Tensor]:
    """The kernel call `conv_into`: `conv_ref`, its new state written over `conv_state` (returned).
    Shapes as `conv_ref`'s."""
    out, new = conv_ref(conv_state, xs, weight, bias)
    return out, conv_state.copy_(new)
