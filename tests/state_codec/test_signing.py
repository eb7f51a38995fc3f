"""Ed25519 request signatures: what verifies, and every way a request fails to."""

from __future__ import annotations

import json
import os

import pytest

from mamba_stream.state_codec import BadSignature, RequestRejected, UnknownSigner, UnsignedRequest
from mamba_stream.state_codec.signing import PrincipalKeys, RequestSigner, signing_bytes
from mamba_stream.workflows._models import AdvanceRequest, GenerateRequest, OpenStreamInput
from mamba_stream.workflows.contract import OpenStreamRequest

ALICE = RequestSigner.generate("alice")
BOB = RequestSigner.generate("bob")
KEYS = PrincipalKeys.from_mapping({"alice": ALICE.public_key, "bob": BOB.public_key})


def signed(req: AdvanceRequest, stream: str = "ms-a", signer: RequestSigner = ALICE) -> AdvanceRequest:
    return req.model_copy(update={"signature": signer.sign("advance", stream, req.claims())})


REQ = AdvanceRequest(principal="alice", chunk_seq=3, tokens=[1, 2, 3])


def test_a_signed_request_verifies_and_its_signature_is_deterministic():
    s = signed(REQ)
    KEYS.verify("advance", "ms-a", s.claims(), s.signature)
    assert signed(REQ).signature == s.signature  # re-sending signs to the same bytes


@pytest.mark.parametrize("change", [{"tokens": [1, 2, 4]}, {"chunk_seq": 4}, {"top_k": 6},
                                    {"tokens": None, "text": "x"}])
def test_a_tampered_field_fails(change):
    s = signed(REQ)
    tampered = s.model_copy(update=change)
    with pytest.raises(BadSignature):
        KEYS.verify("advance", "ms-a", tampered.claims(), tampered.signature)


def test_a_request_replayed_to_another_stream_or_as_another_kind_fails():
    s = signed(REQ)
    with pytest.raises(BadSignature):
        KEYS.verify("advance", "ms-b", s.claims(), s.signature)
    with pytest.raises(BadSignature):
        KEYS.verify("generate", "ms-a", s.claims(), s.signature)


def test_unsigned_unknown_principal_and_another_principals_key_are_told_apart():
    with pytest.raises(UnsignedRequest):
        KEYS.verify("advance", "ms-a", REQ.claims(), None)
    carol = AdvanceRequest(principal="carol", chunk_seq=1, tokens=[1])
    with pytest.raises(UnknownSigner):
        KEYS.verify("advance", "ms-a", carol.claims(),
                    RequestSigner.generate("carol").sign("advance", "ms-a", carol.claims()))
    forged = REQ.model_copy(
        update={"signature": RequestSigner("alice", BOB._key).sign("advance", "ms-a", REQ.claims())})
    with pytest.raises(BadSignature) as err:
        KEYS.verify("advance", "ms-a", forged.claims(), forged.signature)
    assert err.value.reason == "BadSignature" and isinstance(err.value, RequestRejected)
    with pytest.raises(BadSignature):
        KEYS.verify("advance", "ms-a", REQ.claims(), "not base64!")


def test_a_signer_refuses_to_sign_for_another_principal():
    with pytest.raises(ValueError, match="signs for 'alice'"):
        ALICE.sign("advance", "ms-a", AdvanceRequest(principal="bob", chunk_seq=1, tokens=[1]).claims())


def test_signed_bytes_are_canonical_and_leave_defaults_out():
    b = signing_bytes("advance", "ms-a", REQ.claims())
    assert b.startswith(b"mamba-stream/request/v1\n")
    assert json.loads(b.split(b"\n", 1)[1]) == {
        "claims": {"principal": "alice", "chunk_seq": 3, "tokens": [1, 2, 3]}, "kind": "advance", "stream_id": "ms-a"}
    g = GenerateRequest(principal="alice", chunk_seq=2, max_tokens=4)
    assert g.claims() == {"principal": "alice", "chunk_seq": 2, "max_tokens": 4}
    with pytest.raises(ValueError):
        signing_bytes("delete-everything", "ms-a", {})


def test_the_start_input_and_the_open_activity_sign_the_same_claims():
    inp = OpenStreamInput(principal="alice", model_id="tiny-mamba2")
    act = OpenStreamRequest(stream_id="ms-a", principal="alice", model_id="tiny-mamba2")
    assert inp.claims() == act.claims() == {"principal": "alice", "model_id": "tiny-mamba2"}
    sig = ALICE.sign("open", "ms-a", inp.claims())
    KEYS.verify("open", "ms-a", act.claims(), sig)


def test_key_specs_round_trip_and_a_readable_key_file_is_refused(tmp_path):
    again = RequestSigner.from_spec(ALICE.spec())
    assert again.principal == "alice" and again.public_key == ALICE.public_key
    path = tmp_path / "alice.key"
    path.write_text(ALICE.spec())
    os.chmod(path, 0o644)
    with pytest.raises(PermissionError):
        RequestSigner.from_spec(str(path))
    os.chmod(path, 0o600)
    assert RequestSigner.from_spec(str(path)).public_key == ALICE.public_key
    keys_file = tmp_path / "keys.json"
    keys_file.write_text(json.dumps({"alice": ALICE.public_key}))
    assert "alice" in PrincipalKeys.from_spec(str(keys_file)) and len(PrincipalKeys.from_spec(str(keys_file))) == 1
    with pytest.raises(ValueError, match="32 bytes"):
        PrincipalKeys.from_mapping({"alice": "AAAA"})
