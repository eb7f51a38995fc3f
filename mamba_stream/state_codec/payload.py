"""Temporal payload codec: every payload in history encrypted with the keyring.

Encoded payloads carry `encoding: binary/encrypted` and the key id; their data is the 12-byte
nonce followed by the AES-256-GCM ciphertext of the original serialized payload. Payloads
without that encoding (plain JSON typed into the Temporal CLI, say) pass through decoding as
they are, marked as sealed by nobody: a stream refuses them as requests (`state_codec._sealing`).

Every payload the codec decodes says who sealed it (`SEALER_KEY` in its metadata: the tag of the
principal whose history key opened it, "master" for the workers' key, "clear" for none), written
by the codec over anything the sender put there; the payload converter hands it to the request
model, and the stream workflow acts only on what its own principal's key (or the operator's)
sealed.

A payload this keyring cannot open (another keyring's key id, or altered bytes) is not an error
in the codec: the codec runs before the workflow code, where an error either fails the workflow
task again and again (the stream looks Running and never moves) or fails whatever workflow the
payload was sent to. Instead it decodes to a `binary/undecryptable` payload naming the key id,
and `SealedPayloadConverter` turns that into a typed, non-retryable `ApplicationError` at the
point of use: a stream's start input fails the stream at once with `UnknownKeyId` (the client
that opened it is told in one line, nothing is left Running); an update's input rejects that
update only, and the stream goes on serving the clients that hold the right keys.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import BaseModel, ValidationError
from temporalio.api.common.v1 import Payload
from temporalio.api.failure.v1 import Failure
from temporalio.contrib.pydantic import PydanticJSONPlainPayloadConverter, PydanticPayloadConverter
from temporalio.converter import (
    DefaultFailureConverterWithEncodedAttributes,
    EncodingPayloadConverter,
    PayloadCodec,
    SerializationContext,
    WithSerializationContext,
)
from temporalio.exceptions import ApplicationError

from mamba_stream.failures import invalid_request
from mamba_stream.state_codec._errors import CorruptBlob, UnknownKeyId
from mamba_stream.state_codec._sealing import (
    CLEAR,
    FAILURE_SEALER_ATTR,
    MASTER,
    SEALED_ATTR,
    SEALER_KEY,
    stream_tag,
)
from mamba_stream.state_codec.keyring import Keyring

__all__ = ["ENCODED_FAILURE", "ENCRYPTED_ENCODING", "UNDECRYPTABLE_ENCODING", "EncryptionCodec",
           "SealedPayloadConverter", "StreamModelsJSONConverter", "StreamPayloadConverter", "TypedFailureConverter",
           "sealed_for_stream",
           "stream_principal", "with_sealer"]

ENCRYPTED_ENCODING = b"binary/encrypted"
UNDECRYPTABLE_ENCODING = b"binary/undecryptable"
_AAD = b"mamba-stream/payload/v1"
_KID = "encryption-key-id"
_TAG = "encryption-tag"  # set when the payload is under the history key of the principal with that tag


#: the principal tag a stream id names (`state_codec._sealing.stream_tag`)
stream_principal = stream_tag


def with_sealer(payload: Payload, sealer: str) -> Payload:
    """`payload` marked as sealed by `sealer` (a tag, MASTER or CLEAR), whatever it said before."""
    out = Payload()
    out.CopyFrom(payload)
    out.metadata[SEALER_KEY] = sealer.encode()
    return out


def sealed_for_stream(payload: Payload, workflow_id: str) -> bool:
    """Whether `payload` is encrypted as the workers write the stream's payloads: under the
    history key of the principal its id names (the master key for an id that names none). A
    payload in clear, or under another principal's key, did not come from the workers (anyone
    who reaches the frontend can write an activity's heartbeat details by its id, say)."""
    if payload.metadata.get("encoding") != ENCRYPTED_ENCODING:
        return False
    tag = stream_principal(workflow_id)
    return payload.metadata.get(_TAG) == (tag.encode() if tag is not None else None)


