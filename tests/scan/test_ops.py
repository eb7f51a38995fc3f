"""The reference primitives give each row the same bits whatever the batch around it.

This is what makes `advance_batch` on the reference backend equal per-stream `advance` bit for
bit. The native primitives are checked too, to show why the reference needs its own: on this
CPU their single-row and batched results differ.
"""

from __future__ import annotations

import pytest
import torch

from mamba_stream.scan._ops import NATIVE_OPS, REFERENCE_OPS, conv_taps, gated_rms_norm, rms_normalize

BATCHES = [1, 2, 3, 5, 8, 13, 16, 33]


def _rows_invariant(fn, x: torch.Tensor) -> bool:
    solo = [fn(x[i : i + 1]) for i in range(x.shape[0])]
    return all(
        torch.equal(fn(x[:b]), torch.cat(solo[:b])) for b in BATCHES if b <= x.shape[0]
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("k,n", [(64, 264), (128, 64), (16, 8), (8, 20), (256, 1100)])
def test_reference_linear_is_batch_invariant(dtype, k, n):
    g = torch.Generator().manual_seed(k * n)
    w = torch.randn(n, k, generator=g, dtype=dtype)
    b = torch.randn(n, generator=g, dtype=dtype)
    x = torch.randn(33, k, generator=g, dtype=dtype)
    assert _rows_invariant(lambda t: REFERENCE_OPS.linear(t, w, b), x)
    # 3-D inputs flatten to rows the same way
    assert torch.equal(REFERENCE_OPS.linear(x.reshape(3, 11, k), w, b).reshape(33, n), REFERENCE_OPS.linear(x, w, b))
    assert REFERENCE_OPS.linear(x[:0], w, b).shape == (0, n)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", ["silu", "sigmoid", "softplus"])
@pytest.mark.parametrize("width", [7, 16, 24, 100, 1536])
def test_reference_activations_are_batch_invariant(dtype, name, width):
    x = torch.randn(33, width, generator=torch.Generator().manual_seed(width), dtype=dtype) * 6
    assert _rows_invariant(getattr(REFERENCE_OPS, name), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_reference_activations_match_torch_closely(dtype):
    x = torch.linspace(-30, 30, 10001, dtype=dtype)
    eps = 4 * torch.finfo(dtype).eps
    for name in ("silu", "sigmoid", "softplus"):
        ours, theirs = getattr(REFERENCE_OPS, name)(x), getattr(NATIVE_OPS, name)(x)
        assert torch.allclose(ours, theirs, rtol=eps, atol=eps), name


def test_native_primitives_are_not_batch_invariant_here():
    """The reason REFERENCE_OPS exists; if this ever passes, the native ops became invariant."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(264, 64, generator=g)
    x = torch.randn(33, 64, generator=g)
    linear_ok = _rows_invariant(lambda t: NATIVE_OPS.linear(t, w), x)
    silu_ok = _rows_invariant(NATIVE_OPS.silu, torch.randn(33, 24, generator=g) * 6)
    assert not (linear_ok and silu_ok)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_norms_and_conv_taps_are_batch_invariant(dtype):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(33, 96, generator=g, dtype=dtype)
    z = torch.randn(33, 96, generator=g, dtype=dtype)
    w = torch.randn(96, generator=g, dtype=dtype)
    assert _rows_invariant(lambda t: rms_normalize(t, 1e-5), x)
    xz = torch.stack([x, z], dim=1)
    for before in (True, False):
        fn = lambda t: gated_rms_norm(t[:, 0], t[:, 1], w, 1e-5, 32, before, REFERENCE_OPS.silu)  # noqa: E731, B023 - used within this iteration
        assert _rows_invariant(fn, xz)
    window = torch.randn(33, 96, 4, generator=g, dtype=dtype)
    cw = torch.randn(96, 4, generator=g, dtype=dtype)
    assert _rows_invariant(lambda t: conv_taps(t, cw, w), window)


def test_conv_taps_equals_causal_conv1d():
    g = torch.Generator().manual_seed(2)
    window = torch.randn(4, 10, 4, generator=g, dtype=torch.float64)
    weight = torch.randn(10, 1, 4, generator=g, dtype=torch.float64)
    bias = torch.randn(10, generator=g, dtype=torch.float64)
    conv = torch.nn.functional.conv1d(window, weight, bias, groups=10)[..., 0]
    assert torch.allclose(conv_taps(window, weight[:, 0], bias), conv, rtol=1e-12, atol=1e-12)
