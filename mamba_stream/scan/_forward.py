"""The forward pass, written once: embed -> (add, norm, mixer) x layers -> norm_f -> lm_head.

Every backend (`scan._backends`), the slot table's batched step, and the training forward of
`quality` run this loop; a backend only supplies how each layer advances (`Backend.mix`) and the
head's product.

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
        from mamba_stream.scan._exact import exact_backend

        if lm is None or dtype is None:
            raise UnsupportedBackend(f"the {name} backend is probed on its model: pass lm and dtype")
        return exact_backend(lm, dtype, name)[0]
    backends = {"reference": REFERENCE, "chunked": CHUNKED}
    if name not in backends:
        raise UnsupportedBackend(f"unknown backend {name!r}")
    return backends[name]


def forward(lm: MambaLM, hidden: Tensor, layer_states: LayerStates, backend: Backend | str,
            round_state: RoundState = None) -> tuple[Tensor, LayerStates, str]:
    """Logits for `hidden` (B, L, D), continuing `layer_states` (one tuple per layer, leading B).

    Args:
        backend: a `scan._backends.Backend` or its name.
        round_state: rounds a layer's states after every token (a narrow state dtype; the
            reference backend only), or None.

    Returns:
        logits (B, L, V) in the compute dtype, the new states of every layer, and the path of the
        last layer's scan.
    """
    if isinstance(backend, str):
        backend = backend_named(backend, lm, hidden.dtype)
    cfg = lm.cfg
    prims = backend.primitives(hidden.shape[1])
    residual: Tensor | None = None
    new_states: LayerStates = []
    path = "empty"
    for blk, st in zip(lm.backbone.layers, layer_states, strict=False):
        residual = hidden if residual is None else hidden + residual
        normed = prims.norm(residual, blk.norm.weight, blk.norm.bias, cfg.norm_eps, cfg.rms_norm)
        hidden, st_new, path = backend.mix(blk.mixer, normed, st, round_state)
        new_states.append(st_new)
    assert residual is not None
    residual = hidden + residual
    nf = lm.backbone.norm_f
    normed = prims.norm(residual, nf.weight, nf.bias, cfg.norm_eps, cfg.rms_norm)
    logits = prims.linear(normed, lm.lm_head.weight)
    return logits, new_states, path
