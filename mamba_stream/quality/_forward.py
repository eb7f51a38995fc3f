"""The training forward: whole sequences from the zero state, differentiable.

It is the one forward pass of `scan` (`scan.forward`) on the chunked backend, so the weights
that training fits are evaluated by the same arithmetic `load_model(..., backend="chunked")`
serves; a test holds the two to the declared chunked-backend tolerance.

Dimension letters: B batch, L tokens, D d_model, V padded vocabulary.
"""

from __future__ import annotations

import torch

from mamba_stream.scan import embed, forward, zero_states

__all__ = ["sequence_logits"]


def sequence_logits(lm: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (B, L, V) for token ids (B, L), every stream starting from the zero state."""
    hidden = embed(lm, tokens)
    logits, _, _ = forward(lm, hidden, zero_states(lm, tokens.shape[0], hidden), "chunked")
    return logits
