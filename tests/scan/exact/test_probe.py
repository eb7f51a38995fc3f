"""The load-time probe (`_probe`): it verifies the kernels on the model it loads, and a kernel that
depends on its batch is caught and the twins run, with the same bits."""

from __future__ import annotations

import functools

import torch

from mamba_stream.scan import load_model
from mamba_stream.scan.exact import _primitives
from mamba_stream.scan.exact._kernels import _kernel_ops
from tests.scan._helpers import model_for, tokens
from tests.scan.exact._helpers import NEEDS_KERNELS

pytestmark = NEEDS_KERNELS


def test_the_probe_verifies_the_kernels_on_the_model_it_loads():
    model = load_model("tiny-mamba2", backend="exact")
    found = model.exact_probe
    assert found.kernels and found.path == "exact" and "verified" in found.reason
    assert model.advance(model.initial_state(), [1, 2]).path == "exact"


def test_a_product_that_depends_on_its_batch_is_caught_and_the_twins_run(monkeypatch):
    ops = _kernel_ops()
    honest = type(ops).linear

    def batch_dependent(self, x, weight, bias=None):  # a BLAS that changes kernels with M
        out = honest(self, x, weight, bias)
        rows = out.numel() // out.shape[-1]
        return torch.nextafter(out, out + 1) if rows > 1 else out

    monkeypatch.setattr(type(ops), "linear", batch_dependent)
    # primitives built around the patched product (the module's own stay as they were)
    monkeypatch.setattr(_primitives, "_kernel_primitives", functools.cache(_primitives._kernel_primitives.__wrapped__))
    model = load_model("tiny-mamba1", backend="exact")  # a fresh module: probed anew
    found = model.exact_probe
    assert not found.kernels and found.path == "exact-twin"
    assert "not: kernels equal their twins" in found.reason and "not: token by token equals the chunk" in found.reason
    r = model.advance(model.initial_state(), tokens(6, 1))
    assert r.path == "exact-twin"
    honest_model = model_for("tiny-mamba1", "exact", "float32")
    want = honest_model.advance(honest_model.initial_state(), tokens(6, 1))
    assert torch.equal(r.logits, want.logits) and r.state.equal(want.state)  # the twins: the same bits
