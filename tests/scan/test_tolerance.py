"""The declared tolerances: normwise bounds, and on the trained presets they hold for the chunked
backend and still refuse a misaligned state."""

from __future__ import annotations

import random

import pytest
import torch

from mamba_stream.quality.evaluate import EvalConfig, recall_set
from mamba_stream.scan import PRESETS, TOLERANCES, TRAINED_PRESETS, Tolerance, load_model, tolerance
from mamba_stream.scan._model import StepResult


def test_an_element_near_zero_is_held_to_the_scale_of_its_tensor():
    tol = Tolerance(0.0, 4e-6, 0.0, 4e-6)
    truth = torch.tensor([4.6e3, 1e-3, -2.0])
    near = truth + torch.tensor([0.0, 1e-2, 0.0])  # 1e-2 <= 4e-6 * 4.6e3
    assert tol.state_excess(near, truth) == pytest.approx(1e-2 / (4e-6 * 4.6e3))
    assert tol.state_excess(truth + torch.tensor([0.0, 4e-2, 0.0]), truth) > 1.0


def test_each_logits_row_is_held_to_its_own_scale():
    tol = Tolerance(0.0, 1e-5, 0.0, 0.0)
    truth = torch.tensor([[1e3, 0.0], [1.0, 0.5]])
    assert tol.logits_excess(truth + torch.tensor([[5e-3, 5e-3], [0.0, 0.0]]), truth) <= 1.0
    # the same error on the row whose logits are of order 1 is 500x its bound
    assert tol.logits_excess(truth + torch.tensor([[0.0, 0.0], [5e-3, 0.0]]), truth) == pytest.approx(500.0)


def test_exact_means_equal_and_a_shape_mismatch_never_passes():
    exact = tolerance("mamba2", "reference", "float64")
    t = torch.randn(3, 4)
    assert exact.exact and exact.state_excess(t, t.clone()) == 0.0
    assert exact.state_excess(torch.nextafter(t, t + 1), t) == float("inf")
    assert tolerance("mamba2", "chunked", "float32").logits_excess(t[:2], t) == float("inf")


@pytest.mark.parametrize("name", sorted(TRAINED_PRESETS))
def test_a_trained_preset_on_the_chunked_backend_is_within_its_bound_and_a_misaligned_state_is_not(name):
    truth = load_model(name, backend="reference", dtype=torch.float64)
    model = load_model(name, backend="chunked")
    tol = tolerance(model.config.architecture, "chunked", "float32")
    tokens = recall_set(EvalConfig(n=3), 32)[2].tokens
    want = truth.advance(truth.initial_state(), tokens)
    got = model.advance(model.initial_state(), tokens)
    assert tol.logits_excess(got.logits, want.logits) <= 1.0
    for key, t in got.state.tensors.items():
        assert tol.state_excess(t, want.state.tensors[key]) <= 1.0, key
    # the same continuation from the state one token behind, cut inside the facts (a distractor
    # byte behind moves recall-mamba3's logits by only 1.2x its bound: one more repeated word)
    cut = 5
    head = model.advance(model.initial_state(), tokens[:cut]).state
    behind = model.advance(model.initial_state(), tokens[: cut - 1]).state
    cont = truth.advance(truth.advance(truth.initial_state(), tokens[:cut]).state, tokens[cut:]).logits
    assert tol.logits_excess(model.advance(head, tokens[cut:]).logits, cont) <= 1.0
    assert tol.logits_excess(model.advance(behind, tokens[cut:]).logits, cont) > 20.0


# --- every declared bound holds, and is tight, on its own reference run (Issue 19, mutant 4) ---
#
# A bound is only as good as its margin: one that drifted 100x loose still "holds". Each entry of
# `scan.TOLERANCES` is re-measured on the run it was declared from (its `measured` note and
# docs/results/drift-cpu-2026-11-30-normwise.md, drift-cpu-2026-12-01-exact.md): the trained
# preset of its architecture, `bench/measure_drift.py`'s seeded tokens (17 warm-up tokens, then
# 1,024 random bytes; Mamba-3's float32 reference and chunked bounds at 4,096), one call against
# the float64 reference.
#
# Holds: the backend's own error is within the bound, on whatever CPU runs the test (that is
# what a bound promises).
#
# Tight: measured on arithmetic whose error is the same on every CPU, in this run. The error of
# the reference and chunked backends depends on the CPU's kernels (torch rounds differently under
# AVX-512, AVX2 and its scalar build; mamba1/chunked/float32's state error is 2.2x smaller under
# AVX2 than under ATEN_CPU_CAPABILITY=default), so a ratio pinned on one CPU failed on another
# (Issue 25: "state bound 28x the measured error" on an AVX2 Zen 3). The exact backend performs
# the same IEEE operations in the same order on every CPU (mamba_stream/scan/exact/): its error on the same
# tokens, held to the entry's bound, must reach `TIGHT[dtype]` of it. For an exact entry that is
# its own error; for the others it says the bound is not far looser than a float32 (float64)
# computation of the same model errs. A float32 bound must be met to 1/25 (the docs claim about
# 4x headroom over the worst value measured): one 2.5x to 9x looser than declared already fails,
# except Mamba-3's chunked bound, which the exact arithmetic's float32 angles exceed at 4,096
# tokens (40x looser fails); 100x looser fails every entry. The float64 bounds are declared
# floors of 1e-12 or so over errors near double rounding (1e-15 on Mamba-1/2: about 500x
# headroom, by design), held to 1/5000: 5x to 8x looser fails on Mamba-1/2, 230x to 450x on
# Mamba-3 (measured near its bound), 1000x looser every entry. A float64 run
# whose logits, rounded to float32, equal the truth's measures 0: there the logits bound is a
# floor no run can measure, and the test asserts the equality instead.
TIGHT = {"float32": 1 / 25, "float64": 1 / 5000}
#: how much looser than declared a bound must be for the tightness check to fail it, at most
LOOSE = {"float32": 100.0, "float64": 1000.0}