class EncryptionCodec(PayloadCodec, WithSerializationContext):
    """AES-256-GCM over whole payloads.

    A stream's payloads (its workflow's, its activities', its queries' and updates' results, its
    failures) are encrypted under the history key of the principal whose tag its id names
    (`stream_principal`): the SDK hands the codec each payload's workflow id (`with_context`).
    The payload's metadata names the master key id and the tag, which is all a worker needs to
    derive the key (the tag is a keyed hash: it does not say who the principal is). A principal's
    keyring holds only its own keys, so it opens its own streams' payloads and no one else's
    (typed `UnknownKeyId`, never garbage). Payloads of no such stream go under the master key
    (readable by master holders only), except that a principal's keyring always writes under its
    own key.
    """

    def __init__(self, keyring: Keyring, tag: str | None = None) -> None:
        self._keyring = keyring
        self._tag = tag
        self._ciphers: dict[tuple[str, str | None], AESGCM] = {}
        self._by_tag: dict[str | None, EncryptionCodec] = {tag: self}  # with_context: one codec per principal

    @property
    def keyring(self) -> Keyring:
        return self._keyring

    def with_context(self, context: SerializationContext) -> EncryptionCodec:
        workflow_id = getattr(context, "workflow_id", None)
        tag = stream_principal(workflow_id) if isinstance(workflow_id, str) else None
        if tag == self._tag:
            return self
        codec = self._by_tag.get(tag)
        if codec is None:
            codec = self._by_tag[tag] = EncryptionCodec(self._keyring, tag)
            codec._ciphers = self._ciphers  # one cache: keys depend on (kid, tag) only
            codec._by_tag = self._by_tag
        return codec

    def _cipher(self, kid: str, tag: str | None) -> AESGCM | None:
        c = self._ciphers.get((kid, tag))
        if c is None and kid in self._keyring.ids:
            if tag is None and self._keyring.principal is not None:
                return None  # a principal's keyring holds no master key
            try:
                key = self._keyring.key(kid) if tag is None else self._keyring.history_key(kid, tag)
            except UnknownKeyId:
                return None
            c = self._ciphers[(kid, tag)] = AESGCM(key)
        return c

    def encrypt(self, payload: Payload) -> Payload:
        if SEALER_KEY in payload.metadata:  # a decoded payload sent on: who sealed it is the decoder's word
            payload = Payload(metadata={k: v for k, v in payload.metadata.items() if k != SEALER_KEY},
                              data=payload.data)
        kid = self._keyring.active_id
        tag = self._tag if self._keyring.tag is None else self._keyring.tag
        nonce = os.urandom(12)
        cipher = self._cipher(kid, tag)
        if cipher is None:  # unreachable for a keyring's own active key; kept typed
            raise ApplicationError(f"this keyring holds the history keys of {self._keyring.principal!r} only",
                                   type=UnknownKeyId.reason, non_retryable=True)
        aad = _AAD if tag is None else _AAD + b"|" + tag.encode()
        data = nonce + cipher.encrypt(nonce, payload.SerializeToString(), aad)
        meta = {"encoding": ENCRYPTED_ENCODING, _KID: kid.encode()}
        if tag is not None:
            meta[_TAG] = tag.encode()
        return Payload(metadata=meta, data=data)

    def decrypt(self, payload: Payload) -> Payload:
        """The original payload marked with who sealed it, or (when this keyring cannot open it) a
        `binary/undecryptable` one."""
        if payload.metadata.get("encoding") != ENCRYPTED_ENCODING:
            return with_sealer(payload, CLEAR) if payload.metadata.get("encoding") != UNDECRYPTABLE_ENCODING \
                else payload
        kid = payload.metadata.get(_KID, b"").decode(errors="replace")
        tag = payload.metadata[_TAG].decode(errors="replace") if _TAG in payload.metadata else None
        cipher = self._cipher(kid, tag)
        if cipher is None:
            if self._keyring.principal is not None and tag != self._keyring.tag:
                whose = "another principal's history key" if tag else "the workers' master key"
                return _undecryptable(UnknownKeyId.reason, kid,
                                      f"the payload is encrypted under {whose}; this keyring holds the history keys "
                                      f"of {self._keyring.principal!r} only")
            return _undecryptable(UnknownKeyId.reason, kid,
                                  f"the payload is encrypted under key id {kid!r}, which the receiving "
                                  f"keyring does not hold: the client and the workers use different keyrings")
        aad = _AAD if tag is None else _AAD + b"|" + tag.encode()
        try:
            plain = cipher.decrypt(payload.data[:12], payload.data[12:], aad)
        except InvalidTag:
            return _undecryptable(CorruptBlob.reason, kid, f"the payload under key id {kid!r} fails authentication")
        return with_sealer(Payload.FromString(plain), tag if tag is not None else MASTER)

    async def encode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.encrypt(p) for p in payloads]

    async def decode(self, payloads: Sequence[Payload]) -> list[Payload]:
        return [self.decrypt(p) for p in payloads]


