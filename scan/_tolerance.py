"""Declared tolerances: how far each backend and dtype may drift from the float64 reference.

The float64 reference backend is the truth. Every entry bounds |backend - truth|, elementwise
(atol + rtol * |truth|), for the float32 logits and for every state tensor, and records the
measurement it came from (`bench/measure_drift.py`: a warmed-up state, then 1,024 or 4,096
tokens scanned as one call and in a random partition down to one-token chunks). The bounds leave
about 4x headroom over the worst measured value. In that same run, three misaligned states (one
position behind, another stream's, one layer swapped) moved the logits by 0.17 to 0.33, more than
10^4 times the float32 logits bound, so these bounds reject misalignment. A partition may drift at
most 2x as far as one call plus a float noise floor (`DriftPair.chunked_within_rule`). Every
measured row holds to that.

Comparing two backends with each other (or a partition with one call of the same backend): by
the triangle inequality the bound is the sum of theirs, `tolerance(a) + tolerance(b)`.

Mamba-3's k state carries the widest bound. Its rotation angle is accumulated in float32 one
token at a time (as mamba-ssm's step kernel does), so the error is rounding of the angle. It
grows with the stream's length: 3.4e-5 after 1,041 positions, 9.7e-5 after 4,113.
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


    def __add__(self, other: Tolerance) -> Tolerance:
        """The bound between two results, each within its own bound of the truth."""
        return Tolerance(self.logits_atol + other.logits_atol, self.logits_rtol + other.logits_rtol,
                         self.state_atol + other.state_atol, self.state_rtol + other.state_rtol,
                         f"({self.measured}) + ({other.measured})")


EXACT = Tolerance(0.0, 0.0, 0.0, 0.0, "the truth itself")

_F32, _F64 = "float32", "float64"
_M = "2026-11-30, CPU, bench/measure_drift.py"
TOLERANCES: dict[tuple[str, str, str], Tolerance] = {
    ("mamba1", "reference", _F32): Tolerance(4e-6, 4e-6, 1e-5, 1e-5, f"{_M}: logits 2.5e-7, state 3.8e-7 (conv)"),
    ("mamba1", "chunked", _F32): Tolerance(4e-6, 4e-6, 1e-5, 1e-5, f"{_M}: logits 4.2e-7, state 7.2e-7 (conv)"),
    ("mamba1", "chunked", _F64): Tolerance(2e-7, 2e-7, 1e-12, 1e-12, f"{_M}: logits 0 (float32), state 2.0e-15"),
    ("mamba2", "reference", _F32): Tolerance(4e-6, 4e-6, 1e-5, 1e-5, f"{_M}: logits 2.9e-7, state 3.8e-7 (conv)"),
    ("mamba2", "chunked", _F32): Tolerance(4e-6, 4e-6, 1e-5, 1e-5, f"{_M}: logits 5.1e-7, state 8.2e-7 (conv)"),
    ("mamba2", "chunked", _F64): Tolerance(2e-7, 2e-7, 1e-12, 1e-12, f"{_M}: logits 0 (float32), state 1.3e-15"),
    ("mamba3", "reference", _F32): Tolerance(
        4e-6, 4e-6, 4e-4, 4e-4, f"{_M}: logits 1.1e-6, state 9.7e-5 (k) after 4,113 positions"),
    ("mamba3", "chunked", _F32): Tolerance(
        4e-6, 4e-6, 4e-4, 4e-4, f"{_M}: logits 6.6e-7, state 6.7e-5 (k) after 4,113 positions"),
    ("mamba3", "chunked", _F64): Tolerance(2e-7, 2e-7, 1e-12, 1e-12, f"{_M}: logits 0 (float32), state 2.5e-13"),
}


def tolerance(architecture: str, backend: str, dtype: str) -> Tolerance:
    """The declared bound of `backend` in `dtype` against the float64 reference."""
    if backend == "reference" and dtype == _F64:
        return EXACT
    try:
        return TOLERANCES[(architecture, backend, dtype)]
    except KeyError:
        raise KeyError(f"no declared tolerance for {architecture}/{backend}/{dtype}: measure it with "
                       "bench/measure_drift.py (bench/gpu_check.sh on a GPU) and declare it here") from None
