"""Workflows (sandbox-safe: the standard library, temporalio, pydantic and state_codec's record).

    from workflows import ClientConfig, MambaStreamWorkflow, StreamClient
    cfg = ClientConfig()                               # address, task queue, keyring from the environment
    streams = StreamClient(client, cfg.task_queue)     # client built with MambaStreamPlugin
    sid = await streams.open("alice", "tiny-mamba2")
    result = await streams.advance(sid, "alice", text="hello")   # update id: chunk_seq, epoch, content
"""

from workflows._agent import AgentWorkflow
from workflows._client import GenerateStream, StreamClient, new_stream_id, update_id
from workflows._failures import (
    NOT_THE_CHUNKS_FAULT,
    ActivityFailed,
    ChunkTooLarge,
    ConflictingChunk,
    EmptyContext,
    InternalError,
    InvalidRequest,
    OpenFailed,
    ResultExpired,
    RewindPastWindow,
    RewindUnavailable,
    StreamCancelled,
    StreamFailure,
    StreamMoving,
    StreamOpening,
    TokenOutOfRange,
    TokensOutOfOrder,
    UpdateIdMismatch,
    application_error,
    catalogue,
)
from workflows._config import DEFAULT_TASK_QUEUE, ClientConfig
from workflows._models import (
    AdvanceRequest,
    AdvanceResult,
    AgentInput,
    AgentResult,
    CheckpointRequest,
    CheckpointResult,
    GenerateRequest,
    GenerateResult,
    ModelInfo,
    OpenStreamInput,
    ResetRequest,
    StreamOptions,
    StreamStats,
    TokenBatch,
    TokenEvent,
    TokenLogprob,
    chunk_digest,
    parse_update_id,
)
from workflows._stream import MambaStreamWorkflow

__all__ = [
    "DEFAULT_TASK_QUEUE",
    "NOT_THE_CHUNKS_FAULT",
    "ActivityFailed",
    "AdvanceRequest",
    "AdvanceResult",
    "AgentInput",
    "AgentResult",
    "AgentWorkflow",
    "CheckpointRequest",
    "CheckpointResult",
    "ChunkTooLarge",
    "ClientConfig",
    "ConflictingChunk",
    "EmptyContext",
    "GenerateRequest",
    "GenerateResult",
    "GenerateStream",
    "InternalError",
    "InvalidRequest",
    "MambaStreamWorkflow",
    "ModelInfo",
    "OpenFailed",
    "OpenStreamInput",
    "ResetRequest",
    "ResultExpired",
    "RewindPastWindow",
    "RewindUnavailable",
    "StreamCancelled",
    "StreamClient",
    "StreamFailure",
    "StreamMoving",
    "StreamOpening",
    "StreamOptions",
    "StreamStats",
    "TokenBatch",
    "TokenEvent",
    "TokenLogprob",
    "TokenOutOfRange",
    "TokensOutOfOrder",
    "UpdateIdMismatch",
    "application_error",
    "catalogue",
    "chunk_digest",
    "new_stream_id",
    "parse_update_id",
    "update_id",
]
