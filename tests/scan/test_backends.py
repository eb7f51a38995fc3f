"""Backends: batching, declared tolerances, the misalignment negative control, what ran."""

from __future__ import annotations

import copy

import pytest
import torch

from mamba_stream.scan import NonFiniteOutput, UnsupportedBackend, load_model, tolerance
from mamba_stream.scan._drift import measure_drift, misalignment
from tests.scan._helpers import model_for, scan_chunks, tokens


def _streams(model, n=5):
    """Streams at different positions (0 included), each with its own next chunk (0 included)."""
    warm = [0, 3, 17, 1, 40][:n]
    states = [model.advance(model.initial_state(), tokens(w, 20 + i)).state for i, w in enumerate(warm)]
    chunks = [tokens(c, 30 + i) for i, c in enumerate([7, 1, 0, 12, 7][:n])]
    return states, chunks


@pytest.mark.parametrize("backend", ["reference", "exact"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_exact_backends_advance_batch_bit_exact_per_stream(preset, dtype, backend):
    model = model_for(preset, backend, dtype)
    states, chunks = _streams(model)
    batch = model.advance_batch(states, chunks)
    for s, c, got in zip(states, chunks, batch, strict=True):
        solo = model.advance(s, c)
        assert torch.equal(got.logits, solo.logits)
        assert got.state.equal(solo.state)
        assert got.state.position == s.position + len(c)


def test_chunked_advance_batch_within_tolerance_per_stream(preset):
    model = model_for(preset, "chunked")
    one = tolerance(model.config.architecture, "chunked", "float32")
    tol = one + one  # batched and solo, each within its bound of the truth
    states, chunks = _streams(model)
    batch = model.advance_batch(states, chunks)
    for s, c, got in zip(states, chunks, batch, strict=True):
        solo = model.advance(s, c)
        assert tol.logits_excess(got.logits, solo.logits) <= 1.0
        for name, t in got.state.tensors.items():
            assert tol.state_excess(t, solo.state.tensors[name]) <= 1.0
    # decode: many streams, one token each, as a serving batcher would group them
    steps = model.advance_batch(states, [[7]] * len(states))
    assert {r.path for r in steps} == {"step"}


def test_one_bad_stream_fails_the_whole_batch_before_any_work(preset):
    model = model_for(preset)
    states, chunks = _streams(model, 3)
    snapshots = [s.clone() for s in states]
    with pytest.raises(Exception):  # noqa: B017 - whichever refusal: the point is that no state moved
        model.advance_batch(states, [chunks[0], [999], chunks[2]])
    assert all(s.equal(snap) for s, snap in zip(states, snapshots, strict=True))


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_float32_backends_within_declared_tolerance_and_misalignment_is_caught(preset, backend):
    """Against the float64 truth; misaligned states exceed the bound at least 10x (negative control)."""
    truth = model_for(preset, "reference", "float64")
    model = model_for(preset, backend)
    tol = tolerance(model.config.architecture, backend, "float32")
    warm, other, toks = tokens(23, 40), tokens(23, 42), tokens(150, 41)
    t = truth.advance(truth.advance(truth.initial_state(), warm).state, toks)
    start = model.advance(model.initial_state(), warm).state
    for chunks in ([150], [1] * 10 + [140], [64, 64, 22], [5, 0, 31, 114]):
        logits, state = scan_chunks(model, start, toks, chunks)
        assert tol.logits_excess(logits, t.logits) <= 1.0, chunks
        for name, x in state.tensors.items():
            assert tol.state_excess(x, t.state.tensors[name]) <= 1.0, (chunks, name)
    drift = misalignment(model, truth, toks, warm, other)
    assert set(drift) == {"one position behind", "another stream", "layer 1 swapped"}
    for label, err in drift.items():
        assert err >= 10 * (tol.logits_atol + tol.logits_rtol * float(t.logits.abs().max())), label


def test_the_misalignment_control_is_computed_against_the_right_state():
    """The control must be able to pass: the aligned state itself is within the bound."""
    truth = model_for("tiny-mamba2", "reference", "float64")
    model = model_for("tiny-mamba2", "chunked")
    pair = measure_drift(model, truth, tokens(64, 7), [1, 30, 33], tokens(9, 8))
    tol = tolerance("mamba2", "chunked", "float32")
    assert pair.full.logits_abs <= tol.logits_atol + tol.logits_rtol * pair.full.logits_scale
    assert pair.chunked_within_rule(1e-6, 1e-6)


def test_result_records_backend_and_path():
    cases = [
        ("tiny-mamba2", "chunked", 3, ("chunked", "ssd")),
        ("tiny-mamba3", "chunked", 3, ("chunked", "ssd")),
        ("tiny-mamba1", "chunked", 3, ("chunked", "scan")),
        ("tiny-mamba2", "chunked", 1, ("chunked", "step")),
        ("tiny-mamba1", "reference", 3, ("reference", "recurrent")),
        ("tiny-mamba1", "reference", 0, ("reference", "empty")),
        ("tiny-mamba2", "exact", 3, ("exact", "exact")),
        ("tiny-mamba3", "exact", 1, ("exact", "exact")),
    ]
    for preset, backend, n, expected in cases:
        m = model_for(preset, backend)
        r = m.advance(m.initial_state(), tokens(n, 1))
        assert (r.backend, r.path) == expected, (preset, backend, n)


def test_auto_backend_and_unknown_backend():
    assert load_model("tiny-mamba1").backend == "exact"  # the default on CPU: exact under any chunking
    with pytest.raises(UnsupportedBackend):
        load_model("tiny-mamba1", backend="cuda-magic")
    with pytest.raises(UnsupportedBackend):
        load_model("tiny-mamba1", dtype=torch.float16)
    m = load_model("tiny-mamba1", backend="reference")
    assert m.with_backend("chunked").backend == "chunked" and m.backend == "reference"


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact"])
def test_overflow_raises_and_does_not_advance(backend):
    model = load_model("tiny-mamba2", backend=backend)
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.module.backbone.layers[1].mixer.out_proj.weight.fill_(float("inf"))
    state = broken.initial_state()
    with pytest.raises(NonFiniteOutput):
        broken.advance(state, [1, 2, 3])
    assert state.equal(model.initial_state())


@pytest.mark.parametrize("backend", ["exact", "reference"])
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_narrow_state_dtype_is_rounded_per_token_so_chunking_stays_exact(preset, state_dtype, backend):
    model = load_model(preset, state_dtype=state_dtype, backend=backend)
    assert load_model(preset, state_dtype=state_dtype).backend == "exact"  # auto, on the CPU
    for other in ("chunked", "triton"):  # they round the state once per call, not once per token
        with pytest.raises(UnsupportedBackend):
            model.with_backend(other)
    assert {t.dtype for t in model.schema.tensors} == {str(state_dtype).removeprefix("torch.")}
    toks = tokens(30, 50)
    full = model.advance(model.initial_state(), toks)
    logits, state = scan_chunks(model, model.initial_state(), toks, [1, 0, 4, 2, 23])
    assert torch.equal(logits, full.logits) and state.equal(full.state)
    assert all(t.dtype == state_dtype for t in state.tensors.values())
    batch = model.advance_batch([model.initial_state(), full.state], [toks[:7], toks[:3]])
    solo = model.advance(full.state, toks[:3])
    assert torch.equal(batch[1].logits, solo.logits) and batch[1].state.equal(solo.state)
    assert torch.equal(batch[0].logits, full.logits[:7])
    # the rounding is real: the float32-state model gives other logits
    wide = model_for(preset, backend)
    assert not torch.equal(wide.advance(wide.initial_state(), toks).logits, full.logits)
    assert model.schema.fingerprint() != wide.schema.fingerprint()


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
@pytest.mark.parametrize("rows", [[2, 0], [1, 2]], ids=["scattered", "span"])
def test_step_rows_equals_advance_batch_and_touches_only_its_rows(preset, backend, rows):
    model = model_for(preset, backend)
    states = [model.advance(model.initial_state(), tokens(n, n)).state for n in (3, 7, 1, 12)]
    buffers = {name: torch.stack([s.tensors[name] for s in states]) for name in states[0].tensors}
    before = {k: v.clone() for k, v in buffers.items()}
    toks = [11, 42]
    logits, path = model.step_rows(buffers, torch.tensor(rows), torch.tensor(toks))
    solo = model.advance_batch([states[r] for r in rows], [[t] for t in toks])
    tol = tolerance(model.config.architecture, backend, "float32")
    for i, (r, res) in enumerate(zip(rows, solo, strict=True)):
        got_state = {k: v[r] for k, v in buffers.items()}
        if backend in ("reference", "exact", "exact-fma"):  # the same arithmetic, bit for bit
            assert torch.equal(logits[i : i + 1], res.logits)
            assert all(torch.equal(got_state[k], res.state.tensors[k]) for k in got_state)
        else:
            assert (tol + tol).logits_excess(logits[i : i + 1], res.logits) <= 1.0
    for r in sorted({0, 1, 2, 3} - set(rows)):  # rows not stepped are untouched
        assert all(torch.equal(buffers[k][r], before[k][r]) for k in buffers)
    assert path in ("recurrent", "step", "exact")


def test_step_rows_of_no_rows_is_a_no_op():
    model = model_for("tiny-mamba2", "reference")
    buffers = {t.name: torch.ones((2, *t.shape)) for t in model.schema.tensors}
    logits, _ = model.step_rows(buffers, torch.tensor([], dtype=torch.long), torch.tensor([], dtype=torch.long))
    assert logits.shape == (0, model.vocab_size)
    assert all(bool((b == 1).all()) for b in buffers.values())


def test_step_rows_writes_nothing_when_it_overflows():
    model = copy.deepcopy(load_model("tiny-mamba2", backend="reference"))
    with torch.no_grad():
        model.module.backbone.layers[1].mixer.out_proj.weight.fill_(float("inf"))
    buffers = {t.name: torch.ones((2, *t.shape)) for t in model.schema.tensors}
    before = {k: v.clone() for k, v in buffers.items()}
    with pytest.raises(NonFiniteOutput):
        model.step_rows(buffers, torch.tensor([0, 1]), torch.tensor([1, 2]))
    assert all(torch.equal(buffers[k], before[k]) for k in buffers)
