"""The request models (mamba_stream/workflows/_models.py) by themselves, without a Temporal server: what a
request may hold is refused where the request is built or decoded, typed, before any workflow,
activity or CLI sees it (Issue 31: a model that took both `tokens` and `text` was caught only by
a CLI test, and that test's request is refused anyway, as unsealed, once it is decoded)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError
from temporalio.api.common.v1 import Payload
from temporalio.exceptions import ApplicationError

import mamba_stream.workflows._models as models
from mamba_stream.scan import load_model
from mamba_stream.state_codec.codec import Keyring, seal
from mamba_stream.state_codec.payload import StreamPayloadConverter
from mamba_stream.workflows import AdvanceRequest, InvalidRequest
from mamba_stream.workflows.contract import AdvanceChunkRequest

ONE_INPUT = "give exactly one of tokens and text"

#: (tokens, text) pairs that are not exactly one input: both (empty ones too), and neither
BOTH = [pytest.param([1, 2, 3], "hello", id="both"), pytest.param([], "", id="both-empty"),
        pytest.param([0], "", id="tokens-and-empty-text"), pytest.param([], "x", id="empty-tokens-and-text")]
NEITHER = [pytest.param(None, None, id="neither")]


def _advance(**kw) -> dict:
    return {"principal": "alice", "chunk_seq": 1, **kw}


def _refused(exc: ValidationError) -> None:
    """Refused by the one-input rule, and by nothing else."""
    errors = exc.errors()
    assert len(errors) == 1, errors
    assert errors[0]["type"] == "value_error", errors
    assert ONE_INPUT in errors[0]["msg"], errors


@pytest.mark.parametrize(("tokens", "text"), BOTH + NEITHER)
def test_an_advance_request_takes_exactly_one_of_tokens_and_text(tokens, text):
    with pytest.raises(ValidationError) as built:
        AdvanceRequest(**_advance(tokens=tokens, text=text))
    _refused(built.value)
    body = _advance(**{k: v for k, v in (("tokens", tokens), ("text", text)) if v is not None})
    with pytest.raises(ValidationError) as decoded:  # as the workers decode it: JSON, strict
        AdvanceRequest.model_validate_json(json.dumps(body))
    _refused(decoded.value)


@pytest.mark.parametrize(("tokens", "text"), [([1, 2, 3], None), ([], None), (None, "hello"), (None, "")],
                         ids=["tokens", "empty-tokens", "text", "empty-text"])
def test_an_advance_request_with_one_input_is_taken_as_given(tokens, text):
    req = AdvanceRequest(**_advance(tokens=tokens, text=text))
    assert (req.tokens, req.text) == (tokens, text)
    assert AdvanceRequest.model_validate_json(req.model_dump_json()) == req
    # the signed claims carry the one input given, and nothing for the other
    given = "tokens" if tokens is not None else "text"
    assert {k for k in ("tokens", "text") if k in req.claims()} == {given}


def test_the_advance_activitys_input_refuses_a_request_with_both():
    """The activity's input carries the update's request: decoding it refuses both there too."""
    model = load_model("tiny-mamba2")
    receipt, _ = seal(model, model.initial_state(), stream_id="ms-a", principal="alice", chunk_seq=0, epoch=0,
                      keyring=Keyring.generate())
    body = {"stream_id": "ms-a", "principal": "alice", "receipt": receipt.model_dump(mode="json"),
            "request": _advance(tokens=[1], text="both")}
    one = AdvanceChunkRequest.model_validate_json(json.dumps({**body, "request": _advance(tokens=[1])}))
    assert one.receipt == receipt and one.request.tokens == [1]
    with pytest.raises(ValidationError) as exc:
        AdvanceChunkRequest.model_validate_json(json.dumps(body))
    _refused(exc.value)
    assert exc.value.errors()[0]["loc"] == ("request",)


@pytest.mark.parametrize("body", [_advance(tokens=[1], text="both"), _advance()], ids=["both", "neither"])
def test_a_payload_with_both_or_neither_is_refused_typed_and_for_good(body):
    """What `temporal workflow update --input` sends: plain JSON, decoded by the project's payload
    converter, refused as the catalogue's InvalidRequest (non-retryable), never as an untyped error."""
    payload = Payload(metadata={"encoding": b"json/plain"}, data=json.dumps(body).encode())
    with pytest.raises(ApplicationError) as exc:
        StreamPayloadConverter().from_payloads([payload], [AdvanceRequest])
    assert exc.value.type == InvalidRequest.reason == "InvalidRequest"
    assert exc.value.non_retryable
    assert ONE_INPUT in str(exc.value)


def test_every_caller_request_with_tokens_and_text_is_covered_here():
    """A request model added later with both fields must take exactly one of them as well: the
    tests above name the ones there are. (Results, e.g. GenerateResult, carry both on purpose.)"""
    requests = sorted(name for name, cls in vars(models).items()
                      if isinstance(cls, type) and issubclass(cls, models.SealedRequest)
                      and cls is not models.SealedRequest and {"tokens", "text"} <= set(cls.model_fields))
    assert requests == ["AdvanceRequest"]
