"""The triton backend: skipped without CUDA (with the reason); on a GPU, within its declared
bounds of the float64 truth for the property suite's kinds of partition, paths recorded."""

from __future__ import annotations

import pytest
import torch

from mamba_stream.scan import UnsupportedBackend, load_model, tolerance
from mamba_stream.scan._drift import measure_drift, misalignment
from mamba_stream.scan._triton import unavailable_reason
from tests.scan._helpers import ARCH_PRESETS, tokens

REASON = unavailable_reason(torch.device("cuda"))
gpu = pytest.mark.skipif(REASON is not None, reason=f"triton backend unavailable here: {REASON}")


def test_triton_is_refused_with_its_reason_where_it_cannot_run():
    if REASON is None:
        pytest.skip("CUDA and the kernels are available here")
    with pytest.raises(UnsupportedBackend, match=r"CUDA|Triton"):
        load_model("tiny-mamba2", backend="triton")
    assert load_model("tiny-mamba2").backend == "exact"  # auto falls back to the CPU default


PARTITIONS = [[256], [1] * 8 + [248], [2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 16], [255, 1], [100, 0, 156]]


@gpu
@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_triton_partitions_within_declared_tolerance_and_misalignment_fails(preset):
    truth = load_model(preset, backend="reference", dtype=torch.float64, device="cuda")
    model = load_model(preset, backend="triton", device="cuda")
    tol = tolerance(model.config.architecture, "triton", "float32")
    warm, other, toks = tokens(17, 1), tokens(17, 2), tokens(256, 3)
    for chunks in PARTITIONS:
        pair = measure_drift(model, truth, toks, chunks, warm)
        for drift in (pair.full, pair.chunked):
            assert drift.logits_abs <= tol.logits_atol + tol.logits_rtol * drift.logits_scale, chunks
            for name, err in drift.state_abs.items():
                assert err <= tol.state_atol + tol.state_rtol * drift.state_scale[name], (chunks, name)
    bound = tol.logits_atol + tol.logits_rtol * pair.full.logits_scale
    assert all(err >= 10 * bound for err in misalignment(model, truth, toks[:64], warm, other).values())


@gpu
def test_triton_records_the_path_that_ran():
    s = {}
    for preset, n, expected in (("tiny-mamba2", 5, "fused-ssd"), ("tiny-mamba2", 1, "step-kernel"),
                                ("tiny-mamba3", 5, "fused-siso"), ("tiny-mamba3", 1, "step-kernel"),
                                ("tiny-mamba1", 5, "torch-scan"), ("tiny-mamba1", 1, "step-kernel"),
                                ("tiny-mamba3-mimo", 5, "torch-ssd")):
        m = s.setdefault(preset, load_model(preset, backend="triton", device="cuda"))
        r = m.advance(m.initial_state(), tokens(n, 4))
        assert (r.backend, r.path) == ("triton", expected), preset
        assert all(t.dtype == torch.float32 for t in r.state.tensors.values())
