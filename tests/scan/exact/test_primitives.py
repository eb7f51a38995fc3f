"""The primitives (`_primitives`): a whole model on the kernels' primitives gives the twins' bits,
each result labelled with its path."""

from __future__ import annotations

import pytest
import torch

from mamba_stream.scan import load_model
from mamba_stream.scan._backends import FixedBackend
from mamba_stream.scan._forward import embed, forward
from mamba_stream.scan.exact import exact_primitives, twin_primitives
from mamba_stream.scan.exact._kernels import _kernel_ops
from mamba_stream.scan.exact._probe import _states_equal
from tests.scan._helpers import ARCH_PRESETS, tokens
from tests.scan.exact._helpers import NEEDS_KERNELS

pytestmark = NEEDS_KERNELS


#: the exact arithmetics and the computations each is tested in: exact-2 computes in float32 only
ARITHMETICS = [("exact", d) for d in ("float32", "float64")] + [("exact-fma", "float32")]


@pytest.mark.parametrize(("backend", "dtype"), ARITHMETICS)
@pytest.mark.parametrize("preset", ARCH_PRESETS)
def test_a_whole_model_on_the_kernels_gives_the_twins_bits(preset, backend, dtype):
    model = load_model(preset, backend=backend, dtype=getattr(torch, dtype))
    fused = backend == "exact-fma"
    lm = model.module
    states = model._stack([model.initial_state(), model.advance(model.initial_state(), tokens(5, 1)).state])
    with torch.inference_mode():
        hidden = embed(lm, torch.tensor([tokens(21, 2), tokens(21, 3)]))
        a = forward(lm, hidden, states, FixedBackend(exact_primitives(_kernel_ops(fused), "exact")))
        b = forward(lm, hidden, states, FixedBackend(twin_primitives(fused)))
    assert torch.equal(a[0], b[0]) and _states_equal(a[1], b[1])
    assert (a[2], b[2]) == ("exact", "exact-twin")
