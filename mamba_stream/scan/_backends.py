"""Backends: sets of primitives that the one forward pass (`scan._forward.forward`) runs with.

A backend decides how a product, an activation, the conv and the scans are computed, and, for
the reference backend, that a layer advances one token at a time. Everything else (the order
of the layers, the residual stream, the norms, each mixer's preamble and gating) is written once,
in the mixers' `forward` and in `scan._forward`.

    reference  one token at a time, batch-invariant primitives (`REFERENCE_OPS`), the state
               rounded to its dtype after every token: bit-identical under any chunking and
               batching. Path "recurrent".
    chunked    1-token calls: the step formulas with PyTorch's native kernels (path "step");
               longer chunks: GEMMs over the chunk, F.conv1d, the chunked SSD (Mamba-2/3, path
               "ssd") or the segmented selective scan (Mamba-1, path "scan").
    triton     the chunked primitives with mamba-ssm's Triton kernels as the scans (`scan._triton`).
    exact      one set of primitives for every chunk length (`scan.exact`); with a narrow state
               dtype, a layer advances one token at a time and rounds the state after each, as the
               reference does.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from mamba_stream.scan._attention import attention_native, rope_native
from mamba_stream.scan._mamba1 import selective_scan_chunked, selective_scan_steps
from mamba_stream.scan._mamba2 import ssd_chunked, ssd_steps
from mamba_stream.scan._mamba3 import mamba3_chunked, mamba3_steps
from mamba_stream.scan._mixer import Mixer, States, conv_chunk, conv_steps
from mamba_stream.scan._ops import NATIVE_OPS, REFERENCE_OPS, Ops, Primitives, gated_rms_norm, norm

__all__ = ["CHUNKED", "CHUNK_PRIMITIVES", "EXACT_BACKENDS", "REFERENCE", "Backend", "ChunkedBackend", "FixedBackend",
           "ReferenceBackend", "labelled", "step_primitives"]

Tensor = torch.Tensor
#: The exact backends (`scan.exact`) by name, and the version of the arithmetic each computes,
#: recorded in every receipt (`state_codec.Arithmetic`). Anything that changes a bit of any result
#: (an operation's order, a polynomial, a constant) is a new version; tests/scan/exact/test_backend.py pins
#: the bits of each. "exact": exact-1; "exact-fma": exact-2, exact-1 with every step of a
#: product's sums one fused multiply-add.
EXACT_BACKENDS = {"exact": "exact-1", "exact-fma": "exact-2"}
#: rounds a layer's states to the state dtype (kept in the compute dtype); None: no rounding
RoundState = Callable[[States], States] | None


def labelled(fn: Callable[..., tuple[Any, Any]], path: str) -> Callable[..., tuple[Any, Any, str]]:
    """A scan that returns (outputs, state) as a primitive that also names its path."""

    def run(*args: Any) -> tuple[Any, Any, str]:
        out, state = fn(*args)
        return out, state, path

    return run


def step_primitives(ops: Ops, path: str) -> Primitives:
    """The token-at-a-time primitives, computing with `ops`: every token the same arithmetic."""
    return Primitives(
        name=ops.name, linear=ops.linear, silu=ops.silu, sigmoid=ops.sigmoid, softplus=ops.softplus,
        exp=torch.exp, norm=norm, gated_norm=partial(gated_rms_norm, silu=ops.silu), conv=conv_steps,
        selective_scan=labelled(partial(selective_scan_steps, ops=ops), path),
        ssd=labelled(partial(ssd_steps, ops=ops), path),
        mamba3_scan=labelled(partial(mamba3_steps, ops=ops), path),
        attention=ops.attention, rope=ops.rope,
    )


def _linear_chunk(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    # the bias after the product: how the chunk path has always added Mamba-1's dt bias
    out = F.linear(x, weight)
    return out if bias is None else out + bias


#: the chunked backend's primitives for chunks of more than one token
CHUNK_PRIMITIVES = Primitives(
    name="chunked", linear=_linear_chunk, silu=F.silu, sigmoid=torch.sigmoid, softplus=F.softplus,
    exp=torch.exp, norm=norm, gated_norm=partial(gated_rms_norm, silu=F.silu), conv=conv_chunk,
    selective_scan=labelled(selective_scan_chunked, "scan"),
    ssd=labelled(ssd_chunked, "ssd"),
    mamba3_scan=labelled(mamba3_chunked, "ssd"),
    attention=attention_native, rope=rope_native,
)


class Backend:
    """How the layers of a model advance: the primitives for a chunk length, and `mix`, one layer
    over a chunk."""

    name = "backend"

    def primitives(self, length: int) -> Primitives:
        raise NotImplementedError

    def mix(self, mixer: Mixer, u: Tensor, states: States, round_state: RoundState = None
            ) -> tuple[Tensor, States, str]:
        """One layer over a chunk: u (B, L, D) -> (B, L, D), its new states, the path taken."""
        return mixer.forward(u, states, self.primitives(u.shape[1]))

    def decode(self, lm: Any, hidden: Tensor, layer_states: list[States]) -> tuple[Tensor, list[States], str] | None:
        """A whole model's step over one token, hidden (B, 1, D) -> logits (B, 1, V), its new
        states and path, where the backend has it in one call with the loop's bits; None (the
        default): `scan._forward.forward` runs its loop."""
        return None

    def running(self) -> AbstractContextManager[None]:
        """Held by the calling thread around a forward pass and its checks (none by default)."""
        return contextlib.nullcontext()


class FixedBackend(Backend):
    """One set of primitives for every chunk length."""

    def __init__(self, prims: Primitives, name: str | None = None) -> None:
        self.name = name or prims.name
        self._prims = prims

    def primitives(self, length: int) -> Primitives:
        return self._prims

    def mix(self, mixer: Mixer, u: Tensor, states: States, round_state: RoundState = None
            ) -> tuple[Tensor, States, str]:
        if round_state is None:
            return mixer.forward(u, states, self._prims)
        return _token_by_token(mixer, u, states, self._prims, round_state)


def _token_by_token(mixer: Mixer, u: Tensor, states: States, prims: Primitives, round_state: RoundState
                    ) -> tuple[Tensor, States, str]:
    """One layer, one token after the other: a narrow state dtype is rounded after every token,
    never once per call, so chunking cannot show."""
    outs, path = [], prims.name
    for t in range(u.shape[1]):
        out, states, path = mixer.forward(u[:, t : t + 1], states, prims)
        if round_state is not None:
            states = round_state(states)
        outs.append(out)
    return (torch.cat(outs, dim=1) if outs else u[:, :0]), states, path


class ReferenceBackend(FixedBackend):
    def __init__(self) -> None:
        super().__init__(step_primitives(REFERENCE_OPS, "recurrent"), "reference")

    def mix(self, mixer: Mixer, u: Tensor, states: States, round_state: RoundState = None
            ) -> tuple[Tensor, States, str]:
        # token by token whatever the state dtype: the recurrent form is the reference
        out, states, _ = _token_by_token(mixer, u, states, self._prims, round_state)
        return out, states, "recurrent"


class ChunkedBackend(Backend):
    """One set of primitives for 1-token calls, another for longer chunks."""

    def __init__(self, name: str = "chunked", step: Primitives | None = None,
                 chunk: Primitives = CHUNK_PRIMITIVES) -> None:
        self.name = name
        self.step = step or step_primitives(NATIVE_OPS, "step")
        self.chunk = chunk

    def primitives(self, length: int) -> Primitives:
        return self.step if length == 1 else self.chunk


REFERENCE = ReferenceBackend()
CHUNKED = ChunkedBackend()
