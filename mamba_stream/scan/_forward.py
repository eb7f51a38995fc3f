"""The forward pass, written once: embed -> (add, norm, mixer) x layers -> norm_f -> lm_head.

Every backend (`scan._backends`), the slot table's batched step, and the training forward of
`quality` run this loop; a backend only supplies how each layer advances (`Backend.mix`) and the
head's product.

A hybrid's blocks (`scan._lm._Block`) are typed: a Mamba block's mixer advances through
`Backend.mix`; an attention block's mixer (`scan._layers.AttentionMixer`) is called with the chunk's
primitives and the streams' positions (its primitive is chunk-invariant by itself, so it needs no
token-by-token loop); an "mlp" block's mixer is an MLP (no state); a "parallel" block's (Falcon-H1's
`scan._parallel.ParallelMixer`) runs both, its Mamba-2 through `Backend.mix`; a "shared" block's (Zamba2's
`scan._shared.SharedMixer`) calls its weight-shared transformer block on the residual and the embeddings
(`embedded`, handed to every such layer), then norms and runs its Mamba-2; a block with an ffn sublayer adds
(add, norm, ffn) after its mixer, the ffn the MLP, or routed experts plus (Granite) the MLP. Granite's
multipliers (and Falcon-H1's) scale the embeddings, sublayers' outputs and the logits where the config sets them;
where it does not (every plain Mamba model), no operation is done at all, so those models' bits are
what they were (and a multiplier of exactly 1.0 would change none either: x * 1.0 == x in IEEE
arithmetic for every x, -0.0 and the infinities included).

Dimension letters: B streams, L tokens, D d_model, V padded vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mamba_stream.scan._backends import CHUNKED, EXACT_BACKENDS, REFERENCE, Backend, RoundState
from mamba_stream.scan._errors import UnsupportedBackend
from mamba_stream.scan._lm import MambaLM
from mamba_stream.scan._mixer import States
from mamba_stream.scan._quant import Q8Weight

__all__ = ["LayerStates", "backend_named", "embed", "forward", "zero_states"]

Tensor = torch.Tensor
LayerStates = list[States]


def embed(lm: MambaLM, tokens: Tensor) -> Tensor:
    """(B, L) token ids -> (B, L, D) embeddings in the compute dtype (a gather, then an exact
    widening where the embedding is held narrower: exact on every backend)."""
    weight = lm.backbone.embedding.weight
    if isinstance(weight, Q8Weight):  # q d rows: exact products of small integers
        return weight.embedding(tokens).to(lm.compute_dtype)
    return F.embedding(tokens, weight).to(lm.compute_dtype)


def zero_states(lm: MambaLM, batch: int, like: Tensor) -> LayerStates:
    """The initial (all-zero) states of `batch` streams, in the dtype and on the device of `like`."""
    return [tuple(like.new_zeros((batch, *shape)) for _, shape in blk.mixer.state_shapes())
            for blk in lm.backbone.layers]


def backend_named(name: str, lm: MambaLM | None = None, dtype: torch.dtype | None = None) -> Backend:
    """The primitives of a backend ("reference", "chunked", "exact", "exact-fma" or "triton"); an
    exact one is probed on the model it runs (`lm`, `dtype`)."""
    if name == "triton":
        from mamba_stream.scan._triton import TRITON

        return TRITON
    if name in EXACT_BACKENDS:
        from mamba_stream.scan.exact import exact_backend

        if lm is None or dtype is None:
            raise UnsupportedBackend(f"the {name} backend is probed on its model: pass lm and dtype")
        return exact_backend(lm, dtype, name)[0]
    backends = {"reference": REFERENCE, "chunked": CHUNKED}
    if name not in backends:
        raise UnsupportedBackend(f"unknown backend {name!r}")
    return backends[name]


def forward(lm: MambaLM, hidden: Tensor, layer_states: LayerStates, backend: Backend | str,
            round_state: RoundState = None, positions: Tensor | None = None, *, last_only: bool = False
            ) -> tuple[Tensor, LayerStates, str]:
    """Logits for `hidden` (B, L, D), continuing `layer_states` (one tuple per layer, leading B).

    Args:
        backend: a `scan._backends.Backend` or its name.
        round_state: rounds a layer's states after every token (a narrow state dtype; the
            reference backend only), or None.
        positions: (B,) int64, each stream's position before the chunk: required by a model
            with attention layers (their KV rows are written and read by position), ignored by
            the others.
        last_only: logits of each stream's last token only, (B, 1, V): the bits of the last row
            of (B, L, V). On the exact backends the head runs on that row alone; on the others
            it runs on every row and the last is kept.

    Returns:
        logits (B, L, V) (or (B, 1, V)) in the compute dtype, the new states of every layer, and
        the path of the last Mamba layer's scan ("attention" for a model with none).
    """
    if isinstance(backend, str):
        backend = backend_named(backend, lm, hidden.dtype)
    if hidden.shape[1] == 1 and round_state is None:
        whole = backend.decode(lm, hidden, layer_states)  # the loop below in one call, its bits
        if whole is not None:
            return whole
    cfg = lm.cfg
    prims = backend.primitives(hidden.shape[1])
    rm = cfg.residual_multiplier  # None: no multiply at all (every plain Mamba model)
    if cfg.embedding_multiplier is not None:
        hidden = hidden * cfg.embedding_multiplier
    embedded = hidden  # Zamba2's shared blocks read the embeddings at every "shared" layer
    residual: Tensor | None = None
    new_states: LayerStates = []
    path = "empty"
    for blk, st in zip(lm.backbone.layers, layer_states, strict=False):
        residual = hidden if residual is None else hidden + residual
        if blk.kind == "shared":  # Zamba2: its shared block on (residual, embeddings), its own norm, its Mamba-2
            hidden, st_new, path = blk.mixer.forward(residual, embedded, lm.backbone.shared[blk.mixer.block],
                                                     blk.norm, st, backend, prims, positions, round_state)
        else:
            normed = prims.norm(residual, blk.norm.weight, blk.norm.bias, cfg.norm_eps, cfg.rms_norm)
            if blk.kind == "attention":
                hidden, st_new, attn_path = blk.mixer.forward(normed, st, prims, positions, round_state)
                path = attn_path if path == "empty" else path
            elif blk.kind in ("mlp", "moe"):  # no state: an MLP, or experts (Nemotron-H)
                hidden, st_new = blk.mixer(normed, prims), st
            elif blk.kind == "parallel":  # Falcon-H1: its Mamba-2 through the backend, its attention beside it
                hidden, st_new, path = blk.mixer.forward(normed, st, backend, prims, positions, round_state)
            else:
                hidden, st_new, path = backend.mix(blk.mixer, normed, st, round_state)
        if rm is not None:
            hidden = hidden * rm
        if blk.mlp_norm is not None:
            # Granite's residual + out: the same bits as out + residual (IEEE addition commutes)
            residual = hidden + residual
            normed = prims.norm(residual, blk.mlp_norm.weight, blk.mlp_norm.bias, cfg.norm_eps, cfg.rms_norm)
            if blk.moe is None:
                hidden = blk.mlp(normed, prims)
            else:
                hidden = blk.moe(normed, prims)
                if blk.mlp is not None:  # Granite: the shared MLP beside the experts
                    hidden = hidden + blk.mlp(normed, prims)
            if rm is not None:
                hidden = hidden * rm
        new_states.append(st_new)
    assert residual is not None
    residual = hidden + residual
    if last_only and backend.name in EXACT_BACKENDS:
        # the exact products compute each row in one order whatever the others (a norm is per
        # token): the last row alone is its bits; a BLAS's product may depend on the rows it is given
        residual = residual[:, -1:]
    nf = lm.backbone.norm_f
    normed = prims.norm(residual, nf.weight, nf.bias, cfg.norm_eps, cfg.rms_norm)
    logits = prims.linear(normed, lm.lm_head.weight)
    if cfg.logits_scaling is not None:
        logits = logits / cfg.logits_scaling
    if cfg.logits_multiplier is not None:  # Falcon-H1's lm_head_multiplier
        logits = logits * cfg.logits_multiplier
    if last_only and logits.shape[1] > 1:  # another backend's whole head: its last row kept
        logits = logits[:, -1:]
    return logits, new_states, path
