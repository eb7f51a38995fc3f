"""The layers a hybrid model adds to the Mamba mixers: grouped-query attention with its KV as state,
and the gated MLP sublayer.

Dimension letters:
    B   batch (streams advanced together)
    L   tokens in the chunk
    D   d_model
    M   max_positions (the KV rows a stream owns)
    Hq  query heads, Hkv key/value heads, Dh their head dimension
    I   the MLP's intermediate size

Attention's state per stream: k and v, each (M, Hkv, Dh), preallocated at max_positions. Row p holds
the key (value) of the token at position p; rows at or past the stream's position are zero and never
read (the attention primitive reads rows 0..position + L - 1 only). A chunk of L tokens at position
n writes rows n..n+L-1 of fresh copies and attends over rows 0..n+L-1, so the state after a chunk is
the same function of the tokens whatever the chunking: each row is written once, from its token's
own projection, and each query's output is the primitive's, which depends on its keys alone on the
exact and reference backends (`scan._attention`, `scan.exact._attention`).

Separate from the mixers because attention needs the streams' positions (a recurrent mixer does
not): the forward pass hands them over explicitly (`scan._forward.forward`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._mixer import Mixer, States
from mamba_stream.scan._ops import Primitives

__all__ = ["AttentionMixer", "GatedMLP"]

Tensor = torch.Tensor


class AttentionMixer(Mixer):
    """Causal grouped-query attention (GraniteMoeHybrid's `self_attn`: q/k/v/o projections, the
    softmax scale `attention_multiplier`, NoPE or RoPE), its KV held in the state."""

    chunk_path = "attention"

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        assert cfg.n_q_heads is not None and cfg.n_kv_heads is not None and cfg.attn_head_dim is not None
        bias = bool(cfg.attention_bias)
        hq, hkv, dh = cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim
        self.q_proj = nn.Linear(cfg.d_model, hq * dh, bias=bias)
        self.k_proj = nn.Linear(cfg.d_model, hkv * dh, bias=bias)
        self.v_proj = nn.Linear(cfg.d_model, hkv * dh, bias=bias)
        self.o_proj = nn.Linear(hq * dh, cfg.d_model, bias=bias)

    def state_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        cfg = self.cfg
        assert cfg.max_positions is not None and cfg.n_kv_heads is not None and cfg.attn_head_dim is not None
        shape = (cfg.max_positions, cfg.n_kv_heads, cfg.attn_head_dim)
        return [("k", shape), ("v", shape)]

    def forward(self, u: Tensor, states: States, be: Primitives, positions: Tensor | None = None,
                round_state: Callable[[States], States] | None = None) -> tuple[Tensor, States, str]:
        """Advance B streams by L tokens each.

        Args:
            u: (B, L, D) normalized hidden states.
            states: (k, v), each (B, M, Hkv, Dh); never written.
            be: the primitives (`attention`, `rope`, `linear`).
            positions: (B,) int64, each stream's position before the chunk (required).
            round_state: rounds (k, v) rows to a narrow state dtype (kept in the compute dtype), or
                None. The chunk's own rows are rounded before any query reads them, as a later
                chunk reads them: the bits do not depend on where a chunk was cut.

        Returns:
            (B, L, D) output, the new (k, v) (fresh tensors), and the path "attention".
        """
        if positions is None:
            raise ValueError("an attention layer needs each stream's position (scan._forward.forward(positions=))")
        cfg = self.cfg
        assert cfg.n_q_heads is not None and cfg.n_kv_heads is not None and cfg.attn_head_dim is not None
        assert cfg.max_positions is not None and cfg.attention_multiplier is not None
        k_cache, v_cache = states
        bsz, length, _ = u.shape
        hq, hkv, dh = cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim
        starts = [int(p) for p in positions.tolist()]
        if any(p < 0 or p + length > cfg.max_positions for p in starts):
            # `Model` refuses such a chunk (PositionLimit) before any layer runs; this is the guard
            raise ValueError(f"positions {starts} + {length} tokens pass max_positions={cfg.max_positions}")
        q = be.linear(u, self.q_proj.weight, self.q_proj.bias).reshape(bsz, length, hq, dh)
        k = be.linear(u, self.k_proj.weight, self.k_proj.bias).reshape(bsz, length, hkv, dh)
        v = be.linear(u, self.v_proj.weight, self.v_proj.bias).reshape(bsz, length, hkv, dh)
        if cfg.position_embedding == "rope":
            assert cfg.rope_theta is not None
            pos = positions.to(torch.long).unsqueeze(1) + torch.arange(length, device=u.device)  # (B, L)
            q = be.rope(q, pos, cfg.rope_theta, dh)
            k = be.rope(k, pos, cfg.rope_theta, dh)
        if round_state is not None:
            k, v = round_state((k, v))
        new_k, new_v = k_cache.clone(), v_cache.clone()
        for b, start in enumerate(starts):
            new_k[b, start : start + length] = k[b]
            new_v[b, start : start + length] = v[b]
        lengths = [start + length for start in starts]
        held = max(lengths)  # rows past every stream's length are not passed at all
        out = be.attention(q, new_k[:, :held], new_v[:, :held], lengths, float(cfg.attention_multiplier))
        out = be.linear(out.reshape(bsz, length, hq * dh), self.o_proj.weight, self.o_proj.bias)
        return out, (new_k, new_v), "attention"


class GatedMLP(nn.Module):
    """GraniteMoeHybrid's `shared_mlp`: [gate, up] = input_linear(x); output_linear(act(gate) * up).

    x (B, L, D) -> (B, L, D), through the backend's `linear` and `silu` (exact on the exact backend:
    the product, then elementwise operations whose bits depend on their own element alone).
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.mlp_intermediate_size is not None
        self.input_linear = nn.Linear(cfg.d_model, 2 * cfg.mlp_intermediate_size, bias=False)
        self.output_linear = nn.Linear(cfg.mlp_intermediate_size, cfg.d_model, bias=False)

    def forward(self, x: Tensor, be: Primitives) -> Tensor:  # type: ignore[override]
        """x (B, L, D) normalized -> (B, L, D)."""
        gate, up = be.linear(x, self.input_linear.weight, None).chunk(2, dim=-1)
        return be.linear(be.silu(gate) * up, self.output_linear.weight, None)
