"""A stream's recurrent state and the result of advancing it."""

from __future__ import annotations

import math
import mmap
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

import torch

__all__ = ["State", "StepResult", "zeros_on_demand"]

#: below this many bytes a tensor of zeros is an ordinary allocation (a mapping's system calls cost
#: more than the pages it would leave unwritten)
_ON_DEMAND_BYTES = 64 << 10


def zeros_on_demand(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor of zeros whose memory the OS provides as each page is first written: on the CPU (from
    64 KiB), a view of an anonymous mapping, whose pages read as zero and take no memory until written.
    A 7B Mamba-2's state is 279 MB of zeros at position 0, and a worker's slot table holds room for
    several: `torch.zeros` writes all of it at once, this only what is used. Elsewhere `torch.zeros`."""
    device = torch.device(device)
    n = math.prod(shape) * dtype.itemsize
    if device.type != "cpu" or n < _ON_DEMAND_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # private: a process forked later gets its own copy on write, never the parent's pages
    mapping = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(mapping, dtype=dtype).view(shape)  # the tensor keeps the mapping alive


@dataclass(frozen=True, eq=False)
class State:
    """The whole recurrent state of one stream after `position` tokens.

    `tensors` maps names from the model's `StateSchema` (in schema order) to per-stream tensors,
    without a batch dimension. The engine never writes into a State's tensors: advancing returns
    a new State, so a State can be shared, cached or checkpointed while the stream moves on.
    """

    position: int
    tensors: Mapping[str, torch.Tensor]
    # Fingerprint of the schema that produced these tensors; None for states built by hand,
    # which get their values checked (finite) before use.
    origin: str | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.tensors, MappingProxyType):
            object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.tensors.items())

    @property
    def nbytes(self) -> int:
        """Bytes held by the state tensors; constant for a model, whatever the position."""
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def clone(self) -> State:
        """A deep copy (new storage), keeping position and origin."""
        return State(self.position, {k: v.clone() for k, v in self.tensors.items()}, self.origin)

    def equal(self, other: State) -> bool:
        """Bit-for-bit equality of position, names, dtypes, shapes and values."""
        if self.position != other.position or list(self.tensors) != list(other.tensors):
            return False
        return all(
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
            for a, b in zip(self.tensors.values(), other.tensors.values(), strict=True)
        )

    def max_abs_diff(self, other: State) -> float:
        """Largest absolute difference over all tensors (names must match)."""
        if list(self.tensors) != list(other.tensors):
            raise ValueError("states have different tensor names")
        diffs = [
            (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
            for a, b in zip(self.tensors.values(), other.tensors.values(), strict=True)
        ]
        return max(diffs, default=0.0)


@dataclass(frozen=True, eq=False)
class StepResult:
    """What `advance` returns: per-position logits, the new state, and what ran.

    Attributes:
        logits: float32 tensor (len(tokens), vocab_size); row i predicts the token after token i.
        state: the new State; position = input position + len(tokens).
        backend: the backend that ran ("reference", "chunked", ...).
        path: the code path inside it ("recurrent", "ssd", "scan", "step", "empty").
    """

    logits: torch.Tensor
    state: State
    backend: str
    path: str
