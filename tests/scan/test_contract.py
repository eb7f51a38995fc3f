"""The seed's eight streaming-state assertions, on the real models of every architecture.

Reference backend, float32: every equality here is bit-for-bit (torch.equal on full logits
matrices and on every state tensor), never a last-token or tolerance comparison.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from mamba_stream.scan import (
    InvalidInput,
    InvalidState,
    NonFiniteInput,
    NonIntegerInput,
    State,
    TokenOutOfRange,
)
from tests.scan._helpers import model_for, scan_chunks, tokens

N = 40
CHUNKS = [3, 1, 0, 7, 2, 13, 14]


def test_1_chunked_outputs_equal_full_outputs(preset):
    model = model_for(preset)
    toks = tokens(N, 1)
    full = model.advance(model.initial_state(), toks)
    logits, _ = scan_chunks(model, model.initial_state(), toks, CHUNKS)
    assert full.logits.dtype == torch.float32 and full.logits.shape == (N, model.vocab_size)
    assert torch.equal(logits, full.logits)


@pytest.mark.parametrize("backend", ["reference", "chunked", "exact", "exact-fma"])
def test_1b_a_prefills_last_row_alone_is_the_last_row_of_all_and_the_state_the_same(preset, backend):
    """logits="last" runs the head on each stream's last token only: that row's bits, the same
    state, alone and in a batch of streams of other lengths' groups; 0 tokens give 0 rows; any
    other value is refused, typed, before anything runs."""
    model = model_for(preset, backend)
    toks = tokens(N, 11)
    full = model.advance(model.initial_state(), toks)
    last = model.advance(model.initial_state(), toks, logits="last")
    assert last.logits.shape == (1, model.vocab_size) and torch.equal(last.logits, full.logits[-1:])
    assert all(torch.equal(last.state.tensors[k], full.state.tensors[k]) for k in full.state.tensors)
    step = model.advance(full.state, toks[:1], logits="last")
    assert torch.equal(step.logits, model.advance(full.state, toks[:1]).logits)
    a, b, e = model.advance_batch([model.initial_state()] * 3, [toks, toks[:7], []], logits="last")
    assert torch.equal(a.logits, full.logits[-1:]) and e.logits.shape == (0, model.vocab_size)
    assert torch.equal(b.logits, model.advance(model.initial_state(), toks[:7]).logits[-1:])
    with pytest.raises(InvalidInput, match="logits"):
        model.advance(model.initial_state(), toks, logits="first")


def test_2_chunked_final_state_equals_full_final_state(preset):
    model = model_for(preset)
    toks = tokens(N, 2)
    full = model.advance(model.initial_state(), toks)
    _, state = scan_chunks(model, model.initial_state(), toks, CHUNKS)
    assert state.equal(full.state)
    assert list(state.tensors) == [t.name for t in model.schema.tensors]


def test_3_empty_chunk_changes_nothing(preset):
    model = model_for(preset)
    toks = tokens(N, 3)
    mid = model.advance(model.initial_state(), toks[:17]).state
    empty = model.advance(mid, [])
    assert empty.logits.shape == (0, model.vocab_size)
    assert empty.state.equal(mid) and empty.path == "empty"
    full = model.advance(model.initial_state(), toks)
    logits, state = scan_chunks(model, model.initial_state(), toks, [0, N, 0])
    assert torch.equal(logits, full.logits) and state.equal(full.state)


def test_4_position_equals_tokens_consumed(preset):
    model = model_for(preset)
    state, total = model.initial_state(), 0
    assert state.position == 0
    for c in CHUNKS:
        state = model.advance(state, tokens(c, c)).state
        total += c
        assert state.position == total


def test_5_reset_separates_streams(preset):
    """Inequality control: A then B differs from B alone; reset then B equals fresh B."""
    model = model_for(preset)
    a, b = tokens(20, 5), tokens(20, 6)
    after_a = model.advance(model.initial_state(), a).state
    a_then_b = model.advance(after_a, b)
    fresh_b = model.advance(model.initial_state(), b)
    reset_b = model.advance(model.initial_state(), b)  # reset = a new initial state, position 0
    assert not torch.equal(a_then_b.logits, fresh_b.logits)
    assert not a_then_b.state.equal(fresh_b.state)
    assert torch.equal(reset_b.logits, fresh_b.logits) and reset_b.state.equal(fresh_b.state)
    assert reset_b.state.position == len(b)


def test_6_reordered_chunks_differ(preset):
    model = model_for(preset)
    toks = tokens(N, 7)
    full = model.advance(model.initial_state(), toks)
    swapped = toks[20:] + toks[:20]
    logits, state = scan_chunks(model, model.initial_state(), swapped, [20, 20])
    assert not torch.equal(logits, full.logits)
    assert not state.equal(full.state)
    # applying a chunk twice also differs from applying it once
    twice = model.advance(model.advance(model.initial_state(), toks[:20]).state, toks[:20])
    once = model.advance(model.initial_state(), toks[:20])
    assert not twice.state.equal(once.state)


@pytest.mark.parametrize(
    "bad,error",
    [
        ([1, 2, 256], TokenOutOfRange),
        ([1, -1], TokenOutOfRange),
        ([2**70], TokenOutOfRange),
        ([1, 2.5], NonIntegerInput),
        ([1, float("nan")], NonFiniteInput),
        ([1, True], NonIntegerInput),
        ("hello", NonIntegerInput),
        ([[1, 2]], NonIntegerInput),
        (torch.tensor([1.0, 2.0]), NonIntegerInput),
        (torch.tensor([1.0, math.nan]), NonFiniteInput),
        (torch.tensor([[1, 2]]), NonIntegerInput),
        (None, NonIntegerInput),
    ],
)
def test_7_invalid_input_raises_typed_error_and_changes_nothing(preset, bad, error):
    model = model_for(preset)
    toks = tokens(12, 8)
    state = model.advance(model.initial_state(), toks).state
    snapshot = state.clone()
    with pytest.raises(error) as exc:
        model.advance(state, bad)
    assert isinstance(exc.value, InvalidInput)
    assert state.equal(snapshot)  # nothing advanced in place
    # and the stream continues exactly as if the bad call had never happened
    after = model.advance(state, [5, 6, 7])
    assert torch.equal(after.logits, model.advance(snapshot, [5, 6, 7]).logits)


def test_7b_nan_in_float_input_embeddings(preset):
    model = model_for(preset)
    state = model.advance(model.initial_state(), tokens(9, 9)).state
    snapshot = state.clone()
    emb = torch.randn(4, model.config.d_model)
    emb[2, 5] = float("nan")
    with pytest.raises(NonFiniteInput) as exc:
        model.advance_embeddings(state, emb)
    assert exc.value.position == 2
    assert state.equal(snapshot)
    # the embeddings path, fed the embedding rows of tokens, equals the token path bit for bit
    toks = [3, 1, 4, 1]
    rows = model.module.backbone.embedding.weight[toks]
    by_emb = model.advance_embeddings(state, rows)
    by_ids = model.advance(state, toks)
    assert torch.equal(by_emb.logits, by_ids.logits) and by_emb.state.equal(by_ids.state)


def test_7c_invalid_state_raises_typed_error(preset):
    model = model_for(preset)
    good = model.initial_state()
    names = list(good.tensors)
    with pytest.raises(InvalidState):
        model.advance(State(-1, good.tensors), [1])
    with pytest.raises(InvalidState):
        model.advance(State(0, {n: good.tensors[n] for n in reversed(names)}), [1])
    with pytest.raises(InvalidState) as exc:
        model.advance(State(0, {**good.tensors, names[0]: good.tensors[names[0]].double()}), [1])
    assert exc.value.field.endswith(".dtype")
    shape_bad = {**good.tensors, names[1]: torch.zeros(3)}
    with pytest.raises(InvalidState) as exc:
        model.advance(State(0, shape_bad), [1])
    assert exc.value.field.endswith(".shape")
    nan_state = {n: t.clone() for n, t in good.tensors.items()}
    nan_state[names[-1]].view(-1)[0] = float("nan")
    with pytest.raises(InvalidState):
        model.advance(State(3, nan_state), [1])
    # another architecture's state is rejected by name or shape, never reinterpreted
    other = model_for("tiny-mamba2" if model.config.architecture != "mamba2" else "tiny-mamba1")
    with pytest.raises(InvalidState):
        model.advance(other.initial_state(), [1])


def test_8_repeatable_and_returned_state_never_mutated(preset):
    model = model_for(preset)
    toks = tokens(N, 10)
    first = model.advance(model.initial_state(), toks[:25])
    second = model.advance(model.initial_state(), toks[:25])
    assert torch.equal(first.logits, second.logits) and first.state.equal(second.state)
    kept = first.state
    snapshot = kept.clone()
    for _ in range(3):  # later calls from, and beyond, the kept state
        nxt = model.advance(kept, toks[25:])
        model.advance(nxt.state, toks[:5])
    assert kept.equal(snapshot)
    # the input state is never written, also not through tensors shared with the caller
    init = model.initial_state()
    init_snapshot = init.clone()
    model.advance(init, toks)
    assert init.equal(init_snapshot)


def test_numpy_and_tensor_tokens_are_accepted(preset):
    model = model_for(preset)
    toks = tokens(10, 11)
    a = model.advance(model.initial_state(), toks)
    b = model.advance(model.initial_state(), np.array(toks, dtype=np.int64))
    c = model.advance(model.initial_state(), torch.tensor(toks, dtype=torch.int32))
    d = model.advance(model.initial_state(), [np.int16(t) for t in toks])
    for other in (b, c, d):
        assert torch.equal(a.logits, other.logits) and a.state.equal(other.state)


def test_state_bytes_are_constant_and_match_schema(preset):
    model = model_for(preset, backend="chunked")
    short = model.advance(model.initial_state(), tokens(10, 12)).state
    long = model.advance(model.initial_state(), tokens(600, 13)).state
    assert short.nbytes == long.nbytes == model.schema.state_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_the_finite_check_agrees_with_isfinite_on_every_kind_of_bad_value(dtype):
    from mamba_stream.scan._model import all_finite

    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 129, generator=gen) * 100).to(dtype)
    assert all_finite(x) and all_finite(x[:0]) and all_finite(torch.finfo(dtype).max * torch.ones(3, dtype=dtype))
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in ((0, 0), (17, 64), (63, 128)):
            y = x.clone()
            y[at] = bad
            assert all_finite(y) is False and bool(torch.isfinite(y).all()) is False, (bad, at)
    both = x.clone()
    both[1, 1], both[2, 2] = float("inf"), -float("inf")
    assert not all_finite(both)
