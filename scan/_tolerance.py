"""Declared tolerances of each backend against the reference backend, with their measurements.

Every entry comes from `bench/measure_tolerance.py` (6 random 300-token sequences per preset
from a warmed-up state, scanned whole and in random partitions down to one-token chunks,
chunked backend vs reference), with about 6x headroom over the largest difference seen. The
negative control in the same run (the state one token behind, same continuation) moved logits by
0.14 to 0.41, more than 10^4 times the float32 logits bound, so these bounds reject misaligned
states. The reference backend itself is exact: its own chunkings must agree bit for bit.

Mamba-3's k state carries the widest bound: the reference accumulates its rotation angle in
float32 one token at a time (as mamba-ssm's step kernel does) while the chunked path sums angles
in float64, so their k states differ by the reference's own angle rounding, which grows with the
stream's length (2.4e-5 after 300 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TOLERANCES", "Tolerance", "tolerance"]


@dataclass(frozen=True)
class Tolerance:
    """|actual - expected| <= atol + rtol * |expected|, elementwise, for logits and for states."""

    logits_atol: float
    logits_rtol: float
    state_atol: float
    state_rtol: float
    measured: str = ""

    @property
    def exact(self) -> bool:
        return self.logits_atol == self.logits_rtol == self.state_atol == self.state_rtol == 0.0

    @staticmethod
    def _excess(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> float:
        if actual.shape != expected.shape:
            return float("inf")
        if actual.numel() == 0:
            return 0.0
        diff = (actual.double() - expected.double()).abs()
        if atol == 0.0 and rtol == 0.0:
            return 0.0 if bool((diff == 0).all()) else float("inf")
        return float((diff / (atol + rtol * expected.double().abs())).max())

    def logits_excess(self, actual: torch.Tensor, expected: torch.Tensor) -> float:
        """Largest |diff| / bound over the logits: <= 1 passes."""
        return self._excess(actual, expected, self.logits_atol, self.logits_rtol)

    def state_excess(self, actual: torch.Tensor, expected: torch.Tensor) -> float:
        """Largest |diff| / bound over one state tensor: <= 1 passes."""
        return self._excess(actual, expected, self.state_atol, self.state_rtol)


EXACT = Tolerance(0.0, 0.0, 0.0, 0.0, "bit-exact by construction")

_F32 = "float32"
_F64 = "float64"
TOLERANCES: dict[tuple[str, str, str], Tolerance] = {
    ("mamba1", "chunked", _F32): Tolerance(
        4e-6, 4e-6, 1e-5, 1e-5, "2026-11-30: logits 4.8e-7 (rel 4.9e-7), state 8.3e-7 (conv)"),
    ("mamba1", "chunked", _F64): Tolerance(
        2e-7, 2e-7, 1e-12, 1e-12, "2026-11-30: logits 0 (float32 output), state 1.3e-15 (conv)"),
    ("mamba2", "chunked", _F32): Tolerance(
        4e-6, 4e-6, 1e-5, 1e-5, "2026-11-30: logits 6.3e-7 (rel 8.2e-7), state 1.3e-6 (conv)"),
    ("mamba2", "chunked", _F64): Tolerance(
        2e-7, 2e-7, 1e-12, 1e-12, "2026-11-30: logits 0 (float32 output), state 1.8e-15 (conv)"),
    ("mamba3", "chunked", _F32): Tolerance(
        4e-6, 4e-6, 1.5e-4, 1.5e-4,
        "2026-11-30: logits 6.6e-7 (rel 9.6e-7), state 2.4e-5 (k; MIMO preset 2.4e-5)"),
    ("mamba3", "chunked", _F64): Tolerance(
        2e-7, 2e-7, 1e-12, 1e-12, "2026-11-30: logits 0 (float32 output), state 6.7e-14 (k)"),
}


def tolerance(architecture: str, backend: str, dtype: str) -> Tolerance:
    """The declared bound of `backend` against the reference, for one architecture and dtype."""
    if backend == "reference":
        return EXACT
    try:
        return TOLERANCES[(architecture, backend, dtype)]
    except KeyError:
        raise KeyError(f"no declared tolerance for {architecture}/{backend}/{dtype}") from None