def _undecryptable(reason: str, kid: str, message: str) -> Payload:
    return Payload(metadata={"encoding": UNDECRYPTABLE_ENCODING, "reason": reason.encode(), _KID: kid.encode()},
                   data=message.encode())


class SealedPayloadConverter(EncodingPayloadConverter):
    """Refuses, typed, to turn a payload the codec could not open into a value."""

    @property
    def encoding(self) -> str:
        return UNDECRYPTABLE_ENCODING.decode()

    def to_payload(self, value: Any) -> Payload | None:
        return None  # never encodes anything

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        reason = payload.metadata.get("reason", b"CorruptBlob").decode(errors="replace")
        # no details: they would be encrypted for a reader that, by now, evidently lacks the key
        raise ApplicationError(payload.data.decode(errors="replace"), type=reason, non_retryable=True)


class _TypedJSONPayloadConverter(PydanticJSONPlainPayloadConverter):
    """Pydantic JSON, where a payload that does not validate is refused typed: a non-retryable
    `InvalidRequest` naming the fields, not an untyped, retryable ValidationError. A request model
    (one with the private attribute `SEALED_ATTR`) is told who sealed it."""

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        try:
            value = super().from_payload(payload, type_hint)
        except ValidationError as exc:
            raise invalid_request(getattr(type_hint, "__name__", "value"), exc) from None
        private = getattr(value, "__private_attributes__", None)
        if private and SEALED_ATTR in private:
            # who sealed the request, as the codec found (None: it did not pass through one)
            sealer = payload.metadata.get(SEALER_KEY)
            setattr(value, SEALED_ATTR, sealer.decode(errors="replace") if sealer is not None else None)
        return value


def _ours(hint: Any) -> bool:
    """Whether `hint` is a model of this package's (or one built on its requests): one that
    `StreamPayloadConverter` converts."""
    return isinstance(hint, type) and issubclass(hint, BaseModel) and (
        hint.__module__.startswith("mamba_stream.") or SEALED_ATTR in (hint.__private_attributes__ or {}))


class StreamModelsJSONConverter(EncodingPayloadConverter):
    """The json/plain converter of another library's composite converter (the OpenAI Agents
    plugin's), with this package's models converted as `StreamPayloadConverter` converts them:
    the same bytes, who sealed a request recorded (a stream workflow on the same worker checks it),
    a payload that does not validate refused typed. Every other value goes to `other`."""

    def __init__(self, other: EncodingPayloadConverter) -> None:
        self.other, self.ours = other, _TypedJSONPayloadConverter()

    @property
    def encoding(self) -> str:
        return self.other.encoding

    def to_payload(self, value: Any) -> Payload | None:
        return (self.ours if _ours(type(value)) else self.other).to_payload(value)

    def from_payload(self, payload: Payload, type_hint: type | None = None) -> Any:
        return (self.ours if _ours(type_hint) else self.other).from_payload(payload, type_hint)


