"""Response handles: what an agent framework holds between turns, sealed for one principal.

A handle names the conversation's stream and the chunk its state is at after the turn, the
chunk before the reply was generated (where a turn forks when the template renders the reply
otherwise than it was sampled), the stream's epoch and the reply as it was sampled (the next
turn renders after it). It travels through the framework as an opaque string
(`msr1.<tag>.<base64url>`): AES-256-GCM under a key derived from the principal's history key,
bound to its tag, so only the workers and that principal's own keyring open it, nobody can
forge or alter one, and one principal's handle is refused for another (`PrincipalMismatch`),
typed, before anything moves. The tag in the clear is the one the principal's stream ids
already show.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from mamba_stream.failures import InvalidRequest
from mamba_stream.state_codec import PrincipalMismatch

__all__ = ["HANDLE_PREFIX", "ResponseHandle", "open_handle", "seal_handle"]

HANDLE_PREFIX = "msr1"
_LABEL = b"mamba-stream/response-handle/v1"


class ResponseHandle(BaseModel):
    """A conversation's state after one turn (see the module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stream_id: str
    model_id: str
    epoch: int = Field(ge=0)
    seq: int = Field(ge=0, description="the chunk after which the stream holds the turn's end (its reply)")
    fed_seq: int = Field(ge=0, description="the chunk after which the stream held the turn's input, before the reply")
    reply: str = Field(description="the reply's text as sampled and fed (its end marker included)")
    digest: str = Field(default="", description="keyed digest of the conversation's messages up to this turn "
                        "(for frameworks that send the whole history: which messages this state was fed)")
    forked: bool = Field(default=False, description="the turn forked the conversation (an older handle, or a "
                         "reply the template renders otherwise than it was sampled)")


def _cipher(key: bytes) -> AESGCM:
    """The handles' key of a principal, from its streams' id key (`workflows.id_key`), which the
    workers' keyring and the principal's own derive alike, before and after a rotation."""
    return AESGCM(hmac.new(key, _LABEL, hashlib.sha256).digest())


def seal_handle(key: bytes, tag: str, handle: ResponseHandle) -> str:
    """The handle as the opaque string a framework carries (`msr1.<tag>.<base64url>`); `key`: the
    id key of the principal's streams."""
    # the nonce from the handle itself: a retried turn seals the same handle into the same id (a
    # handle names a chunk of one stream, so two different handles never share a nonce)
    plain = handle.model_dump_json().encode()
    nonce = hmac.new(key, b"nonce|" + plain, hashlib.sha256).digest()[:12]
    body = _cipher(key).encrypt(nonce, plain, _LABEL + b"|" + tag.encode())
    return f"{HANDLE_PREFIX}.{tag}.{base64.urlsafe_b64encode(nonce + body).decode().rstrip('=')}"


def open_handle(key: bytes, tag: str, text: str) -> ResponseHandle:
    """The handle `text` seals, for the principal with `tag` (`key`: its streams' id key).

    Raises:
        PrincipalMismatch: the handle is another principal's (field "previous_response_id").
        InvalidRequest: not a handle of ours, or altered (field "previous_response_id").
    """
    parts = text.split(".") if isinstance(text, str) else []
    if len(parts) != 3 or parts[0] != HANDLE_PREFIX:
        raise InvalidRequest(f"previous_response_id {str(text)[:40]!r} is not a response id of this model",
                             field="previous_response_id")
    if parts[1] != tag:
        raise PrincipalMismatch("previous_response_id is another principal's response: this conversation's "
                                "principal cannot continue it", field="previous_response_id")
    try:
        raw = base64.urlsafe_b64decode(parts[2] + "=" * (-len(parts[2]) % 4))
        plain = _cipher(key).decrypt(raw[:12], raw[12:], _LABEL + b"|" + tag.encode())
        return ResponseHandle.model_validate_json(plain)
    except (binascii.Error, ValueError, InvalidTag, ValidationError):
        raise InvalidRequest("previous_response_id does not open: altered, or sealed under keys these workers do "
                             "not hold", field="previous_response_id") from None
