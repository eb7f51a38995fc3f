"""Zamba2's "shared" layers: a Mamba-2 layer whose input first gains the output of a transformer
block whose weights are shared with other such layers.

The model holds `shared_blocks` transformer blocks once (`backbone.shared.{j}`: `SharedBlock`); the
s-th "shared" layer (a call site) calls block s % shared_blocks, with its own KV, its own LoRA
adapters on the block's projections and its own output linear (`SharedMixer`):

    x   (B, L, D)    the layer's input (the residual stream before the layer)
    e   (B, L, D)    the model's embeddings (the same tensor at every site)
    h = rms_norm(concat(x, e)) * block.norm                       (B, L, 2D)
    q = h Wq^T + up_q(down_q(h)), k, v likewise (the site's adapters, where shared_attention_adapter)
    a = o_proj(attention(rope(q), rope(k), v))                    (B, L, D)   the site's own k, v rows
    g = rms_norm(a) * block.mlp_norm
    m = W_out(gelu(gate) * up), [gate; up] = W_in g + up_m(down_m(g))        (the site's adapter)
    t = m W_site^T                                                (B, L, D)   the site's own linear
    out = mamba2(rms_norm(x + t) * layer.norm)

The block has no residual connection of its own: t joins the Mamba-2's input only, and `out` joins
the residual stream as every layer's output does (`scan._forward`). Every step is the backend's
`linear`, `norm`, `attention`, `rope` and `exp` (the GELU's, `scan._ops.gelu`) or an exact
elementwise operation (the concatenation, the additions), each token's row by itself: the layer is
as chunk- and batch-invariant as attention and the Mamba-2 are.

State per stream, in this order: the Mamba-2's conv (C, W) and ssm (H, P, N), then the site's k and
v, (M, Hkv, Dh) each, a row per position (a State holds its position's rows): the weights are shared,
the KV is not.

Parameters: `backbone.shared.{j}.norm.weight` (2D,), `.attn.{q,k,v}_proj.weight` (H*Dh, 2D),
`.attn.o_proj.weight` (D, Hq*Dh), `.mlp_norm.weight` (D,), `.mlp.input_linear.weight` (2I, D),
`.mlp.output_linear.weight` (D, I); per site `backbone.layers.{i}.mixer.mamba.*` (mamba-ssm's Mamba-2
names), `.mixer.linear.weight` (D, D), `.mixer.mlp_adapter.{down,up}.weight` (r, D), (2I, r) and,
where shared_attention_adapter, `.mixer.{q,k,v}_adapter.{down,up}.weight` (r, 2D), (H*Dh, r).

Separate because it is the one layer that reads more than its own input (the embeddings) and
weights it does not own (the block it calls, handed over by the forward pass).
"""

from __future__ import annotations

import torch
from torch import nn

from mamba_stream.scan._backends import Backend, RoundState
from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._layers import MLP, AttentionMixer
from mamba_stream.scan._mamba2 import Mamba2Mixer
from mamba_stream.scan._mixer import Mixer, States
from mamba_stream.scan._ops import Primitives

__all__ = ["LoRA", "SharedBlock", "SharedMixer"]

Tensor = torch.Tensor


class _RMSWeight(nn.Module):
    """An RMS norm's weight (the norm itself is the backend's `norm`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class LoRA(nn.Module):
    """A low-rank adapter: x (..., width) -> up(down(x)) (..., out), through `rank` features."""

    def __init__(self, width: int, rank: int, out: int) -> None:
        super().__init__()
        self.down = nn.Linear(width, rank, bias=False)
        self.up = nn.Linear(rank, out, bias=False)

    def forward(self, x: Tensor, be: Primitives) -> Tensor:  # type: ignore[override]
        return be.linear(be.linear(x, self.down.weight, None), self.up.weight, None)


class SharedBlock(nn.Module):
    """One weight-shared transformer block: `norm` (2D), `attn` (q/k/v from 2D features, o_proj to
    D), `mlp_norm` (D), `mlp` (the gated MLP). Its KV is its call sites' (`SharedMixer`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = _RMSWeight(2 * cfg.d_model)
        self.attn = AttentionMixer(cfg, width=2 * cfg.d_model)
        self.mlp_norm = _RMSWeight(cfg.d_model)
        self.mlp = MLP(cfg)


