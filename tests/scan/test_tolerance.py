"""The declared tolerances: normwise bounds, and on the trained presets they hold for the chunked
backend and still refuse a misaligned state."""

from __future__ import annotations

import pytest
import torch

from quality.evaluate import EvalConfig, recall_set
from scan import TRAINED_PRESETS, Tolerance, load_model, tolerance


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
