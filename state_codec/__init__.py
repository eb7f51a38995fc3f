"""The state record: schema, receipt, typed rejections and resume validation.

This half of the package imports only the standard library and pydantic, so workflows may use it
inside Temporal's sandbox. The checkpoint codec (msgpack, AES-256-GCM, torch) is
`state_codec.codec`, imported only on the worker side.
"""

from state_codec._errors import (
    BadSignature,
    CheckpointNotFound,
    RequestRejected,
    UnknownSigner,
    UnsignedRequest,
    ChecksumMismatch,
    ChunkSequenceMismatch,
    CorruptBlob,
    DTypeMismatch,
    EpochMismatch,
    InputTransformMismatch,
    ModelRevisionMismatch,
    PositionMismatch,
    PrincipalMismatch,
    SchemaMismatch,
    StateRejected,
    StreamMismatch,
    TruncatedBlob,
    UnknownKeyId,
    UnsupportedEnvelopeVersion,
)
from state_codec._receipt import (
    RECEIPT_VERSION,
    Arithmetic,
    ModelIdentity,
    Receipt,
    arithmetic_moved,
    continue_arithmetic,
    schema_diff,
    validate_resume,
)
from state_codec._schema import SCHEMA_VERSION, Discretization, StateSchema, TensorSpec

__all__ = [
    "RECEIPT_VERSION",
    "SCHEMA_VERSION",
    "Arithmetic",
    "BadSignature",
    "CheckpointNotFound",
    "ChecksumMismatch",
    "ChunkSequenceMismatch",
    "CorruptBlob",
    "DTypeMismatch",
    "Discretization",
    "EpochMismatch",
    "InputTransformMismatch",
    "ModelIdentity",
    "ModelRevisionMismatch",
    "PositionMismatch",
    "PrincipalMismatch",
    "Receipt",
    "RequestRejected",
    "SchemaMismatch",
    "StateRejected",
    "StateSchema",
    "StreamMismatch",
    "TensorSpec",
    "TruncatedBlob",
    "UnknownKeyId",
    "UnknownSigner",
    "UnsignedRequest",
    "UnsupportedEnvelopeVersion",
    "arithmetic_moved",
    "continue_arithmetic",
    "schema_diff",
    "validate_resume",
]
