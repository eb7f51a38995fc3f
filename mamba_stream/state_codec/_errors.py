"""Typed rejections of a state resume: each names the field and both values.

Every way a checkpoint can fail to belong to the stream, tenant, model and position it is
presented for raises a `StateRejected` subclass. `reason` is the stable machine name (used as the
Temporal `ApplicationError` type); these failures are permanent, never worth a retry.
"""

from __future__ import annotations

from typing import Any

from mamba_stream.failures import Failure

__all__ = [
    "BadSignature",
    "CheckpointNotFound",
    "ChecksumMismatch",
    "ChunkSequenceMismatch",
    "CorruptBlob",
    "DTypeMismatch",
    "EpochMismatch",
    "ForgedCarry",
    "InputTransformMismatch",
    "ModelRevisionMismatch",
    "PositionMismatch",
    "PrincipalMismatch",
    "RequestRejected",
    "SchemaMismatch",
    "SealerMismatch",
    "SegmentMissing",
    "StateRejected",
    "StreamMismatch",
    "TruncatedBlob",
    "UnknownKeyId",
    "UnknownSigner",
    "UnsealedRequest",
    "UnsignedRequest",
    "UnsupportedEnvelopeVersion",
]


class StateRejected(Failure):
    """A state, receipt or blob that must not be resumed here.

    Attributes:
        field: what differs, e.g. "principal" or "schema.discretization.rope".
        expected: the value the resume needs (the serving side's, or the receipt's).
        actual: the value that was presented.
    """

    def __init__(self, message: str = "", *, field: str = "", expected: Any = None, actual: Any = None) -> None:
        super().__init__(message)
        self.field = field
        self.expected = expected
        self.actual = actual

    def __reduce__(self):  # keep field/expected/actual through pickling
        return (self.__class__, (self.args[0] if self.args else "",), self.__dict__)

    def details(self) -> dict[str, Any]:
        """A JSON-friendly summary for logs and Temporal failure details."""
        return {"reason": self.reason, "field": self.field, "expected": _short(self.expected),
                "actual": _short(self.actual), "message": str(self)}


def _short(v: Any) -> Any:
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v if not isinstance(v, str) or len(v) <= 200 else v[:200] + "..."
    return repr(v)[:200]


def mismatch(cls: type[StateRejected], field: str, expected: Any, actual: Any) -> StateRejected:
    """`cls` with the standard message: '<field>: expected <expected>, got <actual>'."""
    return cls(f"{field}: expected {expected!r}, got {actual!r}", field=field, expected=expected, actual=actual)


class StreamMismatch(StateRejected):
    """The receipt or blob is another stream's."""


class PrincipalMismatch(StateRejected):
    """The receipt or blob is another principal's."""


class ModelRevisionMismatch(StateRejected):
    """The state was made by another model or revision of its weights."""


class InputTransformMismatch(StateRejected):
    """The state was fed through another input transform (tokenizer)."""


class SchemaMismatch(StateRejected):
    """The state's tensors are not this model's state schema."""


class DTypeMismatch(StateRejected):
    """The state's dtype is not the one this model's state is kept in."""


class PositionMismatch(StateRejected):
    """The state is at another token position than the receipt says."""


class ChunkSequenceMismatch(StateRejected):
    """The chunk is not the one that follows the stream's last (or the receipt's)."""


class EpochMismatch(StateRejected):
    """The receipt or request is of another epoch (the stream was reset since)."""


class ChecksumMismatch(StateRejected):
    """The state's bytes are not those the receipt's checksum names."""


class CheckpointNotFound(StateRejected):
    """The receipt names a checkpoint the store does not hold (for this principal)."""


class SegmentMissing(StateRejected):
    """A checkpoint names a KV segment the store does not hold (for this principal): the
    checkpoint cannot be read whole. `expected`: the segment's store key."""


class UnknownKeyId(StateRejected):
    """The blob or payload is under a key this keyring does not hold."""


class CorruptBlob(StateRejected):
    """The blob is not a well-formed envelope, or fails authentication."""


class TruncatedBlob(CorruptBlob):
    """The blob ends before its envelope says it does."""


class UnsupportedEnvelopeVersion(StateRejected):
    """The blob's envelope is of a version this code cannot read."""


class RequestRejected(StateRejected):
    """A request whose signature does not prove it comes from its principal for this stream.

    Raised before the request touches any state (see `state_codec.signing`).
    """


class UnsignedRequest(RequestRejected):
    """A request with no signature where the worker requires one."""


class UnknownSigner(RequestRejected):
    """The worker holds no public key for the request's principal."""


class BadSignature(RequestRejected):
    """Malformed, made with another key, or over other bytes: tampered, or meant for another stream."""


class UnsealedRequest(RequestRejected):
    """A request in clear: not encrypted under any key of this deployment. Only a client holding
    the stream's principal's history key (or the operator) can change a stream."""


class SealerMismatch(RequestRejected):
    """A request sealed under another key than the one it needs: another principal's history key
    on this stream, or the operator's where only the principal may act (feeding a stream)."""


class ForgedCarry(RequestRejected):
    """A start input carrying a continue-as-new carry the workers did not seal for this stream's
    previous run: a client-made carry, or one moved from another stream or run."""
