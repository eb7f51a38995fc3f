"""A "parallel" layer (Falcon-H1): a Mamba-2 mixer and grouped-query attention side by side.

Both read the layer's one normed input, each scaled by its own input multiplier; their outputs,
each scaled by its own output multiplier, are summed (Mamba-2's first, as transformers adds them)
and that sum is the layer's mixer output:

    out = mamba(u * ssm_in) * ssm_out + attention(u * attention_in) * attention_out

A multiplier the config leaves unset (None) is no operation at all. Every product is one exact
IEEE multiplication per element and the sum one addition, so the layer is as chunk- and
batch-invariant as its two mixers.

State per stream, in this order: the Mamba-2's conv (C, W) and ssm (H, P, N), then the attention's
k and v, (M, Hkv, Dh) each (`scan._mamba2`, `scan._layers`): four tensors with four roles.

Parameters: `mixer.mamba.*` (mamba-ssm's Mamba-2 names) and `mixer.attn.*` (q_proj, k_proj,
v_proj, o_proj).

Separate because it is the one mixer built of two, and the one that advances its Mamba part
through the backend's `mix` (the reference backend's token-by-token loop, the exact backend's
one-call decode step where it applies) while its attention part takes the chunk at once.
"""

from __future__ import annotations

import torch

from mamba_stream.scan._backends import Backend, RoundState
from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._layers import AttentionMixer
from mamba_stream.scan._mamba2 import Mamba2Mixer
from mamba_stream.scan._mixer import Mixer, States
from mamba_stream.scan._ops import Primitives

__all__ = ["ParallelMixer"]

Tensor = torch.Tensor


class ParallelMixer(Mixer):
    """Falcon-H1's mixer: `mamba` (a Mamba-2 mixer) and `attn` (an `AttentionMixer`) on one input."""

    chunk_path = "ssd"
    growing_roles = AttentionMixer.growing_roles  # the attention's k and v; the Mamba's conv and ssm are fixed

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        self.mamba = Mamba2Mixer(cfg)
        self.attn = AttentionMixer(cfg)
        self._n_mamba = len(self.mamba.state_shapes())

    def state_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The Mamba-2's (conv, ssm), then the attention's (k, v)."""
        return self.mamba.state_shapes() + self.attn.state_shapes()

    def forward(self, u: Tensor, states: States, backend: Backend, prims: Primitives,  # type: ignore[override]
                positions: Tensor | None = None, round_state: RoundState = None) -> tuple[Tensor, States, str]:
        """Advance B streams by L tokens each.

        Args:
            u: (B, L, D) the layer's normed input.
            states: (conv, ssm, k, v), each with a leading B; never written.
            backend: advances the Mamba-2 part (`Backend.mix`).
            prims: the chunk's primitives, which the attention part computes with.
            positions: (B,) int64, each stream's position before the chunk (required).
            round_state: rounds states to a narrow state dtype after every token, or None.

        Returns:
            (B, L, D) the summed output, the new (conv, ssm, k, v), and the Mamba-2 scan's path.
        """
        cfg = self.cfg
        n = self._n_mamba
        m_in = u if cfg.ssm_in_multiplier is None else u * cfg.ssm_in_multiplier
        m_out, m_states, path = backend.mix(self.mamba, m_in, states[:n], round_state)
        if cfg.ssm_out_multiplier is not None:
            m_out = m_out * cfg.ssm_out_multiplier
        a_in = u if cfg.attention_in_multiplier is None else u * cfg.attention_in_multiplier
        a_out, a_states, _ = self.attn.forward(a_in, states[n:], prims, positions, round_state)
        if cfg.attention_out_multiplier is not None:
            a_out = a_out * cfg.attention_out_multiplier
        return m_out + a_out, (*m_states, *a_states), path
