"""Typed rejections of a state resume: each names the field and both values.

Every way a checkpoint can fail to belong to the stream, tenant, model and position it is
presented for raises a `StateRejected` subclass. `reason` is the stable machine name (used as the
Temporal `ApplicationError` type); these failures are permanent, never worth a retry.
"""

from __future__ import annotations

from typing import Any, ClassVar

__all__ = [
    "CheckpointNotFound",
    "ChecksumMismatch",
    "ChunkSequenceMismatch",
    "CorruptBlob",
    "DTypeMismatch",
    "EpochMismatch",
    "InputTransformMismatch",
    "ModelRevisionMismatch",
    "PositionMismatch",
    "PrincipalMismatch",
    "SchemaMismatch",
    "StateRejected",
    "StreamMismatch",
    "TruncatedBlob",
    "UnknownKeyId",
    "UnsupportedEnvelopeVersion",
    "RequestRejected",
    "UnsignedRequest",
    "UnknownSigner",
    "BadSignature",
    "UnsealedRequest",
    "SealerMismatch",
    "ForgedCarry",
]


class StateRejected(Exception):
    """A state, receipt or blob that must not be resumed here.

    Attributes:
        field: what differs, e.g. "principal" or "schema.discretization.rope".
        expected: the value the resume needs (the serving side's, or the receipt's).
        actual: the value that was presented.
    """

    reason: ClassVar[str] = "StateRejected"

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
    reason = "StreamMismatch"


class PrincipalMismatch(StateRejected):
    reason = "PrincipalMismatch"


class ModelRevisionMismatch(StateRejected):
    reason = "ModelRevisionMismatch"


class InputTransformMismatch(StateRejected):
    reason = "InputTransformMismatch"


class SchemaMismatch(StateRejected):
    reason = "SchemaMismatch"


class DTypeMismatch(StateRejected):
    reason = "DTypeMismatch"


class PositionMismatch(StateRejected):
    reason = "PositionMismatch"


class ChunkSequenceMismatch(StateRejected):
    reason = "ChunkSequenceMismatch"


class EpochMismatch(StateRejected):
    reason = "EpochMismatch"


class ChecksumMismatch(StateRejected):
    reason = "ChecksumMismatch"


class CheckpointNotFound(StateRejected):
    """The receipt names a checkpoint the store does not hold (for this principal)."""

    reason = "CheckpointNotFound"


class UnknownKeyId(StateRejected):
    reason = "UnknownKeyId"


class CorruptBlob(StateRejected):
    """The blob is not a well-formed envelope, or fails authentication."""

    reason = "CorruptBlob"


class TruncatedBlob(CorruptBlob):
    reason = "TruncatedBlob"


class UnsupportedEnvelopeVersion(StateRejected):
    reason = "UnsupportedEnvelopeVersion"


class RequestRejected(StateRejected):
    """A request whose signature does not prove it comes from its principal for this stream.

    Raised before the request touches any state (see `state_codec.signing`).
    """

    reason = "RequestRejected"


class UnsignedRequest(RequestRejected):
    reason = "UnsignedRequest"


class UnknownSigner(RequestRejected):
    """The worker holds no public key for the request's principal."""

    reason = "UnknownSigner"


class BadSignature(RequestRejected):
    """Malformed, made with another key, or over other bytes: tampered, or meant for another stream."""

    reason = "BadSignature"


class UnsealedRequest(RequestRejected):
    """A request in clear: not encrypted under any key of this deployment. Only a client holding
    the stream's principal's history key (or the operator) can change a stream."""

    reason = "UnsealedRequest"


class SealerMismatch(RequestRejected):
    """A request sealed under another key than the one it needs: another principal's history key
    on this stream, or the operator's where only the principal may act (feeding a stream)."""

    reason = "SealerMismatch"


class ForgedCarry(RequestRejected):
    """A start input carrying a continue-as-new carry the workers did not seal for this stream's
    previous run: a client-made carry, or one moved from another stream or run."""

    reason = "ForgedCarry"
