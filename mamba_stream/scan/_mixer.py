"""What every mixer (Mamba-1/2/3 layer) offers the language model.

Dimension letters:
    B   batch (streams advanced together)
    L   tokens in the chunk
    D   d_model
    C   conv channels
    W   d_conv
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mamba_stream.scan._config import ModelConfig
from mamba_stream.scan._ops import Primitives, conv_taps

__all__ = ["Mixer", "conv_chunk", "conv_steps"]

Tensor = torch.Tensor
States = tuple[Tensor, ...]


class Mixer(nn.Module):
    """A sequence-mixing layer whose recurrent state goes in and comes out explicitly.

    Subclasses keep mamba-ssm's parameter names so checkpoints load unchanged. They never write
    into the state tensors they are given.

    `growing_roles`: the roles of the state tensors that hold a row per position (an attention
    layer's k and v: `TensorSpec.rows` "position"); a recurrent state's are fixed in size.
    """

    growing_roles: frozenset[str] = frozenset()

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg

    def state_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """(role, per-stream shape) of each state tensor, in the order step/chunk use them."""
        raise NotImplementedError

    def forward(self, u: Tensor, states: States, be: Primitives) -> tuple[Tensor, States, str]:
        """Advance B streams by L >= 1 tokens each, with the primitives of a backend.

        The same code for every backend and every L: what differs between them (how a product,
        an activation, the conv and the scan are computed) is `be`.

        Args:
            u: (B, L, D) normalized hidden states.
            states: this layer's state tensors, each with a leading B.
            be: the primitives to compute with.

        Returns:
            (B, L, D) mixer output, the new states (fresh tensors), and the path the scan took.
        """
        raise NotImplementedError

    #: name of the algorithm the chunked backend runs for L > 1, recorded on results
    chunk_path: str = "chunk"


def conv_chunk(
    conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Causal depthwise conv over a chunk, continued from the cached inputs.

    Args:
        conv_state: (B, C, W) the last W conv inputs before the chunk, oldest first.
        xs: (B, L, C) the chunk's conv inputs.
        weight: (C, 1, W).
        bias: (C,) or None.

    Returns:
        (B, L, C) conv outputs (before activation) and the new (B, C, W) conv state.
    """
    w = weight.shape[-1]
    full = torch.cat([conv_state, xs.transpose(1, 2)], dim=-1)  # (B, C, W + L)
    out = F.conv1d(full[:, :, 1:], weight, bias, groups=weight.shape[0])  # (B, C, L)
    return out.transpose(1, 2), full[:, :, -w:].contiguous()


def conv_steps(
    conv_state: Tensor, xs: Tensor, weight: Tensor, bias: Tensor | None
) -> tuple[Tensor, Tensor]:
    """`conv_chunk`'s reference twin: one window per token, its taps summed in a fixed order.

    The output of a token depends on nothing but its window, so any chunking gives the same bits.
    """
    window, outs = conv_state, []
    for t in range(xs.shape[1]):
        window = torch.cat([window[:, :, 1:], xs[:, t].unsqueeze(-1)], dim=-1)  # (B, C, W)
        outs.append(conv_taps(window, weight[:, 0, :], bias))
    return torch.stack(outs, dim=1), window
