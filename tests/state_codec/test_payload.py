"""The payload codec (`state_codec.payload.EncryptionCodec`): whose key a payload goes under.

Issue 31, item 4: only master keyrings encoded in the tests, so nothing checked that a principal's
client writes under its own history key and tag whatever stream the serialization context names:
it holds no other key, and a payload it sends to bob's stream must still say (and be) alice's, for
the workers to tell who sealed it."""

from __future__ import annotations

import pytest
from temporalio.converter import DataConverter, WorkflowSerializationContext
from temporalio.exceptions import ApplicationError

from mamba_stream.state_codec._sealing import SEALED_ATTR, SEALER_KEY
from mamba_stream.state_codec.keyring import Keyring
from mamba_stream.state_codec.payload import (
    ENCRYPTED_ENCODING,
    UNDECRYPTABLE_ENCODING,
    EncryptionCodec,
    StreamPayloadConverter,
    sealed_for_stream,
)
from mamba_stream.workflows import new_stream_id
from mamba_stream.workflows._models import AdvanceRequest

#: in every plaintext value below, so that a payload that leaves (or comes back) in clear is seen
_MARK = "issue31-item4-plaintext"


def _values() -> list[tuple[object, type]]:
    """A value of a few kinds a client sends, with the type hint that decodes it."""
    return [
        ({"text": f"{_MARK}-dict", "n": 3}, dict),
        (AdvanceRequest(principal="alice", chunk_seq=2, text=f"{_MARK}-pydantic"), AdvanceRequest),
        (f"{_MARK}-bytes".encode(), bytes),
    ]


def _expected(value: object, sealer: str) -> object:
    """`value` as it comes out of the converter: a request model says who sealed it."""
    if isinstance(value, AdvanceRequest):
        out = value.model_copy()
        setattr(out, SEALED_ATTR, sealer)
        return out
    return value


@pytest.mark.parametrize("context", [None, "alice", "bob", "master"],
                         ids=["no-context", "alices-stream", "bobs-stream", "master-key-stream"])
async def test_a_principals_client_encodes_under_its_own_tag_whatever_stream_the_context_names(context):
    master = Keyring.generate()
    alice, bob = master.for_principal("alice"), master.for_principal("bob")
    tag = master.principal_tag("alice")
    assert alice.tag == tag != bob.tag
    sids = {"alice": new_stream_id(tag), "bob": new_stream_id(master.principal_tag("bob")),
            "master": new_stream_id()}
    assert sids["bob"].startswith(f"ms.{bob.tag}.")

    # alice's client, as the SDK runs it: the data converter cloned with the stream's context
    conv = DataConverter(payload_converter_class=StreamPayloadConverter, payload_codec=EncryptionCodec(alice))
    if context is not None:
        conv = conv.with_context(WorkflowSerializationContext(namespace="default", workflow_id=sids[context]))
    values = [v for v, _ in _values()]
    hints = [h for _, h in _values()]
    encoded = await conv.encode(values)

    assert len(encoded) == len(values)
    for p in encoded:
        # under alice's history key: her tag, the active key id, nothing else in clear
        assert dict(p.metadata) == {"encoding": ENCRYPTED_ENCODING, "encryption-key-id": alice.active_id.encode(),
                                    "encryption-tag": tag.encode()}
        assert _MARK.encode() not in p.data
        assert sealed_for_stream(p, sids["alice"]) and not sealed_for_stream(p, sids["bob"])

    # alice's keyring opens them (in the same context and in none), and so do the workers' (in
    # bob's stream's context, as his stream's worker would): each says alice's key sealed it
    readers = {"alice": EncryptionCodec(alice), "alice in context": conv.payload_codec,
               "workers": EncryptionCodec(master),
               "workers in bob's stream": EncryptionCodec(master).with_context(
                   WorkflowSerializationContext(namespace="default", workflow_id=sids["bob"]))}
    for who, codec in readers.items():
        opened = await codec.decode(encoded)
        assert [p.metadata[SEALER_KEY] for p in opened] == [tag.encode()] * len(values), who
        back = StreamPayloadConverter().from_payloads(opened, hints)
        assert back == [_expected(v, tag) for v in values], who

    # bob's keyring does not: each one refuses, typed, to become a value, and shows nothing
    for p in await EncryptionCodec(bob).decode(encoded):
        assert p.metadata["encoding"] == UNDECRYPTABLE_ENCODING and p.metadata["reason"] == b"UnknownKeyId"
        assert b"another principal's history key" in p.data and _MARK.encode() not in p.data
        assert SEALER_KEY not in p.metadata
        with pytest.raises(ApplicationError) as err:
            StreamPayloadConverter().from_payloads([p], [dict])
        assert err.value.type == "UnknownKeyId" and err.value.non_retryable
