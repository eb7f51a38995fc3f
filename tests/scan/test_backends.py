"""Backends: batching, declared tolerances, the misalignment negative control, what ran."""

from __future__ import annotations

import copy

import pytest
import torch

from scan import NonFiniteOutput, UnsupportedBackend, load_model, tolerance
from tests.scan._helpers import model_for, scan_chunks, tokens


def _streams(model, n=5):
    """Streams at different positions (0 included), each with its own next chunk (0 included)."""
    warm = [0, 3, 17, 1, 40][:n]
    states = [model.advance(model.initial_state(), tokens(w, 20 + i)).state for i, w in enumerate(warm)]
    chunks = [tokens(c, 30 + i) for i, c in enumerate([7, 1, 0, 12, 7][:n])]
    return states, chunks


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_reference_advance_batch_is_bit_exact_per_stream(preset, dtype):
    model = model_for(preset, "reference", dtype)
    states, chunks = _streams(model)
    batch = model.advance_batch(states, chunks)
    for s, c, got in zip(states, chunks, batch):
        solo = model.advance(s, c)
        assert torch.equal(got.logits, solo.logits)
        assert got.state.equal(solo.state)
        assert got.state.position == s.position + len(c)


def test_chunked_advance_batch_within_tolerance_per_stream(preset):
    model = model_for(preset, "chunked")
    tol = tolerance(model.config.architecture, "chunked", "float32")
    states, chunks = _streams(model)
    batch = model.advance_batch(states, chunks)
    for s, c, got in zip(states, chunks, batch):
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
    with pytest.raises(Exception):
        model.advance_batch(states, [chunks[0], [999], chunks[2]])
    assert all(s.equal(snap) for s, snap in zip(states, snapshots))


def test_chunked_backend_within_declared_tolerance_and_misalignment_is_caught(preset):
    ref = model_for(preset, "reference")
    fast = model_for(preset, "chunked")
    tol = tolerance(ref.config.architecture, "chunked", "float32")
    warm = tokens(23, 40)
    start = ref.advance(ref.initial_state(), warm).state
    toks = tokens(150, 41)
    truth = ref.advance(start, toks)
    for chunks in ([150], [1] * 10 + [140], [64, 64, 22], [5, 0, 31, 114]):
        logits, state = scan_chunks(fast, start, toks, chunks)
        assert tol.logits_excess(logits, truth.logits) <= 1.0, chunks
        for name, t in state.tensors.items():
            assert tol.state_excess(t, truth.state.tensors[name]) <= 1.0, (chunks, name)
    # Negative controls: a state one position behind, another stream's state, one layer's state
    # taken from another stream. Each must exceed the declared bound at least 10 times over.
    behind = ref.advance(ref.initial_state(), warm[:-1]).state
    other = ref.advance(ref.initial_state(), tokens(23, 42)).state
    swapped = dict(start.tensors)
    for name in [n for n in swapped if n.startswith("layers.1.")]:
        swapped[name] = other.tensors[name]
    for label, bad in (("one position behind", behind), ("another stream", other),
                       ("layer 1 swapped", type(start)(start.position, swapped))):
        got = fast.advance(bad, toks).logits
        assert tol.logits_excess(got, truth.logits) >= 10.0, label


def test_result_records_backend_and_path():
    cases = [
        ("tiny-mamba2", "chunked", 3, ("chunked", "ssd")),
        ("tiny-mamba3", "chunked", 3, ("chunked", "ssd")),
        ("tiny-mamba1", "chunked", 3, ("chunked", "scan")),
        ("tiny-mamba2", "chunked", 1, ("chunked", "step")),
        ("tiny-mamba1", "reference", 3, ("reference", "recurrent")),
        ("tiny-mamba1", "reference", 0, ("reference", "empty")),
    ]
    for preset, backend, n, expected in cases:
        m = model_for(preset, backend)
        r = m.advance(m.initial_state(), tokens(n, 1))
        assert (r.backend, r.path) == expected, (preset, backend, n)


def test_auto_backend_and_unknown_backend():
    assert load_model("tiny-mamba1").backend == "chunked"  # fastest on CPU
    with pytest.raises(UnsupportedBackend):
        load_model("tiny-mamba1", backend="cuda-magic")
    with pytest.raises(UnsupportedBackend):
        load_model("tiny-mamba1", dtype=torch.float16)
    m = load_model("tiny-mamba1", backend="reference")
    assert m.with_backend("chunked").backend == "chunked" and m.backend == "reference"


@pytest.mark.parametrize("backend", ["reference", "chunked"])
def test_overflow_raises_and_does_not_advance(backend):
    model = load_model("tiny-mamba2", backend=backend)
    broken = copy.deepcopy(model)
    with torch.no_grad():
        broken.module.backbone.layers[1].mixer.out_proj.weight.fill_(float("inf"))
    state = broken.initial_state()
    with pytest.raises(NonFiniteOutput):
        broken.advance(state, [1, 2, 3])
    assert state.equal(model.initial_state())


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_narrow_state_dtype_is_rounded_per_token_so_chunking_stays_exact(preset, state_dtype):
    model = load_model(preset, state_dtype=state_dtype)
    assert model.backend == "reference"  # auto: the chunked backend rounds per call, not per token
    with pytest.raises(UnsupportedBackend):
        model.with_backend("chunked")
    assert {t.dtype for t in model.schema.tensors} == {str(state_dtype).removeprefix("torch.")}
    toks = tokens(30, 50)
    full = model.advance(model.initial_state(), toks)
    logits, state = scan_chunks(model, model.initial_state(), toks, [1, 0, 4, 2, 23])
    assert torch.equal(logits, full.logits) and state.equal(full.state)
    assert all(t.dtype == state_dtype for t in state.tensors.values())
    # the rounding is real: the float32-state model gives other logits
    wide = model_for(preset)
    assert not torch.equal(wide.advance(wide.initial_state(), toks).logits, full.logits)
    assert model.schema.fingerprint() != wide.schema.fingerprint()
