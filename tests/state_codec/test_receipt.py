"""Receipts and the one resume validation: every mismatch typed, named, with both values."""

from __future__ import annotations

import pickle

import pytest
from pydantic import ValidationError

from mamba_stream.scan import load_model
from mamba_stream.state_codec import (
    ChunkSequenceMismatch,
    DTypeMismatch,
    EpochMismatch,
    InputTransformMismatch,
    ModelRevisionMismatch,
    PositionMismatch,
    PrincipalMismatch,
    Receipt,
    SchemaMismatch,
    StateRejected,
    StreamMismatch,
    schema_diff,
    validate_resume,
)
from mamba_stream.state_codec.codec import Keyring, seal

RING = Keyring.generate()


@pytest.fixture(scope="module")
def sealed():
    model = load_model("tiny-mamba2")
    state = model.advance(model.initial_state(), [1, 2, 3, 4]).state
    receipt, _ = seal(model, state, stream_id="s-1", principal="alice", chunk_seq=2, epoch=0, keyring=RING)
    return model, receipt


def test_receipt_is_small_strict_and_frozen(sealed):
    _, r = sealed
    assert len(r.model_dump_json().encode()) < 1024  # the issue asks for well under 4 KiB
    assert Receipt.model_validate_json(r.model_dump_json()) == r
    with pytest.raises(ValidationError):
        r.position = 9
    with pytest.raises(ValidationError):
        Receipt.model_validate({**r.model_dump(), "position": "4"})  # strict: no coercion
    with pytest.raises(ValidationError):
        Receipt.model_validate({**r.model_dump(), "checksum": "md5:abc"})
    with pytest.raises(ValidationError):
        Receipt.model_validate({**r.model_dump(), "position": -1})
    for field in ("stream_id", "principal", "model_id", "model_revision", "code_revision", "input_transform",
                  "schema_fingerprint", "schema_version", "dtype", "position", "chunk_seq", "epoch",
                  "state_key", "checksum", "backend"):
        assert getattr(r, field) is not None


def test_validation_passes_for_the_right_caller(sealed):
    model, r = sealed
    validate_resume(r, model.identity(), "alice", stream_id="s-1", position=4, chunk_seq=2, epoch=0)


@pytest.mark.parametrize(
    "kwargs,update,error,field",
    [
        ({"stream_id": "s-2"}, {}, StreamMismatch, "stream_id"),
        ({}, {"principal": "bob"}, PrincipalMismatch, "principal"),
        ({}, {"model_revision": "sha256:" + "a" * 64}, ModelRevisionMismatch, "model_revision"),
        ({}, {"input_transform": "hf-tokenizers"}, InputTransformMismatch, "input_transform"),
        ({}, {"input_transform_revision": "utf-8/v0"}, InputTransformMismatch, "input_transform_revision"),
        ({}, {"dtype": "bfloat16"}, DTypeMismatch, "dtype"),
        ({}, {"architecture": "mamba3"}, SchemaMismatch, "schema.architecture"),
        ({}, {"schema_version": 0}, SchemaMismatch, "schema.schema_version"),
        ({}, {"schema_fingerprint": "sha256:" + "b" * 64}, SchemaMismatch, "schema.fingerprint"),
        ({"position": 5}, {}, PositionMismatch, "position"),
        ({"chunk_seq": 3}, {}, ChunkSequenceMismatch, "chunk_seq"),
        ({"epoch": 1}, {}, EpochMismatch, "epoch"),
    ],
)
def test_each_mismatch_is_typed_and_names_both_values(sealed, kwargs, update, error, field):
    model, r = sealed
    bad = r.model_copy(update=update)
    with pytest.raises(error) as exc:
        validate_resume(bad, model.identity(), "alice", **kwargs)
    e = exc.value
    assert isinstance(e, StateRejected) and e.field == field
    assert e.expected is not None and e.actual is not None and e.expected != e.actual
    assert field in str(e) and repr(e.actual) in str(e)
    again = pickle.loads(pickle.dumps(e))  # travels through failure details intact
    assert (type(again), again.field, again.expected, again.actual) == (error, e.field, e.expected, e.actual)
    assert e.details()["reason"] == error.reason


def test_first_mismatch_wins(sealed):
    model, r = sealed
    bad = r.model_copy(update={"principal": "bob", "position": 99})
    with pytest.raises(PrincipalMismatch):
        validate_resume(bad, model.identity(), "alice", position=4)


def test_schema_diff_names_the_nested_field():
    a = load_model("tiny-mamba3").schema
    b = a.model_copy(update={"discretization": a.discretization.model_copy(update={"rope": "halved"})})
    assert schema_diff(a, a) is None
    assert schema_diff(a, b) == ("schema.discretization.rope", "pairwise", "halved")
    c = load_model("tiny-mamba1").schema
    path, _, _ = schema_diff(a, c)
    assert path.startswith("schema.")