class SharedMixer(Mixer):
    """One call site: its Mamba-2 (`mamba`), its output linear (`linear`), its adapters, and the
    index of the shared block it calls (`block`, set by the backbone)."""

    chunk_path = "ssd"
    growing_roles = AttentionMixer.growing_roles  # the site's k and v; the Mamba-2's conv and ssm are fixed

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg)
        assert cfg.n_q_heads is not None and cfg.n_kv_heads is not None and cfg.attn_head_dim is not None
        assert cfg.shared_adapter_rank is not None and cfg.mlp_intermediate_size is not None
        d, r = cfg.d_model, cfg.shared_adapter_rank
        self.mamba = Mamba2Mixer(cfg)
        self.linear = nn.Linear(d, d, bias=False)
        self.mlp_adapter = LoRA(d, r, 2 * cfg.mlp_intermediate_size)
        self.q_adapter: LoRA | None = None
        self.k_adapter: LoRA | None = None
        self.v_adapter: LoRA | None = None
        if cfg.shared_attention_adapter:
            self.q_adapter = LoRA(2 * d, r, cfg.n_q_heads * cfg.attn_head_dim)
            self.k_adapter = LoRA(2 * d, r, cfg.n_kv_heads * cfg.attn_head_dim)
            self.v_adapter = LoRA(2 * d, r, cfg.n_kv_heads * cfg.attn_head_dim)
        #: which of `backbone.shared` this site calls (`scan._lm._Backbone` sets it)
        self.block = 0
        self._n_mamba = len(self.mamba.state_shapes())

    def state_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """The Mamba-2's (conv, ssm), then this site's (k, v)."""
        cfg = self.cfg
        assert cfg.max_positions is not None and cfg.n_kv_heads is not None and cfg.attn_head_dim is not None
        kv = (cfg.max_positions, cfg.n_kv_heads, cfg.attn_head_dim)
        return [*self.mamba.state_shapes(), ("k", kv), ("v", kv)]

    def forward(self, x: Tensor, embedded: Tensor, shared: SharedBlock, norm: nn.Module,  # type: ignore[override]
                states: States, backend: Backend, prims: Primitives, positions: Tensor | None = None,
                round_state: RoundState = None) -> tuple[Tensor, States, str]:
        """Advance B streams by L tokens each.

        Args:
            x: (B, L, D) the layer's input, not normed (the residual stream).
            embedded: (B, L, D) the chunk's embeddings.
            shared: the block this site calls (`backbone.shared[self.block]`).
            norm: the layer's norm (its `weight` (D,)), over x plus the block's output.
            states: (conv, ssm, k, v), each with a leading B; never written.
            backend: advances the Mamba-2 (`Backend.mix`).
            prims: the chunk's primitives, which the block computes with.
            positions: (B,) int64, each stream's position before the chunk (required).
            round_state: rounds states to a narrow state dtype after every token, or None.

        Returns:
            (B, L, D) the Mamba-2's output, the new (conv, ssm, k, v), and the Mamba-2 scan's path.
        """
        cfg = self.cfg
        n = self._n_mamba
        eps = cfg.norm_eps
        h = prims.norm(torch.cat([x, embedded], dim=-1), shared.norm.weight, None, eps, True)
        adapters = None
        if self.q_adapter is not None and self.k_adapter is not None and self.v_adapter is not None:
            adapters = (self.q_adapter(h, prims), self.k_adapter(h, prims), self.v_adapter(h, prims))
        a, kv, _ = shared.attn.forward(h, states[n:], prims, positions, round_state, adapters)
        g = prims.norm(a, shared.mlp_norm.weight, None, eps, True)
        m = shared.mlp(g, prims, self.mlp_adapter(g, prims))
        t = prims.linear(m, self.linear.weight, None)
        normed = prims.norm(x + t, norm.weight, None, eps, True)
        out, m_states, path = backend.mix(self.mamba, normed, states[:n], round_state)
        return out, (*m_states, *kv), path
