"""The receipt's arithmetic: what decided a state's bits, carried along a stream and counted when it changes."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from mamba_stream.scan import load_model
from mamba_stream.state_codec import Arithmetic, Receipt, arithmetic_moved, continue_arithmetic
from mamba_stream.state_codec.codec import Keyring, seal

RING = Keyring.generate()

FIELDS = dict(backend="exact", path="exact", dtype="float32", torch="2.13.0+cpu", blas="mkl-2024.2-Product",
              cpu_capability="AVX2", threads=2, device="cpu")


def exact(**kw) -> Arithmetic:
    return Arithmetic(**{"scheme": "exact-1", **FIELDS, **kw})


def torch_(**kw) -> Arithmetic:
    return Arithmetic(**{"scheme": "torch", **FIELDS, "backend": "chunked", "path": "chunked", **kw})


def test_the_exact_id_is_the_scheme_and_dtype_and_nothing_the_machine_chooses():
    a = exact()
    assert a.id == "exact-1/float32" and a.exact
    for other in (dict(cpu_capability="AVX512"), dict(threads=1), dict(blas="openblas"), dict(torch="2.14.0"),
                  dict(path="exact-twin")):
        assert exact(**other).id == a.id, other  # kernels and twins, any CPU: the same bits
    assert exact(dtype="float64").id != a.id
    assert exact(scheme="exact-2").id != a.id  # a new version of the arithmetic is other bits


def test_a_torch_id_names_everything_that_moves_its_bits():
    a = torch_()
    assert not a.exact and a.id.startswith("torch/chunked/")
    for other in (dict(cpu_capability="AVX512"), dict(threads=1), dict(blas="openblas"), dict(torch="2.14.0"),
                  dict(backend="reference"), dict(dtype="float64"), dict(device="cuda")):
        assert torch_(**other).id != a.id, other
    assert torch_(path="step").id == a.id  # the path within a chunk is the chunking's business


def test_an_id_that_does_not_follow_from_its_fields_is_refused():
    a = exact()
    assert Arithmetic.model_validate_json(a.model_dump_json()) == a
    with pytest.raises(ValidationError, match="does not follow"):
        Arithmetic.model_validate({**a.model_dump(), "cpu_capability": "AVX512", "id": torch_().id})
    with pytest.raises(ValidationError, match="does not follow"):
        Arithmetic.model_validate({**torch_().model_dump(), "id": "exact-1/float32"})  # a claim of exactness


@pytest.fixture(scope="module")
def receipts():
    model = load_model("tiny-mamba2", backend="exact")
    s0 = model.initial_state()
    s1 = model.advance(s0, [1, 2, 3]).state
    s2 = model.advance(s1, [4, 5]).state

    def make(state, seq, before, arith):
        return seal(model, state, stream_id="s", principal="p", chunk_seq=seq, epoch=0, keyring=RING,
                    arithmetic=continue_arithmetic(before, arith))[0]

    return model, s1, s2, make


def test_the_same_arithmetic_carries_a_change_counts_and_moves_since(receipts):
    model, s1, s2, make = receipts
    a, b = exact(), torch_()
    r0 = make(model.initial_state(), 0, None, a)
    assert (r0.arithmetic, r0.arithmetic_since, r0.arithmetic_changes) == (a, 0, 0)
    r1 = make(s1, 1, r0, a)
    assert (r1.arithmetic_since, r1.arithmetic_changes) == (0, 0)
    # the same bits on another CPU: the same id, no change
    r1b = make(s1, 1, r0, exact(cpu_capability="AVX512", threads=1))
    assert (r1b.arithmetic_since, r1b.arithmetic_changes) == (0, 0)
    moved = make(s2, 2, r1, b)
    assert (moved.arithmetic.id, moved.arithmetic_since, moved.arithmetic_changes) == (b.id, 3, 1)
    back = make(s2, 2, moved, a)
    assert (back.arithmetic_since, back.arithmetic_changes) == (5, 2)
    assert arithmetic_moved(r1, moved) and arithmetic_moved(moved, back)
    assert not arithmetic_moved(r0, r1) and not arithmetic_moved(r1, r1b) and not arithmetic_moved(None, moved)
    assert not arithmetic_moved(moved.model_copy(update={"epoch": 1}), back)  # a reset is a new epoch
    # at position 0 every arithmetic has the same state: no change
    assert make(s1, 1, make(model.initial_state(), 0, None, b), a).arithmetic_changes == 0
    # a receipt from before arithmetic was recorded cannot vouch for its bits
    legacy = r1.model_copy(update={"arithmetic": None})
    assert make(s2, 2, legacy, a).arithmetic_changes == 1


def test_the_arithmetic_fields_are_optional_and_checked(receipts):
    _model, s1, _, make = receipts
    r = make(s1, 1, None, exact())
    old = {k: v for k, v in r.model_dump().items() if not k.startswith("arithmetic")}
    legacy = Receipt.model_validate(old)  # a receipt written before these fields existed
    assert legacy.arithmetic is None and legacy.arithmetic_changes == 0
    assert Receipt.model_validate_json(r.model_dump_json()) == r
    assert len(r.model_dump_json().encode()) < 1536
    with pytest.raises(ValidationError, match="past the position"):
        Receipt.model_validate({**r.model_dump(), "arithmetic_since": r.position + 1})
    with pytest.raises(ValidationError):
        Receipt.model_validate({**r.model_dump(), "arithmetic_changes": -1})


def test_a_model_names_its_own_arithmetic():
    ex = load_model("tiny-mamba1", backend="exact")
    ch = load_model("tiny-mamba1", backend="chunked")
    assert ex.arithmetic().exact and ex.arithmetic().path == ex.exact_probe.path
    assert ex.arithmetic().id == "exact-1/float32"
    assert not ch.arithmetic().exact and ch.arithmetic().backend == "chunked"
    assert ch.arithmetic("step").path == "step"
    assert load_model("tiny-mamba1", backend="exact", dtype=torch.float64).arithmetic().id == "exact-1/float64"
