"""Declared tolerances: how far each backend and dtype may drift from the float64 reference.

The float64 reference backend is the truth. Every entry bounds |backend - truth| for the float32
logits and for every state tensor, normwise: atol + rtol * max|truth| of the logits row or of
the state tensor (see `Tolerance`). Each records the measurement it came from
(`bench/measure_drift.py`, docs/results/drift-cpu-2026-11-30-normwise.md: a warmed-up state, then
1,024 random bytes scanned as one call and in a random partition down to one-token chunks, on
the random-weight presets and the trained recall-mamba1/2/3; Mamba-3 also at 4,096). The bounds
leave about 4x headroom over the worst measured value. In the same run three misaligned states
(one position behind, another stream's, one layer swapped) moved the logits by 0.16 to 1.9, 13
to 10^6 times the measured error, so these bounds reject misalignment; the thinnest margin is
`recall-mamba3` on random bytes against the float32 reference (0.25 against a measured 0.019). A partition may drift
at most 2x as far as one call plus a float noise floor (`DriftPair.chunked_within_rule`). Every
measured row holds to that.

Comparing two backends with each other (or a partition with one call of the same backend): by
the triangle inequality the bound is the sum of theirs, `tolerance(a) + tolerance(b)`.

Mamba-3 carries the widest float32 bounds, set by the trained `recall-mamba3`: its rotation angle
advances by tanh(.) * pi * dt per token, and where training made dt large the float32 rounding
of that increment (about one ulp of the increment) accumulates in every rotated B the state
holds. After 4,096 random bytes its float32 reference state is 24% (normwise) from the float64
truth while the logits stay within 2.7e-3; the float32 chunked path, which sums angles in
float64, 3.1% and 5.3e-4. On the random-weight presets the same path drifts 4e-5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["TOLERANCES", "Tolerance", "tolerance"]


@dataclass(frozen=True)
class Tolerance:
    """|actual - expected| <= atol + rtol * max|expected|, for logits and for states.

    The scale is normwise: the largest |expected| of the logits row (one position's vocabulary)
    or of the whole state tensor, not each element's own magnitude. Rounding error in a scan
    follows the size of the numbers it accumulates, so an element near zero in a tensor whose
    entries reach 4.6e3 carries the error of 4.6e3, which an elementwise bound would refuse.
    """

    logits_atol: float
    logits_rtol: float
    state_atol: float
    state_rtol: float
    measured: str = ""

    @property
    def exact(self) -> bool:
        return self.logits_atol == self.logits_rtol == self.state_atol == self.state_rtol == 0.0

    @staticmethod
    def _excess(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float, rows: bool) -> float:
        if actual.shape != expected.shape:
            return float("inf")
        if actual.numel() == 0:
            return 0.0
        truth = expected.double()
        diff = (actual.double() - truth).abs()
        if atol == 0.0 and rtol == 0.0:
            return 0.0 if bool((diff == 0).all()) else float("inf")
        scale = truth.abs().amax(dim=-1, keepdim=True) if rows and truth.dim() > 0 else truth.abs().max()
        return float((diff / (atol + rtol * scale)).max())

    def logits_excess(self, actual: torch.Tensor, expected: torch.Tensor) -> float:
        """Largest |diff| / bound over the logits, each row scaled by its own max: <= 1 passes."""
        return self._excess(actual, expected, self.logits_atol, self.logits_rtol, rows=True)

    def state_excess(self, actual: torch.Tensor, expected: torch.Tensor) -> float:
        """Largest |diff| / bound over one state tensor, scaled by its max: <= 1 passes."""
        return self._excess(actual, expected, self.state_atol, self.state_rtol, rows=False)


    def __add__(self, other: Tolerance) -> Tolerance:
        """The bound between two results, each within its own bound of the truth."""
        return Tolerance(self.logits_atol + other.logits_atol, self.logits_rtol + other.logits_rtol,
                         self.state_atol + other.state_atol, self.state_rtol + other.state_rtol,
                         f"({self.measured}) + ({other.measured})")


EXACT = Tolerance(0.0, 0.0, 0.0, 0.0, "the truth itself")

_F32, _F64 = "float32", "float64"
_M = "2026-11-30, CPU, bench/measure_drift.py, normwise"
_X = "2026-12-01, CPU, bench/measure_drift.py --backends exact, normwise"
_W = "2026-12-02, CPU, bench/measure_drift.py --backends exact --dtypes float32/bfloat16,float32/q8, normwise"
_XF = "2026-12-02, CPU, bench/measure_drift.py --backends exact-fma --dtypes float32,float32/bfloat16,float32/q8"
TOLERANCES: dict[tuple[str, str, str], Tolerance] = {
    ("mamba1", "reference", _F32): Tolerance(
        4e-6, 1e-5, 1e-5, 1e-5, f"{_M}: logits 2.4e-6, state 2.2e-6 (recall-mamba1, recall text)"),
    ("mamba1", "chunked", _F32): Tolerance(
        4e-6, 1.5e-5, 1e-5, 1e-5, f"{_M}: logits 3.6e-6, state 1.2e-6 (recall-mamba1)"),
    ("mamba1", "chunked", _F64): Tolerance(2e-7, 2e-7, 1e-12, 1e-12, f"{_M}: logits 0 (float32), state 1.9e-15"),
    ("mamba2", "reference", _F32): Tolerance(
        4e-6, 2.5e-5, 1e-5, 1.2e-5, f"{_M}: logits 5.9e-6, state 2.7e-6 (recall-mamba2)"),
    ("mamba2", "chunked", _F32): Tolerance(
        4e-6, 5e-5, 1e-5, 1.2e-5, f"{_M}: logits 1.1e-5, state 2.9e-6 (recall-mamba2)"),
    ("mamba2", "chunked", _F64): Tolerance(2e-7, 2e-7, 1e-12, 1e-12, f"{_M}: logits 2.6e-11, state 2.4e-14"),
    ("mamba3", "reference", _F32): Tolerance(
        4e-6, 1e-2, 4e-4, 1.0, f"{_M}: logits 2.7e-3, state 0.24 (recall-mamba3 ssm, 4,096 random bytes; "
        "tiny-mamba3 4.1e-5)"),
    ("mamba3", "chunked", _F32): Tolerance(
        4e-6, 4e-3, 4e-4, 0.13, f"{_M}: logits 8.5e-4, state 3.1e-2 (recall-mamba3 ssm, 4,096 random bytes; "
        "tiny-mamba3 2.9e-5)"),
    ("mamba3", "chunked", _F64): Tolerance(2e-7, 2e-7, 1e-12, 4e-10, f"{_M}: logits 1.0e-7 (float32), "
                                                                      "state 8.4e-11 (recall-mamba3)"),
    # The exact backend: one call and every partition give the same bits, so the two columns of
    # the measurement are one (docs/results/drift-cpu-2026-12-01-exact.md).
    ("mamba1", "exact", _F32): Tolerance(
        4e-6, 1e-5, 1e-5, 1e-5, f"{_X}: logits 1.5e-6, state 1.2e-6 (recall-mamba1)"),
    ("mamba1", "exact", _F64): Tolerance(2e-7, 2e-7, 1e-12, 1e-12, f"{_X}: logits 0 (float32), state 1.4e-15"),
    ("mamba2", "exact", _F32): Tolerance(
        4e-6, 2.5e-5, 1e-5, 1.2e-5, f"{_X}: logits 6.2e-6, state 1.4e-6 (recall-mamba2)"),
    ("mamba2", "exact", _F64): Tolerance(2e-7, 2e-7, 1e-12, 1e-12, f"{_X}: logits 0 (float32), state 3.7e-15"),
    ("mamba3", "exact", _F32): Tolerance(
        4e-6, 9e-3, 4e-4, 2e-2, f"{_X}: logits 2.3e-3, state 4.2e-3 (recall-mamba3 ssm; tiny-mamba3 1.7e-5)"),
    ("mamba3", "exact", _F64): Tolerance(2e-7, 2e-7, 1e-12, 2e-10, f"{_X}: logits 0 (float32), "
                                                                    "state 2.9e-11 (recall-mamba3)"),
    # Weights read in a narrower format ("<compute>/<format>": `load_model(weights=...)`), against
    # the float64 truth of the checkpoint's own float weights: these bound the format, not the
    # arithmetic (which is exact: every chunking gives the same bits, so the two columns of the
    # measurement are one; docs/results/drift-cpu-2026-12-02-weights.md). Rounding a trained
    # model's weights moves its logits by as much as a misaligned state does on Mamba-2 (q8) and
    # Mamba-3 (both): there these bounds cannot tell the two apart, and the receipt's checksum,
    # bit-exact on the exact backend, is what proves alignment.
    ("mamba1", "exact", "float32/bfloat16"): Tolerance(
        4e-6, 2.4e-2, 1e-5, 7e-3, f"{_W}: logits 6.0e-3, state 1.7e-3 (recall-mamba1)"),
    ("mamba1", "exact", "float32/q8"): Tolerance(
        4e-6, 0.15, 1e-5, 5e-2, f"{_W}: logits 3.7e-2, state 6.3e-3 (recall-mamba1; 2.1e-2 on another 1,024 bytes)"),
    ("mamba2", "exact", "float32/bfloat16"): Tolerance(
        4e-6, 0.15, 1e-5, 5e-3, f"{_W}: logits 3.8e-2, state 1.3e-3 (recall-mamba2)"),
    ("mamba2", "exact", "float32/q8"): Tolerance(
        4e-6, 1.9, 1e-5, 3e-2, f"{_W}: logits 0.47, state 7.5e-3 (recall-mamba2)"),
    ("mamba3", "exact", "float32/bfloat16"): Tolerance(
        4e-6, 2.6, 4e-4, 6.0, f"{_W}: logits 0.33 (0.85 on another 1,024 bytes), state 1.45 (recall-mamba3 ssm; "
        "tiny-mamba3 1.2e-2, 3.4e-2)"),
    ("mamba3", "exact", "float32/q8"): Tolerance(
        4e-6, 5.0, 4e-4, 6.6, f"{_W}: logits 0.63 (2.2 on another 1,024 bytes), state 1.65 (recall-mamba3 ssm; "
        "tiny-mamba3 4.9e-2, 0.32)"),
    # The exact-fma backend (arithmetic exact-2: fused multiply-adds in the products): exact-1's
    # bounds, which its measured errors meet with the same margins (docs/results/
    # drift-cpu-2026-12-02-exact-fma.md; a fused step rounds once, so its float32 errors are the
    # same size or smaller; the formats' bound the format, as above).
    ("mamba1", "exact-fma", _F32): Tolerance(
        4e-6, 1e-5, 1e-5, 1e-5, f"{_XF}: logits 1.3e-6, state 1.1e-6 (recall-mamba1)"),
    ("mamba2", "exact-fma", _F32): Tolerance(
        4e-6, 2.5e-5, 1e-5, 1.2e-5, f"{_XF}: logits 6.2e-6, state 1.4e-6 (recall-mamba2)"),
    ("mamba3", "exact-fma", _F32): Tolerance(
        4e-6, 9e-3, 4e-4, 2e-2, f"{_XF}: logits 2.2e-3, state 4.4e-3 (recall-mamba3 ssm; tiny-mamba3 1.8e-5)"),
    ("mamba1", "exact-fma", "float32/bfloat16"): Tolerance(
        4e-6, 2.4e-2, 1e-5, 7e-3, f"{_XF}: logits 5.1e-3, state 1.6e-3 (recall-mamba1)"),
    ("mamba1", "exact-fma", "float32/q8"): Tolerance(
        4e-6, 0.15, 1e-5, 5e-2, f"{_XF}: logits 5.6e-2, state 2.2e-2 (recall-mamba1)"),
    ("mamba2", "exact-fma", "float32/bfloat16"): Tolerance(
        4e-6, 0.15, 1e-5, 5e-3, f"{_XF}: logits 2.9e-2, state 1.0e-3 (recall-mamba2)"),
    ("mamba2", "exact-fma", "float32/q8"): Tolerance(
        4e-6, 1.9, 1e-5, 3e-2, f"{_XF}: logits 0.18, state 5.9e-3 (recall-mamba2)"),
    ("mamba3", "exact-fma", "float32/bfloat16"): Tolerance(
        4e-6, 2.6, 4e-4, 6.0, f"{_XF}: logits 0.85, state 1.36 (recall-mamba3 ssm; tiny-mamba3 1.3e-2, 5.0e-2)"),
    ("mamba3", "exact-fma", "float32/q8"): Tolerance(
        4e-6, 5.0, 4e-4, 6.6, f"{_XF}: logits 2.2, state 1.87 (recall-mamba3 ssm; tiny-mamba3 4.0e-2, 1.0)"),
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
