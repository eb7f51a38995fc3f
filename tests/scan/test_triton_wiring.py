"""The triton backend's wiring, checked on CPU with reference twins in place of the kernels.

The kernels need CUDA, but everything around them (which tensors go in, in which layout, how the
states come back) is ours and can be checked anywhere. Each kernel is replaced by a twin with its
exact contract:
- `selective_state_update` by mamba-ssm's `selective_state_update_ref`;
- `mamba_chunk_scan_combined` by the `ssd_minimal_discrete` wrapper of the cross-checks;
- the Mamba-3 SISO kernels by a torch transcription of `mamba3_siso_step_kernel` (looped over
  positions for the combined one).
The triton path must then agree with the reference backend to float32 noise.
"""

from __future__ import annotations

import math
import types

import pytest
import torch
import torch.nn.functional as F

from mamba_stream.scan import _triton, load_model, tolerance
from tests.scan._helpers import model_for, scan_chunks, tokens
from tests.scan._mamba_ssm import import_mamba_ssm, ssd_minimal_scan


def siso_step_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, Input_States=None):
    """mamba3_siso_step_kernel in torch. Q, K: (b, g, n); V: (b, h, p); ADT, DT, Trap: (b, h)."""
    angle, ssm, k_prev, v_prev = Input_States
    hg = V.shape[1] // Q.shape[1]
    q = Q.repeat_interleave(hg, dim=1) + Q_bias
    k = K.repeat_interleave(hg, dim=1) + K_bias
    theta = angle + torch.tanh(Angles) * math.pi * DT[..., None]
    theta = theta - 2 * math.pi * torch.floor(theta / (2 * math.pi))
    cos, sin = torch.cos(theta), torch.sin(theta)

    def rot(t):
        s = cos.shape[-1]
        pairs = t[..., : 2 * s].reshape(*t.shape[:-1], s, 2)
        out = torch.stack([pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 0] * sin + pairs[..., 1] * cos], -1)
        return torch.cat([out.reshape(*t.shape[:-1], 2 * s), t[..., 2 * s :]], dim=-1)

    q, k = rot(q), rot(k)
    alpha = torch.exp(ADT)
    lam = torch.sigmoid(Trap)
    beta, gamma = alpha * DT * (1 - lam), lam * DT
    new = ssm * alpha[..., None, None] + (beta[..., None] * v_prev)[..., None] * k_prev[:, :, None, :] \
        + (gamma[..., None] * V)[..., None] * k[:, :, None, :]
    out = (new * q[:, :, None, :]).sum(-1)
    if D is not None:
        out = out + D[:, None] * V
    if Z is not None:
        out = out * F.silu(Z)
    return out, [theta, new, k, V]


def siso_combined_ref(Q, K, V, ADT, DT, Trap, Q_bias, K_bias, Angles, D=None, Z=None, Input_States=None,
                       chunk_size=64, return_final_states=False, cu_seqlens=None):
    """mamba3_siso_combined's contract, one step at a time. ADT, DT, Trap: (b, h, l)."""
    states, ys = Input_States, []
    for t in range(Q.shape[1]):
        y, states = siso_step_ref(Q[:, t], K[:, t], V[:, t], ADT[..., t], DT[..., t], Trap[..., t], Q_bias, K_bias,
                                   Angles[:, t], D, None if Z is None else Z[:, t], states)
        ys.append(y)
    y = torch.stack(ys, dim=1)
    return (y, *states) if return_final_states else y


@pytest.fixture
def twins(monkeypatch):
    import_mamba_ssm()
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update_ref

    def update_ref(state, x, dt, A, B, C, D=None, z=None, dt_bias=None, dt_softplus=False, **_):
        return selective_state_update_ref(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus)

    fake = types.SimpleNamespace(chunk_scan=ssd_minimal_scan, state_update=update_ref,
                                 siso_combined=siso_combined_ref, siso_step=siso_step_ref)
    monkeypatch.setattr(_triton, "_kernels", lambda: fake)
    monkeypatch.setattr(_triton, "TRITON_CHUNK", 16)  # ssd_minimal_discrete needs L padded to it


def _as_triton(preset: str):
    model = load_model(preset, backend="chunked")
    model.backend = "triton"  # on CPU, with twins: the wiring alone is under test
    return model


@pytest.mark.parametrize("preset", ["tiny-mamba1", "tiny-mamba2", "tiny-mamba3", "tiny-mamba3-mimo"])
def test_triton_wiring_matches_the_reference(twins, preset):
    model = _as_triton(preset)
    truth = model_for(preset, "reference", "float64")
    arch = model.config.architecture
    tol = tolerance(arch, "chunked", "float32")  # the twins are float32 torch, like the chunked backend
    warm, toks = tokens(9, 11), tokens(40, 12)
    t = truth.advance(truth.advance(truth.initial_state(), warm).state, toks)
    start = model.advance(model.initial_state(), warm).state
    paths = set()
    for chunks in ([40], [1, 1, 1, 37], [5, 0, 13, 22], [39, 1]):
        logits, state = scan_chunks(model, start, toks, chunks)
        assert tol.logits_excess(logits, t.logits) <= 1.0, chunks
        for name, x in state.tensors.items():
            assert tol.state_excess(x, t.state.tensors[name]) <= 1.0, (chunks, name)
        paths |= {model.advance(start, toks[:c]).path for c in set(chunks) - {0}}
    expected = {"tiny-mamba1": {"torch-scan", "step-kernel"}, "tiny-mamba2": {"fused-ssd", "step-kernel"},
                "tiny-mamba3": {"fused-siso", "step-kernel"}, "tiny-mamba3-mimo": {"torch-ssd", "torch-step"}}
    assert paths == expected[preset]


def test_triton_step_never_writes_its_input_state(twins):
    model = _as_triton("tiny-mamba2")
    state = model.advance(model.initial_state(), tokens(10, 1)).state
    snapshot = state.clone()
    model.advance(state, [3])
    assert state.equal(snapshot)


def test_triton_kernels_get_the_clamped_dt(twins):
    """The clamp is the mixer's, before the scan: the step kernel runs, and agrees with the reference."""
    from mamba_stream.scan import PRESETS, ModelConfig, init_model

    fields, seed = PRESETS["tiny-mamba2"]
    cfg = ModelConfig.create(**fields, dt_max_clamp=0.002)
    model = init_model(cfg, seed, backend="chunked")
    model.backend = "triton"
    truth = init_model(cfg, seed, backend="reference", dtype=torch.float64)
    tol = tolerance("mamba2", "chunked", "float32")
    toks = tokens(20, 3)
    for chunks in ([20], [1] * 20):
        logits, state = scan_chunks(model, model.initial_state(), toks, chunks)
        t = truth.advance(truth.initial_state(), toks)
        assert tol.logits_excess(logits, t.logits) <= 1.0, chunks
        assert tol.state_excess(state.tensors["layers.1.ssm"], t.state.tensors["layers.1.ssm"]) <= 1.0
    assert model.advance(model.initial_state(), [1]).path == "step-kernel"
    unclamped = init_model(ModelConfig.create(**fields), seed, backend="reference", dtype=torch.float64)
    assert not torch.allclose(unclamped.advance(unclamped.initial_state(), toks).logits, t.logits)
