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
    """Logits (B, L, V) for token ids (B, L), every stream starting from the zero state (a hybrid's
    attention layers from an empty KV, at position 0)."""
    hidden = embed(lm, tokens)
    batch = tokens.shape[0]
    if not lm.cfg.has_attention:
        logits, _, _ = forward(lm, hidden, zero_states(lm, batch, hidden), "chunked")
        return logits
    # KV of no rows rather than zero_states' max_positions zero rows: the layer copies what it is
    # given into each chunk's fresh KV, which would be megabytes a step for rows never read
    states = []
    for blk in lm.backbone.layers:
        growing = getattr(blk.mixer, "growing_roles", frozenset())
        states.append(tuple(hidden.new_zeros((batch, 0, *shape[1:]) if role in growing else (batch, *shape))
                            for role, shape in blk.mixer.state_shapes()))
    positions = torch.zeros(batch, dtype=torch.long, device=tokens.device)
    logits, _, _ = forward(lm, hidden, states, "chunked", positions=positions)
    return logits
