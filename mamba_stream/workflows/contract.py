"""The workflow<->activity contract: the activities' type names, one request model in and one
result model out for each, and a chunk's identity (its content digest and update id) as the
client, the workflow and the activities each compute and check it. Public: what a worker of
another build must agree on with the workflows it serves (`mamba_stream.workflows` names them too).

Sandbox-safe (pydantic and the standard library); new fields are optional, so histories written
by an older version still decode.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Literal

from pydantic import Field

from mamba_stream.state_codec import Receipt
from mamba_stream.workflows._models import (
    _PREFIX,
    DEFAULT_PREFIX_TOKENS,
    AdvanceRequest,
    AdvanceResult,
    CancelRequest,
    CarrySeal,
    CheckpointRequest,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    ReleaseRequest,
    ResetRequest,
    RewindRequest,
    StreamCarry,
    _ActivityResult,
    _Model,
    _Token,
    open_claims,
)

__all__ = [
    "ACTIVITY_ADVANCE",
    "ACTIVITY_CHECKPOINT",
    "ACTIVITY_DISPOSE",
    "ACTIVITY_GENERATE",
    "ACTIVITY_OPEN",
    "ACTIVITY_OPEN_CARRY",
    "ACTIVITY_RECALL",
    "ACTIVITY_RESET",
    "ACTIVITY_REWIND",
    "ACTIVITY_SEAL_CARRY",
    "ACTIVITY_VERIFY",
    "AdvanceChunkRequest",
    "AdvanceChunkResult",
    "CarrySealRequest",
    "CheckpointStreamRequest",
    "DisposeStreamRequest",
    "DisposeStreamResult",
    "GenerateChunkRequest",
    "GenerateChunkResult",
    "OpenStreamRequest",
    "OpenStreamResult",
    "RecallResultRequest",
    "RecallResultResult",
    "ResetStreamRequest",
    "RewindStreamRequest",
    "StateResult",
    "VerifyRequest",
    "carry_digest",
    "chunk_digest",
    "id_digest",
    "parse_update_id",
    "update_id",
]


ACTIVITY_OPEN = "open_stream"
ACTIVITY_ADVANCE = "advance_chunk"
ACTIVITY_GENERATE = "generate_tokens"
ACTIVITY_RESET = "reset_stream"
ACTIVITY_CHECKPOINT = "checkpoint_stream"
ACTIVITY_DISPOSE = "dispose_stream"
ACTIVITY_RECALL = "recall_result"
ACTIVITY_SEAL_CARRY = "seal_carry"
ACTIVITY_OPEN_CARRY = "open_carry"
ACTIVITY_REWIND = "rewind_stream"
ACTIVITY_VERIFY = "verify_request"


class CarrySealRequest(_Model):
    """`seal_carry` (the run about to continue as new) and `open_carry` (the run it started)."""

    stream_id: str
    digest: str = Field(description="carry_digest of the carry")
    seal: CarrySeal | None = Field(default=None, description="open_carry: the seal to verify")
    continued_run_id: str | None = Field(default=None, description="open_carry: the run this one continues, "
                                         "as the server says (workflow.info().continued_run_id)")


class OpenStreamRequest(_Model):
    stream_id: str
    principal: str
    model_id: str
    input_transform: str | None = None
    resume: Receipt | None = None
    signature: str | None = None
    prefix: str | list[_Token] | None = _PREFIX
    max_prefix_tokens: int = Field(default=DEFAULT_PREFIX_TOKENS,
                                   description="StreamOptions.max_prefix_tokens, for the prefix's tokens once encoded")

    def claims(self) -> dict:
        return open_claims(self.principal, self.model_id, self.input_transform, self.resume, self.prefix)


class OpenStreamResult(_ActivityResult):
    receipt: Receipt
    info: ModelInfo
    worker_queue: str | None = None


class AdvanceChunkRequest(_Model):
    stream_id: str
    principal: str
    receipt: Receipt = Field(description="the state to advance")
    request: AdvanceRequest
    max_chunk_tokens: int = 65536
    drop_keys: list[str] = Field(default_factory=list, description="older checkpoints to delete once committed")
    update_id: str | None = Field(default=None, description="the advance update that runs it (its keyed "
                                  "content digest is checked)")


class AdvanceChunkResult(_ActivityResult):
    result: AdvanceResult
    worker_queue: str | None = None


class GenerateChunkRequest(_Model):
    stream_id: str
    principal: str
    receipt: Receipt
    request: GenerateRequest
    drop_keys: list[str] = Field(default_factory=list)
    update_id: str | None = Field(default=None, description="the generate update that runs it (a streaming "
                                  "generate names it in its progress)")
    log_offset: int | None = Field(default=None, description="the token log entry the chunk will take")


class GenerateChunkResult(_ActivityResult):
    result: GenerateResult
    worker_queue: str | None = None


class ResetStreamRequest(_Model):
    stream_id: str
    principal: str
    receipt: Receipt = Field(description="the state being replaced (for its model and chunk_seq)")
    epoch: int
    request: ResetRequest | None = Field(default=None, description="the signal's payload, for its signature")


class StateResult(_ActivityResult):
    """A receipt produced by reset or verified by checkpoint."""

    receipt: Receipt
    worker_queue: str | None = None


class CheckpointStreamRequest(_Model):
    stream_id: str
    principal: str
    receipt: Receipt
    request: CheckpointRequest | None = Field(default=None, description="the update's payload, for its signature")
    state_key: str | None = Field(default=None, description="an earlier checkpoint of the stream to hand out (its "
                                  "recorded receipt); None: the current one, `receipt`")


class RecallResultRequest(_Model):
    """The recorded result of a committed chunk, for a repeated update id carried as a digest."""

    stream_id: str
    principal: str
    state_key: str
    kind: Literal["advance", "generate"]


class RecallResultResult(_ActivityResult):
    advance: AdvanceResult | None = None
    generate: GenerateResult | None = None


class DisposeStreamRequest(_Model):
    stream_id: str


class VerifyRequest(_Model):
    """A request's signature checked by the workers (`verify_request`), for what the workflow
    decides without an activity of its own (a cancel, a release)."""

    stream_id: str
    principal: str
    kind: str
    request: CancelRequest | ReleaseRequest


class RewindStreamRequest(_Model):
    stream_id: str
    principal: str
    receipt: Receipt = Field(description="the stream's current state (for its model)")
    state_key: str = Field(description="the checkpoint to go back to")
    drop_keys: list[str] = Field(default_factory=list, description="the undone chunks' checkpoints, deleted")
    request: RewindRequest


class DisposeStreamResult(_ActivityResult):
    deleted: int
    evicted: int


def carry_digest(carry: StreamCarry) -> str:
    """sha256 of the carry's JSON, fields at their defaults left out (so a field added later with
    a default does not change the digest of a carry sealed before it)."""
    return hashlib.sha256(carry.model_dump_json(exclude_defaults=True).encode()).hexdigest()


#: request fields that decide how a chunk is shown, not what it is: left out of its digest and key
PRESENTATION = frozenset({"stream"})


def chunk_digest(kind: str, request: AdvanceRequest | GenerateRequest) -> str:
    """What a chunk asks for, hashed: its kind and signed fields (not the signature). Two requests
    with the same digest are the same chunk; the update id names it (`workflows.update_id`)."""
    claims = {k: v for k, v in request.claims().items() if k not in PRESENTATION}
    body = json.dumps({"kind": kind, **claims}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def id_digest(key: bytes, kind: str, request: AdvanceRequest | GenerateRequest) -> str:
    """The content digest an update id carries (`workflows.update_id`): `chunk_digest` keyed by
    the stream's id key (`Keyring.id_key`), so that the id says nothing of the content to anyone
    without the key."""
    return hmac.new(key, chunk_digest(kind, request).encode(), hashlib.sha256).hexdigest()[:16]


def update_id(kind: str, request: AdvanceRequest | GenerateRequest, *, epoch: int, key: bytes,
              attempt: int = 0) -> str:
    """The idempotency key of a chunk: `<kind>-<chunk_seq>-e<epoch>-<digest>[-a<attempt>]`.

    The digest is the chunk's content (`chunk_digest`) keyed by the stream's id key (`id_key`):
    update ids are in clear in history, and an unkeyed digest of a short text is a dictionary
    search away from the text. Re-sending the same chunk (same sequence, epoch and content) from
    any client of the stream's principal derives the same id and returns the first result; other
    content under the same sequence is another id, which the stream refuses as
    `ConflictingChunk` instead of answering it with the first writer's result. A signed chunk's id
    also names its signature, so a forged request refused under one id cannot take the id of the
    real one. The epoch (the stream's reset count) and `attempt` let a chunk whose update failed
    for a reason that was not its own (`workflows.NOT_THE_CHUNKS_FAULT`: a store fault, a rewind
    past the window) be sent again once the cause is gone: a failed update id keeps its failure.
    """
    uid = f"{kind}-{request.chunk_seq}-e{epoch}-{id_digest(key, kind, request)}"
    if request.signature is not None:
        uid += "-s" + hashlib.sha256(request.signature.encode()).hexdigest()[:16]
    return uid + (f"-a{attempt}" if attempt else "")


def parse_update_id(uid: str) -> tuple[str, int, int, str] | None:
    """(kind, chunk_seq, epoch, digest prefix) of an id made by `update_id`; None for any other id."""
    parts = uid.split("-")
    if len(parts) < 4 or parts[0] not in ("advance", "generate") or not parts[2].startswith("e"):
        return None
    try:
        return parts[0], int(parts[1]), int(parts[2][1:]), parts[3]
    except ValueError:
        return None