class StreamPayloadConverter(PydanticPayloadConverter):
    """Pydantic payloads (refused typed when they do not validate), and the typed refusal of
    payloads the codec could not open."""

    #: the encoding converters by encoding, made once: they hold no state of their own, and the SDK
    #: builds a payload converter for every payload whose serialization context our codec uses (a
    #: DataConverter cloned per stream id, 18 a 1-token chunk), which cost about 2 ms of one
    _shared: dict[bytes, EncodingPayloadConverter] | None = None

    def __init__(self) -> None:
        shared = type(self).__dict__.get("_shared")
        if shared is None:
            super().__init__()
            self._set_converters(*(_TypedJSONPayloadConverter() if isinstance(c, PydanticJSONPlainPayloadConverter)
                                   else c for c in self.converters.values()), SealedPayloadConverter())
            type(self)._shared = self.converters
        else:
            self.converters = shared  # never changed after it is made


#: the clear stand-in for a failure's encrypted message (Temporal's own words)
ENCODED_FAILURE = "Encoded failure"


class TypedFailureConverter(DefaultFailureConverterWithEncodedAttributes):
    """Failures' messages and stack traces travel encrypted (Temporal's encoded attributes), and
    the clear stand-in names the failure's type: `Encoded failure: UnknownRequest`.

    The type is in clear beside it anyway (`application_failure_info.type`). A refused query is
    the reason: the server hands a query's caller the failure's message and nothing else, so
    without this a refused query would reach any client as "Encoded failure", untyped. A client
    holding the key reads the real message, as before."""

    def from_failure(self, failure: Failure, payload_converter: Any) -> BaseException:
        """The failure as an exception; one whose details this keyring cannot open (another
        principal's stream, a refusal sealed under its key, a failure forged in clear) keeps its
        type, in clear anyway, and its clear stand-in for a message, without the details: the
        caller learns why it was refused, typed, and nothing else. Never raises: in a workflow, a
        failure that does not convert would fail the workflow task on every retry."""
        exc = self._from_failure(failure, payload_converter)
        # who sealed the failure (its encoded attributes, as the codec found them): a failure of a
        # stream's activity that the workers did not seal was put there by someone else
        sealer = failure.encoded_attributes.metadata.get(SEALER_KEY) if failure.HasField("encoded_attributes") \
            else None
        with contextlib.suppress(AttributeError):  # an exception type that takes no attributes
            setattr(exc, FAILURE_SEALER_ATTR, sealer.decode(errors="replace") if sealer is not None else None)
        return exc

    def _from_failure(self, failure: Failure, payload_converter: Any) -> BaseException:
        try:
            return super().from_failure(failure, payload_converter)
        except Exception:  # noqa: BLE001 - details nobody can decode here (another key, a forged failure's)
            pass
        bare = Failure()
        bare.CopyFrom(failure)
        f: Failure | None = bare
        while f is not None:
            for info in ("application_failure_info", "canceled_failure_info", "reset_workflow_failure_info"):
                if f.HasField(info):
                    getattr(f, info).ClearField("details" if info != "reset_workflow_failure_info"
                                                else "last_heartbeat_details")
            if f.HasField("timeout_failure_info"):
                f.timeout_failure_info.ClearField("last_heartbeat_details")
            f = f.cause if f.HasField("cause") else None
        try:
            return super().from_failure(bare, payload_converter)
        except Exception:  # noqa: BLE001 - a failure made to break the converter: its type and message only
            info = failure.application_failure_info if failure.HasField("application_failure_info") else None
            return ApplicationError(failure.message or "undecodable failure", type=info.type if info else None,
                                    non_retryable=info.non_retryable if info else False)

    def to_failure(self, exception: BaseException, payload_converter: Any, failure: Failure) -> None:
        super().to_failure(exception, payload_converter, failure)
        f: Failure | None = failure
        while f is not None:
            kind = f.application_failure_info.type if f.HasField("application_failure_info") else ""
            if f.message == ENCODED_FAILURE and kind:
                f.message = f"{ENCODED_FAILURE}: {kind}"
            f = f.cause if f.HasField("cause") else None