_DEFAULT_ORDER = [*PRESETS, *TRAINED_PRESETS]
_LONG_ORDER = ["tiny-mamba3", "tiny-mamba3-mimo", "recall-mamba3"]  # the 4,096-token run's --presets


def _reference_run(arch: str, backend: str, dtype: str) -> tuple[str, int, list[str]]:
    """(preset, tokens, the --presets order whose seeded draws it used) of an entry's measurement."""
    if arch == "mamba3" and backend in ("reference", "chunked") and dtype == "float32":
        return "recall-mamba3", 4096, _LONG_ORDER
    return f"recall-{arch}", 1024, _DEFAULT_ORDER


def _draws(order: list[str], n: int, preset: str) -> tuple[list[int], list[int]]:
    """The warm-up and the tokens `bench/measure_drift.py --seed 0` drew for `preset`: one
    generator over the presets in order (start, other, tokens each)."""
    rng = random.Random(0)
    for p in order:
        start = [rng.randrange(256) for _ in range(17)]
        _other = [rng.randrange(256) for _ in range(17)]
        tokens = [rng.randrange(256) for _ in range(n)]
        if p == preset:
            return start, tokens
    raise KeyError(preset)


_TRUTHS: dict[tuple[str, int], tuple[list[int], list[int], StepResult]] = {}


def _truth(preset: str, n: int, order: list[str]) -> tuple[list[int], list[int], StepResult]:
    if (preset, n) not in _TRUTHS:
        start, tokens = _draws(order, n, preset)
        truth = load_model(preset, backend="reference", dtype=torch.float64)
        warm = truth.advance(truth.initial_state(), start).state
        _TRUTHS[(preset, n)] = start, tokens, truth.advance(warm, tokens)
    return _TRUTHS[(preset, n)]


def _declared() -> list:
    out = []
    for arch, backend, dtype in sorted(TOLERANCES):
        slow = _reference_run(arch, backend, dtype)[1] > 1024 or arch == "mamba3"  # truths of seconds
        out.append(pytest.param(arch, backend, dtype, id=f"{arch}-{backend}-{dtype}",
                                marks=[pytest.mark.slow] if slow else []))
    return out


def _run(preset: str, backend: str, dtype: str, n: int, order: list[str]) -> tuple[StepResult, StepResult]:
    """(the backend's result, the truth's) on the entry's reference run."""
    start, tokens, want = _truth(preset, n, order)
    compute, _, weights = dtype.partition("/")  # "float32/q8": float32 computation on q8 weights
    model = load_model(preset, backend=backend, dtype=getattr(torch, compute), weights=weights or None)
    return model.advance(model.advance(model.initial_state(), start).state, tokens), want


def _excess(tol: Tolerance, got: StepResult, want: StepResult) -> tuple[float, float]:
    """(logits, worst state tensor) as fractions of the bound."""
    return (tol.logits_excess(got.logits, want.logits),
            max(tol.state_excess(t, want.state.tensors[k]) for k, t in got.state.tensors.items()))


def _tight(tol: Tolerance, got: StepResult, want: StepResult, dtype: str) -> str | None:
    """Why `tol` is not tight on `got` (None: it is)."""
    dtype = dtype.partition("/")[0]
    logits, state = _excess(tol, got, want)
    if state < TIGHT[dtype]:
        return f"state bound {1 / state:.0f}x the exact arithmetic's error"
    if dtype == "float64" and logits == 0.0:
        return None if torch.equal(got.logits, want.logits.to(got.logits.dtype)) else "logits differ"
    if logits < TIGHT[dtype]:
        return f"logits bound {1 / logits:.0f}x the exact arithmetic's error"
    return None


def _loosened(tol: Tolerance, k: float) -> Tolerance:
    return Tolerance(tol.logits_atol * k, tol.logits_rtol * k, tol.state_atol * k, tol.state_rtol * k)


@pytest.mark.parametrize("arch,backend,dtype", _declared())
def test_a_declared_bound_holds_and_is_tight_on_its_own_reference_run(arch, backend, dtype):
    tol = TOLERANCES[(arch, backend, dtype)]
    preset, n, order = _reference_run(arch, backend, dtype)
    assert TRAINED_PRESETS[preset] == arch
    got, want = _run(preset, backend, dtype, n, order)
    logits, state = _excess(tol, got, want)
    print(f"{arch}/{backend}/{dtype}: logits {logits:.3g}, state {state:.3g} of the bound")
    assert logits <= 1.0 and state <= 1.0
    exact = got if backend in ("exact", "exact-fma") else _run(preset, "exact", dtype, n, order)[0]
    print("  the exact arithmetic: logits {:.3g}, state {:.3g} of the bound".format(*_excess(tol, exact, want)))
    why = _tight(tol, exact, want, dtype)
    assert why is None, why
    # and the check can fail: the same bound, orders of magnitude looser, does
    assert _tight(_loosened(tol, LOOSE[dtype.partition("/")[0]]), exact, want, dtype) is not None
