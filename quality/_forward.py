"""The training forward: whole sequences from the zero state, differentiable.

It runs each layer's `chunk` (the chunked backend's own code), so the weights that training
fits are evaluated by the same arithmetic `load_model(..., backend="chunked")` serves; a test
holds the two to the declared chunked-backend tolerance.

Dimension letters: B batch, L tokens, D d_model, V padded vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from scan._lm import MambaLM
from scan._ops import norm

__all__ = ["sequence_logits"]


def sequence_logits(lm: MambaLM, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (B, L, V) for token ids (B, L), every stream starting from the zero state."""
    cfg = lm.cfg
    bsz = tokens.shape[0]
    hidden = F.embedding(tokens, lm.backbone.embedding.weight)
    residual: torch.Tensor | None = None
    for blk in lm.backbone.layers:
        residual = hidden if residual is None else hidden + residual
        normed = norm(residual, blk.norm.weight, blk.norm.bias, cfg.norm_eps, cfg.rms_norm)
        zeros = tuple(hidden.new_zeros((bsz, *shape)) for _, shape in blk.mixer.state_shapes())
        hidden, _ = blk.mixer.chunk(normed, zeros)
    assert residual is not None
    residual = hidden + residual
    nf = lm.backbone.norm_f
    return F.linear(norm(residual, nf.weight, nf.bias, cfg.norm_eps, cfg.rms_norm), lm.lm_head.weight)
