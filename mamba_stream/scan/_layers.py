"""The layers a hybrid model adds to the Mamba mixers: grouped-query attention with its KV as state,
the MLP, and routed experts.

Dimension letters:
    B   batch (streams advanced together)
    L   tokens in the chunk
    D   d_model
    M   max_positions (the KV rows a stream owns)
    Hq  query heads, Hkv key/value heads, Dh their head dimension
    I   the MLP's intermediate size (an expert's: moe_intermediate_size)
    N   tokens of the chunk, all streams (B * L)
    E   experts, K the experts each token is routed to

Attention's state per stream: k and v, each (P, Hkv, Dh) at position P, growing to at most M
(`TensorSpec.rows` "position"; the slot table's buffers hold M rows, zero past the position, and
never read there). Row p holds the key (value) of the token at position p. A chunk of L tokens at
position n writes rows n..n+L-1 of fresh copies and attends over rows 0..n+L-1 (the attention
primitive reads those only), so the state after a chunk is the same function of the tokens whatever
the chunking: each row is written once, from its token's own projection, and each query's output
is the primitive's, which depends on its keys alone on the exact and reference backends
(`scan._attention`, `scan.exact._attention`).

Separate from the mixers because attention needs the streams' positions (a recurrent mixer does
not): the forward pass hands them over explicitly (`scan._forward.forward`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._mixer import Mixer, States
from mamba_stream.scan._ops import Primitives, gelu

__all__ = ["MLP", "AttentionMixer", "Experts", "top_k"]

Tensor = torch.Tensor


class AttentionMixer(Mixer):
    """Causal grouped-query attention (GraniteMoeHybrid's `self_attn`: q/k/v/o projections, the
    softmax scale `attention_multiplier`, NoPE or RoPE), its KV held in the state."""

    chunk_path = "attention"
    growing_roles = frozenset({"k", "v"})

    def __init__(self, cfg: ModelConfig, width: int | None = None) -> None:
        """`width` None: q/k/v read d_model features (Zamba2's shared attention reads 2 * d_model)."""
        super().__init__(cfg)
        assert cfg.n_q_heads is not None and cfg.n_kv_heads is not None and cfg.attn_head_dim is not None
        bias = bool(cfg.attention_bias)
        hq, hkv, dh = cfg.n_q_heads, cfg.n_kv_heads, cfg.attn_head_dim
        width = cfg.d_model if width is None else width
        self.q_proj = nn.Linear(width, hq * dh, bias=bias)
        self.k_proj = nn.Linear(width, hkv * dh, bias=bias)
        self.v_proj = nn.Linear(width, hkv * dh, bias=bias)
        self.o_proj = nn.Linear(hq * dh, cfg.d_model, bias=bias)

    def state_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        cfg = self.cfg
        assert cfg.max_positions is not None and cfg.n_kv_heads is not None and cfg.attn_head_dim is not None
        shape = (cfg.max_positions, cfg.n_kv_heads, cfg.attn_head_dim)
        return [("k", shape), ("v", shape)]

    def forward(self, u: Tensor, states: States, be: Primitives, positions: Tensor | None = None,
                round_state: Callable[[States], States] | None = None,
                adapters: tuple[Tensor | None, Tensor | None, Tensor | None] | None = None,
                ) -> tuple[Tensor, States, str]:
        """Advance B streams by L tokens each.

        Args:
            u: (B, L, D) normalized hidden states (D: the q/k/v projections' width).
            states: (k, v), each (B, P, Hkv, Dh), P the rows held (at least every stream's position;
                zeros past a stream's own); never written.
            be: the primitives (`attention`, `rope`, `linear`).
            positions: (B,) int64, each stream's position before the chunk (required).
            round_state: rounds (k, v) rows to a narrow state dtype (kept in the compute dtype), or
                None. The chunk's own rows are rounded before any query reads them, as a later
                chunk reads them: the bits do not depend on where a chunk was cut.
            adapters: Zamba2's per-call-site LoRA outputs (q (B, L, Hq*Dh), k, v (B, L, Hkv*Dh); None:
                none), each added to its projection's output before anything else; None: none.

        Returns:
            (B, L, D) output, the new (k, v) (fresh tensors of max(P, the longest stream's new
            position) rows), and the path "attention".
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
        q = be.linear(u, self.q_proj.weight, self.q_proj.bias)
        k = be.linear(u, self.k_proj.weight, self.k_proj.bias)
        v = be.linear(u, self.v_proj.weight, self.v_proj.bias)
        if adapters is not None:  # Zamba2: q_proj(u) + adapter(u), as transformers adds them
            dq, dk, dv = adapters
            q, k, v = (p if d is None else p + d for p, d in ((q, dq), (k, dk), (v, dv)))
        q = q.reshape(bsz, length, hq, dh)
        k = k.reshape(bsz, length, hkv, dh)
        v = v.reshape(bsz, length, hkv, dh)
        if cfg.key_multiplier is not None:  # Falcon-H1: the keys scaled before rope, as transformers does
            k = k * cfg.key_multiplier
        if cfg.position_embedding == "rope":
            assert cfg.rope_theta is not None
            pos = positions.to(torch.long).unsqueeze(1) + torch.arange(length, device=u.device)  # (B, L)
            rotary = cfg.rotary_dim or dh
            q = be.rope(q, pos, cfg.rope_theta, rotary)
            k = be.rope(k, pos, cfg.rope_theta, rotary)
        if round_state is not None:
            k, v = round_state((k, v))
        lengths = [start + length for start in starts]
        held = max(lengths)  # rows past every stream's length are not passed at all
        # fresh tensors, as long as the longest stream needs (a State's hold its own rows only; the
        # slot table's hold max_positions rows, and keep them)
        rows = max(held, k_cache.shape[1])
        new_k = k_cache.new_zeros((bsz, rows, hkv, dh))
        new_v = v_cache.new_zeros((bsz, rows, hkv, dh))
        new_k[:, : k_cache.shape[1]] = k_cache
        new_v[:, : v_cache.shape[1]] = v_cache
        for b, start in enumerate(starts):
            new_k[b, start : start + length] = k[b]
            new_v[b, start : start + length] = v[b]
        out = be.attention(q, new_k[:, :held], new_v[:, :held], lengths, float(cfg.attention_multiplier))
        out = be.linear(out.reshape(bsz, length, hq * dh), self.o_proj.weight, self.o_proj.bias)
        return out, (new_k, new_v), "attention"


class MLP(nn.Module):
    """The MLP: gated (GraniteMoeHybrid's `shared_mlp`, Bamba's and Jamba's `feed_forward`):
    [gate, up] = input_linear(x), out = output_linear(act(gate) * up); or not gated (Nemotron-H's
    MLP layers): out = output_linear(act(input_linear(x))). act is silu, relu2 (relu, squared) or
    gelu (the exact, erf GELU: `scan._ops.gelu`, of exact operations and the backend's exp).

    x (B, L, D) -> (B, L, D), through the backend's `linear` and `silu`; relu2 is torch's relu and
    one product, both exact IEEE operations. Every output element depends on its own token alone on
    the exact backend (its `linear` is row-wise), so chunking and batching are invisible.
    """

    def __init__(self, cfg: ModelConfig, intermediate: int | None = None, gated: bool | None = None,
                 bias: bool | None = None, width: int | None = None) -> None:
        """`bias` None: `mlp_bias`; `width` None: d_model (an expert in a latent width reads and
        writes `moe_latent_size` features)."""
        super().__init__()
        size = intermediate if intermediate is not None else cfg.mlp_intermediate_size
        assert size is not None and cfg.mlp_activation is not None
        self.gated = cfg.mlp_gated is not False if gated is None else gated
        self.activation = cfg.mlp_activation
        # Falcon-H1: gate * gate_multiplier before the activation, the output * down_multiplier
        # (None: no operation)
        self.gate_multiplier, self.down_multiplier = cfg.mlp_gate_multiplier, cfg.mlp_down_multiplier
        bias = bool(cfg.mlp_bias) if bias is None else bias
        width = cfg.d_model if width is None else width
        self.input_linear = nn.Linear(width, (2 if self.gated else 1) * size, bias=bias)
        self.output_linear = nn.Linear(size, width, bias=bias)

    def state_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """None: an MLP layer (Nemotron-H's) holds no state."""
        return []

    def act(self, x: Tensor, be: Primitives) -> Tensor:
        if self.activation == "silu":
            return be.silu(x)
        if self.activation == "gelu":
            return gelu(x, be.exp)
        r = torch.relu(x)
        return r * r

    def forward(self, x: Tensor, be: Primitives, adapter: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """x (..., D) normalized -> (..., D). `adapter` (..., 2I or I): Zamba2's per-call-site LoRA
        output, added to input_linear's before the split (None: none)."""
        h = be.linear(x, self.input_linear.weight, self.input_linear.bias)
        if adapter is not None:
            h = h + adapter
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            if self.gate_multiplier is not None:
                gate = gate * self.gate_multiplier
            h = self.act(gate, be) * up
        else:
            h = self.act(h, be)
        out = be.linear(h, self.output_linear.weight, self.output_linear.bias)
        return out if self.down_multiplier is None else out * self.down_multiplier


def top_k(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The k greatest scores of each row and their columns, ties to the lower column.

    scores (N, E) -> values (N, K), indices (N, K) int64, greatest first. A stable sort keeps equal
    scores in column order, so the choice is a function of the row's values alone (`torch.topk`
    promises no order among ties).
    """
    values, indices = torch.sort(scores, dim=-1, descending=True, stable=True)
    return values[:, :k], indices[:, :k]


def softmax_rows(x: Tensor, be: Primitives) -> Tensor:
    """Softmax over the last dimension with the backend's exp and a left-to-right sum.

    x (N, K) -> (N, K): subtract the row's max (exact), exponentiate, add the columns in column
    order, divide. Every operation is elementwise or in a fixed order, so a row's result depends on
    the row alone.
    """
    e = be.exp(x - x.max(dim=-1, keepdim=True).values)
    total = e[:, 0].clone()
    for j in range(1, e.shape[1]):
        total = total + e[:, j]
    return e / total.unsqueeze(-1)


class Experts(nn.Module):
    """Routed experts (GraniteMoeHybrid's `block_sparse_moe`, Jamba's `JambaSparseMoeBlock`,
    Nemotron-H's `NemotronHMoE`).

    router (E, D) scores each token; `top_k` picks K experts per token (ties to the lower index);
    their weights are the softmax of the chosen logits ("topk_softmax"), the chosen entries of the
    softmax over all E ("softmax_topk", not renormalized), or, "sigmoid_group_topk", the chosen
    sigmoid scores where the choice reads the scores plus `correction_bias` (E,) within the best
    `moe_topk_groups` of `moe_groups` groups (`group_limited`), renormalized where `moe_norm_topk`;
    times `moe_scaling` where set. Each chosen expert, an MLP without biases (gated unless
    `mlp_gated` is False), runs on the token (on its `latent_in` projection where `moe_latent_size`),
    and out = sum of weight * expert output over the token's experts in expert-index order (starting
    from +0.0, which the first addend passes through unchanged: no extra rounding), then
    `latent_out` where latent. `shared` (an "moe" layer's shared MLP, of `moe_shared_intermediate_size`)
    runs on x itself and is added last; an "moe" ffn's shared MLP is its block's `mlp` instead.

    An expert's rows are gathered, run through the row-wise `linear` and scattered back: a token's
    output depends on its own row alone whatever else is in the chunk or the batch.
    """

    def __init__(self, cfg: ModelConfig, shared: bool = False) -> None:
        """`shared`: hold the shared MLP (an "moe" layer's; an "moe" ffn's is its block's `mlp`)."""
        super().__init__()
        assert cfg.moe_experts is not None and cfg.moe_top_k is not None and cfg.moe_router is not None
        self.top = cfg.moe_top_k
        self.rule = cfg.moe_router
        self.groups, self.topk_groups = cfg.moe_groups, cfg.moe_topk_groups
        self.norm_topk, self.scaling = bool(cfg.moe_norm_topk), cfg.moe_scaling
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        self.correction_bias: nn.Parameter | None = None
        if self.rule == "sigmoid_group_topk":  # steers the choice only, never the weights
            self.correction_bias = nn.Parameter(torch.zeros(cfg.moe_experts))
        latent = cfg.moe_latent_size
        bias = bool(cfg.mlp_bias)
        self.latent_in = None if latent is None else nn.Linear(cfg.d_model, latent, bias=bias)
        self.latent_out = None if latent is None else nn.Linear(latent, cfg.d_model, bias=bias)
        # every architecture's experts are bias-free matrices (stacked in their checkpoints)
        gated = cfg.mlp_gated is not False
        self.experts = nn.ModuleList([MLP(cfg, cfg.moe_intermediate_size, gated=gated, bias=False, width=latent)
                                      for _ in range(cfg.moe_experts)])
        self.shared = MLP(cfg, cfg.moe_shared_intermediate_size) if shared else None

    def state_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """None: an "moe" layer (Nemotron-H's) holds no state."""
        return []

    def route(self, x: Tensor, be: Primitives) -> tuple[Tensor, Tensor]:
        """x (N, D) -> weights (N, K) in x's dtype, experts (N, K) int64."""
        logits = be.linear(x, self.router.weight, None)
        if self.rule == "topk_softmax":
            values, chosen = top_k(logits, self.top)
            weights = softmax_rows(values, be)
        elif self.rule == "softmax_topk":
            probs = softmax_rows(logits, be)
            weights, chosen = top_k(probs, self.top)
        else:
            weights, chosen = self.group_limited(be.sigmoid(logits))
        return weights if self.scaling is None else weights * self.scaling, chosen

    def group_limited(self, scores: Tensor) -> tuple[Tensor, Tensor]:
        """The "sigmoid_group_topk" rule: scores (N, E) -> weights (N, K), experts (N, K).

        The choice reads scores + correction_bias: per group of E / G experts, the sum of its top
        2; the best `topk_groups` groups kept (ties to the lower group); the top K experts among
        the kept ones. The weights are the chosen experts' own scores, divided by their sum
        (added left to right, + 1e-20) where `norm_topk`. Comparisons, a stable sort and fixed-order
        additions: a row's result depends on the row alone.
        """
        assert self.correction_bias is not None and self.groups is not None and self.topk_groups is not None
        n, e = scores.shape
        choice = scores + self.correction_bias
        if self.topk_groups < self.groups:  # all groups kept: the mask would change nothing
            best2, _ = top_k(choice.reshape(n * self.groups, e // self.groups), 2)
            group_scores = (best2[:, 0] + best2[:, 1]).reshape(n, self.groups)
            _, kept = top_k(group_scores, self.topk_groups)
            keep = torch.zeros(n, self.groups, dtype=torch.bool, device=scores.device)
            keep.scatter_(1, kept, True)
            keep = keep.repeat_interleave(e // self.groups, dim=1)
            choice = choice.masked_fill(~keep, float("-inf"))
        _, chosen = top_k(choice, self.top)
        weights = scores.gather(1, chosen)
        if self.norm_topk:
            total = weights[:, 0].clone()
            for j in range(1, weights.shape[1]):
                total = total + weights[:, j]
            weights = weights / (total + 1e-20).unsqueeze(-1)
        return weights, chosen

    def forward(self, x: Tensor, be: Primitives) -> Tensor:  # type: ignore[override]
        """x (B, L, D) normalized -> (B, L, D)."""
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = self.route(flat, be)
        inner = flat if self.latent_in is None else be.linear(flat, self.latent_in.weight, self.latent_in.bias)
        out = torch.zeros_like(inner)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)
            if rows.numel() == 0:
                continue
            y = expert(inner[rows], be)
            out[rows] = out[rows] + weights[rows, slot].unsqueeze(-1) * y
        if self.latent_out is not None:
            out = be.linear(out, self.latent_out.weight, self.latent_out.bias)
        if self.shared is not None:
            out = out + self.shared(flat, be)
        return out.reshape(x.shape)
